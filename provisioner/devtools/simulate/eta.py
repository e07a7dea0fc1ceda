"""Estimated waits: how good were the broker's predictions on a trace?"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...broker.rules.estimates import HoldTimes, estimate_waits
from ...broker.rules.policy import Policy
from ...broker.rules.scheduling import expired
from ...model import GPU
from .allocators import CoreAllocator, Key
from .measures import percentile
from .schemes import Scheme
from .simulator import Result, Simulator
from .traces import Trace

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

    def acquire(
        self,
        key: Key,
        ppm: int,
        now: float,
        arrived_at: float | None = None,
        groups: frozenset[str] = frozenset(),
    ) -> list[Key]:
        granted = super().acquire(key, ppm, now, arrived_at, groups)
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
