"""Class sessions in the core (``broker/rules/sessions.py`` and its use in ``scheduling``):
the timetable in time zones, where a share is reserved, the lead time, freeing at the
start (idle at once, busy after the grace), members first, lending back, the end; the
sentences students read. Fast: plain data, ``now`` passed in."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from provisioner.broker.rules import scheduling, sessions
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.rules.scheduling import Grant, Queued
from provisioner.model import GPU, ClassSession, PoolState, Quota

GPUS = [GPU("g0", "a", "V100", 32768, 0), GPU("g1", "a", "V100", 32768, 1)]
POLICY = Policy(session_lead=600, session_lend_after=900, session_busy_grace=600)
ML101 = frozenset({"ml101"})
#: ml101 reserves one whole GPU from t=10,000 to t=15,400 (10:46-12:16 UTC on day 0)
LAB = ClassSession("ml101", 10_000.0, 15_400.0, share_ppm=1_000_000, label="Thu 02:46-04:16")


def pool(*sessions_: ClassSession) -> PoolState:
    state = PoolState.build(GPUS)
    state.sessions = sessions_
    return state


def ask(state, user, kernel, ppm, now, groups=frozenset(), ids=itertools.count()):
    decision, _ = scheduling.acquire(
        state,
        Ask(user, kernel, ppm, groups=groups),
        Quota(),
        now,
        POLICY,
        lambda: f"L{next(ids)}",
    )
    return decision.outcome


def test_a_weekly_plan_follows_its_zone_across_daylight_saving():
    plan = sessions.SessionPlan(
        "ml101", dt.time(10), dt.time(11, 30), tz="Europe/Paris", days=(1,), share_ppm=800_000
    )
    # two Tuesdays around the end of summer time (2026-10-25)
    since = dt.datetime(2026, 10, 19, tzinfo=dt.UTC).timestamp()
    until = dt.datetime(2026, 11, 2, tzinfo=dt.UTC).timestamp()
    got = plan.occurrences(since, until)
    starts = [dt.datetime.fromtimestamp(s.start, dt.UTC) for s in got]
    assert starts == [
        dt.datetime(2026, 10, 20, 8, 0, tzinfo=dt.UTC),  # CEST: UTC+2
        dt.datetime(2026, 10, 27, 9, 0, tzinfo=dt.UTC),  # CET: UTC+1
    ]
    assert all(s.end - s.start == 5400 for s in got)
    assert got[0].label == "Tue 10:00-11:30" and got[0].tz == "Europe/Paris"
    assert sessions.clock_text(got[0].end, "Europe/Paris") == "11:30"


def test_a_dated_plan_happens_once():
    plan = sessions.SessionPlan(
        "ml101", dt.time(9), dt.time(12), date=dt.date(2026, 12, 1), pool_fraction=0.5
    )
    day = dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()
    assert len(plan.occurrences(day - 7 * 86400, day + 7 * 86400)) == 1
    assert plan.occurrences(day + 86400, day + 7 * 86400) == []
    assert plan.label == "2026-12-01 09:00-12:00"


def test_the_share_lands_on_whole_gpus_from_the_end_of_the_pool_and_never_beyond_it():
    state = pool(LAB, ClassSession("ds200", 10_500.0, 12_000.0, share_ppm=1_500_000))
    where = sessions.reserve(state, state.sessions, POLICY)
    assert where[LAB.key] == {"g1": 1_000_000}
    assert where[state.sessions[1].key] == {"g0": 1_000_000}  # cut: the pool has 2 GPUs


def test_in_the_lead_time_non_members_are_kept_out_of_the_share_and_members_are_not():
    state = pool(LAB)
    early = LAB.start - 700  # before the lead time: anyone anywhere
    assert isinstance(ask(state, "res", "k0", 1_000_000, early), Grant)
    lead = LAB.start - 500
    # the other GPU is the share: a research kernel waits, and is told why
    out = ask(state, "res", "k1", 500_000, lead)
    assert isinstance(out, Queued)
    assert out.reason.startswith("Part of the GPUs you may use is reserved for ml101's class ")
    assert "until 04:16" in out.reason
    # a member is placed in the share at once, past the waiting head
    assert isinstance(ask(state, "ann", "k0", 100_000, lead, ML101), Grant)


def test_at_the_start_idle_non_members_are_freed_and_busy_ones_only_after_the_grace():
    state = pool(LAB)
    for i in range(4):  # four research kernels fill both GPUs, before the lead time
        assert isinstance(ask(state, f"r{i}", "k", 500_000, 0.0), Grant)
    on_share = sorted(x.id for x in state.leases.values() if x.gpu_uuid == "g1")
    busy, idle = on_share
    state.update_lease(
        scheduling.renewed(state.leases[busy], 9_000, POLICY, execution_state="busy")
    )
    state.update_lease(
        scheduling.renewed(state.leases[idle], 9_000, POLICY, execution_state="idle")
    )
    for lease in list(state.leases.values()):  # the others keep renewing
        state.update_lease(scheduling.renewed(lease, 9_950, POLICY))
    # the lead time frees nothing
    assert not scheduling.reap(state, LAB.start - 10, POLICY).freed
    reaped = scheduling.reap(state, LAB.start, POLICY, can_park=lambda lease: "")
    assert [(x.id, c) for x, c in reaped.freed] == [(idle, "ml101")]
    (ended,) = reaped.changes.ended
    assert ended[1:] == ("revoked", "the GPU was reserved for ml101's class session until 04:16")
    for lease in list(state.leases.values()):
        state.update_lease(scheduling.renewed(lease, LAB.start + 550, POLICY))
    assert not scheduling.reap(state, LAB.start + 500, POLICY).freed  # busy, within the grace
    late = scheduling.reap(state, LAB.start + 600, POLICY, can_park=lambda lease: None)
    assert [x.id for x, _ in late.freed] == [busy] and late.parking[0].id == busy
    scheduling.check_invariants(state, POLICY)


def test_members_fill_the_share_first_then_share_the_rest():
    state = pool(LAB)
    grants = [ask(state, f"s{i}", "k", 250_000, LAB.start, ML101) for i in range(5)]
    assert all(isinstance(g, Grant) for g in grants)
    assert [g.lease.gpu_uuid for g in grants] == ["g1"] * 4 + ["g0"]
    # a non-member uses the rest
    assert isinstance(ask(state, "res", "k", 500_000, LAB.start), Grant)


def test_an_unused_share_is_lent_back_until_a_member_asks_and_returns_at_the_end():
    state = pool(LAB)
    assert isinstance(ask(state, "res", "k0", 1_000_000, LAB.start), Grant)  # g0
    assert isinstance(ask(state, "res2", "k0", 500_000, LAB.start), Queued)
    views = sessions.views(state, LAB.start + 10, POLICY)
    assert views[0].to_json()["state"] == "on" and views[0].to_json()["reserved"] == 1.0
    lent = LAB.start + 900
    for lease in list(state.leases.values()):  # the kernel renews, its neighbour polls
        state.update_lease(scheduling.renewed(lease, lent, POLICY))
    for req in state.queue.values():
        req.last_polled_at = lent
    grants = scheduling.reap(state, lent, POLICY).changes.granted
    assert [g.lease.gpu_uuid for g in grants] == ["g1"]  # lent back
    assert sessions.views(state, lent, POLICY)[0].to_json()["lent"] == 1.0
    # a member asks: the share is held again, and the member is placed in what is left
    assert isinstance(ask(state, "ann", "k0", 500_000, lent + 1, ML101), Grant)
    # after the end, the GPU is everyone's again
    assert not sessions.shares(state, LAB.end, POLICY)
    assert sessions.views(state, LAB.end, POLICY) == []


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            ClassSession("ds200", 12_000.0, 13_000.0, share_ppm=1_500_000, label="Thu"),
            "ml101 (Thu 02:46-04:16) and ds200 (Thu) reserve 2.5 GPU at once but their "
            "GPUs have 2: 0.5 GPU too much.",
        ),
        (ClassSession("ds200", 15_400.0, 16_000.0, share_ppm=1_500_000), None),
        (
            ClassSession("ds200", 0.0, 1.0, share_ppm=100_000, nodes=("b",), label="x"),
            "ds200 (x) reserves 0.1 GPU at once but its GPUs have 0: 0.1 GPU too much.",
        ),
    ],
)
def test_overbooked_timetables_are_named_with_how_much(second, message):
    got = sessions.overbooked([LAB, second], GPUS, POLICY)
    assert got == ([message] if message else [])


def test_without_a_declared_pool_only_pool_fractions_are_summed():
    a = ClassSession("a", 0.0, 10.0, pool_fraction=0.7, label="A")
    b = ClassSession("b", 5.0, 15.0, pool_fraction=0.5, label="B")
    assert sessions.overbooked([a, b], None, POLICY) == [
        "a (A) and b (B) reserve 120% of the pool at once, 20% too much."
    ]


# -- the command line's pure parts ------------------------------------------------------


def test_until_takes_a_time_today_or_a_length() -> None:
    import argparse

    from provisioner.cli import until_arg

    now = dt.datetime(2026, 11, 24, 9, 30, tzinfo=dt.UTC).timestamp()
    paris = dt.datetime(2026, 11, 24, 11, 45, tzinfo=sessions.zone_of("Europe/Paris"))
    assert until_arg("11:45", now, "Europe/Paris") == paris.timestamp()
    assert until_arg("90m", now, "UTC") == now + 5400
    assert until_arg("2h", now, "UTC") == now + 7200
    with pytest.raises(argparse.ArgumentTypeError, match="9:00 has passed today"):
        until_arg("9:00", now, "UTC")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a time such as 11:45"):
        until_arg("soon", now, "UTC")


def test_the_timetable_as_a_table() -> None:
    from provisioner import tables

    start = dt.datetime(2026, 11, 24, 9, 0, tzinfo=dt.UTC).timestamp()
    planned = {
        "course": "ml101",
        "start": start,
        "end": start + 5400,
        "tz": "Europe/Paris",
        "label": "Tue 10:00-11:30",
        "source": "timetable",
        "state": "on",
        "share": "0.8 GPU",
        "reserved": 0.8,
        "used": 0.3,
        "lent": 0.0,
    }
    by_hand = {**planned, "source": "by hand", "state": "lead", "end": start + 7200}
    moved = {**planned, "end": start + 6300}
    text = tables.format_sessions([planned, by_hand, moved])
    assert text.splitlines() == [
        "Class sessions:",
        "  COURSE  WHEN                                        STATE  SHARE    RESERVED  USED  LENT",
        "  ml101   Tue 10:00-11:30 Europe/Paris                on     0.8 GPU  0.8       0.3   0",
        "  ml101   by hand 10:00-12:00 Europe/Paris            lead   0.8 GPU  0.8       0.3   0",
        "  ml101   Tue 10:00-11:30 (until 11:45) Europe/Paris  on     0.8 GPU  0.8       0.3   0",
    ]
    assert tables.format_sessions([]) == "Class sessions: none in the next two days"
