"""The reaper: one pass every ``reap_interval`` seconds that ends what is overdue.

Who calls this: the reaper loop started by ``app.py`` (``serving.py`` calls
:meth:`Reaper.tick` every ``reap_interval`` s). A pass expires leases not renewed in
time, drops queued requests whose clients stopped polling, parks (or, where their node
cannot, revokes) idle leases for waiting requests, revokes leases parking past
``park_timeout``, drains the queue, and persists the heartbeats that
:meth:`~provisioner.broker.services.leases.LeaseService.renew` kept in memory. Every change goes
through the shared :class:`~provisioner.broker.services.service_core.ServiceCore`: decide with
``scheduling``, ``commit``, then answer (see ``core.py``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ...errors import GPULeaseError, NotActive
from ...model import Changes, Lease
from ..rules import scheduling
from .park_policy import ParkPolicy
from .service_core import ServiceCore

log = logging.getLogger("gpu_lease.broker")

#: heartbeats persisted per transaction by the reaper (see ``_persist_heartbeats``)
HEARTBEATS_PER_COMMIT = 200


def parking_timeout_why(timeout: float) -> str:
    """Why parking failed when it took longer than ``park_timeout`` (``scheduling.park_failed``
    puts it in the revoke reason its student reads)."""
    return (
        f"it did not finish within {timeout:g} s (the node's agent did not report the "
        "kernel's GPU memory saved)"
    )


class Reaper:
    """The reaper's passes: what ends, parks or is granted without a request asking."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

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
        ``scheduling.reap`` with ``ParkPolicy.check`` (idle victims are parked where
        their node can, revoked elsewhere); commit; log and count each park, fallback and
        timeout. Returns the pass and the leases revoked for parking too long."""
        self.core.close_gpus(now)
        self.core.use_timetable(now)  # class sessions begin and end with the clock
        self.core.refresh_mps_owners()  # the pass's drain sees the proofs made since
        timeout = self.core.park.timeout
        overdue = scheduling.parking_overdue(self.core.state, now, timeout)
        late = Changes(now)
        for lease in overdue:
            late.extend(
                scheduling.park_failed(
                    self.core.state, lease.id, parking_timeout_why(timeout), now, self.core.policy
                )
            )
        check = ParkPolicy(self.core).check(now)
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
            set(self.core.polls.acquires) | self._resume_polls(),
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
        for lease_id in self.core.polls.resumes:
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
        freed: dict[str, int] = {}
        for lease, course in reaped.freed:
            freed[course] = freed.get(course, 0) + 1
            log.info(
                "Freed lease %s… of %s kernel %s from %s's class session share",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                course,
            )
        for course, n in freed.items():
            metrics.session_freed(course, n)

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


__all__ = ["HEARTBEATS_PER_COMMIT", "Reaper", "parking_timeout_why"]
