"""The courses file: courses (JupyterHub groups) and GPU quotas in one TOML file.

Admins edit one file (``hub_config/courses.toml``); two readers use it:

- ``hub_config/jupyterhub_config.py`` turns the courses into hub groups
  (``c.JupyterHub.load_groups``), the ``instructors`` into holders of the
  ``custom:gpu-lease:admin`` scope and ``admins`` into hub admins;
- the broker (``gpu-lease broker --quotas-file FILE``) applies the quotas at every
  start (:meth:`~provisioner.broker.services.quotas.QuotaService.apply_quotas`).

Shape (every quota table takes the fields of ``PUT /api/v1/quotas/...``:
``max_fraction``, ``max_leases``, ``max_lease_fraction``, ``budget_fraction_hours``,
``budget_window``, ``priority``)::

    admins = ["admin"]

    [quota.default]              # everyone not covered by a course or a user entry
    max_leases = 1

    [courses.ml101]
    description = "Machine learning 101"
    instructors = ["instructor"]
    members = ["student01", "student02"]
    quota = { max_fraction = 0.1, max_leases = 2 }

    [quota.users.student01]      # one person's override (wins over the course)
    max_leases = 4

    [[courses.ml101.sessions]]   # class sessions: the course's reserved GPU share
    days = ["tue", "thu"]        # or date = 2026-12-01 (a one-off: an exam, a make-up lab)
    start = "10:00"
    end = "11:30"
    tz = "Europe/Paris"          # an IANA time zone (default UTC)
    seats = 40                   # seats x kernel_fraction (default: the course's
    kernel_fraction = 0.02       #   max_lease_fraction), or share = 0.25 of the pool
    nodes = ["gpu-a"]            # optional: only these nodes' GPUs (or gpus = [UUID, ...])

Sessions are checked at load (:func:`check_sessions`): a share beyond its GPUs, or
sessions of several courses at once beyond theirs, is refused with a sentence naming them
and by how much.

Parsing is pure (:func:`parse_courses` takes the decoded TOML); :func:`load_courses`
reads the file. Errors are :class:`CoursesFileError` naming the file and the table.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CoursesFileError, GPULeaseError
from ..model import GPU, Quota
from .rules.policy import Policy
from .rules.sessions import DAYS, SessionPlan, overbooked, timetable, zone_of
from .web.validation import parse_fraction, parse_quota

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+\-]{0,254}$")


@dataclass
class Course:
    """One course: a JupyterHub group with members, instructors and a quota."""

    name: str
    description: str = ""
    members: list[str] = field(default_factory=list)
    instructors: list[str] = field(default_factory=list)
    quota: Quota | None = None
    #: its class sessions (recurring and dated), each reserving a share of the GPUs
    sessions: list[SessionPlan] = field(default_factory=list)

    @property
    def everyone(self) -> list[str]:
        """Members and instructors (instructors belong to their course's group)."""
        return sorted(set(self.members) | set(self.instructors))


@dataclass
class Courses:
    """The decoded courses file."""

    admins: list[str] = field(default_factory=list)
    courses: dict[str, Course] = field(default_factory=dict)
    default_quota: Quota | None = None
    user_quotas: dict[str, Quota] = field(default_factory=dict)

    def quota_entries(self) -> list[tuple[str, str, Quota]]:
        """``(level, name, quota)`` for every quota the file names, default first."""
        out: list[tuple[str, str, Quota]] = []
        if self.default_quota is not None:
            out.append(("default", "", self.default_quota))
        out += [("group", c.name, c.quota) for c in self.courses.values() if c.quota is not None]
        out += [("user", name, q) for name, q in sorted(self.user_quotas.items())]
        return out

    def hub_groups(self) -> dict[str, dict[str, Any]]:
        """The courses as ``c.JupyterHub.load_groups`` wants them."""
        return {
            c.name: {
                "users": c.everyone,
                "properties": {"description": c.description, "instructors": c.instructors},
            }
            for c in self.courses.values()
        }

    def session_plans(self) -> list[SessionPlan]:
        return [p for c in self.courses.values() for p in c.sessions]

    def instructors(self) -> list[str]:
        return sorted({name for c in self.courses.values() for name in c.instructors})

    def users(self) -> list[str]:
        """Everyone the file names (admins, members, instructors, quota overrides)."""
        names = set(self.admins) | set(self.user_quotas)
        for c in self.courses.values():
            names |= set(c.everyone)
        return sorted(names)


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise CoursesFileError(f"{where} must be a list of user names.")
    for name in value:
        if not isinstance(name, str) or not _NAME.match(name):
            raise CoursesFileError(
                f"{where} holds {name!r}, which is not a valid user name "
                "(letters, digits, '.', '_', '@', '+', '-')."
            )
    return list(dict.fromkeys(value))


def _quota(value: Any, where: str) -> Quota:
    if not isinstance(value, Mapping):
        raise CoursesFileError(f"{where} must be a table of quota fields.")
    try:
        return parse_quota(dict(value))
    except GPULeaseError as exc:
        raise CoursesFileError(f"{where}: {exc.message}") from exc


def _check_keys(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise CoursesFileError(
            f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed are {', '.join(sorted(allowed))}."
        )


def parse_courses(data: Mapping[str, Any], source: str = "the courses file") -> Courses:
    """The decoded TOML document -> :class:`Courses`; raises :class:`CoursesFileError`."""
    _check_keys(data, {"admins", "courses", "quota"}, source)
    out = Courses(admins=_names(data.get("admins", []), f"'admins' in {source}"))
    courses = data.get("courses", {})
    if not isinstance(courses, Mapping):
        raise CoursesFileError(f"'courses' in {source} must be tables [courses.NAME].")
    for name, table in courses.items():
        where = f"[courses.{name}] in {source}"
        if not _NAME.match(name):
            raise CoursesFileError(f"{where}: {name!r} is not a valid group name.")
        if not isinstance(table, Mapping):
            raise CoursesFileError(f"{where} must be a table.")
        _check_keys(table, {"description", "members", "instructors", "quota", "sessions"}, where)
        description = table.get("description", "")
        if not isinstance(description, str):
            raise CoursesFileError(f"'description' of {where} must be a string.")
        out.courses[name] = Course(
            name=name,
            description=description,
            members=_names(table.get("members", []), f"'members' of {where}"),
            instructors=_names(table.get("instructors", []), f"'instructors' of {where}"),
            quota=_quota(table["quota"], f"the quota of {where}") if "quota" in table else None,
        )
        course = out.courses[name]
        plans = table.get("sessions", [])
        if not isinstance(plans, list):
            raise CoursesFileError(
                f"'sessions' of {where} must be tables [[courses.{name}.sessions]]."
            )
        course.sessions = [
            _session(course, plan, f"session {i} of {where}") for i, plan in enumerate(plans, 1)
        ]
    quota = data.get("quota", {})
    if not isinstance(quota, Mapping):
        raise CoursesFileError(f"'quota' in {source} must be a table.")
    _check_keys(quota, {"default", "users"}, f"[quota] in {source}")
    if "default" in quota:
        out.default_quota = _quota(quota["default"], f"[quota.default] in {source}")
    users = quota.get("users", {})
    if not isinstance(users, Mapping):
        raise CoursesFileError(f"[quota.users] in {source} must be tables [quota.users.NAME].")
    for name, table in users.items():
        _names([name], f"[quota.users] in {source}")
        out.user_quotas[name] = _quota(table, f"[quota.users.{name}] in {source}")
    return out


_SESSION_KEYS = {
    "days",
    "date",
    "start",
    "end",
    "tz",
    "share",
    "seats",
    "kernel_fraction",
    "gpus",
    "nodes",
}


def _clock(value: Any, key: str, where: str) -> dt.time:
    if isinstance(value, dt.time):
        return value
    if isinstance(value, str) and re.fullmatch(r"\d{1,2}:\d{2}", value):
        hour, minute = map(int, value.split(":"))
        if hour < 24 and minute < 60:
            return dt.time(hour, minute)
    raise CoursesFileError(f"'{key}' of {where} must be a time such as \"10:00\", not {value!r}.")


def _session(course: Course, table: Any, where: str) -> SessionPlan:
    """One ``[[courses.NAME.sessions]]`` table -> :class:`SessionPlan` (every refusal says
    what to write instead)."""
    if not isinstance(table, Mapping):
        raise CoursesFileError(f"{where} must be a table.")
    _check_keys(table, _SESSION_KEYS, where)
    for key in ("start", "end"):
        if key not in table:
            raise CoursesFileError(f"{where} has no '{key}' (a time such as \"10:00\").")
    start = _clock(table["start"], "start", where)
    end = _clock(table["end"], "end", where)
    if start == end:
        raise CoursesFileError(f"{where} starts and ends at {start:%H:%M}: give it a length.")
    tz = table.get("tz", "UTC")
    try:
        zone_of(tz if isinstance(tz, str) else repr(tz))
    except ValueError as exc:
        raise CoursesFileError(f"'tz' of {where}: {exc}") from exc
    days: tuple[int, ...] = ()
    date = table.get("date")
    if ("days" in table) == (date is not None):
        raise CoursesFileError(
            f"{where} needs either 'days' (e.g. [\"tue\", \"thu\"]) or 'date' (e.g. 2026-12-01)."
        )
    if "days" in table:
        raw = table["days"]
        if (
            not isinstance(raw, list)
            or not raw
            or not all(isinstance(d, str) and d[:3].lower() in DAYS for d in raw)
        ):
            raise CoursesFileError(
                f'\'days\' of {where} must be a list of week days such as ["tue", "thu"].'
            )
        days = tuple(sorted({DAYS.index(d[:3].lower()) for d in raw}))
    elif isinstance(date, str):
        try:
            date = dt.date.fromisoformat(date)
        except ValueError as exc:
            raise CoursesFileError(f"'date' of {where} must be a date such as 2026-12-01.") from exc
    if date is not None and (not isinstance(date, dt.date) or isinstance(date, dt.datetime)):
        raise CoursesFileError(f"'date' of {where} must be a date such as 2026-12-01.")
    pool_fraction, share_ppm = _share(course, table, where)
    scope: dict[str, tuple[str, ...] | None] = {}
    for key in ("gpus", "nodes"):
        value = table.get(key)
        if value is not None and (
            not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value)
        ):
            raise CoursesFileError(f"'{key}' of {where} must be a list of names.")
        scope[key] = tuple(value) if value is not None else None
    return SessionPlan(
        course=course.name,
        start=start,
        end=end,
        tz=tz,
        days=days,
        date=date,
        pool_fraction=pool_fraction,
        share_ppm=share_ppm,
        gpu_uuids=scope["gpus"],
        nodes=scope["nodes"],
    )


def _share(course: Course, table: Mapping[str, Any], where: str) -> tuple[float | None, int | None]:
    """``share`` (of the pool) or ``seats`` × ``kernel_fraction`` (GPU-ppm)."""
    if ("share" in table) == ("seats" in table):
        raise CoursesFileError(
            f"{where} needs either 'share' (a fraction of the pool, e.g. 0.25) or 'seats' "
            "(e.g. 40, each of kernel_fraction)."
        )
    try:
        if "share" in table:
            return parse_fraction(table["share"], "share") / 1e6, None
        seats = table["seats"]
        if not isinstance(seats, int) or isinstance(seats, bool) or not 0 < seats <= 100_000:
            raise CoursesFileError(f"'seats' of {where} must be a whole number such as 40.")
        if "kernel_fraction" in table:
            each = parse_fraction(table["kernel_fraction"], "kernel_fraction")
        elif course.quota is not None and course.quota.max_lease_fraction_ppm:
            each = course.quota.max_lease_fraction_ppm
        else:
            raise CoursesFileError(
                f"{where} gives 'seats' but no 'kernel_fraction', and the course's quota has no "
                "max_lease_fraction: add kernel_fraction = 0.02 (each seat's GPU fraction)."
            )
        return None, seats * each
    except GPULeaseError as exc:
        if isinstance(exc, CoursesFileError):
            raise
        raise CoursesFileError(f"{where}: {exc.message}") from exc


#: how far ahead the timetable is checked at load (a year: every week of it, DST too)
CHECK_AHEAD = 366 * 86400.0


def check_sessions(
    courses: Courses,
    gpus: list[GPU] | None,
    policy: Policy | None = None,
    now: float | None = None,
    source: str = "the courses file",
) -> None:
    """Refuse a timetable that reserves more than there is (:func:`~.rules.sessions.overbooked`)
    over the next year: one session beyond its GPUs, or several courses' at once beyond
    theirs. ``gpus``: the pool when it is declared (None: only node agents bring it; then
    only shares of the whole pool can be summed)."""
    plans = courses.session_plans()
    if not plans:
        return
    now = time.time() if now is None else now
    found = overbooked(timetable(plans, now, now + CHECK_AHEAD), gpus or None, policy or Policy())
    problems = list(dict.fromkeys(found))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CoursesFileError(
            f"The class sessions of {source} reserve more GPU than there is: "
            f"{' '.join(problems[:3])}{more} Make the shares smaller, move a session, or "
            "limit it to other GPUs (gpus = [...], nodes = [...])."
        )


def load_courses(path: str) -> Courses:
    """Read and parse the courses file at ``path``."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as exc:
        raise CoursesFileError(
            f"The courses file {path!r} does not exist; create it (see hub_config/courses.toml) "
            "or give another path with --quotas-file."
        ) from exc
    except OSError as exc:
        raise CoursesFileError(f"Cannot read the courses file {path!r}: {exc}.") from exc
    except tomllib.TOMLDecodeError as exc:
        raise CoursesFileError(f"The courses file {path!r} is not valid TOML: {exc}.") from exc
    return parse_courses(data, f"the courses file {path!r}")


__all__ = [
    "Course",
    "Courses",
    "CoursesFileError",
    "check_sessions",
    "load_courses",
    "parse_courses",
]
