"""The broker's service: one core and the services that share it.

Who calls this: ``app.py`` builds one :class:`BrokerService`, :meth:`~BrokerService.start`
it before listening and :meth:`~BrokerService.close` it at shutdown; the HTTP handlers
call the service that does the job, one call per request:

- ``service.leases`` (``leases.py``): acquire, renew, release, revoke;
- ``service.resumes`` (``resume.py``): resuming parked leases, with its long-poll;
- ``service.kernels`` (``node_kernels.py``): remote kernels, launched by the lease's node;
- ``service.quotas`` (``quotas.py``): quotas and usage;
- ``service.nodes`` (``nodes.py``): node agents' registrations, heartbeats and over-use;
- ``service.queries`` (``queries.py``): reads (leases, queue, GPUs, health, history);
- ``service.sessions`` (``sessions.py``): class sessions (the timetable, instructors);
- ``service.reaper`` (``reaper.py``): the reaper's passes, which ``app.py`` runs;
- ``service.core`` (``core.py``): the state they share, and the one way to change it
  (decide, commit through the writer, answer; reconcile after a refused batch).

Methods return outcomes (leases, plain dicts) or raise ``errors``; only the handlers
turn them into HTTP statuses and JSON. With ``--http-processes N`` the fronts reach the
same services through ``remote.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...errors import CannotFit, Conflict, GPULeaseError
from ...model import GPU, PoolState
from ...wire import ENDED_LEASE_STATES
from ..rules.policy import Policy
from ..store.store import Store
from .leases import AcquireResult, LeaseService
from .node_kernels import NodeKernelService
from .nodes import Heartbeat, NodeService, NodeView
from .queries import GPUHolding, Health, History, LeaseUsage, QueryService, Waiting
from .quotas import QuotaService, QuotaStanding
from .reaper import Reaper
from .resume import ResumeResult, ResumeService
from .service_core import REAP_INTERVAL, Metrics, ParkSettings, ServiceCore, new_id
from .sessions import SessionService

log = logging.getLogger("gpu_lease.broker")


class BrokerService:
    """The broker's services over one shared core; ``start`` and ``close`` are its life."""

    def __init__(
        self,
        store: Store,
        gpus: list[GPU],
        policy: Policy,
        *,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        id_factory: Callable[[], str] = new_id,
        reap_interval: float = REAP_INTERVAL,
        park: ParkSettings | None = None,
    ) -> None:
        self.core = ServiceCore(
            store,
            gpus,
            policy,
            clock=clock,
            metrics=metrics,
            id_factory=id_factory,
            reap_interval=reap_interval,
            park=park,
        )
        self.leases = LeaseService(self.core)
        self.resumes = ResumeService(self.core)
        self.kernels = NodeKernelService(self.core)
        self.quotas = QuotaService(self.core)
        self.nodes = NodeService(self.core)
        self.queries = QueryService(self.core)
        self.reaper = Reaper(self.core)
        self.sessions = SessionService(self.core)

    @property
    def state(self) -> PoolState:
        """The pool in memory now (the metrics collector reads it at each scrape)."""
        return self.core.state

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def store(self) -> Store:
        return self.core.store

    def clock(self) -> float:
        """The service's time now (the handlers parse relative times with it)."""
        return self.core.clock()

    # -- start-up and shutdown -----------------------------------------------------------
    def start(self) -> None:
        """Open the store, register the GPUs, rebuild state, give every active lease a TTL of grace.

        Called once by ``app.py`` before the HTTP server listens.
        """
        now = self.core.clock()
        self.core.store.open()
        self.core.nodes = {n.name: n for n in self.core.store.load_nodes(seen_at=now)}
        pool = self.core.pool()
        self.core.store.sync_gpus(pool, self.core.policy.capacity_ppm)
        grace = self.core.store.extend_active(now + self.core.policy.ttl)
        # a restart is not the clients' fault: waiting requests get a fresh poll window
        self.core.load(now, {}, pool)
        self.core.book = self.core.store.load_quotas()
        for ended in self.core.store.list_leases(
            states=ENDED_LEASE_STATES, limit=self.core.holds.limit
        ):
            if ended.ended_at is not None:
                self.core.holds.add(ended.ended_at - ended.created_at)
        self.core.started_at = now
        self.core.last_tick = now
        self.core.drain_before_serving(now)
        log.info(
            "Broker state loaded: %d GPU(s), %d active lease(s), %d parked (%d given a TTL "
            "of grace), %d waiting",
            len(self.core.state.gpus),
            len(self.core.state.leases),
            len(self.core.state.parked),  # held, but holding no GPU memory: not "active"
            grace,
            len(self.core.state.queue),
        )

    def close(self) -> None:
        """Stop serving (waiting long-polls answer 503), persist the heartbeats not yet
        persisted, and close the store. Called at shutdown, after the loop's last request."""
        self.core.stop_serving("shutting down")
        self.core.writer.stop()
        beats = self.core.take_renewed(self.core.clock())
        if beats:
            try:
                self.core.store.write_changes([beats], self.core.policy.capacity_ppm)
            except GPULeaseError as exc:
                log.warning("Could not record the last heartbeats at shutdown: %s", exc.message)
        self.core.store.close()


__all__ = [
    "AcquireResult",
    "BrokerService",
    "CannotFit",
    "Conflict",
    "GPUHolding",
    "Health",
    "Heartbeat",
    "History",
    "LeaseUsage",
    "Metrics",
    "NodeView",
    "ParkSettings",
    "QuotaStanding",
    "ResumeResult",
    "Waiting",
    "new_id",
]
