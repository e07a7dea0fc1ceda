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
"""

from __future__ import annotations

from typing import Any

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager


class GPULeaseKernelManager(AsyncMappingKernelManager):
    """``AsyncMappingKernelManager`` that forgets kernels whose start failed."""

    def _forget_failed_starts(self) -> None:
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

    start_kernel = _async_start_kernel  # type: ignore[assignment]

    async def _async_shutdown_all(self, now: bool = False) -> None:
        """Called by ``ServerApp.cleanup_kernels`` when the server stops."""
        self._forget_failed_starts()
        await super()._async_shutdown_all(now=now)

    shutdown_all = _async_shutdown_all  # type: ignore[assignment]


__all__ = ["GPULeaseKernelManager"]
