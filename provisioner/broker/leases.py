"""Leases: acquire (with its long-poll), renew, release, revoke, and the reaper.

Who calls this: the HTTP handlers (``service.leases.acquire(...)``), one call per
request, and the reaper loop started by ``app.py`` (:meth:`LeaseService.tick`). Every
change goes through the shared :class:`~provisioner.broker.core.ServiceCore`: decide
with ``scheduling``, ``commit``, then answer (see ``core.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from ..errors import GPULeaseError, LeaseGone, NotActive, UnknownGPU
from ..model import Changes, Identity, Lease, Request, ppm_to_fraction
from . import admission, scheduling
from .core import ServiceCore, Waiter, check_owner, require_admin
from .policy import Ask
from .scheduling import Existing, Grant, Queued

log = logging.getLogger("gpu_lease.broker")

#: heartbeats persisted per transaction by the reaper (see ``_persist_heartbeats``)
HEARTBEATS_PER_COMMIT = 200


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


def parking_timeout_why(timeout: float) -> str:
    """Why parking failed when it took longer than ``park_timeout`` (``scheduling.park_failed``
    puts it in the revoke reason its student reads)."""
    return (
        f"it did not finish within {timeout:g} s (the node's agent did not report the "
        "kernel's GPU memory saved)"
    )


class LeaseService:
    """Leases and queued requests of kernels, and the reaper that ends them."""

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
        waiter = self.core.waiters.setdefault(key, Waiter())
        waiter.count += 1
        deadline = asyncio.get_running_loop().time() + wait
        try:
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
            waiter.count -= 1
            if waiter.count <= 0:
                self.core.waiters.pop(key, None)
            if self.core.none_waiting is not None and not self.core.waiting:
                self.core.none_waiting.set()
            req = self.core.state.queue.get(key)
            if req is not None:
                req.last_polled_at = self.core.clock()

    async def renew(
        self,
        ident: Identity,
        lease_id: str,
        *,
        pid: int | None = None,
        execution_state: str | None = None,
        last_activity: float | None = None,
        pid_ns: int | None = None,
        cgroup: str | None = None,
    ) -> Lease:
        """``POST /api/v1/leases/{id}/renew``: a new TTL; 410 with the reason if it ended.

        Memory only: the reaper's next pass persists the heartbeat (see the module's
        docstring). A lease active in the database but not in memory is adopted (memory
        reloaded).
        """
        await self.core.ready()
        lease = self.core.state.find_lease(lease_id)  # a parked lease is renewed too
        if lease is None:
            lease = await self.core.adopt(ident, lease_id)
        check_owner(ident, lease)
        fresh = scheduling.renewed(
            lease, self.core.clock(), self.core.policy, pid, execution_state, last_activity
        )
        self.core.state.update_lease(fresh)
        self.core.renewed.add(lease_id)
        self.core.kernel_places.renewed(lease_id, pid_ns, cgroup)
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

    async def tick(self) -> dict[str, int]:
        """One reaper pass: expire, drop stale requests, reclaim idle leases, drain the queue,
        and persist the heartbeats renewed since the last pass.

        Called every ``reap_interval`` seconds by ``app.py``. A gap much longer than
        expected since the last pass (longer than ``max(ttl / 2, 3 * reap_interval)``:
        a suspended process, a clock jump forward) or a clock going backward is treated
        like a restart: every active lease expires exactly one TTL from now instead of
        expiring at once (forward) or only when the clock catches up (backward).
        """
        counts = {
            "expired": 0,
            "dropped": 0,
            "revoked": 0,
            "granted": 0,
            "grace": 0,
            "parking": 0,
            "park_timeouts": 0,
        }
        try:
            await self.core.ready()
        except NotActive:
            return counts  # not the active broker now: it must not decide anything
        now = self.core.clock()
        last = self.core.last_tick if self.core.last_tick is not None else now
        self.core.last_tick = now
        stall = max(self.core.policy.ttl / 2, 3 * self.core.reap_interval)
        if now - last > stall or now < last:
            held = [*self.core.state.leases.values(), *self.core.state.parked.values()]
            for lease in held:
                self.core.state.update_lease(replace(lease, expires_at=now + self.core.policy.ttl))
                self.core.renewed.add(lease.id)
            for req in self.core.state.queue.values():
                req.last_polled_at = now
            counts["grace"] = len(held)
            log.warning(
                "Reaper saw a %.0f s gap (clock jump or stall): gave %d lease(s) a TTL of grace",
                now - last,
                counts["grace"],
            )
            await self._persist_heartbeats(now)
            return counts
        reaped, overdue = await self.core.mutate(lambda: self._reap(now))
        counts["expired"] = len(reaped.expired)
        counts["dropped"] = len(reaped.dropped)
        counts["revoked"] = len(reaped.revoked)
        counts["granted"] = len(reaped.changes.granted)
        counts["parking"] = len(reaped.parking)
        counts["park_timeouts"] = len(overdue)
        if reaped.expired:
            log.info("Expired %d lease(s) not renewed in time", len(reaped.expired))
        if reaped.dropped:
            log.info(
                "Dropped %d queued request(s) whose clients stopped polling", len(reaped.dropped)
            )
        if reaped.revoked:
            log.info("Revoked %d idle lease(s) for waiting requests", len(reaped.revoked))
        await self.core.forget_vanished()
        return counts

    async def _reap(self, now: float) -> tuple[scheduling.Reaped, list[Lease]]:
        """Decide and apply one pass: revoke leases parking past ``park_timeout``, then
        ``scheduling.reap`` with the core's ``can_park`` (idle victims are parked where
        their node can, revoked elsewhere); commit; log and count each park, fallback and
        timeout. Returns the pass and the leases revoked for parking too long."""
        self.core.close_gpus(now)
        timeout = self.core.park.timeout
        overdue = scheduling.parking_overdue(self.core.state, now, timeout)
        late = Changes(now)
        for lease in overdue:
            late.extend(
                scheduling.park_failed(
                    self.core.state, lease.id, parking_timeout_why(timeout), now, self.core.policy
                )
            )
        check = self.core.park_check(now)
        refused: dict[str, str] = {}

        def can_park(lease: Lease) -> str | None:
            why = check(lease)
            if why is None:
                return None
            refused[lease.id] = why
            # the student reads why only where the node parks kernels (checkpoint API on)
            # and could not this time; where it never does, the reason stays today's
            return why if why.tell_student else ""

        reaped = scheduling.reap(
            self.core.state,
            now,
            self.core.policy,
            set(self.core.waiters) | self._resume_polls(),
            can_park=can_park,
        )
        late.extend(reaped.changes)
        await self.core.commit(late)
        await self._persist_heartbeats(now)
        self._note_reaped(reaped, overdue, refused)
        return reaped, overdue

    def _resume_polls(self) -> set[tuple[str, str]]:
        """The kernels whose owners long-poll a resume now (their requests are not stale)."""
        out = set()
        for lease_id in self.core.resume_waiters:
            lease = self.core.state.find_lease(lease_id)
            if lease is not None:
                out.add(lease.user_kernel)
        return out

    def _note_reaped(
        self, reaped: scheduling.Reaped, overdue: list[Lease], refused: dict[str, str]
    ) -> None:
        """Log (INFO, ids cut to 6 characters) and count what a committed pass did about
        parking: orders to park, fallbacks to revoking, parks that timed out."""
        metrics = self.core.metrics
        for lease in overdue:
            log.info(
                "Revoked lease %s… of %s kernel %s: parking did not finish within %g s",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                self.core.park.timeout,
            )
        metrics.parked("timeout", len(overdue))
        for lease in reaped.parking:
            self.core.resume_asked.pop(lease.id, None)
            log.info(
                "Parking idle lease %s… of %s kernel %s on GPU %s for a waiting request",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                lease.gpu_uuid,
            )
        fallbacks = [x for x in reaped.revoked if x.id in refused]
        for lease in fallbacks:
            log.info(
                "Revoked idle lease %s… of %s kernel %s instead of parking it: %s",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                refused[lease.id],
            )
        if self.core.park.idle:  # parking turned off refuses nothing
            metrics.parked("refused", len(fallbacks))

    async def _persist_heartbeats(self, now: float) -> None:
        """Write the latest heartbeat of every lease renewed since the last pass, at most
        ``HEARTBEATS_PER_COMMIT`` per transaction, one transaction after another (so a
        request arriving meanwhile waits for one of them, not for all: 10,000 kernels
        renewing every 30 s are 1,700 heartbeats per 5 s pass); drop the leases another
        writer ended in the database."""
        beats = self.core.take_renewed(now).renewed
        gone: dict[str, tuple[str, str | None]] = {}
        for i in range(0, len(beats), HEARTBEATS_PER_COMMIT):
            chunk = Changes(now, renewed=beats[i : i + HEARTBEATS_PER_COMMIT])
            try:
                gone.update(await self.core.commit(chunk))
            except GPULeaseError:
                self.core.renewed.update(x.id for x in beats[i + HEARTBEATS_PER_COMMIT :])
                raise
        if gone:
            # another writer ended them in the database: drop them, with their capacity
            log.warning(
                "%d renewed lease(s) had ended in the database (another writer); dropped them",
                len(gone),
            )
            held = ((self.core.state.find_lease(i), st, why) for i, (st, why) in gone.items())
            ends = [(x, st, why) for x, st, why in held if x is not None]
            await self.core.commit(scheduling.end(self.core.state, ends, now, self.core.policy))


__all__ = [
    "HEARTBEATS_PER_COMMIT",
    "AcquireResult",
    "LeaseService",
    "parking_timeout_why",
]
