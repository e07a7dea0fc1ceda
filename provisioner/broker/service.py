"""The broker's service layer: the pure core and the store, glued under one lock.

Who calls this: the HTTP handlers (``handlers.py``), one call per request, and the
reaper loop started by ``app.py``. Every mutation follows one pattern:

1. decide with a pure function of ``scheduling`` over the in-memory ``PoolState``;
2. persist the decision in ONE store transaction;
3. only then apply it to the in-memory state and wake long-polling waiters.

All of that runs synchronously on the event loop thread, so no two decisions
interleave (the loop is the lock); if the store fails, memory is untouched and the
caller gets ``StoreError`` (503). After a restart the state is rebuilt from the
store and every active lease gets one TTL of grace.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .. import scheduling as core
from .._version import __version__
from ..errors import (
    CannotFit,
    Conflict,
    Forbidden,
    GPULeaseError,
    InvalidRequest,
    LeaseExpired,
    LeaseGone,
    LeaseNotFound,
    LeaseRevoked,
)
from ..model import GPU, Identity, Lease, PoolState, Quota, QuotaBook, Request, ppm_to_fraction
from ..scheduling import Ask, Existing, Grant, Policy, Queued
from ..store import CapacityConflict, Store

log = logging.getLogger("gpu_lease.broker")

QUOTA_LEVELS = ("default", "group", "user")


class Metrics(Protocol):
    """What the service reports; ``metrics.BrokerMetrics`` implements it."""

    def observe_acquire(self, seconds: float, outcome: str) -> None: ...
    def observe_queue_wait(self, seconds: float) -> None: ...
    def refused(self, reason: str) -> None: ...
    def ended(self, state: str, count: int) -> None: ...


class _NoMetrics:
    def observe_acquire(self, seconds: float, outcome: str) -> None:
        pass

    def observe_queue_wait(self, seconds: float) -> None:
        pass

    def refused(self, reason: str) -> None:
        pass

    def ended(self, state: str, count: int) -> None:
        pass


@dataclass
class AcquireResult:
    """What the handler answers: 201 (new lease), 200 (same lease again) or 202 (queued)."""

    status: int
    lease: Lease | None = None
    request: Request | None = None
    position: int = 0
    reason: str = ""


@dataclass
class _Waiter:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0


def new_id() -> str:
    """An unguessable id (128 bits) for leases and queued requests."""
    return secrets.token_urlsafe(16)


class BrokerService:
    def __init__(
        self,
        store: Store,
        gpus: list[GPU],
        policy: Policy,
        *,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        id_factory: Callable[[], str] = new_id,
        reap_interval: float = 5.0,
    ) -> None:
        self.store = store
        self.declared = list(gpus)
        self.policy = policy
        self.clock = clock
        #: seconds between :meth:`tick` calls (``app.py``'s ``reap_interval``)
        self.reap_interval = float(reap_interval)
        self.metrics: Metrics = metrics or _NoMetrics()
        self.new_id = id_factory
        self.state = PoolState.build(gpus)
        self.quotas = QuotaBook()
        self._waiters: dict[tuple[str, str], _Waiter] = {}
        self._last_tick: float | None = None
        self.started_at = 0.0

    # -- start-up -----------------------------------------------------------------
    def start(self) -> None:
        """Open the store, register the GPUs, rebuild state, give every active lease a TTL of grace.

        Called once by ``app.py`` before the HTTP server listens.
        """
        now = self.clock()
        self.store.open()
        self.store.sync_gpus(self.declared, self.policy.capacity_ppm)
        grace = self.store.extend_active(now + self.policy.ttl)
        leases, queue = self.store.load_active()
        known = {g.uuid for g in self.declared}
        orphans = [lease for lease in leases if lease.gpu_uuid not in known]
        if orphans:
            self.store.end_leases(
                [(x.id, "revoked", now, "its GPU is no longer in the pool") for x in orphans]
            )
            log.warning("Revoked %d lease(s) on GPUs no longer declared", len(orphans))
        # a restart is not the clients' fault: waiting requests get a fresh poll window
        for req in queue:
            req.last_polled_at = now
        self.state = PoolState.build(
            self.declared, [x for x in leases if x.gpu_uuid in known], queue
        )
        self.quotas = self.store.load_quotas()
        self.started_at = now
        self._last_tick = now
        log.info(
            "Broker state loaded: %d GPU(s), %d active lease(s) (%d given a TTL of grace), %d waiting",
            len(self.state.gpus),
            len(self.state.leases),
            grace,
            len(self.state.queue),
        )
        self._drain(now)

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.event.set()
        self.store.close()

    # -- acquire ---------------------------------------------------------------------
    async def acquire(self, ident: Identity, ask: Ask, wait: float = 0.0) -> AcquireResult:
        """``POST /api/v1/leases``: grant, repeat, or queue (long-polling up to ``wait`` s)."""
        t0 = time.perf_counter()
        try:
            result = self._acquire_now(ident, ask)
        except GPULeaseError as exc:
            self.metrics.refused(exc.code)
            raise
        if result.status == 202 and wait > 0:
            result = await self._wait_for_grant(ident, ask, result, wait)
        outcome = {201: "granted", 200: "repeated", 202: "queued"}.get(result.status, "other")
        self.metrics.observe_acquire(time.perf_counter() - t0, outcome)
        return result

    def _acquire_now(self, ident: Identity, ask: Ask) -> AcquireResult:
        now = self.clock()
        quota = core.effective_quota(self.quotas, ident.user, ident.groups)
        used = 0.0
        if quota.budget_fraction_hours is not None and quota.budget_window_s:
            used = self.store.user_usage(ident.user, now - quota.budget_window_s, now)
        decision = core.decide_acquire(self.state, ask, quota, now, self.policy, self.new_id, used)
        outcome = decision.outcome
        if isinstance(outcome, Existing):
            return AcquireResult(200, lease=outcome.lease)
        self._persist_grants(decision.grants)
        if isinstance(outcome, Queued):
            if outcome.new:
                self.store.insert_request(outcome.request)
                log.info(
                    "Queued %s kernel %s for %g of a GPU at position %d",
                    ident.user,
                    ask.kernel_id,
                    ppm_to_fraction(ask.fraction_ppm),
                    outcome.position,
                )
            # polls are kept in memory only: after a restart every request gets a fresh window
            self.state.queue[outcome.request.key] = outcome.request
            return AcquireResult(
                202,
                request=outcome.request,
                position=outcome.position,
                reason=outcome.reason,
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
        return AcquireResult(201, lease=outcome.lease)

    async def _wait_for_grant(
        self, ident: Identity, ask: Ask, queued: AcquireResult, wait: float
    ) -> AcquireResult:
        key = (ident.user, ask.kernel_id)
        waiter = self._waiters.setdefault(key, _Waiter())
        waiter.count += 1
        deadline = asyncio.get_running_loop().time() + wait
        try:
            while True:
                lease = self.state.lease_for_kernel(*key)
                if lease is not None:
                    req = queued.request
                    if req is not None:
                        self.metrics.observe_queue_wait(self.clock() - req.arrived_at)
                    return AcquireResult(201, lease=lease)
                req = self.state.queue.get(key)
                if req is None:
                    raise LeaseGone(
                        "Your queued GPU request was cancelled before a GPU became free. "
                        "Start the kernel again to rejoin the queue.",
                        state="cancelled",
                    )
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    now = self.clock()
                    req.last_polled_at = now
                    return AcquireResult(
                        202,
                        request=req,
                        position=core.position_of(self.state, key, now, self.policy),
                        reason=queued.reason,
                    )
                waiter.event.clear()
                try:
                    await asyncio.wait_for(waiter.event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            waiter.count -= 1
            if waiter.count <= 0:
                self._waiters.pop(key, None)
            req = self.state.queue.get(key)
            if req is not None:
                req.last_polled_at = self.clock()

    # -- renew / release ----------------------------------------------------------------
    def renew(
        self,
        ident: Identity,
        lease_id: str,
        *,
        pid: int | None = None,
        execution_state: str | None = None,
        last_activity: float | None = None,
    ) -> Lease:
        """``POST /api/v1/leases/{id}/renew``: a new TTL; 410 with the reason if it ended."""
        lease = self.state.leases.get(lease_id)
        if lease is None:
            ended = self._visible_lease(ident, lease_id)
            raise _gone(ended)
        self._check_owner(ident, lease)
        now = self.clock()
        fresh = core.renewed(lease, now, self.policy, pid, execution_state, last_activity)
        self.store.renew_lease(
            lease_id,
            fresh.renewed_at,
            fresh.expires_at,
            fresh.pid,
            fresh.execution_state,
            fresh.last_activity,
        )
        self.state.update_lease(fresh)
        return fresh

    def release(self, ident: Identity, lease_id: str) -> None:
        """``DELETE /api/v1/leases/{id}``: end a lease, or cancel a queued request. Idempotent."""
        lease = self.state.leases.get(lease_id)
        if lease is None:
            req = next((r for r in self.state.queue.values() if r.id == lease_id), None)
            if req is not None:
                self._check_owner(ident, req)
                self.store.delete_requests([req.id])
                self.state.queue.pop(req.key, None)
                self._wake([req.key])
                log.info("Cancelled queued request of %s kernel %s", req.user, req.kernel_id)
                self._drain(self.clock())
                return
            self._visible_lease(ident, lease_id)  # 404 / 403, else already ended: fine
            return
        self._check_owner(ident, lease)
        now = self.clock()
        self._end([(lease, "released", None)], now)
        log.info("Released lease %s… of %s kernel %s", lease_id[:6], lease.user, lease.kernel_id)
        self._drain(now)

    def revoke(self, ident: Identity, lease_id: str, reason: str) -> Lease:
        """An admin ends someone's lease; its provisioner stops the kernel and shows ``reason``.

        Called by ``POST /api/v1/leases/{id}/revoke``; returns the lease as ended.
        """
        self._require_admin(ident)
        lease = self.state.leases.get(lease_id)
        if lease is None:
            raise _gone(self._visible_lease(ident, lease_id))
        now = self.clock()
        self._end([(lease, "revoked", reason)], now)
        log.info(
            "Revoked lease %s… of %s kernel %s by %s: %s",
            lease_id[:6],
            lease.user,
            lease.kernel_id,
            ident.user,
            reason,
        )
        self._drain(now)
        return replace(lease, state="revoked", ended_at=now, reason=reason)

    # -- reads ------------------------------------------------------------------------
    def get_lease(self, ident: Identity, lease_id: str) -> Lease:
        lease = self.state.leases.get(lease_id)
        if lease is not None:
            self._check_owner(ident, lease)
            return lease
        return self._visible_lease(ident, lease_id)

    def list_leases(
        self,
        ident: Identity,
        *,
        user: str | None = None,
        all_users: bool = False,
        history: bool = False,
    ) -> list[Lease]:
        """Own leases; admins may ask for ``all_users`` or another ``user``."""
        if (all_users or (user is not None and user != ident.user)) and not ident.admin:
            raise Forbidden("Only GPU lease admins may list other users' leases.")
        who = None if all_users and user is None else (user or ident.user)
        if history:
            return self.store.list_leases(user=who)
        leases = self.state.leases.values()
        return sorted(
            (x for x in leases if who is None or x.user == who), key=lambda x: x.created_at
        )

    def queue(self, ident: Identity) -> list[dict[str, Any]]:
        now = self.clock()
        out = []
        for pos, req in enumerate(core.queue_order(self.state, now, self.policy), start=1):
            if ident.admin or req.user == ident.user:
                out.append(
                    {
                        "id": req.id if (ident.admin or req.user == ident.user) else None,
                        "position": pos,
                        "user": req.user,
                        "kernel_id": req.kernel_id,
                        "fraction": ppm_to_fraction(req.fraction_ppm),
                        "group": req.group,
                        "priority": req.priority,
                        "waiting_s": round(now - req.arrived_at, 3),
                    }
                )
        return out

    def gpus(self) -> list[dict[str, Any]]:
        st = self.state
        return [
            {
                **g.to_json(),
                "index": g.index,
                "allocated_fraction": ppm_to_fraction(st.allocated.get(g.uuid, 0)),
                "allocated_mb": st.allocated.get(g.uuid, 0) * g.memory_mb // 1_000_000,
                "capacity_fraction": ppm_to_fraction(self.policy.capacity_ppm),
                "leases": st.lease_count.get(g.uuid, 0),
            }
            for g in st.ordered_gpus()
        ]

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "version": __version__,
            "gpus": len(self.state.gpus),
            "active_leases": len(self.state.leases),
            "queued": len(self.state.queue),
            "uptime_s": round(self.clock() - self.started_at, 3),
        }

    # -- quotas and usage ---------------------------------------------------------------
    def get_quota(self, ident: Identity, level: str, name: str = "") -> dict[str, Any]:
        """A quota record; users may read the default, their own and their groups' quotas."""
        _check_level(level)
        if not ident.admin:
            if level == "user" and name != ident.user:
                raise Forbidden("You may read only your own quota.")
            if level == "group" and name not in ident.groups:
                raise Forbidden("You may read only the quotas of groups you belong to.")
        quota = self._quota_record(level, name)
        if quota is None:
            raise LeaseNotFound(f"No {level} quota is set for {name!r}.")
        body = quota.to_json()
        if level == "user":
            groups = ident.groups if name == ident.user else frozenset()
            body["effective"] = core.effective_quota(self.quotas, name, groups).to_json()
        return body

    def my_quota(self, ident: Identity) -> dict[str, Any]:
        """The caller's effective quota and what they hold now."""
        eff = core.effective_quota(self.quotas, ident.user, ident.groups)
        return {
            "user": ident.user,
            "effective": eff.to_json(),
            "held_fraction": ppm_to_fraction(self.state.held_by_user.get(ident.user, 0)),
            "leases": self.state.leases_by_user.get(ident.user, 0),
            "groups": sorted(ident.groups),
            "admin": ident.admin,
        }

    def list_quotas(self, ident: Identity) -> dict[str, Any]:
        self._require_admin(ident)
        return {
            "default": self.quotas.default.to_json(),
            "groups": {k: v.to_json() for k, v in sorted(self.quotas.groups.items())},
            "users": {k: v.to_json() for k, v in sorted(self.quotas.users.items())},
        }

    def put_quota(self, ident: Identity, level: str, name: str, quota: Quota) -> dict[str, Any]:
        self._require_admin(ident)
        _check_level(level)
        self.store.put_quota(level, name if level != "default" else "", quota)
        self._set_quota(level, name, quota)
        log.info("Quota %s %r set by %s: %s", level, name, ident.user, quota.to_json())
        self._drain(self.clock())
        return quota.to_json()

    def apply_quotas(self, entries: list[tuple[str, str, Quota]], source: str) -> int:
        """Set every ``(level, name, quota)`` of a quotas file, without an identity.

        Called by ``app.py`` (``--quotas-file``) after :meth:`start`, before listening, on
        every broker start: the file's entries replace what the API set for the same
        default/group/user; quotas the file does not name are left as they are.
        """
        for level, name, quota in entries:
            _check_level(level)
            name = name if level != "default" else ""
            self.store.put_quota(level, name, quota)
            self._set_quota(level, name, quota)
        log.info("Applied %d quota(s) from %s", len(entries), source)
        self._drain(self.clock())
        return len(entries)

    def delete_quota(self, ident: Identity, level: str, name: str = "") -> None:
        self._require_admin(ident)
        _check_level(level)
        self.store.delete_quota(level, name if level != "default" else "")
        if level == "default":
            self.quotas.default = Quota()
        elif level == "group":
            self.quotas.groups.pop(name, None)
        else:
            self.quotas.users.pop(name, None)
        log.info("Quota %s %r removed by %s", level, name, ident.user)

    def usage(self, ident: Identity, since: float, by: str = "user") -> dict[str, float]:
        """Fraction-hours per user or group since ``since``; a student sees only their own."""
        if by not in ("user", "group"):
            raise InvalidRequest("'by' must be 'user' or 'group'.")
        now = self.clock()
        if since > now:
            raise InvalidRequest("'since' is in the future.")
        if not ident.admin and by == "user":
            return {ident.user: self.store.user_usage(ident.user, since, now)}
        rows = self.store.usage(since, now, by)
        if not ident.admin:
            rows = {k: v for k, v in rows.items() if k in ident.groups}
        return rows

    # -- the reaper -------------------------------------------------------------------
    def tick(self) -> dict[str, int]:
        """One reaper pass: expire, drop stale requests, reclaim idle leases, drain the queue.

        Called every ``reap_interval`` seconds by ``app.py``. A gap much longer than
        expected since the last pass (longer than ``max(ttl / 2, 3 * reap_interval)``:
        a suspended process, a clock jump forward) or a clock going backward is treated
        like a restart: every active lease expires exactly one TTL from now instead of
        expiring at once (forward) or only when the clock catches up (backward).
        """
        now = self.clock()
        last = self._last_tick if self._last_tick is not None else now
        self._last_tick = now
        counts = {"expired": 0, "dropped": 0, "revoked": 0, "granted": 0, "grace": 0}
        stall = max(self.policy.ttl / 2, 3 * self.reap_interval)
        if now - last > stall or now < last:
            counts["grace"] = self.store.reset_active_expiry(now + self.policy.ttl)
            for lease in list(self.state.leases.values()):
                lease.expires_at = now + self.policy.ttl
            for req in self.state.queue.values():
                req.last_polled_at = now
            log.warning(
                "Reaper saw a %.0f s gap (clock jump or stall): gave %d lease(s) a TTL of grace",
                now - last,
                counts["grace"],
            )
            return counts
        gone = core.expired(self.state, now)
        if gone:
            self._end([(x, "expired", "not renewed within its TTL") for x in gone], now)
            counts["expired"] = len(gone)
            log.info("Expired %d lease(s) not renewed in time", len(gone))
        stale = core.stale_requests(self.state, now, self.policy, set(self._waiters))
        if stale:
            self.store.delete_requests([r.id for r in stale])
            for r in stale:
                self.state.queue.pop(r.key, None)
            counts["dropped"] = len(stale)
            log.info("Dropped %d queued request(s) whose clients stopped polling", len(stale))
        victims = core.idle_victims(self.state, now, self.policy)
        if victims:
            limit = self.policy.idle_reclaim_after or 0
            self._end(
                [
                    (
                        x,
                        "revoked",
                        f"the kernel was idle for more than {limit / 60:g} minutes while "
                        "other students waited for a GPU",
                    )
                    for x in victims
                ],
                now,
            )
            counts["revoked"] = len(victims)
            log.info("Revoked %d idle lease(s) for waiting requests", len(victims))
        counts["granted"] = self._drain(now)
        return counts

    # -- internals ----------------------------------------------------------------------
    def _drain(self, now: float) -> int:
        grants = core.drain(self.state, now, self.policy)
        self._persist_grants(grants)
        return len(grants)

    def _persist_grants(self, grants: list[Grant]) -> None:
        if not grants:
            return
        try:
            self.store.insert_leases(
                [g.lease for g in grants],
                self.policy.capacity_ppm,
                [g.request.id for g in grants if g.request is not None],
            )
        except CapacityConflict:
            # another writer changed the database under us: our memory is stale
            log.error("The database disagrees with this broker's state; reloading it")
            self._reload()
            raise
        core.apply_grants(self.state, grants)
        self._wake([g.lease.user_kernel for g in grants])

    def _end(self, ends: list[tuple[Lease, str, str | None]], now: float) -> None:
        self.store.end_leases([(x.id, st, now, reason) for x, st, reason in ends])
        core.apply_ends(self.state, [x.id for x, _, _ in ends])
        by_state: dict[str, int] = {}
        for _, st, _ in ends:
            by_state[st] = by_state.get(st, 0) + 1
        for st, n in by_state.items():
            self.metrics.ended(st, n)

    def _reload(self) -> None:
        leases, queue = self.store.load_active()
        known = {g.uuid for g in self.declared}
        self.state = PoolState.build(
            self.declared, [x for x in leases if x.gpu_uuid in known], queue
        )

    def _wake(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            waiter = self._waiters.get(key)
            if waiter is not None:
                waiter.event.set()

    def _visible_lease(self, ident: Identity, lease_id: str) -> Lease:
        lease = self.store.get_lease(lease_id)
        if lease is None:
            raise LeaseNotFound(f"No GPU lease has the id {lease_id!r}.")
        self._check_owner(ident, lease)
        return lease

    @staticmethod
    def _check_owner(ident: Identity, obj: Lease | Request) -> None:
        if obj.user != ident.user and not ident.admin:
            raise Forbidden("This GPU lease belongs to another user.")

    @staticmethod
    def _require_admin(ident: Identity) -> None:
        if not ident.admin:
            raise Forbidden(
                "Only GPU lease admins (JupyterHub admins or holders of the "
                "custom:gpu-lease:admin scope) may do this."
            )

    def _set_quota(self, level: str, name: str, quota: Quota) -> None:
        """Mirror a quota the store just recorded in the in-memory book."""
        if level == "default":
            self.quotas.default = quota
        elif level == "group":
            self.quotas.groups[name] = quota
        else:
            self.quotas.users[name] = quota

    def _quota_record(self, level: str, name: str) -> Quota | None:
        if level == "default":
            return self.quotas.default
        book = self.quotas.groups if level == "group" else self.quotas.users
        return book.get(name)


def _check_level(level: str) -> None:
    if level not in QUOTA_LEVELS:
        raise InvalidRequest(f"Quota level must be one of {', '.join(QUOTA_LEVELS)}.")


def _gone(lease: Lease) -> LeaseGone:
    """The 410 for a lease that is no longer active, with its state and reason."""
    if lease.state == "revoked":
        return LeaseRevoked(
            f"Your GPU lease was revoked: {lease.reason or 'by an administrator'}.",
            state="revoked",
            reason=lease.reason,
        )
    if lease.state == "expired":
        return LeaseExpired(
            "Your GPU lease expired because it was not renewed in time "
            "(was the Jupyter server stopped or cut off from the broker?).",
            state="expired",
            reason=lease.reason,
        )
    return LeaseGone("This GPU lease was released.", state=lease.state, reason=lease.reason)


__all__ = ["AcquireResult", "BrokerService", "CannotFit", "Conflict", "Metrics", "new_id"]
