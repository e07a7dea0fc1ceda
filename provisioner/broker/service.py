"""The broker's service layer: the core's caller, with the store behind a group commit.

Who calls this: the HTTP handlers (``handlers.py``), one call per request, and the
reaper loop started by ``app.py``. Methods return outcomes (leases, plain dicts) or
raise ``errors``; only the handlers turn them into HTTP statuses and JSON. Every
mutation follows one pattern:

1. a mutation of ``scheduling`` (``acquire``, ``end``, ``cancel``, ``reap``) decides
   AND applies, on the event loop, over the in-memory ``PoolState``, and returns the
   ``Changes`` it made;
2. the service hands them to the ``Writer`` (``writer.py``) and awaits them: the
   writer's thread persists every change submitted while its previous transaction
   committed in ONE transaction (group commit), so the loop never waits on the
   database and concurrent requests share a commit;
3. only then does the caller get its answer, and long-polls their grants.

Decisions never interleave (the loop is the lock, and a mutation applies before its
first ``await``). If a batch fails (503 ``StoreError``, or a refusal because another
writer changed the database), every caller in it gets the error, writes decided after
it are refused too, and memory is reloaded from the database before anything is
decided again (``_reconcile``); a refused acquire, release or reaper pass then decides
once more. An answer read from memory that may depend on a change in flight (a
repeated acquire, a long-poll's grant) first awaits ``Writer.barrier``. So nothing is
acknowledged that is not in the database.

Renewals are not a write each: a heartbeat updates memory, and the reaper persists the
latest heartbeat of each renewed lease with its pass (every ``reap_interval``). A
restart grants every active lease one TTL of grace, so no lease expires for a renewal
that was not persisted; what a restart also needs, each kernel's reported activity
(idle reclaim), is at most one reaper pass old.

The database is the one source of truth; memory is its copy. A request about a lease
or queued request that memory does not hold asks the database (and adopts an active
lease, or ends or cancels it there), never answers from memory alone. Reads that do
go to the database (history, usage, an unknown id) run on the writer's thread too.

Every request first passes :meth:`BrokerService.check_serving`: 503 (``NotActive``)
once the broker shuts down (:meth:`BrokerService.stop_serving`) or, with
``--ha-lock``, while its leadership is not confirmed (the ``gate``, set by ``app.py``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from .. import history
from .. import scheduling as core
from .._version import __version__
from ..errors import (
    CannotFit,
    CapacityConflict,
    Conflict,
    DuplicateRequest,
    Forbidden,
    GPULeaseError,
    InvalidRequest,
    LeaseExpired,
    LeaseGone,
    LeaseNotFound,
    LeaseRevoked,
    NodeNotFound,
    NotActive,
    UnknownGPU,
)
from ..model import (
    GPU,
    QUOTA_LEVELS,
    Changes,
    Identity,
    Lease,
    Node,
    PoolState,
    Quota,
    QuotaBook,
    Request,
    ppm_to_fraction,
)
from ..scheduling import Ask, Existing, Grant, Policy, Queued
from ..store import Store
from .kernel_places import KernelPlaces
from .writer import Writer

log = logging.getLogger("gpu_lease.broker")

T = TypeVar("T")

#: lease states that end a lease (their hold times feed the estimated waits)
ENDED_STATES = ("released", "revoked", "expired")
#: heartbeats persisted per transaction by the reaper (see ``_persist_heartbeats``)
HEARTBEATS_PER_COMMIT = 200
#: estimated waits are computed at most this often (s)
ETA_CACHE_S = 1.0


class Metrics(Protocol):
    """What the service reports; ``metrics.BrokerMetrics`` implements it."""

    def observe_acquire(self, seconds: float, outcome: str) -> None: ...
    def observe_queue_wait(self, seconds: float) -> None: ...
    def refused(self, reason: str) -> None: ...
    def ended(self, state: str, count: int) -> None: ...
    def enforced(self, action: str, count: int) -> None: ...
    def committed(self, changes: int) -> None: ...


class _NoMetrics:
    def observe_acquire(self, seconds: float, outcome: str) -> None:
        pass

    def observe_queue_wait(self, seconds: float) -> None:
        pass

    def refused(self, reason: str) -> None:
        pass

    def ended(self, state: str, count: int) -> None:
        pass

    def committed(self, changes: int) -> None:
        pass

    def enforced(self, action: str, count: int) -> None:
        pass


@dataclass
class AcquireResult:
    """An acquire's outcome: ``granted`` (a new lease), ``repeated`` (the kernel's lease
    again) or ``queued``; the handler maps it to an HTTP status."""

    outcome: str
    lease: Lease | None = None
    request: Request | None = None
    position: int = 0
    reason: str = ""
    #: estimated seconds until the grant (``scheduling.estimate_waits``), if it has one
    eta_seconds: float | None = None
    #: how many requests wait in the queue (a queued outcome's answer says so)
    queue_length: int = 0


@dataclass(frozen=True)
class GPUHolding:
    """A GPU of the pool and what is leased on it now (``gpus()``)."""

    gpu: GPU
    allocated_ppm: int
    leases: int


@dataclass(frozen=True)
class Health:
    gpus: int
    active_leases: int
    queued: int
    uptime_s: float
    version: str = __version__


@dataclass(frozen=True)
class Waiting:
    """A waiting request at its place in the queue (``queue()``)."""

    position: int
    request: Request
    waiting_s: float
    eta_seconds: float | None


@dataclass(frozen=True)
class QuotaStanding:
    """A user's effective quota with its sources, their own record and what they hold."""

    user: str
    groups: frozenset[str]
    effective: core.EffectiveQuota
    own: Quota | None
    held_ppm: int
    leases: int


@dataclass(frozen=True)
class NodeView:
    """A registered node and its state now (``up``, ``lost``, ``drained``)."""

    node: Node
    state: str


@dataclass(frozen=True)
class Heartbeat:
    """What a node agent's heartbeat gets back: the node's state, the kernel pids to watch
    (its leases' pids) and the ones whose processes to kill (``--enforce kill``)."""

    node: str
    state: str
    at: float
    watch: list[int]
    kill: list[int]
    #: the node's lease kernels ``{pid, pid_ns}`` and kernel cgroups' ``limits`` (see
    #: :mod:`.kernel_places`)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    limits: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class History:
    """The pool's history in ``step``-second buckets (``history()``)."""

    since: float
    until: float
    step: float
    user: str | None
    group: str | None
    capacity: float
    points: list[history.Point]


@dataclass(frozen=True)
class LeaseUsage:
    """``used_mb``: GPU memory its kernel's processes used at the node's last heartbeat (None
    without an agent); ``enforcement``: the layer that holds the cap (``cooperative`` or
    ``agent-MODE``); ``mps``: the state of the GPU's MPS daemon where the agent runs one."""

    used_mb: int | None
    enforcement: str
    mps: str | None


@dataclass
class _Waiter:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0


class _RandomBytes:
    """``os.urandom`` drawn 4 KiB at a time: one system call per 256 ids, not one per id.

    Each system call lets go of the interpreter lock, and the event loop's thread then
    waits for the writer's thread to hand it back (tens of µs under load). The bytes are
    the same kernel CSPRNG's; a forked child starts with an empty buffer.
    """

    SIZE = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf = b""
        self._pos = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._buf, self._pos = b"", 0

    def take(self, n: int) -> bytes:
        with self._lock:
            if self._pos + n > len(self._buf):
                self._buf, self._pos = os.urandom(max(self.SIZE, n)), 0
            out = self._buf[self._pos : self._pos + n]
            self._pos += n
            return out


_random_bytes = _RandomBytes()


def new_id() -> str:
    """An unguessable id (128 bits) for leases and queued requests.

    Never one that begins with ``-``: command lines take ids as arguments
    (``gpu-lease revoke ID``), and a leading dash reads as an option there (1 id in 64).
    """
    while True:
        lease_id = base64.urlsafe_b64encode(_random_bytes.take(16)).rstrip(b"=").decode("ascii")
        if not lease_id.startswith("-"):
            return lease_id


#: seconds between reaper passes unless the broker says otherwise (``GPULeaseBroker.reap_interval``)
REAP_INTERVAL = 5.0


def _always_serving() -> None:
    """The gate of a broker without ``--ha-lock``: it may always answer."""


class BrokerService:
    def __init__(
        self,
        store: Store,
        gpus: list[GPU],
        policy: Policy,
        *,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        id_factory: Callable[[], str] = new_id,
        reap_interval: float = REAP_INTERVAL,
    ) -> None:
        self.store = store
        self.declared = list(gpus)
        self.policy = policy
        self.clock = clock
        #: seconds between :meth:`tick` calls (``app.py``'s ``reap_interval``)
        self.reap_interval = float(reap_interval)
        self.metrics: Metrics = metrics or _NoMetrics()
        self.new_id = id_factory
        self.state = PoolState.build(gpus)
        self.quotas = QuotaBook()
        self._waiters: dict[tuple[str, str], _Waiter] = {}
        self._last_tick: float | None = None
        self.started_at = 0.0
        #: nodes registered by node agents (name -> Node)
        self.nodes: dict[str, Node] = {}
        #: GPUs that left their node's registration while leased: kept, closed, until free
        self.vanished: set[str] = set()
        #: lease id -> GPU memory (MiB) its kernel's processes used at the last heartbeat
        self.used_mb: dict[str, int] = {}
        #: lease id -> when its kernel was first seen over its lease (cleared when back under)
        self._over_since: dict[str, float] = {}
        #: leases over their cap whose overuse was already reported (``--enforce report``)
        self._over_reported: set[str] = set()
        #: hold times of recent leases: what estimated waits are made of
        self.holds = core.HoldTimes()
        self._etas: tuple[float, tuple[int, int], dict[tuple[str, str], float]] | None = None
        #: raises NotActive while this broker may not answer with state (``app.py`` sets
        #: ``Leadership.check`` with ``--ha-lock``)
        self.gate: Callable[[], None] = _always_serving
        self._closing: str | None = None
        self._none_waiting: asyncio.Event | None = None
        #: the store's one thread: group commit, reads off the loop
        self.writer = Writer(store, policy.capacity_ppm, self.metrics.committed)
        #: memory may hold changes the database refused: reload before deciding again
        self._stale = False
        self._reconciling: asyncio.Future[None] | None = None
        #: leases renewed since the reaper last persisted their heartbeats
        self._renewed: set[str] = set()
        #: each lease kernel's pid namespace and cgroup (renewals; see :mod:`.kernel_places`)
        self.kernel_places = KernelPlaces()

    # -- start-up -----------------------------------------------------------------
    def start(self) -> None:
        """Open the store, register the GPUs, rebuild state, give every active lease a TTL of grace.

        Called once by ``app.py`` before the HTTP server listens.
        """
        now = self.clock()
        self.store.open()
        self.nodes = {n.name: n for n in self.store.load_nodes(seen_at=now)}
        pool = self._pool()
        self.store.sync_gpus(pool, self.policy.capacity_ppm)
        grace = self.store.extend_active(now + self.policy.ttl)
        # a restart is not the clients' fault: waiting requests get a fresh poll window
        self._load(now, {}, pool)
        self.quotas = self.store.load_quotas()
        for ended in self.store.list_leases(states=ENDED_STATES, limit=self.holds.limit):
            if ended.ended_at is not None:
                self.holds.add(ended.ended_at - ended.created_at)
        self.started_at = now
        self._last_tick = now
        self._drain_before_serving(now)
        log.info(
            "Broker state loaded: %d GPU(s), %d active lease(s) (%d given a TTL of grace), %d waiting",
            len(self.state.gpus),
            len(self.state.leases),
            grace,
            len(self.state.queue),
        )

    def _drain_before_serving(self, now: float) -> None:
        """Grant what the queue can have (at start, on this thread: nothing serves yet).
        If the database refuses (another writer), memory is reloaded and the first reaper
        pass drains."""
        changes = Changes(now)
        core.grant_waiting(self.state, now, self.policy, changes)
        try:
            self.store.write_changes([changes], self.policy.capacity_ppm)
        except (CapacityConflict, DuplicateRequest) as exc:
            log.warning("The database refused the queue's grants at start (%s)", exc.message)
            self._load(now, {}, self._pool())

    def close(self) -> None:
        """Stop serving (waiting long-polls answer 503), persist the heartbeats not yet
        persisted, and close the store. Called at shutdown, after the loop's last request."""
        self.stop_serving("shutting down")
        self.writer.stop()
        beats = self._take_renewed(self.clock())
        if beats:
            try:
                self.store.write_changes([beats], self.policy.capacity_ppm)
            except GPULeaseError as exc:
                log.warning("Could not record the last heartbeats at shutdown: %s", exc.message)
        self.store.close()

    # -- serving or not ---------------------------------------------------------------
    def check_serving(self) -> None:
        """Raise :class:`NotActive` (503) unless this broker may answer with state now.

        Called at the start of every request, and by a long-poll before it answers; a
        request read from the socket after a pause longer than the leadership is refused
        here before it acts.
        """
        if self._closing is not None:
            raise NotActive(self._closing)
        self.gate()

    @property
    def waiting(self) -> int:
        """How many long-polls are waiting now."""
        return sum(w.count for w in self._waiters.values())

    async def long_polls_answered(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no long-poll waits: after :meth:`stop_serving`,
        ``app.py`` lets them answer 503 before it closes the connections."""
        if not self.waiting:
            return
        self._none_waiting = asyncio.Event()
        try:
            await asyncio.wait_for(self._none_waiting.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def stop_serving(self, why: str) -> None:
        """From now on every request answers 503, long-polls waiting now included.

        Called by ``app.py`` when it shuts down or loses the leadership, before it
        closes the connections, so that a long-poll gets an answer it retries.
        """
        if self._closing is None:
            self._closing = f"This broker is {why}; retry, and the active broker will answer."
        for waiter in self._waiters.values():
            waiter.event.set()

    # -- acquire ---------------------------------------------------------------------
    async def acquire(self, ident: Identity, ask: Ask, wait: float = 0.0) -> AcquireResult:
        """``POST /api/v1/leases``: grant, repeat, or queue (long-polling up to ``wait`` s)."""
        t0 = time.perf_counter()
        try:
            await self._ready()
            result = await self._mutate(lambda: self._acquire_once(ident, ask))
        except GPULeaseError as exc:
            self.metrics.refused(exc.code)
            raise
        if result.outcome == "queued" and wait > 0:
            result = await self._wait_for_grant(ident, ask, result, wait)
        self.metrics.observe_acquire(time.perf_counter() - t0, result.outcome)
        return result

    async def _acquire_once(self, ident: Identity, ask: Ask) -> AcquireResult:
        quota = core.effective_quota(self.quotas, ident.user, ident.groups)
        used = 0.0
        if quota.budget_fraction_hours is not None and quota.budget_window_s:
            until = self.clock()
            since = until - quota.budget_window_s
            used = await self.writer.call(
                lambda: self.store.user_usage(ident.user, since, until), read=True
            )
        now = self.clock()
        if self.nodes:
            self._close_gpus(now)  # a node silent past its grace is lost from this instant
        try:
            decision, changes = core.acquire(
                self.state, ask, quota, now, self.policy, self.new_id, used
            )
        except UnknownGPU as exc:
            raise UnknownGPU(
                f"{exc.message} List the broker's GPUs with GET /api/v1/gpus (or `gpu-lease top`).",
                **exc.details,
            ) from exc
        waiting = len(self.state.queue)  # as the decision saw it, as its position is
        await self._commit(changes)  # a repeat awaits what it repeats
        outcome = decision.outcome
        if isinstance(outcome, Existing):
            return AcquireResult("repeated", lease=outcome.lease)
        if isinstance(outcome, Queued):
            if outcome.new:
                log.info(
                    "Queued %s kernel %s for %g of a GPU at position %d",
                    ident.user,
                    ask.kernel_id,
                    ppm_to_fraction(ask.fraction_ppm),
                    outcome.position,
                )
            return AcquireResult(
                "queued",
                request=outcome.request,
                position=outcome.position,
                reason=outcome.reason,
                eta_seconds=self.eta(outcome.request.key, now),
                queue_length=waiting,
            )
        assert isinstance(outcome, Grant)
        log.info(
            "Granted %s kernel %s %g of GPU %s (lease %s…)",
            ident.user,
            ask.kernel_id,
            ppm_to_fraction(ask.fraction_ppm),
            outcome.lease.gpu_uuid,
            outcome.lease.id[:6],
        )
        return AcquireResult("granted", lease=outcome.lease)

    async def _wait_for_grant(
        self, ident: Identity, ask: Ask, queued: AcquireResult, wait: float
    ) -> AcquireResult:
        key = (ident.user, ask.kernel_id)
        waiter = self._waiters.setdefault(key, _Waiter())
        waiter.count += 1
        deadline = asyncio.get_running_loop().time() + wait
        try:
            while True:
                self.check_serving()
                lease = self.state.lease_for_kernel(*key)
                if lease is not None:
                    await self.writer.barrier()  # the grant is in the database
                    req = queued.request
                    if req is not None:
                        self.metrics.observe_queue_wait(self.clock() - req.arrived_at)
                    return AcquireResult("granted", lease=lease)
                req = self.state.queue.get(key)
                if req is None:
                    raise LeaseGone(
                        "Your queued GPU request was cancelled before a GPU became free. "
                        "Start the kernel again to rejoin the queue.",
                        state="cancelled",
                    )
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    await self.writer.barrier()
                    now = self.clock()
                    req.last_polled_at = now
                    return AcquireResult(
                        "queued",
                        request=req,
                        position=core.position_of(self.state, key, now, self.policy),
                        reason=queued.reason,
                        eta_seconds=self.eta(key, now),
                        queue_length=len(self.state.queue),
                    )
                waiter.event.clear()
                try:
                    await asyncio.wait_for(waiter.event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            waiter.count -= 1
            if waiter.count <= 0:
                self._waiters.pop(key, None)
            if self._none_waiting is not None and not self.waiting:
                self._none_waiting.set()
            req = self.state.queue.get(key)
            if req is not None:
                req.last_polled_at = self.clock()

    # -- renew / release ----------------------------------------------------------------
    async def renew(
        self,
        ident: Identity,
        lease_id: str,
        *,
        pid: int | None = None,
        execution_state: str | None = None,
        last_activity: float | None = None,
        pid_ns: int | None = None,
        cgroup: str | None = None,
    ) -> Lease:
        """``POST /api/v1/leases/{id}/renew``: a new TTL; 410 with the reason if it ended.

        Memory only: the reaper's next pass persists the heartbeat (see the module's
        docstring). A lease active in the database but not in memory is adopted (memory
        reloaded).
        """
        await self._ready()
        lease = self.state.leases.get(lease_id)
        if lease is None:
            lease = await self._adopt(ident, lease_id)
        self._check_owner(ident, lease)
        fresh = core.renewed(lease, self.clock(), self.policy, pid, execution_state, last_activity)
        self.state.update_lease(fresh)
        self._renewed.add(lease_id)
        self.kernel_places.renewed(lease_id, pid_ns, cgroup)
        return fresh

    async def release(self, ident: Identity, lease_id: str) -> None:
        """``DELETE /api/v1/leases/{id}``: end a lease, or cancel a queued request. Idempotent.

        An id memory does not hold is looked up in the database: a queued request there
        is deleted, an active lease there is ended there; 404 only if neither exists.
        """
        await self._ready()
        if await self._mutate(lambda: self._release_once(ident, lease_id)):
            return
        await self._release_unknown(ident, lease_id)

    async def _release_once(self, ident: Identity, lease_id: str) -> bool:
        """End the lease or cancel the request ``lease_id`` memory holds; False if it holds none."""
        lease = self.state.leases.get(lease_id)
        now = self.clock()
        if lease is not None:
            self._check_owner(ident, lease)
            await self._commit(core.end(self.state, [(lease, "released", None)], now, self.policy))
            log.info(
                "Released lease %s… of %s kernel %s", lease_id[:6], lease.user, lease.kernel_id
            )
            return True
        req = next((r for r in self.state.queue.values() if r.id == lease_id), None)
        if req is None:
            return False
        self._check_owner(ident, req)
        await self._commit(core.cancel(self.state, [req], "cancelled", now, self.policy))
        log.info("Cancelled queued request of %s kernel %s", req.user, req.kernel_id)
        return True

    async def revoke(self, ident: Identity, lease_id: str, reason: str) -> Lease:
        """An admin ends someone's lease; its provisioner stops the kernel and shows ``reason``.

        Called by ``POST /api/v1/leases/{id}/revoke``; returns the lease as ended.
        """
        await self._ready()
        self._require_admin(ident)

        async def once() -> Lease:
            lease = self.state.leases.get(lease_id)
            if lease is None:
                lease = await self._adopt(ident, lease_id)
            now = self.clock()
            await self._commit(core.end(self.state, [(lease, "revoked", reason)], now, self.policy))
            return replace(lease, state="revoked", ended_at=now, reason=reason)

        ended = await self._mutate(once)
        log.info(
            "Revoked lease %s… of %s kernel %s by %s: %s",
            lease_id[:6],
            ended.user,
            ended.kernel_id,
            ident.user,
            reason,
        )
        return ended

    # -- reads ------------------------------------------------------------------------
    async def get_lease(self, ident: Identity, lease_id: str) -> Lease:
        """One lease; one that memory does not hold comes from the database (adopted if active)."""
        await self._ready()
        lease = self.state.leases.get(lease_id)
        if lease is not None:
            self._check_owner(ident, lease)
            return lease
        found = await self._visible_lease(ident, lease_id)
        return await self._adopt(ident, lease_id, found) if found.active else found

    async def list_leases(
        self,
        ident: Identity,
        *,
        user: str | None = None,
        all_users: bool = False,
        history: bool = False,
    ) -> list[Lease]:
        """Own leases; admins may ask for ``all_users`` or another ``user``."""
        await self._ready()
        if (all_users or (user is not None and user != ident.user)) and not ident.admin:
            raise Forbidden("Only GPU lease admins may list other users' leases.")
        who = None if all_users and user is None else (user or ident.user)
        if history:
            return await self.writer.call(lambda: self.store.list_leases(user=who), read=True)
        leases = self.state.leases.values()
        return sorted(
            (x for x in leases if who is None or x.user == who), key=lambda x: x.created_at
        )

    async def queue(self, ident: Identity) -> list[Waiting]:
        """``GET /api/v1/queue``: the waiting requests in queue order; a user sees their own."""
        await self._ready()
        now = self.clock()
        return [
            Waiting(pos, req, now - req.arrived_at, self.eta(req.key, now))
            for pos, req in enumerate(core.queue_order(self.state, now, self.policy), start=1)
            if ident.admin or req.user == ident.user
        ]

    def eta(self, key: tuple[str, str], now: float) -> float | None:
        """Estimated seconds until the waiting request ``key`` is granted, or None.

        ``scheduling.estimate_waits`` over the whole queue, computed at most once per
        second (every ``GET /api/v1/queue`` and queued answer asks).
        """
        shape = (len(self.state.queue), len(self.state.leases))
        if (
            self._etas is None
            or self._etas[1] != shape
            or not 0 <= now - self._etas[0] < ETA_CACHE_S
        ):
            etas = core.estimate_waits(self.state, now, self.policy, self.holds)
            self._etas = (now, shape, etas)
        eta = self._etas[2].get(key)
        return None if eta is None else round(eta)

    async def gpus(self) -> list[GPUHolding]:
        """``GET /api/v1/gpus``: each GPU in the pool's order, with what is leased on it."""
        await self._ready()
        st = self.state
        return [
            GPUHolding(g, st.allocated.get(g.uuid, 0), st.lease_count.get(g.uuid, 0))
            for g in st.ordered_gpus()
        ]

    def health(self) -> Health:
        self.check_serving()
        return Health(
            gpus=len(self.state.gpus),
            active_leases=len(self.state.leases),
            queued=len(self.state.queue),
            uptime_s=self.clock() - self.started_at,
        )

    # -- quotas and usage ---------------------------------------------------------------
    def get_quota(self, ident: Identity, level: str, name: str = "") -> tuple[Quota, Quota | None]:
        """A quota record and, for a user's, the quota admission applies to them (for
        another user than the caller: without their groups). Users may read the default,
        their own and their groups' quotas."""
        self.check_serving()
        _check_level(level)
        if not ident.admin:
            if level == "user" and name != ident.user:
                raise Forbidden("You may read only your own quota.")
            if level == "group" and name not in ident.groups:
                raise Forbidden("You may read only the quotas of groups you belong to.")
        quota = self._quota_record(level, name)
        if quota is None:
            raise LeaseNotFound(f"No {level} quota is set for {name!r}.")
        if level != "user":
            return quota, None
        groups = ident.groups if name == ident.user else frozenset()
        return quota, core.effective_quota(self.quotas, name, groups)

    def my_quota(self, ident: Identity) -> QuotaStanding:
        """The caller's effective quota (with each value's source) and what they hold now."""
        self.check_serving()
        return self._standing(ident.user, ident.groups)

    def _standing(self, user: str, groups: frozenset[str]) -> QuotaStanding:
        return QuotaStanding(
            user,
            groups,
            core.quota_sources(self.quotas, user, groups),
            self.quotas.users.get(user),
            self.state.held_by_user.get(user, 0),
            self.state.leases_by_user.get(user, 0),
        )

    def check_may_read_quota_of(self, ident: Identity, user: str) -> str:
        """Admins may read anyone's effective quota; a user only their own (``user``)."""
        if user != ident.user and not ident.admin:
            raise Forbidden("You may read only your own quota.")
        return user

    def effective_quota_of(
        self, ident: Identity, user: str, groups: frozenset[str]
    ) -> QuotaStanding:
        """``GET /api/v1/quotas/users/{name}?effective=1``: the quota admission applies.

        Computed by :func:`scheduling.quota_sources`, the function every acquire's
        admission uses, for ``user`` in ``groups`` (the handler asks the authenticator).
        Its ``effective.sources`` names, per field, the level that set it (``default``,
        ``group NAME`` or ``user``); ``own`` is the user-level record (None when none).
        """
        self.check_serving()
        self.check_may_read_quota_of(ident, user)
        return self._standing(user, groups)

    def list_quotas(self, ident: Identity) -> QuotaBook:
        self.check_serving()
        self._require_admin(ident)
        return self.quotas

    async def put_quota(self, ident: Identity, level: str, name: str, quota: Quota) -> Quota:
        await self._ready()
        self._require_admin(ident)
        _check_level(level)
        key = name if level != "default" else ""
        await self.writer.call(lambda: self.store.put_quota(level, key, quota))
        self._set_quota(level, name, quota)
        log.info("Quota %s %r set by %s: %s", level, name, ident.user, quota.to_json())
        await self._grant_waiting()
        return quota

    def apply_quotas(self, entries: list[tuple[str, str, Quota]], source: str) -> int:
        """Set every ``(level, name, quota)`` of a quotas file, without an identity.

        Called by ``app.py`` (``--quotas-file``) after :meth:`start`, before listening, on
        every broker start: the file's entries replace what the API set for the same
        default/group/user; quotas the file does not name are left as they are.
        """
        for level, name, quota in entries:
            _check_level(level)
            name = name if level != "default" else ""
            self.store.put_quota(level, name, quota)
            self._set_quota(level, name, quota)
        log.info("Applied %d quota(s) from %s", len(entries), source)
        self._drain_before_serving(self.clock())
        return len(entries)

    async def delete_quota(self, ident: Identity, level: str, name: str = "") -> None:
        await self._ready()
        self._require_admin(ident)
        _check_level(level)
        key = name if level != "default" else ""
        await self.writer.call(lambda: self.store.delete_quota(level, key))
        if level == "default":
            self.quotas.default = Quota()
        elif level == "group":
            self.quotas.groups.pop(name, None)
        else:
            self.quotas.users.pop(name, None)
        log.info("Quota %s %r removed by %s", level, name, ident.user)

    async def usage(self, ident: Identity, since: float, by: str = "user") -> dict[str, float]:
        """Fraction-hours per user or group since ``since``; a student sees only their own."""
        await self._ready()
        if by not in ("user", "group"):
            raise InvalidRequest("'by' must be 'user' or 'group'.")
        now = self.clock()
        if since > now:
            raise InvalidRequest("'since' is in the future.")
        if not ident.admin and by == "user":
            mine = await self.writer.call(
                lambda: self.store.user_usage(ident.user, since, now), read=True
            )
            return {ident.user: mine}
        rows = await self.writer.call(lambda: self.store.usage(since, now, by), read=True)
        if not ident.admin:
            rows = {k: v for k, v in rows.items() if k in ident.groups}
        return rows

    async def history(
        self,
        ident: Identity,
        since: float,
        step: float,
        *,
        group: str | None = None,
        user: str | None = None,
    ) -> History:
        """Allocation, queue length and waits per ``step`` seconds since ``since``.

        Called by ``GET /api/v1/history`` (the dashboard's plots). Admins see the whole
        pool, or one ``user``'s or one course's (``group``, ``""``: no course) part; anyone
        else only their own leases and requests (``user`` may name only themselves).
        """
        await self._ready()
        if not ident.admin:
            if user is not None and user != ident.user:
                raise Forbidden("Only GPU lease admins may see other users' history.")
            user = ident.user
        now = self.clock()
        if since > now:
            raise InvalidRequest("'since' is in the future.")
        held, queued = await self.writer.call(
            lambda: self.store.history(since, now, user=user), read=True
        )
        try:
            points = history.compute(held, queued, since, now, step, group=group)
        except ValueError as exc:
            raise InvalidRequest(
                f"A step of {step:g} s since then gives more than {history.MAX_POINTS} "
                "points; choose a larger 'step' or a later 'since'."
            ) from exc
        return History(
            since=points[0].t if points else since,
            until=now,
            step=step,
            user=user,
            group=group,
            capacity=len(self.state.gpus) * ppm_to_fraction(self.policy.capacity_ppm),
            points=points,
        )

    # -- node agents ------------------------------------------------------------------
    async def register_node(
        self,
        ident: Identity,
        name: str,
        gpus: list[GPU],
        agent_version: str,
        enforce: str = "report",
    ) -> NodeView:
        """``PUT /api/v1/nodes/{node}``: (re-)register a node's GPUs; it is up (not drained).

        A GPU another node (or the ``--gpus`` declaration) already has is refused (403);
        a GPU missing from this registration that still carries leases stays in the pool,
        closed, until its leases end.
        """
        await self._ready()
        self._check_node_caller(ident, name)
        now = self.clock()
        owners = {g.uuid: g.node for g in self.declared}
        for other in self.nodes.values():
            if other.name != name:
                owners.update((g.uuid, other.name) for g in other.gpus)
        for g in gpus:
            if g.uuid in owners:
                raise Forbidden(
                    f"GPU {g.uuid} belongs to node {owners[g.uuid]!r}, not {name!r}; an agent "
                    "registers only its own node's GPUs (check the agent's --node).",
                    gpu_uuid=g.uuid,
                )
        old = self.nodes.get(name)
        node = Node(
            name=name,
            gpus=[replace(g, node=name) for g in gpus],
            agent_version=agent_version,
            registered_at=old.registered_at if old is not None else now,
            last_seen=now,
            enforce=enforce,
        )
        self.nodes[name] = node
        pool = self._pool()
        keep = pool + self._vanishing(pool)

        def record() -> None:
            self.store.sync_gpus(keep, self.policy.capacity_ppm)
            self.store.put_node(node)

        try:
            await self.writer.call(record)
        except GPULeaseError:
            if old is None:
                self.nodes.pop(name)
            else:
                self.nodes[name] = old
            raise
        self._apply_pool(pool)
        self._close_gpus(now)
        log.info(
            "Node %s registered %d GPU(s) (agent %s)%s",
            name,
            len(gpus),
            agent_version,
            "" if old is None else " again",
        )
        await self._grant_waiting()
        return NodeView(node, core.node_state(node, now, self.policy))

    async def node_heartbeat(
        self,
        ident: Identity,
        name: str,
        usage: list[tuple[int, str, int]],
        at: float | None = None,
        mps: dict[str, str] | None = None,
        kernels: dict[tuple[int, int], int] | None = None,
        driver_limits: list[str] | None = None,
    ) -> Heartbeat:
        """``POST /api/v1/nodes/{node}/heartbeat``: the node is alive; its per-process usage
        and (agents with ``--mps``) its GPUs' MPS daemon states.

        Samples or MPS states of a GPU this node did not register are refused (403), memory
        above the GPU's size is refused (400); nothing is changed then. A report never frees or
        grants capacity: leases end only by release, revoke or TTL.
        """
        await self._ready()
        self._check_node_caller(ident, name)
        node = self.nodes.get(name)
        if node is None:
            raise NodeNotFound(
                f"Node {name!r} is not registered; its agent registers it with "
                f"PUT /api/v1/nodes/{name} first (restart the agent)."
            )
        mine = {g.uuid: g for g in node.gpus}
        for pid, uuid, used in usage:
            gpu = mine.get(uuid)
            if gpu is None:
                raise Forbidden(
                    f"GPU {uuid} is not one of node {name!r}'s registered GPUs; register it "
                    "again (PUT) before reporting its processes.",
                    gpu_uuid=uuid,
                )
            if used > gpu.memory_mb:
                raise InvalidRequest(
                    f"Process {pid} cannot use {used} MiB of GPU {uuid}, which has "
                    f"{gpu.memory_mb} MiB; report what NVML measures."
                )
        for uuid in mps or {}:
            if uuid not in mine:
                raise Forbidden(
                    f"GPU {uuid} is not one of node {name!r}'s registered GPUs; an agent "
                    "reports MPS daemons of its own GPUs only.",
                    gpu_uuid=uuid,
                )
        now = self.clock()
        was = core.node_state(node, now, self.policy)
        node.last_seen = now
        node.usage = list(usage)
        node.mps = dict(mps or {})
        self.kernel_places.forget_ended(set(self.state.leases))
        self.kernel_places.driver_limited[name] = set(driver_limits or ())
        ends, kill = self._account_usage(node, usage, now, kernels)
        if was == "lost":
            log.info("Node %s is back (its agent heartbeats again)", name)
            self._close_gpus(now)
        if ends:
            await self._mutate(lambda: self._commit(core.end(self.state, ends, now, self.policy)))
            self._log_overuse(node, ends, kill)
        elif was == "lost":
            await self._grant_waiting()
        here = [x for x in self.state.leases.values() if x.gpu_uuid in mine]
        watch = sorted({x.pid for x in here if x.pid})
        return Heartbeat(
            name,
            core.node_state(node, now, self.policy),
            now,
            watch,
            kill,
            self.kernel_places.kernels(here),
            self.kernel_places.limits(here, self.policy.context_overhead_mb),
        )

    def _account_usage(
        self,
        node: Node,
        usage: list[tuple[int, str, int]],
        now: float,
        kernels: dict[tuple[int, int], int] | None = None,
    ) -> tuple[list[tuple[Lease, str, str | None]], list[int]]:
        """Map samples to leases by kernel pid; which leases over their cap past the grace end.

        The agent reports a kernel's child processes under the kernel's host pid (it walks
        /proc), and ``kernels`` maps namespaced kernels to host pids. Returns the leases to
        revoke and the kernel host pids whose processes the agent should kill (``--enforce
        kill``). Changes no lease itself.
        """
        mine = {g.uuid for g in node.gpus}
        leases = [x for x in self.state.leases.values() if x.gpu_uuid in mine]
        by_pid = self.kernel_places.by_host_pid(leases, kernels)
        host_of = {x.id: pid for pid, x in by_pid.items()}
        used: dict[str, int] = {}
        node.unleased = []
        for pid, uuid, mb in usage:
            lease = by_pid.get(pid)
            if lease is None:
                node.unleased.append((pid, uuid, mb))
            else:
                used[lease.id] = used.get(lease.id, 0) + mb
        ends: list[tuple[Lease, str, str | None]] = []
        kill: list[int] = []
        for lease in leases:
            mb = used.get(lease.id, 0)
            self.used_mb[lease.id] = mb
            if node.enforce == "off" or not core.over_lease(lease, mb, self.policy):
                self._over_since.pop(lease.id, None)
                self._over_reported.discard(lease.id)
                continue
            since = self._over_since.setdefault(lease.id, now)
            if now - since < self.policy.overuse_grace:
                continue
            reason = core.overuse_reason(mb, lease, self.policy)
            if node.enforce in ("revoke", "kill"):
                ends.append((lease, "revoked", reason))
                if node.enforce == "kill" and lease.id in host_of:
                    kill.append(host_of[lease.id])
            elif lease.id not in self._over_reported:  # once per episode over the cap
                self._over_reported.add(lease.id)
                self.metrics.enforced("reported", 1)
                log.warning(
                    "Lease %s… of %s on node %s: %s", lease.id[:6], lease.user, node.name, reason
                )
        return ends, kill

    def _log_overuse(
        self, node: Node, ends: list[tuple[Lease, str, str | None]], kill: list[int]
    ) -> None:
        self.metrics.enforced("revoked", len(ends))
        if kill:
            self.metrics.enforced("killed", len(kill))
        for lease, _, why in ends:
            log.warning(
                "Revoked lease %s… of %s kernel %s on node %s: %s",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                node.name,
                why,
            )

    def queue_length(self) -> int:
        """How many requests wait in the queue (everyone's, also for a student)."""
        return len(self.state.queue)

    def lease_facts(self, lease: Lease) -> tuple[GPU | None, LeaseUsage]:
        """What a lease's answer shows beside the lease: its GPU and :meth:`lease_usage`."""
        return self.state.gpus.get(lease.gpu_uuid), self.lease_usage(lease)

    def lease_usage(self, lease: Lease) -> LeaseUsage:
        """What the lease's node reports: see :class:`LeaseUsage`."""
        node = self._node_of(lease.gpu_uuid)
        if node is None:
            return LeaseUsage(None, "cooperative", None)
        layer = f"agent-{node.enforce}"
        if self.kernel_places.driver_limited_on(node.name, lease.id):
            layer = f"driver+{layer}"  # the driver caps the kernel's cgroup (R615+)
        return LeaseUsage(self.used_mb.get(lease.id), layer, node.mps.get(lease.gpu_uuid))

    def _node_of(self, gpu_uuid: str) -> Node | None:
        gpu = self.state.gpus.get(gpu_uuid)
        node = self.nodes.get(gpu.node) if gpu is not None else None
        return node if node is not None and any(g.uuid == gpu_uuid for g in node.gpus) else None

    async def drain_node(self, ident: Identity, name: str) -> None:
        """``DELETE /api/v1/nodes/{node}``: no new leases there; held ones stay. Idempotent."""
        await self._ready()
        self._check_node_caller(ident, name)
        node = self.nodes.get(name)
        if node is None:
            raise NodeNotFound(f"Node {name!r} is not registered; there is nothing to drain.")
        if not node.drained:
            await self.writer.call(lambda: self.store.set_node_drained(name, True))
            node.drained = True
            log.info("Node %s drained by %s", name, ident.user)
        self._close_gpus(self.clock())

    async def list_nodes(self, ident: Identity) -> list[NodeView]:
        """``GET /api/v1/nodes``: every registered node with its state (the handler shows
        admins their GPUs and usage too)."""
        await self._ready()
        now = self.clock()
        return [
            NodeView(node, core.node_state(node, now, self.policy))
            for node in sorted(self.nodes.values(), key=lambda n: n.name)
        ]

    def node_states(self) -> dict[str, int]:
        """How many registered nodes are up, lost and drained (for /metrics)."""
        now = self.clock()
        counts = dict.fromkeys(("up", "lost", "drained"), 0)
        for node in self.nodes.values():
            counts[core.node_state(node, now, self.policy)] += 1
        return counts

    def unleased_processes(self) -> int:
        """GPU processes the agents last reported that belong to no lease (for /metrics)."""
        return sum(len(node.unleased) for node in self.nodes.values())

    def gpu_used_mb(self) -> dict[str, int]:
        """GPU uuid -> MiB its processes use, from each node's last heartbeat (for /metrics)."""
        out: dict[str, int] = {}
        for node in self.nodes.values():
            for g in node.gpus:
                out[g.uuid] = 0
            for _, uuid, mb in node.usage:
                out[uuid] = out.get(uuid, 0) + mb
        return out

    def _check_node_caller(self, ident: Identity, name: str) -> None:
        if ident.node is not None:
            if ident.node != name:
                raise Forbidden(
                    f"This agent token belongs to node {ident.node!r}; it may not speak for "
                    f"node {name!r} (check the agent's --node)."
                )
            return
        self._require_admin(ident)

    def _pool(self) -> list[GPU]:
        """The declared GPUs and every registered node's GPUs."""
        pool = {g.uuid: g for g in self.declared}
        for node in self.nodes.values():
            for g in node.gpus:
                pool.setdefault(g.uuid, g)
        return list(pool.values())

    def _vanishing(self, pool: list[GPU]) -> list[GPU]:
        """GPUs in the state but not in ``pool`` that still carry leases (they stay, closed)."""
        keep = {g.uuid for g in pool}
        return [
            g
            for u, g in self.state.gpus.items()
            if u not in keep and self.state.lease_count.get(u, 0) > 0
        ]

    def _apply_pool(self, pool: list[GPU]) -> None:
        """Make the in-memory pool ``pool`` plus the leased GPUs that left it."""
        keep = {g.uuid for g in pool}
        for g in pool:
            self.state.put_gpu(g)
        self.vanished = {g.uuid for g in self._vanishing(pool)}
        for u in list(self.state.gpus):
            if u not in keep and u not in self.vanished:
                self.state.drop_gpu(u)

    async def _forget_vanished(self) -> None:
        """Drop vanished GPUs whose last lease ended (from memory and the store)."""
        free = {u for u in self.vanished if not self.state.lease_count.get(u, 0)}
        if not free:
            return
        self.vanished -= free
        for u in free:
            self.state.drop_gpu(u)
        pool = list(self.state.gpus.values())
        await self.writer.call(lambda: self.store.sync_gpus(pool, self.policy.capacity_ppm))
        log.info("Removed %d GPU(s) that left their node once their leases ended", len(free))

    def _close_gpus(self, now: float) -> None:
        self.state.closed = core.closed_gpus(self.nodes.values(), now, self.policy) | self.vanished

    # -- the reaper -------------------------------------------------------------------
    async def tick(self) -> dict[str, int]:
        """One reaper pass: expire, drop stale requests, reclaim idle leases, drain the queue,
        and persist the heartbeats renewed since the last pass.

        Called every ``reap_interval`` seconds by ``app.py``. A gap much longer than
        expected since the last pass (longer than ``max(ttl / 2, 3 * reap_interval)``:
        a suspended process, a clock jump forward) or a clock going backward is treated
        like a restart: every active lease expires exactly one TTL from now instead of
        expiring at once (forward) or only when the clock catches up (backward).
        """
        counts = {"expired": 0, "dropped": 0, "revoked": 0, "granted": 0, "grace": 0}
        try:
            await self._ready()
        except NotActive:
            return counts  # not the active broker now: it must not decide anything
        now = self.clock()
        last = self._last_tick if self._last_tick is not None else now
        self._last_tick = now
        stall = max(self.policy.ttl / 2, 3 * self.reap_interval)
        if now - last > stall or now < last:
            for lease in list(self.state.leases.values()):
                self.state.update_lease(replace(lease, expires_at=now + self.policy.ttl))
                self._renewed.add(lease.id)
            for req in self.state.queue.values():
                req.last_polled_at = now
            counts["grace"] = len(self.state.leases)
            log.warning(
                "Reaper saw a %.0f s gap (clock jump or stall): gave %d lease(s) a TTL of grace",
                now - last,
                counts["grace"],
            )
            await self._persist_heartbeats(now)
            return counts
        reaped = await self._mutate(lambda: self._reap(now))
        counts["expired"] = len(reaped.expired)
        counts["dropped"] = len(reaped.dropped)
        counts["revoked"] = len(reaped.revoked)
        counts["granted"] = len(reaped.changes.granted)
        if reaped.expired:
            log.info("Expired %d lease(s) not renewed in time", len(reaped.expired))
        if reaped.dropped:
            log.info(
                "Dropped %d queued request(s) whose clients stopped polling", len(reaped.dropped)
            )
        if reaped.revoked:
            log.info("Revoked %d idle lease(s) for waiting requests", len(reaped.revoked))
        await self._forget_vanished()
        return counts

    async def _reap(self, now: float) -> core.Reaped:
        self._close_gpus(now)
        reaped = core.reap(self.state, now, self.policy, set(self._waiters))
        await self._commit(reaped.changes)
        await self._persist_heartbeats(now)
        return reaped

    async def _persist_heartbeats(self, now: float) -> None:
        """Write the latest heartbeat of every lease renewed since the last pass, at most
        ``HEARTBEATS_PER_COMMIT`` per transaction, one transaction after another (so a
        request arriving meanwhile waits for one of them, not for all: 10,000 kernels
        renewing every 30 s are 1,700 heartbeats per 5 s pass); drop the leases another
        writer ended in the database."""
        beats = self._take_renewed(now).renewed
        gone: dict[str, tuple[str, str | None]] = {}
        for i in range(0, len(beats), HEARTBEATS_PER_COMMIT):
            chunk = Changes(now, renewed=beats[i : i + HEARTBEATS_PER_COMMIT])
            try:
                gone.update(await self._commit(chunk))
            except GPULeaseError:
                self._renewed.update(x.id for x in beats[i + HEARTBEATS_PER_COMMIT :])
                raise
        if gone:
            # another writer ended them in the database: drop them, with their capacity
            log.warning(
                "%d renewed lease(s) had ended in the database (another writer); dropped them",
                len(gone),
            )
            ends = [
                (self.state.leases[i], st, why)
                for i, (st, why) in gone.items()
                if i in self.state.leases
            ]
            await self._commit(core.end(self.state, ends, now, self.policy))

    def _take_renewed(self, now: float) -> Changes:
        """The heartbeats not persisted yet, as changes (the set is emptied)."""
        beats = Changes(
            now, renewed=[self.state.leases[i] for i in self._renewed if i in self.state.leases]
        )
        self._renewed = set()
        return beats

    # -- internals: commit, reconcile ---------------------------------------------------
    async def _ready(self) -> None:
        """Raise unless this broker may answer now; reload memory first if it may hold
        changes the database refused."""
        self.check_serving()
        if self._stale or self.writer.poisoned:
            await self._reconcile()

    async def _mutate(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt`` (decide, apply, commit); if the database refused its batch
        because another writer changed it, reload memory and decide once more."""
        try:
            return await attempt()
        except (CapacityConflict, DuplicateRequest) as exc:
            log.warning(
                "The database refused a change (%s: %s); deciding again on its state",
                exc.code,
                exc.message,
            )
            await self._reconcile()
            return await attempt()

    async def _commit(self, changes: Changes) -> dict[str, tuple[str, str | None]]:
        """Persist ``changes`` (applied to memory already) with the writer's next batch.

        Empty changes only wait until everything before them is in the database.
        Bookkeeping (hold times, metrics, usage) is done at once; long-polls whose
        requests were granted or withdrawn are woken once the batch is committed. Returns
        the renewed leases of ``changes`` that the database holds as ended. If the
        batch fails, memory is marked stale (reloaded before the next decision) and the
        error raised.
        """
        if not changes:
            await self.writer.barrier()
            return {}
        if changes.ended:
            self._note_ends(changes)
        if changes.granted or changes.ended:
            self._etas = None
        try:
            gone = await self.writer.write(changes)
        except GPULeaseError:
            self._stale = True
            for lease in changes.renewed:  # still not persisted
                self._renewed.add(lease.id)
            raise
        self._wake(
            [g.lease.user_kernel for g in changes.granted] + [r.key for r, _ in changes.dropped]
        )
        mine = {x.id for x in changes.renewed}
        return {i: v for i, v in gone.items() if i in mine}

    def _note_ends(self, changes: Changes) -> None:
        by_state: dict[str, int] = {}
        for lease, st, _ in changes.ended:
            self.used_mb.pop(lease.id, None)
            self._over_since.pop(lease.id, None)
            self._over_reported.discard(lease.id)
            self._renewed.discard(lease.id)
            self.holds.add(changes.now - lease.created_at)
            by_state[st] = by_state.get(st, 0) + 1
        for st, n in by_state.items():
            self.metrics.ended(st, n)

    async def _grant_waiting(self) -> None:
        """Grant what the queue can have now (after a quota or a node changed)."""

        async def once() -> None:
            changes = Changes(self.clock())
            core.grant_waiting(self.state, changes.now, self.policy, changes)
            await self._commit(changes)

        try:
            await self._mutate(once)
        except (CapacityConflict, DuplicateRequest) as exc:
            # the caller's own change has happened: the next reaper pass drains again
            log.error("The database refused the queue's grants twice (%s)", exc.message)

    async def _reconcile(self, *, force: bool = False) -> None:
        """Memory := the database (after a refused or failed batch, or to adopt a lease).

        One reload at a time: callers that arrive meanwhile wait for it. Raises
        ``StoreError`` if the database cannot be read (memory stays stale: the next
        request tries again).
        """
        if self._reconciling is not None:
            await asyncio.shield(self._reconciling)
            if not force:
                return
        if not (self._stale or self.writer.poisoned or force):
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reconciling = done
        try:
            polled = {r.id: r.last_polled_at for r in self.state.queue.values()}
            pool = self._pool() + [
                self.state.gpus[u] for u in self.vanished if u in self.state.gpus
            ]
            now = self.clock()
            leases, queue = await self.writer.recover(lambda: self._fetch(now, pool))
            self._install(now, polled, pool, leases, queue)
            self._stale = False
            self._wake(list(self._waiters))
            done.set_result(None)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                done.cancel()
            else:
                done.set_exception(exc)
            raise
        finally:
            self._reconciling = None
            if done.done() and not done.cancelled():
                done.exception()  # retrieved: the waiters re-raise it themselves

    def _fetch(self, now: float, pool: list[GPU]) -> tuple[list[Lease], list[Request]]:
        """(writer's thread) The database's active leases on ``pool`` and its queue.

        Leases on GPUs not in the pool are revoked; queued requests whose kernel holds an
        active lease were served (by another writer) and are dropped.
        """
        leases, queue = self.store.load_active()
        known = {g.uuid for g in pool}
        orphans = [lease for lease in leases if lease.gpu_uuid not in known]
        if orphans:
            self.store.end_leases(
                [(x.id, "revoked", now, "its GPU is no longer in the pool") for x in orphans]
            )
            log.warning("Revoked %d lease(s) on GPUs no longer in the pool", len(orphans))
        held = {x.user_kernel for x in leases}
        served = [r for r in queue if r.key in held]
        if served:
            self.store.delete_requests([r.id for r in served], outcome="dropped", at=now)
            log.warning("Dropped %d queued request(s) whose kernel holds a lease", len(served))
        return [x for x in leases if x.gpu_uuid in known], [r for r in queue if r.key not in held]

    def _install(
        self,
        now: float,
        polled: dict[str, float],
        pool: list[GPU],
        leases: list[Lease],
        queue: list[Request],
    ) -> None:
        """Memory := ``leases`` and ``queue`` from the database, on ``pool``.

        A lease memory holds keeps its newer heartbeat (heartbeats are persisted by the
        reaper only); a request's last poll is ``polled[id]``, else ``now``.
        """
        mine = self.state.leases
        fresh = []
        for lease in leases:
            known = mine.get(lease.id)
            fresh.append(
                known if known is not None and known.renewed_at > lease.renewed_at else lease
            )
        for req in queue:
            req.last_polled_at = polled.get(req.id, now)
        self.state = PoolState.build(pool, fresh, queue)
        self._etas = None
        self._close_gpus(now)

    def _load(self, now: float, polled: dict[str, float], pool: list[GPU]) -> None:
        """Memory := the database's state (at start, before serving: on this thread)."""
        self._install(now, polled, pool, *self._fetch(now, pool))

    async def _adopt(self, ident: Identity, lease_id: str, found: Lease | None = None) -> Lease:
        """A lease memory does not hold, as the database has it: 404, 403, 410 with its
        state, or (active there) the lease from memory reloaded to include it."""
        if found is None:
            found = await self._visible_lease(ident, lease_id)
        if not found.active:
            raise _gone(found)
        log.warning(
            "Lease %s… is active in the database but was not in memory; reloading the state",
            lease_id[:6],
        )
        await self._reconcile(force=True)
        lease = self.state.leases.get(lease_id)
        if lease is None:  # on a GPU no longer declared: _fetch revoked it
            gone = await self.writer.call(lambda: self.store.get_lease(lease_id), read=True)
            raise _gone(gone or found)
        return lease

    async def _release_unknown(self, ident: Identity, request_id: str) -> None:
        """DELETE of an id memory does not hold: cancel or end it in the database, or 404."""
        req = await self.writer.call(lambda: self.store.get_request(request_id), read=True)
        if req is not None:
            self._check_owner(ident, req)
            await self.writer.call(lambda: self.store.delete_requests([req.id]))
            log.info("Cancelled queued request of %s kernel %s (database)", req.user, req.kernel_id)
            return
        found = await self._visible_lease(ident, request_id)  # 404 / 403
        if found.active:
            now = self.clock()
            await self.writer.call(
                lambda: self.store.end_leases([(found.id, "released", now, None)])
            )
            self.metrics.ended("released", 1)
            log.warning(
                "Released lease %s… of %s kernel %s, active in the database but not in memory",
                found.id[:6],
                found.user,
                found.kernel_id,
            )

    def _wake(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            waiter = self._waiters.get(key)
            if waiter is not None:
                waiter.event.set()

    async def _visible_lease(self, ident: Identity, lease_id: str) -> Lease:
        lease = await self.writer.call(lambda: self.store.get_lease(lease_id), read=True)
        if lease is None:
            raise LeaseNotFound(f"No GPU lease has the id {lease_id!r}.")
        self._check_owner(ident, lease)
        return lease

    @staticmethod
    def _check_owner(ident: Identity, obj: Lease | Request) -> None:
        if obj.user != ident.user and not ident.admin:
            raise Forbidden("This GPU lease belongs to another user.")

    @staticmethod
    def _require_admin(ident: Identity) -> None:
        if not ident.admin:
            raise Forbidden(
                "Only GPU lease admins (JupyterHub admins or holders of the "
                "custom:gpu-lease:admin scope) may do this."
            )

    def _set_quota(self, level: str, name: str, quota: Quota) -> None:
        """Mirror a quota the store just recorded in the in-memory book."""
        if level == "default":
            self.quotas.default = quota
        elif level == "group":
            self.quotas.groups[name] = quota
        else:
            self.quotas.users[name] = quota

    def _quota_record(self, level: str, name: str) -> Quota | None:
        if level == "default":
            return self.quotas.default
        book = self.quotas.groups if level == "group" else self.quotas.users
        return book.get(name)


def _check_level(level: str) -> None:
    if level not in QUOTA_LEVELS:
        raise InvalidRequest(f"Quota level must be one of {', '.join(QUOTA_LEVELS)}.")


def _gone(lease: Lease) -> LeaseGone:
    """The 410 for a lease that is no longer active, with its state and reason."""
    if lease.state == "revoked":
        return LeaseRevoked(
            f"Your GPU lease was revoked: {lease.reason or 'by an administrator'}.",
            state="revoked",
            reason=lease.reason,
        )
    if lease.state == "expired":
        return LeaseExpired(
            "Your GPU lease expired because it was not renewed in time "
            "(was the Jupyter server stopped or cut off from the broker?).",
            state="expired",
            reason=lease.reason,
        )
    return LeaseGone("This GPU lease was released.", state=lease.state, reason=lease.reason)


__all__ = ["AcquireResult", "BrokerService", "CannotFit", "Conflict", "Metrics", "new_id"]
