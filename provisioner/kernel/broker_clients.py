"""The provisioner's broker clients, made again when the URL or the token changes.

A provisioner talks to the broker for as long as its kernel lives, and JupyterHub
rotates a single-user server's token meanwhile: so the token is read again (through
:func:`provisioner.client.broker_env`, the one place that knows the variables) before
every call, and a client made with an older one is closed and replaced.

Two flavours: calls that must get through (acquire, release, taking an expired lease
back) retry ``ACQUIRE_RETRIES`` times with backoff, which rides out a broker restart;
renewals retry once, because the renewal loop itself is the retry and a long backoff
inside one renewal would only delay the warning.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..client import BrokerClient, broker_env
from ..errors import InvalidRequest

#: retries of one acquire or release call (backoff 0.5, 1, 2, 4, 8 s): rides out a broker restart
ACQUIRE_RETRIES = 5
#: retries of one renewal: the renewal loop is the retry
RENEW_RETRIES = 1


class BrokerClients:
    """Broker clients for one kernel; ``url`` gives the broker URL (the provisioner's trait)."""

    def __init__(self, url: Callable[[], str]) -> None:
        self._url = url
        self._clients: dict[bool, BrokerClient] = {}
        self._key: tuple[str, str | None] | None = None
        self._closing: set[asyncio.Task[Any]] = set()

    def get(self, *, renewal: bool = False) -> BrokerClient:
        """The client for a call (``renewal``: the one that retries once)."""
        url, token = self._url(), broker_env().token
        if self._key != (url, token):
            for old in self._clients.values():
                self._close_later(old)
            self._clients = {}
            self._key = (url, token)
        client = self._clients.get(renewal)
        if client is None:
            if not url:
                raise InvalidRequest(
                    "No GPU lease broker URL is set: set GPU_LEASE_URL in the Jupyter server's "
                    "environment (the hub admin can pass it with c.Spawner.environment), or "
                    "c.GPULeaseProvisioner.broker_url."
                )
            retries = RENEW_RETRIES if renewal else ACQUIRE_RETRIES
            # a connection per call: the calls are seconds apart, and each may run on
            # another event loop (jupyter_client's blocking API), where none may linger
            client = BrokerClient(url, token, retries=retries, keep_alive=False)
            self._clients[renewal] = client
        return client

    def new(self) -> BrokerClient:
        """A client of its own, for a call beside one in flight (``async with`` closes it):
        "Stop waiting" withdraws a request while its acquire is being cancelled."""
        url = self._url()
        if not url:
            return self.get()  # raises the same "No GPU lease broker URL" sentence
        return BrokerClient(url, broker_env().token, retries=ACQUIRE_RETRIES, keep_alive=False)

    async def aclose(self) -> None:
        """Close every client (the next :meth:`get` makes a new one)."""
        clients, self._clients, self._key = list(self._clients.values()), {}, None
        for client in clients:
            await client.aclose()

    def _close_later(self, client: BrokerClient) -> None:
        """Close a replaced client without waiting (``get`` is synchronous)."""
        task = asyncio.ensure_future(client.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


__all__ = ["ACQUIRE_RETRIES", "RENEW_RETRIES", "BrokerClients"]
