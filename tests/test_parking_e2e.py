"""Parking end to end, every part real, and what a crash does to it.

Each test runs a real broker process (``--gpus agents``, idle reclaim after 1 s, the
reaper every 0.2 s), a real ``gpu-lease agent`` process (heartbeat every 0.3 s) with the
stand-in driver (tests/standin_libcuda: its state per pid and ``calls.log`` in a folder)
and the stand-in NVML (tests/fake_nvml, a JSON file where the test lists the kernel's
real pid with ``USED_MB``; a CHECKPOINTED pid shows 0 MiB), and a real ipykernel kernel
started by :class:`~provisioner.kernel.provisioner.GPULeaseProvisioner` on the agent's one
GPU. Alice's kernel sets ``x = 41`` and idles; bob asks for the same GPU and waits, so the
reaper picks her kernel:

1. it is parked (the agent checkpoints the kernel's pid), bob is granted; the agent is
   killed with ``kill -9`` and a new one started; bob leaves; ``print(x)`` in the kernel
   resumes it (the new agent finds the checkpointed pid by walking ``/proc``) and prints 41;
2. the same across a broker failover (PostgreSQL, two brokers with ``--ha-lock``): the
   active is killed with ``kill -9`` while the kernel is parked; the agent and the kernel's
   provisioner reach the standby through a TCP front that sends each connection to the
   broker that listens (a standby listens on nothing), as docs/admins-ha.md "Routing
   clients" tells admins to deploy; the standby loads the lease parked, its capacity free;
3. the checkpoint fails (the stand-in's ``fail-checkpoint``): the broker reclaims instead,
   the provisioner shuts the kernel down saying that parking failed, bob is granted;
4. the GPU memory is taken by an unleased process when the kernel resumes: the cell
   waits (the lease ``resuming``, no restore asked of the driver) until it leaves.

After each: no lease left but the kernel's own (none once it is shut down), no GPU
over-allocated (the broker's view and the database's sum, parked leases excluded), and the
processes gone.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import pytest
import sqlalchemy as sa

from provisioner.devtools.testing import alive, execute, wait_for_async
from provisioner.node.checkpoint import CudaCheckpoint, ProcessState
from tests.standin_libcuda.build import build

from .conftest import Broker, postgres_schema
from .test_agent import Agent
from .test_failover import start_standby, stopped_at_the_end
from .test_faults import answers, engine
from .test_nodes import NodeBroker
from .test_parking_kernel import run_until
from .test_provisioner import Specs, kernel, read_json

pytestmark = pytest.mark.slow  # brokers, agents, kernels: processes

NODE = "gpu-a"
#: the GPU memory the stand-in NVML shows for the kernel's process
USED_MB = 1000
#: each kernel's and bob's share: two do not fit on the one GPU
FRACTION = 0.6
PPM = 1_000_000
PARK_ARGS = (
    "--gpus",
    "agents",
    "--GPULeaseBroker.reap_interval=0.2",
    "--GPULeaseBroker.idle_reclaim_after=1",
    "--GPULeaseBroker.node_grace=5",
)
#: the leadership TTL of the failover test's brokers (s): short, so that a takeover is quick
TTL = 2.0
#: a busy shared 2-core box starts a broker in 1-10 s
SLACK = 30.0


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("libcuda"))


class Front:
    """A TCP front for active/standby brokers, as a health-checked load balancer is: each
    new connection goes to the first broker that accepts it (a standby listens on
    nothing), so clients that retry on a new connection reach the broker active now."""

    def __init__(self, brokers: list[Broker]) -> None:
        self.ports = [int(urlsplit(b.url).port or 0) for b in brokers]
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        up = None
        for port in self.ports:
            try:
                up = socket.create_connection(("127.0.0.1", port), timeout=2.0)
                break
            except OSError:
                continue
        if up is None:  # none listens (a takeover under way): the client retries
            conn.close()
            return
        up.settimeout(None)
        with self.lock:
            self.sockets |= {conn, up}
        back = threading.Thread(target=self._pump, args=(up, conn), daemon=True)
        back.start()
        self._pump(conn, up)
        back.join()
        with self.lock:
            self.sockets -= {conn, up}
        conn.close()
        up.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.server.close()
        with self.lock:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class Rig:
    """One node for a test: the broker (through ``url``: its own, or a front's), the agent
    process on one GPU with the stand-in driver and NVML, and alice's kernelspec."""

    def __init__(
        self,
        b: NodeBroker,
        tmp: Path,
        libdir: Path,
        monkeypatch: pytest.MonkeyPatch,
        url: str | None = None,
    ) -> None:
        self.b = b
        self.url = url or b.url
        self.db_url = b.db_url
        self.driver = tmp / "driver"
        self.driver.mkdir()
        monkeypatch.setenv("LD_LIBRARY_PATH", str(libdir))  # the agent's libcuda.so.1
        monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(self.driver))
        self.checkpoint = CudaCheckpoint(str(libdir / "libcuda.so.1"))  # the test's look
        # the agent talks to self.url (Agent.start reads .url and .tokens)
        self.agent = Agent(
            cast(NodeBroker, SimpleNamespace(url=self.url, tokens=b.tokens)), NODE, tmp
        )
        self.agent.gpus = self.agent.gpus[:1]  # one GPU: bob and alice want the same one
        self.gpu = str(self.agent.gpus[0]["uuid"])
        self.agent.set_processes({})
        specs = Specs(tmp / "jupyter")
        specs.add("gpu-park", FRACTION, renew_interval=0.5, long_poll=2.0)
        monkeypatch.setenv("JUPYTER_PATH", str(specs.root))
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp / "runtime"))
        monkeypatch.setenv("GPU_LEASE_URL", self.url)
        monkeypatch.setenv("GPU_LEASE_TOKEN", b.tokens["alice"])
        monkeypatch.setenv("GPU_LEASE_NODE", NODE)
        monkeypatch.delenv("GPU_LEASE_GPU_UUIDS", raising=False)
        self.tmp = tmp

    # -- the node's stand-ins ---------------------------------------------------------------
    def gpu_processes(self, used: dict[int, int]) -> None:
        """What NVML lists on the GPU: pid -> MiB."""
        procs = [{"pid": pid, "used_mb": mb} for pid, mb in used.items()]
        self.agent.set_processes({self.gpu: procs})

    def calls(self) -> list[str]:
        log = self.driver / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def state(self, pid: int) -> ProcessState:
        return self.checkpoint.state(pid)

    def recorded_state(self, pid: int) -> ProcessState:
        """The stand-in driver's record of ``pid`` (also once the process is gone)."""
        path = self.driver / f"{pid}.state"
        return ProcessState(int(path.read_text())) if path.exists() else ProcessState.RUNNING

    def log(self) -> str:
        path = self.agent.log_path
        return path.read_text(errors="replace") if path.exists() else ""

    async def start_agent(self) -> None:
        registered = self.log().count(f"Registered node {NODE}")
        self.agent.start()
        await wait_for_async(
            lambda: self.log().count(f"Registered node {NODE}") > registered,
            SLACK,
            "the agent to register",
            detail=self.log,
        )

    # -- the broker -------------------------------------------------------------------------
    def client(self, user: str, timeout: float = 30.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=f"{self.url}/api/v1",
            headers=self.b.headers(user),
            timeout=timeout,
            event_hooks=self.b.conformance.hooks(),
        )

    async def lease(self, lease_id: str) -> dict[str, Any]:
        async with self.client("alice") as alice:
            r = await alice.get(f"/leases/{lease_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def allocated(self) -> float:
        """The GPU's allocated fraction, the broker's view checked against the database's
        sum of leases holding capacity (parked ones hold none); both at most 1."""
        async with self.client("admin") as admin:
            r = await admin.get("/gpus")
        assert r.status_code == 200, r.text
        (gpu,) = [g for g in r.json()["gpus"] if g["uuid"] == self.gpu]
        eng = engine(self.db_url)
        try:
            with eng.connect() as conn:
                held = conn.execute(
                    sa.text(
                        "SELECT COALESCE(SUM(fraction_ppm), 0) FROM leases WHERE state = "
                        "'active' AND (park_state IS NULL OR park_state <> 'parked') "
                        "AND gpu_uuid = :gpu"
                    ),
                    {"gpu": self.gpu},
                ).scalar()
        finally:
            eng.dispose()
        assert int(held or 0) <= PPM and gpu["allocated_fraction"] <= 1.0, (held, gpu)
        assert abs(int(held or 0) / PPM - gpu["allocated_fraction"]) < 1e-9, (held, gpu)
        return float(gpu["allocated_fraction"])

    async def nothing_left(self) -> None:
        """No lease, parked or not, and no queued request: in the broker and its database."""

        async def empty() -> bool:
            async with self.client("admin") as admin:
                leases = (await admin.get("/leases", params={"all": "1"})).json()["leases"]
                queue = (await admin.get("/queue")).json()["queue"]
            return not leases and not queue

        await wait_for_async(empty, 15, "every lease to end")
        eng = engine(self.db_url)
        try:
            with eng.connect() as conn:
                live = conn.execute(
                    sa.text("SELECT id, park_state FROM leases WHERE state = 'active'")
                ).all()
                waiting = conn.execute(sa.text("SELECT id FROM requests")).all()
        finally:
            eng.dispose()
        assert not live and not waiting, (live, waiting)
        assert await self.allocated() == 0.0

    # -- the scene ---------------------------------------------------------------------------
    async def idle_then_parked_for_bob(self, km: Any) -> Parked:
        """Alice's kernel sets x = 41 and holds USED_MB on the GPU; bob asks for the GPU
        and waits; the reaper picks alice's idle kernel. Bob's answer (status, lease)."""
        out, reply = await execute(km, "x = 41\nimport os; print(os.getpid())")
        assert reply["status"] == "ok", (out, reply)
        pid = int(out.strip().splitlines()[-1])  # the kernel's real pid
        keeper = km.provisioner.lease_keeper
        lease_id = keeper.lease.id
        self.gpu_processes({pid: USED_MB})

        async def used() -> bool:
            return (await self.lease(lease_id))["used_mb"] == USED_MB

        await wait_for_async(used, 15, "the agent to report the kernel's GPU memory")
        assert await self.allocated() == FRACTION
        async with self.client("bob") as bob:
            ask = {"kernel_id": f"bob-{uuid.uuid4()}", "fraction": FRACTION, "node": NODE}
            r = await bob.post("/leases", json={**ask, "wait": 30})
        return Parked(pid, lease_id, Path(keeper.state_file.path), r)

    async def release_bob(self, lease_id: str) -> None:
        async with self.client("bob") as bob:
            assert (await bob.delete(f"/leases/{lease_id}")).status_code == 204

    async def check_parked(self, p: Parked) -> str:
        """Alice's kernel parked for bob: the driver holds its pid CHECKPOINTED, bob holds
        the GPU's share, alice's lease says parked. Bob's lease id."""
        assert p.bob.status_code == 201, p.bob.text  # granted once alice's kernel was parked
        assert self.state(p.pid) is ProcessState.CHECKPOINTED
        assert f"cuCheckpointProcessCheckpoint {p.pid} 0" in self.calls()
        lease = await self.lease(p.lease_id)
        assert lease["state"] == "parked" and lease["parked_at"] is not None, lease
        assert lease["gpu"]["uuid"] == self.gpu
        assert f"Parked lease {p.lease_id[:6]}: pids {p.pid}, {USED_MB} MiB in" in self.log()
        await wait_for_async(
            lambda: read_json(p.state_path).get("state") == "parked",
            10,
            "the kernel's state file to say parked",
        )
        assert await self.allocated() == FRACTION  # bob's share only
        return str(p.bob.json()["id"])

    async def resumed(self, km: Any, p: Parked, when: dict[str, Callable[[], Any]]) -> str:
        """``print(x)`` in the parked kernel: it resumes and prints 41. The cell's output."""
        out, reply = await run_until(km, "print(x)", when, timeout=60)
        assert reply["status"] == "ok", (out, reply, self.log())
        assert "GPU parked: resuming before this cell runs…" in out
        assert "your variables are intact." in out
        assert out.strip().splitlines()[-1] == "41"
        assert self.state(p.pid) is ProcessState.RUNNING
        assert f"cuCheckpointProcessRestore {p.pid} 0" in self.calls()
        assert (await self.lease(p.lease_id))["state"] == "active"
        assert read_json(p.state_path)["state"] == "active"
        assert await self.allocated() == FRACTION  # alice's share again
        return out


class Parked(SimpleNamespace):
    pid: int
    lease_id: str
    state_path: Path
    bob: httpx.Response

    def __init__(self, pid: int, lease_id: str, state_path: Path, bob: httpx.Response) -> None:
        super().__init__(pid=pid, lease_id=lease_id, state_path=state_path, bob=bob)


@contextlib.asynccontextmanager
async def alices_kernel(rig: Rig) -> AsyncIterator[Any]:
    """Alice's GPU kernel; afterwards it is gone, and so is every lease."""
    async with kernel("gpu-park", rig.tmp) as km:
        pid = km.provisioner.pid
        yield km
    await wait_for_async(lambda: not alive(pid), 15, "the kernel's process to exit")
    await rig.nothing_left()


@contextlib.contextmanager
def sqlite_node(tmp_path: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    b = NodeBroker(tmp_path, f"sqlite:///{tmp_path / 'b.sqlite'}", PARK_ARGS)
    with b.running(timeout=60):
        rig = Rig(b, tmp_path, libdir, monkeypatch)
        try:
            yield rig
        finally:
            rig.agent.stop()


@pytest.fixture
def rig(tmp_path: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    with sqlite_node(tmp_path, libdir, monkeypatch) as made:
        yield made
    assert made.agent.proc is None or made.agent.proc.poll() is not None


# -- 1. kill -9 of the agent while the kernel is parked ---------------------------------------
async def test_a_kernel_parked_by_a_killed_agent_is_resumed_by_the_next(rig: Rig) -> None:
    await rig.start_agent()
    async with alices_kernel(rig) as km:
        p = await rig.idle_then_parked_for_bob(km)
        bobs = await rig.check_parked(p)
        old = rig.agent.proc
        assert rig.agent.signal(signal.SIGKILL) == -signal.SIGKILL
        assert old is not None and not alive(old.pid)
        await rig.start_agent()  # knows nothing of what the killed one parked
        assert (await rig.lease(p.lease_id))["state"] == "parked"
        assert rig.state(p.pid) is ProcessState.CHECKPOINTED
        await rig.release_bob(bobs)
        assert await rig.allocated() == 0.0
        await rig.resumed(km, p, {})
        new_log = rig.log().rsplit(f"Registered node {NODE}", 1)[1]
        assert f"Resumed lease {p.lease_id[:6]}: pids {p.pid}, {USED_MB} MiB in" in new_log
        steps = [line.split()[0] for line in rig.calls()]
        assert steps.count("cuCheckpointProcessCheckpoint") == 1
        assert steps.count("cuCheckpointProcessRestore") == 1
    assert not rig.b.problems(), rig.b.problems()


# -- 2. broker failover while the kernel is parked --------------------------------------------
@pytest.mark.postgres
async def test_a_parked_kernel_survives_a_broker_failover(
    tmp_path: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ha = ("--ha-lock", "--ttl", "30", f"--GPULeaseBroker.leadership_ttl={TTL}", *PARK_ARGS)
    with postgres_schema("gl_park") as db_url:
        active = NodeBroker(tmp_path, db_url, ha)
        with active.running(timeout=60):
            standby = await start_standby(active, tmp_path)
            front = Front([active, standby])
            with stopped_at_the_end(standby):
                rig = Rig(active, tmp_path, libdir, monkeypatch, url=front.url)
                try:
                    await rig.start_agent()
                    async with alices_kernel(rig) as km:
                        p = await rig.idle_then_parked_for_bob(km)
                        bobs = await rig.check_parked(p)
                        parked_at = (await rig.lease(p.lease_id))["parked_at"]
                        active.kill9()
                        await wait_for_async(lambda: answers(standby), SLACK, "a takeover")
                        # the standby loaded the lease parked, its capacity free
                        lease = await rig.lease(p.lease_id)
                        assert lease["state"] == "parked", lease
                        assert lease["parked_at"] == parked_at
                        assert await rig.allocated() == FRACTION  # bob's share only
                        assert "1 active lease(s), 1 parked" in standby.log(), standby.log()
                        await rig.release_bob(bobs)
                        await rig.resumed(km, p, {})
                        # the agent's orders and outcomes went to the new broker
                        assert "Resumed lease" in standby.log(20000), standby.log()
                finally:
                    rig.agent.stop()
                    front.close()
            assert not standby.problems(), standby.problems()


# -- 3. the checkpoint fails: reclaimed as before ---------------------------------------------
async def test_a_failed_checkpoint_falls_back_to_reclaim(rig: Rig) -> None:
    (rig.driver / "fail-checkpoint").write_text("")
    await rig.start_agent()
    async with alices_kernel(rig) as km:
        p = await rig.idle_then_parked_for_bob(km)
        assert p.bob.status_code == 201, p.bob.text  # the fallback freed the GPU for bob
        await wait_for_async(
            lambda: read_json(p.state_path).get("state") == "revoked",
            15,
            "the kernel's provisioner to learn its lease was revoked",
        )
        reason = read_json(p.state_path)["reason"]
        assert "parking failed" in reason and "cuCheckpointProcessCheckpoint" in reason, reason
        await wait_for_async(lambda: not km.has_kernel, 15, "the kernel to be shut down")
        assert not alive(p.pid)
        # unlocked again, never parked (the driver's record: the process is gone now)
        assert rig.recorded_state(p.pid) is ProcessState.RUNNING
        assert [c.split()[0] for c in rig.calls()][-1] == "cuCheckpointProcessUnlock"
        async with rig.client("alice") as alice:
            r = await alice.get(f"/leases/{p.lease_id}")
        assert r.status_code in (200, 410), r.text
        assert r.json().get("state", "revoked") == "revoked"
        assert await rig.allocated() == FRACTION  # bob's; nothing of alice's
        await rig.release_bob(str(p.bob.json()["id"]))
    assert not rig.b.problems(), rig.b.problems()


# -- 4. the restore waits while another process holds the GPU memory ---------------------------
@pytest.fixture
def squatter() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside every lease (the test lists it on the GPU)."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


async def test_a_resume_waits_while_the_gpu_memory_is_taken(
    rig: Rig, squatter: subprocess.Popen[bytes]
) -> None:
    await rig.start_agent()
    async with alices_kernel(rig) as km:
        p = await rig.idle_then_parked_for_bob(km)
        await rig.release_bob(await rig.check_parked(p))
        # an unleased process takes all but 500 MiB of the GPU: the kernel's 1000 MiB
        # do not fit, though the broker's pool has room
        rig.gpu_processes({p.pid: USED_MB, squatter.pid: 16384 - 500})

        async def squatter_leaves() -> None:
            await wait_for_async(
                lambda: f"Resume of lease {p.lease_id[:6]} waits: GPU" in rig.log(),
                20,
                "the agent to say the resume waits",
                detail=rig.log,
            )
            waited = time.time()

            async def beats_since() -> bool:  # the broker repeats the order meanwhile
                async with rig.client("admin") as admin:
                    nodes = (await admin.get("/nodes")).json()["nodes"]
                return bool(nodes[0]["last_seen"] > waited + 1.0)

            await wait_for_async(beats_since, 10, "more heartbeats")
            assert (await rig.lease(p.lease_id))["state"] == "resuming"
            assert read_json(p.state_path)["state"] == "resuming"
            assert not [c for c in rig.calls() if c.startswith("cuCheckpointProcessRestore")]
            assert rig.state(p.pid) is ProcessState.CHECKPOINTED
            assert await rig.allocated() == FRACTION  # re-reserved before the restore
            squatter.kill()
            squatter.wait()
            rig.gpu_processes({p.pid: USED_MB})

        out = await rig.resumed(km, p, {"restoring the GPU memory": squatter_leaves})
        assert "resuming: restoring the GPU memory…" in out
        assert squatter.poll() is not None  # it waited for the squatter, not less
    assert not rig.b.problems(), rig.b.problems()
