"""jupyter_server's kernel manager, with refused kernel starts forgotten.

Use it in a single-user server (``hub_config/jupyterhub_config.py`` passes it)::

    c.ServerApp.kernel_manager_class = "provisioner.kernel.server.GPULeaseKernelManager"

Why: when a kernel's start fails -- and a GPU kernel's start fails whenever the broker
refuses (quota, course membership, queue timeout) -- jupyter_client's
``MultiKernelManager`` leaves the kernel's id in ``_pending_kernels`` (its
``_add_kernel_when_ready`` logs the error but never pops it). At server shutdown
``shutdown_all`` then asks jupyter_server to shut that id down, which raises
"Kernel does not exist" (404) from ``_check_kernel_id``; ``ServerApp._stop`` dies with
the exception and the server never exits, until JupyterHub's spawner SIGKILLs it after
``term_timeout``. This manager drops such finished-and-failed entries before shutting
everything down (and after each failed start), so the server stops in seconds.

It also pays the GPU provisioner's one-time costs when the server starts
(:func:`warm_up`), not inside a student's first GPU kernel start, and introduces the
server's token to the broker then (:func:`introduce`), so the broker's question to
JupyterHub ("whose token is this?") is answered and cached before the first acquire.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

log = logging.getLogger(__name__)


def warm_up() -> None:
    """Import the provisioner and build the first HTTP client's state now.

    Called once per server process, when jupyter_server creates its kernel manager.
    Importing the provisioner (httpx, the client) and building the first ``BrokerClient``
    (a verifying SSL context with the CA bundle, httpx's lazy set-up) cost ~0.15-0.3 s of
    CPU, once, inside the server's first GPU kernel start. That is nothing for one kernel,
    but in a classroom burst (100 processes on 2 cores) each CPU second stretches into
    many wall seconds, all on the GPU kernels' critical path.
    """
    import httpx

    from ..client.http import _ssl_context
    from . import provisioner  # noqa: F401  (the entry point jupyter_client loads later)

    httpx.AsyncClient(verify=_ssl_context())  # opens nothing; only its one-time set-up


def introduce() -> threading.Thread | None:
    """Ask the broker for this server's quota once, in the background, at server start.

    The broker identifies a hub token by asking JupyterHub, once per token per
    ``--hub-cache-max-age`` (300 s); without this, that round trip through the hub sits
    inside the first GPU kernel start, when a whole class starting at once keeps the hub
    busy. The answer itself is not needed: failures (no broker yet, a refused token) are
    logged at debug level and change nothing. Returns the thread (tests join it).
    """
    from ..client import BrokerClient, broker_env

    url, token = broker_env()
    if not url or not token:
        return None

    def hello() -> None:
        from ..errors import GPULeaseError

        async def ask() -> None:
            async with BrokerClient.from_env(retries=0) as client:
                await client.quotas.mine()

        try:
            asyncio.run(ask())
            log.debug("GPU lease broker at %s knows this server's token", url)
        except GPULeaseError as exc:
            log.debug("GPU lease broker at %s did not take the introduction: %s", url, exc.code)

    thread = threading.Thread(target=hello, name="gpu-lease-introduce", daemon=True)
    thread.start()
    return thread


class GPULeaseKernelManager(AsyncMappingKernelManager):
    """``AsyncMappingKernelManager`` that forgets kernels whose start failed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        warm_up()
        introduce()

    def _forget_failed_starts(self) -> None:
        # MultiKernelManager._add_kernel_when_ready() logs a failed start but leaves its
        # entry in the private _pending_kernels, which _async_shutdown_all() then shuts
        # down (https://github.com/jupyter/jupyter_client/blob/main/jupyter_client/multikernelmanager.py,
        # _add_kernel_when_ready and _async_shutdown_all; on shutting down kernels that
        # never finished starting: https://github.com/jupyter/jupyter_client/issues/616).
        for kernel_id, task in list(self._pending_kernels.items()):
            if task.done() and kernel_id not in self._kernels:
                self._pending_kernels.pop(kernel_id, None)

    async def _async_start_kernel(self, **kwargs: Any) -> str:
        """``POST /api/kernels`` and ``/api/sessions``: start, or forget the failed start."""
        try:
            return str(await super()._async_start_kernel(**kwargs))
        except Exception:
            self._forget_failed_starts()
            raise

    # AsyncMultiKernelManager binds the public name to the coroutine once, at class
    # creation (``start_kernel = MultiKernelManager._async_start_kernel``), so an override
    # of the _async_ twin must rebind it too (same for shutdown_all below); see
    # https://github.com/jupyter/jupyter_client/issues/755 on the sync/async twins.
    start_kernel = _async_start_kernel  # type: ignore[assignment]

    async def _async_shutdown_all(self, now: bool = False) -> None:
        """Called by ``ServerApp.cleanup_kernels`` when the server stops."""
        self._forget_failed_starts()
        await super()._async_shutdown_all(now=now)

    shutdown_all = _async_shutdown_all  # type: ignore[assignment]


__all__ = ["GPULeaseKernelManager"]
