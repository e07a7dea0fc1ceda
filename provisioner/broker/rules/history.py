"""The pool's history in time buckets: allocation, queue length and waits (pure).

Called by :meth:`provisioner.broker.services.queries.QueryService.history` (``GET
/api/v1/history``, the dashboard's plots) with the lease rows and queue records the
store read for the period; nothing here does I/O or reads the clock.

For buckets ``[t, t + step)`` from ``since`` (rounded down to a multiple of ``step``,
so that buckets stay put as time passes) to ``until`` (the last bucket may be partial;
its means are over the part that has passed):

- ``allocated`` / ``allocated_max``: the sum of active lease fractions (in GPUs),
  averaged over the bucket / at its peak. A lease counts from ``created_at`` to
  ``ended_at`` (an active lease up to ``until``);
- ``queue`` / ``queue_max``: requests waiting, averaged / at the peak;
- ``grants``: leases granted in the bucket; ``waited``: those of them that had waited
  in the queue, with ``wait_mean_s`` and ``wait_max_s`` (``None`` when none waited);
  ``withdrawn``: requests that left the queue without a lease (cancelled or dropped).

At one instant, ends come before starts (the broker releases, then grants), so a peak
never counts a lease that ended and the one that took its place together.

With ``group``, only that course's part counts, by :func:`provisioner.model.attribution`:
a lease's fraction is weighted by the course's share of it (as ``usage --by group``
splits it), while a request counts wholly in each of its courses (queue length, waits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ...model import Lease, QueueRecord, attribution
from ...wire import ppm_to_fraction

__all__ = ["MAX_POINTS", "Point", "bucket_starts", "compute"]

#: the most buckets one history may have (step must be at least (until - since) / this)
MAX_POINTS = 2000


@dataclass(frozen=True)
class Point:
    """One bucket ``[t, t + step)`` of the history (fractions in GPUs, waits in seconds)."""

    t: float
    allocated: float
    allocated_max: float
    queue: float
    queue_max: int
    grants: int
    waited: int
    wait_mean_s: float | None
    wait_max_s: float | None
    withdrawn: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def bucket_starts(since: float, until: float, step: float) -> list[float]:
    """Bucket starts from ``since`` rounded down to a multiple of ``step``, while before ``until``."""
    if not step > 0 or not math.isfinite(step):
        raise ValueError(f"step must be a positive number of seconds, not {step!r}")
    first = math.floor(since / step) * step
    n = max(0, math.ceil((until - first) / step))
    if n > MAX_POINTS:
        raise ValueError(f"{n} buckets is more than {MAX_POINTS}; choose a larger step")
    return [first + i * step for i in range(n)]


def _sweep(
    events: list[tuple[float, int]], starts: list[float], step: float, until: float
) -> list[tuple[float, int]]:
    """(mean, peak) per bucket of a step function given as ``(time, change)`` events.

    Events before the first bucket set the starting value; at equal times, decreases
    come first (sorted by ``(time, change)``).
    """
    events = sorted(events)
    out: list[tuple[float, int]] = []
    value = 0
    i = 0
    for t0 in starts:
        t1 = min(t0 + step, until)
        while i < len(events) and events[i][0] <= t0:
            value += events[i][1]
            i += 1
        peak = value
        area = 0.0
        t = t0
        while i < len(events) and events[i][0] < t1:
            area += value * (events[i][0] - t)
            t = events[i][0]
            value += events[i][1]
            peak = max(peak, value)
            i += 1
        area += value * (t1 - t)
        out.append((area / (t1 - t0) if t1 > t0 else float(value), peak))
    return out


def compute(
    leases: Iterable[Lease],
    queue: Iterable[QueueRecord],
    since: float,
    until: float,
    step: float,
    *,
    group: str | None = None,
) -> list[Point]:
    """The history of ``[since, until)`` in buckets of ``step`` seconds (see the module doc).

    ``leases`` and ``queue`` may hold rows outside the period; they are clipped here.
    Raises ``ValueError`` for a step that is not positive or gives more than
    :data:`MAX_POINTS` buckets.
    """
    starts = bucket_starts(since, until, step)
    if not starts:
        return []
    first = starts[0]

    def index(t: float) -> int | None:
        k = math.floor((t - first) / step)
        return k if 0 <= k < len(starts) and t < until else None

    alloc: list[tuple[float, int]] = []  # fraction in ppm x the course's share (ppm)
    grants = [0] * len(starts)
    for lease in leases:
        weight = 1.0
        if group is not None:
            weight = attribution(lease.group, lease.groups).get(group, 0.0)
            if weight <= 0:
                continue
        if (k := index(lease.created_at)) is not None:
            grants[k] += 1
        start = lease.created_at
        end = lease.ended_at if lease.state != "active" and lease.ended_at is not None else until
        if end <= first or start >= until or end <= start:
            continue
        ppm = round(lease.fraction_ppm * weight)
        alloc.append((start, ppm))
        if end < until:
            alloc.append((end, -ppm))

    waiting: list[tuple[float, int]] = []
    waits: list[list[float]] = [[] for _ in starts]
    withdrawn = [0] * len(starts)
    for rec in queue:
        if group is not None and group not in attribution(rec.group, rec.groups):
            continue
        left = rec.left_at if rec.left_at is not None else until
        if left <= first or rec.arrived_at >= until:
            continue
        if left > rec.arrived_at:
            waiting.append((rec.arrived_at, 1))
            if left < until:
                waiting.append((left, -1))
        if rec.left_at is None or (k := index(rec.left_at)) is None:
            continue
        if rec.outcome == "granted":
            waits[k].append(rec.left_at - rec.arrived_at)
        else:
            withdrawn[k] += 1

    allocated = _sweep(alloc, starts, step, until)
    queued = _sweep(waiting, starts, step, until)
    points = []
    for k, t0 in enumerate(starts):
        w = waits[k]
        points.append(
            Point(
                t=t0,
                allocated=round(ppm_to_fraction(allocated[k][0]), 6),
                allocated_max=round(ppm_to_fraction(allocated[k][1]), 6),
                queue=round(queued[k][0], 4),
                queue_max=queued[k][1],
                grants=grants[k],
                waited=len(w),
                wait_mean_s=round(sum(w) / len(w), 3) if w else None,
                wait_max_s=round(max(w), 3) if w else None,
                withdrawn=withdrawn[k],
            )
        )
    return points
