"""Quotas and usage: read, set and remove quotas; the fraction-hours each user used.

Who calls this: the HTTP handlers (``service.quotas.put_quota(...)``), and ``app.py``
for a quotas file (:meth:`QuotaService.apply_quotas`). The quota book lives in the
shared :class:`~provisioner.broker.services.service_core.ServiceCore` (``book``): every acquire's
admission reads it there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...errors import Forbidden, InvalidRequest, QuotaNotFound
from ...model import Identity, Quota, QuotaBook, quota_key_problem
from ..rules import admission
from .service_core import ServiceCore, require_admin

log = logging.getLogger("gpu_lease.broker")


#: how far back a user who is not an admin may ask for usage, at least (``since=0``
#: from any student scanned every lease ever recorded on the store's writer thread)
STUDENT_USAGE_REACH_S = 31 * 86400
#: ``since=31d`` was turned into a time a moment before the check: it still passes
REACH_SLACK_S = 60.0


@dataclass(frozen=True)
class QuotaStanding:
    """A user's effective quota with its sources, their own record and what they hold."""

    user: str
    groups: frozenset[str]
    effective: admission.EffectiveQuota
    own: Quota | None
    held_ppm: int
    leases: int


class QuotaService:
    """The quota book (default, group and user quotas) and usage over time."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def get_quota(self, ident: Identity, level: str, name: str = "") -> tuple[Quota, Quota | None]:
        """A quota record and, for a user's, the quota admission applies to them (for
        another user than the caller: without their groups). Users may read the default,
        their own and their groups' quotas."""
        self.core.check_serving()
        _check_level(level, name)
        if not ident.admin:
            if level == "user" and name != ident.user:
                raise Forbidden("You may read only your own quota.")
            if level == "group" and name not in ident.groups:
                raise Forbidden("You may read only the quotas of groups you belong to.")
        quota = self._quota_record(level, name)
        if quota is None:
            raise QuotaNotFound(f"No {level} quota is set for {name!r}.")
        if level != "user":
            return quota, None
        groups = ident.groups if name == ident.user else frozenset()
        return quota, admission.effective_quota(self.core.book, name, groups)

    def my_quota(self, ident: Identity) -> QuotaStanding:
        """The caller's effective quota (with each value's source) and what they hold now."""
        self.core.check_serving()
        return self._standing(ident.user, ident.groups)

    def _standing(self, user: str, groups: frozenset[str]) -> QuotaStanding:
        return QuotaStanding(
            user,
            groups,
            admission.quota_sources(self.core.book, user, groups),
            self.core.book.users.get(user),
            self.core.state.held_by_user.get(user, 0),
            self.core.state.leases_by_user.get(user, 0),
        )

    def check_may_read_quota_of(self, ident: Identity, user: str) -> str:
        """Admins may read anyone's effective quota; a user only their own (``user``)."""
        if user != ident.user and not ident.admin:
            raise Forbidden("You may read only your own quota.")
        return user

    def effective_quota_of(
        self, ident: Identity, user: str, groups: frozenset[str]
    ) -> QuotaStanding:
        """``GET /api/v1/quotas/users/{name}?effective=1``: the quota admission applies.

        Computed by :func:`admission.quota_sources`, the function every acquire's
        admission uses, for ``user`` in ``groups`` (the handler asks the authenticator).
        Its ``effective.sources`` names, per field, the level that set it (``default``,
        ``group NAME`` or ``user``); ``own`` is the user-level record (None when none).
        """
        self.core.check_serving()
        self.check_may_read_quota_of(ident, user)
        return self._standing(user, groups)

    def list_quotas(self, ident: Identity) -> QuotaBook:
        self.core.check_serving()
        require_admin(ident)
        return self.core.book

    async def put_quota(self, ident: Identity, level: str, name: str, quota: Quota) -> Quota:
        await self.core.ready()
        require_admin(ident)
        _check_level(level, name)
        key = name if level != "default" else ""
        await self.core.writer.call(lambda: self.core.store.put_quota(level, key, quota))
        self._set_quota(level, name, quota)
        log.info("Quota %s %r set by %s: %s", level, name, ident.user, quota.to_json())
        await self.core.grant_waiting()
        return quota

    def apply_quotas(self, entries: list[tuple[str, str, Quota]], source: str) -> int:
        """Set every ``(level, name, quota)`` of a quotas file, without an identity.

        Called by ``app.py`` (``--quotas-file``) after :meth:`start`, before listening, on
        every broker start: the file's entries replace what the API set for the same
        default/group/user; quotas the file does not name are left as they are.
        """
        for level, name, quota in entries:
            _check_level(level, name)
            name = name if level != "default" else ""
            self.core.store.put_quota(level, name, quota)
            self._set_quota(level, name, quota)
        log.info("Applied %d quota(s) from %s", len(entries), source)
        self.core.drain_before_serving(self.core.clock())
        return len(entries)

    async def delete_quota(self, ident: Identity, level: str, name: str = "") -> None:
        await self.core.ready()
        require_admin(ident)
        _check_level(level, name)
        key = name if level != "default" else ""
        await self.core.writer.call(lambda: self.core.store.delete_quota(level, key))
        if level == "default":
            self.core.book.default = Quota()
        elif level == "group":
            self.core.book.groups.pop(name, None)
        else:
            self.core.book.users.pop(name, None)
        log.info("Quota %s %r removed by %s", level, name, ident.user)

    async def usage(self, ident: Identity, since: float, by: str = "user") -> dict[str, float]:
        """Fraction-hours per user or group since ``since``; a student sees only their own."""
        await self.core.ready()
        if by not in ("user", "group"):
            raise InvalidRequest("'by' must be 'user' or 'group'.")
        now = self.core.clock()
        if since > now:
            raise InvalidRequest("'since' is in the future.")
        reach = self.student_reach()
        if not ident.admin and since < now - reach - REACH_SLACK_S:
            days = reach / 86400
            raise Forbidden(
                f"Your usage reaches back {days:g} days at most; ask for since={days:g}d or "
                "later, or ask a GPU lease admin for older usage.",
                max_since_s=reach,
            )
        if not ident.admin and by == "user":
            mine = await self.core.writer.call(
                lambda: self.core.store.user_usage(ident.user, since, now), read=True
            )
            return {ident.user: mine}
        rows = await self.core.writer.call(lambda: self.core.store.usage(since, now, by), read=True)
        if not ident.admin:
            rows = {k: v for k, v in rows.items() if k in ident.groups}
        return rows

    def student_reach(self) -> float:
        """How far back (seconds) a user who is not an admin may ask for usage: the longest
        budget window of any quota, at least :data:`STUDENT_USAGE_REACH_S` (each such
        question scans the leases of that window on the store's one writer thread)."""
        book = self.core.book
        windows = [q.budget_window_s or 0 for q in (book.default, *book.groups.values())]
        windows += [q.budget_window_s or 0 for q in book.users.values()]
        return float(max(STUDENT_USAGE_REACH_S, *windows))

    def _set_quota(self, level: str, name: str, quota: Quota) -> None:
        """Mirror a quota the store just recorded in the in-memory book."""
        if level == "default":
            self.core.book.default = quota
        elif level == "group":
            self.core.book.groups[name] = quota
        else:
            self.core.book.users[name] = quota

    def _quota_record(self, level: str, name: str) -> Quota | None:
        if level == "default":
            return self.core.book.default
        book = self.core.book.groups if level == "group" else self.core.book.users
        return book.get(name)


def _check_level(level: str, name: str) -> None:
    """The service ignores a name given with the default level (``model.quota_key_problem``)."""
    why = quota_key_problem(level, "" if level == "default" else name)
    if why:
        raise InvalidRequest(why)


__all__ = ["QuotaService", "QuotaStanding"]
