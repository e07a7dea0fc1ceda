"""A client's class-session calls: ``client.sessions`` of a
:class:`~provisioner.client.BrokerClient`.

The CLI's ``gpu-lease session list|start|extend|end COURSE`` and ``gpu-lease top``'s
timetable. Each call goes through the client's core (:meth:`BrokerClient.send`).
"""

from __future__ import annotations

from typing import Any

from .calls import Core, segment


class SessionCalls:
    """``/api/v1/sessions`` over ``client``'s core."""

    def __init__(self, client: Core) -> None:
        self._client = client

    async def listing(self, course: str | None = None) -> dict[str, Any]:
        """``GET /api/v1/sessions[?course=]``: ``{"sessions": [...], "now": T}``."""
        params = {"course": course} if course else None
        return self._client.json_object(await self._client.send("GET", "/sessions", params=params))

    async def start(self, course: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /api/v1/sessions/{course}``: ``{"until", "seats" | "share", ...}``."""
        path = f"/sessions/{segment(course)}"
        return self._client.json_object(await self._client.send("POST", path, body=body))

    async def extend(self, course: str, until: float) -> dict[str, Any]:
        """``PATCH /api/v1/sessions/{course}``: the session under way ends at ``until``."""
        path = f"/sessions/{segment(course)}"
        body = {"until": until}
        return self._client.json_object(await self._client.send("PATCH", path, body=body))

    async def end(self, course: str) -> dict[str, Any]:
        """``DELETE /api/v1/sessions/{course}``: end the session under way now."""
        path = f"/sessions/{segment(course)}"
        return self._client.json_object(await self._client.send("DELETE", path))


__all__ = ["SessionCalls"]
