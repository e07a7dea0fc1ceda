"""Noticing that a kernel died for good, which jupyter_client never tells its provisioner.

jupyter_client calls ``cleanup(restart=False)`` only at the end of a shutdown somebody
asked for. When the kernel process dies on its own:

- with a restarter (``IOLoopKernelManager`` and jupyter_server's kernel managers, when
  ``autorestart`` is on), the restarter restarts it (the start sequence again, whose
  ``pre_launch`` gets the same lease back), or, past ``restart_limit``, fires its
  ``"dead"`` callbacks and stops; nothing else happens, ``cleanup`` included
  (``KernelRestarter.poll``:
  https://github.com/jupyter/jupyter_client/blob/main/jupyter_client/restarter.py).
  :meth:`DeathWatch.watch` registers such a callback;
- without one (a plain ``AsyncKernelManager``), nobody notices at all: the lease
  keeper's renewal loop asks :meth:`DeathWatch.exited_for_good` before each renewal.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

from jupyter_client.provisioning import LocalProvisioner


class DeathWatch:
    """Watches the kernel of ``provisioner``; calls ``on_death`` when it died for good."""

    def __init__(
        self, provisioner: LocalProvisioner, on_death: Callable[[], Awaitable[None]]
    ) -> None:
        self._provisioner = provisioner
        self._on_death = on_death
        self._restarting = False
        self._watching: Any = None  # the KernelManager holding our "dead" callback
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self) -> None:
        """Register the ``"dead"`` restart callback on the kernel's manager.

        Called after every start (and after ``load_provisioner_info``): the restarter
        exists from ``KernelManager.post_start_kernel()`` on. Managers without a
        restarter ignore the registration (``add_restart_callback`` returns at once).
        """
        km = self._provisioner.parent
        if km is None or not hasattr(km, "add_restart_callback"):
            return
        if self._watching is km:
            km.remove_restart_callback(self._dead, "dead")
        km.add_restart_callback(self._dead, "dead")
        self._watching = km

    def stop(self) -> None:
        """Unregister the callback (the lease has ended: a later death changes nothing)."""
        km, self._watching = self._watching, None
        if km is not None:
            km.remove_restart_callback(self._dead, "dead")

    def restarting(self) -> None:
        """``cleanup(restart=True)``: the process is gone on purpose until the next launch."""
        self._restarting = True

    def launched(self) -> None:
        """A kernel process was launched (again): its exit counts from now on."""
        self._restarting = False

    def exited_for_good(self) -> bool:
        """The kernel process is gone and no restarter, restart or shutdown is under way."""
        prov = self._provisioner
        km = prov.parent
        if self._restarting or getattr(km, "shutting_down", False):
            return False
        # jupyter_client has no public "is there a restarter?": KernelManager._restarter is
        # None unless an IOLoop manager's start_restarter() made one (autorestart on), and
        # add_restart_callback() silently does nothing without it. With one, the restarter
        # restarts the kernel or fires "dead" (above); without one, only this check notices.
        # https://github.com/jupyter/jupyter_client/blob/main/jupyter_client/manager.py
        # (KernelManager._restarter, add_restart_callback) and .../ioloop/manager.py
        # (IOLoopKernelManager.start_restarter).
        if getattr(km, "autorestart", False) and getattr(km, "_restarter", None) is not None:
            return False
        process = prov.process
        if process is not None:
            return bool(process.poll() is not None)
        if prov.pid:
            try:
                os.kill(prov.pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                return False
        return False

    def _dead(self) -> None:
        """The restarter gave up on the kernel (called synchronously by the restarter)."""
        self._provisioner.log.warning(
            "Kernel %s died and will not be restarted; releasing its GPU lease.",
            self._provisioner.kernel_id,
        )
        task = asyncio.ensure_future(self._on_death())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


__all__ = ["DeathWatch"]
