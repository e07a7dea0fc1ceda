"""What class sessions change, measured on a trace with a timetable (``Trace.class_sessions``).

Members are the sessions (kernels) whose group is a course with class sessions; the
others (a research group) are everyone else. For one run (:func:`session_metrics`):

* members' wait at a session's start: first asks from ``lead`` before a start to
  ``window`` after it (p50, p95, max; a request still waiting at the end counts its wait
  so far);
* the others' wait (mean, p95) and their kernels lost: leases ended with their state
  (revoked: by idle reclaim for a waiter, or freed from a share); parked ones keep it;
* the busy hours those lost kernels had run (all users).
"""

from __future__ import annotations

from dataclasses import dataclass

from .measures import _waits, percentile
from .schemes import Scheme
from .simulator import Result, Simulator
from .traces import Trace


@dataclass(frozen=True)
class SessionMetrics:
    trace: str
    scheme: str
    member_start_n: int
    member_start_p50: float
    member_start_p95: float
    member_start_max: float
    others_n: int
    others_wait_mean: float
    others_wait_p95: float
    others_lost: int
    members_lost: int
    busy_h_lost: float
    parked: int


def session_metrics(result: Result, lead: float = 600.0, window: float = 600.0) -> SessionMetrics:
    """The class-session measures of one run (see the module docstring)."""
    trace = result.trace
    starts: dict[str, list[float]] = {}
    for c in trace.class_sessions:
        starts.setdefault(c.course, []).append(c.start)
    group = [s.group for s in trace.sessions]
    at_start: list[float] = []
    others: list[float] = []
    for r, w in _waits(result):
        course = group[r.session]
        if course in starts:
            if r.attempt == 0 and any(t - lead <= r.asked_at <= t + window for t in starts[course]):
                at_start.append(w)
        else:
            others.append(w)
    lost = [lease for lease in result.leases if lease.reason == "revoked"]
    members_lost = sum(1 for lease in lost if group[lease.session] in starts)
    return SessionMetrics(
        trace=trace.name,
        scheme=result.scheme.name,
        member_start_n=len(at_start),
        member_start_p50=percentile(at_start, 50),
        member_start_p95=percentile(at_start, 95),
        member_start_max=max(at_start, default=0.0),
        others_n=len(others),
        others_wait_mean=sum(others) / len(others) if others else 0.0,
        others_wait_p95=percentile(others, 95),
        others_lost=len(lost) - members_lost,
        members_lost=members_lost,
        busy_h_lost=result.lost_busy_s / 3600.0,
        parked=result.parked,
    )


def simulate_sessions(trace: Trace, scheme: Scheme, **kwargs: object) -> SessionMetrics:
    """Run one scheme on a trace with a timetable and measure what sessions change."""
    return session_metrics(Simulator(trace, scheme, **kwargs).run())  # type: ignore[arg-type]


__all__ = ["SessionMetrics", "session_metrics", "simulate_sessions"]
