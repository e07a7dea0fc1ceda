"""What one Jupyter server's GPU kernels are doing: a board the JupyterLab extension reads.

Who writes: each :class:`~provisioner.kernel.provisioner.GPULeaseProvisioner`, at the
moments it learns something anyway -- before it asks the broker (``waiting``), from each
queued long-poll answer (position, queue length, estimated wait), from the grant and from
every renewal (``active``; ``parking``/``parked``/``resuming`` while the broker has parked
the kernel's GPU memory, with the place in the queue while its resume waits), and when the lease ends (``revoked``/``expired`` with the
broker's reason, or ``released``). Nothing here talks to the broker.

Who reads: the jupyter_server extension (:mod:`provisioner.lab`), which answers the
browser's ``GET {base_url}gpu-lease/api/kernels`` from it, and asks a waiting kernel's
provisioner to stop waiting through the hook registered here.

One board per server: the provisioner's parent ``KernelManager`` is a child of the
server's ``MultiKernelManager`` (also while the kernel is still starting, when jupyter_client
keeps it only in ``MultiKernelManager._pending_kernels``), and :func:`board_for` keys the
boards by that object. Ended leases stay on the board (the last ``keep`` of them, for
``keep_for`` seconds), so a student who reopens a notebook still reads why its kernel was
stopped.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..client.answers import GrantedLease
from ..wire import ENDED_LEASE_STATES, KERNEL_LEASE_STATES, PARK_STATES

#: the states a kernel's GPU lease can be in, as the JupyterLab extension shows them
STATES: tuple[str, ...] = tuple(
    dict.fromkeys((*KERNEL_LEASE_STATES[:2], *PARK_STATES, *KERNEL_LEASE_STATES[2:]))
)
ENDED = ENDED_LEASE_STATES

StopWaiting = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class KernelLease:
    """One GPU kernel as the student should see it (docs/developers.md, "In JupyterLab")."""

    kernel_id: str
    state: str
    fraction: float
    kernel_name: str | None = None
    #: the session path jupyter_server gave the kernel (``JPY_SESSION_NAME``): the
    #: notebook's file where the start named it (JupyterLab's does), else the session's
    #: path, a temporary ``dir/<uuid>`` while JupyterLab starts a notebook's kernel
    session_path: str | None = None
    lease: dict[str, Any] | None = None
    position: int | None = None
    waiting: int | None = None
    eta_seconds: float | None = None
    reason: str | None = None
    request_id: str | None = None
    since: float = 0.0
    updated_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The record of ``GET {base_url}gpu-lease/api/kernels`` (optional keys left out)."""
        out: dict[str, Any] = {
            "kernel_id": self.kernel_id,
            "state": self.state,
            "fraction": self.fraction,
        }
        optional = {
            "lease": self.lease,
            "position": self.position,
            "waiting": self.waiting,
            "eta_seconds": self.eta_seconds,
            "reason": self.reason,
            "kernel_name": self.kernel_name,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.state == "waiting":
            out["waiting_since"] = self.since
        if self.state in PARK_STATES:
            out["parked_since"] = self.since
        if self.state in ENDED:
            out["ended_at"] = self.since
        return out


@dataclass
class LeaseBoard:
    """The GPU kernels of one server: live ones (waiting, active) and recently ended ones."""

    keep: int = 200
    keep_for: float = 24 * 3600.0
    clock: Callable[[], float] = time.time
    live: dict[str, KernelLease] = field(default_factory=dict)
    ended: OrderedDict[str, KernelLease] = field(default_factory=OrderedDict)
    #: kernel id -> why its start failed (the last ``keep``)
    failed: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _stoppers: dict[str, StopWaiting] = field(default_factory=dict)

    # -- written by the provisioner --------------------------------------------------------
    def waiting(
        self,
        kernel_id: str,
        fraction: float,
        *,
        kernel_name: str | None,
        session_path: str | None,
        stop: StopWaiting,
    ) -> None:
        """``pre_launch`` is about to ask the broker: the kernel waits for its GPU."""
        now = self.clock()
        self.ended.pop(kernel_id, None)
        self.failed.pop(kernel_id, None)
        self.live[kernel_id] = KernelLease(
            kernel_id,
            "waiting",
            fraction,
            kernel_name=kernel_name,
            session_path=session_path,
            since=now,
            updated_at=now,
        )
        self._stoppers[kernel_id] = stop

    def queued(self, kernel_id: str, answer: dict[str, Any]) -> None:
        """A ``202`` answer of the broker: place in the queue, its length, the estimated wait,
        and why it waits."""
        old = self.live.get(kernel_id)
        if old is None or old.state != "waiting":
            return
        self.live[kernel_id] = replace(
            old,
            position=_int(answer.get("position")),
            waiting=_int(answer.get("queue_length")),
            eta_seconds=_seconds(answer.get("eta_seconds")),
            request_id=answer.get("id") if isinstance(answer.get("id"), str) else old.request_id,
            # why it waits (a class session's reserved share names its course and end)
            reason=answer.get("reason") if isinstance(answer.get("reason"), str) else old.reason,
            updated_at=self.clock(),
        )

    def queue_seen(self, kernel_id: str, entry: dict[str, Any] | None, length: int | None) -> None:
        """The server extension's own look at ``GET /api/v1/queue`` (``None``: not waiting there)."""
        old = self.live.get(kernel_id)
        if old is None or old.state != "waiting" or entry is None:
            return
        self.live[kernel_id] = replace(
            old,
            position=_int(entry.get("position")),
            waiting=length if length is not None else old.waiting,
            eta_seconds=_seconds(entry.get("eta_seconds")),
            request_id=entry.get("id") if isinstance(entry.get("id"), str) else old.request_id,
            # a class session's reserved share, named (the queue's entry says it)
            reason=entry.get("session") if isinstance(entry.get("session"), str) else old.reason,
            updated_at=self.clock(),
        )

    def active(self, kernel_id: str, fraction: float, lease: GrantedLease) -> None:
        """The kernel holds ``lease`` (granted, kept over a restart, or renewed); the board
        shows it as the broker's JSON object (:meth:`GrantedLease.to_json`)."""
        now = self.clock()
        old = self.live.get(kernel_id)
        self._stoppers.pop(kernel_id, None)
        self.ended.pop(kernel_id, None)
        since = old.since if old is not None and old.state == "active" else now
        base = old or KernelLease(kernel_id, "active", fraction)
        self.live[kernel_id] = replace(
            base,
            state="active",
            fraction=float(lease.fraction or fraction),
            lease=lease.to_json(),
            position=None,
            waiting=None,
            eta_seconds=None,
            reason=None,
            since=since,
            updated_at=now,
        )

    def parked(
        self,
        kernel_id: str,
        fraction: float,
        lease: GrantedLease,
        *,
        state: str,
        position: int | None = None,
        waiting: int | None = None,
        eta_seconds: float | None = None,
    ) -> None:
        """The broker parked the kernel's GPU memory: ``state`` is ``parking``/``parked``, or
        ``resuming`` once the memory is re-reserved. From each renewal, and from each answer
        to the keeper's resume call: ``position`` (and ``waiting``, the queue's length, and
        ``eta_seconds``) while the resume waits in the queue."""
        now = self.clock()
        old = self.live.get(kernel_id)
        self._stoppers.pop(kernel_id, None)
        self.ended.pop(kernel_id, None)
        since = old.since if old is not None and old.state in PARK_STATES else now
        base = old or KernelLease(kernel_id, state, fraction)
        self.live[kernel_id] = replace(
            base,
            state=state,
            fraction=float(lease.fraction or fraction),
            lease=lease.to_json(),
            position=position,
            waiting=waiting if position is not None else None,
            eta_seconds=_seconds(eta_seconds),
            reason=None,
            since=since,
            updated_at=now,
        )

    def end(self, kernel_id: str, state: str, reason: str | None) -> None:
        """The lease ended (``revoked``/``expired`` by the broker, ``released`` by us).

        A revoked or expired record is not overwritten by the release that follows it.
        """
        now = self.clock()
        self._stoppers.pop(kernel_id, None)
        old = self.live.pop(kernel_id, None) or self.ended.get(kernel_id)
        if old is None:
            return
        if old.state in ("revoked", "expired") and state == "released":
            return
        lease = dict(old.lease) if old.lease else None
        if lease is not None:
            lease["state"] = state
            if reason is not None and state != "released":
                lease["reason"] = reason
        self.ended[kernel_id] = replace(
            old, state=state, reason=reason, lease=lease, since=now, updated_at=now
        )
        self.ended.move_to_end(kernel_id)
        self._trim(now)

    def forget(self, kernel_id: str, why: str | None = None) -> None:
        """The kernel never started (refused, gave up, stopped waiting): its start error says
        why, and so does :meth:`start_error` (a page that re-attached to the waiting kernel
        reads it there: the start's own answer went to the page that started it)."""
        self.live.pop(kernel_id, None)
        self._stoppers.pop(kernel_id, None)
        if why:
            self.failed[kernel_id] = why
            self.failed.move_to_end(kernel_id)
            while len(self.failed) > self.keep:
                self.failed.popitem(last=False)

    def start_error(self, kernel_id: str) -> str | None:
        """Why the kernel's start failed (see :meth:`forget`), if it did."""
        return self.failed.get(kernel_id)

    # -- read by the server extension -----------------------------------------------------
    def snapshot(self) -> list[KernelLease]:
        """Every live kernel, then the ended ones, oldest first."""
        self._trim(self.clock())
        return [*self.live.values(), *self.ended.values()]

    def get(self, kernel_id: str) -> KernelLease | None:
        return self.live.get(kernel_id) or self.ended.get(kernel_id)

    def waiting_ids(self) -> list[str]:
        return [k for k, v in self.live.items() if v.state == "waiting"]

    async def stop_waiting(self, kernel_id: str) -> bool:
        """Ask the waiting kernel's provisioner to give up its queue place; False if not waiting."""
        stop = self._stoppers.get(kernel_id)
        record = self.live.get(kernel_id)
        if stop is None or record is None or record.state != "waiting":
            return False
        return await stop()

    def _trim(self, now: float) -> None:
        while self.ended and (
            len(self.ended) > self.keep
            or now - next(iter(self.ended.values())).updated_at > self.keep_for
        ):
            self.ended.popitem(last=False)


_BOARDS: weakref.WeakKeyDictionary[Any, LeaseBoard] = weakref.WeakKeyDictionary()


def board_for(manager: Any) -> LeaseBoard | None:
    """The board of the server whose ``MultiKernelManager`` is ``manager`` (made on first use).

    ``None`` for ``None`` (a kernel managed by a lone ``KernelManager``, as in tests and
    ``jupyter console``: nobody reads a board there).
    """
    if manager is None:
        return None
    board = _BOARDS.get(manager)
    if board is None:
        board = _BOARDS[manager] = LeaseBoard()
    return board


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _seconds(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


__all__ = ["ENDED", "PARK_STATES", "STATES", "KernelLease", "LeaseBoard", "board_for"]
