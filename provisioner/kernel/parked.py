"""``ParkWatch``: a parked lease's way back to its GPU memory (parking).

The broker may park an idle kernel's GPU memory in host RAM while others wait. The
kernel's :class:`~provisioner.kernel.lease_keeper.LeaseKeeper` goes on renewing (``parking``,
``parked`` and ``resuming`` are not ends) and writes the wire state to the state file; when
a renewal finds the lease parked, it starts its :class:`ParkWatch`, which looks for
``<state file>.resume`` every ``RESUME_WATCH_INTERVAL`` seconds (one ``stat``): the
kernel's ``pre_run_cell`` hook (``startup/gpu_lease_magic.py``) creates it when a cell is
run. Then the watch calls ``client.leases.resume`` (``POST /api/v1/leases/{id}/resume``:
first at once, for the resume's place in the queue; then long-polls of
``RESUME_LONG_POLL`` s at most) until the lease is active, handing each answer to the
keeper (which writes the place in the queue to the state file and the board), and deletes
the ``.resume`` file; a lease that ended meanwhile goes back to the keeper as a revoke (the
reason shown, the kernel shut down).

A kernel without that hook (not an IPython kernel: R, Julia...; ``resume_when_busy``, set
by the provisioner) cannot ask: its lease is resumed as soon as the kernel is busy, since a
cell it runs would otherwise block in CUDA with nobody asking. An IPython kernel busy for
``BUSY_RESUME_AFTER`` seconds without a break is resumed too: a cell that started before
the keeper learnt of the park (its next renewal) passed the hook while the state file
still said ``active``.

The watch knows its keeper only through :class:`LeaseHolder`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from ..client.answers import GrantedLease, ResumeAnswer
from ..errors import GPULeaseError, LeaseGone, LeaseNotFound
from .broker_clients import BrokerClients
from .loops import cancel_and_wait
from .state_file import StateFile

#: how often a parked lease's keeper looks for ``<state file>.resume`` (s)
RESUME_WATCH_INTERVAL = 0.25
#: the first pause after a resume call the broker could not answer (s); doubles up to a renewal interval
RESUME_RETRY = 0.5
#: never long-poll a resume more often than this (s), whatever the broker's long-poll does
MIN_RESUME_PERIOD = 0.5
#: the longest one resume call long-polls (s), ``long_poll`` permitting: each answer carries
#: the resume's place in the queue, which the waiting cell prints and the status bar shows
RESUME_LONG_POLL = 5.0
#: a parked IPython kernel busy this long without a break is resumed (s): a cell that began
#: before its keeper learnt of the park (at the next renewal) waits in CUDA, and its hook,
#: which ran when the state file still said ``active``, asked for nothing
BUSY_RESUME_AFTER = 2.0


class LeaseHolder(Protocol):
    """What a :class:`ParkWatch` needs of the keeper that owns it (``LeaseKeeper``)."""

    @property
    def lease(self) -> GrantedLease | None:
        """The lease held now, as the broker last described it."""
        ...

    @property
    def kernel_id(self) -> str: ...

    @property
    def long_poll(self) -> float:
        """The longest the broker may hold one of this kernel's requests (s)."""
        ...

    def kernel_busy(self) -> bool:
        """Whether the kernel is executing now."""
        ...

    def interval(self) -> float:
        """Seconds between renewals (the longest pause between resume calls too)."""
        ...

    def holds(self, lease: GrantedLease) -> bool:
        """Whether ``lease`` is still the one held."""
        ...

    def hold(self, fresh: GrantedLease) -> None:
        """The broker's latest word on the lease held: keep it, write it, show it."""
        ...

    async def lost_parked(self, exc: GPULeaseError) -> None:
        """The parked lease has ended (``exc`` says why): shut the kernel down."""
        ...


class ParkWatch:
    """Owns a parked lease's resume: the task that waits for the kernel to want its GPU
    memory back and then resumes the lease, the broker's latest place in the resume queue,
    and ``resume_when_busy``."""

    def __init__(
        self,
        holder: LeaseHolder,
        clients: BrokerClients,
        *,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        self.holder = holder
        self.clients = clients
        self.log = log
        #: while the lease is parked: the task that watches for the kernel's resume request
        #: and then resumes (see :meth:`_watch`)
        self.task: asyncio.Task[None] | None = None
        #: the broker's latest answer to a resume that waits: ``position``, ``eta_seconds``
        self.progress: dict[str, Any] | None = None
        #: resume a parked lease as soon as the kernel is busy, without ``<state file>.resume``.
        #: Set by the provisioner (``pre_launch``) for kernels without the ``%gpu`` extension
        #: (not IPython: R, Julia...): nothing in them asks, and a cell run there would block
        #: in CUDA until someone did. Never for IPython kernels: JupyterLab's completions and
        #: inspections make a kernel briefly busy, and their ``pre_run_cell`` hook asks for
        #: real cells only (``%gpu`` alone runs without resuming).
        self.resume_when_busy = False
        #: while parked: since when the kernel has been busy without a break (monotonic)
        self._busy_since: float | None = None

    def follow(self, fresh: GrantedLease, state_file: StateFile | None) -> None:
        """The holder now holds ``fresh``. Only a ``parked`` lease keeps its place in the
        queue: a ``resuming`` one (its memory re-reserved, the restore ordered; a renewal
        may say so before the resume's long-poll does) and an active one forget it. A
        parked lease's watch starts on this loop unless it runs already (or no state
        file: without one the kernel has no way to ask, and renewals simply go on)."""
        if fresh.state != "parked":
            self.progress = None
        if not fresh.parked or state_file is None:
            return
        task = self.task
        if task is not None and not task.done():
            return
        self.task = asyncio.ensure_future(self._watch(state_file))

    def forget_if_caller(self) -> None:
        """The resume under way ends the lease (and shuts the kernel down) itself: forget
        its task, so that the shutdown does not cancel it."""
        if self.task is asyncio.current_task():
            self.task = None

    async def stop(self) -> None:
        """Cancel the watch (unless the caller is it) and forget it."""
        task = self.task
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait(task)
        self.task = None

    async def _watch(self, state_file: StateFile) -> None:
        """While the lease is parked: wait for the kernel to ask (``<state file>.resume``),
        or, where ``resume_when_busy``, for the kernel to be busy; then resume. Ends when
        the lease is active again or has ended.

        Cheap: one ``stat`` (and, where ``resume_when_busy``, one look at the kernel's
        execution state) every ``RESUME_WATCH_INTERVAL`` seconds, only while parked
        (renewals keep telling the state meanwhile; a lease found active stops the watch).
        """
        self._busy_since = None
        while True:
            lease = self.holder.lease
            if lease is None or not lease.parked:
                if lease is not None:
                    state_file.resume_done()  # resumed without us (another server process)
                return
            why = self._resume_wanted(state_file)
            if why is not None:
                break
            await asyncio.sleep(RESUME_WATCH_INTERVAL)
        self.log.info(
            "Kernel %s %s; resuming GPU lease %s.", self.holder.kernel_id, why, lease.short_id
        )
        await self._resume(state_file)

    def _resume_wanted(self, state_file: StateFile) -> str | None:
        """Why the parked lease must be resumed now (the end of a log line), or None.

        Also for IPython kernels, a kernel busy without a break for ``BUSY_RESUME_AFTER``
        seconds is resumed: a cell that started before this keeper learnt of the park (a
        renewal later; the state file said ``active``, so the hook let it run) blocks in
        its first CUDA call with nobody asking. Completions and inspections are far
        shorter, and ``%gpu`` alone returns at once.
        """
        if state_file.resume_asked():
            return "asks for its parked GPU memory back"
        busy = self.holder.kernel_busy()
        now = time.monotonic()
        if not busy:
            self._busy_since = None
            return None
        if self.resume_when_busy:
            return "is busy (it has no %gpu cell hook to ask for its parked GPU memory)"
        if self._busy_since is None:
            self._busy_since = now
        if now - self._busy_since >= BUSY_RESUME_AFTER:
            return (
                f"has been busy for {BUSY_RESUME_AFTER:g} s (a cell that started before it "
                "was parked waits for its GPU memory)"
            )
        return None

    async def _resume(self, state_file: StateFile) -> None:
        """``client.leases.resume`` until the lease is active (then the ``.resume`` file goes)
        or has ended (handled as a revoke). Each 202 answer (state, place in the queue,
        estimated wait) goes to the holder, which writes it to the state file (the kernel's
        hook prints it) and the board (JupyterLab's status bar shows it). A broker that
        cannot answer is asked again with backoff, up to a renewal interval apart, as
        renewals do."""
        holder = self.holder
        started = time.monotonic()
        retry = RESUME_RETRY
        # The first call does not long-poll: it queues the resume and answers its place at
        # once (a long-poll would tell the cell and the status bar nothing for its length).
        wait = 0.0
        while True:
            lease = holder.lease
            if lease is None:
                return
            asked, polled = time.monotonic(), wait > 0
            try:
                answer = await self.clients.get(renewal=True).leases.resume(lease.id, wait=wait)
            except GPULeaseError as exc:
                if not holder.holds(lease):
                    return
                if isinstance(exc, (LeaseGone, LeaseNotFound)):
                    await holder.lost_parked(exc)
                    return
                self.log.warning(
                    "Could not resume GPU lease %s of kernel %s; asking again in %g s: %s",
                    lease.short_id,
                    holder.kernel_id,
                    retry,
                    exc,
                )
                await asyncio.sleep(retry)
                retry = min(retry * 2, max(RESUME_RETRY, holder.interval()))
                continue
            retry = RESUME_RETRY
            wait = min(holder.long_poll, RESUME_LONG_POLL)
            if not holder.holds(lease):
                return  # ended meanwhile
            fresh, progress = _resume_answer(answer, lease)
            if fresh.id != lease.id:
                return
            self.progress = progress
            holder.hold(fresh)
            if not fresh.parked:
                state_file.resume_done()
                self.log.info(
                    "GPU lease %s of kernel %s is active again: resumed in %.1f s.",
                    fresh.short_id,
                    holder.kernel_id,
                    time.monotonic() - started,
                )
                return
            self.log.debug(
                "GPU lease %s of kernel %s: %s, position %s",
                fresh.short_id,
                holder.kernel_id,
                fresh.state,
                (progress or {}).get("position"),
            )
            # the first call answered at once by design: the long-poll follows at once (the
            # restore is ordered to the node at once too, and may be done in milliseconds)
            pause = MIN_RESUME_PERIOD - (time.monotonic() - asked) if polled else 0.0
            if pause > 0:
                await asyncio.sleep(pause)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _resume_answer(
    answer: ResumeAnswer, held: GrantedLease
) -> tuple[GrantedLease, dict[str, Any] | None]:
    """The broker's answer to a resume (typed by the client): the lease (200), or the 202
    body's lease in its park state with its ``position``/``eta_seconds``/``queue_length``.
    A 202 body without a lease keeps ``held``."""
    fresh = answer.lease if answer.lease is not None else held
    if not answer.waiting:
        return fresh, None
    eta = answer.eta_seconds
    progress = {
        "position": _count(answer.position),
        "eta_seconds": eta if eta is not None and eta >= 0 else None,
        "queue_length": _count(answer.queue_length),
    }
    return fresh, progress


__all__ = ["BUSY_RESUME_AFTER", "LeaseHolder", "ParkWatch"]
