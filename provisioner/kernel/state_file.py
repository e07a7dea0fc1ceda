"""The kernel's lease state file: what the ``%gpu`` magic reads inside the kernel.

The provisioner passes its path to the kernel as ``GPU_LEASE_STATE_FILE``; the lease
keeper rewrites it at each renewal and when the broker ends the lease, so ``%gpu`` shows
the state, the expiry and the reason (``startup/gpu_lease_magic.py`` reads ``state``,
``expires_at`` and ``reason``; while the lease is parked, ``parked_at`` and, while a
resume waits, ``position`` and ``eta_seconds``: the magic's ``pre_run_cell`` hook waits
on them). Beside it, ``<path>.resume`` (:attr:`StateFile.resume_flag`) is the kernel's
way to ask for its parked GPU memory back: the hook creates it, the keeper deletes it. It lives next to the connection file, in the server's
private runtime folder, mode 0600, and goes when the lease is released, except when the
broker ended the lease: then the reason stays readable after the kernel is gone.
Errors are logged, never raised: ``%gpu`` is a convenience, the kernel is not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

from ..client.answers import GrantedLease


def state_file_path(connection_file: str | None, kernel_id: Any) -> str:
    """Next to the connection file (the server's private runtime dir), else the runtime dir."""
    if connection_file:
        folder = os.path.dirname(os.path.abspath(connection_file))
    else:
        from jupyter_core.paths import jupyter_runtime_dir

        folder = jupyter_runtime_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, f"gpu-lease-{kernel_id}.json")


class StateFile:
    """One kernel's state file at ``path``."""

    def __init__(
        self, path: str, *, kernel_id: Any, log: logging.Logger | logging.LoggerAdapter[Any]
    ) -> None:
        self.path = path
        self.kernel_id = kernel_id
        self.log = log
        #: leave the file in place at :meth:`remove` (the broker ended the lease: why stays readable)
        self.keep = False

    def write(
        self,
        lease: GrantedLease,
        *,
        fraction: float,
        state: str | None = None,
        reason: str | None = None,
        position: int | None = None,
        eta_seconds: float | None = None,
    ) -> None:
        """Write ``lease``'s state atomically (``state``/``reason`` override the lease's).

        ``fraction`` is what was asked for, written when the broker's lease omits it.
        ``position``/``eta_seconds``: a parked lease's place in the queue while its resume
        waits (the broker's latest 202 answer to the keeper's resume call).
        """
        # the lease as the broker last described it (one function: a field the client
        # learns is in the file too), then what the file adds or names its own way
        data = {
            **lease.to_json(),
            "state": state or lease.state,
            "reason": reason if reason is not None else lease.reason,
            "lease_id": lease.id,
            "kernel_id": self.kernel_id,
            "fraction": lease.fraction if lease.fraction is not None else fraction,
            # what the broker last said holds the cap beyond the kernel's own framework
            # caps (the lease's ``enforcement``: a node agent's mode); ``enforcement`` in
            # the kernel is its own (GPU_LEASE_ENFORCEMENT), so the file names it apart
            "node_enforcement": lease.enforcement,
            "position": position,
            "eta_seconds": eta_seconds,
            "updated_at": time.time(),
        }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            self.log.warning("Could not write the GPU lease state file %s: %s", self.path, exc)

    @property
    def resume_flag(self) -> str:
        """``<path>.resume``: created by the kernel's ``pre_run_cell`` hook when a cell is run
        while the lease is parked (the kernel runs as the user, in the same 0700 folder)."""
        return f"{self.path}.resume"

    def resume_asked(self) -> bool:
        """Whether the kernel asked for its parked GPU memory back (one ``stat``)."""
        return os.path.exists(self.resume_flag)

    def resume_done(self) -> None:
        """The lease is active again (or ended): the request is answered."""
        with contextlib.suppress(OSError):
            os.unlink(self.resume_flag)

    def remove(self) -> None:
        """Delete the file, unless :attr:`keep` says its reason must stay readable."""
        self.resume_done()
        if not self.keep:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


__all__ = ["StateFile", "state_file_path"]
