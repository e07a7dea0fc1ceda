"""Estimated waits (``estimates.estimate_waits``): tables on the pure core, and the simulator.

The broker answers ``eta_seconds`` in queued answers and ``GET /api/v1/queue`` from this
function (see docs/developers.md, "Estimated waits"); JupyterLab shows it as "about 4 min".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from provisioner.broker.rules import estimates, scheduling
from provisioner.broker.rules.estimates import HoldTimes
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.rules.scheduling import Queued
from provisioner.devtools.simulate import SCHEMES, eta_accuracy, load_trace
from provisioner.model import GPU, PPM, PoolState

V100 = GPU("GPU-v100", "local", "V100", 32768, 0)
T4 = GPU("GPU-t4", "other", "T4", 16384, 0)
SMALL = Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "small.jsonl"
POLICY = Policy(ttl=30.0)


def holds(*seconds: float) -> HoldTimes:
    h = HoldTimes()
    for s in seconds:
        h.add(s)
    return h


def queue_up(state: PoolState, user: str, kernel: str, ppm: int, now: float, **kw: object) -> None:
    n = len(state.leases) + len(state.queue)
    d = scheduling.decide_acquire(
        state,
        Ask(user, kernel, ppm, **kw),
        scheduling.Quota(),
        now,
        POLICY,
        lambda: f"id{n}-{kernel}",
    )
    scheduling.apply_grants(state, d.grants)
    if isinstance(d.outcome, Queued):
        state.queue[d.outcome.request.key] = d.outcome.request


@pytest.mark.parametrize(
    "observed, age, expect",
    [
        ([600] * 5, 0, 600),  # everyone held 10 min: a new lease has 10 min left
        ([600] * 5, 500, 100),  # ... and one held 500 s has 100 s left
        ([100, 200, 300, 900, 900, 900], 250, 500),  # mean of the longer (750) minus the age
        ([600] * 5, 700, 300),  # older than every hold seen: half the mean hold
        ([10] * 5, 0, 30),  # never below the TTL
    ],
)
def test_remaining_hold_is_the_mean_residual_life(observed, age, expect):
    assert holds(*observed).remaining(age, floor=30.0) == pytest.approx(expect)


def test_no_estimate_without_enough_history_or_without_a_queue():
    state = PoolState.build([V100])
    queue_up(state, "a", "k1", PPM, 0.0)
    assert estimates.estimate_waits(state, 0.0, POLICY, holds(600, 600, 600, 600, 600)) == {}
    queue_up(state, "b", "k2", PPM // 2, 0.0)  # waits
    assert estimates.estimate_waits(state, 0.0, POLICY, holds(600, 600)) == {}


def test_each_waiting_request_gets_the_time_its_turn_comes():
    state = PoolState.build([V100])
    queue_up(state, "a", "k1", PPM // 2, 0.0)
    queue_up(state, "b", "k2", PPM // 2, 300.0)  # two halves fill the GPU; b's is younger
    for i, who in enumerate(["c", "d", "e"]):
        queue_up(state, who, f"w{i}", PPM // 2, 400.0)
    assert len(state.queue) == 3
    # every lease lasts 1000 s: a's ends at 1000, b's at 1300; c and d take their places,
    # each for 1000 s more, e follows when c's lease ends at 2000
    etas = estimates.estimate_waits(state, 400.0, POLICY, holds(*[1000.0] * 5))
    assert etas == {("c", "w0"): 600.0, ("d", "w1"): 900.0, ("e", "w2"): 1600.0}
    assert len(state.queue) == 3 and len(state.leases) == 2  # the state is left alone


def test_placement_limits_hold_in_the_replay():
    state = PoolState.build([V100, T4])
    queue_up(state, "a", "k1", PPM, 0.0, node="local")
    queue_up(state, "b", "k2", PPM, 5.0, node="other")
    queue_up(state, "c", "k3", PPM, 10.0, node="local")  # waits for a's V100
    queue_up(state, "d", "k4", PPM, 10.0, node="other")  # waits for b's T4
    etas = estimates.estimate_waits(state, 10.0, POLICY, holds(*[100.0] * 5))
    assert etas == {("c", "k3"): 90.0, ("d", "k4"): 95.0}


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_estimates_on_the_small_trace(warm):
    """The simulator compares each queued request's estimate with its real wait."""
    trace = load_trace(SMALL)
    ours = next(s for s in SCHEMES if s.name == "ours")
    acc = eta_accuracy(trace, ours, warm=warm)
    assert acc.queued > 0
    assert 0 < acc.estimated <= acc.queued
    assert acc.mae >= 0 and acc.median_abs <= acc.p90_abs
    assert 0.0 <= acc.within_half <= 1.0
    if warm:  # a broker with history estimates (nearly) every wait
        assert acc.estimated >= 0.9 * acc.queued, acc
