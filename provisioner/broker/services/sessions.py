"""Class sessions: the timetable from the courses file, and instructors' sessions by hand.

Who calls this: ``app.py`` hands it the courses file's timetable at start, and
``startup.CoursesWatch`` again whenever the file changed and is still good (a bad one is
logged and the last good one kept) (:meth:`SessionService.use`); the handlers of ``/api/v1/sessions`` call
:meth:`list`, :meth:`start`, :meth:`extend` and :meth:`end`. The rules are pure, in
``rules/sessions.py``; the core sees the sessions near now (``ServiceCore.use_timetable``)
and every reaper pass frees what a session under way reserves (``scheduling.reap``).

Sessions started, extended or ended by hand live in memory: a restarted broker has only
the courses file's timetable (docs/instructors.md says so).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ...errors import Conflict, Forbidden, InvalidRequest, NotFound
from ...model import ClassSession, Identity
from ...wire import fraction_to_ppm
from ..rules import sessions
from ..rules.sessions import SessionPlan, SessionView, Timetable
from .service_core import ServiceCore

log = logging.getLogger("gpu_lease.broker")

#: the longest session an instructor may start or extend to by hand (seconds)
MAX_BY_HAND = 12 * 3600.0


class SessionService:
    """The timetable (courses file + by hand) and the instructors' commands."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    # -- the courses file -------------------------------------------------------------
    def use(
        self,
        plans: tuple[SessionPlan, ...],
        instructors: dict[str, frozenset[str]],
        seat_ppm: dict[str, int],
    ) -> None:
        """Take a checked timetable (the courses file's, read by ``broker/courses.py``);
        the sessions started, extended or ended by hand are kept."""
        old = self.core.timetable
        self.core.timetable = Timetable(
            plans=plans,
            instructors=instructors,
            seat_ppm=seat_ppm,
            by_hand=old.by_hand,
            ends=old.ends,
        )
        self.core.use_timetable(self.core.clock())
        if plans:
            log.info("Class sessions: %d plan(s) of %d course(s)", len(plans), len(instructors))

    # -- reads ----------------------------------------------------------------------------
    async def list(self, ident: Identity, course: str | None = None) -> list[SessionView]:
        """The timetable from now to two days ahead (anyone signed in may read it)."""
        await self.core.ready()
        now = self.core.clock()
        self.core.use_timetable(now)
        out = sessions.views(self.core.state, now, self.core.policy)
        return [v for v in out if course is None or v.session.course == course]

    # -- instructors ----------------------------------------------------------------------
    def _may_run(self, ident: Identity, course: str) -> None:
        if course not in self.core.timetable.instructors:
            raise NotFound(
                f"There is no course {course!r} in the courses file; check the name "
                "(gpu-lease session list shows the timetable)."
            )
        if ident.admin or ident.user in self.core.timetable.instructors.get(course, ()):
            return
        who = ", ".join(sorted(self.core.timetable.instructors.get(course, ()))) or "an admin"
        raise Forbidden(
            f"Only the instructors of {course} (or a GPU lease admin) may start, extend or end "
            f"its class sessions; ask {who}."
        )

    def _until(self, until: float, now: float) -> float:
        if until <= now + 60:
            raise InvalidRequest(
                "'until' must be at least a minute from now (a time later today, e.g. 11:45)."
            )
        if until > now + MAX_BY_HAND:
            raise InvalidRequest(
                f"A session by hand lasts at most {MAX_BY_HAND / 3600:g} hours; plan longer "
                "ones in the courses file."
            )
        return until

    async def start(
        self,
        ident: Identity,
        course: str,
        until: float,
        *,
        seats: int | None = None,
        kernel_fraction: float | None = None,
        share: float | None = None,
        tz: str | None = None,
    ) -> SessionView:
        """Start a session of ``course`` now until ``until``, reserving ``share`` of the
        pool or ``seats`` × ``kernel_fraction`` (default: the course's max_lease_fraction).
        Refused (409) when the course already has one now, or when it would reserve more
        than the pool has beside the sessions already on."""
        await self.core.ready()
        self._may_run(ident, course)
        now = self.core.clock()
        until = self._until(until, now)
        table = self.core.timetable
        if table.current(course, now, self.core.policy) is not None:
            held = table.current(course, now, self.core.policy)
            assert held is not None
            raise Conflict(
                f"{course} already has a class session until "
                f"{sessions.clock_text(held.end, held.tz)}; extend it "
                f"(gpu-lease session extend {course} --until HH:MM) or end it first."
            )
        pool_fraction, share_ppm = self._share(course, seats, kernel_fraction, share)
        zone = tz or table.zone(course)
        try:
            sessions.zone_of(zone)
        except ValueError as exc:
            raise InvalidRequest(f"'tz': {exc}") from exc
        fresh = ClassSession(
            course=course,
            start=now,
            end=until,
            pool_fraction=pool_fraction,
            share_ppm=share_ppm,
            tz=zone,
            source="by hand",
            label="by hand",
        )
        self._check_room(fresh, now)
        table.by_hand[course] = fresh
        log.info(
            "%s started a class session of %s until %s (%s)",
            ident.user,
            course,
            sessions.clock_text(until, zone),
            sessions.share_text(pool_fraction, share_ppm),
        )
        return await self._changed(fresh, now)

    def _share(
        self, course: str, seats: int | None, kernel_fraction: float | None, share: float | None
    ) -> tuple[float | None, int | None]:
        if (share is None) == (seats is None):
            raise InvalidRequest(
                "Give either 'seats' (e.g. 40, each of the course's kernel fraction) or "
                "'share' (a fraction of the pool, e.g. 0.25)."
            )
        if share is not None:
            return share, None
        assert seats is not None
        each = (
            fraction_to_ppm(kernel_fraction)
            if kernel_fraction is not None
            else self.core.timetable.seat_ppm.get(course)
        )
        if not each:
            raise InvalidRequest(
                f"{course}'s quota has no max_lease_fraction to size a seat: give "
                "'kernel_fraction' (e.g. 0.02) with 'seats'."
            )
        return None, seats * each

    def _check_room(self, fresh: ClassSession, now: float) -> None:
        """409 when ``fresh`` beside the sessions at once reserves beyond the pool."""
        others = [
            s for s in self.core.state.sessions if s.start < fresh.end and fresh.start < s.end
        ]
        found = sessions.overbooked([*others, fresh], self.core.pool(), self.core.policy)
        mine = [p for p in found if f"{fresh.course} (by hand)" in p]
        if mine:
            raise Conflict(f"{mine[0]} Ask for fewer seats or a smaller share.")

    async def extend(self, ident: Identity, course: str, until: float) -> SessionView:
        """Move the end of ``course``'s session under way (planned or by hand) to ``until``."""
        await self.core.ready()
        self._may_run(ident, course)
        now = self.core.clock()
        until = self._until(until, now)
        table = self.core.timetable
        held = table.current(course, now, self.core.policy)
        if held is None:
            raise Conflict(
                f"{course} has no class session now; start one (gpu-lease session start "
                f"{course} --until HH:MM --seats N)."
            )
        if until <= held.end:
            raise InvalidRequest(
                f"{course}'s session already lasts until {sessions.clock_text(held.end, held.tz)}; "
                "give a later time (or end it with gpu-lease session end)."
            )
        moved = replace(held, end=until)
        self._check_room(replace(moved, source="by hand", label="by hand"), now)
        self._put(moved)
        log.info("%s extended %s's class session until %s", ident.user, course, until)
        return await self._changed(moved, now)

    async def end(self, ident: Identity, course: str) -> SessionView:
        """End ``course``'s session under way now (its share returns to everyone)."""
        await self.core.ready()
        self._may_run(ident, course)
        now = self.core.clock()
        held = self.core.timetable.current(course, now, self.core.policy)
        if held is None:
            raise Conflict(f"{course} has no class session now: there is nothing to end.")
        ended = replace(held, end=now)
        self._put(ended)
        log.info("%s ended %s's class session", ident.user, course)
        return await self._changed(ended, now)

    def _put(self, moved: ClassSession) -> None:
        table = self.core.timetable
        if moved.source == "by hand":
            if moved.end <= moved.start:
                table.by_hand.pop(moved.course, None)
            else:
                table.by_hand[moved.course] = moved
        else:
            table.ends[moved.key] = moved.end

    async def _changed(self, session: ClassSession, now: float) -> SessionView:
        """The core sees the new timetable; the queue drains (a session's end frees its
        share, a start lets waiting members in); the session as ``list`` shows it."""
        self.core.use_timetable(now)
        await self.core.grant_waiting()
        for view in sessions.views(self.core.state, now, self.core.policy):
            if view.session.key == session.key:
                return view
        return SessionView(session, None, 0, 0, 0, 0)


__all__ = ["MAX_BY_HAND", "SessionService"]
