"""Property-based (hypothesis stateful) tests of the core's invariants.

Random interleavings of acquire (new and repeated), release, renew, clock advance,
expiry, stale-request drops, idle reclaim and queue drains, checking after every
step: capacity per GPU, bookkeeping, idempotency of acquire, quotas, and that the
drain leaves no waiting head that could have been placed; and, with MPS kernels
(``mps_uid``, honest or made up), agents' reports of whom each GPU's MPS server serves and
their proofs of kernels' uids, that no GPU holds MPS leases of two uids that count (proven,
or claimed within the claim window: one would hang) and none is placed where another uid
is served; a made-up claim stops counting after the window (the reaper's drain
then places the head it kept out, ``drain_is_complete``).

Parking: the reaper parks idle victims where a random ``can_park`` allows,
the agent's reports (park done/failed, resume done/failed), the parking timeout, the
owners' resumes, releases, renewals and expiry of parked leases, and acquires of
kernels whose lease is parked are interleaved too; parked leases never hold capacity,
and a kernel's place in the queue is kept only by its resume request.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from provisioner.broker.rules import admission, node_rules, scheduling, sessions
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.rules.scheduling import Existing, Grant, Queued
from provisioner.errors import GPULeaseError
from provisioner.model import GPU, Changes, ClassSession, PoolState, Quota, QuotaBook

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
#: a uid a student makes up: no account, nothing ever runs as it
MADE_UP_UID = 4242
#: every user's MPS kernel of this name claims :data:`MADE_UP_UID` (each repeat alike)
LYING_KERNEL = "k3"


class Broker(RuleBasedStateMachine):
    #: the pool and the quotas (:class:`CrowdedBroker` changes them)
    gpus = GPUS
    book = BOOK

    def __init__(self) -> None:
        super().__init__()
        self.policy = Policy(
            ttl=90, idle_reclaim_after=300, queue_poll_grace=30, starvation_after=600
        )
        self.state = PoolState.build(self.gpus)
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
        uid = (MADE_UP_UID if kernel == LYING_KERNEL else UIDS[user]) if mps else None
        ask = Ask(user, kernel, ppm, groups=GROUPS[user], node=node, mps_uid=uid)
        quota = admission.effective_quota(self.book, user, GROUPS[user])
        before = self._snapshot()
        was = self.state.lease_for_kernel(user, kernel)
        try:
            d, changes = scheduling.acquire(
                self.state, ask, quota, self.now, self.policy, self.new_id
            )
        except GPULeaseError:
            # a refusal changes nothing
            assert before == self._snapshot()
            return
        if was is not None and was.park == "parked":  # the kernel restarted: released
            assert (was.id, "released") in [(x.id, how) for x, how, _ in changes.ended]
            assert self.state.find_lease(was.id) is None
        if isinstance(d.outcome, Grant) and uid is not None:  # never where another uid is served
            owners = node_rules.mps_owners(self.state, self.now, self.policy)
            owners = owners[d.outcome.lease.gpu_uuid]
            assert owners == {uid}, owners
        # idempotency: asking again at once yields the same lease or the same queue place
        again = scheduling.decide_acquire(
            self.state, ask, quota, self.now, self.policy, self.new_id
        )
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

    def _snapshot(self):
        return (
            dict(self.state.allocated),
            set(self.state.leases),
            set(self.state.parked),
            dict(self.state.queue),
            dict(self.state.held_by_user),
        )

    def _live(self) -> list[str]:
        return sorted([*self.state.leases, *self.state.parked])

    def _in(self, park: str) -> list[str]:
        home = self.state.parked if park == "parked" else self.state.leases
        return sorted(i for i, x in home.items() if x.park == park)

    @precondition(lambda self: self.state.leases or self.state.parked)
    @rule(data=st.data())
    def release(self, data):
        lease_id = data.draw(st.sampled_from(self._live()))
        lease = self.state.find_lease(lease_id)
        changes = scheduling.end(self.state, [(lease, "released", None)], self.now, self.policy)
        assert [x.id for x, _, _ in changes.ended] == [lease_id]
        assert self.state.find_lease(lease_id) is None
        assert not [r for r in self.state.queue.values() if r.resume_of == lease_id]

    @precondition(lambda self: self.state.leases or self.state.parked)
    @rule(data=st.data(), busy=st.booleans())
    def renew(self, data, busy):
        lease_id = data.draw(st.sampled_from(self._live()))
        lease = self.state.find_lease(lease_id)
        state = "busy" if busy else "idle"
        self.state.update_lease(
            scheduling.renewed(
                lease, self.now, self.policy, execution_state=state, last_activity=self.now
            )
        )

    @precondition(lambda self: any(x.park == "parking" for x in self.state.leases.values()))
    @rule(data=st.data(), done=st.booleans())
    def park_report(self, data, done):
        """The node agent reports a checkpoint done (the share is freed) or failed."""
        lease_id = data.draw(st.sampled_from(self._in("parking")))
        lease = self.state.leases[lease_id]
        held = self.state.allocated[lease.gpu_uuid]
        if done:
            changes = scheduling.park_done(self.state, lease_id, self.now, self.policy)
            assert self.state.parked[lease_id].park == "parked"
            assert changes.parks[0].id == lease_id
        else:
            changes = scheduling.park_failed(self.state, lease_id, "no", self.now, self.policy)
            assert [(x.id, how) for x, how, _ in changes.ended] == [(lease_id, "revoked")]
        # its share is freed, and the queue may have taken it at once
        regranted = [g.lease for g in changes.granted] + [x for _, x in changes.resumed]
        taken = sum(x.fraction_ppm for x in regranted if x.gpu_uuid == lease.gpu_uuid)
        assert self.state.allocated[lease.gpu_uuid] == held - lease.fraction_ppm + taken
        # a repeated report changes nothing
        assert not scheduling.park_done(self.state, lease_id, self.now, self.policy)
        assert not scheduling.park_failed(self.state, lease_id, "again", self.now, self.policy)

    @precondition(lambda self: any(x.park == "parking" for x in self.state.leases.values()))
    @rule(timeout=st.sampled_from([0.0, 50.0, 500.0]))
    def parking_timeout(self, timeout):
        """The service gives up on leases parking longer than its ``park_timeout``."""
        for lease in scheduling.parking_overdue(self.state, self.now, timeout):
            assert self.now - lease.parked_at > timeout
            scheduling.park_failed(self.state, lease.id, "it did not finish", self.now, self.policy)

    @precondition(lambda self: self.state.leases or self.state.parked)
    @rule(data=st.data())
    def resume(self, data):
        """An owner asks for their lease back (any live lease: not parked is answered as is)."""
        parked = self._in("parked")
        pick = parked if parked and data.draw(st.booleans()) else self._live()
        lease_id = data.draw(st.sampled_from(pick))
        was = self.state.find_lease(lease_id)
        d, changes = scheduling.resume(self.state, lease_id, self.now, self.policy, self.new_id)
        assert d.lease is self.state.find_lease(lease_id)
        if was.park != "parked":
            assert d.state == (was.park or "active") and not changes
            return
        assert d.state in ("parked", "resuming")
        if d.state == "parked":
            req = self.state.queue[was.user_kernel]
            assert req.resume_of == lease_id and d.position >= 1
            assert req.arrived_at == was.parked_at
        else:
            assert lease_id in self.state.leases and d.position is None
            assert any(x.id == lease_id for _, x in changes.resumed)
        assert not changes.granted or all(g.request is not None for g in changes.granted)
        again, more = scheduling.resume(self.state, lease_id, self.now, self.policy, self.new_id)
        assert again.state == d.state and not more.queued  # idempotent

    @precondition(lambda self: any(x.park == "resuming" for x in self.state.leases.values()))
    @rule(data=st.data(), done=st.booleans())
    def resume_report(self, data, done):
        """The node agent reports a restore done (active again) or failed (revoked)."""
        lease_id = data.draw(st.sampled_from(self._in("resuming")))
        if done:
            scheduling.resume_done(self.state, lease_id, self.now)
            assert self.state.leases[lease_id].park is None
        else:
            changes = scheduling.resume_failed(self.state, lease_id, "no", self.now, self.policy)
            assert changes.ended[0][0].id == lease_id
        assert not scheduling.resume_done(self.state, lease_id, self.now)
        assert not scheduling.resume_failed(self.state, lease_id, "again", self.now, self.policy)

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
            scheduling.grant_waiting(self.state, self.now, self.policy, Changes(self.now))

    @rule(
        dt=st.sampled_from([1.0, 10.0, 45.0, 100.0, 400.0]),
        parking=st.sampled_from(["off", "yes", "yes", "no", "some"]),
        kept=st.sampled_from([True, True, False]),
    )
    def advance(self, dt, parking, kept=False):
        """The reaper's pass, as the service runs it, with parking off (no ``can_park``),
        always possible, never possible, or possible for some leases only. ``kept``: the
        kernels' keepers renewed every live lease meanwhile (parked ones too), reporting
        no activity (idle kernels stay idle, and may be reclaimed), and every waiting
        request's client polled."""
        self.now += dt
        if kept:
            for lease in [*self.state.leases.values(), *self.state.parked.values()]:
                self.state.update_lease(scheduling.renewed(lease, self.now, self.policy))
            for req in self.state.queue.values():
                req.last_polled_at = self.now
        can_park = {
            "off": None,
            "yes": lambda lease: None,
            "no": lambda lease: "the node cannot checkpoint",
            "some": lambda lease: None if lease.fraction_ppm <= 250_000 else "too big",
        }[parking]
        before = {i for i, x in self.state.leases.items() if x.park is not None}
        reaped = scheduling.reap(self.state, self.now, self.policy, can_park=can_park)
        freed = {x.id for x, _ in reaped.freed}  # a class session's share, freed at its start
        if [x for x in [*reaped.revoked, *reaped.parking] if x.id not in freed]:
            assert self.state.queue or reaped.changes.granted or reaped.changes.resumed, (
                "idle leases reclaimed while nobody waited"
            )
        for lease in reaped.parking:
            assert lease.id not in before and can_park is not None and can_park(lease) is None
            assert self.state.leases[lease.id].park == "parking"
            assert self.state.leases[lease.id].parked_at == self.now
        for lease in reaped.revoked:
            assert lease.id not in before, "a lease being parked or resumed was revoked as idle"
        assert not scheduling.expired(self.state, self.now)

    @invariant()
    def capacity_and_bookkeeping(self):
        scheduling.check_invariants(self.state, self.policy)

    @invariant()
    def quotas_hold(self):
        for user in USERS:
            quota = admission.effective_quota(self.book, user, GROUPS[user])
            live = [*self.state.leases.values(), *self.state.parked.values()]
            mine = [x for x in live if x.user == user]  # parked leases count for quotas
            waiting = [  # a resume request's lease counts already
                r for r in self.state.queue.values() if r.user == user and r.resume_of is None
            ]
            assert len(mine) + len(waiting) <= quota.max_leases
            held = sum(x.fraction_ppm for x in mine) + sum(r.fraction_ppm for r in waiting)
            assert quota.max_fraction_ppm is None or held <= quota.max_fraction_ppm
            if quota.max_lease_fraction_ppm is not None:
                assert all(x.fraction_ppm <= quota.max_lease_fraction_ppm for x in mine)

    @invariant()
    def drain_is_complete(self):
        """After every step, the head of the queue cannot be placed (else it would have been)."""
        order = scheduling.queue_order(self.state, self.now, self.policy)
        if order:
            head = order[0]
            ok = scheduling.usable_gpus(
                self.state, head.fraction_ppm, self.policy, head.node, head.gpu_uuids
            )
            owners = node_rules.mps_owners(self.state, self.now, self.policy)
            blocked = node_rules.mps_blocked(owners, head.mps_uid)
            placed = scheduling.place(
                ok, self.state.allocated, head.fraction_ppm, self.policy, blocked
            )
            assert placed is None

    @invariant()
    def parked_leases_hold_nothing(self):
        held: dict[str, int] = {}
        for lease in self.state.leases.values():
            held[lease.gpu_uuid] = held.get(lease.gpu_uuid, 0) + lease.fraction_ppm
        for uuid in self.state.gpus:
            assert self.state.allocated[uuid] == held.get(uuid, 0) <= self.policy.capacity_ppm
        for lease in self.state.parked.values():
            assert lease.park == "parked" and lease.parked_at is not None
            assert lease.expires_at > self.now  # expired ones are reaped

    @rule(data=st.data())
    def mps_proof(self, data):
        """A node agent proves an MPS lease's kernel within its claim window (as an honest
        kernel's is: it renews at once after launch), as the uid its user really runs as
        (a made-up claim is replaced by the truth); the service drains the queue."""
        window = node_rules.mps_claim_window(self.policy)
        fresh = sorted(
            x.id
            for x in self.state.leases.values()
            if x.mps_uid is not None
            and x.id not in self.state.mps_proven
            and self.now - x.created_at <= window
        )
        if not fresh:
            return
        lease = self.state.leases[data.draw(st.sampled_from(fresh))]
        self.state.mps_proven[lease.id] = UIDS[lease.user]
        scheduling.grant_waiting(self.state, self.now, self.policy, Changes(self.now))

    @invariant()
    def one_mps_uid_per_gpu(self):
        """No GPU holds MPS leases of two uids that count (proven, or claimed within the
        claim window): a client of the second would hang. A claim past its window counts
        for nobody."""
        window = node_rules.mps_claim_window(self.policy)
        uids: dict[str, set[int]] = {}
        for lease in self.state.leases.values():
            if lease.mps_uid != UIDS[lease.user]:
                continue  # not MPS, or made up: two liars of one made-up uid meet each other
            uid = self.state.mps_proven.get(lease.id)
            if uid is None and self.now - lease.created_at <= window:
                uid = lease.mps_uid
            if uid is not None:
                uids.setdefault(lease.gpu_uuid, set()).add(uid)
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


class CrowdedBroker(Broker):
    """The same machine on one GPU with loose quotas: the queue forms often, so idle
    reclaim, parking and resumes happen in most runs (the wide pool rarely fills)."""

    gpus = [GPUS[0]]
    book = QuotaBook(default=Quota(max_leases=3))

    @precondition(lambda self: self.state.leases)
    @rule()
    def everyone_idle(self):
        """Every kernel reports that it has been idle for long (its last activity well
        before the reclaim limit): the next reaper pass reclaims for whoever waits."""
        for lease in list(self.state.leases.values()):
            since = self.now - 2 * (self.policy.idle_reclaim_after or 0)
            self.state.update_lease(
                scheduling.renewed(
                    lease, self.now, self.policy, execution_state="idle", last_activity=since
                )
            )

    @precondition(lambda self: self.state.leases)
    @rule(
        user=st.sampled_from(USERS), kernel=st.sampled_from(KERNELS), ppm=st.sampled_from(FRACTIONS)
    )
    def park_for(self, user, kernel, ppm):
        """Someone asks while every kernel is idle: the reaper parks what makes room and
        the agents report the checkpoints done (a path to parked leases in few steps)."""
        self.everyone_idle()
        self.acquire(user, kernel, ppm, None)
        reaped = scheduling.reap(self.state, self.now, self.policy, can_park=lambda lease: None)
        assert not reaped.revoked
        for lease in reaped.parking:
            scheduling.park_done(self.state, lease.id, self.now, self.policy)
            assert lease.id in self.state.parked


CrowdedBroker.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestParkingInvariants = CrowdedBroker.TestCase


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
        scheduling.end(m.state, [(oldest, "released", None)], m.now, m.policy)
        scheduling.check_invariants(m.state, m.policy)
    assert served == set(waiting)


# -- class sessions ------------------------------------------------------------------

#: ml101 (ann, bob) reserves 0.3 GPU (fifteen seats of 0.02) from t=600 to t=2400; a
#: research course (dee) half of node b from t=1200 to t=3000; cyd belongs to neither
SESSIONS = (
    ClassSession("ml101", 600.0, 2400.0, share_ppm=300_000),
    ClassSession("lab", 1200.0, 3000.0, pool_fraction=0.5, nodes=("b",)),
)
SESSION_GROUPS = {**GROUPS, "dee": frozenset({"lab"})}


class SessionBroker(Broker):
    """The machine with class sessions on the timetable (lead time, hours, lending back,
    their end), and instructors starting and ending sessions by hand. After every step:
    nothing is reserved beyond the pool (``check_invariants``), a member of a course in
    session never waits while the share has room for the kernel, and the queue's head
    (members first in their share, others beside the held shares) cannot be placed."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = Policy(
            ttl=90,
            idle_reclaim_after=300,
            queue_poll_grace=30,
            starvation_after=600,
            session_lead=300,
            session_lend_after=900,
            session_busy_grace=600,
        )
        self.state.sessions = SESSIONS

    @rule(
        user=st.sampled_from(USERS),
        kernel=st.sampled_from(KERNELS),
        ppm=st.sampled_from(FRACTIONS),
        node=st.sampled_from([None, None, "a", "b"]),
    )
    def acquire(self, user, kernel, ppm, node, mps=False):
        ask = Ask(user, kernel, ppm, groups=SESSION_GROUPS[user], node=node)
        quota = admission.effective_quota(self.book, user, SESSION_GROUPS[user])
        try:
            d, changes = scheduling.acquire(
                self.state, ask, quota, self.now, self.policy, self.new_id
            )
        except GPULeaseError:
            return
        if isinstance(d.outcome, Queued) and node is None:
            assert not self._room_for(d.outcome.request), "a member waits beside free share"
        # nobody is granted into another course's unused share held now
        sh = sessions.shares(self.state, self.now, self.policy)
        for grant in changes.granted:
            uuid = grant.lease.gpu_uuid
            held_back = sh.extra(grant.lease.groups).get(uuid, 0)
            if held_back:
                assert self.state.allocated[uuid] + held_back <= self.policy.capacity_ppm, grant

    @rule(
        course=st.sampled_from(["ml101", "lab"]),
        length=st.sampled_from([60.0, 600.0, 3600.0]),
        share=st.sampled_from([100_000, 1_000_000, 5_000_000]),
    )
    def start_by_hand(self, course, length, share):
        """An instructor starts a session now (a share beyond the pool is cut), or ends
        every session of the course (a zero-length one); the service drains."""
        kept = tuple(s for s in self.state.sessions if s.course != course or s.source != "hand")
        if length == 60.0:
            self.state.sessions = kept
        else:
            fresh = ClassSession(
                course, self.now, self.now + length, share_ppm=share, source="hand"
            )
            self.state.sessions = (*kept, fresh)
        scheduling.grant_waiting(self.state, self.now, self.policy, Changes(self.now))

    def _room_for(self, req) -> bool:
        """Whether the share of a course of ``req``'s user held now has room for it."""
        if req.node is not None or req.gpu_uuids is not None or req.mps_uid is not None:
            return False
        sh = sessions.shares(self.state, self.now, self.policy)
        extra = sh.extra(req.groups)
        ok = scheduling.usable_gpus(self.state, req.fraction_ppm, self.policy)
        for h in sh.mine(req.groups):
            for g in ok:
                fits = (
                    self.state.allocated[g.uuid] + extra.get(g.uuid, 0) + req.fraction_ppm
                    <= self.policy.capacity_ppm
                )
                if h.unused(g.uuid) >= req.fraction_ppm and fits:
                    return True
        return False

    @invariant()
    def members_never_wait_beside_free_share(self):
        for req in self.state.queue.values():
            assert not self._room_for(req), f"{req.user} waits while its share has room"

    @invariant()
    def drain_is_complete(self):
        order = scheduling.queue_order(self.state, self.now, self.policy)
        if order:
            head = order[0]
            ok = scheduling.usable_gpus(
                self.state, head.fraction_ppm, self.policy, head.node, head.gpu_uuids
            )
            sh = sessions.shares(self.state, self.now, self.policy)
            placed = scheduling.place_for(
                sh, head.groups, ok, self.state.allocated, head.fraction_ppm, self.policy
            )
            assert placed is None

    @invariant()
    def reserves_within_the_pool(self):
        sh = sessions.shares(self.state, self.now, self.policy)
        per_gpu: dict[str, int] = {}
        for h in sh.held:
            for uuid, n in h.reserved.items():
                per_gpu[uuid] = per_gpu.get(uuid, 0) + n
        assert all(n <= self.policy.capacity_ppm for n in per_gpu.values())
        assert set(per_gpu) <= set(self.state.gpus)


SessionBroker.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSessionInvariants = SessionBroker.TestCase
