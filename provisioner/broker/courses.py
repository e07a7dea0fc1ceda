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

Parsing is pure (:func:`parse_courses` takes the decoded TOML); :func:`load_courses`
reads the file. Errors are :class:`CoursesFileError` naming the file and the table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CoursesFileError, GPULeaseError
from ..model import Quota
from .web.validation import parse_quota

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
        _check_keys(table, {"description", "members", "instructors", "quota"}, where)
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


__all__ = ["Course", "Courses", "CoursesFileError", "load_courses", "parse_courses"]
