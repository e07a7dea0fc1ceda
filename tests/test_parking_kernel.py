"""Parking on the kernel's side: a cell run in a parked kernel waits for its GPU.

- the ``%gpu`` extension's ``pre_run_cell`` hook (``startup/gpu_lease_magic.py``), run
  against a state file that a thread of the test changes as the lease keeper would: the
  lines it prints, the ``.resume`` request it makes, an interrupt, an ended lease, and its
  cost when the kernel is not parked; also inside a real IPython shell;
- the lease keeper's parking branch (renewals of a parked lease, the ``.resume`` watcher,
  resuming a busy kernel that has no cell hook, the resume loop, the state file and the
  board) through the real client against a real broker (slow), whose node agent, other
  user and admin are played over REST as in ``test_parking_broker.py``;
- end to end (slow; runs once the broker has parking): a real ipykernel kernel launched by
  our provisioner is parked by a real broker, and ``print(x)`` resumes it and prints 41.
"""

from __future__ import annotations

import _thread
import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner import wire
from provisioner.devtools.testing import execute, wait_for_async
from provisioner.kernel.broker_clients import BrokerClients
from provisioner.kernel.lease_keeper import KernelReport, LeaseAsk, LeaseKeeper
from provisioner.kernel.parked import BUSY_RESUME_AFTER
from provisioner.kernel.state_file import StateFile
from provisioner.kernel.status import LeaseBoard

from .test_launcher import load_startup
from .test_nodes import NodeBroker, gpus_of, register

UUID = "GPU-8f0c1a22-0000-4000-8000-000000000001"


@pytest.fixture
def magic(monkeypatch: pytest.MonkeyPatch) -> Any:
    for key in list(os.environ):
        if key.startswith("GPU_LEASE_"):
            monkeypatch.delenv(key)
    return load_startup("gpu_lease_magic")


def write_state(path: Path, **fields: Any) -> None:
    """As the keeper writes it (json.dump's separators), atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"lease_id": "L", "expires_at": None, "reason": None, **fields}))
    os.replace(tmp, path)


def play(steps: list[tuple[Callable[[], bool], Callable[[], None]]]) -> threading.Thread:
    """A thread that, for each step, waits for its condition and then does its action."""

    def run() -> None:
        for condition, action in steps:
            deadline = time.monotonic() + 10
            while not condition():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- the pre_run_cell hook -------------------------------------------------------------------
def test_a_cell_in_a_parked_kernel_waits_for_its_resume(magic: Any, tmp_path: Path) -> None:
    path = tmp_path / "gpu-lease-k.json"
    flag = Path(f"{path}.resume")
    write_state(path, state="parked", parked_at=1000.0)
    lines: list[str] = []
    hook = magic.ParkedCellHook(str(path), out=lines.append, poll=0.02)
    thread = play(
        [
            (flag.exists, lambda: write_state(path, state="parked", position=2, eta_seconds=40)),
            (lambda: len(lines) >= 2, lambda: write_state(path, state="parked", position=1)),
            (lambda: len(lines) >= 3, lambda: write_state(path, state="resuming")),
            (lambda: len(lines) >= 4, lambda: write_state(path, state="active")),
        ]
    )
    hook()
    thread.join(5)
    assert lines[:4] == [
        "GPU parked: resuming before this cell runs…",
        "resuming: 2nd in queue (about 40 s)",
        "resuming: 1st in queue",
        "resuming: restoring the GPU memory…",
    ]
    assert lines[4].startswith("GPU resumed in ") and lines[4].endswith(
        " s; your variables are intact."
    )
    assert len(lines) == 5
    assert hook.pending is None  # the cell runs
    assert hook.visit("cell") == "cell"


@pytest.mark.parametrize(
    "ended, words",
    [
        ({"state": "revoked", "reason": "an admin stopped it"}, "revoked: an admin stopped it"),
        (None, "the GPU lease was released"),  # the keeper removed the file
    ],
)
def test_a_lease_that_ends_while_the_cell_waits_says_why(
    magic: Any, tmp_path: Path, ended: dict[str, Any] | None, words: str
) -> None:
    path = tmp_path / "gpu-lease-k.json"
    write_state(path, state="parked")
    lines: list[str] = []
    hook = magic.ParkedCellHook(str(path), out=lines.append, poll=0.02)
    end = (lambda: write_state(path, **ended)) if ended else path.unlink
    thread = play([(Path(f"{path}.resume").exists, end)])
    hook()
    thread.join(5)
    assert lines[0] == "GPU parked: resuming before this cell runs…"
    assert words in lines[-1] and "restart the kernel" in lines[-1]
    # the cell does not run: IPython's AST transformer turns it into the error
    module = hook.visit("cell")
    assert "RuntimeError" in __import__("ast").unparse(module)
    with pytest.raises(RuntimeError, match=words.split(":")[0]):
        exec(compile(module, "<cell>", "exec"), {})
    assert hook.visit("next cell") == "next cell"


def test_interrupting_the_kernel_stops_the_wait(magic: Any, tmp_path: Path) -> None:
    path = tmp_path / "gpu-lease-k.json"
    write_state(path, state="parked")
    lines: list[str] = []
    hook = magic.ParkedCellHook(str(path), out=lines.append, poll=0.02)
    thread = play([(Path(f"{path}.resume").exists, _thread.interrupt_main)])
    hook()  # the interrupt arrives in this (the main) thread while it waits
    thread.join(5)
    assert lines[-1].startswith("Stopped waiting for the GPU: this cell did not run.")
    with pytest.raises(KeyboardInterrupt):
        exec(compile(hook.visit("cell"), "<cell>", "exec"), {})
    assert Path(f"{path}.resume").exists()  # the resume goes on in the keeper


def test_the_hook_is_one_small_read_when_the_kernel_is_not_parked(
    magic: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpu-lease-k.json"
    write_state(path, state="active", gpu={"uuid": UUID}, fraction=0.02, used_mb=512)
    hook = magic.ParkedCellHook(str(path), out=lambda line: pytest.fail(line))
    n = 2000
    started = time.perf_counter()
    for _ in range(n):
        hook()
    per_cell = (time.perf_counter() - started) / n
    print(f"pre_run_cell hook, not parked: {per_cell * 1e6:.1f} us per cell")
    # measured ~10-20 us on the 2-core test machine; a cell's own overhead is ~1 ms
    assert per_cell < 500e-6
    assert not Path(f"{path}.resume").exists() and hook.pending is None
    # no state file (no GPU lease, or not written yet): nothing to do either
    magic.ParkedCellHook(str(tmp_path / "none.json"))()
    assert magic.quick_state(str(tmp_path / "none.json")) is None


def test_gpu_magic_shows_the_parked_state_and_since_when(magic: Any) -> None:
    at = time.mktime((2026, 3, 2, 14, 2, 11, 0, 0, -1))
    info = {
        "lease": "L",
        "gpu": {"uuid": UUID},
        "enforcement": "cooperative",
        "state": "parked",
        "parked_at": at,
    }
    text = magic.format_info(info, now=at + 720)
    assert "state:      parked (its GPU memory is in host RAM) since 14:02:11, 12 min ago" in text
    assert "running a cell resumes it, variables are kept" in text
    waiting = magic.format_info({**info, "position": 3, "eta_seconds": 300}, now=at + 60)
    assert "since 14:02:11, 60 s ago; resuming: 3rd in queue (about 5 min)" in waiting


def test_the_hook_in_an_ipython_shell(
    magic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded as the kernel loads it: a parked cell runs after the resume; %gpu does not wait;
    an interrupted wait skips the cell."""
    from IPython.core.interactiveshell import InteractiveShell

    path = tmp_path / "gpu-lease-k.json"
    monkeypatch.setenv("GPU_LEASE_STATE_FILE", str(path))
    shell = InteractiveShell.instance()
    try:
        magic.load_ipython_extension(shell)
        magic.load_ipython_extension(shell)  # %reload_ext: one hook, not two
        hooks = [h for h in shell.ast_transformers if isinstance(h, magic.ParkedCellHook)]
        assert len(hooks) == 1
        hooks[0].poll = 0.02
        write_state(path, state="active")
        assert shell.run_cell("x = 41").success
        write_state(path, state="parked", parked_at=time.time())
        assert shell.run_cell("%gpu --json").success
        assert not Path(f"{path}.resume").exists()  # %gpu alone does not resume
        thread = play([(Path(f"{path}.resume").exists, lambda: write_state(path, state="active"))])
        assert shell.run_cell("y = x + 1").success
        thread.join(5)
        assert shell.user_ns["y"] == 42
        write_state(path, state="parked")
        os.unlink(f"{path}.resume")
        thread = play([(Path(f"{path}.resume").exists, _thread.interrupt_main)])
        result = shell.run_cell("z = 1")
        thread.join(5)
        assert isinstance(result.error_in_exec, KeyboardInterrupt)
        assert "z" not in shell.user_ns
    finally:
        for h in [h for h in shell.ast_transformers if isinstance(h, magic.ParkedCellHook)]:
            shell.ast_transformers.remove(h)
            shell.events.unregister("pre_run_cell", h)
        InteractiveShell.clear_instance()


# -- the keeper, against a real broker --------------------------------------------------------
@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    """SQLite only: the broker's own parking tests cover PostgreSQL."""
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


#: a broker whose pool is the GPUs its agents register, with idle reclaim after 0.5 s
PARK_ARGS = (
    "--gpus",
    "agents",
    "--GPULeaseBroker.reap_interval=0.2",
    "--GPULeaseBroker.idle_reclaim_after=0.5",
)
GPU_MB = 16384


@pytest.fixture
def pb(tmp_path: Path, broker_db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[NodeBroker]:
    """A real broker whose pool is gpu-a's one GPU, with idle reclaim after half a second and
    a fast reaper (``tests/test_parking_broker.py``'s); the keeper's token is alice's."""
    b = NodeBroker(tmp_path, broker_db_url, PARK_ARGS)
    with b.running(timeout=60):
        monkeypatch.setenv("GPU_LEASE_TOKEN", b.tokens["alice"])
        monkeypatch.delenv("GPU_LEASE_TOKEN_FILE", raising=False)
        yield b


class Park:
    """Everyone but the keeper, over REST: gpu-a's node agent (as ``test_parking_broker.py``
    plays it: its heartbeats say it can checkpoint and has host memory, and report each
    order it is given as done; the agent itself is tested for real in ``test_parking_agent.py``),
    bob, who takes the GPU, and an admin. Async clients: the keeper shares the loop."""

    def __init__(self, pb: NodeBroker) -> None:
        self.agent, self.alice, self.bob, self.admin = (
            pb.client(who) for who in ("agent:gpu-a", "alice", "bob", "admin")
        )

    async def register(self) -> None:
        r = await self.agent.put(
            "/nodes/gpu-a", json={"gpus": gpus_of("gpu-a", 1, GPU_MB), "agent_version": "test"}
        )
        assert r.status_code == 200, r.text
        await self.beat()

    async def beat(self, parking: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "usage": [],
            "checkpoint": True,
            "host_memory_available_mb": 100_000,
        }
        if parking:
            body["parking"] = parking
        r = await self.agent.post("/nodes/gpu-a/heartbeat", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def carry_out(self, action: str) -> None:
        """Heartbeats until the broker orders ``action`` (park/resume), then report it done."""

        async def ordered() -> list[dict[str, Any]]:
            return [o for o in (await self.beat())["orders"] if o["action"] == action]

        orders = await wait_for_async(ordered, timeout=15, what=f"a {action} order")
        done = [{"lease_id": o["lease_id"], "action": action, "outcome": "done"} for o in orders]
        assert [o for o in (await self.beat(done))["orders"] if o["action"] == action] == []

    async def bob_takes_the_gpu(self) -> str:
        """Bob asks for the whole GPU: the broker parks alice's idle lease for him (the agent
        parks it when ordered) and grants his request; his kernel is busy, so no idle reclaim
        takes the GPU back from him. His lease's id."""
        ask = {"kernel_id": "k2", "fraction": 1.0}
        r = await self.bob.post("/leases", json=ask)
        assert r.status_code == 202, r.text
        await self.carry_out("park")
        r = await self.bob.post("/leases", json=ask)  # the same request, granted now
        assert r.status_code == 200, r.text
        bob_id = str(r.json()["id"])
        r = await self.bob.post(f"/leases/{bob_id}/renew", json={"execution_state": "busy"})
        assert r.status_code == 200, r.text
        return bob_id

    async def bob_leaves(self, bob_id: str) -> None:
        """Bob releases the GPU; the broker grants alice's waiting resume, the agent restores."""
        assert (await self.bob.delete(f"/leases/{bob_id}")).status_code == 204
        await self.carry_out("resume")

    async def lease(self, lease_id: str) -> dict[str, Any]:
        r = await self.alice.get(f"/leases/{lease_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def queue(self) -> list[dict[str, Any]]:
        r = await self.alice.get("/queue")
        assert r.status_code == 200, r.text
        return list(r.json()["queue"])

    async def renewals_go_on(self, lease_id: str, seconds: float = 1.0) -> dict[str, Any]:
        """Wait until the keeper has renewed the lease for ``seconds`` more (4 of its parked
        watcher's looks a second): the lease then, as the broker has it."""
        since = (await self.lease(lease_id))["renewed_at"]

        async def renewed() -> dict[str, Any] | None:
            lease = await self.lease(lease_id)
            return lease if lease["renewed_at"] >= since + seconds else None

        return dict(await wait_for_async(renewed, timeout=15, what="renewals"))

    async def no_resume_asked(self, lease_id: str) -> None:
        """The broker saw no resume call: the lease is parked with no resume request."""
        lease = await self.lease(lease_id)
        assert lease["state"] == "parked" and "resume" not in lease, lease
        assert await self.queue() == []

    async def aclose(self) -> None:
        for c in (self.agent, self.alice, self.bob, self.admin):
            await c.aclose()


@pytest.fixture
async def park(pb: NodeBroker) -> AsyncIterator[Park]:
    p = Park(pb)
    await p.register()
    yield p
    await p.aclose()


class Kernel:
    """The keeper's view of its kernel (the provisioner's part of ``KernelHandle``): idle
    since it was made (the broker's idle reclaim counts from ``last_activity``), until a
    test says otherwise."""

    def __init__(self) -> None:
        self.execution_state = "idle"
        self.last_activity = time.time()
        self.shut_down = False
        self.ended = False

    def kernel_report(self) -> KernelReport:
        return KernelReport(
            pid=os.getpid(),
            execution_state=self.execution_state,
            last_activity=self.last_activity,
        )

    def kernel_exited_for_good(self) -> bool:
        return False

    async def shut_kernel_down(self) -> None:
        self.shut_down = True

    def lease_ended(self) -> None:
        self.ended = True


#: the whole GPU; long-polls of 2 s (so a resume's state changes reach the state file soon)
ASK = LeaseAsk(kernel_id="k1", fraction=1.0, long_poll=2.0, renew_interval=0.2)


def keeper_for(pb: NodeBroker, tmp_path: Path) -> tuple[LeaseKeeper, Kernel, StateFile]:
    kernel = Kernel()
    log = logging.getLogger("test.parking")
    keeper = LeaseKeeper(kernel, BrokerClients(lambda: pb.url), log=log)
    keeper.state_file = StateFile(str(tmp_path / "gpu-lease-k1.json"), kernel_id="k1", log=log)
    keeper.board = LeaseBoard()
    return keeper, kernel, keeper.state_file


def touch(path: str) -> None:
    Path(path).touch()


def exists(path: str) -> bool:
    return os.path.exists(path)


def state_of(state_file: StateFile) -> dict[str, Any]:
    try:
        return dict(json.loads(Path(state_file.path).read_text()))
    except (OSError, ValueError):
        return {}


class Trail:
    """The state file's successive ``(state, position)``, as read by each :meth:`at`."""

    def __init__(self, state_file: StateFile) -> None:
        self.state_file = state_file
        self.seen: list[tuple[Any, Any]] = []

    def at(self, state: str, position: int | None = None) -> bool:
        """Read the file (noting a change); whether it says ``state`` (at ``position``)."""
        s = state_of(self.state_file)
        now = (s.get("state"), s.get("position"))
        if not self.seen or self.seen[-1] != now:
            self.seen.append(now)
        return now[0] == state and (position is None or now[1] == position)

    async def reach(self, state: str, position: int | None = None) -> None:
        """Wait until the file says ``state`` (at ``position``), noting each change meanwhile."""
        at = f" at position {position}" if position is not None else ""
        await wait_for_async(
            lambda: self.at(state, position),
            timeout=10,
            interval=0.005,
            what=f"the state file to say {state}{at}",
            detail=lambda: f"it said {self.seen}",
        )

    def states(self) -> list[Any]:
        """The states seen, each once in a row."""
        return [s for i, (s, _) in enumerate(self.seen) if i == 0 or self.seen[i - 1][0] != s]


async def parked(keeper: LeaseKeeper, state_file: StateFile) -> None:
    """Wait until the keeper's renewals found its lease parked; check the state file and
    the board say so."""
    await wait_for_async(
        lambda: state_of(state_file).get("state") == "parked",
        timeout=15,
        what="the state file to say parked",
    )
    assert keeper.lease is not None and state_of(state_file)["parked_at"] is not None
    assert keeper.board is not None
    record = keeper.board.get("k1")
    assert record is not None and record.state == "parked"
    assert record.to_json()["state"] == "parked" and "parked_since" in record.to_json()


@pytest.mark.slow
async def test_keeper_renews_a_parked_lease_and_resumes_when_the_kernel_asks(
    pb: NodeBroker, park: Park, tmp_path: Path
) -> None:
    keeper, kernel, state_file = keeper_for(pb, tmp_path)
    lease = await keeper.acquire(ASK)
    keeper.start_renewing()
    try:
        await wait_for_async(
            lambda: state_of(state_file).get("state") == "active", what="the first renewal"
        )
        bob = await park.bob_takes_the_gpu()
        await parked(keeper, state_file)
        # renewals go on; nobody asked: no resume call
        assert (await park.renewals_go_on(lease.id))["state"] == "parked"
        await park.no_resume_asked(lease.id)
        assert not kernel.shut_down and not exists(state_file.resume_flag)

        trail = Trail(state_file)
        touch(state_file.resume_flag)  # what the kernel's hook does when a cell is run
        # the resume waits behind bob: its place reaches the state file (the first call
        # does not long-poll) and the board
        await trail.reach("parked", 1)
        assert (await park.lease(lease.id))["resume"]["position"] == 1
        assert len(await park.queue()) == 1
        record = keeper.board.get("k1") if keeper.board else None
        assert record is not None and (record.state, record.position) == ("parked", 1)
        assert exists(state_file.resume_flag)  # the cell still waits
        assert (await park.bob.delete(f"/leases/{bob}")).status_code == 204  # the GPU is free
        await trail.reach("resuming")
        assert exists(state_file.resume_flag)  # not active yet: the agent has not restored
        await park.carry_out("resume")
        await trail.reach("active")
        assert trail.states() == ["parked", "resuming", "active"], trail.seen
        # resuming has no place in the queue any more (the cell says "restoring…")
        assert [p for s, p in trail.seen if s == "resuming"] == [None], trail.seen
        assert trail.seen[-1] == ("active", None)
        await wait_for_async(
            lambda: not exists(state_file.resume_flag), timeout=5, what="the .resume flag to go"
        )
        assert keeper.board is not None
        record = keeper.board.get("k1")
        assert record is not None and record.state == "active" and record.position is None
        now = await park.lease(lease.id)
        assert now["state"] == "active" and now["parked_at"] is None
        assert not kernel.shut_down and keeper.lease is not None
    finally:
        await keeper.end("the test ended")


@pytest.mark.slow
async def test_a_renewal_that_finds_a_parked_lease_revoked_says_its_memory_is_lost(
    pb: NodeBroker, park: Park, tmp_path: Path
) -> None:
    """Not the resume but a renewal meets the revoke: the student is told the same, that the
    parked GPU memory cannot be restored, with the admin's reason."""
    keeper, kernel, state_file = keeper_for(pb, tmp_path)
    lease = await keeper.acquire(ASK)
    try:
        assert await keeper.renew_once()
        await park.bob_takes_the_gpu()
        assert await keeper.renew_once()  # the keeper learns that its lease is parked
        await parked(keeper, state_file)
        r = await park.admin.post(
            f"/leases/{lease.id}/revoke", json={"reason": "the course's GPU time is over"}
        )
        assert r.status_code == 200, r.text
        assert not await keeper.renew_once()
        await wait_for_async(lambda: kernel.shut_down, timeout=20, what="the kernel shut down")
        state = state_of(state_file)
        assert state["state"] == "revoked"
        assert "the course's GPU time is over" in state["reason"]
        assert "cannot be restored" in state["reason"]
    finally:
        await keeper.end("the test ended")


@pytest.mark.slow
async def test_keeper_shuts_a_parked_kernel_down_when_its_resume_finds_the_lease_ended(
    pb: NodeBroker, park: Park, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An admin revokes the lease while its resume waits in the queue (after a broker restart
    that the resume rides out). No renewal loop here, so that it is the resume's calls that
    meet both: one renewal tells the broker the kernel is idle, one after the park tells the
    keeper its lease is parked."""
    caplog.set_level(logging.INFO, logger="test.parking")
    keeper, kernel, state_file = keeper_for(pb, tmp_path)
    lease = await keeper.acquire(ASK)
    assert await keeper.renew_once()
    await park.bob_takes_the_gpu()
    touch(state_file.resume_flag)  # a cell was run
    assert await keeper.renew_once()  # parked: the watcher starts, finds the flag, resumes
    await parked(keeper, state_file)
    await wait_for_async(
        lambda: state_of(state_file).get("position") == 1,
        timeout=10,
        what="the resume to wait in the queue",
    )
    # the broker stops under the resume's long-poll: the keeper says so and asks again (with
    # backoff) until the broker, started again, answers the resume's place once more
    await asyncio.to_thread(pb.terminate)
    await wait_for_async(
        lambda: "Could not resume GPU lease" in caplog.text,
        timeout=15,
        what="the keeper to warn that the broker did not answer",
    )
    restarted = time.time()
    await asyncio.to_thread(pb.start)
    await wait_for_async(
        lambda: (
            (s := state_of(state_file)).get("updated_at", 0) > restarted and s.get("position") == 1
        ),
        timeout=15,
        what="the resume's place again, from the restarted broker",
    )
    assert not kernel.shut_down and exists(state_file.resume_flag)
    r = await park.admin.post(
        f"/leases/{lease.id}/revoke", json={"reason": "the course's GPU time is over"}
    )
    assert r.status_code == 200, r.text
    await wait_for_async(lambda: kernel.shut_down, timeout=20, what="the kernel shut down")
    state = state_of(state_file)
    assert state["state"] == "revoked"
    assert "the course's GPU time is over" in state["reason"]
    assert "cannot be restored" in state["reason"]
    assert keeper.board is not None
    record = keeper.board.get("k1")
    assert record is not None and record.state == "revoked"
    await wait_for_async(lambda: kernel.ended, timeout=5, what="the lease to end")
    assert not exists(state_file.resume_flag)
    assert (await park.lease(lease.id))["state"] == "revoked"
    assert await park.queue() == []  # the revoke dropped the resume request
    os.unlink(state_file.path)  # kept for the reason: the test's to clean


@pytest.mark.slow
@pytest.mark.parametrize("hookless", [True, False], ids=["no-gpu-hook", "ipython"])
async def test_a_busy_parked_kernel_is_resumed(
    pb: NodeBroker,
    park: Park,
    tmp_path: Path,
    hookless: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A parked kernel that is busy gets its GPU memory back with no ``.resume`` flag.

    Without the ``%gpu`` hook (``resume_when_busy``, set by the provisioner for R, Julia...)
    as soon as it is busy: nothing else would ask. An IPython kernel only when busy for
    ``BUSY_RESUME_AFTER`` s without a break: a cell that started before its keeper learnt
    of the park passed the hook while the state file said ``active``, and waits in CUDA;
    a brief busy (a completion, an inspection) resumes nothing."""
    caplog.set_level(logging.INFO, logger="test.parking")
    keeper, kernel, state_file = keeper_for(pb, tmp_path)
    keeper.park_watch.resume_when_busy = hookless
    lease = await keeper.acquire(ASK)
    keeper.start_renewing()
    try:
        bob = await park.bob_takes_the_gpu()
        await parked(keeper, state_file)
        if not hookless:
            kernel.execution_state = "busy"  # a completion: briefer than the limit
            await asyncio.sleep(BUSY_RESUME_AFTER / 2)  # the condition here is time itself
            kernel.execution_state = "idle"
            await park.renewals_go_on(lease.id)
            await park.no_resume_asked(lease.id)
        started = time.monotonic()
        kernel.execution_state = "busy"  # a cell runs (and would block in CUDA)
        await wait_for_async(
            lambda: state_of(state_file).get("position") == 1,
            timeout=10,
            what="the resume to wait behind bob",
        )
        said = "is busy (it has no %gpu cell hook" if hookless else "has been busy for 2 s"
        assert said in caplog.text, caplog.text
        if not hookless:
            assert time.monotonic() - started >= BUSY_RESUME_AFTER
        assert (await park.lease(lease.id))["resume"]["position"] == 1
        await park.bob_leaves(bob)
        await wait_for_async(
            lambda: state_of(state_file).get("state") == "active",
            timeout=10,
            what="the lease to be active again",
        )
        assert not exists(state_file.resume_flag)  # nobody made one: the keeper resumed
        assert (await park.lease(lease.id))["state"] == "active"
        record = keeper.board.get("k1") if keeper.board else None
        assert record is not None and record.state == "active"
        assert not kernel.shut_down
    finally:
        await keeper.end("the test ended")


# -- end to end: a real broker parks a real kernel -----------------------------------------
async def release(b: Any, user: str, lease_id: str) -> None:
    async with httpx.AsyncClient(base_url=f"{b.url}/api/v1", headers=b.headers(user)) as c:
        assert (await c.delete(f"/leases/{lease_id}")).status_code in (200, 204)


async def run_until(
    km: Any, code: str, when: dict[str, Callable[[], Any]], timeout: float = 60
) -> tuple[str, dict[str, Any]]:
    """Run ``code`` in the kernel; when its output first shows a key of ``when``, await that
    action (the test acts on what the cell prints). Its output and the execute reply."""
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=30)
        msg_id = kc.execute(code)
        out = ""
        deadline = time.monotonic() + timeout
        while True:
            msg = await kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out += msg["content"]["text"]
                for words in [w for w in when if w in out]:
                    await when.pop(words)()
            elif msg["msg_type"] == "error":
                out += f"{msg['content']['ename']}: {msg['content']['evalue']}"
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = await kc.get_shell_msg(timeout=10)
        return out, dict(reply["content"])
    finally:
        kc.stop_channels()


needs_parking = pytest.mark.skipif(
    not hasattr(wire, "PARK_STATES"),
    reason="the broker's parking (branches park-core and park-service) is not merged yet",
)


@pytest.mark.slow
@needs_parking
async def test_a_parked_kernel_resumes_when_a_cell_runs_and_keeps_its_variables(
    tmp_path: Path, broker_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .test_provisioner import Specs, kernel, read_json

    node = "gpu-a"
    b = NodeBroker(
        tmp_path,
        broker_db_url,
        (
            "--GPULeaseBroker.reap_interval=0.2",
            "--GPULeaseBroker.idle_reclaim_after=1",
            "--GPULeaseBroker.node_grace=5",
        ),
    )
    specs = Specs(tmp_path / "jupyter")
    specs.add("gpu-0.6", 0.6)
    monkeypatch.setenv("JUPYTER_PATH", str(specs.root))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    with b.running(timeout=60):
        monkeypatch.setenv("GPU_LEASE_URL", b.url)
        monkeypatch.setenv("GPU_LEASE_TOKEN", b.tokens["alice"])
        monkeypatch.setenv("GPU_LEASE_NODE", node)
        agent = b.http(f"agent:{node}")
        gpu = gpus_of(node, count=1)
        assert register(agent, node, gpu).status_code == 200
        done: list[dict[str, Any]] = []
        stop = threading.Event()

        busy: list[str] = []  # bob's lease: renewed as a busy kernel (never idle reclaimed)
        bob_http = b.http("bob")

        def agent_loop() -> None:
            """The node agent: checkpoint offered; every order it is given succeeds. And bob's
            kernel elsewhere, busy, so that alice's resume waits behind it."""
            while not stop.is_set():
                for lease_id in busy:
                    bob_http.post(f"/leases/{lease_id}/renew", json={"execution_state": "busy"})
                beat = {
                    "usage": [],
                    "checkpoint": True,
                    "host_memory_available_mb": 65536,
                    "parking": done[:],
                }
                answer = agent.post(f"/nodes/{node}/heartbeat", json=beat).json()
                done[:] = [
                    {"lease_id": o["lease_id"], "action": o["action"], "outcome": "done"}
                    for o in answer.get("orders", [])
                ]
                stop.wait(0.2)

        beats = threading.Thread(target=agent_loop, daemon=True)
        beats.start()
        try:
            async with kernel("gpu-0.6", tmp_path) as km:
                out, reply = await execute(km, "x = 41")
                assert reply["status"] == "ok", (out, reply)
                state_file = km.provisioner.lease_keeper.state_file  # type: ignore[union-attr]
                state_path = Path(state_file.path)
                await asyncio.sleep(1.3)  # idle longer than idle_reclaim_after
                async with httpx.AsyncClient(
                    base_url=f"{b.url}/api/v1", headers=b.headers("bob"), timeout=30
                ) as bob:
                    r = await bob.post(
                        "/leases",
                        json={
                            "kernel_id": f"bob-{uuid.uuid4()}",
                            "fraction": 0.6,
                            "node": node,
                            "wait": 20,
                        },
                    )
                assert r.status_code == 201, r.text  # alice's idle kernel was parked for bob
                bobs = r.json()["id"]
                busy.append(bobs)
                await wait_for_async(
                    lambda: read_json(state_path).get("state") == "parked",
                    timeout=15,
                    what="the state file to say parked",
                )
                out, reply = await run_until(
                    km,
                    "print(x)",
                    # the resume waits behind bob: he leaves once the cell says so
                    {"1st in queue": lambda: (busy.clear(), release(b, "bob", bobs))[1]},
                )
                assert reply["status"] == "ok", (out, reply)
                assert "GPU parked: resuming before this cell runs…" in out
                assert "resuming: 1st in queue" in out
                assert "your variables are intact." in out
                assert out.strip().splitlines()[-1] == "41"
                assert read_json(state_path)["state"] == "active"
                assert not exists(f"{state_path}.resume")
        finally:
            stop.set()
            beats.join(5)
            agent.close()
            bob_http.close()
