"""Plain data: GPUs, leases, queued requests, quotas, identities, and the pool state.

Nothing here does I/O or reads the clock: times are POSIX seconds passed in by the
caller. Fractions are kept as integer parts per million (``ppm``) so that fifty
leases of 0.02 fill a GPU exactly, with no float drift; they are converted to and
from floats only at the edges (JSON, kernel.json, CLI) by :mod:`provisioner.wire`'s
``fraction_to_ppm`` / ``ppm_to_fraction``, whose states and modes this module uses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import InvalidRequest

# the wire's vocabulary, re-exported for the core's callers (its one home is wire.py)
from .wire import DEFAULT_ENFORCE_MODE
from .wire import ENFORCEMENTS as ENFORCEMENTS
from .wire import LEASE_STATES as LEASE_STATES
from .wire import MPS_STATES as MPS_STATES
from .wire import NODE_STATES as NODE_STATES
from .wire import PARK_STATES as PARK_STATES
from .wire import PPM as PPM
from .wire import LeaseState as LeaseState
from .wire import ParkState as ParkState
from .wire import fraction_to_ppm as fraction_to_ppm
from .wire import ppm_to_fraction as ppm_to_fraction

#: quota levels, most general first: a user's own quota wins, else the most generous
#: of their groups', else the default
QUOTA_LEVELS: tuple[str, ...] = ("default", "group", "user")
#: the named levels' plurals, as in ``/api/v1/quotas/users/{name}`` and the keys of
#: ``GET /api/v1/quotas`` (``{"default": ..., "groups": {...}, "users": {...}}``)
QUOTA_LEVEL_PLURALS: dict[str, str] = {"group": "groups", "user": "users"}


def quota_key_problem(level: str, name: str) -> str | None:
    """Why ``(level, name)`` names no quota, as a sentence, else None: the level is one of
    :data:`QUOTA_LEVELS`; the default quota has no name, a group's or a user's has one.
    The store refuses such a key (``ValueError``), the service and the client too
    (:class:`InvalidRequest`)."""
    if level not in QUOTA_LEVELS:
        *others, last = (repr(lv) for lv in QUOTA_LEVELS)
        return f"Unknown quota level {brief(level)}: use {', '.join(others)} or {last}."
    if level == "default" and name:
        return (
            f"The default quota has no name (got {brief(name)}): leave the name out, or use "
            "the level 'user' or 'group'."
        )
    if level != "default" and not name:
        return f"A {level} quota needs the {level} name."
    return None


#: a quota's fields on the wire (REST API v1, ``gpu-lease quota``), pairwise with
#: :attr:`Quota.FIELDS`: fractions travel as floats, the budget window as seconds
QUOTA_FIELDS: tuple[str, ...] = (
    "max_fraction",
    "max_leases",
    "max_lease_fraction",
    "budget_fraction_hours",
    "budget_window",
    "priority",
)


def validate_fraction(
    value: object, subject: str = "The GPU fraction", *, upper: float = 1.0
) -> float:
    """The one rule for a GPU fraction: ``value`` as a float, or :class:`InvalidRequest`.

    A fraction is a number (not a bool), finite, above 0, at most ``upper`` (1: a whole
    GPU; a quota's ``max_fraction`` sums over GPUs and passes a larger bound) and at
    least one part per million. ``subject`` starts each message ("The GPU fraction",
    "'max_fraction'"). Every fraction passes here: kernel.json (the provisioner's trait),
    the kernelspec builder, the command line (``cli.fraction_arg`` turns text into a
    number first) and the broker's JSON (``validation.parse_fraction`` refuses strings
    first); :func:`fraction_to_ppm` of the result is its exact value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{subject} must be a number such as 0.02, not {brief(value)}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{subject} must be a finite number such as 0.02, not {brief(value)}.")
    # compare before converting: a huge int would overflow a float
    if not 0 < value <= upper:
        raise InvalidRequest(
            f"{subject} must be greater than 0 and at most {upper:g} (1 is a whole GPU), "
            f"not {brief(value)}."
        )
    if fraction_to_ppm(float(value)) < 1:
        raise InvalidRequest(
            f"{subject} of {brief(value)} is below one millionth of a GPU, the smallest "
            "fraction the broker counts; ask for a larger fraction."
        )
    return float(value)


def brief(value: object) -> str:
    """``repr(value)`` for a message, at most 40 characters (a huge int says so instead)."""
    try:
        text = repr(value)
    except ValueError:  # an int above sys.get_int_max_str_digits()
        return "a number with too many digits"
    return text if len(text) <= 40 else text[:37] + "..."


def reserved_mb(ppm: int, memory_mb: int) -> int:
    """GPU memory (MiB) a lease of ``ppm`` reserves on a GPU of ``memory_mb`` MiB: floor(f·M)."""
    return ppm * memory_mb // PPM


def memory_cap_mb(ppm: int, memory_mb: int, context_overhead_mb: int) -> int:
    """The framework cap the kernel gets: reserved memory minus the CUDA context overhead."""
    return reserved_mb(ppm, memory_mb) - context_overhead_mb


def min_ppm_for(memory_mb: int, context_overhead_mb: int) -> int:
    """The smallest fraction (ppm) whose memory cap on this GPU is at least 1 MiB."""
    # smallest p with p*M // PPM >= overhead + 1  <=>  p*M >= (overhead+1)*PPM
    return max(1, math.ceil((context_overhead_mb + 1) * PPM / memory_mb))


def min_memory_mb_for(ppm: int, context_overhead_mb: int) -> int:
    """The least GPU memory (MiB) on which a lease of ``ppm`` gets a cap of at least 1 MiB
    (:func:`min_ppm_for` turned round: the smallest M with ``p*M // PPM >= overhead + 1``)."""
    return math.ceil((context_overhead_mb + 1) * PPM / ppm)


NO_GROUP = ""


def attribution(group: str | None, groups: Iterable[str]) -> dict[str, float]:
    """The courses one lease's use counts for, each with its share (the shares sum to 1).

    The rule behind ``usage --by group`` and the dashboard's per-course view: a lease
    of a course kernel (``group`` set) counts wholly for that course; any other lease
    is split equally among the groups (courses) its user belonged to when it was
    granted (``Lease.groups``); a user in no group counts under :data:`NO_GROUP` (``""``,
    shown as "(no group)"). Leases recorded before the broker kept ``groups`` have none.
    """
    if group:
        return {group: 1.0}
    names = sorted(set(groups))
    if not names:
        return {NO_GROUP: 1.0}
    share = 1.0 / len(names)
    return dict.fromkeys(names, share)


@dataclass(frozen=True)
class GPU:
    """One physical GPU (or a declared one). ``index`` is its device index on its node."""

    uuid: str
    node: str
    name: str
    memory_mb: int
    index: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "node": self.node,
            "name": self.name,
            "memory_mb": self.memory_mb,
        }


@dataclass(frozen=True)
class Identity:
    """Who is calling, as verified from a token (never from a name the caller typed)."""

    user: str
    groups: frozenset[str] = frozenset()
    admin: bool = False
    #: set for a node agent's token: the node it speaks for (it may call only the node routes)
    node: str | None = None
    #: may read ``/metrics`` without being an admin (a scraper's token)
    metrics: bool = False


@dataclass
class Node:
    """A GPU node as its agent registered it (``PUT /api/v1/nodes/{node}``)."""

    name: str
    gpus: list[GPU]
    agent_version: str
    registered_at: float
    #: the broker's clock at the last registration or heartbeat
    last_seen: float
    drained: bool = False
    #: the agent's ``--enforce`` mode: off | report | revoke | kill
    enforce: str = DEFAULT_ENFORCE_MODE
    #: the last heartbeat's ``(pid, gpu_uuid, used_mb)`` samples
    usage: list[tuple[int, str, int]] = field(default_factory=list)
    #: the samples of that heartbeat that belong to no lease
    unleased: list[tuple[int, str, int]] = field(default_factory=list)
    #: GPU uuid -> its MPS control daemon's state, from the last heartbeat (agent ``--mps``)
    mps: dict[str, str] = field(default_factory=dict)
    #: GPU uuid -> the Unix uid its MPS server serves clients of now (absent: none), from
    #: the last heartbeat (agent ``--mps``); see :func:`provisioner.broker.rules.node_rules.mps_blocked`
    mps_uid: dict[str, int] = field(default_factory=dict)

    def summary(self, state: str) -> dict[str, Any]:
        return {
            "node": self.name,
            "state": state,
            "gpus": len(self.gpus),
            "last_seen": self.last_seen,
        }

    def detail(self, state: str) -> dict[str, Any]:
        return {
            **self.summary(state),
            "gpus": [{**g.to_json(), "index": g.index} for g in self.gpus],
            "agent_version": self.agent_version,
            "enforce": self.enforce,
            "registered_at": self.registered_at,
            "usage": [{"pid": p, "gpu_uuid": u, "used_mb": m} for p, u, m in self.usage],
            "unleased": [{"pid": p, "gpu_uuid": u, "used_mb": m} for p, u, m in self.unleased],
            "mps": dict(self.mps),
            "mps_uid": {g.uuid: self.mps_uid.get(g.uuid) for g in self.gpus},
        }


@dataclass
class Lease:
    id: str
    user: str
    kernel_id: str
    gpu_uuid: str
    fraction_ppm: int
    memory_limit_mb: int
    state: LeaseState
    created_at: float
    renewed_at: float
    expires_at: float
    group: str | None = None
    ended_at: float | None = None
    reason: str | None = None
    pid: int | None = None
    execution_state: str | None = None
    last_activity: float | None = None
    #: the user's groups (courses) when the lease was granted, sorted; see :func:`attribution`
    groups: tuple[str, ...] = ()
    #: an ``enforcement=mps`` kernel's Unix uid, as its provisioner reported it (None: not
    #: an MPS kernel). A claim by the lease's holder, not an identity: it steers its own
    #: placement, and counts for others only during ``node_rules.mps_claim_window`` after
    #: the grant (``node_rules.mps_owners``).
    #: Kept in memory only (a restarted broker learns it again from the agents' reports)
    mps_uid: int | None = None
    #: parking: None, or "parking" (the broker ordered its kernel's GPU memory
    #: into host RAM; the lease still holds its share), "parked" (it holds none: it lives
    #: in :attr:`PoolState.parked`, not :attr:`PoolState.leases`) or "resuming" (its share
    #: re-reserved on the same GPU, the restore ordered). ``state`` stays "active" all along
    park: ParkState | None = None
    #: when parking began (None unless ``park`` is set)
    parked_at: float | None = None

    @property
    def active(self) -> bool:
        """Not ended (parked leases too: they keep their id, TTL and quota)."""
        return self.state == "active"

    @property
    def wire_state(self) -> str:
        """The ``state`` the REST API shows: the park state of a live lease, else ``state``."""
        return self.park if self.park is not None and self.state == "active" else self.state

    @property
    def user_kernel(self) -> tuple[str, str]:
        return (self.user, self.kernel_id)

    def to_json(self, gpu: GPU | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "kernel_id": self.kernel_id,
            "fraction": ppm_to_fraction(self.fraction_ppm),
            "gpu": gpu.to_json() if gpu else {"uuid": self.gpu_uuid},
            "memory_limit_mb": self.memory_limit_mb,
            "state": self.wire_state,
            "group": self.group,
            "created_at": self.created_at,
            "renewed_at": self.renewed_at,
            "expires_at": self.expires_at,
            "ended_at": self.ended_at,
            "reason": self.reason,
            "pid": self.pid,
            "execution_state": self.execution_state,
            "last_activity": self.last_activity,
            "groups": list(self.groups),
            "mps_uid": self.mps_uid,
            "parked_at": self.parked_at,
        }


@dataclass
class Request:
    """An acquire that did not fit and waits in the queue.

    ``(user, kernel_id)`` identifies it: repeating the acquire finds the same place.
    ``last_polled_at`` is refreshed each time the client asks again; a request
    whose client stopped polling is dropped.
    """

    id: str
    user: str
    kernel_id: str
    fraction_ppm: int
    arrived_at: float
    last_polled_at: float
    groups: frozenset[str] = frozenset()
    group: str | None = None
    node: str | None = None
    gpu_uuids: tuple[str, ...] | None = None
    priority: int = 0
    #: as :attr:`Lease.mps_uid` (each repeat of the acquire brings it again)
    mps_uid: int | None = None
    #: a resume request (``POST /api/v1/leases/{id}/resume``): the id of the parked lease
    #: it brings back. Granting it re-reserves that lease on its GPU (``gpu_uuids``) rather
    #: than creating a lease (``scheduling.resume``)
    resume_of: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.user, self.kernel_id)


#: how a queued request left the queue: granted a lease, withdrawn by its client
#: (``DELETE``), or dropped because its client stopped polling
QUEUE_OUTCOMES: tuple[str, ...] = ("granted", "cancelled", "dropped")


@dataclass(frozen=True)
class QueueRecord:
    """One request's stay in the queue (the store's ``queue_log``), for the broker's history.

    ``left_at`` and ``outcome`` (one of :data:`QUEUE_OUTCOMES`) are ``None`` while it waits.
    """

    id: str
    user: str
    kernel_id: str
    fraction_ppm: int
    arrived_at: float
    group: str | None = None
    groups: tuple[str, ...] = ()
    left_at: float | None = None
    outcome: str | None = None


@dataclass(frozen=True)
class Quota:
    """Limits at one level (default, group or user). ``None`` means "not set here".

    At the default level ``None`` means unlimited; at group and user level it means
    "inherit from the level below". ``priority`` matters for groups only: a higher
    priority group's waiting requests are served first.
    """

    max_fraction_ppm: int | None = None
    max_leases: int | None = None
    max_lease_fraction_ppm: int | None = None
    budget_fraction_hours: float | None = None
    budget_window_s: int | None = None
    priority: int | None = None

    FIELDS = (
        "max_fraction_ppm",
        "max_leases",
        "max_lease_fraction_ppm",
        "budget_fraction_hours",
        "budget_window_s",
        "priority",
    )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for wire, attr in zip(QUOTA_FIELDS, self.FIELDS, strict=True):
            value = getattr(self, attr)
            if value is not None and attr.endswith("_ppm"):
                value = ppm_to_fraction(value)
            out[wire] = value
        return out


@dataclass
class QuotaBook:
    """All quotas: the default, per group and per user."""

    default: Quota = field(default_factory=Quota)
    groups: dict[str, Quota] = field(default_factory=dict)
    users: dict[str, Quota] = field(default_factory=dict)


def never_allowed(quota: Quota, ppm: int) -> str | None:
    """Why ``quota`` can never admit one kernel of ``ppm``, whatever else is held; else None.

    A per-kernel limit below the fraction, a total below it, no leases or no budget at
    all. Used by the launcher (which kernels to offer); the broker's admission
    (``admission.admit``) mirrors it.
    """
    if quota.max_leases is not None and quota.max_leases <= 0:
        return "max_leases"
    if quota.max_fraction_ppm is not None and quota.max_fraction_ppm <= 0:
        return "max_fraction"
    if quota.max_lease_fraction_ppm is not None and ppm > quota.max_lease_fraction_ppm:
        return "max_lease_fraction"
    if quota.max_fraction_ppm is not None and ppm > quota.max_fraction_ppm:
        return "max_fraction"
    if quota.budget_fraction_hours is not None and quota.budget_fraction_hours <= 0:
        return "budget_fraction_hours"
    return None


@dataclass(frozen=True)
class ClassSession:
    """One class session as the core sees it: a course's reservation of a GPU share from
    ``start`` to ``end`` (epoch seconds), planned in the courses file or started by hand.

    The share is ``pool_fraction`` of the capacity of the GPUs it may use (all of the
    pool, or those of ``gpu_uuids`` / ``nodes``) or ``share_ppm`` GPU-ppm (seats × a
    kernel's fraction; 1,000,000 = one whole GPU). ``tz`` (an IANA name) is where its
    times are told to people. The rules are in ``broker/rules/sessions.py``.
    """

    course: str
    start: float
    end: float
    pool_fraction: float | None = None
    share_ppm: int | None = None
    gpu_uuids: tuple[str, ...] | None = None
    nodes: tuple[str, ...] | None = None
    tz: str = "UTC"
    #: how it came: "timetable" (the courses file) or "by hand" (an instructor started it)
    source: str = "timetable"
    #: what people read for it: "Tue 10:00-11:30", "2026-12-01 09:00-12:00", "by hand"
    label: str = ""

    @property
    def key(self) -> tuple[str, float, str]:
        return (self.course, self.start, self.source)


@dataclass
class PoolState:
    """The broker's working state in memory: GPUs, active leases and the queue.

    Only live leases live here; ended ones are history in the store. The
    ``allocated`` map (GPU uuid -> ppm held) is maintained incrementally so that
    placement is O(GPUs), not O(leases).

    Parked leases (``park == "parked"``) are in :attr:`parked`, not :attr:`leases`: they
    hold no capacity (not in ``allocated``/``lease_count``) but still count as their
    user's (``held_by_user``, ``leases_by_user``: quotas) and their kernel's
    (``by_kernel``). ``parking`` and ``resuming`` leases are in :attr:`leases` and hold
    capacity. Moves between the two: :meth:`park_lease`, :meth:`unpark`; a parked lease
    leaves with :meth:`remove_parked`; :meth:`find_lease` looks in both.
    """

    gpus: dict[str, GPU] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    by_kernel: dict[tuple[str, str], str] = field(default_factory=dict)
    allocated: dict[str, int] = field(default_factory=dict)
    queue: dict[tuple[str, str], Request] = field(default_factory=dict)
    held_by_user: dict[str, int] = field(default_factory=dict)
    leases_by_user: dict[str, int] = field(default_factory=dict)
    #: uuid -> number of active leases on it
    lease_count: dict[str, int] = field(default_factory=dict)
    #: uuids of GPUs where nothing new is placed (their node is lost or drained, or the GPU
    #: vanished from its node while leased); their leases run on until they end
    closed: set[str] = field(default_factory=set)
    #: GPU uuid -> the uid its MPS server serves clients of now, as the node agents
    #: report it (absent: no server, or one without clients)
    mps_uid: dict[str, int] = field(default_factory=dict)
    #: lease id -> the uid of its kernel as the node agent proved it (the broker's
    #: ``KernelPlaces.proven_uids``; absent: not proven); with :attr:`mps_uid`, the only
    #: sources of a GPU's MPS owners past a grant's claim window (``node_rules.mps_owners``)
    mps_proven: dict[str, int] = field(default_factory=dict)
    #: lease id -> parked lease (``park == "parked"``): holds no capacity, see the class doc
    parked: dict[str, Lease] = field(default_factory=dict)
    #: the class sessions near now (their lead time, the session, ended ones are dropped),
    #: refreshed by the broker's service from the timetable (``broker/rules/sessions.py``)
    sessions: tuple[ClassSession, ...] = ()
    _ordered: list[GPU] | None = field(default=None, repr=False, compare=False)

    def ordered_gpus(self) -> list[GPU]:
        """All GPUs in a stable order (node, index, uuid); cached, the pool is fixed."""
        if self._ordered is None or len(self._ordered) != len(self.gpus):
            self._ordered = sorted(self.gpus.values(), key=lambda g: (g.node, g.index, g.uuid))
        return self._ordered

    @classmethod
    def build(
        cls,
        gpus: Iterable[GPU],
        leases: Iterable[Lease] = (),
        queue: Iterable[Request] = (),
    ) -> PoolState:
        gpus = list(gpus)
        state = cls(gpus={g.uuid: g for g in gpus})
        for g in gpus:
            state.allocated[g.uuid] = 0
            state.lease_count[g.uuid] = 0
        for lease in leases:
            if lease.active and lease.park == "parked":
                state._add_parked(lease)
            elif lease.active:
                state.add_lease(lease)
        for req in queue:
            state.queue[req.key] = req
        return state

    # -- GPUs (node agents register and withdraw them) ----------------------------
    def put_gpu(self, gpu: GPU) -> None:
        """Add a GPU to the pool, or replace its record (its leases stay)."""
        self.gpus[gpu.uuid] = gpu
        self.allocated.setdefault(gpu.uuid, 0)
        self.lease_count.setdefault(gpu.uuid, 0)
        self._ordered = None

    def drop_gpu(self, uuid: str) -> None:
        """Take a GPU without active leases out of the pool."""
        assert not self.lease_count.get(uuid), "a GPU with active leases stays in the pool"
        self.gpus.pop(uuid, None)
        self.allocated.pop(uuid, None)
        self.lease_count.pop(uuid, None)
        self.closed.discard(uuid)
        self._ordered = None

    # -- leases ------------------------------------------------------------
    def add_lease(self, lease: Lease) -> None:
        assert lease.active and lease.park != "parked"
        assert lease.id not in self.leases and lease.id not in self.parked
        self.leases[lease.id] = lease
        self._hold(lease)
        self._count(lease, +1)

    def remove_lease(self, lease_id: str) -> Lease:
        """Take a lease of :attr:`leases` out (it ended); a parked one: :meth:`remove_parked`."""
        lease = self.leases.pop(lease_id)
        self._release(lease)
        self._count(lease, -1)
        return lease

    def _hold(self, lease: Lease) -> None:
        """The capacity a lease of :attr:`leases` holds on its GPU."""
        self.allocated[lease.gpu_uuid] = self.allocated.get(lease.gpu_uuid, 0) + lease.fraction_ppm
        self.lease_count[lease.gpu_uuid] = self.lease_count.get(lease.gpu_uuid, 0) + 1

    def _release(self, lease: Lease) -> None:
        self.allocated[lease.gpu_uuid] -= lease.fraction_ppm
        self.lease_count[lease.gpu_uuid] -= 1

    def _count(self, lease: Lease, sign: int) -> None:
        """What a live lease (parked or not) counts for: its kernel and its user's quotas."""
        if sign > 0:
            self.by_kernel[(lease.user, lease.kernel_id)] = lease.id
            self.held_by_user[lease.user] = (
                self.held_by_user.get(lease.user, 0) + lease.fraction_ppm
            )
            self.leases_by_user[lease.user] = self.leases_by_user.get(lease.user, 0) + 1
            return
        self.by_kernel.pop((lease.user, lease.kernel_id), None)
        self.held_by_user[lease.user] -= lease.fraction_ppm
        self.leases_by_user[lease.user] -= 1
        if not self.leases_by_user[lease.user]:
            del self.leases_by_user[lease.user]
            del self.held_by_user[lease.user]

    def _add_parked(self, lease: Lease) -> None:
        """A parked lease loaded from the store (``build``): counted, holding nothing."""
        assert lease.active and lease.park == "parked"
        assert lease.id not in self.leases and lease.id not in self.parked
        self.parked[lease.id] = lease
        self._count(lease, +1)

    # -- parking (the moves of scheduling.park_done and the resume grants) ----
    def park_lease(self, lease_id: str) -> Lease:
        """Its kernel's GPU memory is in host RAM: move the lease from :attr:`leases` to
        :attr:`parked` with ``park="parked"``, freeing its capacity (it still counts for
        its kernel and user). Returns the parked record. ``scheduling.park_done`` calls it."""
        lease = self.leases.pop(lease_id)
        self._release(lease)
        parked = replace(lease, park="parked")
        self.parked[lease_id] = parked
        return parked

    def unpark(self, lease_id: str, park: ParkState | None = "resuming") -> Lease:
        """Move a parked lease back into :attr:`leases`, holding its capacity on its GPU
        again, with ``park`` (``"resuming"``: its restore is to be ordered). The caller
        checked that it fits (a granted resume request). Returns the new record."""
        assert park != "parked"
        lease = replace(self.parked.pop(lease_id), park=park)
        if park is None:
            lease.parked_at = None
        self.leases[lease_id] = lease
        self._hold(lease)
        return lease

    def remove_parked(self, lease_id: str) -> Lease:
        """Take a parked lease out (it ended: released, expired, revoked); returns it."""
        lease = self.parked.pop(lease_id)
        self._count(lease, -1)
        return lease

    def find_lease(self, lease_id: str) -> Lease | None:
        """A live lease by id, parked or not."""
        return self.leases.get(lease_id) or self.parked.get(lease_id)

    def update_lease(self, lease: Lease) -> None:
        """Replace a live lease's record, parked or not, by a new copy (same id, gpu and
        fraction): a renewal, or a change of ``park`` that keeps it on the same side
        (``None``/``"parking"``/``"resuming"`` in :attr:`leases`, ``"parked"`` in
        :attr:`parked`; moving between them is :meth:`park_lease` / :meth:`unpark`)."""
        home = self.leases if lease.id in self.leases else self.parked
        old = home[lease.id]
        assert old.gpu_uuid == lease.gpu_uuid and old.fraction_ppm == lease.fraction_ppm
        assert (home is self.parked) == (lease.park == "parked"), (old.park, lease.park)
        home[lease.id] = lease

    def lease_for_kernel(self, user: str, kernel_id: str) -> Lease | None:
        """The kernel's live lease, parked or not (None: it holds none)."""
        lease_id = self.by_kernel.get((user, kernel_id))
        return self.find_lease(lease_id) if lease_id else None

    def copy(self) -> PoolState:
        """A deep-enough copy for simulations and property tests."""
        return PoolState(
            gpus=dict(self.gpus),
            leases={k: replace(v) for k, v in self.leases.items()},
            by_kernel=dict(self.by_kernel),
            allocated=dict(self.allocated),
            queue={k: replace(v) for k, v in self.queue.items()},
            held_by_user=dict(self.held_by_user),
            leases_by_user=dict(self.leases_by_user),
            lease_count=dict(self.lease_count),
            closed=set(self.closed),
            mps_uid=dict(self.mps_uid),
            mps_proven=dict(self.mps_proven),
            parked={k: replace(v) for k, v in self.parked.items()},
            sessions=self.sessions,
        )


@dataclass
class Grant:
    """Create ``lease``; if it came from the queue, ``request`` is the entry it consumes."""

    lease: Lease
    request: Request | None = None


@dataclass
class Changes:
    """What one mutation did to a ``PoolState``: what a store must persist, in this order.

    ``ended`` holds each lease as it was before it ended, with its new state and reason;
    ``granted`` the new leases (a grant from the queue names the request it consumed);
    ``queued`` the requests that joined the queue; ``dropped`` the requests that left it
    without a lease, with how (``cancelled`` or ``dropped``); ``renewed`` the latest
    record of leases whose heartbeat is not persisted yet.

    Parking: ``parks`` the leases whose ``park``/``parked_at`` changed (to persist as
    ``park_state``/``parked_at``; of several records of one lease the latest wins);
    ``resumed`` the resume requests granted, each with its lease as it now is
    (``park="resuming"``, also in ``parks``): the request leaves the queue as granted,
    and NO lease is created (the store re-checks the lease's GPU's capacity instead).
    """

    now: float
    ended: list[tuple[Lease, str, str | None]] = field(default_factory=list)
    granted: list[Grant] = field(default_factory=list)
    queued: list[Request] = field(default_factory=list)
    dropped: list[tuple[Request, str]] = field(default_factory=list)
    renewed: list[Lease] = field(default_factory=list)
    parks: list[Lease] = field(default_factory=list)
    resumed: list[tuple[Request, Lease]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.ended
            or self.granted
            or self.queued
            or self.dropped
            or self.renewed
            or self.parks
            or self.resumed
        )

    def extend(self, other: Changes) -> None:
        """Append ``other``'s changes (made after these) to these."""
        self.ended += other.ended
        self.granted += other.granted
        self.queued += other.queued
        self.dropped += other.dropped
        self.renewed += other.renewed
        self.parks += other.parks
        self.resumed += other.resumed
