"""Allocators: the pure core (also clairvoyant, random-fit) and the fluid reference."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ...broker.rules.policy import Ask, Policy
from ...broker.rules.scheduling import (
    Grant,
    apply_grants,
    check_invariants,
    end,
    expired,
    grant_waiting,
    new_lease,
    place,
    queue_order,
    reap,
    usable_gpus,
)
from ...broker.rules.scheduling import acquire as core_acquire
from ...model import GPU, Changes, PoolState, Quota, Request

#: a kernel's request and lease in the simulation: (user, "SESSION.ATTEMPT")
Key = tuple[str, str]


# -- allocators: the core, and the fluid reference -----------------------------------------


class Allocator(Protocol):
    def expect(self, key: Key, hold: float) -> None: ...
    def acquire(
        self,
        key: Key,
        ppm: int,
        now: float,
        arrived_at: float | None = None,
        groups: frozenset[str] = frozenset(),
    ) -> list[Key]: ...
    def release(self, key: Key, now: float) -> list[Key]: ...
    def crash(self, key: Key, expires_at: float) -> None: ...
    def expire(self, now: float) -> tuple[list[Key], list[Key]]: ...
    def reap(
        self, now: float, activity: Callable[[Key, float], tuple[bool, float]]
    ) -> tuple[list[Key], list[Key]]: ...
    def waiting(self) -> int: ...
    def held_ppm(self) -> int: ...
    def active(self) -> int: ...
    def check(self) -> None: ...


@dataclass
class _RandomOrderPool(PoolState):
    """A pool whose GPU order is reshuffled at every look: first-fit over it is random fit."""

    rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False, compare=False)

    def ordered_gpus(self) -> list[GPU]:
        gpus = sorted(self.gpus.values(), key=lambda g: (g.node, g.index, g.uuid))
        self.rng.shuffle(gpus)
        return gpus


class CoreAllocator:
    """The broker's decisions without the broker: core functions, applied at once."""

    def __init__(self, gpus: list[GPU], policy: Policy, rng: random.Random | None = None) -> None:
        if rng is not None:
            state: PoolState = _RandomOrderPool.build(gpus)
            assert isinstance(state, _RandomOrderPool)
            state.rng = rng
        else:
            state = PoolState.build(gpus)
        self.state = state
        self.policy = policy
        self.quota = Quota()
        self._ids = itertools.count()

    def _new_id(self) -> str:
        return f"sim-{next(self._ids)}"

    def expect(self, key: Key, hold: float) -> None:
        """The session time ``key`` will hold a lease; a broker cannot know it: ignored."""

    def _granted(self, grants: list[Grant]) -> list[Key]:
        """Grants the core applied: the simulated provisioner renews until the kernel ends."""
        for g in grants:
            g.lease.expires_at = math.inf
        return [g.lease.user_kernel for g in grants]

    def _drain(self, now: float) -> list[Key]:
        """Grant what the queue can have (the core's drain; a reference may override it)."""
        changes = Changes(now)
        grant_waiting(self.state, now, self.policy, changes)
        return self._granted(changes.granted)

    def acquire(
        self,
        key: Key,
        ppm: int,
        now: float,
        arrived_at: float | None = None,
        groups: frozenset[str] = frozenset(),
    ) -> list[Key]:
        """``arrived_at``: the queue position's arrival, when earlier than ``now`` (a resume);
        ``groups``: the user's courses (members of a class session's course)."""
        ask = Ask(user=key[0], kernel_id=key[1], fraction_ppm=ppm, groups=groups)
        _, changes = core_acquire(self.state, ask, self.quota, now, self.policy, self._new_id)
        if arrived_at is not None and key in self.state.queue:
            self.state.queue[key].arrived_at = arrived_at
        return self._granted(changes.granted)

    def release(self, key: Key, now: float) -> list[Key]:
        lease = self.state.leases[self.state.by_kernel[key]]
        end(self.state, [(lease, "released", None)], now, self.policy, drain_queue=False)
        return self._drain(now)

    def crash(self, key: Key, expires_at: float) -> None:
        self.state.leases[self.state.by_kernel[key]].expires_at = expires_at

    def expire(self, now: float) -> tuple[list[Key], list[Key]]:
        gone = [(x, "expired", None) for x in expired(self.state, now)]
        if not gone:
            return [], []
        changes = end(self.state, gone, now, self.policy, drain_queue=False)
        return [x.user_kernel for x, _, _ in changes.ended], self._drain(now)

    def reap(
        self, now: float, activity: Callable[[Key, float], tuple[bool, float]]
    ) -> tuple[list[Key], list[Key]]:
        if self.policy.idle_reclaim_after is not None or self.state.sessions:
            for lease in self.state.leases.values():  # what the last heartbeat reported
                busy, last = activity(lease.user_kernel, now)
                lease.execution_state = "busy" if busy else "idle"
                lease.last_activity = last
        # the broker's reaper pass; simulated clients keep polling while they wait
        reaped = reap(self.state, now, self.policy, set(self.state.queue), drain_queue=False)
        return [x.user_kernel for x in reaped.revoked], self._drain(now)

    def waiting(self) -> int:
        return len(self.state.queue)

    def held_ppm(self) -> int:
        return sum(self.state.allocated.values())

    def active(self) -> int:
        return len(self.state.leases)

    def check(self) -> None:
        check_invariants(self.state, self.policy)


class ClairvoyantAllocator(CoreAllocator):
    """The core's order, best-fit and idle reclaim, with exact hold times (a reference).

    The head of the queue that does not fit reserves the GPU where, its leases ending
    at their known times, it fits soonest (the *shadow* time); a later request may
    land there only if it fits now and will have ended by the shadow time, so the head
    is never delayed (EASY backfilling). A crashed kernel's extra TTL and revocations
    are not foreseen: ends come earlier or later than planned, as run times do in a
    real EASY scheduler.
    """

    def __init__(self, gpus: list[GPU], policy: Policy) -> None:
        super().__init__(gpus, policy)
        self.hold: dict[Key, float] = {}
        self.ends_at: dict[str, float] = {}  # lease id -> planned end

    def expect(self, key: Key, hold: float) -> None:
        self.hold[key] = hold

    def acquire(
        self,
        key: Key,
        ppm: int,
        now: float,
        arrived_at: float | None = None,
        groups: frozenset[str] = frozenset(),
    ) -> list[Key]:
        req = Request(
            id=self._new_id(),
            user=key[0],
            kernel_id=key[1],
            fraction_ppm=ppm,
            arrived_at=now if arrived_at is None else arrived_at,
            last_polled_at=now,
        )
        self.state.queue[req.key] = req
        return self._drain(now)

    def _apply(self, grants: list[Grant]) -> list[Key]:
        for g in grants:
            self.ends_at[g.lease.id] = g.lease.created_at + self.hold.get(g.lease.user_kernel, 0.0)
        apply_grants(self.state, grants)
        return self._granted(grants)

    def _drain(self, now: float) -> list[Key]:
        state, policy = self.state, self.policy
        if not state.queue:
            return []
        cap = policy.capacity_ppm
        alloc = dict(state.allocated)
        ends: dict[str, list[tuple[float, int]]] = {}
        for lease in state.leases.values():
            planned = self.ends_at.get(lease.id, now)
            ends.setdefault(lease.gpu_uuid, []).append((planned, lease.fraction_ppm))
        grants: list[Grant] = []
        reserved: tuple[str, float] | None = None  # (GPU, shadow time)
        for req in queue_order(state, now, policy):
            ok = usable_gpus(state, req.fraction_ppm, policy, req.node, req.gpu_uuids)
            gpu = place(
                ok, alloc, req.fraction_ppm, policy, exclude={reserved[0]} if reserved else set()
            )
            end = now + self.hold.get(req.key, 0.0)
            if gpu is None and reserved is not None and end <= reserved[1]:
                gpu = next(
                    (
                        g
                        for g in ok
                        if g.uuid == reserved[0] and alloc[g.uuid] + req.fraction_ppm <= cap
                    ),
                    None,
                )
            if gpu is not None:
                alloc[gpu.uuid] += req.fraction_ppm
                ends.setdefault(gpu.uuid, []).append((end, req.fraction_ppm))
                grants.append(Grant(new_lease(req, gpu, now, policy, self._new_id()), req))
            elif reserved is None and ok:
                reserved = min(
                    (
                        (
                            g.uuid,
                            self._fits_at(
                                ends.get(g.uuid, []), alloc[g.uuid], req.fraction_ppm, now
                            ),
                        )
                        for g in ok
                    ),
                    key=lambda x: x[1],
                )
        return self._apply(grants)

    def _fits_at(
        self, ends: list[tuple[float, int]], allocated: int, ppm: int, now: float
    ) -> float:
        """When ``ppm`` fits on a GPU whose leases end as planned."""
        t = now
        for planned, size in sorted(ends):
            if allocated + ppm <= self.policy.capacity_ppm:
                break
            allocated -= size
            t = max(t, planned)
        return t


class FluidAllocator:
    """One bin of capacity ``sum(GPUs)``: no fragmentation; FIFO order, whoever fits goes.

    With ``reclaim_after``, the reaper revokes leases idle longer than that, as
    ``scheduling.idle_victims`` does but over the pooled bin: for each waiting request
    (FIFO) that does not fit, the most idle leases, only if they suffice.
    """

    def __init__(self, gpus: list[GPU], policy: Policy, reclaim_after: float | None = None) -> None:
        self.reclaim_after = reclaim_after
        self.capacity = len(gpus) * policy.capacity_ppm
        self.held: dict[Key, int] = {}
        self.expiry: dict[Key, float] = {}
        self.queue: dict[Key, int] = {}  # insertion order = arrival order
        self.total = 0

    def expect(self, key: Key, hold: float) -> None:
        """Ignored: the fluid bound needs no hold times."""

    def _drain(self) -> list[Key]:
        granted = []
        for key, ppm in list(self.queue.items()):
            if self.total + ppm <= self.capacity:
                del self.queue[key]
                self.held[key] = ppm
                self.total += ppm
                granted.append(key)
        return granted

    def acquire(
        self,
        key: Key,
        ppm: int,
        now: float,
        arrived_at: float | None = None,
        groups: frozenset[str] = frozenset(),
    ) -> list[Key]:
        """FIFO by call order: the fluid reference has no parking (``arrived_at`` unused)."""
        self.queue[key] = ppm
        return self._drain()

    def release(self, key: Key, now: float) -> list[Key]:
        self.total -= self.held.pop(key)
        self.expiry.pop(key, None)
        return self._drain()

    def crash(self, key: Key, expires_at: float) -> None:
        self.expiry[key] = expires_at

    def expire(self, now: float) -> tuple[list[Key], list[Key]]:
        ended = [k for k, t in self.expiry.items() if t <= now]
        for k in ended:
            self.total -= self.held.pop(k)
            del self.expiry[k]
        return ended, self._drain() if ended else []

    def reap(
        self, now: float, activity: Callable[[Key, float], tuple[bool, float]]
    ) -> tuple[list[Key], list[Key]]:
        limit = self.reclaim_after
        if limit is None or not self.queue:
            return [], []
        idle = []
        for key in self.held:
            busy, last = activity(key, now)
            if not busy and now - last > limit:
                idle.append((last, key))
        idle.sort()  # most idle first
        total, gone, taken = self.total, [], set()
        for ppm in self.queue.values():
            need = total + ppm - self.capacity
            chosen = []
            for _, key in idle:
                if need <= 0:
                    break
                if key not in taken:
                    chosen.append(key)
                    need -= self.held[key]
            if need > 0:
                continue
            for key in chosen:
                taken.add(key)
                gone.append(key)
                total -= self.held[key]
            total += ppm
        for key in gone:
            self.total -= self.held.pop(key)
            self.expiry.pop(key, None)
        return gone, self._drain()

    def waiting(self) -> int:
        return len(self.queue)

    def held_ppm(self) -> int:
        return self.total

    def active(self) -> int:
        return len(self.held)

    def check(self) -> None:
        assert 0 <= self.total <= self.capacity
        assert self.total == sum(self.held.values())
        assert not set(self.held) & set(self.queue)
