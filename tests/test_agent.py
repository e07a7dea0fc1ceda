"""``gpu-lease agent`` as a REAL subprocess against a REAL broker subprocess.

NVML cannot exist here: the agent gets a stand-in ``pynvml`` (``tests/fake_nvml``, first
on its ``PYTHONPATH``) that reports the GPUs and processes a JSON file declares.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import wait_for, wait_for_async
from provisioner.node.mps import MPSDaemon, MPSSupervisor
from provisioner.wire import pipe_directory

from .proven import claim, kernel_env
from .test_nodes import NodeBroker, node_state, pool

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAKE_NVML = HERE / "fake_nvml"


class Agent:
    """``python -m provisioner.node.agent`` for one node, its NVML state in a JSON file."""

    def __init__(self, broker: NodeBroker, node: str, tmp: Path, *args: str) -> None:
        self.broker = broker
        self.node = node
        self.args = args
        self.nvml_file = tmp / f"nvml-{node}.json"
        self.gpus = [
            {"uuid": f"GPU-{node}-{i}-{uuid.uuid4().hex[:8]}", "name": "T4", "memory_mb": 16384}
            for i in range(2)
        ]
        self.set_processes({})
        self.log_path = tmp / f"agent-{node}.log"
        #: seconds between heartbeats (``--interval``)
        self.interval = 0.3
        self.proc: subprocess.Popen[bytes] | None = None

    def set_processes(self, processes: dict[str, list[dict[str, int]]]) -> None:
        tmp = self.nvml_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": self.gpus, "processes": processes}))
        os.replace(tmp, self.nvml_file)

    def start(self, token_of: str | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML), str(ROOT), env.get("PYTHONPATH", "")])
        env["FAKE_NVML_FILE"] = str(self.nvml_file)
        env["GPU_LEASE_AGENT_TOKEN"] = self.broker.tokens[f"agent:{token_of or self.node}"]
        cmd = [sys.executable, "-m", "provisioner.node.agent", "--broker-url", self.broker.url]
        cmd += ["--node", self.node, "--interval", str(self.interval), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def signal(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(20)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def nb(tmp_path: Path) -> Iterator[NodeBroker]:
    b = NodeBroker(
        tmp_path,
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        ("--GPULeaseBroker.node_grace=3", "--GPULeaseBroker.reap_interval=0.2"),
    )
    with b.running(timeout=60):
        yield b


@pytest.fixture
def agents(nb: NodeBroker, tmp_path: Path) -> Iterator[dict[str, Agent]]:
    made = {node: Agent(nb, node, tmp_path) for node in ("gpu-a", "gpu-b")}
    try:
        yield made
    finally:
        for agent in made.values():
            agent.stop()


def nodes_of(nb: NodeBroker, who: str = "admin") -> dict[str, dict[str, Any]]:
    with nb.http(who) as c:
        return {n["node"]: n for n in c.get("/nodes").json()["nodes"]}


def test_two_agents_register_and_report_processes(nb: NodeBroker, agents: dict[str, Agent]) -> None:
    a, b = agents["gpu-a"], agents["gpu-b"]
    a.set_processes({a.gpus[1]["uuid"]: [{"pid": 4321, "used_mb": 700}]})
    a.start()
    b.start()
    wait_for(lambda: set(nodes_of(nb)) == {"gpu-a", "gpu-b"})
    with nb.http("alice") as u:
        gpus = pool(u)
    assert {g["uuid"] for g in a.gpus + b.gpus} <= set(gpus)
    assert gpus[a.gpus[0]["uuid"]]["node"] == "gpu-a"
    wait_for(lambda: nodes_of(nb)["gpu-a"]["usage"] != [])
    assert nodes_of(nb)["gpu-a"]["usage"] == [
        {"pid": 4321, "gpu_uuid": a.gpus[1]["uuid"], "used_mb": 700}
    ]
    assert nodes_of(nb)["gpu-b"]["usage"] == []
    # heartbeats are not logged one by one (httpx's INFO line per request is silenced)
    assert "HTTP Request:" not in a.log_path.read_text()
    assert "Registered node gpu-a" in a.log_path.read_text()


def test_killed_agent_loses_its_node_until_it_restarts(
    nb: NodeBroker, agents: dict[str, Agent]
) -> None:
    a = agents["gpu-a"]
    a.start()
    wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("state") == "up")
    assert a.signal(signal.SIGKILL) == -signal.SIGKILL
    with nb.http("alice") as u:
        wait_for(lambda: node_state(u, "gpu-a") == "lost")
        ask = {"kernel_id": "k1", "fraction": 0.25, "node": "gpu-a"}
        assert u.post("/leases", json=ask).status_code == 202  # no placement on a lost node
        a.start()
        wait_for(lambda: node_state(u, "gpu-a") == "up")
        # the node shows "up" while its registration is written; the queue is drained just
        # after, so a repeat in between still answers 202 (CI saw it once): wait for the grant
        r = wait_for(
            lambda: (x := u.post("/leases", json=ask)).status_code in (200, 201) and x,
            10,
            "the queued request to be granted on the node that came back",
        )
        assert r.json()["gpu"]["node"] == "gpu-a"
        # the restarted agent registered the same GPUs again, not a second copy
        assert sum(1 for g in pool(u).values() if g["node"] == "gpu-a") == 2


def test_clean_stop_drains_the_node(nb: NodeBroker, agents: dict[str, Agent]) -> None:
    a = agents["gpu-a"]
    a.start()
    wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("state") == "up")
    with nb.http("alice") as u:
        held = u.post("/leases", json={"kernel_id": "k1", "fraction": 0.25, "node": "gpu-a"})
        assert held.status_code == 201
        assert a.signal(signal.SIGTERM) == 0
        assert node_state(u, "gpu-a") == "drained"
        ask = {"kernel_id": "k2", "fraction": 0.25, "node": "gpu-a"}
        assert u.post("/leases", json=ask).status_code == 202
        assert u.get(f"/leases/{held.json()['id']}").json()["state"] == "active"
    assert "Drained node gpu-a" in a.log_path.read_text()


def test_agent_without_nvml_declares_its_gpus(nb: NodeBroker, tmp_path: Path) -> None:
    agent = Agent(nb, "gpu-b", tmp_path, "--gpus", "1x24576:L4")
    try:
        agent.start()
        wait_for(lambda: nodes_of(nb).get("gpu-b", {}).get("state") == "up")
        (gpu,) = nodes_of(nb)["gpu-b"]["gpus"]
        assert (gpu["name"], gpu["memory_mb"], gpu["node"]) == ("L4", 24576, "gpu-b")
        assert gpu["uuid"] not in {g["uuid"] for g in agent.gpus}  # NVML was not asked
    finally:
        agent.stop()


def test_agent_says_whether_it_can_park_and_heartbeats_either_way(
    nb: NodeBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the stand-in libcuda first on its library path the agent opens the driver's
    checkpoint API once and says so; with ``--no-park`` it says why not. Its heartbeats
    carry the parking fields to whichever broker answers (one older than parking refuses
    them once and then gets none): the usage reaches the broker either way."""
    from tests.standin_libcuda.build import build

    driver = tmp_path / "driver"
    driver.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(build(tmp_path / "lib")))
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(driver))
    a = Agent(nb, "gpu-a", tmp_path)
    b = Agent(nb, "gpu-b", tmp_path, "--no-park")
    a.set_processes({a.gpus[0]["uuid"]: [{"pid": 4321, "used_mb": 700}]})
    b.set_processes({b.gpus[1]["uuid"]: [{"pid": 4322, "used_mb": 300}]})
    try:
        a.start()
        b.start()
        wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("usage"), what="gpu-a's usage")
        wait_for(lambda: nodes_of(nb).get("gpu-b", {}).get("usage"), what="gpu-b's usage")
    finally:
        a.stop()
        b.stop()
    said = a.log_path.read_text()
    assert "Parking idle kernels: the driver offers process checkpointing (CUDA API 12090)" in (
        said
    )
    assert "Parking idle kernels: no; parking is turned off on this node (--no-park)" in (
        b.log_path.read_text()
    )
    assert not (driver / "calls.log").exists()  # no order came: the driver was not asked


def test_agent_with_another_nodes_token_is_refused(nb: NodeBroker, tmp_path: Path) -> None:
    agent = Agent(nb, "gpu-a", tmp_path)
    agent.start(token_of="gpu-b")
    assert agent.proc is not None and agent.proc.wait(30) == 1
    assert "belongs to node 'gpu-b'" in agent.log_path.read_text()
    assert nodes_of(nb) == {}


# -- per-lease usage and enforcement -------------------------------------------------------

KERNEL = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


class Kernel:
    """A real process standing for a kernel, with a child that holds GPU memory; started
    with a lease secret as a provisioner starts one (``claim``: its renewal body)."""

    def __init__(self) -> None:
        env, self.proof = kernel_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, env=env
        )
        assert self.proc.stdout is not None
        self.child = int(self.proc.stdout.readline())

    @property
    def claim(self) -> dict[str, Any]:
        return claim(self.proc.pid, self.proof)

    def child_alive(self) -> bool:
        try:
            os.kill(self.child, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{self.child}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"

    def stop(self) -> None:
        for pid in (self.child, self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


#: the broker options of the enforcement tests: a node lost after 5 s, over-use acted on
#: after 1 s with no tolerance, a reaper pass every 0.2 s
ENFORCING = (
    "--GPULeaseBroker.node_grace=5",
    "--GPULeaseBroker.overuse_grace=1",
    "--GPULeaseBroker.overuse_tolerance_mb=0",
    "--GPULeaseBroker.reap_interval=0.2",
)


def enforcing_broker(tmp_path: Path, options: tuple[str, ...] = ENFORCING) -> NodeBroker:
    """A broker on SQLite in ``tmp_path`` for the enforcement tests (start it with
    ``running``)."""
    return NodeBroker(tmp_path, f"sqlite:///{tmp_path / 'b.sqlite'}", options)


async def mps_client(pipe: str) -> asyncio.subprocess.Process:
    """A stand-in CUDA process that connects to the stand-in MPS daemon of ``pipe``, says
    ``in`` once admitted, and lives until its stdin closes."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import cupy, sys; cupy.empty(1); print('in', flush=True); sys.stdin.read()",
        env={"PYTHONPATH": str(HERE / "standin_gpu"), "CUDA_MPS_PIPE_DIRECTORY": pipe},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


@pytest.fixture
def enforcing(tmp_path: Path) -> Iterator[NodeBroker]:
    b = enforcing_broker(tmp_path)
    with b.running(timeout=60):
        yield b


def metric(text: str, name: str, has: str = "") -> float | None:
    """The value of the first sample of ``name`` whose line contains ``has`` (else None)."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and has in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("mode", ["revoke", "kill"])
def test_a_kernel_over_its_lease_is_revoked_and_one_within_is_not(
    enforcing: NodeBroker, tmp_path: Path, mode: str
) -> None:
    agent = Agent(enforcing, "gpu-a", tmp_path, "--enforce", mode)
    hog, modest = Kernel(), Kernel()
    try:
        agent.start()
        wait_for(lambda: nodes_of(enforcing).get("gpu-a", {}).get("state") == "up")
        gpu = agent.gpus[0]["uuid"]
        with enforcing.http("alice") as u:
            leases = {}
            for name, kernel in (("hog", hog), ("modest", modest)):
                ask = {"kernel_id": name, "fraction": 0.1, "gpu_uuids": [gpu]}
                r = u.post("/leases", json=ask)
                assert r.status_code == 201, r.text
                leases[name] = r.json()
                # the provisioner reports the kernel's pid in its renewals
                r = u.post(f"/leases/{r.json()['id']}/renew", json=kernel.claim)
                assert r.status_code == 200
            cap = leases["hog"]["memory_limit_mb"]  # 1126 MiB: 0.1 of 16 GiB less 512
            agent.set_processes(
                {
                    gpu: [
                        {"pid": hog.child, "used_mb": 4000},  # a child of the hog kernel
                        {"pid": modest.child, "used_mb": cap},  # at its cap: never touched
                        {"pid": 999_999, "used_mb": 300},  # nobody's
                    ]
                }
            )

            def state(name: str) -> dict[str, Any]:
                return dict(u.get(f"/leases/{leases[name]['id']}").json())

            wait_for(lambda: state("modest")["used_mb"] == cap)
            assert state("modest")["enforcement"] == f"agent-{mode}"
            wait_for(lambda: state("hog")["state"] == "revoked", timeout=30)
            reason = state("hog")["reason"]
            assert "used 3.9 GiB of GPU memory on a 1.6 GiB lease" in reason, reason
            r = u.post(f"/leases/{leases['hog']['id']}/renew", json=hog.claim)
            assert r.status_code == 410 and "3.9 GiB" in r.json()["message"]
            assert state("modest")["state"] == "active"
        metrics = httpx.get(
            f"{enforcing.url}/metrics", headers=enforcing.headers("admin"), timeout=30
        ).text
        assert 'gpu_lease_nodes{state="up"} 1.0' in metrics
        used_line = next(
            x
            for x in metrics.splitlines()
            if x.startswith("gpu_lease_gpu_used_memory_bytes") and gpu in x
        )
        assert float(used_line.split()[-1]) >= (cap + 300) * 1024 * 1024
        # per lease, and what enforcement did (the hog: revoked once; killed once in kill)
        assert metric(metrics, "gpu_lease_lease_used_memory_bytes", leases["modest"]["id"]) == (
            cap * 1024 * 1024
        )
        assert metric(metrics, "gpu_lease_unleased_gpu_processes") == 1
        assert metric(metrics, "gpu_lease_enforcement_actions_total", 'action="revoked"') == 1
        killed = metric(metrics, "gpu_lease_enforcement_actions_total", 'action="killed"')
        assert killed == (1 if mode == "kill" else None)
        top = subprocess.run(
            [sys.executable, "-m", "provisioner", "top"],
            env={
                **os.environ,
                "GPU_LEASE_URL": enforcing.url,
                "GPU_LEASE_TOKEN": enforcing.tokens["admin"],
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"{cap}/{cap} MiB" in top.stdout, top.stdout + top.stderr
        unleased = nodes_of(enforcing)["gpu-a"]["unleased"]
        assert {"pid": 999_999, "gpu_uuid": gpu, "used_mb": 300} in unleased
        if mode == "kill":
            wait_for(lambda: not hog.child_alive())
        else:
            assert hog.child_alive()
        assert modest.child_alive()
    finally:
        agent.stop()
        hog.stop()
        modest.stop()


def test_report_mode_flags_once_and_unleased_processes_die_when_asked(
    enforcing: NodeBroker, tmp_path: Path
) -> None:
    """``--enforce report``: a kernel over its lease is flagged once per episode and left
    running; ``--kill-unleased-after``: a GPU process of no lease is killed, a leased
    kernel's child never."""
    agent = Agent(enforcing, "gpu-a", tmp_path, "--enforce", "report", "--kill-unleased-after", "1")
    hog, stray = Kernel(), Kernel()
    try:
        agent.start()
        wait_for(lambda: nodes_of(enforcing).get("gpu-a", {}).get("state") == "up")
        gpu = agent.gpus[0]["uuid"]
        with enforcing.http("alice") as u:
            r = u.post("/leases", json={"kernel_id": "hog", "fraction": 0.1, "gpu_uuids": [gpu]})
            assert r.status_code == 201, r.text
            lease = r.json()
            r = u.post(f"/leases/{lease['id']}/renew", json=hog.claim)
            assert r.status_code == 200
            seen = nodes_of(enforcing)["gpu-a"]["last_seen"]
            wait_for(lambda: nodes_of(enforcing)["gpu-a"]["last_seen"] > seen)  # watch has it
            agent.set_processes(
                {
                    gpu: [
                        {"pid": hog.child, "used_mb": 4000},
                        {"pid": stray.child, "used_mb": 300},
                    ]
                }
            )

            def actions() -> float | None:
                text = httpx.get(
                    f"{enforcing.url}/metrics", headers=enforcing.headers("admin"), timeout=30
                ).text
                return metric(text, "gpu_lease_enforcement_actions_total", 'action="reported"')

            wait_for(lambda: not stray.child_alive(), 20, "the unleased process to be killed")
            wait_for(actions, 20, "the over-use to be reported")
            flagged = nodes_of(enforcing)["gpu-a"]["last_seen"]
            wait_for(lambda: nodes_of(enforcing)["gpu-a"]["last_seen"] > flagged + 1.0)
            assert actions() == 1  # once per episode, not once per heartbeat
            assert u.get(f"/leases/{lease['id']}").json()["state"] == "active"
        assert hog.child_alive()
        log = agent.log_path.read_text()
        assert f"Killed GPU process {stray.child} that belongs to no GPU lease" in log, log
        assert str(hog.child) not in log
    finally:
        agent.stop()
        hog.stop()
        stray.stop()


def test_kill_unleased_after_shorter_than_three_heartbeats_is_refused(
    nb: NodeBroker, tmp_path: Path
) -> None:
    agent = Agent(nb, "gpu-a", tmp_path, "--kill-unleased-after", "0.5")  # interval 0.3
    agent.start()
    assert agent.proc is not None and agent.proc.wait(30) == 2
    assert "--kill-unleased-after 0.5 is too short" in agent.log_path.read_text()
    assert nodes_of(nb) == {}


# -- MPS daemons (agent --mps), against a stand-in nvidia-cuda-mps-control ---------------------

FAKE_MPS = HERE / "fake_mps" / "nvidia-cuda-mps-control"


def test_agent_runs_restarts_and_stops_an_mps_daemon_per_gpu(
    nb: NodeBroker, tmp_path: Path
) -> None:
    """``--mps``: one daemon per GPU with its own pipe directory (the one an
    enforcement=mps kernel is pointed at), restarted when it dies, reported per lease,
    stopped with ``quit`` when the agent stops."""
    mps_dir = tmp_path / "mps"
    agent = Agent(
        nb, "gpu-a", tmp_path, "--mps", "--mps-dir", str(mps_dir), "--mps-control", str(FAKE_MPS)
    )
    uuids = [g["uuid"] for g in agent.gpus]

    def pid_of(gpu: str) -> int:
        path = mps_dir / gpu / "pipe" / "control.pid"
        return int(path.read_text()) if path.exists() and path.read_text() else 0

    def log_of(gpu: str) -> str:
        path = mps_dir / gpu / "log" / "control.log"
        return path.read_text() if path.exists() else ""

    try:
        agent.start()
        wait_for(
            lambda: nodes_of(nb).get("gpu-a", {}).get("mps") == dict.fromkeys(uuids, "running")
        )
        # each daemon sees its own GPU only ("running" is reported once the process is
        # spawned; the stand-in writes its pid and log a moment later)
        wait_for(
            lambda: all(pid_of(g) and f"started {pid_of(g)} for {g}" in log_of(g) for g in uuids),
            what="each daemon's start, for its own GPU",
        )
        with nb.http("alice") as u:
            r = u.post("/leases", json={"kernel_id": "k", "fraction": 0.1, "gpu_uuids": [uuids[0]]})
            assert r.status_code == 201, r.text
            assert r.json()["mps"] == "running" and r.json()["enforcement"] == "agent-report"
        first = pid_of(uuids[0])
        os.kill(first, signal.SIGKILL)  # the daemon dies: restarted
        wait_for(lambda: pid_of(uuids[0]) not in (0, first), 20, "the daemon's restart")
        assert "exited with -9; restarting" in agent.log_path.read_text()
        wait_for(lambda: nodes_of(nb)["gpu-a"]["mps"][uuids[0]] == "running")
        pids = [pid_of(g) for g in uuids]
        assert agent.signal(signal.SIGTERM) == 0
        for gpu, pid in zip(uuids, pids, strict=True):
            assert log_of(gpu).endswith("quit\n"), log_of(gpu)  # stopped with `quit`
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        agent.stop()


async def test_the_agent_learns_whom_each_gpus_mps_server_serves(tmp_path: Path) -> None:
    """``get_server_list``, ``get_client_list PID`` and the server's uid from
    /proc: the uid while the server has clients, None before the first and after the last
    (an idle server gives way to the next uid at once)."""
    daemon = MPSDaemon("GPU-x", str(tmp_path), str(FAKE_MPS))
    pipe = pipe_directory(str(tmp_path), "GPU-x")
    stop = asyncio.Event()
    running = asyncio.ensure_future(daemon.run(stop))
    client: asyncio.subprocess.Process | None = None
    try:
        await wait_for_async(Path(pipe, "clients").exists, what="the daemon's start")
        assert await daemon.server_uid() is None  # no server yet
        client = await mps_client(pipe)
        assert client.stdout is not None and client.stdin is not None
        assert await asyncio.wait_for(client.stdout.readline(), 20) == b"in\n"  # admitted
        assert await daemon.server_uid() == os.getuid()
        client.stdin.close()
        assert await asyncio.wait_for(client.wait(), 20) == 0
        for _ in range(100):  # the daemon notices the client's end within a step
            if await daemon.server_uid() is None:
                break
            await asyncio.sleep(0.05)
        assert await daemon.server_uid() is None
    finally:
        if client is not None and client.returncode is None:
            client.kill()
            await client.wait()
        stop.set()
        await running
    assert daemon.state == "down"


# -- MPS: the daemon-side memory limit ---------------------------------

#: a hostile cell: it drops the caps from its environment before CUDA starts, then pins
#: 6,000 MiB; argv[1]: what it sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT to ("" unsets it)
HOSTILE_CELL = """
import os, sys
os.environ.pop("CUPY_GPU_MEMORY_LIMIT", None)
os.environ.pop("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", None)
if sys.argv[1]:
    os.environ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = sys.argv[1]
import cupy
first = cupy.empty(1 << 20)  # CUDA starts: a client of the GPU's MPS server
try:
    big = cupy.empty(6000 * 1024 * 1024)
    print("LIFTED", flush=True)
except cupy.OutOfMemoryError as exc:
    print("CAPPED", exc, flush=True)
sys.stdin.read()
"""


def test_the_mps_daemon_holds_the_cap_when_a_kernel_unsets_or_raises_its_variable(
    nb: NodeBroker, tmp_path: Path
) -> None:
    """``--mps``: the agent sets each GPU's pinned memory limit in its MPS control daemon
    from the heartbeat answer's leases (largest lease there: 0.25 of a 16 GiB T4 holds
    4096 MiB), the default for the next server and the running server's, and re-sets them
    when leases come and go. A kernel that unsets ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (or
    raises it) before CUDA starts is still held to it by the server (the stand-in applies
    the lower of the server's and the client's, as MPS does). Before daemon-side limits the only cap
    was the variable: the same cell pinned 6,000 MiB ("LIFTED")."""
    mps_dir = tmp_path / "mps"
    agent = Agent(
        nb, "gpu-a", tmp_path, "--mps", "--mps-dir", str(mps_dir), "--mps-control", str(FAKE_MPS)
    )
    agent.gpus = agent.gpus[:1]
    agent.set_processes({})
    gpu = agent.gpus[0]["uuid"]
    pipe = pipe_directory(str(mps_dir), gpu)
    control_log = mps_dir / gpu / "log" / "control.log"
    cells: list[subprocess.Popen[str]] = []

    def control(command: str) -> str:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
        env["CUDA_MPS_LOG_DIRECTORY"] = str(control_log.parent)
        done = subprocess.run(
            [str(FAKE_MPS)], input=command + "\n", capture_output=True, text=True, env=env
        )
        return done.stdout.strip()

    def cell(limit: str) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOSTILE_CELL, limit],
            env={
                "PYTHONPATH": str(HERE / "standin_gpu"),
                "CUDA_MPS_PIPE_DIRECTORY": pipe,
                "CUDA_VISIBLE_DEVICES": gpu,
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3584M",  # as the provisioner sets it
                "CUPY_GPU_MEMORY_LIMIT": str(3584 * 1024 * 1024),
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        cells.append(proc)
        assert proc.stdout is not None
        return proc.stdout.readline().strip()

    try:
        agent.start()
        wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("mps") == {gpu: "running"}, 30)
        with nb.http("alice") as u:
            ask = {"kernel_id": "k", "fraction": 0.25, "gpu_uuids": [gpu], "mps_uid": os.getuid()}
            lease = u.post("/leases", json=ask).json()
            memory = lease["memory_limit_mb"] + 512  # cap + the default context: 4096 MiB
            assert memory == 4096
            # the provisioner's first renewal: the kernel's pid and cgroup
            renew = {"pid": os.getpid(), "cgroup": "/gpu-lease/k-mps"}
            assert u.post(f"/leases/{lease['id']}/renew", json=renew).status_code == 200
            wait_for(
                lambda: control("get_default_device_pinned_mem_limit 0") == f"{memory}M",
                20,
                "the agent's default limit in the daemon",
            )
            # the hostile cell unsets the variable, then raises it: the server's limit holds
            assert cell("").startswith("CAPPED"), control_log.read_text()
            assert cell("0=16000M").startswith("CAPPED"), control_log.read_text()
            # a careless cell's own lower variable still binds it (the lower one wins)
            assert cell("0=1000M").startswith("CAPPED")
            text = control_log.read_text()
            assert text.count(f"(pinned limit {memory} MiB)") == 2, text
            assert "(pinned limit 1000 MiB)" in text, text
            (server,) = [int(x) for x in control("get_server_list").split()]
            wait_for(
                lambda: control(f"get_device_pinned_mem_limit {server} 0") == f"{memory}M",
                20,
                "the running server's limit",
            )
            # a larger lease comes: the server's limit follows; it goes: back again
            big = u.post(
                "/leases", json={"kernel_id": "k2", "fraction": 0.5, "gpu_uuids": [gpu]}
            ).json()
            assert u.post(f"/leases/{big['id']}/renew", json={"cgroup": "/gpu-lease/k2"})
            wait_for(
                lambda: control(f"get_device_pinned_mem_limit {server} 0") == "8192M",
                20,
                "the limit of the larger lease",
            )
            assert u.delete(f"/leases/{big['id']}").status_code in (200, 204)
            wait_for(
                lambda: control(f"get_device_pinned_mem_limit {server} 0") == f"{memory}M",
                20,
                "the limit after the larger lease ended",
            )
        log = agent.log_path.read_text()
        assert f"set_default_device_pinned_mem_limit 0 {memory}M" in log, log
        assert f"MPS server {server} of GPU {gpu}" in log, log
    finally:
        for proc in cells:
            proc.kill()
            proc.communicate()  # and closes its pipes
        agent.stop()


async def test_the_mps_limits_follow_each_users_leases_in_the_answer(
    tmp_path: Path,
) -> None:
    """The heartbeat answer as the broker sends it now (each kernel with its
    ``user``, ``gpu_uuid`` and ``memory_mb``), on a stand-in daemon: the next server's
    default is the GPU's largest MPS lease; the running server (serving this test's user)
    gets that user's largest, not ``nobody``'s; when the GPU has no MPS lease any more, both drop
    to ``EMPTY_GPU_LIMIT_MB``. An older broker's answer (no memory) sets nothing."""
    supervisor = MPSSupervisor(["GPU-x"], str(tmp_path), str(FAKE_MPS))
    (daemon,) = supervisor.daemons
    stop = asyncio.Event()
    running = asyncio.ensure_future(supervisor.run(stop))
    client: asyncio.subprocess.Process | None = None

    def kernel(user: str, memory: int) -> dict[str, Any]:
        return {
            "pid": 7,
            "pid_ns": 1,
            "lease_id": f"L-{user}",
            "user": user,
            "proof": "x",
            "gpu_uuid": "GPU-x",
            "memory_mb": memory,
            "enforcement": "agent-report",
        }

    async def control(command: str) -> str:
        return (await daemon.query(command) or "").strip()

    try:
        pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
        await wait_for_async(Path(pipe, "clients").exists, what="the daemon's start")
        await supervisor.apply_limits({"kernels": [{"pid": 7, "pid_ns": 1}], "limits": []})
        assert await control("get_default_device_pinned_mem_limit 0") == "0"
        me = pwd.getpwuid(os.getuid()).pw_name
        answer = {"kernels": [kernel(me, 3000), kernel("nobody", 5000)]}
        await supervisor.apply_limits(answer)
        assert await control("get_default_device_pinned_mem_limit 0") == "5000M"
        client = await mps_client(pipe)
        assert client.stdout is not None
        assert await asyncio.wait_for(client.stdout.readline(), 20) == b"in\n"
        assert await supervisor.server_uids() == {"GPU-x": os.getuid()}
        (server,) = daemon.servers
        await supervisor.apply_limits(answer)
        assert await control(f"get_device_pinned_mem_limit {server} 0") == "3000M"
        await supervisor.apply_limits({"kernels": []})  # both leases ended
        assert await control("get_default_device_pinned_mem_limit 0") == "1M"
        assert await control(f"get_device_pinned_mem_limit {server} 0") == "1M"
    finally:
        if client is not None and client.returncode is None:
            client.kill()
            await client.wait()
        stop.set()
        await running
