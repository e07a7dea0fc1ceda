"""Which GPU kernels a user's launcher offers: only those the broker would let them start.

Use it in a single-user server (``hub_config/jupyterhub_config.py`` passes it)::

    c.ServerApp.kernel_spec_manager_class = "provisioner.kernel.offered.GPULeaseKernelSpecManager"

Why: every student sees every installed kernelspec, so an ml101 student was offered
"Python 3 (GPU 0.1)" ... "(GPU 1)", which their course quota (``max_lease_fraction =
0.05``) can never start, and an outsider the course's own kernel. This manager asks the
broker once for the server's user's effective quota (``GET /api/v1/quotas/me``, cached
``quota_cache_seconds``) and leaves out of the kernelspec list (``GET /api/kernelspecs``,
which JupyterLab's launcher and kernel picker show) every GPU kernelspec the user can
*never* start (:func:`never_startable`): a course kernel of a course they are not in (an
admin is in every course), a fraction above their per-kernel or total limit, or a quota
of no kernels or no budget at all. Kernels that cannot start *now* (the GPUs are full,
the user already holds their kernels, the budget is used up for the week) stay offered:
that changes by itself. ``unavailable = "mark"`` keeps them listed with the reason in
their display name instead; admins always get that (they see every kernelspec).

Starting a kernel by name (``POST /api/kernels``, an old notebook's kernel) is not
filtered: the broker still refuses with its own sentence. When the broker cannot be
asked, everything is offered (and the broker refuses what it refuses).
"""

from __future__ import annotations

__all__ = ["GPULeaseKernelSpecManager", "never_startable", "offered", "quota_from_json"]

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from traitlets import Enum, Float

from ..errors import GPULeaseError, InvalidRequest
from ..model import Quota, never_allowed, validate_fraction
from ..wire import fraction_to_ppm, may_use_course
from .kernelspecs import gpu_config

#: what each reason of :func:`model.never_allowed` says in a marked display name
_WHY = {
    "max_leases": "your quota allows no GPU kernels",
    "max_fraction": "above your GPU limit",
    "max_lease_fraction": "above your per-kernel limit",
    "budget_fraction_hours": "your quota allows no GPU time",
}


def quota_from_json(body: Mapping[str, Any]) -> Quota:
    """A ``Quota`` from the wire's effective quota (``GET /api/v1/quotas/me``'s ``effective``)."""

    def ppm(name: str) -> int | None:
        value = body.get(name)
        return fraction_to_ppm(float(value)) if isinstance(value, (int, float)) else None

    def number(name: str) -> Any:
        value = body.get(name)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return Quota(
        max_fraction_ppm=ppm("max_fraction"),
        max_leases=number("max_leases"),
        max_lease_fraction_ppm=ppm("max_lease_fraction"),
        budget_fraction_hours=number("budget_fraction_hours"),
        budget_window_s=number("budget_window"),
        priority=number("priority"),
    )


def never_startable(spec: Mapping[str, Any], me: Mapping[str, Any]) -> str | None:
    """Why the user of ``me`` (``GET /api/v1/quotas/me``) can never start kernel.json
    ``spec``, as a phrase for a display name, or None (it may start, or is no GPU kernel).

    The broker's own rules: the course check (``admission.check_course``) and the
    quota's per-kernel limits (``model.never_allowed``, which admission mirrors).
    """
    config = gpu_config(dict(spec))
    if config is None:
        return None
    group = config.get("group")
    members = me.get("groups") or []
    if isinstance(group, str) and not may_use_course(group, members, bool(me.get("admin"))):
        return f"for course {group} only"
    try:
        fraction = validate_fraction(config.get("fraction"))
    except InvalidRequest:
        return None  # the provisioner explains a broken kernel.json when it is started
    effective = me.get("effective")
    if not isinstance(effective, Mapping):
        return None
    why = never_allowed(quota_from_json(effective), fraction_to_ppm(fraction))
    return _WHY.get(why) if why else None


def offered(
    specs: dict[str, Any], me: Mapping[str, Any], unavailable: str = "hide"
) -> dict[str, Any]:
    """``get_all_specs()``'s dict without (``hide``) or with marked (``mark``) the GPU
    kernelspecs :func:`never_startable` rules out. An admin is shown every kernelspec
    (admins publish and support them all); those their own quota rules out are marked.
    Pure; the input is not changed."""
    if me.get("admin"):
        unavailable = "mark"
    out: dict[str, Any] = {}
    for name, entry in specs.items():
        spec = entry.get("spec") if isinstance(entry, Mapping) else None
        why = never_startable(spec, me) if isinstance(spec, Mapping) else None
        if why is None:
            out[name] = entry
        elif unavailable == "mark":
            shown = dict(spec)  # type: ignore[arg-type]
            shown["display_name"] = f"{spec.get('display_name') or name} (not for you: {why})"  # type: ignore[union-attr]
            out[name] = {**entry, "spec": shown}
    return out


class GPULeaseKernelSpecManager(KernelSpecManager):
    """``KernelSpecManager`` whose list leaves out GPU kernels the user can never start.

    ``get_all_specs`` is a coroutine here, as in jupyter_server's gateway manager:
    jupyter_server's ``GET /api/kernelspecs`` awaits it (``ensure_async``).
    """

    unavailable = Enum(
        ["hide", "mark"],
        default_value="hide",
        help="What the kernel list does with a GPU kernelspec the user can never start: "
        "'hide' leaves it out, 'mark' keeps it with the reason in its display name. "
        "Default: hide.",
    ).tag(config=True)

    quota_cache_seconds = Float(
        60.0,
        help="Seconds the user's quota from the broker is reused before it is asked again "
        "(a quota change shows in the launcher after at most this long). Default: 60.",
    ).tag(config=True)

    broker_timeout = Float(
        5.0,
        help="Seconds to wait for the broker's answer before offering every kernel. Default: 5.",
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._me: dict[str, Any] | None = None
        self._asked_at = float("-inf")
        self._lock: asyncio.Lock | None = None
        self._warned = False

    async def get_all_specs(self) -> dict[str, Any]:  # type: ignore[override]
        """Called by jupyter_server's ``GET /api/kernelspecs`` (the launcher, kernel picker)."""
        specs = super().get_all_specs()
        me = await self._my_quota()
        return specs if me is None else offered(specs, me, self.unavailable)

    async def why_not(self, name: str) -> dict[str, Any] | None:
        """Whether this user can ever start kernelspec ``name``, and if not why, in a
        sentence (``GET {base_url}gpu-lease/api/kernelspecs/{name}``: a notebook saved with
        a kernel the list leaves out). None if there is no such kernelspec."""
        entry = super().get_all_specs().get(name)
        spec = entry.get("spec") if isinstance(entry, Mapping) else None
        if not isinstance(spec, Mapping):
            return None
        shown = str(spec.get("display_name") or name)
        me = await self._my_quota()
        why = never_startable(spec, me) if me is not None else None
        out: dict[str, Any] = {"name": name, "display_name": shown, "startable": why is None}
        if why is not None:
            out["reason"] = why
            out["message"] = (
                f'This notebook was saved with the kernel "{shown}", which you cannot start: '
                f"{why}. Choose another kernel next (the launcher shows the GPU kernels you "
                "may start), or ask your instructor for this one."
            )
        return out

    async def _my_quota(self) -> dict[str, Any] | None:
        """The broker's ``/quotas/me`` for this server's token, cached; None if unavailable."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._asked_at < self.quota_cache_seconds:
                return self._me
            from ..client import BrokerClient

            try:
                async with BrokerClient.from_env(retries=0, timeout=self.broker_timeout) as client:
                    self._me = await asyncio.wait_for(client.quotas.mine(), self.broker_timeout)
                self._warned = False
            except (GPULeaseError, asyncio.TimeoutError) as exc:
                if not self._warned:
                    self.log.warning(
                        "GPU lease broker not asked which GPU kernels this user may start; "
                        "offering every kernel: %s",
                        getattr(exc, "message", None) or type(exc).__name__,
                    )
                    self._warned = True
                self._me = None
            self._asked_at = time.monotonic()
            return self._me


__all__ = ["GPULeaseKernelSpecManager", "never_startable", "offered", "quota_from_json"]
