"""The broker's service core: the state, commit/reconcile and the writer.

Who calls this: the services of ``service.py`` (``leases.py``, ``quotas.py``,
``nodes.py``, ``queries.py``), which share one :class:`ServiceCore`. Each service's
methods return outcomes (leases, plain dicts) or raise ``errors``; only the HTTP
handlers turn them into HTTP statuses and JSON. Every mutation follows one pattern:

1. a mutation of ``scheduling`` (``acquire``, ``end``, ``cancel``, ``reap``) decides
   AND applies, on the event loop, over the in-memory ``PoolState``, and returns the
   ``Changes`` it made;
2. the service hands them to the ``Writer`` (``writer.py``) through
   :meth:`ServiceCore.commit` and awaits them: the writer's thread persists every
   change submitted while its previous transaction committed in ONE transaction
   (group commit), so the loop never waits on the database and concurrent requests
   share a commit;
3. only then does the caller get its answer, and long-polls their grants.

Decisions never interleave (the loop is the lock, and a mutation applies before its
first ``await``). If a batch fails (503 ``StoreError``, or a refusal because another
writer changed the database), every caller in it gets the error, writes decided after
it are refused too, and memory is reloaded from the database before anything is
decided again (:meth:`ServiceCore.reconcile`); a refused acquire, release or reaper
pass then decides once more (:meth:`ServiceCore.mutate`). An answer read from memory
that may depend on a change in flight (a repeated acquire, a long-poll's grant) first
awaits ``Writer.barrier``. So nothing is acknowledged that is not in the database.

Renewals are not a write each: a heartbeat updates memory, and the reaper
(``leases.py``) persists the latest heartbeat of each renewed lease with its pass
(every ``reap_interval``). A restart grants every active lease one TTL of grace, so no
lease expires for a renewal that was not persisted; what a restart also needs, each
kernel's reported activity (idle reclaim), is at most one reaper pass old.

The database is the one source of truth; memory is its copy. A request about a lease
or queued request that memory does not hold asks the database (and adopts an active
lease, or ends or cancels it there), never answers from memory alone. Reads that do
go to the database (history, usage, an unknown id) run on the writer's thread too.

Every request first passes :meth:`ServiceCore.check_serving` (through
:meth:`ServiceCore.ready`): 503 (``NotActive``) once the broker shuts down
(:meth:`ServiceCore.stop_serving`) or, with ``--ha-lock``, while its leadership is not
confirmed (the ``gate``, set by ``app.py``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ...errors import (
    CapacityConflict,
    DuplicateRequest,
    Forbidden,
    GPULeaseError,
    LeaseExpired,
    LeaseGone,
    LeaseNotFound,
    LeaseRevoked,
    NotActive,
)
from ...model import (
    GPU,
    Changes,
    Identity,
    Lease,
    Node,
    PoolState,
    QuotaBook,
    Request,
)
from ..rules import estimates, node_rules, scheduling
from ..rules.kernel_places import KernelPlaces
from ..rules.node_kernels import NodeKernels
from ..rules.policy import Policy
from ..rules.sessions import Timetable
from ..store.commit_thread import Writer
from ..store.store import Store
from .long_polls import LongPolls

log = logging.getLogger("gpu_lease.broker")

T = TypeVar("T")

#: estimated waits are computed at most this often (s)
ETA_CACHE_S = 1.0
#: seconds between reaper passes unless the broker says otherwise (``GPULeaseBroker.reap_interval``)
REAP_INTERVAL = 5.0


class Metrics(Protocol):
    """What the service reports; ``metrics.BrokerMetrics`` implements it."""

    def observe_acquire(self, seconds: float, outcome: str) -> None: ...
    def observe_queue_wait(self, seconds: float) -> None: ...
    def refused(self, reason: str) -> None: ...
    def ended(self, state: str, count: int) -> None: ...
    def enforced(self, action: str, count: int) -> None: ...
    def committed(self, changes: int) -> None: ...
    def parked(self, outcome: str, count: int) -> None: ...
    def resumed(self, outcome: str, count: int) -> None: ...
    def observe_resume_wait(self, seconds: float) -> None: ...
    def session_freed(self, course: str, count: int) -> None: ...


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

    def parked(self, outcome: str, count: int) -> None:
        pass

    def resumed(self, outcome: str, count: int) -> None:
        pass

    def observe_resume_wait(self, seconds: float) -> None:
        pass

    def session_freed(self, course: str, count: int) -> None:
        pass


@dataclass(frozen=True)
class ParkSettings:
    """The broker's parking options (``GPULeaseBroker.park_idle``, ``park_host_reserve_mb``,
    ``park_timeout``; see ``options.py``), handed to :class:`ServiceCore` by ``app.py``."""

    #: park idle leases instead of revoking them, where the node can (see ``park_policy.py``)
    idle: bool = True
    #: host RAM (MiB) a node keeps free beyond what parked kernels take
    host_reserve_mb: int = 2048
    #: seconds a lease may stay ``parking`` before it is revoked
    timeout: float = 120.0


@dataclass
class NodeParking:
    """What a node's agent last said about parking (its latest heartbeat; memory only)."""

    #: the node's libcuda offers the checkpoint API (``node/checkpoint.py`` ``support()``)
    checkpoint: bool = False
    #: MemAvailable of the node's host, MiB (None: not reported)
    host_memory_available_mb: int | None = None


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


def _always_serving() -> None:
    """The gate of a broker without ``--ha-lock``: it may always answer."""


class ServiceCore:
    """The state every service shares, and the one way to change it (``commit``).

    Owns the in-memory pool (``state``), the quota book, the registered nodes, the
    long-polls waiting for a grant, the writer and its reconcile. Built by
    ``BrokerService``; the services call it, never each other.
    """

    def __init__(
        self,
        store: Store,
        gpus: list[GPU],
        policy: Policy,
        *,
        clock: Callable[[], float],
        metrics: Metrics | None,
        id_factory: Callable[[], str],
        reap_interval: float,
        park: ParkSettings | None = None,
    ) -> None:
        self.store = store
        self.declared = list(gpus)
        self.policy = policy
        self.clock = clock
        #: seconds between the reaper's passes (``Reaper.tick``, ``app.py``'s ``reap_interval``)
        self.reap_interval = float(reap_interval)
        self.metrics: Metrics = metrics or _NoMetrics()
        self.new_id = id_factory
        self.state = PoolState.build(gpus)
        self.book = QuotaBook()
        #: the acquire and resume long-polls waiting now
        self.polls = LongPolls()
        self.last_tick: float | None = None
        self.started_at = 0.0
        #: nodes registered by node agents (name -> Node)
        self.nodes: dict[str, Node] = {}
        #: GPUs that left their node's registration while leased: kept, closed, until free
        self.vanished: set[str] = set()
        #: lease id -> GPU memory (MiB) its kernel's processes used at the last heartbeat
        self.used_mb: dict[str, int] = {}
        #: lease id -> when its kernel was first seen over its lease (cleared when back under)
        self.over_since: dict[str, float] = {}
        #: leases over their cap whose overuse was already reported (``--enforce report``)
        self.over_reported: set[str] = set()
        #: hold times of recent leases: what estimated waits are made of
        self.holds = estimates.HoldTimes()
        self.etas: tuple[float, tuple[int, int], dict[tuple[str, str], float]] | None = None
        #: raises NotActive while this broker may not answer with state (``app.py`` sets
        #: ``Leadership.check`` with ``--ha-lock``)
        self.gate: Callable[[], None] = _always_serving
        self._closing: str | None = None
        #: the store's one thread: group commit, reads off the loop
        self.writer = Writer(store, policy.capacity_ppm, self.metrics.committed)
        #: memory may hold changes the database refused: reload before deciding again
        self.stale = False
        self._reconciling: asyncio.Future[None] | None = None
        #: leases renewed since the reaper last persisted their heartbeats
        self.renewed: set[str] = set()
        #: each lease kernel's pid namespace and cgroup (renewals; see :mod:`.kernel_places`)
        self.kernel_places = KernelPlaces()
        #: the kernels node agents launch for their leases, in memory only (``node_kernels``)
        self.node_kernels = NodeKernels()
        #: the parking options (``options.py``)
        self.park = park or ParkSettings()
        #: node name -> what its agent last said about parking (``nodes.py`` heartbeats)
        self.node_parking: dict[str, NodeParking] = {}
        #: lease id -> when its owner first asked to resume it (``resume_wait_seconds``)
        self.resume_asked: dict[str, float] = {}
        #: the class sessions' timetable (``services/sessions.py`` keeps it)
        self.timetable = Timetable()

    def use_timetable(self, now: float) -> None:
        """The core sees the sessions near ``now`` (each reaper pass, each change)."""
        self.state.sessions = self.timetable.near(now)

    # -- start-up, serving or not ---------------------------------------------------------
    def drain_before_serving(self, now: float) -> None:
        """Grant what the queue can have (at start, on this thread: nothing serves yet).
        If the database refuses (another writer), memory is reloaded and the first reaper
        pass drains."""
        changes = Changes(now)
        scheduling.grant_waiting(self.state, now, self.policy, changes)
        try:
            self.store.write_changes([changes], self.policy.capacity_ppm)
        except (CapacityConflict, DuplicateRequest) as exc:
            log.warning("The database refused the queue's grants at start (%s)", exc.message)
            self.load(now, {}, self.pool())

    def check_serving(self) -> None:
        """Raise :class:`NotActive` (503) unless this broker may answer with state now.

        Called at the start of every request, and by a long-poll before it answers; a
        request read from the socket after a pause longer than the leadership is refused
        here before it acts.
        """
        if self._closing is not None:
            raise NotActive(self._closing)
        self.gate()

    def stop_serving(self, why: str) -> None:
        """From now on every request answers 503, long-polls waiting now included.

        Called by ``app.py`` when it shuts down or loses the leadership, before it
        closes the connections, so that a long-poll gets an answer it retries.
        """
        if self._closing is None:
            self._closing = f"This broker is {why}; retry, and the active broker will answer."
        self.polls.wake_all()

    async def ready(self) -> None:
        """Raise unless this broker may answer now; reload memory first if it may hold
        changes the database refused."""
        self.check_serving()
        if self.stale or self.writer.poisoned:
            await self.reconcile()

    async def mutate(self, attempt: Callable[[], Awaitable[T]]) -> T:
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
            await self.reconcile()
            return await attempt()

    async def commit(self, changes: Changes) -> dict[str, tuple[str, str | None]]:
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
            self.etas = None
        try:
            gone = await self.writer.write(changes)
        except GPULeaseError:
            self.stale = True
            for lease in changes.renewed:  # still not persisted
                self.renewed.add(lease.id)
            raise
        self.polls.wake_acquires(
            [g.lease.user_kernel for g in changes.granted] + [r.key for r, _ in changes.dropped]
        )
        if changes.parks or changes.ended or changes.dropped:
            self.polls.wake_resumes()
        if self.polls.orders and (changes.parks or changes.ended):
            self.polls.wake_orders(self._nodes_of(changes))
        if self.polls.kernels and changes.ended:
            self.polls.wake_kernels([x.id for x, _, _ in changes.ended])
        mine = {x.id for x in changes.renewed}
        return {i: v for i, v in gone.items() if i in mine}

    def _nodes_of(self, changes: Changes) -> set[str]:
        """The nodes whose orders ``changes`` may have changed: those of the GPUs of the
        leases whose park state changed, that ended while parking or resuming, or that
        ended with a kernel their node launched (the node ends it)."""
        leases = [
            *changes.parks,
            *(
                x
                for x, _, _ in changes.ended
                if x.park is not None or self.node_kernels.remote(x.id)
            ),
        ]
        gpus = self.state.gpus
        return {gpus[x.gpu_uuid].node for x in leases if x.gpu_uuid in gpus}

    def _note_ends(self, changes: Changes) -> None:
        by_state: dict[str, int] = {}
        for lease, st, _ in changes.ended:
            self.used_mb.pop(lease.id, None)
            self.over_since.pop(lease.id, None)
            self.over_reported.discard(lease.id)
            self.renewed.discard(lease.id)
            self.holds.add(changes.now - lease.created_at)
            by_state[st] = by_state.get(st, 0) + 1
        for st, n in by_state.items():
            self.metrics.ended(st, n)

    async def grant_waiting(self) -> None:
        """Grant what the queue can have now (after a quota or a node changed)."""

        async def once() -> None:
            changes = Changes(self.clock())
            scheduling.grant_waiting(self.state, changes.now, self.policy, changes)
            await self.commit(changes)

        try:
            await self.mutate(once)
        except (CapacityConflict, DuplicateRequest) as exc:
            # the caller's own change has happened: the next reaper pass drains again
            log.error("The database refused the queue's grants twice (%s)", exc.message)

    async def reconcile(self, *, force: bool = False) -> None:
        """Memory := the database (after a refused or failed batch, or to adopt a lease).

        One reload at a time: callers that arrive meanwhile wait for it. Raises
        ``StoreError`` if the database cannot be read (memory stays stale: the next
        request tries again). The reload is a task of its own: a caller that goes away
        (its client hung up) does not cancel it under the others waiting for it.
        """
        if self._reconciling is not None:
            await asyncio.shield(self._reconciling)
            if not force:
                return
        if not (self.stale or self.writer.poisoned or force):
            return
        reload = asyncio.ensure_future(self._reload())
        reload.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        self._reconciling = reload
        await asyncio.shield(reload)

    async def _reload(self) -> None:
        try:
            polled = {r.id: r.last_polled_at for r in self.state.queue.values()}
            pool = self.pool() + [self.state.gpus[u] for u in self.vanished if u in self.state.gpus]
            now = self.clock()
            leases, queue = await self.writer.recover(lambda: self._fetch(now, pool))
            self._install(now, polled, pool, leases, queue)
            self.stale = False
            self.polls.wake_all()
        finally:
            self._reconciling = None

    def _fetch(self, now: float, pool: list[GPU]) -> tuple[list[Lease], list[Request]]:
        """(writer's thread) The database's active leases on ``pool`` and its queue.

        Leases on GPUs not in the pool are revoked; queued requests whose kernel holds an
        active lease were served (by another writer) and are dropped, and so are resume
        requests whose parked lease is no longer parked; a parked lease's resume request stays.
        """
        leases, queue = self.store.load_active()
        known = {g.uuid for g in pool}
        orphans = [lease for lease in leases if lease.gpu_uuid not in known]
        if orphans:
            self.store.end_leases(
                [(x.id, "revoked", now, "its GPU is no longer in the pool") for x in orphans]
            )
            log.warning("Revoked %d lease(s) on GPUs no longer in the pool", len(orphans))
        # a parked lease's kernel waits for its resume: its request (``resume_of``) stays
        held = {x.user_kernel for x in leases if x.park != "parked"}
        parked = {x.id for x in leases if x.park == "parked" and x.gpu_uuid in known}
        served = [
            r
            for r in queue
            if r.key in held or (r.resume_of is not None and r.resume_of not in parked)
        ]
        if served:
            self.store.delete_requests([r.id for r in served], outcome="dropped", at=now)
            log.warning(
                "Dropped %d queued request(s) whose kernel holds a lease (or whose parked "
                "lease is gone)",
                len(served),
            )
        gone = {r.id for r in served}
        return [x for x in leases if x.gpu_uuid in known], [r for r in queue if r.id not in gone]

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
        mine = {**self.state.parked, **self.state.leases}
        fresh = []
        for lease in leases:
            known = mine.get(lease.id)
            if known is not None and known.renewed_at > lease.renewed_at:
                lease = known
            elif known is not None:  # memory only: see Lease.mps_uid
                lease.mps_uid = known.mps_uid
            fresh.append(lease)
        waiting = {r.id: r for r in self.state.queue.values()}
        for req in queue:
            req.last_polled_at = polled.get(req.id, now)
            if req.id in waiting:
                req.mps_uid = waiting[req.id].mps_uid
        self.state = PoolState.build(pool, fresh, queue)
        self.use_timetable(now)
        self.refresh_mps_owners()
        self.etas = None
        self.close_gpus(now)

    def load(self, now: float, polled: dict[str, float], pool: list[GPU]) -> None:
        """Memory := the database's state (at start, before serving: on this thread)."""
        self._install(now, polled, pool, *self._fetch(now, pool))

    async def adopt(self, ident: Identity, lease_id: str, found: Lease | None = None) -> Lease:
        """A lease memory does not hold, as the database has it: 404, 403, 410 with its
        state, or (active there) the lease from memory reloaded to include it."""
        if found is None:
            found = await self.visible_lease(ident, lease_id)
        if not found.active:
            raise _gone(found)
        log.warning(
            "Lease %s… is active in the database but was not in memory; reloading the state",
            lease_id[:6],
        )
        await self.reconcile(force=True)
        lease = self.state.find_lease(lease_id)
        if lease is None:  # on a GPU no longer declared: _fetch revoked it
            gone = await self.writer.call(lambda: self.store.get_lease(lease_id), read=True)
            raise _gone(gone or found)
        return lease

    async def visible_lease(self, ident: Identity, lease_id: str) -> Lease:
        lease = await self.writer.call(lambda: self.store.get_lease(lease_id), read=True)
        if lease is None:
            raise LeaseNotFound(f"No GPU lease has the id {lease_id!r}.")
        check_owner(ident, lease)
        return lease

    def eta(self, key: tuple[str, str], now: float) -> float | None:
        """Estimated seconds until the waiting request ``key`` is granted, or None.

        ``estimates.estimate_waits`` over the whole queue, computed at most once per
        second (every ``GET /api/v1/queue`` and queued answer asks).
        """
        shape = (len(self.state.queue), len(self.state.leases))
        if self.etas is None or self.etas[1] != shape or not 0 <= now - self.etas[0] < ETA_CACHE_S:
            etas = estimates.estimate_waits(self.state, now, self.policy, self.holds)
            self.etas = (now, shape, etas)
        eta = self.etas[2].get(key)
        return None if eta is None else round(eta)

    def pool(self) -> list[GPU]:
        """The declared GPUs and every registered node's GPUs."""
        pool = {g.uuid: g for g in self.declared}
        for node in self.nodes.values():
            for g in node.gpus:
                pool.setdefault(g.uuid, g)
        return list(pool.values())

    def mps_uids(self) -> dict[str, int]:
        """GPU uuid -> the uid its MPS server serves, as the nodes' agents last reported."""
        return {u: uid for n in self.nodes.values() for u, uid in n.mps_uid.items()}

    def refresh_mps_owners(self) -> bool:
        """The state's trusted sources of MPS owners := the agents' reports and the kernels
        they proved (``KernelPlaces.proven_uids``: lease id -> uid); True if either changed (a waiting MPS kernel may fit now). Called after
        each heartbeat, on each reaper pass and when memory is reloaded."""
        served = self.mps_uids()
        proven = self.kernel_places.proven_uids()
        changed = served != self.state.mps_uid or proven != self.state.mps_proven
        self.state.mps_uid, self.state.mps_proven = served, proven
        return changed

    def close_gpus(self, now: float) -> None:
        self.state.closed = (
            node_rules.closed_gpus(self.nodes.values(), now, self.policy) | self.vanished
        )

    async def forget_vanished(self) -> None:
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

    def take_renewed(self, now: float) -> Changes:
        """The heartbeats not persisted yet, as changes (the set is emptied)."""
        found = (self.state.find_lease(i) for i in self.renewed)  # parked ones too
        beats = Changes(now, renewed=[x for x in found if x is not None])
        self.renewed = set()
        return beats


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


def check_owner(ident: Identity, obj: Lease | Request) -> None:
    """Another user's lease or request is answered as one that does not exist (the 404
    of an unknown id, word for word): no oracle for its ids. Admins may act on any."""
    if obj.user != ident.user and not ident.admin:
        raise LeaseNotFound(f"No GPU lease has the id {obj.id!r}.")


def require_admin(ident: Identity) -> None:
    """403 unless the caller is a GPU lease admin."""
    if not ident.admin:
        raise Forbidden(
            "Only GPU lease admins (JupyterHub admins or holders of the "
            "custom:gpu-lease:admin scope) may do this."
        )


__all__ = [
    "REAP_INTERVAL",
    "Metrics",
    "NodeParking",
    "ParkSettings",
    "ServiceCore",
    "check_owner",
    "new_id",
    "require_admin",
]
