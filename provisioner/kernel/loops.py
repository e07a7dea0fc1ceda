"""Which event loop runs a provisioner's own tasks, and stopping a task on any loop.

jupyter_client's ``AsyncKernelManager`` (jupyter_server, nbclient) is driven by one event
loop that keeps running, so the provisioner's renewals run there. Its blocking
``KernelManager`` runs a loop only *during* each call, and picks it per call (the
thread's own, or a runner thread's when a loop is already running in the thread): a
renewal task left on such a loop would sleep between calls while the lease expires, or
never run again. :func:`renewal_loop` says where renewals run; for a blocking manager it
is :class:`BackgroundLoop`, one daemon thread per process whose loop always runs.
:func:`cancel_and_wait` stops a task whichever loop it belongs to.

Two rules keep a kernel's shutdown from stalling or breaking in a forked child:

- *Never wait on a loop that may be blocked on us.* jupyter_server's synchronous
  ``MappingKernelManager`` runs each call on a runner loop, and a call inside it on a
  nested runner loop in another thread, while the outer loop blocks on that very call
  (``jupyter_core.utils.run_sync``): the outer loop still says ``is_running()`` but runs
  nothing until we return. So work for another thread's loop is only *handed* to it
  (``call_soon_threadsafe``), and waited for only where that loop is one of ours
  (:func:`is_free`): a :class:`BackgroundLoop` never waits on anybody.
- *A forked child starts without the loop.* ``fork`` copies the loop object but not
  its thread (``ProcessPoolExecutor``, ``multiprocessing``): the child forgets it
  (``os.register_at_fork``) and starts a thread of its own on first use; the parent's
  loop object is kept, never used nor closed there (its descriptors are the parent's).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import weakref
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
        #: loops of the parent process, kept in a forked child (see the module docstring)
        self._inherited: list[asyncio.AbstractEventLoop] = []
        os.register_at_fork(after_in_child=self._forget_after_fork)

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (its thread is started by the first call in this process)."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._run, args=(loop,), name=self.name, daemon=True
                )
                thread.start()
                atexit.register(self._stop, loop, os.getpid())
                _FREE_LOOPS.add(loop)
                self._loop = loop
            return self._loop

    def _forget_after_fork(self) -> None:
        """In a forked child: the loop's thread was not copied, so start anew on next use."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        if self._loop is not None:
            self._inherited.append(self._loop)  # never collected: closing it is the parent's
            _FREE_LOOPS.discard(self._loop)
        self._loop = None

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
    def _stop(loop: asyncio.AbstractEventLoop, pid: int) -> None:
        if os.getpid() != pid:  # a forked child's exit: the loop is its parent's
            return
        with contextlib.suppress(RuntimeError):  # closed already
            loop.call_soon_threadsafe(loop.stop)


#: the loops of :class:`BackgroundLoop` threads in this process: they never block on a caller
_FREE_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def is_free(loop: asyncio.AbstractEventLoop) -> bool:
    """``loop`` runs in one of our :class:`BackgroundLoop` threads, so waiting on it is safe.

    Any other thread's loop may be blocked on the very call that would wait on it
    (jupyter_core's runner loops, see the module docstring), though it says ``is_running()``.
    """
    return loop in _FREE_LOOPS and loop.is_running()


#: runs the renewals of kernels whose manager is jupyter_client's blocking ``KernelManager``
RENEWALS = BackgroundLoop("gpu-lease-renewals")


def renewal_loop(manager: Any) -> BackgroundLoop | None:
    """Where the renewals of a kernel managed by ``manager`` run: :data:`RENEWALS` for a
    blocking ``KernelManager``, ``None`` (the running loop) for an async one or none."""
    if isinstance(manager, KernelManager) and not isinstance(manager, AsyncKernelManager):
        return RENEWALS
    return None


async def cancel_and_wait(task: asyncio.Task[Any], timeout: float = 10.0) -> None:
    """Cancel ``task`` and wait until it has stopped, where waiting is safe.

    A task of the running loop is cancelled and awaited; one of a :class:`BackgroundLoop`
    is cancelled there and waited for (at most ``timeout`` seconds). Any other loop is only
    told to cancel it (it runs the cancellation when it runs next): it may be blocked on
    this very call (see the module docstring). One of a closed loop can never run again.
    """
    loop = task.get_loop()
    if loop is asyncio.get_running_loop():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    elif is_free(loop):
        there = asyncio.run_coroutine_threadsafe(cancel_and_wait(task, timeout), loop)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(there), timeout)
    else:
        with contextlib.suppress(RuntimeError):  # closed
            loop.call_soon_threadsafe(task.cancel)


async def wait_done(future: asyncio.Future[Any], timeout: float = 10.0) -> None:
    """Wait until ``future`` (of any loop) is done, where waiting is safe (as
    :func:`cancel_and_wait`): at once on a loop that may be blocked on us. Never raises."""
    loop = future.get_loop()
    with contextlib.suppress(Exception):  # timed out
        if loop is asyncio.get_running_loop():
            await asyncio.wait_for(asyncio.shield(future), timeout)
        elif is_free(loop):

            async def done() -> None:
                await asyncio.wait({future})

            there = asyncio.run_coroutine_threadsafe(done(), loop)
            await asyncio.wait_for(asyncio.wrap_future(there), timeout)


__all__ = ["RENEWALS", "BackgroundLoop", "cancel_and_wait", "is_free", "renewal_loop", "wait_done"]
