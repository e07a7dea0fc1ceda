"""Quota admission: who may hold how much, and may this ask be admitted.

Pure like the rest of the core (plain data in, ``now`` never read). The one home of quota
precedence (:func:`quota_sources`: default -> group -> user), of the course check
(:func:`check_course`) and of the quota checks an acquire must pass (:func:`admit`), which
``scheduling.decide_acquire`` calls before it places or queues anything. The launcher's
filter for kernels a quota never allows (``model.never_allowed``) mirrors :func:`admit`.
:func:`fraction_hours` is the budget's arithmetic: fraction x hours over lease intervals.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import Forbidden, QuotaExceeded
from ...model import PoolState, Quota, QuotaBook
from ...wire import PPM, may_use_course, ppm_to_fraction
from .policy import Ask, Policy


@dataclass(frozen=True)
class EffectiveQuota:
    """A user's effective quota and, per field, the level that set it.

    ``sources`` maps each :attr:`Quota.FIELDS` name to ``"user"``, ``"group NAME"`` or
    ``"default"`` (also for a value the default leaves unset: unlimited).
    """

    quota: Quota
    sources: dict[str, str]


def quota_sources(book: QuotaBook, user: str, groups: Iterable[str]) -> EffectiveQuota:
    """default -> group -> user: a user's own value wins, else the most generous group's, else default.

    The one home of quota precedence: admission (:func:`effective_quota`), ``GET
    /api/v1/quotas/me`` and the admin's ``gpu-lease quota show --user NAME`` all call it.
    Groups are taken in name order, so of two groups with the same value the first
    name is the source.
    """
    mine = book.users.get(user)
    group_quotas = [(g, book.groups[g]) for g in sorted(groups) if g in book.groups]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in Quota.FIELDS:
        value = getattr(mine, name) if mine is not None else None
        source = "user"
        if value is None:
            best: tuple[str, Any] | None = None
            for group, q in group_quotas:
                v = getattr(q, name)
                if v is not None and (best is None or v > best[1]):
                    best = (group, v)
            if best is not None:
                value, source = best[1], f"group {best[0]}"
        if value is None:
            value, source = getattr(book.default, name), "default"
        values[name] = value
        sources[name] = source
    return EffectiveQuota(Quota(**values), sources)


def effective_quota(book: QuotaBook, user: str, groups: Iterable[str]) -> Quota:
    """The quota admission applies to ``user`` in ``groups`` (see :func:`quota_sources`)."""
    return quota_sources(book, user, groups).quota


def check_course(ask: Ask) -> None:
    """Course kernelspecs carry ``group``: only its members (and admins) may use them."""
    if not may_use_course(ask.group, ask.groups, ask.admin):
        raise Forbidden(
            f"This kernel is reserved for course {ask.group!r}, and you are not a member of it. "
            "Ask your instructor to add you to the course, or choose another kernel.",
            group=ask.group,
        )


def admit(
    state: PoolState,
    ask: Ask,
    quota: Quota,
    used_fraction_hours: float = 0.0,
    policy: Policy | None = None,
) -> None:
    """Raise ``QuotaExceeded`` (403) with the reason if the ask would exceed ``quota``.

    Waiting requests of the user count as held, so one user cannot fill the queue;
    a resume request does not (its parked lease already counts: parked leases count
    for their user's quotas).
    """
    fraction = ppm_to_fraction(ask.fraction_ppm)
    waiting = [r for r in state.queue.values() if r.user == ask.user and r.resume_of is None]
    held = state.held_by_user.get(ask.user, 0) + sum(r.fraction_ppm for r in waiting)
    count = state.leases_by_user.get(ask.user, 0) + len(waiting)
    for field_name, value in (
        ("max_leases", quota.max_leases),
        ("max_fraction", quota.max_fraction_ppm),
        ("max_lease_fraction", quota.max_lease_fraction_ppm),
    ):
        if value is not None and value <= 0:
            raise QuotaExceeded(
                f"Your quota allows no GPU kernels (its {field_name} is 0), so no GPU kernel "
                "can start. Choose a kernel without a GPU, or ask your instructor or "
                "administrator for a GPU quota.",
                quota=field_name,
                limit=0,
            )
    if quota.max_lease_fraction_ppm is not None and ask.fraction_ppm > quota.max_lease_fraction_ppm:
        limit = ppm_to_fraction(quota.max_lease_fraction_ppm)
        raise QuotaExceeded(
            f"A GPU fraction of {fraction:g} is above your per-kernel limit of {limit:g}. "
            f"Choose a kernel with a GPU fraction of at most {limit:g}.",
            quota="max_lease_fraction",
            limit=limit,
        )
    if quota.max_fraction_ppm is not None and ask.fraction_ppm > quota.max_fraction_ppm:
        limit = ppm_to_fraction(quota.max_fraction_ppm)
        raise QuotaExceeded(
            f"A GPU fraction of {fraction:g} is above your limit of {limit:g} of a GPU held "
            f"at once. Choose a kernel with a GPU fraction of at most {limit:g}.",
            quota="max_fraction",
            limit=limit,
        )
    if quota.max_leases is not None and count + 1 > quota.max_leases:
        raise QuotaExceeded(
            f"You already hold or wait for {_kernels(count)}, the most your quota allows "
            f"({quota.max_leases}). Shut down a GPU kernel you no longer use and try again.",
            quota="max_leases",
            limit=quota.max_leases,
        )
    if quota.max_fraction_ppm is not None and held + ask.fraction_ppm > quota.max_fraction_ppm:
        limit = ppm_to_fraction(quota.max_fraction_ppm)
        raise QuotaExceeded(
            f"This kernel would bring your GPU share to {ppm_to_fraction(held + ask.fraction_ppm):g}, "
            f"above your limit of {limit:g} at once; you hold or wait for "
            f"{ppm_to_fraction(held):g} in {_kernels(count)}. Shut down a GPU kernel you no "
            "longer use and try again.",
            quota="max_fraction",
            limit=limit,
        )
    if quota.budget_fraction_hours is not None and quota.budget_fraction_hours <= 0:
        raise QuotaExceeded(
            "Your quota allows no GPU time (a budget of 0 fraction-hours), so no GPU kernel "
            "can start. Choose a kernel without a GPU, or ask your instructor or "
            "administrator for a GPU budget.",
            quota="budget_fraction_hours",
            limit=quota.budget_fraction_hours,
            used=round(used_fraction_hours, 6),
        )
    if (
        quota.budget_fraction_hours is not None
        and used_fraction_hours >= quota.budget_fraction_hours
    ):
        window_h = (quota.budget_window_s or 0) / 3600
        raise QuotaExceeded(
            f"You have used {used_fraction_hours:.2f} of your {quota.budget_fraction_hours:g} "
            f"GPU fraction-hours for the last {window_h:g} hours. Try again later or ask "
            "your instructor for a larger budget.",
            quota="budget_fraction_hours",
            limit=quota.budget_fraction_hours,
            used=round(used_fraction_hours, 6),
        )
    if policy is not None and len(waiting) >= policy.max_queued_per_user:
        raise QuotaExceeded(
            f"You already have {len(waiting)} GPU kernels waiting in the queue, the most allowed. "
            "Wait for them to start, or shut them down.",
            quota="max_queued",
            limit=policy.max_queued_per_user,
        )


def _kernels(count: int) -> str:
    """1 -> "1 GPU kernel", 2 -> "2 GPU kernels"."""
    return f"{count} GPU kernel" + ("" if count == 1 else "s")


# -- budgets ----------------------------------------------------------------------


def fraction_hours(
    intervals: Iterable[tuple[int, float, float | None]], since: float, until: float
) -> float:
    """Sum of fraction x hours over ``(ppm, start, end-or-None)`` clipped to ``[since, until]``."""
    total = 0.0
    for ppm, start, end in intervals:
        lo = max(start, since)
        hi = min(end if end is not None else until, until)
        if hi > lo:
            total += ppm * (hi - lo)
    return total / PPM / 3600.0
