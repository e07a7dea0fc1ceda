"""A client's quota and usage calls: ``client.quotas`` of a
:class:`~provisioner.client.BrokerClient`.

The CLI's ``gpu-lease quota`` and ``usage`` (admin, or a user's own quota), and the
kernel side's ``mine`` (the launcher offers only the GPU kernels the user may start).
Each call goes through the client's core (:meth:`BrokerClient.send`).
"""

from __future__ import annotations

from typing import Any

from .. import errors
from ..model import QUOTA_LEVEL_PLURALS, quota_key_problem
from .calls import Core, segment


def quota_path(level: str, name: str | None) -> str:
    """The URL path of the quota at ``level`` (``default``, ``user(s)``, ``group(s)``) and
    ``name``; raises :class:`errors.InvalidRequest` for a pair that names no quota."""
    # a named level, in the singular ("user") or as in the URL ("users")
    singulars = {plural: one for one, plural in QUOTA_LEVEL_PLURALS.items()}
    level = singulars.get(level, level)
    why = quota_key_problem(level, name or "")
    if why:
        raise errors.InvalidRequest(why)
    if level == "default":
        return "/quotas/default"
    return f"/quotas/{QUOTA_LEVEL_PLURALS[level]}/{segment(name or '')}"


class QuotaCalls:
    """``/api/v1/quotas`` and ``/api/v1/usage`` over ``client``'s core."""

    def __init__(self, client: Core) -> None:
        self._client = client

    async def get(self, level: str, name: str | None = None) -> dict[str, Any]:
        """``GET /api/v1/quotas/default|users/{name}|groups/{name}``."""
        return self._client.json_object(await self._client.send("GET", quota_path(level, name)))

    async def book(self) -> dict[str, Any]:
        """``GET /api/v1/quotas``: ``{"default": {...}, "groups": {...}, "users": {...}}``."""
        return self._client.json_object(await self._client.send("GET", "/quotas"))

    async def put(self, level: str, name: str | None, quota: dict[str, Any]) -> dict[str, Any]:
        """``PUT`` a quota at ``level`` (``default``, ``user`` or ``group``); returns it as stored."""
        client = self._client
        return client.json_object(await client.send("PUT", quota_path(level, name), body=quota))

    async def delete(self, level: str, name: str | None) -> None:
        """``DELETE`` the quota at ``level``."""
        await self._client.send("DELETE", quota_path(level, name))

    async def effective(self, user: str) -> dict[str, Any]:
        """``GET /api/v1/quotas/users/{name}?effective=1``: ``user``'s effective quota as
        admission applies it, the source of each value and their own record (admin, or
        the user themself)."""
        client = self._client
        path = quota_path("user", user)
        return client.json_object(await client.send("GET", path, params={"effective": "1"}))

    async def mine(self) -> dict[str, Any]:
        """``GET /api/v1/quotas/me``: the caller's effective quota and what they hold now."""
        return self._client.json_object(await self._client.send("GET", "/quotas/me"))

    async def usage(self, *, since: float | str | None = None, by: str = "user") -> dict[str, Any]:
        """``GET /api/v1/usage?since=&by=``: fraction-hours used, per user or group."""
        params: dict[str, str] = {"by": by}
        if since is not None:
            params["since"] = str(since)
        return self._client.json_object(await self._client.send("GET", "/usage", params=params))


__all__ = ["QuotaCalls", "quota_path"]
