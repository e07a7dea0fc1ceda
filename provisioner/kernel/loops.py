"""Which event loop runs a provisioner's own tasks, and stopping a task on any loop.

jupyter_client's ``AsyncKernelManager`` (jupyter_server, nbclient) is driven by one event
loop that keeps running, so the provisioner's renewals run there. Its blocking
``KernelManager`` runs a loop only *during* each call, and picks it per call (the
thread's own, or a runner thread's when a loop is already running in the thread): a
renewal task left on such a loop would sleep between calls while the lease expires, or
never run again. :func:`renewal_loop` says where renewals run; for a blocking manager it
is :class:`BackgroundLoop`, one daemon thread per process whose loop always runs.
:func:`cancel_and_wait` stops a task whichever loop it belongs to.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from jupyter_client.manager import AsyncKernelManager, KernelManager

_T = TypeVar("_T")


class BackgroundLoop:
    """An event loop running for good in a daemon thread, started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (its thread is started by the first call)."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._run, args=(loop,), name=self.name, daemon=True
                )
                thread.start()
                atexit.register(self._stop, loop)
                self._loop = loop
            return self._loop

    def spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """``coro`` as a task of this loop (called from any thread or loop)."""
        loop = self.loop()
        with contextlib.suppress(RuntimeError):  # no loop runs here
            if asyncio.get_running_loop() is loop:
                return asyncio.ensure_future(coro)

        async def create() -> asyncio.Task[_T]:
            return asyncio.ensure_future(coro)

        return asyncio.run_coroutine_threadsafe(create(), loop).result(timeout=10)

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    @staticmethod
    def _stop(loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            loop.call_soon_threadsafe(loop.stop)


#: runs the renewals of kernels whose manager is jupyter_client's blocking ``KernelManager``
RENEWALS = BackgroundLoop("gpu-lease-renewals")


def renewal_loop(manager: Any) -> BackgroundLoop | None:
    """Where the renewals of a kernel managed by ``manager`` run: :data:`RENEWALS` for a
    blocking ``KernelManager``, ``None`` (the running loop) for an async one or none."""
    if isinstance(manager, KernelManager) and not isinstance(manager, AsyncKernelManager):
        return RENEWALS
    return None


async def cancel_and_wait(task: asyncio.Task[Any], timeout: float = 10.0) -> None:
    """Cancel ``task`` and wait until it has stopped, whichever event loop it runs on.

    A task of a loop running in another thread is cancelled there and waited for (at
    most ``timeout`` seconds); one of a loop that is not running now is cancelled when it
    next runs, and one of a closed loop can never run again.
    """
    loop = task.get_loop()
    if loop is asyncio.get_running_loop():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    elif loop.is_running():
        there = asyncio.run_coroutine_threadsafe(cancel_and_wait(task, timeout), loop)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(there), timeout)
    else:
        with contextlib.suppress(RuntimeError):  # closed
            loop.call_soon_threadsafe(task.cancel)


__all__ = ["RENEWALS", "BackgroundLoop", "cancel_and_wait", "renewal_loop"]
