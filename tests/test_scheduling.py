"""Table tests of the pure allocation core (no I/O, ``now`` passed in)."""

from __future__ import annotations

import itertools

import pytest

from provisioner.broker.rules import admission, node_rules, scheduling
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.rules.scheduling import Existing, Grant, Queued
from provisioner.errors import CannotFit, Conflict, Forbidden, InvalidRequest, QuotaExceeded
from provisioner.model import (
    GPU,
    PPM,
    Changes,
    PoolState,
    Quota,
    QuotaBook,
    fraction_to_ppm,
    memory_cap_mb,
    min_ppm_for,
)

V100 = GPU("GPU-v100", "local", "V100", 32768, 0)
A100s = [GPU(f"GPU-a{i}", "local", "A100", 81920, i) for i in range(3)]


def ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


_IDS = ids()


def pool(*gpus: GPU) -> PoolState:
    return PoolState.build(list(gpus))


def acquire(state, ask, policy=Policy(), now=0.0, quota=Quota(), new_id=None, used=0.0):
    """Decide and apply, as the service does (without the store)."""
    d = scheduling.decide_acquire(state, ask, quota, now, policy, new_id or _IDS, used)
    scheduling.apply_grants(state, d.grants)
    if isinstance(d.outcome, Queued):
        state.queue[d.outcome.request.key] = d.outcome.request
    return d.outcome


@pytest.mark.parametrize(
    "fraction, ppm", [(0.02, 20_000), (1.0, PPM), (0.000001, 1), (0.1, 100_000), (1 / 3, 333_333)]
)
def test_fraction_to_ppm(fraction, ppm):
    assert fraction_to_ppm(fraction) == ppm


@pytest.mark.parametrize(
    "ppm, memory, overhead, cap",
    [
        (20_000, 32768, 512, 143),
        (20_000, 81920, 512, 1126),
        (PPM, 16384, 512, 15872),
        (15_000, 32768, 512, -21),
    ],
)
def test_memory_cap(ppm, memory, overhead, cap):
    assert memory_cap_mb(ppm, memory, overhead) == cap


def test_min_ppm_is_the_smallest_that_works():
    for memory in (16384, 32768, 81920, 143771):
        p = min_ppm_for(memory, 512)
        assert memory_cap_mb(p, memory, 512) >= 1
        assert memory_cap_mb(p - 1, memory, 512) <= 0


def test_fifty_students_fill_one_v100_exactly_and_the_51st_queues():
    st = pool(V100)
    for i in range(50):
        out = acquire(st, Ask(f"s{i}", "k", 20_000))
        assert isinstance(out, Grant)
    assert st.allocated[V100.uuid] == PPM
    out = acquire(st, Ask("s50", "k", 20_000))
    assert isinstance(out, Queued) and out.position == 1
    assert "100%" in out.reason
    scheduling.check_invariants(st, Policy())


@pytest.mark.parametrize(
    "placement, expect",
    [("best-fit", "GPU-a1"), ("spread", "GPU-a2"), ("first-fit", "GPU-a0")],
)
def test_placement(placement, expect):
    st = pool(*A100s)
    st.allocated.update({"GPU-a0": 100_000, "GPU-a1": 900_000, "GPU-a2": 0})
    gpu = scheduling.place(st.ordered_gpus(), st.allocated, 100_000, Policy(placement=placement))
    assert gpu is not None and gpu.uuid == expect


def test_placement_respects_reserve_and_exclusion():
    st = pool(V100)
    policy = Policy(reserve_ppm=100_000)
    st.allocated[V100.uuid] = 880_000
    assert scheduling.place([V100], st.allocated, 20_000, policy) is V100
    assert scheduling.place([V100], st.allocated, 30_000, policy) is None
    assert scheduling.place([V100], st.allocated, 20_000, policy, exclude={V100.uuid}) is None


def test_idempotent_acquire_and_conflict():
    st = pool(V100)
    first = acquire(st, Ask("alice", "k1", 20_000))
    again = acquire(st, Ask("alice", "k1", 20_000))
    assert isinstance(first, Grant) and isinstance(again, Existing)
    assert again.lease.id == first.lease.id
    assert len(st.leases) == 1
    with pytest.raises(Conflict, match="already holds"):
        acquire(st, Ask("alice", "k1", 50_000))
    # another user with the same kernel id is another request
    assert isinstance(acquire(st, Ask("bob", "k1", 20_000)), Grant)


def test_repeated_queued_acquire_keeps_its_place():
    st = pool(V100)
    acquire(st, Ask("big", "k", PPM))
    q1 = acquire(st, Ask("a", "k", 20_000), now=1)
    q2 = acquire(st, Ask("b", "k", 20_000), now=2)
    again = acquire(st, Ask("a", "k", 20_000), now=3)
    assert isinstance(again, Queued) and not again.new
    assert again.request.id == q1.request.id and again.position == 1
    assert q2.position == 2
    assert len(st.queue) == 2


@pytest.mark.parametrize(
    "ask, error, match",
    [
        (Ask("u", "k", 10_000), CannotFit, "smallest fraction that works is 0.015656"),
        (Ask("u", "k", PPM, gpu_uuids=("GPU-nope",)), InvalidRequest, "Unknown GPU UUID"),
        (Ask("u", "k", 20_000, node="elsewhere"), CannotFit, "node 'elsewhere'"),
        (Ask("u", "k", 20_000, group="ml101"), Forbidden, "course 'ml101'"),
    ],
)
def test_refusals_leave_state_unchanged(ask, error, match):
    st = pool(V100)
    acquire(st, Ask("x", "k0", 20_000))
    before = (dict(st.allocated), set(st.leases), dict(st.queue))
    with pytest.raises(error, match=match):
        acquire(st, ask)
    assert (dict(st.allocated), set(st.leases), dict(st.queue)) == before


def test_above_capacity_after_reserve_is_422():
    st = pool(V100)
    with pytest.raises(CannotFit, match="at most 0.9"):
        acquire(st, Ask("u", "k", PPM), policy=Policy(reserve_ppm=100_000))


def test_course_member_and_admin_may_use_course_kernel():
    st = pool(V100)
    assert isinstance(
        acquire(st, Ask("m", "k", 20_000, groups=frozenset({"ml101"}), group="ml101")), Grant
    )
    assert isinstance(acquire(st, Ask("root", "k", 20_000, admin=True, group="ml101")), Grant)


BOOK = QuotaBook(
    default=Quota(max_leases=1, max_fraction_ppm=100_000),
    groups={
        "ml101": Quota(max_leases=2, max_lease_fraction_ppm=50_000),
        "research": Quota(max_leases=4, max_fraction_ppm=PPM, priority=5),
    },
    users={"vip": Quota(max_leases=10), "capped": Quota(max_leases=0)},
)


@pytest.mark.parametrize(
    "user, groups, expect",
    [
        ("nobody", [], Quota(max_leases=1, max_fraction_ppm=100_000)),
        (
            "s",
            ["ml101"],
            Quota(max_leases=2, max_fraction_ppm=100_000, max_lease_fraction_ppm=50_000),
        ),
        (
            "s",
            ["ml101", "research"],
            Quota(max_leases=4, max_fraction_ppm=PPM, max_lease_fraction_ppm=50_000, priority=5),
        ),
        (
            "vip",
            ["ml101"],
            Quota(max_leases=10, max_fraction_ppm=100_000, max_lease_fraction_ppm=50_000),
        ),
        ("capped", ["research"], Quota(max_leases=0, max_fraction_ppm=PPM, priority=5)),
    ],
)
def test_effective_quota(user, groups, expect):
    assert admission.effective_quota(BOOK, user, groups) == expect


@pytest.mark.parametrize(
    "quota, held, ask_ppm, used, match",
    [
        (Quota(max_leases=1), 1, 20_000, 0, "most your quota allows"),
        (Quota(max_fraction_ppm=50_000), 2, 20_000, 0, "above your limit of 0.05"),
        (Quota(max_lease_fraction_ppm=50_000), 0, 100_000, 0, "per-kernel limit of 0.05"),
        (Quota(budget_fraction_hours=1.0, budget_window_s=86400), 0, 20_000, 1.0, "fraction-hours"),
    ],
)
def test_admission_refusals(quota, held, ask_ppm, used, match):
    st = pool(V100)
    for i in range(held):
        acquire(st, Ask("u", f"k{i}", 20_000))
    with pytest.raises(QuotaExceeded, match=match):
        acquire(st, Ask("u", "new", ask_ppm), quota=quota, used=used)
    assert len(st.leases) == held


def test_queued_requests_count_against_quota():
    st = pool(V100)
    acquire(st, Ask("hog", "k", PPM))
    acquire(st, Ask("u", "k1", 20_000), quota=Quota(max_leases=1))
    with pytest.raises(QuotaExceeded):
        acquire(st, Ask("u", "k2", 20_000), quota=Quota(max_leases=1))


def test_queue_order_priority_fair_share_arrival_and_aging():
    st = pool(V100)
    acquire(st, Ask("rich", "held", 500_000))
    acquire(st, Ask("filler", "f", 500_000))
    policy = Policy(starvation_after=100)
    acquire(st, Ask("rich", "r", 20_000), now=1, policy=policy)
    acquire(st, Ask("poor", "p", 20_000), now=2, policy=policy)
    acquire(st, Ask("poor2", "p", 20_000), now=3, policy=policy)
    st.queue[("vip", "v")] = st.queue[("poor2", "p")].__class__(
        id="v",
        user="vip",
        kernel_id="v",
        fraction_ppm=20_000,
        arrived_at=4,
        last_polled_at=4,
        priority=5,
    )
    order = [r.user for r in scheduling.queue_order(st, 10, policy)]
    assert order == ["vip", "poor", "poor2", "rich"]
    # after waiting past starvation_after, arrival order wins
    order = [r.user for r in scheduling.queue_order(st, 200, policy)]
    assert order == ["rich", "poor", "poor2", "vip"]


def test_head_reservation_prevents_starvation_of_a_large_request():
    gpus = [GPU("g0", "n", "A100", 81920, 0), GPU("g1", "n", "A100", 81920, 1)]
    st = pool(*gpus)
    new_id = ids()
    policy = Policy()
    for i in range(16):
        acquire(st, Ask(f"s{i}", "k", 100_000), new_id=new_id)  # best-fit: g0 full, g1 at 0.6
    assert st.allocated == {"g0": PPM, "g1": 600_000}
    big = acquire(st, Ask("researcher", "big", 800_000), now=1, new_id=new_id)
    assert isinstance(big, Queued)
    # a stream of small requests arrives while the oldest leases end one by one
    t = 2.0
    for i in range(30):
        victim = min(st.leases.values(), key=lambda x: x.created_at).id
        scheduling.apply_ends(st, [victim])
        scheduling.apply_grants(st, scheduling.drain(st, t, policy))
        acquire(st, Ask(f"late{i}", "k", 100_000), now=t, new_id=new_id)
        scheduling.check_invariants(st, policy)
        t += 1
        if st.lease_for_kernel("researcher", "big"):
            break
    assert st.lease_for_kernel("researcher", "big") is not None


def test_a_grant_that_reorders_the_queue_drains_it_again():
    """Found by the property test: a grant moves its user behind others (who hold less);
    the new head, which fits, is granted in the same drain instead of waiting for the
    next release (with the reaper's pass, up to ``reap_interval`` later)."""
    v100, t4 = GPU("g-v100", "a", "V100", 32768, 0), GPU("g-t4", "b", "T4", 16384, 0)
    st = pool(v100, t4)
    new_id = ids()
    policy = Policy()
    assert isinstance(acquire(st, Ask("bob", "k1", 50_000, node="b"), new_id=new_id), Grant)
    # cyd's whole T4 waits first (nobody it holds) and reserves the T4: ann waits behind it
    assert isinstance(acquire(st, Ask("cyd", "k2", PPM, node="b"), now=1, new_id=new_id), Queued)
    assert isinstance(acquire(st, Ask("ann", "k1", 50_000, node="b"), now=2, new_id=new_id), Queued)
    # cyd's small kernel goes to the V100: now cyd holds more than ann, ann is first, fits
    decision, changes = scheduling.acquire(st, Ask("cyd", "k1", 20_000), Quota(), 3, policy, new_id)
    assert isinstance(decision.outcome, Grant)
    assert st.lease_for_kernel("ann", "k1") is not None, "ann's request still waits"
    assert {g.lease.user for g in changes.granted} == {"cyd", "ann"}
    assert [r.user for r in st.queue.values()] == ["cyd"]
    order = scheduling.queue_order(st, 3, policy)
    ok = scheduling.usable_gpus(st, order[0].fraction_ppm, policy, order[0].node)
    assert scheduling.place(ok, st.allocated, order[0].fraction_ppm, policy) is None
    scheduling.check_invariants(st, policy)


def test_without_backfill_reservation_small_requests_overtake_forever():
    gpus = [GPU("g0", "n", "A100", 81920, 0)]
    st = pool(*gpus)
    new_id = ids()
    policy = Policy(backfill=False, starvation_after=1e9)
    for i in range(5):
        acquire(st, Ask(f"s{i}", "k", 200_000), new_id=new_id, policy=policy)
    acquire(st, Ask("researcher", "big", 800_000), now=1, new_id=new_id, policy=policy)
    for i in range(10):
        victim = min(st.leases.values(), key=lambda x: x.created_at).id
        scheduling.apply_ends(st, [victim])
        acquire(st, Ask(f"late{i}", "k", 200_000), now=2 + i, new_id=new_id, policy=policy)
    assert st.lease_for_kernel("researcher", "big") is None


def test_expiry_and_renewal():
    st = pool(V100)
    policy = Policy(ttl=90)
    lease = acquire(st, Ask("u", "k", 20_000), now=0, policy=policy).lease
    assert scheduling.expired(st, 89) == []
    fresh = scheduling.renewed(lease, 60, policy, pid=42, execution_state="idle", last_activity=55)
    st.update_lease(fresh)
    assert fresh.expires_at == 150 and fresh.pid == 42
    assert scheduling.expired(st, 149) == [] and [x.id for x in scheduling.expired(st, 150)] == [
        lease.id
    ]


def test_stale_requests_dropped_unless_polling():
    st = pool(V100)
    acquire(st, Ask("hog", "k", PPM))
    acquire(st, Ask("a", "k", 20_000), now=0)
    acquire(st, Ask("b", "k", 20_000), now=0)
    policy = Policy(queue_poll_grace=30)
    stale = scheduling.stale_requests(st, 31, policy, polling={("b", "k")})
    assert [r.user for r in stale] == ["a"]


def test_idle_reclaim_only_while_someone_waits():
    st = pool(V100)
    policy = Policy(idle_reclaim_after=600)
    for i in range(50):
        lease = acquire(st, Ask(f"s{i}", "k", 20_000), policy=policy).lease
        st.update_lease(
            scheduling.renewed(lease, 0, policy, execution_state="idle", last_activity=0)
        )
    assert scheduling.idle_victims(st, 10_000, policy) == []  # nobody waits: nothing revoked
    acquire(st, Ask("late", "k", 40_000), now=10_000, policy=policy)
    victims = scheduling.idle_victims(st, 10_000, policy)
    assert len(victims) == 2  # exactly enough for 0.04
    # busy kernels are never idle
    for lease in list(st.leases.values()):
        st.update_lease(scheduling.renewed(lease, 10_000, policy, execution_state="busy"))
    assert scheduling.idle_victims(st, 20_000, policy) == []


@pytest.mark.parametrize(
    "intervals, since, until, expect",
    [
        ([(PPM, 0, 3600)], 0, 7200, 1.0),
        ([(500_000, 0, None)], 0, 7200, 1.0),
        ([(20_000, 0, 3600), (20_000, 1800, 5400)], 3600, 7200, 0.01),
        ([(PPM, 0, 100)], 200, 300, 0.0),
    ],
)
def test_fraction_hours(intervals, since, until, expect):
    assert admission.fraction_hours(intervals, since, until) == pytest.approx(expect)


def test_check_invariants_catches_over_allocation():
    st = pool(V100)
    acquire(st, Ask("u", "k", PPM))
    st.allocated[V100.uuid] += 1
    with pytest.raises(AssertionError):
        scheduling.check_invariants(st, Policy())


@pytest.mark.parametrize(
    "sizes, allocated, ppm, expect",
    [
        ([], 0, PPM, 0),  # empty GPU: fits now
        ([750_000], 750_000, 250_000, 0),  # fits exactly
        ([750_000], 750_000, 500_000, 1),
        ([20_000] * 20, 400_000, PPM, 20),  # every small lease must end
        ([500_000, 100_000, 100_000], 700_000, 500_000, 1),  # the 0.5 is enough
        ([300_000, 300_000, 100_000], 700_000, 700_000, 2),
    ],
)
def test_leases_to_end(sizes, allocated, ppm, expect):
    assert scheduling.leases_to_end(sizes, allocated, ppm, PPM) == expect


def _reservation_pool():
    """g0: twenty 0.02 leases (0.4 allocated); g1: one 0.75 lease; g2: full of 0.25s."""
    gpus = [GPU(f"g{i}", "n", "A100", 81920, i) for i in range(3)]
    st = pool(*gpus)
    new_id = ids()
    one = Policy(placement="first-fit")
    for i in range(4):
        acquire(st, Ask(f"r{i}", "k", 250_000, gpu_uuids=("g2",)), policy=one, new_id=new_id)
    acquire(st, Ask("long", "k", 750_000, gpu_uuids=("g1",)), policy=one, new_id=new_id)
    for i in range(20):
        acquire(st, Ask(f"s{i}", "k", 20_000, gpu_uuids=("g0",)), policy=one, new_id=new_id)
    assert st.allocated == {"g0": 400_000, "g1": 750_000, "g2": PPM}
    return st, new_id


@pytest.mark.parametrize(
    "reservation, reserved, small_on",
    [
        ("fewest-leases", "g1", "g0"),  # one lease to end on g1, twenty on g0
        ("emptiest", "g0", "g1"),  # the rule before: the least allocated
    ],
)
def test_head_reserves_the_gpu_where_the_fewest_leases_must_end(reservation, reserved, small_on):
    st, new_id = _reservation_pool()
    policy = Policy(reservation=reservation)
    assert isinstance(
        acquire(st, Ask("big", "k", PPM), policy=policy, now=1, new_id=new_id), Queued
    )
    ok = scheduling.usable_gpus(st, PPM, policy)
    sizes = {}
    for lease in st.leases.values():
        sizes.setdefault(lease.gpu_uuid, []).append(lease.fraction_ppm)
    assert (
        scheduling.reservation_target(ok, dict(st.allocated), sizes, PPM, policy).uuid == reserved
    )
    # a 0.2 fits on g0 or g1; best-fit would pick g1 (fuller), but not if g1 is reserved
    out = acquire(st, Ask("small", "k", 200_000), policy=policy, now=2, new_id=new_id)
    assert isinstance(out, Grant) and out.lease.gpu_uuid == small_on


def test_fewest_leases_reservation_serves_the_head_despite_a_stream_of_small_requests():
    st, new_id = _reservation_pool()
    policy = Policy()  # fewest-leases
    acquire(st, Ask("big", "k", PPM), policy=policy, now=1, new_id=new_id)
    t = 2.0
    for i in range(40):  # small asks keep coming; the oldest lease ends each second
        acquire(st, Ask(f"late{i}", "k", 20_000), policy=policy, now=t, new_id=new_id)
        assert st.allocated["g1"] <= 750_000  # nothing new lands on the reserved GPU
        victim = min(st.leases.values(), key=lambda x: x.created_at).id
        scheduling.apply_ends(st, [victim])
        scheduling.apply_grants(st, scheduling.drain(st, t, policy))
        scheduling.check_invariants(st, policy)
        t += 1
        if st.lease_for_kernel("big", "k"):
            break
    lease = st.lease_for_kernel("big", "k")
    assert lease is not None and lease.gpu_uuid == "g1"


def test_a_repeated_poll_says_how_full_the_gpus_are():
    st = pool(V100)
    acquire(st, Ask("hog", "k", PPM))
    acquire(st, Ask("a", "k", 20_000), now=1)
    again = acquire(st, Ask("a", "k", 20_000), now=2)
    assert isinstance(again, Queued) and not again.new
    assert "V100" in again.reason and "100% allocated" in again.reason


# -- MPS serves one Unix user per GPU at a time ----------------------------------
ANN, BOB = 1000, 1001  # the uids their provisioners report


def mps_pool(reported: int | None, lease_uids: list[int | None]) -> PoolState:
    """One V100: its agent reports its MPS server serving ``reported`` (None: no one), and
    a lease of 0.1 is held for each of ``lease_uids`` (None: a cooperative kernel)."""
    st = pool(V100)
    if reported is not None:
        st.mps_uid[V100.uuid] = reported
    for i, uid in enumerate(lease_uids):
        assert isinstance(acquire(st, Ask(f"u{i}", "k", 100_000, mps_uid=uid)), Grant)
    return st


@pytest.mark.parametrize(
    "reported, lease_uids, uid, granted",
    [
        (None, [], BOB, True),  # no server: it starts for bob
        (BOB, [], BOB, True),  # it serves bob already
        (ANN, [], BOB, False),  # it serves ann's clients: bob's would hang
        (None, [ANN], BOB, False),  # ann's granted MPS kernel may connect any moment
        (None, [BOB, None], BOB, True),  # bob's own and a cooperative kernel
        (ANN, [ANN], None, True),  # a cooperative kernel does not use MPS
        (None, [None], BOB, True),  # cooperative kernels do not hold the server
    ],
)
def test_an_mps_kernel_is_placed_only_where_the_mps_server_serves_its_uid_or_none(
    reported, lease_uids, uid, granted
):
    st = mps_pool(reported, lease_uids)
    out = acquire(st, Ask("bob", "k", 100_000, mps_uid=uid), now=1)
    assert isinstance(out, Grant) is granted
    if not granted:
        assert isinstance(out, Queued)
        assert out.reason == (
            "The MPS server of GPU 0 (V100) is serving another user's kernels, and MPS serves one "
            "user per GPU at a time: your MPS kernel waits until those kernels end."
        )
        assert "ann" not in out.reason and str(ANN) not in out.reason  # never who
    else:
        assert out.lease.mps_uid == uid
    scheduling.check_invariants(st, Policy())


def test_an_mps_kernel_goes_to_another_gpu_rather_than_wait():
    st = pool(*A100s)
    acquire(st, Ask("ann", "k", 500_000, mps_uid=ANN))  # best-fit would put bob beside it
    out = acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=1)
    assert isinstance(out, Grant) and out.lease.gpu_uuid != st.lease_for_kernel("ann", "k").gpu_uuid
    again = acquire(st, Ask("ann", "k2", 100_000, mps_uid=ANN), now=2)  # ann's own GPU, best-fit
    assert isinstance(again, Grant) and again.lease.gpu_uuid == "GPU-a0"


def test_the_waiting_mps_kernel_is_granted_when_the_other_users_kernels_end():
    st = mps_pool(ANN, [ANN])
    policy = Policy()
    assert isinstance(acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=1), Queued)
    # ann's lease ends, but her kernel's client is still reported: bob still waits
    (ann,) = st.leases.values()
    changes = scheduling.end(st, [(ann, "released", None)], 2, policy)
    assert changes.granted == [] and ("bob", "k") in st.queue
    # the agent's next report: the server has no clients (None); the service drains
    st.mps_uid.clear()
    changes = Changes(3)
    assert scheduling.grant_waiting(st, 3, policy, changes) == 1
    assert st.lease_for_kernel("bob", "k").mps_uid == BOB


def test_one_drain_does_not_place_two_users_mps_kernels_on_one_gpu():
    st = pool(V100)
    policy = Policy()
    hog = acquire(st, Ask("hog", "k", PPM))
    assert isinstance(acquire(st, Ask("ann", "k", 100_000, mps_uid=ANN), now=1), Queued)
    assert isinstance(acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=2), Queued)
    changes = scheduling.end(st, [(hog.lease, "released", None)], 3, policy)
    assert [g.lease.user for g in changes.granted] == ["ann"]
    reason = scheduling.decide_acquire(
        st, Ask("bob", "k", 100_000, mps_uid=BOB), Quota(), 4, policy, _IDS
    ).outcome.reason
    assert reason.startswith("The MPS server of GPU 0 (V100) is serving another user's kernels")


def test_the_first_users_stream_of_mps_kernels_does_not_starve_the_second():
    """Bob waits first in the queue and reserves the GPU: ann's new MPS kernels wait behind
    him, so when her kernels end he is served, not overtaken forever."""
    st = mps_pool(None, [])
    policy = Policy()
    new_id = ids()
    acquire(st, Ask("ann", "k0", 100_000, mps_uid=ANN), new_id=new_id)
    assert isinstance(
        acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=1, new_id=new_id), Queued
    )
    for t in range(2, 6):
        acquire(st, Ask("ann", f"k{t}", 100_000, mps_uid=ANN), now=t, new_id=new_id)
    assert [x.kernel_id for x in st.leases.values()] == ["k0"]  # ann's new ones wait too
    scheduling.end(st, [(st.lease_for_kernel("ann", "k0"), "released", None)], 6, policy)
    assert st.lease_for_kernel("bob", "k") is not None


def test_the_reason_names_each_gpu_whose_server_serves_another_user_and_how_full_the_rest_are():
    st = pool(*A100s)
    st.mps_uid.update({"GPU-a0": ANN, "GPU-a1": ANN})
    acquire(st, Ask("hog", "k", PPM, gpu_uuids=("GPU-a2",)))
    out = acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=1)
    assert isinstance(out, Queued)
    assert out.reason.startswith(
        "The MPS servers of GPU 0 (A100) and GPU 1 (A100) are serving another user's kernels"
    ), out.reason
    assert "GPU 2 (A100) is 100% allocated" in out.reason, out.reason


# -- MPS owners from trusted sources only ------------------------------
MADE_UP = 4242  # a uid a student claims; no account runs anything as it
WINDOW = node_rules.mps_claim_window(Policy())  # 90/3 + 30 = 60 s


@pytest.mark.parametrize(
    "reported, claimed, proven, age, owners",
    [
        (None, ANN, None, 0.0, {ANN}),  # just granted: the claim holds (it may start any moment)
        (None, ANN, None, WINDOW, {ANN}),  # the window's last instant
        (None, MADE_UP, None, WINDOW + 1, set()),  # past the window a claim alone holds nothing
        (None, MADE_UP, ANN, 0.0, {ANN}),  # a proof replaces the claim, even within the window
        (None, ANN, ANN, 3600.0, {ANN}),  # a proven kernel holds its GPU as long as it lives
        (BOB, MADE_UP, None, 3600.0, {BOB}),  # the agent's report always counts
        (BOB, MADE_UP, None, 0.0, {BOB, MADE_UP}),
        (None, None, ANN, 0.0, set()),  # a cooperative kernel does not use MPS
    ],
)
def test_a_gpus_mps_owners_come_from_the_agent_and_proofs_and_a_claim_only_briefly(
    reported, claimed, proven, age, owners
):
    st = pool(V100)
    lease = acquire(st, Ask("ann", "k", 100_000, mps_uid=claimed)).lease
    if reported is not None:
        st.mps_uid[V100.uuid] = reported
    if proven is not None:
        st.mps_proven[lease.id] = proven
    assert node_rules.mps_owners(st, age, Policy()).get(V100.uuid, set()) == owners


def test_a_made_up_mps_uid_keeps_another_users_mps_kernel_waiting_only_for_the_window():
    """The MPS placement squat: a 0.02 lease claiming a made-up uid on the only GPU. The
    victim waits within the window, and the reaper's drain grants it after."""
    st = pool(V100)
    policy = Policy()
    squat = acquire(st, Ask("mallory", "k", 20_000, mps_uid=MADE_UP))
    assert isinstance(squat, Grant)
    out = acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=WINDOW / 2)
    assert isinstance(out, Queued) and "serving another user's kernels" in out.reason
    assert scheduling.reap(st, WINDOW, policy).changes.granted == []
    st.queue[("bob", "k")].last_polled_at = WINDOW  # bob's client long-polls meanwhile
    reaped = scheduling.reap(st, WINDOW + 1, policy)
    assert [g.lease.user for g in reaped.changes.granted] == ["bob"]
    assert st.find_lease(squat.lease.id) is not None  # the squatter is not punished


def test_two_requests_granted_in_one_pass_still_see_each_others_claims():
    """Within one grant pass a request's own uid steers the owners (nobody has started yet):
    two users' MPS kernels are never placed together, whatever the window."""
    st = pool(V100)
    policy = Policy()
    hog = acquire(st, Ask("hog", "k", PPM))
    for t, (who, uid) in enumerate([("ann", ANN), ("bob", BOB)], 1):
        assert isinstance(acquire(st, Ask(who, "k", 100_000, mps_uid=uid), now=t), Queued)
    later = 10 * WINDOW
    changes = scheduling.end(st, [(hog.lease, "released", None)], later, policy)
    assert [g.lease.user for g in changes.granted] == ["ann"]


def test_a_repeated_acquire_brings_back_the_uid_a_restarted_broker_forgot():
    st = pool(V100)
    st.mps_uid[V100.uuid] = ANN
    acquire(st, Ask("hog", "k", PPM))
    first = acquire(st, Ask("bob", "k", 100_000), now=1)  # as reloaded: no uid in memory
    assert isinstance(first, Queued) and first.request.mps_uid is None
    again = acquire(st, Ask("bob", "k", 100_000, mps_uid=BOB), now=2)
    assert isinstance(again, Queued) and st.queue[("bob", "k")].mps_uid == BOB
    assert "MPS server of GPU 0 (V100) is serving another user's kernels" in again.reason
