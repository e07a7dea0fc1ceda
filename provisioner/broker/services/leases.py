"""Leases: acquire (with its long-poll), renew, release, revoke.

Who calls this: the HTTP handlers (``service.leases.acquire(...)``), one call per
request. A parked lease's resume is ``resume.py``'s; the reaper's passes (expiry, idle
reclaim, the heartbeats ``renew`` keeps in memory) are ``reaper.py``'s. Every change
goes through the shared :class:`~provisioner.broker.services.service_core.ServiceCore`: decide with
``scheduling``, ``commit``, then answer (see ``core.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from ...errors import GPULeaseError, LeaseGone, UnknownGPU
from ...model import Identity, Lease, Request, ppm_to_fraction
from ...wire import Renewal
from ..rules import admission, scheduling
from ..rules.policy import Ask
from ..rules.scheduling import Existing, Grant, Queued
from .service_core import ServiceCore, check_owner, require_admin

log = logging.getLogger("gpu_lease.broker")


@dataclass
class AcquireResult:
    """An acquire's outcome: ``granted`` (a new lease), ``repeated`` (the kernel's lease
    again) or ``queued``; the handler maps it to an HTTP status."""

    outcome: str
    lease: Lease | None = None
    request: Request | None = None
    position: int = 0
    reason: str = ""
    #: estimated seconds until the grant (``estimates.estimate_waits``), if it has one
    eta_seconds: float | None = None
    #: how many requests wait in the queue (a queued outcome's answer says so)
    queue_length: int = 0


class LeaseService:
    """Leases and queued requests of kernels: acquire, renew, release, revoke."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    async def acquire(self, ident: Identity, ask: Ask, wait: float = 0.0) -> AcquireResult:
        """``POST /api/v1/leases``: grant, repeat, or queue (long-polling up to ``wait`` s)."""
        t0 = time.perf_counter()
        try:
            await self.core.ready()
            result = await self.core.mutate(lambda: self._acquire_once(ident, ask))
        except GPULeaseError as exc:
            self.core.metrics.refused(exc.code)
            raise
        if result.outcome == "queued" and wait > 0:
            result = await self._wait_for_grant(ident, ask, result, wait)
        self.core.metrics.observe_acquire(time.perf_counter() - t0, result.outcome)
        return result

    async def _acquire_once(self, ident: Identity, ask: Ask) -> AcquireResult:
        quota = admission.effective_quota(self.core.book, ident.user, ident.groups)
        used = 0.0
        if quota.budget_fraction_hours is not None and quota.budget_window_s:
            until = self.core.clock()
            since = until - quota.budget_window_s
            used = await self.core.writer.call(
                lambda: self.core.store.user_usage(ident.user, since, until), read=True
            )
        now = self.core.clock()
        if self.core.nodes:
            self.core.close_gpus(now)  # a node silent past its grace is lost from this instant
        try:
            decision, changes = scheduling.acquire(
                self.core.state, ask, quota, now, self.core.policy, self.core.new_id, used
            )
        except UnknownGPU as exc:
            raise UnknownGPU(
                f"{exc.message} List the broker's GPUs with GET /api/v1/gpus (or `gpu-lease top`).",
                **exc.details,
            ) from exc
        waiting = len(self.core.state.queue)  # as the decision saw it, as its position is
        await self.core.commit(changes)  # a repeat awaits what it repeats
        outcome = decision.outcome
        if isinstance(outcome, Existing):
            return AcquireResult("repeated", lease=outcome.lease)
        if isinstance(outcome, Queued):
            if outcome.new:
                log.info(
                    "Queued %s kernel %s for %g of a GPU at position %d",
                    ident.user,
                    ask.kernel_id,
                    ppm_to_fraction(ask.fraction_ppm),
                    outcome.position,
                )
            return AcquireResult(
                "queued",
                request=outcome.request,
                position=outcome.position,
                reason=outcome.reason,
                eta_seconds=self.core.eta(outcome.request.key, now),
                queue_length=waiting,
            )
        assert isinstance(outcome, Grant)
        log.info(
            "Granted %s kernel %s %g of GPU %s (lease %s…)",
            ident.user,
            ask.kernel_id,
            ppm_to_fraction(ask.fraction_ppm),
            outcome.lease.gpu_uuid,
            outcome.lease.id[:6],
        )
        return AcquireResult("granted", lease=outcome.lease)

    async def _wait_for_grant(
        self, ident: Identity, ask: Ask, queued: AcquireResult, wait: float
    ) -> AcquireResult:
        key = (ident.user, ask.kernel_id)
        deadline = asyncio.get_running_loop().time() + wait
        try:
            with self.core.polls.for_grant(key) as waiter:
                while True:
                    self.core.check_serving()
                    lease = self.core.state.lease_for_kernel(*key)
                    if lease is not None:
                        await self.core.writer.barrier()  # the grant is in the database
                        req = queued.request
                        if req is not None:
                            self.core.metrics.observe_queue_wait(self.core.clock() - req.arrived_at)
                        return AcquireResult("granted", lease=lease)
                    req = self.core.state.queue.get(key)
                    if req is None:
                        raise LeaseGone(
                            "Your queued GPU request was cancelled before a GPU became free. "
                            "Start the kernel again to rejoin the queue.",
                            state="cancelled",
                        )
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        await self.core.writer.barrier()
                        now = self.core.clock()
                        req.last_polled_at = now
                        return AcquireResult(
                            "queued",
                            request=req,
                            position=scheduling.position_of(
                                self.core.state, key, now, self.core.policy
                            ),
                            reason=queued.reason,
                            eta_seconds=self.core.eta(key, now),
                            queue_length=len(self.core.state.queue),
                        )
                    await waiter.pause(remaining)
        finally:
            req = self.core.state.queue.get(key)
            if req is not None:
                req.last_polled_at = self.core.clock()

    async def renew(
        self,
        ident: Identity,
        lease_id: str,
        claim: Renewal = Renewal(),
    ) -> Lease:
        """``POST /api/v1/leases/{id}/renew``: a new TTL; 410 with the reason if it ended.

        Memory only: the reaper's next pass persists the heartbeat (``reaper.py``). A lease
        active in the database but not in memory is adopted (memory reloaded). The
        ``claim``'s ``pid``, ``pid_ns``, ``cgroup`` and ``proof`` (the sha256 of the
        kernel's secret) are kept in memory for the node agent to prove
        (``kernel_places.py``).
        """
        await self.core.ready()
        lease = self.core.state.find_lease(lease_id)  # a parked lease is renewed too
        if lease is None:
            lease = await self.core.adopt(ident, lease_id)
        check_owner(ident, lease)
        fresh = scheduling.renewed(
            lease,
            self.core.clock(),
            self.core.policy,
            claim.pid,
            claim.execution_state,
            claim.last_activity,
        )
        self.core.state.update_lease(fresh)
        self.core.renewed.add(lease_id)
        self.core.kernel_places.renewed(lease_id, claim.pid_ns, claim.cgroup, claim.proof)
        return fresh

    async def release(self, ident: Identity, lease_id: str) -> None:
        """``DELETE /api/v1/leases/{id}``: end a lease, or cancel a queued request. Idempotent.

        An id memory does not hold is looked up in the database: a queued request there
        is deleted, an active lease there is ended there; 404 only if neither exists.
        """
        await self.core.ready()
        if await self.core.mutate(lambda: self._release_once(ident, lease_id)):
            return
        await self._release_unknown(ident, lease_id)

    async def _release_once(self, ident: Identity, lease_id: str) -> bool:
        """End the lease or cancel the request ``lease_id`` memory holds; False if it holds none."""
        lease = self.core.state.find_lease(lease_id)
        now = self.core.clock()
        if lease is not None:
            check_owner(ident, lease)
            await self.core.commit(
                scheduling.end(self.core.state, [(lease, "released", None)], now, self.core.policy)
            )
            log.info(
                "Released %slease %s… of %s kernel %s",
                "parked " if lease.park == "parked" else "",
                lease_id[:6],
                lease.user,
                lease.kernel_id,
            )
            return True
        # a resume request's id withdraws it (its lease stays parked)
        req = next((r for r in self.core.state.queue.values() if r.id == lease_id), None)
        if req is None:
            return False
        check_owner(ident, req)
        await self.core.commit(
            scheduling.cancel(self.core.state, [req], "cancelled", now, self.core.policy)
        )
        log.info("Cancelled queued request of %s kernel %s", req.user, req.kernel_id)
        return True

    async def revoke(self, ident: Identity, lease_id: str, reason: str) -> Lease:
        """An admin ends someone's lease; its provisioner stops the kernel and shows ``reason``.

        Called by ``POST /api/v1/leases/{id}/revoke``; returns the lease as ended.
        """
        await self.core.ready()
        require_admin(ident)

        async def once() -> Lease:
            lease = self.core.state.find_lease(lease_id)
            if lease is None:
                lease = await self.core.adopt(ident, lease_id)
            now = self.core.clock()
            await self.core.commit(
                scheduling.end(self.core.state, [(lease, "revoked", reason)], now, self.core.policy)
            )
            return replace(lease, state="revoked", ended_at=now, reason=reason, park=None)

        ended = await self.core.mutate(once)
        log.info(
            "Revoked lease %s… of %s kernel %s by %s: %s",
            lease_id[:6],
            ended.user,
            ended.kernel_id,
            ident.user,
            reason,
        )
        return ended

    async def _release_unknown(self, ident: Identity, request_id: str) -> None:
        """DELETE of an id memory does not hold: cancel or end it in the database, or 404."""
        req = await self.core.writer.call(
            lambda: self.core.store.get_request(request_id), read=True
        )
        if req is not None:
            check_owner(ident, req)
            await self.core.writer.call(lambda: self.core.store.delete_requests([req.id]))
            log.info("Cancelled queued request of %s kernel %s (database)", req.user, req.kernel_id)
            return
        found = await self.core.visible_lease(ident, request_id)  # 404 / 403
        if found.active:
            now = self.core.clock()
            await self.core.writer.call(
                lambda: self.core.store.end_leases([(found.id, "released", now, None)])
            )
            self.core.metrics.ended("released", 1)
            log.warning(
                "Released lease %s… of %s kernel %s, active in the database but not in memory",
                found.id[:6],
                found.user,
                found.kernel_id,
            )


__all__ = ["AcquireResult", "LeaseService"]
