"""Trace-driven simulator: the pure allocation core on a simulated clock.

Called by ``benchmarks/simulate.py`` (every policy and baseline on every trace) and by
``tests/test_simulate.py`` (a small trace, invariants checked at every event). It
drives the very mutations the broker's service calls -- ``scheduling.acquire``,
``end``, ``reap``, ``grant_waiting`` -- with no HTTP, store or real clock, so a
simulated week takes seconds.

A trace is a list of :class:`Session`: a student (or researcher) asks for a kernel
of ``fraction`` at ``arrival``, uses it for ``duration`` seconds of session time, and
is busy during the ``busy`` stretches (session seconds from the kernel's start).
Session time runs only while the kernel holds a lease, so waiting shifts the session
later. A kernel whose lease is revoked (idle reclaim) is shut down; its student comes
back when next active (the next busy stretch), asks again and waits again. A session
marked ``crash`` ends without a release; its lease expires one TTL later.

*Parking* (``Scheme.park``, issue 28) is idle reclaim that keeps the kernel: the same
victims at the same moments, but the kernel's GPU memory goes to host RAM instead of the
kernel ending, so nothing is lost ("work lost": kernels ended with their state, and the busy
hours they had run; both 0 when parking works). The returning student's resume request
queues with the arrival time of its park (``resume_order="park-time"``: ahead of whoever
came after the park) or as a new arrival (``"arrival"``). Not modelled: a park that fails
or finds too little host RAM (the broker then reclaims, as today), and the seconds a
restore takes (GiB at the copy bandwidth: seconds, against waits of minutes).

Baselines are :class:`Scheme` settings over the same core (whole-GPU: every request
rounded up to one GPU; first-fit; random fit: first-fit over a GPU order shuffled
at every decision, i.e. uniform among fitting GPUs) plus a *fluid* reference that
pools all capacity into one bin (no fragmentation, FIFO order, greedy admission), with
and without the same idle reclaim as ours (so that a policy with reclaim can be
compared with a bound that reclaims too). A *clairvoyant* reference keeps per-GPU
leases but knows how long every kernel will hold its lease (no broker can): the head
reserves the GPU where it will fit soonest and smaller requests backfill that GPU only
if they will end before then (EASY backfilling with exact run times). It shows what
better drain prediction could win for this design (a strong reference, not an optimum).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import GPULeaseError
from ..estimates import HoldTimes, estimate_waits
from ..model import GPU, PPM, Changes, PoolState, Quota, Request, fraction_to_ppm
from ..policy import Ask, Policy
from ..scheduling import (
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
from ..scheduling import acquire as core_acquire

Key = tuple[str, str]

#: a kernel idle this long counts as "idle-held" (the metric; not a policy knob)
IDLE_METRIC_S = 600.0
#: requests at least this large are "large" (research) in the metrics
LARGE_PPM = PPM // 2


# -- traces -------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """One kernel's life as its user would live it, if it never had to wait."""

    id: str
    user: str
    arrival: float
    fraction: float
    duration: float
    busy: tuple[tuple[float, float], ...] = ()
    group: str | None = None
    crash: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "group": self.group,
            "arrival": round(self.arrival, 3),
            "fraction": self.fraction,
            "duration": round(self.duration, 3),
            "busy": [[round(a, 1), round(b, 1)] for a, b in self.busy],
            "crash": self.crash,
        }


@dataclass(frozen=True)
class PoolSpec:
    count: int
    memory_mb: int
    name: str = "GPU"


@dataclass
class Trace:
    """A workload: the pool, the horizon over which utilisation is measured, the sessions."""

    name: str
    horizon: float
    pool: list[PoolSpec]
    sessions: list[Session]
    description: str = ""
    seed: int | None = None

    def gpus(self) -> list[GPU]:
        out: list[GPU] = []
        for spec in self.pool:
            for _ in range(spec.count):
                i = len(out)
                out.append(GPU(f"GPU-sim-{i:04d}", "sim", spec.name, spec.memory_mb, i))
        return out

    def dump(self, path: str | Path) -> None:
        """Write as JSONL: a header line, then one session per line."""
        head = {
            "kind": "header",
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "horizon": self.horizon,
            "pool": [
                {"count": p.count, "memory_mb": p.memory_mb, "name": p.name} for p in self.pool
            ],
        }
        with open(path, "w") as f:
            f.write(json.dumps(head) + "\n")
            for s in sorted(self.sessions, key=lambda s: (s.arrival, s.id)):
                f.write(json.dumps(s.to_json()) + "\n")


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :meth:`Trace.dump` (``benchmarks/traces/*.jsonl``)."""
    with open(path) as f:
        head = json.loads(f.readline())
        sessions = []
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            busy = tuple((float(a), float(b)) for a, b in d.get("busy", ()))
            sessions.append(
                Session(
                    d["id"], d["user"], float(d["arrival"]), float(d["fraction"]),
                    float(d["duration"]), busy, d.get("group"), bool(d.get("crash", False)),
                )
            )  # fmt: skip
    pool = [
        PoolSpec(int(p["count"]), int(p["memory_mb"]), p.get("name", "GPU")) for p in head["pool"]
    ]
    return Trace(
        head["name"],
        float(head["horizon"]),
        pool,
        sessions,
        head.get("description", ""),
        head.get("seed"),
    )


# -- schemes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheme:
    """A policy to simulate: core ``Policy`` settings, or ``policy=None`` for the fluid bound."""

    name: str
    policy: Policy | None
    whole_gpu: bool = False
    random_fit: bool = False
    note: str = ""
    #: fluid only: revoke leases idle longer than this while the pooled head does not fit
    fluid_reclaim_after: float | None = None
    #: the core's policy, but reservation and backfill use each kernel's known hold time
    clairvoyant: bool = False
    #: idle victims are parked (state kept) instead of ended; see the module docstring
    park: bool = False
    #: where a parked kernel's resume request queues: "park-time" or "arrival"
    resume_order: str = "park-time"


#: baselines: FIFO order, no reservation, never reclaim (as Kubernetes / gpushare schedule)
_FIFO = Policy(placement="first-fit", backfill=False, starvation_after=0.0)
BASELINES: tuple[Scheme, ...] = (
    Scheme("whole-gpu", _FIFO, whole_gpu=True, note="one kernel per GPU (nvidia.com/gpu: 1)"),
    Scheme("first-fit", _FIFO, note="first-fit binpack, FIFO, no reservation (gpushare)"),
    Scheme("random-fit", _FIFO, random_fit=True, note="uniform among fitting GPUs, FIFO"),
    Scheme("fluid", None, note="pooled capacity, no fragmentation, FIFO-greedy (reference)"),
)
#: our policy, and variants that each change one of its choices (README: "Scheduling simulator")
_RECLAIM = 900.0
#: the fluid reference with ours' idle reclaim: compare ``ours`` with this, ``no-reclaim`` with ``fluid``
FLUID_RECLAIM = Scheme(
    "fluid-reclaim",
    None,
    fluid_reclaim_after=_RECLAIM,
    note="pooled capacity, FIFO-greedy, idle reclaim after 15 min (reference)",
)
OURS: tuple[Scheme, ...] = (
    Scheme(
        "spread",
        Policy(placement="spread", idle_reclaim_after=_RECLAIM),
        note="ours, emptiest GPU first",
    ),
    Scheme(
        "fifo", Policy(starvation_after=0.0, idle_reclaim_after=_RECLAIM), note="ours, FIFO order"
    ),
    Scheme(
        "emptiest-resv",
        Policy(reservation="emptiest", idle_reclaim_after=_RECLAIM),
        note="ours, head reserves the emptiest GPU (the rule before)",
    ),
    Scheme(
        "no-resv",
        Policy(backfill=False, idle_reclaim_after=_RECLAIM),
        note="ours, no head reservation",
    ),
    Scheme("no-reclaim", Policy(), note="ours without idle reclaim (the broker's defaults)"),
    Scheme("reclaim-30m", Policy(idle_reclaim_after=1800.0), note="ours, reclaim after 30 min"),
    Scheme(
        "ours",
        Policy(idle_reclaim_after=_RECLAIM),
        note="best-fit, fair share, head reservation (fewest leases), reclaim after 15 min",
    ),
)
#: parking instead of reclaim (issue 28): the same victims, their state kept
PARKING: tuple[Scheme, ...] = (
    Scheme(
        "park",
        Policy(idle_reclaim_after=_RECLAIM),
        park=True,
        note="ours, idle kernels parked after 15 min; a resume queues from its park time",
    ),
    Scheme(
        "park-arrival",
        Policy(idle_reclaim_after=_RECLAIM),
        park=True,
        resume_order="arrival",
        note="ours, parked; a resume queues as a new arrival",
    ),
)
#: per-GPU references that know every hold time in advance: what drain prediction could win
CLAIRVOYANT: tuple[Scheme, ...] = (
    Scheme(
        "clairvoyant",
        Policy(),
        clairvoyant=True,
        note="knows hold times: reserve where the head fits soonest, EASY backfill (reference)",
    ),
    Scheme(
        "clairvoyant-reclaim",
        Policy(idle_reclaim_after=_RECLAIM),
        clairvoyant=True,
        note="the same with ours' idle reclaim after 15 min (reference)",
    ),
)
SCHEMES: tuple[Scheme, ...] = (*BASELINES, FLUID_RECLAIM, *CLAIRVOYANT, *OURS, *PARKING)


# -- allocators: the core, and the fluid reference -----------------------------------------


class Allocator(Protocol):
    def expect(self, key: Key, hold: float) -> None: ...
    def acquire(
        self, key: Key, ppm: int, now: float, arrived_at: float | None = None
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

    def acquire(self, key: Key, ppm: int, now: float, arrived_at: float | None = None) -> list[Key]:
        """``arrived_at``: the queue position's arrival, when earlier than ``now`` (a resume)."""
        ask = Ask(user=key[0], kernel_id=key[1], fraction_ppm=ppm)
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
        if self.policy.idle_reclaim_after is not None:
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

    def acquire(self, key: Key, ppm: int, now: float, arrived_at: float | None = None) -> list[Key]:
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

    def acquire(self, key: Key, ppm: int, now: float, arrived_at: float | None = None) -> list[Key]:
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


# -- the simulation ------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One acquire (a session's first, or a return after revocation) and when it was served."""

    session: int
    user: str
    ppm: int
    asked_at: float
    hold: float  # session seconds it will hold the lease if never revoked
    granted_at: float | None = None
    #: 0 for the session's first ask, n for its n-th return after reclaim or park
    attempt: int = 0


@dataclass
class LeaseRecord:
    session: int
    key: Key
    ppm: int
    start: float
    anchor: float  # wall time of session time 0 for this kernel
    end: float | None = None
    reason: str = ""


@dataclass
class Result:
    trace: Trace
    scheme: Scheme
    n_gpus: int
    capacity_ppm: int
    stopped_at: float
    requests: list[RequestRecord]
    leases: list[LeaseRecord]
    queue_busy: list[tuple[float, float]]  # intervals when someone waited
    used_ppm_s: float  # integral of allocated ppm over [0, horizon]
    sat_used_ppm_s: float  # the same, only while someone waited
    sat_s: float  # seconds within the horizon while someone waited
    max_active: int
    rejected: int
    wall_s: float
    #: kernels whose idle lease was parked (``Scheme.park``) rather than ended
    parked: int = 0
    #: session-seconds of busy time run by kernels that were then ended with their state
    lost_busy_s: float = 0.0


_ARRIVE, _END, _EXPIRE, _TICK = 0, 1, 2, 3


class Simulator:
    """Replays one trace under one scheme. ``check=True`` asserts invariants at every event."""

    def __init__(
        self,
        trace: Trace,
        scheme: Scheme,
        *,
        check: bool = False,
        reap_interval: float = 30.0,
        stop_at: float | None = None,
        seed: int = 0,
    ) -> None:
        self.trace = trace
        self.scheme = scheme
        self.check = check
        self.reap_interval = reap_interval
        self.stop_at = stop_at if stop_at is not None else 3 * trace.horizon
        self.gpus = trace.gpus()
        self.policy = scheme.policy or Policy()
        self.alloc: Allocator
        if scheme.policy is None:
            self.alloc = FluidAllocator(self.gpus, self.policy, scheme.fluid_reclaim_after)
        elif scheme.clairvoyant:
            self.alloc = ClairvoyantAllocator(self.gpus, scheme.policy)
        else:
            rng = random.Random(seed) if scheme.random_fit else None
            self.alloc = CoreAllocator(self.gpus, scheme.policy, rng)
        sessions = trace.sessions
        self._starts = [[a for a, _ in s.busy] for s in sessions]
        self._ends = [[b for _, b in s.busy] for s in sessions]

    def _ppm(self, s: Session) -> int:
        return PPM if self.scheme.whole_gpu else fraction_to_ppm(s.fraction)

    def run(self) -> Result:
        t0 = time.perf_counter()
        sessions = self.trace.sessions
        n = len(sessions)
        attempt = [0] * n
        tau_req = [0.0] * n  # session time at which the pending/current kernel starts
        anchor = [0.0] * n  # wall time of session time 0 for the current kernel
        done = [False] * n
        req_of: dict[Key, RequestRecord] = {}
        lease_of: dict[Key, LeaseRecord] = {}
        sess_of: dict[Key, int] = {}
        requests: list[RequestRecord] = []
        leases: list[LeaseRecord] = []
        heap: list[tuple[float, int, int, int, int]] = []
        seq = itertools.count()
        for i, s in enumerate(sessions):
            heap.append((s.arrival, next(seq), _ARRIVE, i, 0))
        heapq.heapify(heap)
        alloc, horizon, ttl = self.alloc, self.trace.horizon, self.policy.ttl
        # the broker's reaper (reclaim, then drain) runs every reap_interval while someone
        # waits; without reclaim its drain grants nothing the event-time drains did not
        policy = self.scheme.policy
        ticks = (
            policy is not None and policy.idle_reclaim_after is not None
        ) or self.scheme.fluid_reclaim_after is not None
        tick_pending = False
        queue_busy: list[tuple[float, float]] = []
        busy_since: float | None = None
        used = sat_used = sat = 0.0
        waiting = 0
        held = 0
        last_t = 0.0
        max_active = 0
        rejected = 0
        parked = 0
        lost_busy_s = 0.0
        parked_at: dict[int, float] = {}  # session -> when its kernel was parked

        def key_of(i: int) -> Key:
            return (sessions[i].user, f"{sessions[i].id}.{attempt[i]}")

        def activity(key: Key, now: float) -> tuple[bool, float]:
            i = sess_of[key]
            tau = now - anchor[i]
            j = bisect.bisect_right(self._starts[i], tau) - 1
            if j >= 0 and tau < self._ends[i][j] and tau < sessions[i].duration:
                return True, now
            start = anchor[i] + tau_req[i]
            return False, max(start, anchor[i] + self._ends[i][j]) if j >= 0 else start

        def granted(keys: Iterable[Key], now: float) -> None:
            nonlocal max_active
            for key in keys:
                i = sess_of[key]
                rec = req_of.pop(key)
                rec.granted_at = now
                anchor[i] = now - tau_req[i]
                lease = LeaseRecord(i, key, rec.ppm, now, anchor[i])
                leases.append(lease)
                lease_of[key] = lease
                end = anchor[i] + sessions[i].duration
                heapq.heappush(heap, (end, next(seq), _END, i, attempt[i]))
            max_active = max(max_active, alloc.active())

        def ended(keys: Iterable[Key], now: float, reason: str) -> None:
            for key in keys:
                lease = lease_of.pop(key)
                lease.end, lease.reason = now, reason

        stopped = 0.0
        while heap:
            t, _, kind, i, att = heapq.heappop(heap)
            if t > self.stop_at:
                stopped = self.stop_at
                break
            lo, hi = min(last_t, horizon), min(t, horizon)
            if hi > lo:
                used += held * (hi - lo)
                if waiting:
                    sat_used += held * (hi - lo)
                    sat += hi - lo
            last_t = t
            if kind == _ARRIVE:
                if att != attempt[i]:
                    continue
                key = key_of(i)
                sess_of[key] = i
                rec = RequestRecord(i, sessions[i].user, fraction_to_ppm(sessions[i].fraction), t,
                                    sessions[i].duration - tau_req[i], attempt=att)  # fmt: skip
                req_of[key] = rec
                requests.append(rec)
                alloc.expect(key, rec.hold)
                since = parked_at.pop(i, None)
                if since is not None and self.scheme.resume_order == "arrival":
                    since = None
                try:
                    granted(alloc.acquire(key, self._ppm(sessions[i]), t, since), t)
                except GPULeaseError:
                    rejected += 1
                    del req_of[key]
                    done[i] = True
            elif kind == _END:
                if att != attempt[i] or done[i]:
                    continue
                done[i] = True
                key = key_of(i)
                if sessions[i].crash:
                    alloc.crash(key, t + ttl)
                    heapq.heappush(heap, (t + ttl, next(seq), _EXPIRE, i, att))
                else:
                    ended([key], t, "released")
                    granted(alloc.release(key, t), t)
            elif kind == _EXPIRE:
                gone, new = alloc.expire(t)
                ended(gone, t, "expired")
                granted(new, t)
            else:  # _TICK
                tick_pending = False
                gone, new = alloc.reap(t, activity)
                for key in gone:
                    j = sess_of[key]
                    if self.scheme.park:
                        parked += 1
                    else:  # the kernel ends: the busy time it had run is lost with it
                        lease = lease_of[key]
                        lost_busy_s += _busy_within(
                            sessions[j].busy, lease.start - lease.anchor, t - lease.anchor
                        )
                ended(gone, t, "parked" if self.scheme.park else "revoked")
                for key in gone:
                    j = sess_of[key]
                    if done[j]:
                        continue
                    tau = t - anchor[j]
                    k = bisect.bisect_right(self._starts[j], tau)
                    if k >= len(self._starts[j]) or self._starts[j][k] >= sessions[j].duration:
                        done[j] = True  # nothing left to do: the student does not come back
                        continue
                    attempt[j] += 1
                    if self.scheme.park:
                        parked_at[j] = t
                    tau_req[j] = self._starts[j][k]
                    back = t + (tau_req[j] - tau)
                    heapq.heappush(heap, (back, next(seq), _ARRIVE, j, attempt[j]))
                granted(new, t)
            held = alloc.held_ppm()
            waiting = alloc.waiting()
            if waiting and busy_since is None:
                busy_since = t
            elif not waiting and busy_since is not None:
                queue_busy.append((busy_since, t))
                busy_since = None
            if ticks and waiting and not tick_pending:
                tick = (math.floor(t / self.reap_interval) + 1) * self.reap_interval
                heapq.heappush(heap, (tick, next(seq), _TICK, -1, 0))
                tick_pending = True
            if self.check:
                alloc.check()
                assert held <= len(self.gpus) * self.policy.capacity_ppm
                assert alloc.active() == len(lease_of)
                assert alloc.waiting() == len(req_of)

        stopped = max(stopped, last_t)
        if last_t < horizon:
            used += held * (horizon - last_t)
            if waiting:
                sat_used += held * (horizon - last_t)
                sat += horizon - last_t
        if busy_since is not None:
            queue_busy.append((busy_since, stopped))
        return Result(
            self.trace, self.scheme, len(self.gpus), self.policy.capacity_ppm, stopped,
            requests, leases, queue_busy, used, sat_used, sat, max_active, rejected, time.perf_counter() - t0,
            parked, lost_busy_s,
        )  # fmt: skip


def _busy_within(busy: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Session-seconds of the ``busy`` stretches inside [lo, hi)."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in busy)


# -- metrics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (as numpy's default); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 = all equal, 1/n = one takes all."""
    if not values:
        return 1.0
    sq = sum(x * x for x in values)
    if sq == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * sq)


@dataclass
class Metrics:
    trace: str
    scheme: str
    requests: int
    served: int
    waiting_at_end: int
    rejected: int
    revoked: int
    #: busy session-hours the kernels ended by idle reclaim (``revoked``) had run (what their students would have to redo)
    busy_h_lost: float
    parked: int
    #: mean wait of a student's return after reclaim or park, and of first arrivals
    return_wait_mean: float
    first_wait_mean: float
    seated_max: int
    seated_per_gpu: float
    wait_mean: float
    wait_p95: float
    large_wait_mean: float
    large_wait_p95: float
    large_wait_max: float
    large_hold_mean: float
    utilisation: float
    utilisation_saturated: float
    jain_wait: float
    jain_slowdown: float
    idle_held_gpu_h: float
    wall_s: float

    def row(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _waits(result: Result) -> list[tuple[RequestRecord, float]]:
    """(request, wait); a request still waiting at the end counts its wait so far."""
    return [
        (r, (r.granted_at if r.granted_at is not None else result.stopped_at) - r.asked_at)
        for r in result.requests
    ]


def _idle_held(result: Result, threshold: float = IDLE_METRIC_S) -> float:
    """Fraction-seconds held by kernels idle >= ``threshold`` while someone waited, within the horizon."""
    busy = [
        (a, min(b, result.trace.horizon)) for a, b in result.queue_busy if a < result.trace.horizon
    ]
    if not busy:
        return 0.0
    starts = [a for a, _ in busy]

    def overlap(lo: float, hi: float) -> float:
        total = 0.0
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        while k < len(busy) and busy[k][0] < hi:
            a, b = busy[k]
            total += max(0.0, min(b, hi) - max(a, lo))
            k += 1
        return total

    total = 0.0
    sessions = result.trace.sessions
    for lease in result.leases:
        s = sessions[lease.session]
        end = lease.end if lease.end is not None else result.stopped_at
        t0, t1 = lease.start - lease.anchor, end - lease.anchor  # session time held
        idle_from = t0
        for a, b in [*s.busy, (math.inf, math.inf)]:
            if b <= t0:
                continue
            gap_end = min(a, t1)
            if gap_end > idle_from + threshold:
                total += lease.ppm * overlap(
                    lease.anchor + idle_from + threshold, lease.anchor + gap_end
                )
            if a >= t1:
                break
            idle_from = max(idle_from, b)
    return total / PPM


def metrics(result: Result) -> Metrics:
    waits = _waits(result)
    all_w = [w for _, w in waits]
    large = [(r, w) for r, w in waits if r.ppm >= LARGE_PPM]
    large_w = [w for _, w in large]
    by_user: dict[str, list[float]] = {}
    waited = [0.0] * len(result.trace.sessions)  # per session, all its waits
    for r, w in waits:
        by_user.setdefault(r.user, []).append(w)
        waited[r.session] += w
    slow_by_user: dict[str, list[float]] = {}
    for s, w in zip(result.trace.sessions, waited, strict=True):  # a session stretched by its waits
        slow_by_user.setdefault(s.user, []).append((w + s.duration) / s.duration)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    capacity = result.n_gpus * result.capacity_ppm * result.trace.horizon
    return Metrics(
        trace=result.trace.name,
        scheme=result.scheme.name,
        requests=len(result.requests),
        served=sum(1 for r in result.requests if r.granted_at is not None),
        waiting_at_end=sum(1 for r in result.requests if r.granted_at is None),
        rejected=result.rejected,
        revoked=sum(1 for lease in result.leases if lease.reason == "revoked"),
        busy_h_lost=result.lost_busy_s / 3600.0,
        parked=result.parked,
        return_wait_mean=mean([w for r, w in waits if r.attempt]),
        first_wait_mean=mean([w for r, w in waits if not r.attempt]),
        seated_max=result.max_active,
        seated_per_gpu=result.max_active / result.n_gpus,
        wait_mean=mean(all_w),
        wait_p95=percentile(all_w, 95),
        large_wait_mean=mean(large_w),
        large_wait_p95=percentile(large_w, 95),
        large_wait_max=max(large_w, default=0.0),
        large_hold_mean=mean([r.hold for r, _ in large]),
        utilisation=result.used_ppm_s / capacity if capacity else 0.0,
        utilisation_saturated=result.sat_used_ppm_s
        / (result.n_gpus * result.capacity_ppm * result.sat_s)
        if result.sat_s
        else 0.0,
        jain_wait=jain([mean(ws) for ws in by_user.values()]),
        jain_slowdown=jain([mean(xs) for xs in slow_by_user.values()]),
        idle_held_gpu_h=_idle_held(result) / 3600.0,
        wall_s=result.wall_s,
    )


def simulate(trace: Trace, scheme: Scheme, **kwargs: Any) -> Metrics:
    """Run one scheme on one trace and return its metrics."""
    return metrics(Simulator(trace, scheme, **kwargs).run())


# -- estimated waits: how good were they? ----------------------------------------------------


class EtaAllocator(CoreAllocator):
    """The core allocator that also estimates, as the broker does, each new request's wait.

    Holds of ended leases feed a ``HoldTimes`` (seeded with ``seed_holds``, e.g. the
    holds of a previous run of the same class: the broker keeps its history). When a
    request joins the queue, ``estimate_waits`` predicts its wait; ``predicted`` maps the
    request's key to that estimate (None: the broker would give none).
    """

    def __init__(self, gpus: list[GPU], policy: Policy, seed_holds: Iterable[float] = ()) -> None:
        super().__init__(gpus, policy)
        self.holds = HoldTimes()
        for h in seed_holds:
            self.holds.add(h)
        self.predicted: dict[Key, float | None] = {}

    def _ended(self, leases: Iterable[Any], now: float) -> None:
        for lease in leases:
            self.holds.add(now - lease.created_at)

    def acquire(self, key: Key, ppm: int, now: float, arrived_at: float | None = None) -> list[Key]:
        granted = super().acquire(key, ppm, now, arrived_at)
        if key in self.state.queue:
            self.predicted[key] = estimate_waits(self.state, now, self.policy, self.holds).get(key)
        return granted

    def release(self, key: Key, now: float) -> list[Key]:
        self._ended([self.state.leases[self.state.by_kernel[key]]], now)
        return super().release(key, now)

    def expire(self, now: float) -> tuple[list[Key], list[Key]]:
        self._ended(expired(self.state, now), now)
        return super().expire(now)

    def reap(
        self, now: float, activity: Callable[[Key, float], tuple[bool, float]]
    ) -> tuple[list[Key], list[Key]]:
        before = dict(self.state.leases)
        gone, new = super().reap(now, activity)
        self._ended([lease for i, lease in before.items() if i not in self.state.leases], now)
        return gone, new


@dataclass
class EtaAccuracy:
    """Predicted vs actual waits of the requests that queued (seconds)."""

    queued: int
    estimated: int
    bias: float  # mean of (estimate - actual): above 0, estimates are too long
    mae: float
    median_abs: float
    p90_abs: float
    median_rel: float
    within_half: float  # share of estimates within 50 % (or 60 s) of the actual wait

    def row(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in vars(self).items()}


def eta_accuracy(trace: Trace, scheme: Scheme, *, warm: bool = True, **kwargs: Any) -> EtaAccuracy:
    """Run ``trace`` with estimates and compare each queued request's estimate with its wait.

    ``warm``: the hold history starts with the holds of a first run of the same trace
    (yesterday's class), as a broker that has run before has; else it starts empty.
    """
    assert scheme.policy is not None and not scheme.clairvoyant, "the core's own schemes only"
    seed: list[float] = []
    if warm:
        first = Simulator(trace, scheme, **kwargs).run()
        seed = [lease.end - lease.start for lease in first.leases if lease.end is not None]
    sim = Simulator(trace, scheme, **kwargs)
    alloc = EtaAllocator(sim.gpus, scheme.policy, seed)
    sim.alloc = alloc
    result = sim.run()
    errors: list[float] = []
    signed: list[float] = []
    relative: list[float] = []
    queued = estimated = 0
    within = 0
    for rec, key in zip(result.requests, _request_keys(result), strict=True):
        if key not in alloc.predicted or rec.granted_at is None:
            continue
        queued += 1
        guess = alloc.predicted[key]
        if guess is None:
            continue
        estimated += 1
        actual = rec.granted_at - rec.asked_at
        errors.append(abs(guess - actual))
        signed.append(guess - actual)
        relative.append(abs(guess - actual) / max(actual, 60.0))
        within += abs(guess - actual) <= max(0.5 * actual, 60.0)
    return EtaAccuracy(
        queued,
        estimated,
        sum(signed) / len(signed) if signed else 0.0,
        sum(errors) / len(errors) if errors else 0.0,
        percentile(errors, 50),
        percentile(errors, 90),
        percentile(relative, 50),
        within / estimated if estimated else 0.0,
    )


def _request_keys(result: Result) -> list[Key]:
    """Each request's key, in the order the simulator made them (``attempt`` counts up)."""
    attempts: dict[int, int] = {}
    keys = []
    for rec in result.requests:
        n = attempts.get(rec.session, 0)
        attempts[rec.session] = n + 1
        s = result.trace.sessions[rec.session]
        keys.append((s.user, f"{s.id}.{n}"))
    return keys
