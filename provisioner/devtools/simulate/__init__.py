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

*Parking* (``Scheme.park``) is idle reclaim that keeps the kernel: the same
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

The modules: :mod:`.traces` (sessions, pools, JSONL), :mod:`.schemes` (the policies
simulated), :mod:`.allocators` (the core, clairvoyant and fluid allocators),
:mod:`.simulator` (the event loop and its records), :mod:`.measures` (the metrics of a
run), :mod:`.eta` (how good the estimated waits were) and :mod:`.labs` (what class
sessions' reservations change: members' wait at a start, the others' wait and kernels
lost). Their names are re-exported
here: ``from provisioner.devtools.simulate import ...``.
"""

from __future__ import annotations

from .allocators import Allocator, ClairvoyantAllocator, CoreAllocator, FluidAllocator, Key
from .eta import EtaAccuracy, EtaAllocator, eta_accuracy
from .labs import SessionMetrics, session_metrics, simulate_sessions
from .measures import IDLE_METRIC_S, LARGE_PPM, Metrics, jain, metrics, percentile, simulate
from .schemes import (
    BASELINES,
    CLAIRVOYANT,
    FLUID_RECLAIM,
    OURS,
    PARKING,
    SCHEMES,
    SESSIONS,
    Scheme,
)
from .simulator import LeaseRecord, RequestRecord, Result, Simulator
from .traces import PoolSpec, Session, Trace, load_trace

__all__ = [
    "BASELINES",
    "CLAIRVOYANT",
    "FLUID_RECLAIM",
    "IDLE_METRIC_S",
    "LARGE_PPM",
    "OURS",
    "PARKING",
    "SCHEMES",
    "SESSIONS",
    "Allocator",
    "ClairvoyantAllocator",
    "CoreAllocator",
    "EtaAccuracy",
    "EtaAllocator",
    "FluidAllocator",
    "Key",
    "LeaseRecord",
    "Metrics",
    "PoolSpec",
    "RequestRecord",
    "Result",
    "Scheme",
    "Session",
    "SessionMetrics",
    "Simulator",
    "Trace",
    "eta_accuracy",
    "jain",
    "load_trace",
    "metrics",
    "percentile",
    "session_metrics",
    "simulate",
    "simulate_sessions",
]
