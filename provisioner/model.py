"""Plain data: GPUs, leases, queued requests, quotas, identities, and the pool state.

Nothing here does I/O or reads the clock: times are POSIX seconds passed in by the
caller. Fractions are kept as integer parts per million (``ppm``) so that fifty
leases of 0.02 fill a GPU exactly, with no float drift; they are converted to and
from floats only at the edges (JSON, kernel.json, CLI).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

PPM = 1_000_000

LeaseState = Literal["active", "revoked", "released", "expired"]
LEASE_STATES: tuple[str, ...] = ("active", "revoked", "released", "expired")


def fraction_to_ppm(fraction: float) -> int:
    """0.02 -> 20000. The caller has validated ``0 < fraction <= 1``."""
    return int(round(fraction * PPM))


def ppm_to_fraction(ppm: int) -> float:
    """20000 -> 0.02 (a float for JSON; exact arithmetic stays in ppm)."""
    return ppm / PPM


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


@dataclass
class Lease:
    id: str
    user: str
    kernel_id: str
    gpu_uuid: str
    fraction_ppm: int
    memory_limit_mb: int
    state: str
    created_at: float
    renewed_at: float
    expires_at: float
    group: str | None = None
    ended_at: float | None = None
    reason: str | None = None
    pid: int | None = None
    execution_state: str | None = None
    last_activity: float | None = None

    @property
    def active(self) -> bool:
        return self.state == "active"

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
            "state": self.state,
            "group": self.group,
            "created_at": self.created_at,
            "renewed_at": self.renewed_at,
            "expires_at": self.expires_at,
            "ended_at": self.ended_at,
            "reason": self.reason,
            "pid": self.pid,
            "execution_state": self.execution_state,
            "last_activity": self.last_activity,
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

    @property
    def key(self) -> tuple[str, str]:
        return (self.user, self.kernel_id)


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
        return {
            "max_fraction": None
            if self.max_fraction_ppm is None
            else ppm_to_fraction(self.max_fraction_ppm),
            "max_leases": self.max_leases,
            "max_lease_fraction": None
            if self.max_lease_fraction_ppm is None
            else ppm_to_fraction(self.max_lease_fraction_ppm),
            "budget_fraction_hours": self.budget_fraction_hours,
            "budget_window": self.budget_window_s,
            "priority": self.priority,
        }

    def is_empty(self) -> bool:
        return all(getattr(self, f) is None for f in self.FIELDS)


@dataclass
class QuotaBook:
    """All quotas: the default, per group and per user."""

    default: Quota = field(default_factory=Quota)
    groups: dict[str, Quota] = field(default_factory=dict)
    users: dict[str, Quota] = field(default_factory=dict)


@dataclass
class PoolState:
    """The broker's working state in memory: GPUs, active leases and the queue.

    Only active leases live here; ended ones are history in the store. The
    ``allocated`` map (GPU uuid -> ppm held) is maintained incrementally so that
    placement is O(GPUs), not O(leases).
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
            if lease.active:
                state.add_lease(lease)
        for req in queue:
            state.queue[req.key] = req
        return state

    # -- leases ------------------------------------------------------------
    def add_lease(self, lease: Lease) -> None:
        assert lease.active and lease.id not in self.leases
        self.leases[lease.id] = lease
        self.by_kernel[(lease.user, lease.kernel_id)] = lease.id
        self.allocated[lease.gpu_uuid] = self.allocated.get(lease.gpu_uuid, 0) + lease.fraction_ppm
        self.lease_count[lease.gpu_uuid] = self.lease_count.get(lease.gpu_uuid, 0) + 1
        self.held_by_user[lease.user] = self.held_by_user.get(lease.user, 0) + lease.fraction_ppm
        self.leases_by_user[lease.user] = self.leases_by_user.get(lease.user, 0) + 1

    def remove_lease(self, lease_id: str) -> Lease:
        lease = self.leases.pop(lease_id)
        self.by_kernel.pop((lease.user, lease.kernel_id), None)
        self.allocated[lease.gpu_uuid] -= lease.fraction_ppm
        self.lease_count[lease.gpu_uuid] -= 1
        self.held_by_user[lease.user] -= lease.fraction_ppm
        self.leases_by_user[lease.user] -= 1
        if not self.leases_by_user[lease.user]:
            del self.leases_by_user[lease.user]
            del self.held_by_user[lease.user]
        return lease

    def update_lease(self, lease: Lease) -> None:
        """Replace an active lease's record by a renewed copy (same id, gpu and fraction)."""
        old = self.leases[lease.id]
        assert old.gpu_uuid == lease.gpu_uuid and old.fraction_ppm == lease.fraction_ppm
        self.leases[lease.id] = lease

    def lease_for_kernel(self, user: str, kernel_id: str) -> Lease | None:
        lease_id = self.by_kernel.get((user, kernel_id))
        return self.leases.get(lease_id) if lease_id else None

    def user_leases(self, user: str) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.user == user]

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
        )
