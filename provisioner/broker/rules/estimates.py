"""Estimated waits: the future replayed on a copy of the state.

Each active lease ends after its expected remaining hold given its age (from observed
hold times, :class:`HoldTimes`), or at its idle reclaim if sooner; after each end,
``scheduling.drain`` grants what fits, exactly as the broker will. Pure like the core it
replays (``now`` passed in); the broker's service and the simulator keep a ``HoldTimes``
each and call :func:`estimate_waits`.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from ...model import Lease, PoolState
from .policy import Policy
from .scheduling import apply_ends, apply_grants, drain, idle_since


@dataclass
class HoldTimes:
    """Observed hold times (seconds from grant to end) of recent leases, for estimated waits.

    The broker's service adds each lease's hold when it ends (released, revoked or
    expired) and seeds it from the store's recent history at start; the simulator does
    the same on its clock. ``limit`` bounds memory: the oldest observations go first.
    """

    limit: int = 1000
    holds: list[float] = field(default_factory=list)
    _sorted: list[float] | None = field(default=None, repr=False)

    def add(self, seconds: float) -> None:
        if seconds >= 0:
            self.holds.append(float(seconds))
            if len(self.holds) > self.limit:
                del self.holds[: len(self.holds) - self.limit]
            self._sorted = None

    def __len__(self) -> int:
        return len(self.holds)

    def ordered(self) -> list[float]:
        if self._sorted is None:
            self._sorted = sorted(self.holds)
        return self._sorted

    def mean(self) -> float:
        return sum(self.holds) / len(self.holds) if self.holds else 0.0

    def remaining(self, age: float, floor: float) -> float:
        """Expected seconds left for a lease held ``age`` seconds: the mean residual life.

        The mean of ``h - age`` over the observed holds ``h`` longer than ``age`` (leases
        that lived this long lived that much longer); with fewer than
        ``MIN_LONGER_HOLDS`` such observations (a lease older than almost all seen),
        half the mean hold. Never less than ``floor`` (the TTL: a lease ends at the
        earliest when its kernel stops, and then at once; an unrenewed one takes a TTL).
        """
        ordered = self.ordered()
        longer = ordered[bisect.bisect_right(ordered, age) :]
        if len(longer) >= MIN_LONGER_HOLDS:
            left = sum(longer) / len(longer) - age
        else:
            left = self.mean() / 2
        return max(floor, left)


#: fewer observed holds than this make no estimate at all
MIN_HOLDS_FOR_ETA = 5
#: a lease's residual life is averaged over at least this many longer holds
MIN_LONGER_HOLDS = 3


def expected_end(lease: Lease, now: float, policy: Policy, holds: HoldTimes) -> float:
    """When ``lease`` is expected to end: after its expected remaining hold, or, with idle
    reclaim on and its kernel idle now, when it will have been idle for
    ``idle_reclaim_after`` (someone waits, so the reaper then revokes it), if sooner."""
    end = now + holds.remaining(now - lease.created_at, policy.ttl)
    limit, since = policy.idle_reclaim_after, idle_since(lease)
    if limit is not None and since is not None:
        end = min(end, max(now, since + limit))
    return end


def estimate_waits(
    state: PoolState, now: float, policy: Policy, holds: HoldTimes
) -> dict[tuple[str, str], float]:
    """Estimated seconds until each waiting request gets its lease (by request key).

    Replays the future on a copy of the state: every active lease ends when
    :func:`expected_end` says (its expected remaining hold given its age, or its idle
    reclaim, if sooner); after each
    end, ``drain`` (queue order, placement and the head's reservation, exactly as the
    broker will) grants what fits, and each grant's lease is expected to last the mean
    hold. A request's estimate is the time of its grant. New arrivals, idle reclaim and
    kernels that stop earlier or later than the average are not foreseen: it is an
    estimate. Requests that no foreseen end makes room for, and every request while
    fewer than ``MIN_HOLDS_FOR_ETA`` holds were observed, get none.
    """
    if not state.queue or len(holds) < MIN_HOLDS_FOR_ETA:
        return {}
    sim = state.copy()
    mean_hold = max(policy.ttl, holds.mean())
    ends: list[tuple[float, str]] = [
        (expected_end(lease, now, policy, holds), lease.id) for lease in sim.leases.values()
    ]
    heapq.heapify(ends)
    out: dict[tuple[str, str], float] = {}
    t = now
    while sim.queue and ends:
        t, lease_id = heapq.heappop(ends)
        # every lease ending at the same moment ends before the drain
        gone = [lease_id]
        while ends and ends[0][0] <= t:
            gone.append(heapq.heappop(ends)[1])
        apply_ends(sim, gone)
        grants = drain(sim, t, policy)
        apply_grants(sim, grants)
        for grant in grants:
            if grant.request is not None:
                out[grant.request.key] = t - now
            heapq.heappush(ends, (t + mean_hold, grant.lease.id))
    return out
