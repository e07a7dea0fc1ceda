"""Property-based (hypothesis stateful) tests of the core's invariants.

Random interleavings of acquire (new and repeated), release, renew, clock advance,
expiry, stale-request drops, idle reclaim and queue drains, checking after every
step: capacity per GPU, bookkeeping, idempotency of acquire, quotas, and that the
drain leaves no waiting head that could have been placed; and, with MPS kernels
(``mps_uid``) and agents' reports of whom each GPU's MPS server serves, that no GPU
holds MPS leases of two uids (one would hang) and none is placed where another uid is
served.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from provisioner.broker import admission, node_rules
from provisioner.broker import scheduling as core
from provisioner.broker.policy import Ask, Policy
from provisioner.broker.scheduling import Existing, Grant, Queued
from provisioner.errors import GPULeaseError
from provisioner.model import GPU, Changes, PoolState, Quota, QuotaBook

GPUS = [
    GPU("g-v100", "a", "V100", 32768, 0),
    GPU("g-a100", "a", "A100", 81920, 1),
    GPU("g-t4", "b", "T4", 16384, 0),
]
USERS = ["ann", "bob", "cyd", "dee"]
KERNELS = ["k1", "k2", "k3"]
FRACTIONS = [20_000, 50_000, 100_000, 250_000, 300_000, 500_000, 1_000_000]
BOOK = QuotaBook(
    default=Quota(max_leases=3, max_fraction_ppm=1_500_000),
    groups={"ml101": Quota(max_lease_fraction_ppm=100_000, max_leases=2)},
    users={"dee": Quota(max_leases=5, max_fraction_ppm=3_000_000)},
)
GROUPS = {
    "ann": frozenset({"ml101"}),
    "bob": frozenset({"ml101"}),
    "cyd": frozenset(),
    "dee": frozenset(),
}
#: each user's Unix uid, which an MPS kernel's provisioner reports
UIDS = {user: 1000 + i for i, user in enumerate(USERS)}


class Broker(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = Policy(
            ttl=90, idle_reclaim_after=300, queue_poll_grace=30, starvation_after=600
        )
        self.state = PoolState.build(GPUS)
        self.now = 0.0
        counter = itertools.count()
        self.new_id = lambda: f"x{next(counter)}"

    @rule(
        user=st.sampled_from(USERS),
        kernel=st.sampled_from(KERNELS),
        ppm=st.sampled_from(FRACTIONS),
        node=st.sampled_from([None, None, "a", "b"]),
        mps=st.booleans(),
    )
    def acquire(self, user, kernel, ppm, node, mps=False):
        uid = UIDS[user] if mps else None
        ask = Ask(user, kernel, ppm, groups=GROUPS[user], node=node, mps_uid=uid)
        quota = admission.effective_quota(BOOK, user, GROUPS[user])
        before = (dict(self.state.allocated), set(self.state.leases), set(self.state.queue))
        try:
            d, _ = core.acquire(self.state, ask, quota, self.now, self.policy, self.new_id)
        except GPULeaseError:
            # a refusal changes nothing
            assert before == (
                dict(self.state.allocated),
                set(self.state.leases),
                set(self.state.queue),
            )
            return
        if isinstance(d.outcome, Grant) and uid is not None:  # never where another uid is served
            owners = node_rules.mps_owners(self.state)[d.outcome.lease.gpu_uuid]
            assert owners == {uid}, owners
        # idempotency: asking again at once yields the same lease or the same queue place
        again = core.decide_acquire(self.state, ask, quota, self.now, self.policy, self.new_id)
        assert again.grants == []
        if isinstance(d.outcome, (Grant, Existing)):
            assert (
                isinstance(again.outcome, Existing) and again.outcome.lease.id == d.outcome.lease.id
            )
        else:
            out = again.outcome
            if isinstance(out, Existing):  # granted by a drain in the same decision
                assert out.lease.user_kernel == (user, kernel)
            else:
                assert isinstance(out, Queued) and out.request.id == d.outcome.request.id

    @precondition(lambda self: self.state.leases)
    @rule(data=st.data())
    def release(self, data):
        lease_id = data.draw(st.sampled_from(sorted(self.state.leases)))
        lease = self.state.leases[lease_id]
        changes = core.end(self.state, [(lease, "released", None)], self.now, self.policy)
        assert [x.id for x, _, _ in changes.ended] == [lease_id]

    @precondition(lambda self: self.state.leases)
    @rule(data=st.data(), busy=st.booleans())
    def renew(self, data, busy):
        lease_id = data.draw(st.sampled_from(sorted(self.state.leases)))
        lease = self.state.leases[lease_id]
        state = "busy" if busy else "idle"
        self.state.update_lease(
            core.renewed(
                lease, self.now, self.policy, execution_state=state, last_activity=self.now
            )
        )

    @rule(gpu=st.sampled_from([g.uuid for g in GPUS]), user=st.sampled_from([None, *USERS]))
    def mps_report(self, gpu, user):
        """A node agent reports whom a GPU's MPS server serves (None: no one); a change
        drains the queue, as the service does."""
        before = dict(self.state.mps_uid)
        if user is None:
            self.state.mps_uid.pop(gpu, None)
        else:
            self.state.mps_uid[gpu] = UIDS[user]
        if self.state.mps_uid != before:
            core.grant_waiting(self.state, self.now, self.policy, Changes(self.now))

    @rule(dt=st.sampled_from([1.0, 10.0, 45.0, 100.0, 400.0]))
    def advance(self, dt):
        """The reaper's pass, as the service runs it."""
        self.now += dt
        reaped = core.reap(self.state, self.now, self.policy)
        if reaped.revoked:
            assert self.state.queue or reaped.changes.granted, (
                "idle leases revoked while nobody waited"
            )
        assert not core.expired(self.state, self.now)

    @invariant()
    def capacity_and_bookkeeping(self):
        core.check_invariants(self.state, self.policy)

    @invariant()
    def quotas_hold(self):
        for user in USERS:
            quota = admission.effective_quota(BOOK, user, GROUPS[user])
            mine = [x for x in self.state.leases.values() if x.user == user]
            waiting = [r for r in self.state.queue.values() if r.user == user]
            assert len(mine) + len(waiting) <= quota.max_leases
            held = sum(x.fraction_ppm for x in mine) + sum(r.fraction_ppm for r in waiting)
            assert held <= quota.max_fraction_ppm
            if quota.max_lease_fraction_ppm is not None:
                assert all(x.fraction_ppm <= quota.max_lease_fraction_ppm for x in mine)

    @invariant()
    def drain_is_complete(self):
        """After every step, the head of the queue cannot be placed (else it would have been)."""
        order = core.queue_order(self.state, self.now, self.policy)
        if order:
            head = order[0]
            ok = core.usable_gpus(
                self.state, head.fraction_ppm, self.policy, head.node, head.gpu_uuids
            )
            blocked = node_rules.mps_blocked(node_rules.mps_owners(self.state), head.mps_uid)
            placed = core.place(ok, self.state.allocated, head.fraction_ppm, self.policy, blocked)
            assert placed is None

    @invariant()
    def one_mps_uid_per_gpu(self):
        """No GPU holds MPS leases of two uids: a client of the second would hang."""
        uids: dict[str, set[int]] = {}
        for lease in self.state.leases.values():
            if lease.mps_uid is not None:
                uids.setdefault(lease.gpu_uuid, set()).add(lease.mps_uid)
        assert all(len(u) == 1 for u in uids.values()), uids

    @invariant()
    def leases_match_gpu_memory(self):
        for lease in self.state.leases.values():
            gpu = self.state.gpus[lease.gpu_uuid]
            assert 0 < lease.memory_limit_mb < gpu.memory_mb


Broker.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBrokerInvariants = Broker.TestCase


def test_no_starvation_every_waiting_request_is_served_as_leases_end():
    """Whole-GPU requests queue behind a pool full of small leases; as leases end, all are served."""
    m = Broker()
    for i in range(30):  # small leases from many kernels fill every GPU partly
        user = USERS[i % 2]  # ann, bob: ml101 members, up to 0.1 each
        m.acquire(user, f"k{i % 2}", 100_000, None)
    asks = [("cyd", f"k{i}") for i in range(1, 4)] + [("dee", f"k{i}") for i in range(1, 4)]
    for user, kernel in asks:
        m.acquire(user, kernel, 1_000_000, None)
    waiting = [key for key in asks if key in m.state.queue]
    assert waiting, "the scenario should have made someone wait"
    served: set[tuple[str, str]] = set()
    for _ in range(200):
        m.now += 1
        for r in m.state.queue.values():
            r.last_polled_at = m.now
        served |= {key for key in waiting if m.state.lease_for_kernel(*key)}
        if served == set(waiting):
            break
        oldest = min(m.state.leases.values(), key=lambda x: x.created_at)
        core.end(m.state, [(oldest, "released", None)], m.now, m.policy)
        core.check_invariants(m.state, m.policy)
    assert served == set(waiting)
