"""The trace simulator: correctness on a small trace and on hand-made ones (not speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from provisioner.broker.rules.policy import Policy
from provisioner.devtools.simulate import (
    SCHEMES,
    SESSIONS,
    PoolSpec,
    Scheme,
    Session,
    Simulator,
    Trace,
    jain,
    load_trace,
    metrics,
    percentile,
    session_metrics,
)
from provisioner.model import PPM

SMALL = Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "small.jsonl"
BY_NAME = {s.name: s for s in SCHEMES}
V100 = [PoolSpec(1, 32768, "V100")]


@pytest.fixture(scope="module")
def small() -> Trace:
    return load_trace(SMALL)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_small_trace_invariants_conservation_and_lease_lives(small, scheme):
    # check=True asserts scheduling.check_invariants (or the fluid's) after every event
    result = Simulator(small, scheme, check=True).run()
    m = metrics(result)
    assert m.rejected == 0
    assert m.served + m.waiting_at_end == m.requests  # nothing lost, nothing twice
    taken = [lease for lease in result.leases if lease.reason in ("revoked", "parked")]
    assert m.requests == len(small.sessions) + len(taken) - sum(  # their students come back...
        1 for lease in taken if not _returns(small, lease)
    )  # ...unless nothing is left of their session
    if scheme.park:  # the same victims, none of them ended: nothing to redo
        assert m.revoked == 0 and m.busy_h_lost == 0.0 and m.parked == len(taken)
    else:
        assert m.parked == 0 and m.revoked == len(taken)
    ttl = (scheme.policy or Policy()).ttl
    for lease in result.leases:
        s = small.sessions[lease.session]
        session_end = lease.anchor + s.duration
        assert lease.start <= session_end
        if lease.reason == "released":
            assert lease.end == pytest.approx(session_end)
        elif lease.reason == "expired":  # a crashed kernel's lease lives one TTL longer
            assert s.crash and lease.end == pytest.approx(session_end + ttl)
        elif lease.reason in ("revoked", "parked"):  # idle, or a crashed kernel's before it expired
            assert lease.end < session_end or (s.crash and lease.end <= session_end + ttl)
        else:
            assert lease.end is None and result.stopped_at < session_end + ttl
    if scheme.whole_gpu:
        assert m.seated_max <= 2  # two GPUs, one kernel each
    assert 0 <= m.utilisation <= 1 + 1e-9 and 0 <= m.utilisation_saturated <= 1 + 1e-9


def _returns(trace, lease) -> bool:
    s = trace.sessions[lease.session]
    tau = lease.end - lease.anchor
    return any(tau < a < s.duration for a, _ in s.busy)


def test_small_trace_exercises_every_path(small):
    ours = Simulator(small, BY_NAME["ours"]).run()
    reasons = {lease.reason for lease in ours.leases}
    assert {"released", "expired", "revoked"} <= reasons
    assert any(r.ppm >= PPM // 2 for r in ours.requests)


def _burst(n: int, fraction: float) -> Trace:
    sessions = [Session(f"k{i}", f"u{i}", i * 0.1, fraction, 3600.0) for i in range(n)]
    return Trace("burst", 3600.0, V100, sessions)


def test_best_fit_seats_fifty_students_at_002_on_one_v100_whole_gpu_one():
    # 0.02 of 32768 MiB reserves 655 MiB: a cap of 143 MiB after the 512 MiB context
    trace = _burst(60, 0.02)
    assert metrics(Simulator(trace, BY_NAME["ours"], check=True).run()).seated_max == 50
    whole = metrics(Simulator(trace, BY_NAME["whole-gpu"], check=True).run())
    assert whole.seated_max == 1 and whole.waiting_at_end > 0


def test_metrics_on_a_hand_made_trace():
    sessions = [
        Session("a", "alice", 0.0, 1.0, 100.0),
        Session("b", "bob", 10.0, 0.5, 50.0),  # waits 90 s for alice's GPU
        Session("c", "carol", 20.0, 0.5, 50.0),  # waits 80 s, then shares it with bob
    ]
    trace = Trace("three", 200.0, V100, sessions)
    for name in ("ours", "first-fit", "fluid"):
        m = metrics(Simulator(trace, BY_NAME[name], check=True).run())
        assert (m.requests, m.served, m.waiting_at_end) == (3, 3, 0)
        assert m.wait_mean == pytest.approx(170 / 3)
        assert m.wait_p95 == pytest.approx(89.0)  # [0, 80, 90] at 95 %: 80 + 0.9 * 10
        assert m.large_wait_max == pytest.approx(90.0)
        assert m.utilisation == pytest.approx((1.0 * 100 + 0.5 * 50 * 2) / 200)
        # while bob and carol waited, alice held the whole GPU
        assert m.utilisation_saturated == pytest.approx(1.0)
        assert m.jain_wait == pytest.approx(170**2 / (3 * (90**2 + 80**2)))
        assert m.jain_slowdown == pytest.approx(jain([1.0, 140 / 50, 130 / 50]))
        assert m.seated_max == 2 and m.idle_held_gpu_h == 0.0


def test_revoked_student_comes_back_when_next_active_and_waits_again():
    # alice runs a cell, goes idle for over an hour, comes back at session time 5000 s
    alice = Session("a", "alice", 0.0, 1.0, 6000.0, ((0.0, 10.0), (5000.0, 5100.0)))
    bob = Session("b", "bob", 100.0, 0.5, 100.0, ((0.0, 100.0),))
    trace = Trace("reclaim", 7000.0, V100, [alice, bob])
    scheme = Scheme("r", Policy(idle_reclaim_after=900.0))
    result = Simulator(trace, scheme, check=True).run()
    first, bobs, again = sorted(result.leases, key=lambda x: x.start)
    assert first.reason == "revoked" and first.end == 930.0  # first reaper tick after 910 s idle
    assert bobs.start == 930.0 and bobs.end == 1030.0
    assert again.start == 5000.0 and again.end == 6000.0 and again.reason == "released"
    waits = sorted((r.user, r.granted_at - r.asked_at) for r in result.requests)
    assert waits == [("alice", 0.0), ("alice", 0.0), ("bob", 830.0)]
    m = metrics(result)
    assert m.revoked == 1
    # alice held the GPU idle (>= 10 min) from 610 s until 930 s while bob waited
    assert m.idle_held_gpu_h == pytest.approx(320 / 3600)


@pytest.mark.parametrize(
    "values, expect",
    [
        ([], 1.0),
        ([0, 0, 0], 1.0),
        ([5, 5, 5, 5], 1.0),
        ([1, 0, 0, 0], 0.25),
        ([1, 1, 0, 0], 0.5),
        ([1, 2, 3], 36 / 42),
    ],
)
def test_jain_index(values, expect):
    assert jain(values) == pytest.approx(expect)


@pytest.mark.parametrize(
    "values, q, expect",
    [
        ([], 95, 0.0),
        ([7], 95, 7.0),
        ([1, 2, 3, 4], 50, 2.5),
        ([0, 80, 90], 95, 89.0),
        ([3, 1, 2], 100, 3),
    ],
)
def test_percentile(values, q, expect):
    assert percentile(values, q) == pytest.approx(expect)


def test_trace_round_trip(tmp_path, small):
    path = tmp_path / "t.jsonl"
    small.dump(path)
    again = load_trace(path)
    assert again.pool == small.pool and again.horizon == small.horizon
    assert sorted(again.sessions, key=lambda s: s.id) == sorted(small.sessions, key=lambda s: s.id)


def _park_then_contend() -> Trace:
    # alice (1.0) goes idle at 10 s and is parked at the 930 s tick for bob; carol arrives at
    # 2000 s, after the park; alice is back at 2500 s; both wait for bob's end at 2930 s
    alice = Session("a", "alice", 0.0, 1.0, 3000.0, ((0.0, 10.0), (2500.0, 3000.0)))
    bob = Session("b", "bob", 100.0, 1.0, 2000.0, ((0.0, 2000.0),))
    carol = Session("c", "carol", 2000.0, 1.0, 100.0, ((0.0, 100.0),))
    return Trace("park", 6000.0, V100, [alice, bob, carol])


@pytest.mark.parametrize(
    "name, alice_back, carol",
    [
        ("park", (2930.0, 3430.0), (3430.0, 3530.0)),
        ("park-arrival", (3030.0, 3530.0), (2930.0, 3030.0)),
    ],
)
def test_a_parked_kernel_resumes_from_its_park_time_or_as_a_new_arrival(name, alice_back, carol):
    result = Simulator(_park_then_contend(), BY_NAME[name], check=True).run()
    by_user: dict[str, list] = {}
    for lease in sorted(result.leases, key=lambda x: x.start):
        by_user.setdefault(result.trace.sessions[lease.session].user, []).append(lease)
    first, back = by_user["alice"]
    assert first.reason == "parked" and first.end == 930.0
    assert (back.start, back.end) == alice_back and back.reason == "released"
    (c,) = by_user["carol"]
    assert (c.start, c.end) == carol
    m = metrics(result)
    assert (m.revoked, m.parked, m.busy_h_lost) == (0, 1, 0.0)
    assert m.return_wait_mean == alice_back[0] - 2500.0


def test_reclaim_loses_the_busy_time_the_kernel_had_run():
    result = Simulator(_park_then_contend(), BY_NAME["ours"], check=True).run()
    m = metrics(result)
    assert (m.revoked, m.parked) == (1, 0)
    assert m.busy_h_lost == pytest.approx(10.0 / 3600)  # alice's one busy stretch, 0-10 s


# -- class sessions ------------------------------------------------------------------------

LABS = SMALL.parent / "labs.jsonl"


def test_the_labs_trace_round_trips_its_timetable(tmp_path):
    trace = load_trace(LABS)
    assert [(c.course, c.share_ppm) for c in trace.class_sessions] == [
        ("ml101", 800_000),
        ("ml101", 800_000),
        ("dl201", 1_500_000),
        ("dl201", 1_500_000),
    ]
    trace.dump(tmp_path / "again.jsonl")
    assert load_trace(tmp_path / "again.jsonl").class_sessions == trace.class_sessions


def test_a_lab_trace_with_and_without_reservations():
    """Invariants at every event (nothing reserved beyond the pool among them); members
    asking at a lab's start wait less with their course's share reserved; parking loses
    no kernel."""
    trace = load_trace(LABS)
    runs = {
        s.name: session_metrics(Simulator(trace, s, check=True).run())
        for s in [BY_NAME["ours"], *SESSIONS]
        if s.name in ("ours", "sessions", "sessions-park")
    }
    assert runs["sessions"].member_start_n == runs["ours"].member_start_n > 100
    assert runs["sessions"].member_start_p50 < runs["ours"].member_start_p50 / 5
    assert runs["sessions"].member_start_p95 < runs["ours"].member_start_p95
    assert runs["sessions-park"].others_lost == runs["sessions-park"].members_lost == 0
