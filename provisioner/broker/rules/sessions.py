"""Class sessions: a course's reserved GPU share on its timetable, pure like the rest of the core.

A course plans its sessions in the courses file (:class:`SessionPlan`: recurring days and
hours in an IANA time zone, or a date) or an instructor starts one by hand; either way
the core sees :class:`~provisioner.model.ClassSession` records (``PoolState.sessions``)
with ``now`` passed in. The rules, in the order of a session's life:

* **Reserved where.** A session reserves its share (a fraction of the capacity of the
  GPUs it may use, or seats × a kernel's fraction) on those GPUs, whole GPUs first,
  taken from the end of the pool's order (placement's best-fit fills the pool from its
  start, so the reserve lands where the fewest kernels are). Sessions at once take turns,
  the narrowest first; a GPU is never reserved beyond its capacity (:func:`reserve`),
  so nothing is reserved beyond the pool even when the file asks for more.
* **Lead** (``Policy.session_lead`` before the start): no new lease of a non-member is
  placed in the share's unused part (:meth:`Shares.extra`).
* **On** (from the start): the same, and the reaper frees the share from non-members'
  kernels that sit in it (:func:`victims`): idle ones at once (parked where the node parks,
  revoked otherwise, with :func:`freed_reason`), busy ones only ``Policy.session_busy_grace``
  after the start (None: never).
* Members are granted **from the share first** (:func:`place_for`): a GPU where their
  course's share has room for the kernel, past the queue head's reservation; otherwise
  where anyone may go, and non-members use only the rest.
* **Lent back**: ``Policy.session_lend_after`` into the session, the share's unused part
  is no longer held from non-members, until a member of the course waits again.
* At the **end** the share returns to everyone (the record leaves the state).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ...model import GPU, ClassSession, Lease, PoolState
from ...wire import PPM, ppm_to_fraction
from .policy import Policy

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


# -- the timetable ------------------------------------------------------------------


@dataclass(frozen=True)
class SessionPlan:
    """One line of a course's timetable: recurring ``days`` (0 = Monday) or one ``date``,
    from ``start`` to ``end`` (wall-clock times in ``tz``), reserving ``pool_fraction`` of
    its GPUs' capacity or ``share_ppm`` (seats × a kernel's fraction)."""

    course: str
    start: dt.time
    end: dt.time
    tz: str = "UTC"
    days: tuple[int, ...] = ()
    date: dt.date | None = None
    pool_fraction: float | None = None
    share_ppm: int | None = None
    gpu_uuids: tuple[str, ...] | None = None
    nodes: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        hours = f"{self.start:%H:%M}-{self.end:%H:%M}"
        if self.date is not None:
            return f"{self.date.isoformat()} {hours}"
        return f"{','.join(DAYS[d].capitalize() for d in self.days)} {hours}"

    def share_text(self) -> str:
        return share_text(self.pool_fraction, self.share_ppm)

    def occurrences(self, since: float, until: float) -> list[ClassSession]:
        """Its sessions that overlap ``[since, until)`` (epoch seconds), DST-aware."""
        zone = zone_of(self.tz)
        first = dt.datetime.fromtimestamp(since, zone).date() - dt.timedelta(days=1)
        last = dt.datetime.fromtimestamp(until, zone).date()
        dates: Iterable[dt.date]
        if self.date is not None:
            dates = [self.date] if first <= self.date <= last else []
        else:
            count = (last - first).days + 1
            days = set(self.days)
            dates = (
                d
                for d in (first + dt.timedelta(days=i) for i in range(count))
                if d.weekday() in days
            )
        out = []
        for day in dates:
            start = dt.datetime.combine(day, self.start, zone).timestamp()
            end_day = day if self.end > self.start else day + dt.timedelta(days=1)
            end = dt.datetime.combine(end_day, self.end, zone).timestamp()
            if end > since and start < until:
                out.append(
                    ClassSession(
                        course=self.course,
                        start=start,
                        end=end,
                        pool_fraction=self.pool_fraction,
                        share_ppm=self.share_ppm,
                        gpu_uuids=self.gpu_uuids,
                        nodes=self.nodes,
                        tz=self.tz,
                        source="timetable",
                        label=self.label,
                    )
                )
        return out


@dataclass
class Timetable:
    """The broker's timetable: the courses file's plans, the sessions instructors started
    by hand, and the planned ones they extended or ended early (by their ``key``)."""

    plans: tuple[SessionPlan, ...] = ()
    #: course -> its instructors (who may start, extend and end its sessions)
    instructors: dict[str, frozenset[str]] = field(default_factory=dict)
    #: course -> a seat's default GPU fraction (ppm): its quota's max_lease_fraction
    seat_ppm: dict[str, int] = field(default_factory=dict)
    #: course -> the session an instructor started by hand
    by_hand: dict[str, ClassSession] = field(default_factory=dict)
    #: a planned session's key -> its end as an instructor moved it (extended, ended)
    ends: dict[tuple[str, float, str], float] = field(default_factory=dict)

    def near(self, now: float) -> tuple[ClassSession, ...]:
        """The sessions from now to two days ahead, as the core gets them
        (``PoolState.sessions``): planned ones with their moved ends, and by-hand ones."""
        out = []
        for s in timetable(self.plans, now - 86400.0, now + 2 * 86400.0):
            end = self.ends.get(s.key, s.end)
            if end > now:
                out.append(s if end == s.end else replace(s, end=end))
        out += [s for s in self.by_hand.values() if s.end > now]
        return tuple(sorted(out, key=lambda s: (s.start, s.course)))

    def current(self, course: str, now: float, policy: Policy) -> ClassSession | None:
        """The course's session under way or in its lead time now, if any."""
        for s in self.near(now):
            if s.course == course and phase(s, now, policy) is not None:
                return s
        return None

    def zone(self, course: str) -> str:
        """Where a course's times are told: its first plan's zone, else UTC."""
        return next((p.tz for p in self.plans if p.course == course), "UTC")


def zone_of(name: str) -> ZoneInfo:
    """The IANA zone ``name``; ``ValueError`` with a sentence when it is unknown."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"{name!r} is not an IANA time zone (e.g. 'Europe/Paris', 'America/New_York', 'UTC')."
        ) from exc


def share_text(pool_fraction: float | None, share_ppm: int | None) -> str:
    if pool_fraction is not None:
        return f"{pool_fraction:.0%} of its GPUs"
    return f"{ppm_to_fraction(share_ppm or 0):g} GPU"


def timetable(plans: Iterable[SessionPlan], since: float, until: float) -> list[ClassSession]:
    """Every plan's sessions overlapping ``[since, until)``, by start."""
    out = [s for p in plans for s in p.occurrences(since, until)]
    return sorted(out, key=lambda s: (s.start, s.course))


def clock_text(when: float, tz: str) -> str:
    """``11:30`` in the session's zone (what students read)."""
    return f"{dt.datetime.fromtimestamp(when, zone_of(tz)):%H:%M}"


# -- where a share is reserved ---------------------------------------------------


def scope(state: PoolState, session: ClassSession) -> list[GPU]:
    """The GPUs a session may reserve, in the pool's order."""
    gpus = state.ordered_gpus()
    if session.gpu_uuids is not None:
        wanted = set(session.gpu_uuids)
        gpus = [g for g in gpus if g.uuid in wanted]
    if session.nodes is not None:
        nodes = set(session.nodes)
        gpus = [g for g in gpus if g.node in nodes]
    return gpus


def wanted_ppm(session: ClassSession, gpus: list[GPU], capacity: int) -> int:
    """The share a session asks for, in GPU-ppm, on ``gpus`` of ``capacity`` each."""
    if session.pool_fraction is not None:
        return round(session.pool_fraction * capacity * len(gpus))
    return session.share_ppm or 0


def reserve(
    state: PoolState, sessions: Iterable[ClassSession], policy: Policy
) -> dict[tuple[str, float, str], dict[str, int]]:
    """Each session's reserve per GPU (``key`` -> uuid -> ppm), never more than a GPU's
    capacity in all: the narrowest sessions first, whole GPUs from the end of the pool's
    order first. A share beyond what its GPUs have left is cut (never beyond the pool)."""
    cap = policy.capacity_ppm
    taken: dict[str, int] = {}
    out: dict[tuple[str, float, str], dict[str, int]] = {}
    todo = [(s, scope(state, s)) for s in sessions]
    todo.sort(key=lambda x: (len(x[1]), x[0].start, x[0].course))
    for s, gpus in todo:
        left = wanted_ppm(s, gpus, cap)
        mine: dict[str, int] = {}
        for g in reversed(gpus):
            if left <= 0:
                break
            room = cap - taken.get(g.uuid, 0)
            if room <= 0:
                continue
            part = min(room, left)
            mine[g.uuid] = part
            taken[g.uuid] = taken.get(g.uuid, 0) + part
            left -= part
        out[s.key] = mine
    return out


# -- the share as placement sees it -----------------------------------------------


def phase(session: ClassSession, now: float, policy: Policy) -> str | None:
    """``lead``, ``on`` or ``after`` (past ``session_lend_after``: lent back unless a member
    asks); None outside its lead time and its hours."""
    if now >= session.end or now < session.start - policy.session_lead:
        return None
    if now < session.start:
        return "lead"
    lend = policy.session_lend_after
    if lend is not None and now >= session.start + lend:
        return "after"
    return "on"


@dataclass
class Held:
    """One session in its lead time or hours: its reserve and its members' use per GPU."""

    session: ClassSession
    phase: str
    reserved: dict[str, int]
    used: dict[str, int] = field(default_factory=dict)
    #: members of the course waiting in the queue (a lent share is held again while any do)
    waiting: int = 0

    @property
    def asked(self) -> bool:
        return self.waiting > 0

    @property
    def course(self) -> str:
        return self.session.course

    @property
    def lent(self) -> bool:
        return self.phase == "after" and not self.asked

    def unused(self, uuid: str) -> int:
        return max(0, self.reserved.get(uuid, 0) - self.used.get(uuid, 0))

    def hold(self, uuid: str) -> int:
        """What non-members must leave free on ``uuid`` now."""
        return 0 if self.lent else self.unused(uuid)

    @property
    def reserved_ppm(self) -> int:
        return sum(self.reserved.values())

    @property
    def used_ppm(self) -> int:
        return sum(min(u, self.reserved.get(g, 0)) for g, u in self.used.items())

    @property
    def lent_ppm(self) -> int:
        return sum(self.unused(g) for g in self.reserved) if self.lent else 0


def is_member(course: str, groups: Iterable[str]) -> bool:
    return course in groups


class Shares:
    """The sessions held at ``now`` over ``state``: what each asker may use where. Built
    once per decision (:func:`shares`); :meth:`note` counts a grant made meanwhile."""

    def __init__(self, held: list[Held]) -> None:
        self.held = held

    def __bool__(self) -> bool:
        return bool(self.held)

    def mine(self, groups: Iterable[str]) -> list[Held]:
        g = set(groups)
        return [h for h in self.held if h.course in g]

    def extra(self, groups: Iterable[str]) -> dict[str, int]:
        """uuid -> ppm that an asker of ``groups`` must leave free (others' shares)."""
        g = set(groups)
        out: dict[str, int] = {}
        for h in self.held:
            if h.course in g:
                continue
            for uuid in h.reserved:
                n = h.hold(uuid)
                if n:
                    out[uuid] = out.get(uuid, 0) + n
        return out

    def note(self, lease: Lease, waited: bool = True) -> None:
        """A grant made since: its member's use of the share, one member fewer waiting."""
        for h in self.held:
            if h.course not in lease.groups:
                continue
            if waited and h.waiting:
                h.waiting -= 1
            if lease.gpu_uuid in h.reserved:
                h.used[lease.gpu_uuid] = h.used.get(lease.gpu_uuid, 0) + lease.fraction_ppm

    def protects(self, lease: Lease, groups: Iterable[str]) -> bool:
        """Whether ``lease`` is a member's in its course's share held now, which idle
        reclaim for an asker of ``groups`` (not of that course) must not take: its freed
        part would be held back from that asker anyway."""
        g = set(groups)
        return any(
            not h.lent
            and lease.gpu_uuid in h.reserved
            and h.course in lease.groups
            and h.course not in g
            for h in self.held
        )

    def blocking(self, groups: Iterable[str], uuids: Iterable[str]) -> list[Held]:
        """The held sessions of other courses that hold something back on ``uuids``."""
        g = set(groups)
        wanted = set(uuids)
        return [
            h
            for h in self.held
            if h.course not in g and any(h.hold(u) for u in wanted & set(h.reserved))
        ]


def shares(state: PoolState, now: float, policy: Policy, *, asking: Iterable[str] = ()) -> Shares:
    """The sessions held at ``now`` (lead time or hours), their reserves and members' use;
    ``asking``: the groups of a new ask not yet in the queue (it counts as waiting)."""
    live = [
        (s, p) for s in state.sessions if (p := phase(s, now, policy)) is not None and s.end > now
    ]
    if not live:
        return Shares([])
    where = reserve(state, [s for s, _ in live], policy)
    waiting: dict[str, int] = {}
    for groups in [asking, *(r.groups for r in state.queue.values())]:
        for g in groups:
            waiting[g] = waiting.get(g, 0) + 1
    held = []
    for s, p in live:
        reserved = where.get(s.key, {})
        used: dict[str, int] = {}
        for lease in state.leases.values():
            if lease.gpu_uuid in reserved and s.course in lease.groups:
                used[lease.gpu_uuid] = used.get(lease.gpu_uuid, 0) + lease.fraction_ppm
        held.append(Held(s, p, reserved, used, waiting=waiting.get(s.course, 0)))
    return Shares(held)


def effective(alloc: dict[str, int], extra: dict[str, int]) -> dict[str, int]:
    """``alloc`` with what an asker must leave free added."""
    if not extra:
        return alloc
    out = dict(alloc)
    for uuid, n in extra.items():
        out[uuid] = out.get(uuid, 0) + n
    return out


# -- freeing the share at the start -------------------------------------------------


def freed_reason(session: ClassSession) -> str:
    """Why a non-member's kernel left a share (what its student reads)."""
    return (
        f"the GPU was reserved for {session.course}'s class session until "
        f"{clock_text(session.end, session.tz)}"
    )


def member_note(
    sessions: Iterable[ClassSession], groups: Iterable[str], now: float, policy: Policy
) -> str | None:
    """What a member's lease says while its course's session is held (lead time or hours):
    ``GPU reserved for ml101 until 11:30``; None otherwise."""
    g = set(groups)
    for s in sessions:
        if s.course in g and phase(s, now, policy) is not None:
            return f"GPU reserved for {s.course} until {clock_text(s.end, s.tz)}"
    return None


def waiting_reason(held: list[Held]) -> str:
    """The sentence a non-member waiting behind sessions reads first."""
    parts = [
        f"reserved for {h.course}'s class session until {clock_text(h.session.end, h.session.tz)}"
        for h in held
    ]
    return f"Part of the GPUs you may use is {' and '.join(parts)}."


def victims(
    state: PoolState,
    now: float,
    policy: Policy,
    sh: Shares,
    idle_since: Callable[[Lease], float | None],
) -> list[tuple[Lease, ClassSession]]:
    """Non-members' leases to free so that the shares of sessions under way (``on``, or
    lent back and asked for again) are free: on each GPU, as much as those shares hold
    back beyond the GPU's capacity; idle kernels first (most idle first), busy ones only
    once ``session_busy_grace`` has passed since the session's start. A lease being
    parked or resumed is never picked; a ``parking`` one counts as free already.
    ``idle_since``: the core's idle rule (``scheduling.idle_since``, its one home)."""

    freeing = [h for h in sh.held if h.phase == "on" or (h.phase == "after" and h.asked)]
    if not freeing:
        return []
    cap = policy.capacity_ppm
    alloc = dict(state.allocated)
    on_gpu: dict[str, list[Lease]] = {}
    for lease in state.leases.values():
        if lease.park == "parking":
            alloc[lease.gpu_uuid] -= lease.fraction_ppm
        elif lease.park is None:
            on_gpu.setdefault(lease.gpu_uuid, []).append(lease)
    out: list[tuple[Lease, ClassSession]] = []
    uuids = sorted({u for h in freeing for u in h.reserved})
    for uuid in uuids:
        holding = [h for h in sh.held if h.hold(uuid)]
        need = alloc.get(uuid, 0) + sum(h.hold(uuid) for h in holding) - cap
        need = min(need, sum(h.hold(uuid) for h in freeing))
        if need <= 0:
            continue
        courses = {h.course for h in holding}
        # whose share this GPU's freeing serves: the first session under way that holds here
        first = next(h for h in freeing if h.hold(uuid))
        grace = policy.session_busy_grace
        busy_ok = grace is not None and now >= first.session.start + grace
        cands = [
            x
            for x in on_gpu.get(uuid, [])
            if not courses & set(x.groups) and (idle_since(x) is not None or busy_ok)
        ]
        cands.sort(key=lambda x: (idle_since(x) is None, idle_since(x) or 0.0, x.id))
        for lease in cands:
            if need <= 0:
                break
            out.append((lease, first.session))
            need -= lease.fraction_ppm
    return out


# -- what the API and the dashboard show ----------------------------------------------


@dataclass(frozen=True)
class SessionView:
    """One session as ``GET /api/v1/sessions`` and ``gpu-lease top`` show it."""

    session: ClassSession
    phase: str | None
    reserved_ppm: int
    used_ppm: int
    lent_ppm: int
    wanted_ppm: int

    def to_json(self) -> dict[str, object]:
        s = self.session
        return {
            "course": s.course,
            "start": s.start,
            "end": s.end,
            "tz": s.tz,
            "label": s.label,
            "source": s.source,
            "state": self.phase or "planned",
            "share": share_text(s.pool_fraction, s.share_ppm),
            "wanted": ppm_to_fraction(self.wanted_ppm),
            "reserved": ppm_to_fraction(self.reserved_ppm),
            "used": ppm_to_fraction(self.used_ppm),
            "lent": ppm_to_fraction(self.lent_ppm),
            "gpus": list(s.gpu_uuids) if s.gpu_uuids is not None else None,
            "nodes": list(s.nodes) if s.nodes is not None else None,
        }


def views(state: PoolState, now: float, policy: Policy) -> list[SessionView]:
    """Every session of ``state`` by start, held ones with their reserve, use and loan."""
    sh = shares(state, now, policy)
    held = {h.session.key: h for h in sh.held}
    out = []
    for s in sorted(state.sessions, key=lambda s: (s.start, s.course)):
        if s.end <= now:
            continue
        h = held.get(s.key)
        want = wanted_ppm(s, scope(state, s), policy.capacity_ppm)
        if h is None:
            out.append(SessionView(s, None, 0, 0, 0, want))
        else:
            out.append(SessionView(s, h.phase, h.reserved_ppm, h.used_ppm, h.lent_ppm, want))
    return out


# -- checks of a timetable at load ------------------------------------------------


def overbooked(sessions: list[ClassSession], gpus: list[GPU] | None, policy: Policy) -> list[str]:
    """Sentences for every moment where sessions at once ask for more than there is:
    one session beyond its GPUs, or several whose GPUs overlap beyond their capacity
    (every subset of the sessions at once, so a share that cannot be placed is found).
    Without ``gpus`` (a pool only node agents bring), only shares given as fractions of
    the whole pool can be checked (their sum at most 1)."""
    cap = policy.capacity_ppm
    pool = PoolState.build(gpus) if gpus else None
    problems: list[str] = []
    seen: set[tuple[tuple[str, float, str], ...]] = set()
    for s in sessions:
        at_once = [o for o in sessions if o.start < s.end and s.start < o.end]
        at_once.sort(key=lambda o: (o.start, o.course))
        n = len(at_once)
        for mask in range(1, 1 << min(n, 12)):
            group = [at_once[i] for i in range(n) if mask >> i & 1]
            if s not in group or len({o.course for o in group}) < len(group) and len(group) > 1:
                continue
            key = tuple(sorted(o.key for o in group))
            if key in seen:
                continue
            seen.add(key)
            problem = _over(group, pool, cap)
            if problem:
                problems.append(problem)
    return problems


def _over(group: list[ClassSession], pool: PoolState | None, cap: int) -> str:
    names = " and ".join(f"{o.course} ({o.label or 'by hand'})" for o in group)
    if pool is None:
        if any(o.pool_fraction is None or o.gpu_uuids or o.nodes for o in group):
            return ""
        total = sum(o.pool_fraction or 0.0 for o in group)
        if total > 1 + 1e-9:
            return f"{names} reserve {total:.0%} of the pool at once, {total - 1:.0%} too much."
        return ""
    uuids: set[str] = set()
    want = 0
    for o in group:
        gpus = scope(pool, o)
        uuids.update(g.uuid for g in gpus)
        want += wanted_ppm(o, gpus, cap)
    have = cap * len(uuids)
    if want > have:
        what = "its GPUs" if len(group) == 1 else "their GPUs"
        verb = "reserves" if len(group) == 1 else "reserve"
        return (
            f"{names} {verb} {ppm_to_fraction(want):g} GPU at once but {what} have "
            f"{ppm_to_fraction(have):g}: {ppm_to_fraction(want - have):g} GPU too much."
        )
    return ""


__all__ = [
    "DAYS",
    "PPM",
    "Held",
    "SessionPlan",
    "SessionView",
    "Shares",
    "Timetable",
    "clock_text",
    "effective",
    "freed_reason",
    "member_note",
    "overbooked",
    "phase",
    "reserve",
    "scope",
    "share_text",
    "shares",
    "timetable",
    "victims",
    "views",
    "waiting_reason",
    "zone_of",
]
