"""What the client's call groups (``client.leases``, ``client.quotas``, ``client.nodes``)
use of :class:`~provisioner.client.BrokerClient`'s core, and how an id becomes a path
segment. The groups type their client by :class:`Core`, so that they import nothing of
``http.py`` (which builds them) and the modules stay a ladder.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

import httpx


class Core(Protocol):
    """The transport core of a broker client (implemented by ``BrokerClient``)."""

    #: seconds each ordinary call may take; a long-poll reads for its wait on top
    timeout: float
    #: the first retry's pause (s); also the least pause between two queued long-polls
    backoff: float

    async def send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        read_timeout: float | None = None,
        retries: int | None = None,
    ) -> httpx.Response: ...

    def json_object(self, response: httpx.Response) -> dict[str, Any]: ...

    def json_list(self, response: httpx.Response, key: str) -> list[dict[str, Any]]: ...


def segment(value: str) -> str:
    """``value`` quoted as one URL path segment (a ``/`` in an id stays inside it)."""
    return quote(value, safe="")


__all__ = ["Core", "segment"]
