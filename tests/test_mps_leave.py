"""A kernel that leaves MPS is over its cap, with REAL processes: a
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

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import wait_for, wait_for_async
from provisioner.node.mps import MPSSupervisor
from provisioner.wire import lease_digest, mps_covered_file, pipe_directory

from .proven import claim, kernel_env
from .test_agent import (
    ENFORCING,
    FAKE_MPS,
    HERE,
    Agent,
    enforcing_broker,
    metric,
    mps_client,
    nodes_of,
)
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
    b = enforcing_broker(tmp_path, tuple(x for x in ENFORCING if "overuse_tolerance_mb" not in x))
    with b.running(timeout=60):
        yield b


def beats(nb: NodeBroker, n: int) -> None:
    """Wait for ``n`` more heartbeats of gpu-a."""
    for _ in range(n):
        seen = nodes_of(nb)["gpu-a"]["last_seen"]
        wait_for(lambda s=seen: nodes_of(nb)["gpu-a"]["last_seen"] > s, 20, "a heartbeat")


class Scene:
    """The agent (``--mps --enforce MODE``, one GPU), a proven MPS kernel and its lease."""

    def __init__(self, nb: NodeBroker, tmp_path: Path, enforce: str) -> None:
        self.nb = nb
        self.mps_dir = tmp_path / "mps"
        self.agent = Agent(nb, "gpu-a", tmp_path, "--enforce", enforce, "--mps")
        self.agent.args += ("--mps-dir", str(self.mps_dir), "--mps-control", str(FAKE_MPS))
        self.agent.gpus = self.agent.gpus[:1]
        self.agent.set_processes({})
        self.gpu = self.agent.gpus[0]["uuid"]
        self.control_log = self.mps_dir / self.gpu / "log" / "control.log"
        self.env, self.proof = kernel_env()
        self.env.update(
            PYTHONPATH=str(HERE / "standin_gpu"),
            FAKE_NVML_FILE=str(self.agent.nvml_file),
            CUDA_VISIBLE_DEVICES=self.gpu,
            # as the provisioner sets them for enforcement=mps
            CUDA_MPS_PIPE_DIRECTORY=pipe_directory(str(self.mps_dir), self.gpu),
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=3584M",
        )
        self.kernel: subprocess.Popen[str] | None = None
        self.lease: dict[str, Any] = {}

    def start(self, u: httpx.Client) -> None:
        """The agent, the kernel and its lease (renewed with the kernel's proof), once the
        daemon's limits cover the lease (the provisioner waits for that)."""
        self.agent.start()
        wait_for(lambda: nodes_of(self.nb).get("gpu-a", {}).get("mps") == {self.gpu: "running"})
        self.kernel = subprocess.Popen(
            [sys.executable, "-c", KERNEL],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ask = {"kernel_id": "k", "fraction": 0.25, "gpu_uuids": [self.gpu], "mps_uid": os.getuid()}
        self.lease = u.post("/leases", json=ask).json()
        renew = claim(self.kernel.pid, self.proof)
        assert u.post(f"/leases/{self.lease['id']}/renew", json=renew).status_code == 200
        covered = Path(mps_covered_file(str(self.mps_dir), self.gpu))
        digest = lease_digest(self.lease["id"])
        wait_for(lambda: covered.exists() and digest in covered.read_text(), 20, "covered")

    def run(self, cell: str) -> tuple[int, str]:
        """Run ``cell`` (``honest`` or ``hostile``) in the kernel: its pid, first line."""
        assert self.kernel is not None and self.kernel.stdin and self.kernel.stdout
        self.kernel.stdin.write(cell + "\n")
        self.kernel.stdin.flush()
        pid, said = self.kernel.stdout.readline().split()
        return int(pid), said

    def stop(self) -> None:
        if self.kernel is not None:
            os.killpg(self.kernel.pid, 9)
            self.kernel.communicate()
        self.agent.stop()


def test_a_kernel_process_outside_mps_revokes_its_lease_an_mps_client_does_not(
    nb: NodeBroker, tmp_path: Path
) -> None:
    """A proven MPS kernel whose cell is an MPS client keeps its lease over many samples;
    the same kernel's cell that unset ``CUDA_MPS_PIPE_DIRECTORY`` is reported outside MPS,
    its lease revoked with that reason and (``--enforce kill``) the process killed. Before
    this change the lease stayed active (the hostile cell's 500 MiB were within the cap)."""
    scene = Scene(nb, tmp_path, "kill")
    try:
        with nb.http("alice") as u:
            scene.start(u)

            def state() -> dict[str, Any]:
                return dict(u.get(f"/leases/{scene.lease['id']}").json())

            honest, said = scene.run("honest")
            assert said == "ON-MPS" and f"client {honest} of uid" in scene.control_log.read_text()
            wait_for(lambda: state()["used_mb"] > 0, 20, "the honest cell's usage on the lease")
            beats(nb, 6)  # many samples: an MPS client is never outside MPS
            assert state()["state"] == "active", state()
            assert state()["kernel_refused"] is None, state()

            hostile, said = scene.run("hostile")
            assert said == "OUTSIDE-MPS"
            assert f"client {hostile} " not in scene.control_log.read_text()
            wait_for(lambda: state()["state"] == "revoked", 30, "the revocation")
            reason = state()["reason"]
            assert f"a kernel process (pid {hostile}) runs on GPU" in reason, reason
            assert "outside MPS" in reason, reason
            wait_for(lambda: not alive(hostile), 20, "the process outside MPS killed")
        log = scene.agent.log_path.read_text()
        assert f"process {hostile} " in log and "outside MPS" in log, log
        assert f"process {honest} " not in log.replace(f"GPU process {honest} ", ""), log
        assert scene.proof not in log and scene.proof not in nb.log_path.read_text()
        metrics = httpx.get(f"{nb.url}/metrics", headers=nb.headers("admin"), timeout=30).text
        assert metric(metrics, "gpu_lease_enforcement_actions_total", 'action="revoked"') == 1
    finally:
        scene.stop()


#: the last commit whose broker knows proofs and ``escaped`` but not ``left_mps``
BEFORE_LEFT_MPS = "4722170"


@pytest.fixture
def older_nb(tmp_path: Path) -> Iterator[NodeBroker]:
    """A real broker from the tree of :data:`BEFORE_LEFT_MPS` (``git archive``)."""
    tree = tmp_path / "older"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", BEFORE_LEFT_MPS, "provisioner"],
        capture_output=True,
    )
    if archive.returncode != 0:
        pytest.skip(f"no git history with {BEFORE_LEFT_MPS} here (a shallow clone?)")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    b = NodeBroker(
        tmp_path,
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        ("--GPULeaseBroker.overuse_grace=1", "--GPULeaseBroker.reap_interval=0.2"),
    )
    b.source = tree
    with b.running(timeout=60):
        yield b


def test_an_older_broker_is_told_a_process_outside_mps_as_escaped(
    older_nb: NodeBroker, tmp_path: Path
) -> None:
    """A broker older than ``left_mps`` refuses the field; the agent says so once and
    reports those pids as ``escaped``: the lease is over its cap all the same (revoked
    under ``--enforce revoke``, with the older broker's cgroup reason)."""
    scene = Scene(older_nb, tmp_path, "revoke")
    try:
        with older_nb.http("alice") as u:
            scene.start(u)
            hostile, said = scene.run("hostile")
            assert said == "OUTSIDE-MPS"

            def state() -> dict[str, Any]:
                return dict(u.get(f"/leases/{scene.lease['id']}").json())

            wait_for(lambda: state()["state"] == "revoked", 30, "the revocation")
            assert f"a kernel process (pid {hostile}) left the kernel's cgroup" in state()["reason"]
        log = scene.agent.log_path.read_text()
        assert log.count("The broker is older than kernels outside MPS") == 1, log
        assert "older than proven kernels" not in log, log
    finally:
        scene.stop()


async def test_the_daemons_client_list_counts_only_where_the_agent_can_read_it(
    tmp_path: Path,
) -> None:
    """A stand-in daemon and one client: :meth:`MPSDaemon.server_uid` keeps every server's
    client pids. Where a listed client is no process of the server's uid in the agent's
    ``/proc`` (here a made-up, empty one: as if the daemon numbered pids in another pid
    namespace), the list is not understood and judges no one (None), so an honest kernel
    is never revoked for it; a daemon that is down judges no one either."""
    supervisor = MPSSupervisor(["GPU-x"], str(tmp_path), str(FAKE_MPS))
    (daemon,) = supervisor.daemons
    stop = asyncio.Event()
    running = asyncio.ensure_future(supervisor.run(stop))
    client: asyncio.subprocess.Process | None = None
    try:
        pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
        await wait_for_async(Path(pipe, "clients").exists, what="the daemon's start")
        assert await supervisor.server_uids() == {"GPU-x": None}
        assert supervisor.clients() == {"GPU-x": frozenset()}  # no server: no client
        client = await mps_client(pipe)
        assert client.stdout is not None
        assert await asyncio.wait_for(client.stdout.readline(), 20) == b"in\n"
        assert await supervisor.server_uids() == {"GPU-x": os.getuid()}
        assert supervisor.clients() == {"GPU-x": frozenset({client.pid})}
        (tmp_path / "proc").mkdir()
        await daemon.server_uid(proc=str(tmp_path / "proc"))
        assert daemon.clients is None
    finally:
        if client is not None and client.returncode is None:
            client.kill()
            await client.wait()
        stop.set()
        await running
    assert supervisor.clients() == {"GPU-x": None}  # down
