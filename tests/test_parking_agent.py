"""The node agent's side of parking (provisioner/node/parking.py) on the stand-ins.

The driver is the stand-in libcuda (tests/standin_libcuda, built with cc, its state per pid
in files), NVML the stand-in pynvml (tests/fake_nvml, a JSON file; a process the stand-in
driver holds CHECKPOINTED shows 0 MiB). The kernels are real processes: ``sh`` standing
for the kernel with a ``sleep`` child, both GPU processes. The Parker is driven exactly as
the agent drives it: orders in (``take``), outcomes out (``outcomes``/``delivered``).
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from provisioner import inventory
from provisioner.devtools.testing import wait_for, wait_for_async
from provisioner.model import GPU
from provisioner.node.agent import nvml_free_mb
from provisioner.node.checkpoint import CudaCheckpoint, ProcessState, open_checkpoint
from provisioner.node.parking import Order, Parker, descendants, host_pid
from provisioner.node.pidns import pid_ns_of
from tests.standin_libcuda.build import build

from .proven import claim, kernel_env
from .test_agent import Agent, nodes_of
from .test_nodes import NodeBroker

pytestmark = pytest.mark.slow  # builds a C library and starts processes

HERE = Path(__file__).resolve().parent
GPU_A = "GPU-park-a"
GPU_B = "GPU-park-b"
TOTAL_MB = 16384


def _fake_nvml() -> ModuleType:
    """The stand-in pynvml loaded under its own name (the real binding may be installed)."""
    spec = importlib.util.spec_from_file_location("fake_pynvml", HERE / "fake_nvml" / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NVML = _fake_nvml()
GPUS = [GPU(GPU_A, "node", "T4", TOTAL_MB, 0), GPU(GPU_B, "node", "T4", TOTAL_MB, 1)]


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("libcuda"))


@pytest.fixture(scope="module")
def old_libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("libcuda-old"), checkpoint=False)


class Node:
    """One node's stand-ins: the driver's state folder, NVML's file, /proc/meminfo's."""

    def __init__(self, tmp: Path, libdir: Path) -> None:
        self.driver = tmp / "driver"
        self.driver.mkdir()
        self.library = str(libdir / "libcuda.so.1")
        self.nvml_file = tmp / "nvml.json"
        self.meminfo = tmp / "meminfo"
        self.host_available_mb(64 * 1024)
        self.processes: dict[str, list[dict[str, int]]] = {}
        self.write()

    def write(self) -> None:
        gpus = [{"uuid": g.uuid, "name": g.name, "memory_mb": g.memory_mb} for g in GPUS]
        tmp = self.nvml_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": gpus, "processes": self.processes}))
        os.replace(tmp, self.nvml_file)

    def gpu_process(self, uuid: str, pid: int, used_mb: int) -> None:
        self.processes.setdefault(uuid, []).append({"pid": pid, "used_mb": used_mb})
        self.write()

    def drop_process(self, pid: int) -> None:
        self.processes = {u: [p for p in ps if p["pid"] != pid] for u, ps in self.processes.items()}
        self.write()

    def host_available_mb(self, mb: int) -> None:
        self.meminfo.write_text(f"MemTotal: {2 * mb * 1024} kB\nMemAvailable: {mb * 1024} kB\n")

    def calls(self) -> list[str]:
        log = self.driver / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def used(self) -> dict[int, int]:
        return {pid: mb for pid, _, mb in inventory.running_processes(NVML)}

    def parker(self, library: str | None = None, reserve_mb: int = 2048) -> Parker:
        """A Parker as the agent opens it: one handle, the agent's NVML free memory."""
        handle, verdict = open_checkpoint(library or self.library)
        return Parker(
            handle,
            verdict.reason,
            lambda: inventory.running_processes(NVML),
            nvml_free_mb(NVML, GPUS),
            host_reserve_mb=reserve_mb,
            meminfo=str(self.meminfo),
        )


@pytest.fixture
def node(tmp_path: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    made = Node(tmp_path, libdir)
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(made.driver))
    monkeypatch.setenv("FAKE_NVML_FILE", str(made.nvml_file))
    return made


class Kernel:
    """``sh`` (the kernel) with one ``sleep`` child: both hold GPU memory. Started with a
    lease secret, as a provisioner starts a kernel (``proof``: what its renewals send)."""

    def __init__(self) -> None:
        env, self.proof = kernel_env()
        self.proc = subprocess.Popen(
            ["sh", "-c", "sleep 120 & echo $!; wait"], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        self.pid = self.proc.pid
        self.child = int(self.proc.stdout.readline())
        self.proc.stdout.close()

    def stop(self) -> None:
        for pid in (self.child, self.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture
def kernel(node: Node) -> Iterator[Kernel]:
    k = Kernel()
    node.gpu_process(GPU_A, k.pid, 1000)
    node.gpu_process(GPU_A, k.child, 500)
    try:
        yield k
    finally:
        k.stop()


def order(action: str, kernel: Kernel | None, lease: str = "lease-0001", **more: Any) -> dict:
    return {
        "lease_id": lease,
        "action": action,
        "pid": kernel.pid if kernel else None,
        "pid_ns": None,
        "gpu_uuid": GPU_A,
        "memory_mb": 4096,
        **more,
    }


async def settle(parker: Parker, raw: dict[str, Any]) -> dict[str, Any]:
    """Give ``raw`` to the parker as a heartbeat answer does; its outcome, once delivered."""
    parker.take([raw])

    def outcome() -> dict[str, Any] | None:
        if raw["lease_id"] in parker._busy:
            return None
        mine = [o for o in parker.outcomes() if o["lease_id"] == raw["lease_id"]]
        return mine[0] if mine else None

    got: dict[str, Any] = await wait_for_async(outcome, 20, f"the {raw['action']} outcome")
    parker.delivered([got])
    return got


def state(node: Node, pid: int) -> ProcessState:
    return CudaCheckpoint(node.library).state(pid)


async def test_park_then_resume_a_kernel_and_its_child(node: Node, kernel: Kernel) -> None:
    parker = node.parker()
    assert parker.supported
    try:
        parked = await settle(parker, order("park", kernel))
        assert parked["outcome"] == "done", parked
        assert parked["pids"] == sorted([kernel.pid, kernel.child])
        assert parked["mb"] == 1500 and parked["seconds"] >= 0
        assert parked["action"] == "park" and "message" not in parked
        assert state(node, kernel.pid) is state(node, kernel.child) is ProcessState.CHECKPOINTED
        assert node.used() == {kernel.pid: 0, kernel.child: 0}  # off the GPU
        assert NVML.nvmlDeviceGetMemoryInfo(0).free == TOTAL_MB * 2**20

        calls = len(node.calls())
        again = await settle(parker, order("park", kernel))  # the broker repeats it
        assert again["outcome"] == "done" and again["mb"] == 1500
        assert len(node.calls()) == calls  # no second checkpoint

        resumed = await settle(parker, order("resume", kernel))
        assert resumed["outcome"] == "done", resumed
        assert resumed["pids"] == sorted([kernel.pid, kernel.child])
        assert resumed["mb"] == 1500
        assert state(node, kernel.pid) is state(node, kernel.child) is ProcessState.RUNNING
        assert node.used() == {kernel.pid: 1000, kernel.child: 500}
        steps = [line.split()[0] for line in node.calls()]
        assert steps.count("cuCheckpointProcessCheckpoint") == 2
        assert steps.count("cuCheckpointProcessRestore") == 2

        calls = len(node.calls())
        assert (await settle(parker, order("resume", kernel)))["outcome"] == "done"
        assert len(node.calls()) == calls  # resume of running processes: nothing to do
    finally:
        await parker.close()


async def test_a_failed_checkpoint_is_reported_and_the_kernel_runs_on(
    node: Node, kernel: Kernel
) -> None:
    (node.driver / "fail-checkpoint").write_text("")
    parker = node.parker()
    try:
        failed = await settle(parker, order("park", kernel))
    finally:
        await parker.close()
    assert failed["outcome"] == "failed"
    said = failed["message"]
    assert said.startswith("cuCheckpointProcessCheckpoint of process"), failed
    assert said.count("cuCheckpointProcessCheckpoint") == 1, failed  # named once
    assert "now LOCKED" not in said and "was unlocked" in said, failed  # no stale state
    assert "CUDA_ERROR_UNKNOWN" in failed["message"]
    assert state(node, kernel.pid) is state(node, kernel.child) is ProcessState.RUNNING
    assert node.calls()[-1].startswith("cuCheckpointProcessUnlock")
    assert node.used() == {kernel.pid: 1000, kernel.child: 500}


async def test_park_is_refused_when_host_memory_cannot_hold_the_gpu_memory(
    node: Node, kernel: Kernel
) -> None:
    node.host_available_mb(3000)  # less the 2048 MiB reserve: 952 MiB < 1500 MiB
    parker = node.parker()
    try:
        refused = await settle(parker, order("park", kernel))
        assert refused["outcome"] == "failed"
        assert "3000 MiB of host memory" in refused["message"], refused
        assert "2048 MiB in reserve" in refused["message"] and "1500 MiB" in refused["message"]
        assert node.calls() == []  # the driver was never asked
        assert state(node, kernel.pid) is ProcessState.RUNNING

        node.host_available_mb(3600)  # 1552 MiB over the reserve: it fits
        assert (await settle(parker, order("park", kernel, lease="lease-0002")))[
            "outcome"
        ] == "done"
    finally:
        await parker.close()


async def test_resume_waits_while_another_process_holds_the_gpu_memory(
    node: Node, kernel: Kernel
) -> None:
    parker = node.parker()
    try:
        assert (await settle(parker, order("park", kernel)))["outcome"] == "done"
        squatter = os.getpid()  # any live pid outside the kernel: an unleased process
        node.gpu_process(GPU_A, squatter, TOTAL_MB - 1000)
        waiting = await settle(parker, order("resume", kernel))
        assert waiting["outcome"] == "waiting", waiting
        assert "1000 MiB" in waiting["message"] and "1500 MiB" in waiting["message"]
        assert GPU_A in waiting["message"]
        again = await settle(parker, order("resume", kernel))  # repeated: still waiting
        assert again["outcome"] == "waiting"
        assert not [c for c in node.calls() if c.startswith("cuCheckpointProcessRestore")]
        assert state(node, kernel.pid) is ProcessState.CHECKPOINTED

        node.drop_process(squatter)
        done = await settle(parker, order("resume", kernel))
        assert done["outcome"] == "done", done
        assert state(node, kernel.pid) is state(node, kernel.child) is ProcessState.RUNNING
    finally:
        await parker.close()


async def test_a_restarted_agent_resumes_a_kernel_parked_before(node: Node, kernel: Kernel) -> None:
    """The new Parker knows nothing: it walks the kernel's descendants in /proc, asks the
    driver, and checks the order's memory_mb is free."""
    old = node.parker()
    try:
        assert (await settle(old, order("park", kernel)))["outcome"] == "done"
    finally:
        await old.close()
    assert descendants(kernel.pid) == [kernel.child]
    new = node.parker()
    try:
        node.gpu_process(GPU_A, os.getpid(), TOTAL_MB - 4000)  # 4000 MiB free < memory_mb
        waiting = await settle(new, order("resume", kernel, memory_mb=4096))
        assert waiting["outcome"] == "waiting" and "4096 MiB" in waiting["message"]
        node.drop_process(os.getpid())
        ns = pid_ns_of(kernel.pid)  # named as a namespaced provisioner names it
        assert host_pid(kernel.pid, ns) == kernel.pid
        resumed = await settle(new, order("resume", kernel, pid_ns=ns, memory_mb=4096))
    finally:
        await new.close()
    assert resumed["outcome"] == "done", resumed
    assert resumed["pids"] == sorted([kernel.pid, kernel.child])
    assert state(node, kernel.pid) is state(node, kernel.child) is ProcessState.RUNNING


async def test_a_kernel_without_gpu_processes_parks_trivially(node: Node) -> None:
    k = Kernel()  # not in NVML's list
    parker = node.parker()
    try:
        parked = await settle(parker, order("park", k))
        assert parked["outcome"] == "done" and parked["pids"] == [] and parked["mb"] == 0
        assert (await settle(parker, order("resume", k)))["outcome"] == "done"
        no_pid = await settle(parker, order("park", None, lease="lease-0003"))
        assert no_pid["outcome"] == "failed" and "pid" in no_pid["message"]
    finally:
        await parker.close()
        k.stop()
    gone = node.parker()
    try:  # the kernel's process has ended: nothing to resume, said so
        lost = await settle(gone, order("resume", k))
    finally:
        await gone.close()
    assert lost["outcome"] == "failed" and "gone" in lost["message"]
    assert node.calls() == []


async def test_without_the_checkpoint_api_orders_fail_with_why(
    node: Node, kernel: Kernel, old_libdir: Path, tmp_path: Path
) -> None:
    for library, says in [
        (str(old_libdir / "libcuda.so.1"), "driver 570 or later"),
        (str(tmp_path / "nowhere" / "libcuda.so.1"), "could not be loaded"),
    ]:
        parker = node.parker(library)
        assert not parker.supported
        try:
            for action in ("park", "resume"):
                got = await settle(parker, order(action, kernel))
                assert got["outcome"] == "failed", got
                assert "this node cannot park" in got["message"] and says in got["message"]
        finally:
            await parker.close()
    assert node.calls() == []
    assert node.used() == {kernel.pid: 1000, kernel.child: 500}


async def test_outcomes_are_kept_until_a_heartbeat_delivers_them(
    node: Node, kernel: Kernel
) -> None:
    """A beat that failed (broker down) sends the same outcomes again; a settled order
    repeated meanwhile is not run twice; unreadable orders are ignored."""
    parker = node.parker()
    try:
        parker.take([{"action": "park"}, {"lease_id": "x", "action": "dance"}, "nonsense"])
        assert parker.outcomes() == [] and not parker._busy
        parker.take([order("park", kernel)])
        await wait_for_async(lambda: parker.ready.is_set(), 20, "the park's outcome")
        first = parker.outcomes()
        assert [o["outcome"] for o in first] == ["done"]
        calls = len(node.calls())
        parker.take([order("park", kernel)])  # its outcome is not delivered yet
        assert not parker._busy and len(node.calls()) == calls
        assert parker.outcomes() == first  # the beat failed: the same again
        parker.delivered(first)
        assert parker.outcomes() == []
    finally:
        await parker.close()


def test_orders_parse_as_the_wire_says() -> None:
    got = Order.parse(
        {"lease_id": "abc", "action": "resume", "pid": 7, "pid_ns": 4026531836,
         "gpu_uuid": GPU_A, "memory_mb": 2048}
    )  # fmt: skip
    assert got == Order("abc", "resume", 7, 4026531836, GPU_A, 2048)
    assert Order.parse({"lease_id": "abc", "action": "park", "pid": None, "pid_ns": None}) == (
        Order("abc", "park", None, None, "", 0)
    )
    assert Order.parse({"lease_id": "abc", "action": "evict"}) is None


# -- the agent as a process, against a real broker ---------------------------------------


@contextlib.contextmanager
def parking_broker(tmp_path: Path, node_grace: float) -> Iterator[NodeBroker]:
    """A broker that parks idle leases (idle after 0.5 s, reaper every 0.2 s) and keeps a
    silent node up for ``node_grace`` s."""
    b = NodeBroker(
        tmp_path,
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        (
            "--gpus",
            "agents",
            "--GPULeaseBroker.reap_interval=0.2",
            "--GPULeaseBroker.idle_reclaim_after=0.5",
            f"--GPULeaseBroker.node_grace={node_grace:g}",
        ),
    )
    with b.running(timeout=60):
        yield b


@pytest.fixture
def park_broker(tmp_path: Path) -> Iterator[NodeBroker]:
    with parking_broker(tmp_path, node_grace=5) as b:
        yield b


def test_an_agent_parks_and_resumes_a_kernel_the_broker_orders(
    park_broker: NodeBroker,
    tmp_path: Path,
    libdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``gpu-lease agent`` with the stand-in driver: alice's idle kernel (and its child) is
    parked for bob, resumed when bob leaves, after the GPU memory an unleased process took
    is free again; the driver restores nothing while it is not."""
    driver = tmp_path / "driver"
    driver.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(libdir))
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(driver))
    agent = Agent(park_broker, "gpu-a", tmp_path)
    agent.gpus = agent.gpus[:1]  # one GPU: bob and alice want the same one
    gpu = agent.gpus[0]["uuid"]
    k = Kernel()
    processes = {gpu: [{"pid": k.pid, "used_mb": 1000}, {"pid": k.child, "used_mb": 500}]}
    agent.set_processes(processes)
    calls = driver / "calls.log"
    monkeypatch.setenv("FAKE_NVML_FILE", str(agent.nvml_file))
    alice, bob = park_broker.http("alice"), park_broker.http("bob")
    try:
        agent.start()
        wait_for(lambda: nodes_of(park_broker).get("gpu-a", {}).get("state") == "up")
        r = alice.post("/leases", json={"kernel_id": "k1", "fraction": 1.0})
        assert r.status_code == 201, r.text
        lease = r.json()["id"]
        idle = claim(k.pid, k.proof, execution_state="idle")
        r = alice.post(f"/leases/{lease}/renew", json=idle)
        assert r.status_code == 200, r.text

        def state() -> str:
            return str(alice.get(f"/leases/{lease}").json()["state"])

        def log() -> str:
            return agent.log_path.read_text()

        wait_for(lambda: alice.get(f"/leases/{lease}").json()["used_mb"] == 1500)
        assert bob.post("/leases", json={"kernel_id": "k2", "fraction": 1.0}).status_code == 202
        wait_for(lambda: state() == "parked", 20, "alice's lease parked", detail=log)
        checkpointed = CudaCheckpoint(str(libdir / "libcuda.so.1"))
        assert checkpointed.state(k.pid) is checkpointed.state(k.child) is ProcessState.CHECKPOINTED
        assert f"Parked lease {lease[:6]}: pids {k.pid} {k.child}, 1500 MiB in" in log()
        r = bob.post("/leases", json={"kernel_id": "k2", "fraction": 1.0})
        assert r.status_code == 200, r.text  # the park freed the GPU for bob
        r = bob.post(f"/leases/{r.json()['id']}/renew", json={"execution_state": "busy"})
        assert r.status_code == 200

        assert alice.post(f"/leases/{lease}/resume", json={}).status_code == 202
        squatter = os.getpid()  # an unleased process takes all but 1000 MiB of the GPU
        agent.set_processes({gpu: [*processes[gpu], {"pid": squatter, "used_mb": 15384}]})
        assert bob.delete(f"/leases/{r.json()['id']}").status_code == 204
        wait_for(lambda: "waits: GPU" in log(), 20, "the resume to wait", detail=log)
        assert state() == "resuming"
        assert "cuCheckpointProcessRestore" not in calls.read_text()
        agent.set_processes(processes)  # the squatter is gone
        wait_for(lambda: state() == "active", 20, "alice's lease resumed", detail=log)
        assert checkpointed.state(k.pid) is checkpointed.state(k.child) is ProcessState.RUNNING
        assert f"Resumed lease {lease[:6]}: pids {k.pid} {k.child}, 1500 MiB in" in log()
        steps = [line.split()[0] for line in calls.read_text().splitlines()]
        assert steps.count("cuCheckpointProcessCheckpoint") == 2
        assert steps.count("cuCheckpointProcessRestore") == 2
        assert "older than parking" not in log()
    finally:
        alice.close()
        bob.close()
        agent.stop()
        k.stop()


# -- orders as they arise: the agent's long-poll ------------------------------------------


class OlderBrokerFront:
    """A reverse proxy on loopback in front of the broker that answers the orders long-poll
    with ``status`` (404: a broker older than it, whose answer it copies; 405: a proxy that
    takes no GET there) and relays everything else, so the agent meets a broker without
    the long-poll. ``orders_asked`` counts the long-polls it refused."""

    def __init__(self, target: str, status: int) -> None:
        self.orders_asked = 0
        front = self

        class Relay(http.server.BaseHTTPRequestHandler):
            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.path.split("?")[0].endswith("/orders"):
                    front.orders_asked += 1
                    path = self.path.split("?")[0]
                    code = "not_found" if status == 404 else "method_not_allowed"
                    self.answer(
                        status,
                        json.dumps({"error": code, "message": f"no {path} here"}).encode(),
                    )
                    return
                keep = ("authorization", "content-type")
                headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
                r = httpx.request(
                    self.command, target + self.path, headers=headers, content=body, timeout=30
                )
                self.answer(r.status_code, r.content)

            def answer(self, code: int, content: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = relay

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def slow_beat_broker(tmp_path: Path) -> Iterator[NodeBroker]:
    """:func:`parking_broker` keeping a node up for 120 s without a heartbeat (its agents
    beat every 30 s)."""
    with parking_broker(tmp_path, node_grace=120) as b:
        yield b


def _park_for_bob(broker: NodeBroker, agent: Agent, k: Kernel, within: float) -> tuple[float, str]:
    """alice's idle kernel on the agent's one GPU; bob asks for the GPU (his request waits
    until her kernel is idle long enough): the seconds until alice's lease is parked (at
    most ``within``) and her lease id."""
    alice, bob = broker.http("alice"), broker.http("bob")
    try:
        r = alice.post("/leases", json={"kernel_id": "k1", "fraction": 1.0})
        assert r.status_code == 201, r.text
        lease = r.json()["id"]
        r = alice.post(f"/leases/{lease}/renew", json=claim(k.pid, k.proof, execution_state="idle"))
        assert r.status_code == 200, r.text
        asked = time.monotonic()
        assert bob.post("/leases", json={"kernel_id": "k2", "fraction": 1.0}).status_code == 202
        wait_for(
            lambda: alice.get(f"/leases/{lease}").json()["state"] == "parked",
            within,
            "alice's lease parked",
            interval=0.05,
            detail=lambda: agent.log_path.read_text(),
        )
        return time.monotonic() - asked, lease
    finally:
        alice.close()
        bob.close()


def _wait_for_the_gpu(broker: NodeBroker, agent: Agent) -> None:
    """Until the agent's GPU is in the pool (a node is listed as soon as it registers,
    its GPUs a moment later)."""
    with broker.http("admin") as admin:
        wait_for(
            lambda: agent.gpus[0]["uuid"] in {g["uuid"] for g in admin.get("/gpus").json()["gpus"]},
            20,
            "the agent's GPU in the pool",
        )


def _agent_on_one_gpu(
    broker: NodeBroker,
    tmp_path: Path,
    libdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    interval: float,
) -> tuple[Agent, Kernel]:
    driver = tmp_path / "driver"
    driver.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(libdir))
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(driver))
    agent = Agent(broker, "gpu-a", tmp_path)
    agent.interval = interval
    # one GPU of 4 GiB: the broker parks a kernel whose usage no beat has reported yet
    # (its lease's reservation counts then) where the host's memory holds it
    agent.gpus = [{**agent.gpus[0], "memory_mb": 4096}]
    k = Kernel()
    gpu = agent.gpus[0]["uuid"]
    agent.set_processes({gpu: [{"pid": k.pid, "used_mb": 1000}, {"pid": k.child, "used_mb": 500}]})
    monkeypatch.setenv("FAKE_NVML_FILE", str(agent.nvml_file))
    return agent, k


def test_a_park_order_reaches_the_agent_long_before_its_next_heartbeat(
    slow_beat_broker: NodeBroker, tmp_path: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent beats every 30 s; the park order reaches it through its long-poll, and the
    kernel is parked (bob's waiter freed) within a few seconds of bob's request."""
    agent, k = _agent_on_one_gpu(slow_beat_broker, tmp_path, libdir, monkeypatch, 30.0)
    try:
        agent.start()
        _wait_for_the_gpu(slow_beat_broker, agent)
        took, lease = _park_for_bob(slow_beat_broker, agent, k, 8.0)
        assert took < 8.0  # not the 30 s heartbeat
        log = agent.log_path.read_text()
        assert f"Parked lease {lease[:6]}: pids {k.pid} {k.child}, 1500 MiB in" in log
        assert "no orders long-poll" not in log
        checkpointed = CudaCheckpoint(str(libdir / "libcuda.so.1"))
        assert checkpointed.state(k.pid) is ProcessState.CHECKPOINTED
        # once: the order came with a heartbeat the long-poll brought, never from both
        calls = (tmp_path / "driver" / "calls.log").read_text().splitlines()
        assert [c.split()[0] for c in calls].count("cuCheckpointProcessCheckpoint") == 2
    finally:
        agent.stop()
        k.stop()


@pytest.mark.parametrize("status", [404, 405])
def test_an_agent_falls_back_to_heartbeats_where_the_broker_has_no_long_poll(
    status: int,
    slow_beat_broker: NodeBroker,
    tmp_path: Path,
    libdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Behind a front that answers the long-poll 404 (an older broker) or 405, the agent
    says so once, asks no more, and parks on the order its next heartbeat brings."""
    front = OlderBrokerFront(slow_beat_broker.url, status)
    monkeypatch.setattr(slow_beat_broker, "url", front.url)  # the agent's --broker-url
    agent, k = _agent_on_one_gpu(slow_beat_broker, tmp_path, libdir, monkeypatch, 1.0)
    try:
        agent.start()
        wait_for(lambda: "no orders long-poll" in agent.log_path.read_text(), 20, "the fallback")
        _wait_for_the_gpu(slow_beat_broker, agent)
        _, lease = _park_for_bob(slow_beat_broker, agent, k, 20.0)
        log = agent.log_path.read_text()
        assert f"Parked lease {lease[:6]}" in log
        assert log.count("no orders long-poll") == 1
        assert front.orders_asked == 1  # asked again only after 10 minutes
    finally:
        agent.stop()
        k.stop()
        front.close()
