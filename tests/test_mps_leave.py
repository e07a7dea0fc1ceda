"""A kernel that leaves MPS is over its cap (issue 36, item 3), with REAL processes: a
broker subprocess, the node agent subprocess with ``--mps --enforce kill`` running the
stand-in MPS control daemon (``tests/fake_mps``) on a stand-in NVML (``tests/fake_nvml``),
and an ``enforcement=mps`` kernel started as the provisioner starts one (its lease's secret
in its environment, ``tests/proven.py``; the GPU's pipe directory set), whose cells use the
stand-in CuPy (``tests/standin_gpu``: a client of the MPS daemon when the pipe directory
is set, reporting its memory to the stand-in NVML).

The attack as a student mounts it in a cell: unset ``CUDA_MPS_PIPE_DIRECTORY`` before CUDA
starts. CUDA then runs without MPS ("if the connection attempt fails, the program continues
to run as it normally would without MPS", ``man nvidia-cuda-mps-control``), so no MPS
memory limit, the daemon's included, reaches that process. Before this change the agent saw
nothing wrong while its usage stayed under the cap (nothing would stop it from growing).
Now each GPU process of a proven MPS kernel must be a client of its GPU's MPS server
(``get_client_list``); one that is not, in two consecutive samples, puts the lease over its
cap with its own reason. The pure rule is tabled in ``tests/test_proof.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import wait_for
from provisioner.wire import lease_digest, mps_covered_file, pipe_directory

from .proven import claim, kernel_env
from .test_agent import FAKE_MPS, HERE, Agent, metric, nodes_of
from .test_node_boundaries import alive
from .test_nodes import NodeBroker

pytestmark = pytest.mark.slow

#: an honest cell: CUDA starts as a client of the GPU's MPS server
HONEST = "import cupy, sys; x = cupy.empty(1 << 20); print('ON-MPS', flush=True); sys.stdin.read()"
#: the hostile cell: the pipe directory (and the variable) gone before CUDA starts, it runs
#: without MPS; 200 MiB keeps it within its cap, so only the MPS check can tell
HOSTILE = (
    "import os, sys\n"
    "os.environ.pop('CUDA_MPS_PIPE_DIRECTORY')\n"
    "os.environ.pop('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', None)\n"
    "import cupy\n"
    "x = cupy.empty(200 << 20)\n"
    "print('OUTSIDE-MPS', flush=True)\n"
    "sys.stdin.read()\n"
)
#: the kernel: runs each cell it is named on stdin as a child; prints its pid and first line
KERNEL = (
    "import subprocess, sys\n"
    f"cells = {{'honest': {HONEST!r}, 'hostile': {HOSTILE!r}}}\n"
    "running = []\n"
    "for line in sys.stdin:\n"
    "    p = subprocess.Popen([sys.executable, '-c', cells[line.strip()]],\n"
    "                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
    "    running.append(p)\n"
    "    print(p.pid, p.stdout.readline().strip(), flush=True)\n"
)


@pytest.fixture
def nb(tmp_path: Path) -> Iterator[NodeBroker]:
    b = NodeBroker(
        tmp_path,
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        (
            "--GPULeaseBroker.node_grace=5",
            "--GPULeaseBroker.overuse_grace=1",
            "--GPULeaseBroker.reap_interval=0.2",
        ),
    )
    with b.running(timeout=60):
        yield b


def beats(nb: NodeBroker, n: int) -> None:
    """Wait for ``n`` more heartbeats of gpu-a."""
    for _ in range(n):
        seen = nodes_of(nb)["gpu-a"]["last_seen"]
        wait_for(lambda s=seen: nodes_of(nb)["gpu-a"]["last_seen"] > s, 20, "a heartbeat")


def test_a_kernel_process_outside_mps_revokes_its_lease_an_mps_client_does_not(
    nb: NodeBroker, tmp_path: Path
) -> None:
    """A proven MPS kernel whose cell is an MPS client keeps its lease over many samples;
    the same kernel's cell that unset ``CUDA_MPS_PIPE_DIRECTORY`` is reported outside MPS,
    its lease revoked with that reason and (``--enforce kill``) the process killed. Before
    this change the lease stayed active (the hostile cell's 500 MiB were within the cap)."""
    mps_dir = tmp_path / "mps"
    agent = Agent(
        nb,
        "gpu-a",
        tmp_path,
        "--enforce",
        "kill",
        "--mps",
        "--mps-dir",
        str(mps_dir),
        "--mps-control",
        str(FAKE_MPS),
    )
    agent.gpus = agent.gpus[:1]
    agent.set_processes({})
    gpu = agent.gpus[0]["uuid"]
    pipe = pipe_directory(str(mps_dir), gpu)
    control_log = mps_dir / gpu / "log" / "control.log"
    env, proof = kernel_env()
    env.update(
        PYTHONPATH=str(HERE / "standin_gpu"),
        FAKE_NVML_FILE=str(agent.nvml_file),
        CUDA_VISIBLE_DEVICES=gpu,
        CUDA_MPS_PIPE_DIRECTORY=pipe,  # as the provisioner sets them for enforcement=mps
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=3584M",
    )
    kernel: subprocess.Popen[str] | None = None
    try:
        agent.start()
        wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("mps") == {gpu: "running"}, 30)
        kernel = subprocess.Popen(
            [sys.executable, "-c", KERNEL],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert kernel.stdin is not None and kernel.stdout is not None

        def run(cell: str) -> tuple[int, str]:
            assert kernel is not None and kernel.stdin is not None and kernel.stdout
            kernel.stdin.write(cell + "\n")
            kernel.stdin.flush()
            pid, said = kernel.stdout.readline().split()
            return int(pid), said

        with nb.http("alice") as u:
            ask = {"kernel_id": "k", "fraction": 0.25, "gpu_uuids": [gpu], "mps_uid": os.getuid()}
            lease = u.post("/leases", json=ask).json()
            renew = claim(kernel.pid, proof)
            assert u.post(f"/leases/{lease['id']}/renew", json=renew).status_code == 200

            def state() -> dict[str, Any]:
                return dict(u.get(f"/leases/{lease['id']}").json())

            covered = Path(mps_covered_file(str(mps_dir), gpu))
            wait_for(
                lambda: covered.exists() and lease_digest(lease["id"]) in covered.read_text(),
                20,
                "the daemon's limits to cover the lease (the provisioner waits for it)",
            )
            honest, said = run("honest")
            assert said == "ON-MPS" and f"client {honest} of uid" in control_log.read_text()
            wait_for(lambda: state()["used_mb"] > 0, 20, "the honest cell's usage on the lease")
            beats(nb, 6)  # many samples: an MPS client is never outside MPS
            assert state()["state"] == "active", state()
            assert state()["kernel_refused"] is None, state()

            hostile, said = run("hostile")
            assert said == "OUTSIDE-MPS"
            assert f"client {hostile} " not in control_log.read_text()
            wait_for(lambda: state()["state"] == "revoked", 30, "the revocation")
            reason = state()["reason"]
            assert f"a kernel process (pid {hostile}) runs on GPU" in reason, reason
            assert "outside MPS" in reason, reason
            wait_for(lambda: not alive(hostile), 20, "the process outside MPS killed")
        log = agent.log_path.read_text()
        assert f"process {hostile} " in log and "outside MPS" in log, log
        assert f"process {honest} " not in log.replace(f"GPU process {honest} ", ""), log
        assert proof not in log and proof not in nb.log_path.read_text()
        metrics = httpx.get(f"{nb.url}/metrics", headers=nb.headers("admin"), timeout=30).text
        assert metric(metrics, "gpu_lease_enforcement_actions_total", 'action="revoked"') == 1
    finally:
        if kernel is not None:
            os.killpg(kernel.pid, 9)
            kernel.communicate()
        agent.stop()
