"""Fenced leadership of active/standby brokers on PostgreSQL (``--ha-lock``).

Who calls this: ``app.py``, with one :class:`Leadership` per broker process. The SQL is
the store's (``store.fencing``: :meth:`~provisioner.broker.store.fencing.Fencing.take`, ``renew``,
``release``, ``set``); this module keeps the time.

- A standby runs :meth:`Leadership.wait_until_leader`: it tries to take the leadership
  row and sleeps until the current leadership expires (by the database's clock), at
  most ``poll`` seconds at a time.
- The active broker runs :meth:`Leadership.keep`: it renews every ``ttl / 3`` seconds,
  in a thread (a busy event loop does not starve it), and retries quickly when a
  renewal fails. When the row names another broker it is deposed: ``on_lost`` is
  called and it never serves again.
- :meth:`Leadership.check` is the service's gate, called before every request acts
  and before a long-poll answers: it raises :class:`~provisioner.errors.NotActive`
  (503, ``Retry-After: 1``) unless the last successful renewal was *sent* less than
  ``ttl - margin`` ago. The database ends that leadership ``ttl`` after it *executed*
  the renewal, later than it was sent, so this broker stops answering before another
  can start. Time is measured on :func:`boottime`, a clock that keeps counting while
  the process is stopped (SIGSTOP) or the machine is suspended.
- Every write is fenced in the database (the store checks holder, epoch and expiry in
  the write's own transaction), so whatever this process believes, a deposed broker
  commits nothing. A refused write closes the gate at once.

The bound: a standby takes over once the active's last renewal is ``ttl`` old, so
between ``2/3 ttl`` and ``ttl`` (plus up to ``poll``) after the active paused, died or
lost the database, then loads the state and listens. A clean shutdown gives the
leadership up (:meth:`release`): a standby takes it within ``poll``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable

from ...errors import NotActive, StoreError
from .store import Fence, Store

log = logging.getLogger("gpu_lease.broker.leadership")

__all__ = ["Leadership", "boottime"]


def boottime() -> float:
    """Seconds on a clock that never goes back and keeps counting while the process is
    stopped or the machine sleeps (Linux ``CLOCK_BOOTTIME``; elsewhere monotonic)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


class Leadership:
    """This broker's side of the leadership row: take it, keep it, gate on it, give it up.

    ``ttl`` (s) is how long a leadership lasts unless renewed (``--leadership-ttl``);
    ``holder`` names this process in the row (host, pid and a random tag by default).
    """

    def __init__(
        self,
        store: Store,
        ttl: float,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = boottime,
        poll: float | None = None,
    ) -> None:
        if not ttl > 0:
            raise ValueError("the leadership TTL must be a positive number of seconds")
        self.store = store
        self.ttl = float(ttl)
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.clock = clock
        #: seconds between renewals while they succeed
        self.renew_every = self.ttl / 3
        #: the gate closes this long before the database could end the leadership
        self.margin = min(1.0, self.ttl / 10)
        #: seconds between attempts after a failed renewal
        self.retry_every = max(0.05, min(0.5, self.ttl / 10))
        #: a standby's longest sleep between attempts to take over
        self.poll = poll if poll is not None else min(1.0, self.ttl / 4)
        self.epoch: int | None = None
        #: why this broker will never serve again (deposed, or gave the leadership up)
        self.lost: str | None = None
        self._valid_until = -math.inf
        self._on_lost: Callable[[str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the gate ---------------------------------------------------------------------
    @property
    def valid(self) -> bool:
        """Whether this broker may answer with state now (see :meth:`check`)."""
        return self.lost is None and self.epoch is not None and self.clock() < self._valid_until

    def check(self) -> None:
        """Raise :class:`NotActive` unless this broker may answer with state now.

        Called by ``ServiceCore.check_serving`` (``core.py``) at the start of every request.
        """
        if self.lost is not None:
            raise NotActive(
                f"This broker is not the active one any more ({self.lost}); retry, and "
                "the active broker will answer."
            )
        if self.epoch is None:
            raise NotActive("This broker is standing by; retry, and the active broker will answer.")
        if self.clock() >= self._valid_until:
            raise NotActive(
                "This broker could not confirm its leadership with the database in time; "
                "retry in a moment: it or a standby broker will answer."
            )

    # -- standing by --------------------------------------------------------------------
    def try_take(self) -> tuple[bool, str | None, float]:
        """One attempt to take the leadership: ``(taken, holder now, seconds to its expiry)``.

        On success the store's fence is set before anything else is written.
        """
        sent = self.clock()
        epoch, holder, remaining = self.store.fencing.take(self.holder, self.ttl)
        if epoch is None:
            return False, holder, remaining
        self.epoch = epoch
        self._valid_until = sent + self.ttl - self.margin
        self.store.fencing.set(Fence(self.holder, epoch), self._refused)
        return True, holder, self.ttl

    async def wait_until_leader(self, stop: asyncio.Event) -> bool:
        """Stand by until this broker leads; False if ``stop`` was set first.

        Called by ``app.py`` before loading state or listening. Database errors are
        logged (once per kind) and retried: a standby outlives a database restart.
        """
        said = ""
        while not stop.is_set():
            wait = self.poll
            try:
                taken, holder, remaining = await asyncio.to_thread(self.try_take)
            except StoreError as exc:
                line = f"standby: cannot take the leadership yet: {exc.message}"
            else:
                if taken:
                    log.info(
                        "Leadership taken (epoch %d, TTL %g s): this broker is now the active one",
                        self.epoch,
                        self.ttl,
                    )
                    return True
                if holder is None:
                    line = (
                        "standby: a write of the active broker holds the leadership row; retrying"
                    )
                else:
                    line = (
                        f"standby: another broker ({holder}) holds the leadership; taking over "
                        "if it is not renewed"
                    )
                wait = min(self.poll, remaining + 0.01)
            if line != said:
                log.warning("%s", line)
                said = line
            try:
                await asyncio.wait_for(stop.wait(), max(0.01, wait))
            except asyncio.TimeoutError:
                pass
        return False

    # -- leading ------------------------------------------------------------------------
    async def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew the leadership until it is lost (then ``on_lost(why)``) or this task is cancelled.

        Started by ``app.py`` once the broker listens.
        """
        assert self.epoch is not None, "keep() runs after the leadership was taken"
        self._loop = asyncio.get_running_loop()
        self._on_lost = on_lost
        failing = ""
        while self.lost is None:
            await asyncio.sleep(self.retry_every if failing else self.renew_every)
            if self.lost is not None:
                break
            sent = self.clock()
            try:
                renewed = await asyncio.to_thread(
                    self.store.fencing.renew, self.holder, self.epoch, self.ttl
                )
            except StoreError as exc:
                if not failing:
                    log.warning(
                        "Cannot renew the leadership (%s); retrying. This broker answers 503 "
                        "if it cannot renew within %.1f s of its last renewal.",
                        exc.message,
                        self.ttl - self.margin,
                    )
                failing = exc.message
                continue
            if not renewed:
                self._deposed(f"another broker took over from epoch {self.epoch}")
                break
            self._valid_until = max(self._valid_until, sent + self.ttl - self.margin)
            if failing:
                log.info("Leadership renewed again (epoch %d)", self.epoch)
                failing = ""

    def release(self) -> None:
        """Give the leadership up at a clean shutdown, after the broker stopped serving:
        a standby takes over within its ``poll``. Errors are logged, not raised."""
        epoch, self._valid_until = self.epoch, -math.inf
        if self.lost is None:
            self.lost = "it gave the leadership up"
        if epoch is None:
            return
        try:
            self.store.fencing.release(self.holder, epoch)
        except StoreError as exc:
            log.warning("Could not give the leadership up (%s); it expires by itself.", exc.message)

    # -- internals ----------------------------------------------------------------------
    def _refused(self, why: str, deposed: bool) -> None:
        """The store's fence refused a write (any thread)."""
        self._valid_until = -math.inf
        if deposed:
            self._deposed(why)

    def _deposed(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        self._valid_until = -math.inf
        log.critical(
            "Lost the leadership: %s. This broker stops serving now and exits; "
            "restart it to stand by.",
            why,
        )
        callback, loop = self._on_lost, self._loop
        if callback is None:
            return
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(callback, why)
        else:
            callback(why)
