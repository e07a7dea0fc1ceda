"""Resuming parked leases: ``POST /api/v1/leases/{id}/resume`` and its long-poll.

Who calls this: the HTTP handlers (``service.resumes.resume(...)``), one call per
request. A parked lease (its kernel's GPU memory checkpointed by its node's agent, see
``park_orders.py``) gets a resume request in the queue (``scheduling.resume``); a resume
asked while the lease is still ``parking`` is queued by its long-poll once it is parked.
Every change goes through the shared :class:`~provisioner.broker.services.service_core.ServiceCore`:
decide with ``scheduling``, ``commit``, then answer (see ``core.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ...model import Identity, Lease
from ..rules import scheduling
from .service_core import ServiceCore, check_owner

log = logging.getLogger("gpu_lease.broker")


@dataclass
class ResumeResult:
    """A resume's outcome (``POST /api/v1/leases/{id}/resume``): ``state`` is ``active``
    (the handler answers 200 with the lease) or a park state (202, with the place of its
    resume request in the queue while it waits: ``position``, ``eta_seconds``)."""

    state: str
    lease: Lease
    position: int | None = None
    eta_seconds: float | None = None
    queue_length: int = 0


class ResumeService:
    """The owners' resumes of parked leases, and their long-polls."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    async def resume(self, ident: Identity, lease_id: str, wait: float = 0.0) -> ResumeResult:
        """``POST /api/v1/leases/{id}/resume``: the owner (or an admin) wants the parked
        kernel's GPU memory back.

        An active lease answers at once. A parked one gets a resume request in the queue
        (``scheduling.resume``: same GPU, same fraction, its place in the queue that of
        the moment it was parked), granted at once if it fits: the lease is ``resuming``
        (its capacity reserved again) and its node's agent is ordered to restore it. With
        ``wait`` > 0 this long-polls until the lease is active again or the wait ends.
        Another user's lease is 404 like an unknown id; an ended one 410 with its reason.
        """
        await self.core.ready()
        result = await self.core.mutate(lambda: self._resume_once(ident, lease_id))
        if result.state != "active" and wait > 0:
            result = await self._wait_for_resume(ident, lease_id, wait)
        return result

    async def _resume_once(self, ident: Identity, lease_id: str) -> ResumeResult:
        lease = self.core.state.find_lease(lease_id)
        if lease is None:
            lease = await self.core.adopt(ident, lease_id)  # 404, 410, or adopted
        check_owner(ident, lease)
        if lease.park is None:
            await self.core.writer.barrier()  # a resume done in flight is in the database
            return ResumeResult("active", lease)
        now = self.core.clock()
        if lease.park == "parked":
            waiting = lease.user_kernel in self.core.state.queue
            decision, changes = scheduling.resume(
                self.core.state, lease_id, now, self.core.policy, self.core.new_id
            )
            self.core.resume_asked.setdefault(lease_id, now)
            await self.core.commit(changes)
            if decision.state == "resuming":
                log.info(
                    "Resuming lease %s… of %s kernel %s on GPU %s (capacity reserved again)",
                    lease_id[:6],
                    lease.user,
                    lease.kernel_id,
                    lease.gpu_uuid,
                )
            elif not waiting:
                log.info(
                    "Queued the resume of lease %s… of %s kernel %s at position %s",
                    lease_id[:6],
                    lease.user,
                    lease.kernel_id,
                    decision.position,
                )
        return self._resume_state(lease_id, now)

    def _resume_state(self, lease_id: str, now: float) -> ResumeResult:
        """Where the lease ``lease_id`` (held in memory) stands now, for a resume's answer."""
        lease = self.core.state.find_lease(lease_id)
        assert lease is not None
        state = lease.park or "active"
        key = lease.user_kernel
        req = self.core.state.queue.get(key)
        if req is None or req.resume_of != lease_id:
            return ResumeResult(state, lease, queue_length=len(self.core.state.queue))
        req.last_polled_at = now
        return ResumeResult(
            state,
            lease,
            position=scheduling.position_of(self.core.state, key, now, self.core.policy),
            eta_seconds=self.core.eta(key, now),
            queue_length=len(self.core.state.queue),
        )

    async def _wait_for_resume(self, ident: Identity, lease_id: str, wait: float) -> ResumeResult:
        """Long-poll a resume: woken by each commit that parks, resumes or ends leases."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        queued = False  # the resume request queued by this poll (at most once)
        with self.core.polls.for_resume(lease_id) as waiter:
            while True:
                self.core.check_serving()
                lease = self.core.state.find_lease(lease_id)
                if lease is None or lease.park is None:  # ended (410) or active (200)
                    await self.core.writer.barrier()
                    return await self.core.mutate(lambda: self._resume_once(ident, lease_id))
                req = self.core.state.queue.get(lease.user_kernel)
                if (
                    not queued
                    and lease.park == "parked"
                    and (req is None or req.resume_of != lease_id)
                ):
                    # asked while it was still parking: now it is parked, queue the resume
                    queued = True
                    await self.core.mutate(lambda: self._resume_once(ident, lease_id))
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    await self.core.writer.barrier()
                    return self._resume_state(lease_id, self.core.clock())
                await waiter.pause(remaining)


__all__ = ["ResumeResult", "ResumeService"]
