"""Metrics of a run: waits, utilisation, fairness, idle-held capacity, work lost."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...model import PPM
from .schemes import Scheme
from .simulator import RequestRecord, Result, Simulator
from .traces import Trace

#: a kernel idle this long counts as "idle-held" (the metric; not a policy knob)
IDLE_METRIC_S = 600.0
#: requests at least this large are "large" (research) in the metrics
LARGE_PPM = PPM // 2


# -- metrics ------------------------------------------------------------------------------


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
