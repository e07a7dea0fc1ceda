"""Schemes: the policies simulated (ours, its variants, the baselines, the references)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...broker.rules.policy import Policy

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
    #: the trace's class sessions reserve their shares (``broker/rules/sessions.py``)
    sessions: bool = False


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
#: parking instead of reclaim: the same victims, their state kept
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
#: class sessions' reservations (the trace's timetable) against ``ours`` without them
_LAB = Policy(idle_reclaim_after=_RECLAIM)
SESSIONS: tuple[Scheme, ...] = (
    Scheme(
        "sessions",
        _LAB,
        sessions=True,
        note="ours with the timetable's reservations: lead 10 min, lent back after 15 min, "
        "busy kernels never freed (the broker's defaults)",
    ),
    Scheme(
        "sessions-park",
        _LAB,
        sessions=True,
        park=True,
        note="the same, idle kernels parked (at the start and for waiters) instead of revoked",
    ),
    Scheme(
        "sessions-no-lend",
        replace(_LAB, session_lend_after=None),
        sessions=True,
        note="reservations never lent back",
    ),
    Scheme(
        "sessions-lend-5m",
        replace(_LAB, session_lend_after=300.0),
        sessions=True,
        note="an unused share lent back after 5 min",
    ),
    Scheme(
        "sessions-lead-0",
        replace(_LAB, session_lead=0.0),
        sessions=True,
        note="no lead time: the share is kept from non-members only from the start",
    ),
    Scheme(
        "sessions-busy-10m",
        replace(_LAB, session_busy_grace=600.0),
        sessions=True,
        note="busy kernels in the share freed too, 10 min after the start",
    ),
    Scheme(
        "sessions-park-busy-10m",
        replace(_LAB, session_busy_grace=600.0),
        sessions=True,
        park=True,
        note="parked, and busy kernels in the share freed (parked) 10 min after the start",
    ),
)
SCHEMES: tuple[Scheme, ...] = (*BASELINES, FLUID_RECLAIM, *CLAIRVOYANT, *OURS, *PARKING)
