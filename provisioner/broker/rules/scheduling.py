"""The pure allocation core: placement, queue order, expiry, idle reclaim.

Everything here is a plain function over plain data (``model.PoolState``, ``Quota``,
``Request``, ...) with ``now`` passed in: no ``await``, no SQL, no HTTP, no
traitlets. Its neighbours, as pure and on the same terms: ``policy`` (the knobs,
:class:`Policy`, and an acquire, :class:`Ask`), ``admission`` (quota precedence, the
course check and the quota checks :func:`decide_acquire` runs), ``node_rules`` (a node's
state, over-use, MPS's one user per GPU) below it, and ``estimates`` (estimated waits,
which replay :func:`drain`) above it.

Two layers. *Decisions* (``decide_acquire``, ``drain``, ``expired``, ``idle_victims``
...) never mutate the state they are given. *Mutations* (``acquire``, ``end``,
``cancel``, ``reap``, ``grant_waiting``) decide AND apply, and return the
:class:`Changes` they made, which is what a store persists. The broker's service, the
trace simulator and the property tests all mutate the state through these, so decide
→ apply is written once, here.

Key rules (docs/developers.md, "The core's rules", sums them up for readers):

* Capacity: on each GPU, the sum of active lease fractions (ppm) is at most
  ``Policy.capacity_ppm`` (1,000,000 minus the admin's reserve).
* Memory: a lease of ``f`` on a GPU of ``M`` MiB reserves ``floor(f·M)``; the
  framework cap is that minus ``context_overhead_mb``; a cap <= 0 can never work.
* Placement: best-fit (the fullest GPU that fits) by default; ``spread`` picks the
  emptiest; ``first-fit`` is kept as a baseline for the simulator.
* Queue order: requests waiting longer than ``starvation_after`` first (by arrival),
  then group priority, then fair share (users holding less first), then arrival.
* Backfill with a reservation: the first request in queue order that does not fit
  reserves one GPU; later requests may not be placed on it, so it drains and the large
  request cannot be overtaken forever. The reserved GPU is the one it could use where
  the fewest leases must end before it fits (counting the largest leases first; ties:
  the least allocated), not merely the emptiest: twenty small leases take longer to
  all end than one (``Policy.reservation``; "emptiest" is kept for the simulator).
* MPS serves one Unix user per GPU at a time (a second user's client hangs until the
  first user's clients are gone): an ``enforcement=mps`` request (``mps_uid`` set) is
  placed only on a GPU whose MPS server serves its uid or none
  (``node_rules.mps_blocked``), else it waits, and the student reads why
  (:func:`why_waiting`). A GPU's owners come from its agent's report and proven kernels;
  a lease's claimed uid counts for others only within ``node_rules.mps_claim_window`` of
  its grant, and a request's within the grant pass that places it.
* Idle reclaim (optional): only while some request waits and does not fit, leases of
  kernels idle longer than ``idle_reclaim_after`` on the GPU where the fewest such
  revocations make room are revoked -- or parked, where the service's ``can_park``
  says the node can take the kernel's GPU memory into host RAM.
* Class sessions (``sessions``): a course's reserved share is left free for its members
  from ``session_lead`` before the start (non-members are placed only in the rest),
  members are placed in it first (:func:`place_for`), and from the start the reaper frees
  it from non-members' kernels as it frees idle ones (:func:`reap`).
* Parking (``model.Lease.park``): a victim goes ``parking`` (it still holds its
  share), then ``parked`` when its node agent reports the checkpoint done
  (:func:`park_done`: its share is freed, ``PoolState.parked``); its owner's
  :func:`resume` queues a resume request (``Request.resume_of``) that keeps the place of
  the moment it was parked (``arrived_at = parked_at``), fits only on the lease's own GPU,
  and when granted re-reserves the share (``resuming``: no new lease) before the restore
  is ordered; :func:`resume_done` makes it ``active`` again. A parked lease still counts
  for its user's quotas, but not against its own resume request's fair share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from ...errors import CannotFit, Conflict, UnknownGPU
from ...model import (
    GPU,
    Changes,
    Grant,
    Lease,
    PoolState,
    Quota,
    Request,
    memory_cap_mb,
    min_ppm_for,
    reserved_mb,
)
from ...wire import ppm_to_fraction
from .admission import admit, check_course
from .node_rules import mps_blocked, mps_claim_window, mps_owners, mps_owners_of
from .policy import Ask, Policy
from .sessions import Shares, effective, freed_reason, reserve, shares, victims, waiting_reason

# -- decisions -----------------------------------------------------------------


@dataclass
class Existing:
    """The kernel already holds this lease: an idempotent repeat."""

    lease: Lease


@dataclass
class Queued:
    """The ask waits in the queue at ``position`` (1 = next). ``new`` if just enqueued."""

    request: Request
    position: int
    new: bool
    reason: str = ""


@dataclass
class AcquireDecision:
    """What ``decide_acquire`` concluded: the caller's own outcome plus every grant to persist."""

    outcome: Grant | Existing | Queued
    grants: list[Grant] = field(default_factory=list)


# -- memory and eligibility ------------------------------------------------------


def usable_gpus(
    state: PoolState,
    ppm: int,
    policy: Policy,
    node: str | None = None,
    gpu_uuids: Iterable[str] | None = None,
) -> list[GPU]:
    """GPUs that could host ``ppm``: on the node / in the uuid list, cap > 0, within capacity,
    and open (not on a lost or drained node: ``state.closed``)."""
    gpus = candidate_gpus(state, node, gpu_uuids)
    if state.closed:
        gpus = [g for g in gpus if g.uuid not in state.closed]
    if ppm > policy.capacity_ppm:
        return []
    return [g for g in gpus if memory_cap_mb(ppm, g.memory_mb, policy.context_overhead_mb) > 0]


def candidate_gpus(
    state: PoolState, node: str | None = None, gpu_uuids: Iterable[str] | None = None
) -> list[GPU]:
    """The GPUs a requester may use, before any size check, in a stable order."""
    if node is None and gpu_uuids is None:
        return state.ordered_gpus()
    gpus: Iterable[GPU] = state.gpus.values()
    if gpu_uuids is not None:
        wanted = set(gpu_uuids)
        gpus = [g for g in gpus if g.uuid in wanted]
    if node is not None:
        gpus = [g for g in gpus if g.node == node]
    return sorted(gpus, key=lambda g: (g.node, g.index, g.uuid))


def check_can_ever_fit(state: PoolState, ask: Ask, policy: Policy) -> list[GPU]:
    """Raise a clear 400/422 if ``ask`` can never be placed; return the GPUs it may use."""
    if ask.gpu_uuids is not None:
        unknown = sorted(set(ask.gpu_uuids) - set(state.gpus))
        if unknown:
            raise UnknownGPU(
                f"Unknown GPU UUID(s): {', '.join(unknown)}; they are not in the broker's pool."
            )
    if ask.node is not None and not any(g.node == ask.node for g in state.gpus.values()):
        raise CannotFit(
            f"No GPU of the pool is on node {ask.node!r}; "
            "ask your administrator to declare that node's GPUs to the broker.",
            node=ask.node,
        )
    cands = candidate_gpus(state, ask.node, ask.gpu_uuids)
    if not cands:
        raise CannotFit("None of the GPUs this server may use belongs to the broker's pool.")
    fraction = ppm_to_fraction(ask.fraction_ppm)
    if ask.fraction_ppm > policy.capacity_ppm:
        most = ppm_to_fraction(policy.capacity_ppm)
        raise CannotFit(
            f"A GPU fraction of {fraction:g} can never be granted: at most {most:g} of one GPU "
            "is available to leases. Pick a kernel with a smaller GPU fraction.",
            max_fraction=most,
        )
    # the cap depends on a GPU's memory only: decided once per memory size, not per GPU
    too_small = {
        m
        for m in {g.memory_mb for g in cands}
        if memory_cap_mb(ask.fraction_ppm, m, policy.context_overhead_mb) <= 0
    }
    ok = [g for g in cands if g.memory_mb not in too_small] if too_small else cands
    if not ok:
        overhead = policy.context_overhead_mb
        biggest = max(cands, key=lambda g: g.memory_mb)
        smallest = min_ppm_for(biggest.memory_mb, overhead)
        raise CannotFit(
            f"A GPU fraction of {fraction:g} gives at most "
            f"{reserved_mb(ask.fraction_ppm, biggest.memory_mb)} MiB on a {biggest.name} "
            f"({biggest.memory_mb} MiB), not more than the {overhead} MiB every CUDA process "
            f"needs for its context. The smallest fraction that works is "
            f"{ppm_to_fraction(smallest):g}.",
            min_fraction=ppm_to_fraction(smallest),
        )
    # a lost or drained node's GPUs could take it later: wait for them, never place there now
    return [g for g in ok if g.uuid not in state.closed] if state.closed else list(ok)


# -- placement ----------------------------------------------------------------


def place(
    gpus: Iterable[GPU],
    allocated: dict[str, int],
    ppm: int,
    policy: Policy,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> GPU | None:
    """Choose a GPU for ``ppm`` among ``gpus`` by the policy's placement, or None."""
    cap = policy.capacity_ppm
    best: GPU | None = None
    best_alloc = -1
    mode = policy.placement
    fullest = cap - ppm  # best-fit can do no better than a GPU this full
    get = allocated.get
    for g in gpus:
        if exclude and g.uuid in exclude:
            continue
        a = get(g.uuid, 0)
        if a > fullest:
            continue
        if mode == "first-fit":
            return g
        if best is None or (a > best_alloc if mode == "best-fit" else a < best_alloc):
            best, best_alloc = g, a
            if mode == "best-fit" and a == fullest:
                return g
    return best


def place_for(
    sh: Shares | None,
    groups: Iterable[str],
    ok: list[GPU],
    alloc: dict[str, int],
    ppm: int,
    policy: Policy,
    exclude: frozenset[str] | set[str] = frozenset(),
    blocked: frozenset[str] | set[str] = frozenset(),
) -> GPU | None:
    """:func:`place` with the class sessions held now (``sh``): a member of a course whose
    share has room for ``ppm`` on a GPU is placed there first (past ``exclude``, the queue
    head's reservation; never on a ``blocked`` one); anyone else is placed as if the other
    courses' unused shares were allocated."""
    if not sh:
        return place(ok, alloc, ppm, policy, exclude=exclude | blocked if blocked else exclude)
    extra = sh.extra(groups)
    eff = effective(alloc, extra)
    for h in sh.mine(groups):
        room = [g for g in ok if h.unused(g.uuid) >= ppm and g.uuid not in blocked]
        gpu = place(room, eff, ppm, policy) if room else None
        if gpu is not None:
            return gpu
    return place(ok, eff, ppm, policy, exclude=exclude | blocked if blocked else exclude)


# -- queue ------------------------------------------------------------------


def queue_order(
    state: PoolState,
    now: float,
    policy: Policy,
    extra: Request | None = None,
    held: dict[str, int] | None = None,
) -> list[Request]:
    """Waiting requests (plus ``extra``, a not yet enqueued one) in service order.

    ``held`` (user -> ppm) replaces what each user holds now (a drain's grants count).
    A resume request's user counts without the parked lease it brings back."""
    held = state.held_by_user if held is None else held

    def key(r: Request) -> tuple:
        if now - r.arrived_at >= policy.starvation_after:
            return (0, 0, 0, r.arrived_at, r.id)
        mine = held.get(r.user, 0)
        if r.resume_of is not None:  # its own parked lease does not push it back
            mine = max(0, mine - r.fraction_ppm)
        return (1, -r.priority, mine, r.arrived_at, r.id)

    waiting = list(state.queue.values())
    if extra is not None:
        waiting.append(extra)
    return sorted(waiting, key=key)


def position_of(
    state: PoolState,
    key: tuple[str, str],
    now: float,
    policy: Policy,
    extra: Request | None = None,
) -> int:
    """1-based place of ``key`` in the queue order (0 if it is not waiting)."""
    for i, r in enumerate(queue_order(state, now, policy, extra), start=1):
        if r.key == key:
            return i
    return 0


def drain(
    state: PoolState,
    now: float,
    policy: Policy,
    extra: Request | None = None,
) -> list[Grant]:
    """Grants for waiting requests that fit now, in queue order, with a reservation for the head.

    ``extra`` is a new request considered as if it were waiting. A granted request's
    lease takes the request's id. Does not mutate ``state``; apply the result with
    ``apply_grants``. A resume request (``resume_of``) is granted its parked lease as
    it will be (``park="resuming"``, its own id): no new lease, its user holds no more.

    A grant changes what its user holds, and so the order (fewer held goes first): a pass
    that granted anything is followed by another over what still waits, in the order
    those grants make, until one grants nothing. Its head then fits nowhere: the queue
    is drained as far as it goes (``tests/test_scheduling_properties.py``).
    """
    if not state.queue and extra is None:
        return []
    alloc = dict(state.allocated)
    sizes: dict[str, list[int]] = {}  # lease sizes per GPU, this drain's grants included
    for lease in state.leases.values():
        sizes.setdefault(lease.gpu_uuid, []).append(lease.fraction_ppm)
    held = dict(state.held_by_user)
    grants: list[Grant] = []
    done: set[str] = set()
    # MPS owners only when an MPS request waits: this drain's grants join them
    mps = any(r.mps_uid is not None for r in state.queue.values()) or (
        extra is not None and extra.mps_uid is not None
    )
    owners = mps_owners(state, now, policy) if mps else {}
    sh = (
        shares(state, now, policy, asking=extra.groups if extra else ()) if state.sessions else None
    )
    while True:
        reserved: set[str] = set()
        granted = len(grants)
        for req in queue_order(state, now, policy, extra, held):
            if req.id in done:
                continue
            parked = state.parked.get(req.resume_of) if req.resume_of is not None else None
            if req.resume_of is not None and parked is None:
                continue  # its lease ended: grant_waiting drops it
            ok = usable_gpus(state, req.fraction_ppm, policy, req.node, req.gpu_uuids)
            blocked = mps_blocked(owners, req.mps_uid) if mps else None
            gpu = place_for(
                sh, req.groups, ok, alloc, req.fraction_ppm, policy, reserved, blocked or set()
            )
            if gpu is not None:
                alloc[gpu.uuid] = alloc.get(gpu.uuid, 0) + req.fraction_ppm
                sizes.setdefault(gpu.uuid, []).append(req.fraction_ppm)
                # the lease keeps the request's id: a client that gave up waiting and
                # withdraws its request by that id (DELETE) releases the lease if it was
                # granted meanwhile; a resume grants the parked lease back on its own GPU
                lease = (
                    new_lease(req, gpu, now, policy, req.id)
                    if parked is None
                    else replace(parked, park="resuming")
                )
                if req.mps_uid is not None:  # as mps_owners will count it after the grant
                    claim = mps_owners_of(
                        {},
                        [replace(lease, mps_uid=req.mps_uid)],
                        state.mps_proven,
                        now,
                        mps_claim_window(policy),
                    )
                    owners.setdefault(gpu.uuid, set()).update(claim.get(gpu.uuid, set()))
                done.add(req.id)
                grants.append(Grant(lease, req))
                if sh:
                    sh.note(lease)
                if parked is None:
                    held[req.user] = held.get(req.user, 0) + req.fraction_ppm
            elif policy.backfill and not reserved and ok:
                # the head reserves one GPU it could use; nothing else lands there until it fits
                reserved.add(reservation_target(ok, alloc, sizes, req.fraction_ppm, policy).uuid)
        if len(grants) == granted:
            return grants


def leases_to_end(sizes: Iterable[int], allocated: int, ppm: int, capacity: int) -> int:
    """The fewest of a GPU's leases (of ``sizes``) that must end before ``ppm`` fits on it.

    Largest first: the least number of ends after which ``allocated + ppm <= capacity``
    can hold. When one of them ends, this count does not grow (and the allocation falls).
    """
    need = allocated + ppm - capacity
    ended = 0
    for size in sorted(sizes, reverse=True):
        if need <= 0:
            break
        need -= size
        ended += 1
    return ended


def reservation_target(
    ok: list[GPU], alloc: dict[str, int], sizes: dict[str, list[int]], ppm: int, policy: Policy
) -> GPU:
    """The GPU a head that does not fit reserves, among the non-empty ``ok``.

    ``fewest-leases`` (default): the fewest leases must end before it fits, then the
    least allocated. Once the head is first in queue order (aging puts it there after
    ``starvation_after``), nothing new lands on the reserved GPU: its key never grows
    and falls with every lease that ends there, so the minimum over GPUs only falls and
    the head is placed after finitely many lease ends (no starvation), as with
    ``emptiest`` (the least allocated; the rule before).
    """
    if policy.reservation == "emptiest":
        return min(ok, key=lambda g: (alloc.get(g.uuid, 0), g.node, g.index, g.uuid))
    cap = policy.capacity_ppm
    return min(
        ok,
        key=lambda g: (
            leases_to_end(sizes.get(g.uuid, ()), alloc.get(g.uuid, 0), ppm, cap),
            alloc.get(g.uuid, 0),
            g.node,
            g.index,
            g.uuid,
        ),
    )


def new_lease(req: Request | Ask, gpu: GPU, now: float, policy: Policy, lease_id: str) -> Lease:
    return Lease(
        id=lease_id,
        user=req.user,
        kernel_id=req.kernel_id,
        gpu_uuid=gpu.uuid,
        fraction_ppm=req.fraction_ppm,
        memory_limit_mb=memory_cap_mb(req.fraction_ppm, gpu.memory_mb, policy.context_overhead_mb),
        state="active",
        created_at=now,
        renewed_at=now,
        expires_at=now + policy.ttl,
        group=req.group,
        last_activity=now,
        groups=tuple(sorted(req.groups)),
        mps_uid=req.mps_uid,
    )


def decide_acquire(
    state: PoolState,
    ask: Ask,
    quota: Quota,
    now: float,
    policy: Policy,
    new_id: Callable[[], str],
    used_fraction_hours: float = 0.0,
) -> AcquireDecision:
    """Decide one acquire: repeat -> same lease or queue place; else check, admit, place or enqueue.

    Raises ``UnknownGPU`` (an ``InvalidRequest``), ``CannotFit``, ``Forbidden``,
    ``QuotaExceeded`` or ``Conflict`` with nothing decided. A new ask joins the queue's order; if anything is waiting,
    a new ask is granted at once only if the drain (with its head reservation) grants it.
    A kernel whose lease is parked repeats as :class:`Existing` here; :func:`acquire`
    ends such a lease first (the kernel restarted: its checkpoint is gone).
    """
    existing = state.lease_for_kernel(ask.user, ask.kernel_id)
    if existing is not None:
        if existing.fraction_ppm != ask.fraction_ppm:
            raise Conflict(
                f"Kernel {ask.kernel_id} already holds a GPU lease of "
                f"{ppm_to_fraction(existing.fraction_ppm):g}; release it before asking for "
                f"{ppm_to_fraction(ask.fraction_ppm):g}.",
                lease_id=existing.id,
            )
        return AcquireDecision(Existing(existing))
    waiting = state.queue.get((ask.user, ask.kernel_id))
    if waiting is not None:
        # a restarted broker forgot the uid (memory only): each repeat brings it again
        uid = waiting.mps_uid if ask.mps_uid is None else ask.mps_uid
        touched = replace(waiting, last_polled_at=now, mps_uid=uid)
        ok = usable_gpus(state, waiting.fraction_ppm, policy, waiting.node, waiting.gpu_uuids)
        blocked = mps_blocked(mps_owners(state, now, policy), uid) if uid is not None else set()
        held = shares(state, now, policy) if state.sessions else None
        return AcquireDecision(
            Queued(
                touched,
                position_of(state, waiting.key, now, policy),
                new=False,
                reason=why_waiting(
                    state,
                    ok,
                    waiting.fraction_ppm,
                    policy,
                    waiting.node,
                    blocked,
                    held,
                    waiting.groups,
                ),
            )
        )

    check_course(ask)
    ok = check_can_ever_fit(state, ask, policy)
    admit(state, ask, quota, used_fraction_hours, policy)
    blocked = (
        mps_blocked(mps_owners(state, now, policy), ask.mps_uid)
        if ask.mps_uid is not None
        else set()
    )

    sh = shares(state, now, policy, asking=ask.groups) if state.sessions else None
    if not state.queue:
        gpu = place_for(
            sh, ask.groups, ok, state.allocated, ask.fraction_ppm, policy, set(), blocked
        )
        if gpu is not None:
            grant = Grant(new_lease(ask, gpu, now, policy, new_id()))
            return AcquireDecision(grant, [grant])
    req = Request(
        id=new_id(),
        user=ask.user,
        kernel_id=ask.kernel_id,
        fraction_ppm=ask.fraction_ppm,
        arrived_at=now,
        last_polled_at=now,
        groups=ask.groups,
        group=ask.group,
        node=ask.node,
        gpu_uuids=ask.gpu_uuids,
        priority=quota.priority or 0,
        mps_uid=ask.mps_uid,
    )
    grants = drain(state, now, policy, extra=req)
    mine = next((g for g in grants if g.request is req), None)
    if mine is not None:
        mine.request = None  # it never waited: nothing to take out of the queue
        return AcquireDecision(mine, grants)
    position = position_of(state, req.key, now, policy, extra=req)
    return AcquireDecision(
        Queued(
            req,
            position,
            new=True,
            reason=why_waiting(
                state, ok, req.fraction_ppm, policy, req.node, blocked, sh, req.groups
            ),
        ),
        grants,
    )


def why_waiting(
    state: PoolState,
    ok: list[GPU],
    ppm: int = 0,
    policy: Policy | None = None,
    node: str | None = None,
    mps_serving: set[str] | frozenset[str] = frozenset(),
    sh: Shares | None = None,
    groups: Iterable[str] = (),
) -> str:
    """Sentences for a student whose request (of ``ppm``) waits: how full its GPUs are.

    With class sessions held now (``sh``) that keep part of its GPUs from this asker (of
    ``groups``), the first sentence names each course and the end of its session.

    GPUs are named as ``gpu-lease top`` names them (``GPU 0 (V100)``, with the node when
    the pool has several), never by UUID. When a smaller kernel could be placed right
    now (some usable GPU has room for at least the smallest fraction that works there,
    but less than ``ppm``), it says how much is free; otherwise it gives no such advice
    (a student on the smallest kernel that works has nothing smaller to pick). A request
    bound to ``node`` (its server's node) that another node has room for says so. The
    GPUs in ``mps_serving`` (an MPS kernel's, :func:`mps_blocked`) are named first: their
    MPS server serves another user (never named) until that user's kernels end.
    """
    if not ok:
        return "No GPU can take this request right now."
    if sh:
        blocking = sh.blocking(groups, [g.uuid for g in ok])
        if blocking:
            then = why_waiting(state, ok, ppm, policy, node, mps_serving)
            return f"{waiting_reason(blocking)} {then}"
    policy = policy or Policy()
    nodes = {g.node for g in state.gpus.values()}

    def title(g: GPU) -> str:
        where = f" on node {g.node}" if len(nodes) > 1 else ""
        return f"GPU {g.index} ({g.name}){where}"

    if mps_serving:
        serving = [g for g in ok if g.uuid in mps_serving]
        rest = [g for g in ok if g.uuid not in mps_serving]
        if serving:
            names = [title(g) for g in serving[:3]] + (["others"] if len(serving) > 3 else [])
            owner = (
                f"The MPS server of {names[0]} is"
                if len(names) == 1
                else f"The MPS servers of {', '.join(names[:-1])} and {names[-1]} are"
            )
            text = (
                f"{owner} serving another user's kernels, and MPS serves one user per GPU at "
                "a time: your MPS kernel waits until those kernels end."
            )
            return text if not rest else f"{text} {why_waiting(state, rest, ppm, policy, node)}"

    parts = []
    for g in ok[:4]:
        used = ppm_to_fraction(state.allocated.get(g.uuid, 0))
        parts.append(f"{title(g)} is {used:.0%} allocated")
    more = f" (and {len(ok) - 4} more)" if len(ok) > 4 else ""
    roomiest = max(ok, key=lambda g: policy.capacity_ppm - state.allocated.get(g.uuid, 0))
    free = policy.capacity_ppm - state.allocated.get(roomiest.uuid, 0)
    if ppm and free >= ppm:  # it fits, but waits behind the queue's head (its reservation)
        return f"Requests ahead of yours in the queue are served first ({'; '.join(parts)}{more})."
    subject = "The GPU you may use is full" if len(ok) == 1 else "The GPUs you may use are full"
    text = f"{subject}: {'; '.join(parts)}{more}."
    smallest = min_ppm_for(roomiest.memory_mb, policy.context_overhead_mb)
    if ppm and smallest <= free < ppm:
        text += (
            f" {title(roomiest)} has {ppm_to_fraction(free):g} of a GPU free: a kernel with "
            "a smaller GPU fraction may start sooner."
        )
    elsewhere = sorted(
        {
            g.node
            for g in state.gpus.values()
            if node is not None
            and g.node != node
            and g.uuid not in state.closed
            and policy.capacity_ppm - state.allocated.get(g.uuid, 0) >= ppm
            and memory_cap_mb(ppm, g.memory_mb, policy.context_overhead_mb) > 0
        }
    )
    if elsewhere:
        text += (
            f" Node {', '.join(elsewhere[:3])}{' and others' if len(elsewhere) > 3 else ''} "
            f"{'has' if len(elsewhere) == 1 else 'have'} room, but your server runs on node "
            f"{node} and its kernels can use only that node's GPUs: a server started on "
            "another node could start this kernel now."
        )
    return text


# -- applying decisions -------------------------------------------------------------


def apply_grants(state: PoolState, grants: Iterable[Grant]) -> None:
    """Apply a drain's grants: each request leaves the queue and its lease is added; a
    resume request's parked lease moves back into ``state.leases`` as ``resuming``
    (``g.lease`` becomes that record)."""
    for g in grants:
        if g.request is not None:
            state.queue.pop(g.request.key, None)
            if g.request.resume_of is not None:
                if g.request.resume_of in state.parked:
                    g.lease = state.unpark(g.request.resume_of, "resuming")
                continue
        state.add_lease(g.lease)


def record_grants(changes: Changes, grants: Iterable[Grant]) -> None:
    """Record applied grants in ``changes``: new leases in ``granted``; granted resume
    requests in ``resumed`` and their leases in ``parks`` (no lease to create)."""
    for g in grants:
        if g.request is not None and g.request.resume_of is not None:
            changes.parks.append(g.lease)
            changes.resumed.append((g.request, g.lease))
        else:
            changes.granted.append(g)


def apply_ends(state: PoolState, lease_ids: Iterable[str]) -> list[Lease]:
    return [state.remove_lease(i) for i in lease_ids if i in state.leases]


# -- liveness -----------------------------------------------------------------------


def renewed(
    lease: Lease,
    now: float,
    policy: Policy,
    pid: int | None = None,
    execution_state: str | None = None,
    last_activity: float | None = None,
) -> Lease:
    """The lease after a heartbeat: a new TTL and the kernel's reported activity."""
    return replace(
        lease,
        renewed_at=now,
        expires_at=now + policy.ttl,
        pid=pid if pid is not None else lease.pid,
        execution_state=execution_state if execution_state is not None else lease.execution_state,
        last_activity=last_activity if last_activity is not None else lease.last_activity,
    )


def expired(state: PoolState, now: float) -> list[Lease]:
    """Live leases whose TTL has run out (``expires_at <= now``), parked ones too (their
    provisioner keeps renewing them; ending one frees no capacity)."""
    out = [lease for lease in state.leases.values() if lease.expires_at <= now]
    out += [lease for lease in state.parked.values() if lease.expires_at <= now]
    return out


def stale_requests(
    state: PoolState,
    now: float,
    policy: Policy,
    polling: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
) -> list[Request]:
    """Waiting requests whose client stopped polling (not in a long-poll, silent past the grace)."""
    return [
        r
        for r in state.queue.values()
        if r.key not in polling and now - r.last_polled_at > policy.queue_poll_grace
    ]


def idle_since(lease: Lease) -> float | None:
    """Since when the lease's kernel has been idle (its provisioner reports activity; a
    kernel that never reported any: since its grant); None while it is busy. The one home
    of the idle rule: idle reclaim, parking and the estimated waits read it."""
    if lease.execution_state == "busy":
        return None
    return lease.last_activity if lease.last_activity is not None else lease.created_at


def idle_for(lease: Lease, now: float) -> float:
    """Seconds since the kernel last did something (0 while busy)."""
    since = idle_since(lease)
    return 0.0 if since is None else max(0.0, now - since)


def idle_victims(state: PoolState, now: float, policy: Policy) -> list[Lease]:
    """Leases to revoke so that waiting requests fit; empty unless someone waits.

    For each waiting request in queue order that does not fit, pick the usable GPU
    where revoking the fewest idle-too-long leases (most idle first) makes room;
    revoke only if that suffices. Later requests see the capacity already promised.
    A lease being parked or resumed (``park`` set) is never picked, and a ``parking``
    lease's share counts as free already (it will be when its checkpoint is done): no
    more victims are picked for the waiter it makes room for.
    """
    limit = policy.idle_reclaim_after
    if limit is None or not state.queue:
        return []
    alloc = dict(state.allocated)
    victims: list[Lease] = []
    taken: set[str] = set()
    idle_by_gpu: dict[str, list[Lease]] = {}
    for lease in state.leases.values():
        if lease.park == "parking":
            alloc[lease.gpu_uuid] -= lease.fraction_ppm
        elif lease.park is None and idle_for(lease, now) > limit:
            idle_by_gpu.setdefault(lease.gpu_uuid, []).append(lease)
    if not idle_by_gpu:
        return []
    for leases in idle_by_gpu.values():
        leases.sort(key=lambda x: -idle_for(x, now))
    cap = policy.capacity_ppm
    mps = any(r.mps_uid is not None for r in state.queue.values())
    owners = mps_owners(state, now, policy) if mps else {}
    sh = shares(state, now, policy) if state.sessions else None
    for req in queue_order(state, now, policy):
        ok = usable_gpus(state, req.fraction_ppm, policy, req.node, req.gpu_uuids)
        if sh:  # a GPU whose free part a class session holds back is no room for it
            extra = sh.extra(req.groups)
            ok = [g for g in ok if not extra.get(g.uuid)]
        if req.mps_uid is not None:  # revoking idle leases does not free a GPU's MPS server
            blocked = mps_blocked(owners, req.mps_uid)
            ok = [g for g in ok if g.uuid not in blocked]
        if place(ok, alloc, req.fraction_ppm, policy) is not None:
            gpu = place(ok, alloc, req.fraction_ppm, policy)
            assert gpu is not None
            alloc[gpu.uuid] += req.fraction_ppm
            continue
        best: tuple[int, GPU, list[Lease]] | None = None
        for g in ok:
            need = alloc.get(g.uuid, 0) + req.fraction_ppm - cap
            chosen: list[Lease] = []
            for lease in idle_by_gpu.get(g.uuid, []):
                if need <= 0:
                    break
                if lease.id in taken or (sh and sh.protects(lease, req.groups)):
                    continue
                chosen.append(lease)
                need -= lease.fraction_ppm
            if need <= 0 and (best is None or len(chosen) < best[0]):
                best = (len(chosen), g, chosen)
        if best is None:
            continue
        _, g, chosen = best
        for lease in chosen:
            taken.add(lease.id)
            victims.append(lease)
            alloc[g.uuid] -= lease.fraction_ppm
        alloc[g.uuid] += req.fraction_ppm
    return victims


# -- mutations: decide and apply, return what changed ---------------------------------


def grant_waiting(state: PoolState, now: float, policy: Policy, changes: Changes) -> int:
    """Grant and apply what the queue can have now; record it in ``changes``
    (:func:`record_grants`). How many. A resume request whose lease is no longer parked
    is dropped first."""
    for req in [r for r in state.queue.values() if r.resume_of is not None]:
        if req.resume_of not in state.parked:
            del state.queue[req.key]
            changes.dropped.append((req, "dropped"))
    grants = drain(state, now, policy)
    apply_grants(state, grants)
    record_grants(changes, grants)
    return len(grants)


def acquire(
    state: PoolState,
    ask: Ask,
    quota: Quota,
    now: float,
    policy: Policy,
    new_id: Callable[[], str],
    used_fraction_hours: float = 0.0,
) -> tuple[AcquireDecision, Changes]:
    """Decide one acquire (:func:`decide_acquire`) and apply it: grants made, a new
    request queued, a repeat's poll noted. Raises as ``decide_acquire``, changing nothing.

    A kernel whose lease is parked restarted (its checkpoint went with the old process):
    that lease ends ``released`` (and its resume request leaves the queue) in the same
    changes, and the ask is decided as a new one."""
    changes = Changes(now)
    parked = state.lease_for_kernel(ask.user, ask.kernel_id)
    if parked is not None and parked.park == "parked":
        waiting = state.queue.get(parked.user_kernel)
        mine = waiting if waiting is not None and waiting.resume_of == parked.id else None
        state.remove_parked(parked.id)
        if mine is not None:
            del state.queue[mine.key]
        try:
            decision = decide_acquire(state, ask, quota, now, policy, new_id, used_fraction_hours)
        except BaseException:
            state._add_parked(parked)
            if mine is not None:
                state.queue[mine.key] = mine
            raise
        changes.ended.append((parked, "released", RESTARTED_WHILE_PARKED))
        if mine is not None:
            changes.dropped.append((mine, "dropped"))
    else:
        decision = decide_acquire(state, ask, quota, now, policy, new_id, used_fraction_hours)
    outcome = decision.outcome
    if isinstance(outcome, Queued):
        state.queue[outcome.request.key] = outcome.request
        if outcome.new:
            changes.queued.append(outcome.request)
    apply_grants(state, decision.grants)
    record_grants(changes, decision.grants)
    return decision, changes


#: why a parked lease ended when its kernel asked for a GPU again (:func:`acquire`)
RESTARTED_WHILE_PARKED = "the kernel restarted while its GPU state was parked"


def end(
    state: PoolState,
    ends: Iterable[tuple[Lease, str, str | None]],
    now: float,
    policy: Policy,
    *,
    drain_queue: bool = True,
) -> Changes:
    """End leases ``(lease, state, reason)`` and grant what the freed capacity lets waiting
    requests have. Leases no longer in ``state`` are skipped (ending is idempotent). A
    parked lease ends too (freeing nothing), and its resume request leaves the queue."""
    changes = Changes(now)
    for lease, new_state, reason in ends:
        if lease.id in state.leases:
            changes.ended.append((state.remove_lease(lease.id), new_state, reason))
        elif lease.id in state.parked:
            changes.ended.append((state.remove_parked(lease.id), new_state, reason))
            waiting = state.queue.get(lease.user_kernel)
            if waiting is not None and waiting.resume_of == lease.id:
                del state.queue[waiting.key]
                changes.dropped.append((waiting, "dropped"))
    if drain_queue:
        grant_waiting(state, now, policy, changes)
    return changes


def cancel(
    state: PoolState, requests: Iterable[Request], outcome: str, now: float, policy: Policy
) -> Changes:
    """Take waiting requests out of the queue (``cancelled`` by their client or ``dropped``),
    then grant what the queue can have now (a smaller head may fit)."""
    changes = Changes(now)
    for req in requests:
        if state.queue.pop(req.key, None) is not None:
            changes.dropped.append((req, outcome))
    grant_waiting(state, now, policy, changes)
    return changes


@dataclass
class Reaped:
    """One reaper pass: what changed, the leases it ended by cause, and the idle leases
    it began to park (``parking``: their records as ``park="parking"``; the service
    orders their node agents to checkpoint them)."""

    changes: Changes
    expired: list[Lease] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)
    revoked: list[Lease] = field(default_factory=list)
    parking: list[Lease] = field(default_factory=list)
    #: non-members' leases freed from a class session's share (parked or revoked; also in
    #: ``parking`` or ``revoked``), with the course
    freed: list[tuple[Lease, str]] = field(default_factory=list)


def idle_reason(policy: Policy) -> str:
    """Why an idle lease was revoked (what its student reads)."""
    limit = policy.idle_reclaim_after or 0
    return (
        f"the kernel was idle for more than {limit / 60:g} minutes while other students "
        "waited for a GPU"
    )


def reap(
    state: PoolState,
    now: float,
    policy: Policy,
    polling: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
    *,
    drain_queue: bool = True,
    can_park: Callable[[Lease], str | None] | None = None,
) -> Reaped:
    """One reaper pass, applied: expire leases past their TTL (parked ones too), drop
    requests whose clients stopped polling (``polling``: those in a long-poll now),
    reclaim idle leases only while someone waits, then (``drain_queue``) grant what the
    queue can have.

    Reclaim parks rather than revokes where it can: ``can_park(lease)`` (the service's
    check of the lease's node: an agent that can checkpoint, host memory to spare)
    returns None for a victim that can be parked -- it goes ``park="parking"``,
    ``parked_at=now`` (``Changes.parks``, ``Reaped.parking``; the state already holds it
    when ``can_park`` is asked about the next victim) -- or a sentence saying why not:
    it is revoked, its reason saying so. Without ``can_park`` every victim is revoked.
    """
    gone = expired(state, now)
    changes = end(
        state,
        [(x, "expired", "not renewed within its TTL") for x in gone],
        now,
        policy,
        drain_queue=False,
    )
    stale = stale_requests(state, now, policy, polling)
    for req in stale:
        state.queue.pop(req.key, None)
        changes.dropped.append((req, "dropped"))
    why = idle_reason(policy)
    revoked, parking = _reclaim(
        state, [(v, why) for v in idle_victims(state, now, policy)], now, policy, changes, can_park
    )
    freed: list[tuple[Lease, str]] = []
    if state.sessions:  # a class session under way frees its share from non-members
        chosen = victims(state, now, policy, shares(state, now, policy), idle_since)
        more, parked = _reclaim(
            state, [(v, freed_reason(s)) for v, s in chosen], now, policy, changes, can_park
        )
        course = {v.id: s.course for v, s in chosen}
        freed = [(x, course[x.id]) for x in [*parked, *(x for x, _, _ in more)]]
        revoked += more
        parking += parked
    if drain_queue:
        grant_waiting(state, now, policy, changes)
    return Reaped(changes, gone, stale, [x for x, _, _ in revoked], parking, freed)


def _reclaim(
    state: PoolState,
    chosen: list[tuple[Lease, str]],
    now: float,
    policy: Policy,
    changes: Changes,
    can_park: Callable[[Lease], str | None] | None,
) -> tuple[list[tuple[Lease, str, str | None]], list[Lease]]:
    """Park (where ``can_park`` says None) or revoke each ``(lease, why)``, applied into
    ``changes``; the revoked ``(lease, state, reason)`` and the leases now ``parking``."""
    revoked: list[tuple[Lease, str, str | None]] = []
    parking: list[Lease] = []
    for victim, why in chosen:
        if can_park is None:
            revoked.append((victim, "revoked", why))
            continue
        refusal = can_park(victim)
        if refusal is None:
            fresh = replace(victim, park="parking", parked_at=now)
            state.update_lease(fresh)
            changes.parks.append(fresh)
            parking.append(fresh)
        else:
            # an empty refusal: parking is not offered there at all, so the student's reason
            # stays today's (an admin's log says why; see Reaper._reap)
            said = f"{why}; it could not be parked: {refusal}" if refusal else why
            revoked.append((victim, "revoked", said))
    if revoked:
        changes.extend(end(state, revoked, now, policy, drain_queue=False))
    return revoked, parking


# -- parking ----------------------------------------------------------------


def parking_overdue(state: PoolState, now: float, timeout: float) -> list[Lease]:
    """Leases ``parking`` for longer than ``timeout`` seconds: the service gives up on
    them (:func:`park_failed`, saying parking did not finish)."""
    return [
        lease
        for lease in state.leases.values()
        if lease.park == "parking"
        and lease.parked_at is not None
        and now - lease.parked_at > timeout
    ]


def park_done(state: PoolState, lease_id: str, now: float, policy: Policy) -> Changes:
    """The node agent reports a lease's checkpoint done: ``parking`` -> ``parked``
    (``PoolState.park_lease``: its share is freed), then grant what the queue can have.
    A lease not ``parking`` (a late or repeated report) changes nothing."""
    changes = Changes(now)
    lease = state.leases.get(lease_id)
    if lease is None or lease.park != "parking":
        return changes
    changes.parks.append(state.park_lease(lease_id))
    grant_waiting(state, now, policy, changes)
    return changes


def park_failed(state: PoolState, lease_id: str, why: str, now: float, policy: Policy) -> Changes:
    """Parking a lease failed (the agent says ``why``, or it did not finish in time): it
    is revoked as idle reclaim would have, its reason saying why it was not parked; the
    queue drains. A lease not ``parking`` changes nothing."""
    lease = state.leases.get(lease_id)
    if lease is None or lease.park != "parking":
        return Changes(now)
    reason = f"{idle_reason(policy)}; parking failed: {why.rstrip('.')}"
    return end(state, [(lease, "revoked", reason)], now, policy)


@dataclass
class ResumeDecision:
    """What :func:`resume` found: the lease as it is now and its wire state: ``active``
    (nothing to do), ``parking`` (its checkpoint is still being made), ``resuming`` (its
    share is re-reserved, the restore ordered) or ``parked`` (its resume request waits at
    ``position``, 1 = next)."""

    lease: Lease
    state: Literal["active", "parking", "resuming", "parked"]
    position: int | None = None


def resume(
    state: PoolState,
    lease_id: str,
    now: float,
    policy: Policy,
    new_id: Callable[[], str],
    *,
    priority: int | None = None,
) -> tuple[ResumeDecision, Changes]:
    """The owner asks for a parked lease back (``POST /api/v1/leases/{id}/resume``).

    ``lease_id`` names a live lease (``state.leases`` or ``state.parked``; else
    ``KeyError``): the service has checked that the caller owns it. A lease not parked
    is answered as it is. A parked one gets a resume request (``Request.resume_of``) of
    its fraction on its own GPU, arrived when it was parked (it keeps that place in the
    queue), no quota checked (it was admitted before), with ``priority`` (the user's
    effective quota's; None: as a waiting request of the same user, else of the same
    course, else 0); the queue then drains, and if the request is granted at once the
    lease is ``resuming``. Idempotent: an existing resume request is found (its poll
    noted) and its position told.
    """
    changes = Changes(now)
    live = state.leases.get(lease_id)
    if live is not None:
        return ResumeDecision(live, live.park or "active"), changes
    lease = state.parked[lease_id]
    key = lease.user_kernel
    waiting = state.queue.get(key)
    if waiting is not None:
        assert waiting.resume_of == lease.id, "a parked lease's kernel waits only to resume"
        state.queue[key] = replace(waiting, last_polled_at=now)
        return ResumeDecision(lease, "parked", position_of(state, key, now, policy)), changes
    if priority is None:
        priority = _queue_priority(state, lease)
    req = Request(
        id=new_id(),
        user=lease.user,
        kernel_id=lease.kernel_id,
        fraction_ppm=lease.fraction_ppm,
        arrived_at=lease.parked_at if lease.parked_at is not None else now,
        last_polled_at=now,
        groups=frozenset(lease.groups),
        group=lease.group,
        gpu_uuids=(lease.gpu_uuid,),
        priority=priority,
        mps_uid=lease.mps_uid,
        resume_of=lease.id,
    )
    state.queue[key] = req
    changes.queued.append(req)
    grant_waiting(state, now, policy, changes)
    back = state.leases.get(lease_id)
    if back is not None:
        return ResumeDecision(back, "resuming"), changes
    position = position_of(state, key, now, policy)
    return ResumeDecision(state.parked[lease_id], "parked", position), changes


def _queue_priority(state: PoolState, lease: Lease) -> int:
    """The priority the queue gives ``lease``'s user now: that of a waiting request of the
    same user, else of the same course kernel's group, else 0."""
    same_group = None
    for r in state.queue.values():
        if r.user == lease.user:
            return r.priority
        if same_group is None and lease.group is not None and r.group == lease.group:
            same_group = r.priority
    return same_group or 0


def resume_done(state: PoolState, lease_id: str, now: float) -> Changes:
    """The node agent reports a lease's restore done: ``resuming`` -> ``active``
    (``park`` and ``parked_at`` cleared). A lease not ``resuming`` changes nothing."""
    changes = Changes(now)
    lease = state.leases.get(lease_id)
    if lease is None or lease.park != "resuming":
        return changes
    fresh = replace(lease, park=None, parked_at=None)
    state.update_lease(fresh)
    changes.parks.append(fresh)
    return changes


#: the start of the reason of a lease whose restore failed (:func:`resume_failed`)
RESTORE_FAILED = "the GPU state could not be restored: "


def resume_failed(state: PoolState, lease_id: str, why: str, now: float, policy: Policy) -> Changes:
    """The restore of a ``resuming`` lease failed (the agent says ``why``): it is revoked
    and the queue drains. A lease not ``resuming`` changes nothing."""
    lease = state.leases.get(lease_id)
    if lease is None or lease.park != "resuming":
        return Changes(now)
    return end(state, [(lease, "revoked", RESTORE_FAILED + why.rstrip("."))], now, policy)


# -- accounting -------------------------------------------------------------------


def check_invariants(state: PoolState, policy: Policy) -> None:
    """Assert the capacity and bookkeeping invariants (used by tests and the simulator).

    Parked leases: apart from ``leases``, holding no capacity, counted for their kernel
    and user; a kernel waits in the queue while it holds a lease only with the one
    resume request of its parked lease, and every resume request has its parked lease."""
    totals: dict[str, int] = {u: 0 for u in state.gpus}
    counts: dict[str, int] = {u: 0 for u in state.gpus}
    seen: set[tuple[str, str]] = set()
    held: dict[str, int] = {}
    numbers: dict[str, int] = {}
    for lease in [*state.leases.values(), *state.parked.values()]:
        assert lease.active, lease
        parked = lease.id in state.parked
        assert (lease.park == "parked") == parked, lease
        assert not (parked and lease.id in state.leases), f"{lease.id} both parked and not"
        assert (lease.park is None) == (lease.parked_at is None), lease
        key = (lease.user, lease.kernel_id)
        assert key not in seen, f"two active leases for {key}"
        seen.add(key)
        assert state.by_kernel.get(key) == lease.id, f"by_kernel drifted on {key}"
        held[lease.user] = held.get(lease.user, 0) + lease.fraction_ppm
        numbers[lease.user] = numbers.get(lease.user, 0) + 1
        waiting = state.queue.get(key)
        if parked:
            assert waiting is None or waiting.resume_of == lease.id, f"{key} waits anew"
            continue
        totals[lease.gpu_uuid] = totals.get(lease.gpu_uuid, 0) + lease.fraction_ppm
        counts[lease.gpu_uuid] = counts.get(lease.gpu_uuid, 0) + 1
        assert waiting is None, f"{key} both holds a lease and waits"
    assert len(state.by_kernel) == len(seen), "by_kernel names a lease that is gone"
    assert held == state.held_by_user, f"held_by_user drifted: {state.held_by_user} != {held}"
    assert numbers == state.leases_by_user, "leases_by_user drifted"
    for req in state.queue.values():
        if req.resume_of is None:
            continue
        of = state.parked.get(req.resume_of)
        assert of is not None, f"resume request {req.id} of a lease not parked"
        assert req.key == of.user_kernel and req.gpu_uuids == (of.gpu_uuid,), req
        assert req.fraction_ppm == of.fraction_ppm, req
    if state.sessions:  # nothing is reserved beyond the pool
        reserved: dict[str, int] = {}
        for per_gpu in reserve(state, state.sessions, policy).values():
            for uuid, n in per_gpu.items():
                assert uuid in state.gpus, f"a share reserved on {uuid}, not in the pool"
                reserved[uuid] = reserved.get(uuid, 0) + n
        for uuid, n in reserved.items():
            assert 0 < n <= policy.capacity_ppm, f"GPU {uuid} reserved {n} ppm"
    for uuid, total in totals.items():
        assert total <= policy.capacity_ppm, f"GPU {uuid} over-allocated: {total} ppm"
        assert state.allocated.get(uuid, 0) == total, f"allocated map drifted on {uuid}"
        assert state.lease_count.get(uuid, 0) == counts[uuid], f"lease_count drifted on {uuid}"
