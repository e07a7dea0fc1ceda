"""The simulator: one trace replayed under one scheme on a simulated clock."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...broker.rules.policy import Policy
from ...errors import GPULeaseError
from ...model import PPM, fraction_to_ppm
from .allocators import Allocator, ClairvoyantAllocator, CoreAllocator, FluidAllocator, Key
from .schemes import Scheme
from .traces import Session, Trace

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
        if scheme.sessions and isinstance(self.alloc, CoreAllocator):
            self.alloc.state.sessions = tuple(trace.class_sessions)
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
        if self.scheme.sessions:  # the reaper's passes around each class session
            for c in self.trace.class_sessions:
                t = c.start - self.policy.session_lead
                while t <= c.end + self.reap_interval:
                    heap.append((t, next(seq), _TICK, -2, 0))  # -2: not the waiters' tick
                    t += self.reap_interval
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
                    course = sessions[i].group
                    groups = frozenset({course}) if course else frozenset[str]()
                    granted(alloc.acquire(key, self._ppm(sessions[i]), t, since, groups), t)
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
                if i == -1:  # the waiters' tick (a class session's own ticks are -2)
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
