"""Table tests of lease parking in the pure core (no I/O, ``now`` passed in).

The reaper parks an idle victim instead of revoking it where the service's ``can_park``
allows; the agent's reports move it on (``park_done``/``park_failed``); its owner's
``resume`` queues a resume request that keeps the place of the moment it was parked and
is granted by re-reserving the same lease on its GPU (``resuming``), then
``resume_done``/``resume_failed``. Every test checks ``check_invariants`` as it goes.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from provisioner import wire
from provisioner.broker.rules import estimates, scheduling
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.rules.scheduling import Existing, Grant, Queued, ResumeDecision
from provisioner.errors import QuotaExceeded
from provisioner.model import GPU, Changes, Lease, PoolState, Quota

V100 = GPU("GPU-v100", "a", "V100", 32768, 0)
T4 = GPU("GPU-t4", "b", "T4", 16384, 0)
POLICY = Policy(ttl=10_000, idle_reclaim_after=600, queue_poll_grace=10_000)
IDLE = scheduling.idle_reason(POLICY)


def ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def ok(state: PoolState) -> None:
    scheduling.check_invariants(state, POLICY)


def take(state: PoolState, user: str, ppm: int, now: float = 0.0, kernel: str = "k", **kw):
    """Acquire as the service does; returns the outcome."""
    d, _ = scheduling.acquire(state, Ask(user, kernel, ppm, **kw), Quota(), now, POLICY, NEW)
    ok(state)
    return d.outcome


NEW = ids()


def idle(state: PoolState, lease_id: str, since: float = 0.0) -> None:
    lease = state.find_lease(lease_id)
    assert lease is not None
    state.update_lease(replace(lease, execution_state="idle", last_activity=since))


@pytest.fixture
def full() -> tuple[PoolState, Lease, Lease]:
    """One V100 held by ann (0.5, idle since 0) and bob (0.5, idle since 100); cyd waits
    for 0.5 since 900."""
    st = PoolState.build([V100])
    a = take(st, "ann", 500_000)
    b = take(st, "bob", 500_000)
    assert isinstance(a, Grant) and isinstance(b, Grant)
    idle(st, a.lease.id, 0.0)
    idle(st, b.lease.id, 100.0)
    assert isinstance(take(st, "cyd", 500_000, now=900.0), Queued)
    return st, st.leases[a.lease.id], st.leases[b.lease.id]


def parked(full, now: float = 1000.0) -> tuple[PoolState, Lease, Changes]:
    """ann's lease parked at 1000 (cyd granted in its place)."""
    st, a, _ = full
    reaped = scheduling.reap(st, now, POLICY, can_park=lambda lease: None)
    assert [x.id for x in reaped.parking] == [a.id]
    done = scheduling.park_done(st, a.id, now + 5, POLICY)
    ok(st)
    return st, st.parked[a.id], done


# -- the wire and the model ---------------------------------------------------------


def test_the_wire_knows_the_park_states_actions_and_outcomes():
    assert wire.PARK_STATES == ("parking", "parked", "resuming")
    assert set(wire.PARK_STATES) < set(wire.LEASE_STATES)
    assert {"active", "revoked", "released", "expired"} < set(wire.LEASE_STATES)
    assert wire.PARK_ACTIONS == ("park", "resume")
    assert wire.PARK_OUTCOMES == ("done", "failed", "waiting")
    assert not set(wire.PARK_STATES) & set(wire.ENDED_LEASE_STATES)


def test_a_lease_shows_its_park_state_on_the_wire_until_it_ends(full):
    _, a, _ = full
    assert a.wire_state == "active" and a.to_json(V100)["parked_at"] is None
    p = replace(a, park="parked", parked_at=1000.0)
    assert p.active and p.wire_state == "parked"
    assert p.to_json(V100)["state"] == "parked" and p.to_json(V100)["parked_at"] == 1000.0
    assert replace(p, state="released").wire_state == "released"


def test_a_parked_lease_holds_no_capacity_but_counts_for_its_kernel_and_user(full):
    st, _, done = parked(full)
    a = next(iter(st.parked.values()))
    assert a.id not in st.leases and st.find_lease(a.id) is a
    assert st.lease_for_kernel("ann", "k") is a
    assert st.held_by_user["ann"] == 500_000 and st.leases_by_user["ann"] == 1
    assert st.allocated[V100.uuid] == 1_000_000  # bob and cyd, granted in ann's place
    assert st.lease_count[V100.uuid] == 2
    copy = st.copy()
    assert copy.parked == st.parked and copy.parked[a.id] is not a
    rebuilt = PoolState.build([V100], [*st.leases.values(), a])
    assert rebuilt.parked == {a.id: a} and rebuilt.allocated == st.allocated
    ok(rebuilt)


def test_update_lease_renews_a_parked_lease_in_place(full):
    st, a, _ = parked(full)
    fresh = scheduling.renewed(a, 2000.0, POLICY, pid=7)
    st.update_lease(fresh)
    assert st.parked[a.id].expires_at == 2000.0 + POLICY.ttl and st.parked[a.id].pid == 7
    assert st.parked[a.id].park == "parked"
    ok(st)


# -- the reaper parks --------------------------------------------------------------


def test_the_reaper_parks_an_idle_victim_that_can_be_parked(full):
    st, a, b = full
    asked: list[str] = []

    def can_park(lease: Lease) -> str | None:
        asked.append(lease.id)
        return None

    reaped = scheduling.reap(st, 1000.0, POLICY, can_park=can_park)
    assert asked == [a.id]  # the most idle; one is enough for cyd
    assert reaped.revoked == [] and [x.id for x in reaped.parking] == [a.id]
    now = st.leases[a.id]
    assert (now.park, now.parked_at, now.active) == ("parking", 1000.0, True)
    assert reaped.changes.parks == [now] and not reaped.changes.ended
    assert st.allocated[V100.uuid] == 1_000_000  # it holds its share until parked
    assert ("cyd", "k") in st.queue
    ok(st)
    # its share counts as about to be freed: no more victims for the same waiter, and a
    # parking lease is never a victim again
    again = scheduling.reap(st, 2000.0, POLICY, can_park=can_park)
    assert again.parking == [] and again.revoked == [] and asked == [a.id]
    assert scheduling.idle_victims(st, 2000.0, POLICY) == []


def test_the_reaper_revokes_a_victim_it_cannot_park_and_says_why(full):
    st, a, _ = full
    reaped = scheduling.reap(
        st, 1000.0, POLICY, can_park=lambda lease: "the node cannot checkpoint"
    )
    assert [x.id for x in reaped.revoked] == [a.id] and reaped.parking == []
    ((gone, how, why),) = reaped.changes.ended
    assert gone.id == a.id and how == "revoked"
    assert why == f"{IDLE}; it could not be parked: the node cannot checkpoint"
    assert st.lease_for_kernel("cyd", "k") is not None  # granted in its place
    ok(st)


def test_without_can_park_the_reaper_revokes_as_before(full):
    st, a, _ = full
    reaped = scheduling.reap(st, 1000.0, POLICY)
    assert [x.id for x in reaped.revoked] == [a.id] and reaped.parking == []
    assert reaped.changes.ended[0][2] == IDLE and not reaped.changes.parks
    ok(st)


def test_parking_overdue_names_leases_parking_too_long(full):
    st, a, _ = full
    scheduling.reap(st, 1000.0, POLICY, can_park=lambda lease: None)
    assert scheduling.parking_overdue(st, 1100.0, 120.0) == []
    assert [x.id for x in scheduling.parking_overdue(st, 1121.0, 120.0)] == [a.id]


# -- the agent's reports ----------------------------------------------------------


def test_park_done_frees_the_share_and_grants_the_waiter(full):
    st, a, done = parked(full)
    assert [x.id for x in done.parks] == [a.id] and done.parks[0].park == "parked"
    assert done.parks[0].parked_at == 1000.0
    assert [g.lease.user_kernel for g in done.granted] == [("cyd", "k")]
    assert not st.queue
    # a late or repeated report changes nothing
    assert not scheduling.park_done(st, a.id, 1010.0, POLICY)
    assert not scheduling.park_done(st, "no-such-lease", 1010.0, POLICY)
    ok(st)


def test_park_failed_revokes_with_the_agents_reason_and_drains(full):
    st, a, _ = full
    scheduling.reap(st, 1000.0, POLICY, can_park=lambda lease: None)
    ch = scheduling.park_failed(st, a.id, "cuCheckpointProcessLock failed", 1005.0, POLICY)
    ((gone, how, why),) = ch.ended
    assert (gone.id, how) == (a.id, "revoked")
    assert why == f"{IDLE}; parking failed: cuCheckpointProcessLock failed"
    assert [g.lease.user_kernel for g in ch.granted] == [("cyd", "k")]
    assert not scheduling.park_failed(st, a.id, "again", 1006.0, POLICY)  # ended: ignored
    b = st.lease_for_kernel("bob", "k")
    assert b is not None and not scheduling.park_failed(st, b.id, "not parking", 1006.0, POLICY)
    ok(st)


# -- resume -------------------------------------------------------------------------


def test_resume_of_a_lease_not_parked_answers_its_state(full):
    st, a, b = full
    d, ch = scheduling.resume(st, a.id, 1000.0, POLICY, NEW)
    assert d == ResumeDecision(st.leases[a.id], "active", None) and not ch
    scheduling.reap(st, 1000.0, POLICY, can_park=lambda lease: None)
    d, ch = scheduling.resume(st, a.id, 1001.0, POLICY, NEW)
    assert (d.state, d.position, bool(ch)) == ("parking", None, False)
    with pytest.raises(KeyError):
        scheduling.resume(st, "no-such-lease", 1001.0, POLICY, NEW)


def test_resume_queues_a_request_that_keeps_the_place_of_the_moment_it_was_parked(full):
    st, a, done = parked(full)
    # dee arrives after ann was parked, and holds nothing (fair share would put her first)
    assert isinstance(take(st, "dee", 500_000, now=1500.0), Queued)
    d, ch = scheduling.resume(st, a.id, 2000.0, POLICY, NEW, priority=0)
    (req,) = ch.queued
    assert req.resume_of == a.id and req.key == ("ann", "k")
    assert (req.arrived_at, req.last_polled_at, req.gpu_uuids) == (1000.0, 2000.0, (V100.uuid,))
    assert req.fraction_ppm == a.fraction_ppm
    assert (d.state, d.position) == ("parked", 1) and d.lease is st.parked[a.id]
    assert not ch.granted and not ch.resumed
    ok(st)
    # idempotent: the same request, its poll noted
    d2, ch2 = scheduling.resume(st, a.id, 2100.0, POLICY, NEW)
    assert (d2.state, d2.position, bool(ch2)) == ("parked", 1, False)
    assert st.queue[("ann", "k")].id == req.id and st.queue[("ann", "k")].last_polled_at == 2100.0
    # cyd leaves: ann's resume is granted before dee, on its own GPU, as the same lease
    cyd = st.lease_for_kernel("cyd", "k")
    assert cyd is not None
    ch3 = scheduling.end(st, [(cyd, "released", None)], 2200.0, POLICY)
    assert ch3.granted == []
    ((r, back),) = ch3.resumed
    assert r.id == req.id and back.id == a.id and back.park == "resuming"
    assert ch3.parks == [back] and st.leases[a.id] is back and a.id not in st.parked
    assert back.parked_at == 1000.0 and st.allocated[V100.uuid] == 1_000_000
    assert ("dee", "k") in st.queue
    ok(st)
    d4, _ = scheduling.resume(st, a.id, 2201.0, POLICY, NEW)
    assert (d4.state, d4.position) == ("resuming", None)


def test_resume_that_fits_at_once_is_resuming(full):
    st, a, _ = parked(full)
    bob = st.lease_for_kernel("bob", "k")
    assert bob is not None
    scheduling.end(st, [(bob, "released", None)], 1100.0, POLICY)
    d, ch = scheduling.resume(st, a.id, 1200.0, POLICY, NEW)
    assert d.state == "resuming" and d.lease is st.leases[a.id] and d.position is None
    (req,) = ch.queued
    assert ch.resumed == [(req, st.leases[a.id])] and ch.granted == []
    assert not st.queue
    ok(st)


def test_a_resume_request_fits_only_on_its_own_gpu():
    st = PoolState.build([V100, T4])
    a = take(st, "ann", 1_000_000)
    assert isinstance(a, Grant)
    idle(st, a.lease.id)
    take(st, "bob", 1_000_000, now=900.0, gpu_uuids=(V100.uuid,))
    scheduling.reap(st, 1000.0, POLICY, can_park=lambda lease: None)
    scheduling.park_done(st, a.lease.id, 1001.0, POLICY)
    assert st.leases_by_user.get("bob") == 1  # bob took the V100
    d, _ = scheduling.resume(st, a.lease.id, 1002.0, POLICY, NEW)
    assert d.state == "parked" and d.position == 1  # the T4 is free, but not its GPU
    ok(st)


def test_resume_takes_the_priority_the_queue_gives_its_user(full):
    st, a, _ = parked(full)
    take(st, "ann", 500_000, now=1500.0, kernel="k2")  # ann's other kernel waits
    st.queue[("ann", "k2")].priority = 7
    scheduling.resume(st, a.id, 2000.0, POLICY, NEW)
    assert st.queue[("ann", "k")].priority == 7


def test_resume_done_and_resume_failed(full):
    st, a, _ = parked(full)
    cyd = st.lease_for_kernel("cyd", "k")
    assert cyd is not None
    scheduling.end(st, [(cyd, "released", None)], 1100.0, POLICY)
    scheduling.resume(st, a.id, 1200.0, POLICY, NEW)
    assert not scheduling.resume_failed(st, "nope", "x", 1201.0, POLICY)
    ch = scheduling.resume_done(st, a.id, 1300.0)
    (back,) = ch.parks
    assert (back.park, back.parked_at, st.leases[a.id].wire_state) == (None, None, "active")
    assert not scheduling.resume_done(st, a.id, 1301.0)  # repeated: ignored
    assert not scheduling.resume_failed(st, a.id, "late", 1301.0, POLICY)  # active: ignored
    ok(st)
    # once more, and this time the restore fails
    idle(st, a.id, 1300.0)
    bob = st.lease_for_kernel("bob", "k")
    assert bob is not None
    st.update_lease(replace(bob, execution_state="busy"))  # never idle: ann is the victim
    take(st, "dee", 500_000, now=1400.0)
    scheduling.reap(st, 3000.0, POLICY, can_park=lambda lease: None)
    scheduling.park_done(st, a.id, 3001.0, POLICY)
    dee = st.lease_for_kernel("dee", "k")
    assert dee is not None and dee.park is None
    scheduling.end(st, [(dee, "released", None)], 3002.0, POLICY)
    scheduling.resume(st, a.id, 3003.0, POLICY, NEW)
    ch = scheduling.resume_failed(st, a.id, "CUDA_ERROR_OUT_OF_MEMORY", 3004.0, POLICY)
    ((gone, how, why),) = ch.ended
    assert (gone.id, how) == (a.id, "revoked")
    assert why == "the GPU state could not be restored: CUDA_ERROR_OUT_OF_MEMORY"
    assert st.find_lease(a.id) is None
    ok(st)


# -- ends, expiry, a restarted kernel, quotas --------------------------------------


def test_a_parked_lease_expires_and_its_resume_request_leaves(full):
    st, a, _ = parked(full)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    req = st.queue[("ann", "k")]
    reaped = scheduling.reap(st, a.expires_at, POLICY)
    assert a.id in [x.id for x in reaped.expired]
    assert (req, "dropped") in reaped.changes.dropped
    assert st.find_lease(a.id) is None and ("ann", "k") not in st.queue
    assert "ann" not in st.held_by_user
    assert st.allocated[V100.uuid] <= 1_000_000
    ok(st)


def test_releasing_a_parked_lease_drops_its_resume_request(full):
    st, a, _ = parked(full)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    ch = scheduling.end(st, [(a, "released", None)], 1200.0, POLICY)
    assert [(x.id, how) for x, how, _ in ch.ended] == [(a.id, "released")]
    assert [r.resume_of for r, _ in ch.dropped] == [a.id]
    assert not scheduling.end(st, [(a, "released", None)], 1201.0, POLICY)  # idempotent
    ok(st)


def test_an_acquire_for_a_kernel_whose_lease_is_parked_releases_it_and_decides_anew(full):
    st, a, _ = parked(full)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    d, ch = scheduling.acquire(st, Ask("ann", "k", 200_000), Quota(), 1200.0, POLICY, NEW)
    assert isinstance(d.outcome, Queued) and d.outcome.new  # the V100 is full
    assert [(x.id, how, why) for x, how, why in ch.ended] == [
        (a.id, "released", "the kernel restarted while its GPU state was parked")
    ]
    assert [r.resume_of for r, _ in ch.dropped] == [a.id]
    assert ch.queued == [d.outcome.request] and d.outcome.request.resume_of is None
    assert a.id not in st.parked
    ok(st)


def test_a_refused_acquire_for_a_parked_kernel_changes_nothing(full):
    st, a, _ = parked(full)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    before = (dict(st.parked), dict(st.queue), dict(st.held_by_user), dict(st.by_kernel))
    with pytest.raises(QuotaExceeded):
        scheduling.acquire(st, Ask("ann", "k", 200_000), Quota(max_leases=0), 1200.0, POLICY, NEW)
    assert (dict(st.parked), dict(st.queue), dict(st.held_by_user), dict(st.by_kernel)) == before
    ok(st)


def test_a_parked_lease_still_counts_for_its_users_quota_but_its_resume_request_not_twice(full):
    st, a, _ = parked(full)
    quota = Quota(max_leases=1, max_fraction_ppm=500_000)
    with pytest.raises(QuotaExceeded):
        scheduling.acquire(st, Ask("ann", "k2", 100_000), quota, 1100.0, POLICY, NEW)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    roomy = Quota(max_leases=2, max_fraction_ppm=600_000)
    d, _ = scheduling.acquire(st, Ask("ann", "k2", 100_000), roomy, 1200.0, POLICY, NEW)
    assert isinstance(d.outcome, (Grant, Queued))
    ok(st)


def test_a_repeated_acquire_of_a_parking_kernel_is_a_repeat(full):
    st, a, _ = full
    scheduling.reap(st, 1000.0, POLICY, can_park=lambda lease: None)
    d, ch = scheduling.acquire(st, Ask("ann", "k", 500_000), Quota(), 1001.0, POLICY, NEW)
    assert isinstance(d.outcome, Existing) and d.outcome.lease.park == "parking" and not ch


def test_a_resume_requests_own_parked_lease_does_not_push_it_back():
    """ann (parked 0.5) and bob (holding nothing) arrive in that order: fair share alone
    would serve bob first if ann's parked lease counted against her resume."""
    st = PoolState.build([V100])
    policy = Policy(ttl=10_000, starvation_after=1e9)
    ann = Lease("L", "ann", "k", V100.uuid, 500_000, 100, "active", 0, 0, 10_000)
    st._add_parked(replace(ann, park="parked", parked_at=10.0))
    take(st, "cyd", 1_000_000, now=5.0)
    take(st, "bob", 500_000, now=20.0)
    scheduling.resume(st, "L", 30.0, policy, NEW)
    order = [r.user for r in scheduling.queue_order(st, 30.0, policy)]
    assert order == ["ann", "bob"]


# -- invariants and estimates ------------------------------------------------------


def test_check_invariants_catches_resume_requests_without_a_parked_lease(full):
    st, a, _ = parked(full)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    bad = st.copy()
    bad.queue[("ann", "k")] = replace(bad.queue[("ann", "k")], resume_of="other")
    with pytest.raises(AssertionError, match="waits anew"):
        scheduling.check_invariants(bad, POLICY)
    ghost = st.copy()
    ghost.queue[("zed", "k")] = replace(ghost.queue.pop(("ann", "k")), user="zed", resume_of="gone")
    with pytest.raises(AssertionError, match="not parked"):
        scheduling.check_invariants(ghost, POLICY)
    worse = st.copy()
    worse.leases[a.id] = worse.parked[a.id]  # in both
    with pytest.raises(AssertionError):
        scheduling.check_invariants(worse, POLICY)
    drift = st.copy()
    drift.held_by_user["ann"] = 0
    with pytest.raises(AssertionError, match="held_by_user"):
        scheduling.check_invariants(drift, POLICY)


def test_estimated_waits_count_a_resume_request(full):
    st, a, _ = parked(full)
    scheduling.resume(st, a.id, 1100.0, POLICY, NEW)
    holds = estimates.HoldTimes()
    for h in (100.0, 200.0, 300.0, 400.0, 500.0, 600.0):
        holds.add(h)
    etas = estimates.estimate_waits(st, 1100.0, POLICY, holds)
    assert ("ann", "k") in etas and etas[("ann", "k")] >= 0
    ok(st)  # the replay works on a copy
