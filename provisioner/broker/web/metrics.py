"""Prometheus metrics of the broker (``GET /metrics``).

:class:`BrokerMetrics` implements the service's ``Metrics`` protocol (events the
service reports as they happen: acquire latency, queue waits, refusals, ended
leases) and adds a collector that reads the pool at scrape time (allocation per
GPU, queue length, active leases). It owns its ``CollectorRegistry``, never
prometheus_client's global one, so several brokers (or tests) in one process do
not collide; nothing is registered at import.

Metric names (all prefixed ``gpu_lease_``; per-GPU gauges carry ``uuid, node, name``):

* ``acquire_seconds{outcome}`` histogram: time to answer ``POST /api/v1/leases``
  (outcome granted | repeated | queued | other), 0.5 ms to 300 s
* ``queue_wait_seconds`` histogram: arrival in the queue to lease granted
* ``refusals_total{reason}`` counter: acquires refused, by error code
* ``leases_ended_total{state}`` counter: leases ended (released | expired | revoked)
* ``gpu_allocated_fraction``, ``gpu_capacity_fraction`` (1 minus the reserve),
  ``gpu_leases``, ``gpu_memory_bytes``, ``gpu_allocated_memory_bytes`` gauges per GPU
  (bytes, Prometheus's base unit; ``promtool check metrics`` refuses ``_mb`` names, so
  the ``gpu_memory_mb`` and ``gpu_allocated_memory_mb`` of 0.1.0 are gone)
* ``gpu_used_memory_bytes`` per GPU of a node with an agent: what its processes use
* ``nodes{state}`` gauge: registered nodes up | lost | drained
* ``lease_used_memory_bytes{lease_id, user, uuid}`` gauge: what a lease's kernel (and its
  child processes) use, as its node agent last reported (left out with ``per_user=False``)
* ``unleased_gpu_processes`` gauge: GPU processes on agents' nodes that belong to no lease
* ``enforcement_actions_total{action}`` counter: what the agents' enforcement did to
  leases over their cap (reported | revoked | killed); see docs/admins.md, "Node agents"
* ``leases_parked`` gauge: leases parked (their kernel's GPU memory in its node's RAM)
* ``parks_total{outcome}`` counter: idle leases the reaper chose to park, by outcome
  (done | failed | timeout: parking did not finish within park_timeout | refused: revoked
  instead, the node could not park it)
* ``resumes_total{outcome}`` counter: restores of parked kernels (done | failed)
* ``resume_wait_seconds`` histogram: a parked lease's first resume request to active again
* ``session_reserved_fraction{course}``, ``session_used_fraction{course}``,
  ``session_lent_fraction{course}`` gauges: the GPU (in whole GPUs) a class session under
  way (or in its lead time) reserves, how much of it its members use, and how much of it
  is lent back to everyone (``broker/rules/sessions.py``)
* ``session_freed_kernels_total{course}`` counter: non-members' kernels freed (parked or
  revoked) from a class session's share
* ``queue_length``, ``active_leases`` gauges
* ``user_held_fraction{user}`` gauge (left out with ``per_user=False``)
* ``info{version}`` gauge, always 1
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..._version import __version__
from ...model import PoolState, reserved_mb
from ...wire import ppm_to_fraction
from ..rules import sessions
from ..rules.policy import Policy

#: group-commit batch sizes (mutations per transaction)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: acquire latency buckets (s): 0.5 ms to 300 s (the longest long-poll)
ACQUIRE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
#: bytes per MiB: the pool counts MiB, Prometheus wants bytes
MIB = 1024 * 1024
#: queue wait buckets (s): 0.1 s to 1 h
QUEUE_WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class ServiceView(Protocol):
    """What the scrape-time collector reads of ``BrokerService``: these two, and the node
    agents' figures from its ``nodes`` (``NodeService``) where it has one."""

    @property
    def state(self) -> PoolState: ...

    @property
    def policy(self) -> Policy: ...


def _node_view(
    service: ServiceView,
) -> tuple[dict[str, int], dict[str, int], int, dict[str, int]]:
    """Node states, per-GPU used MiB, the unleased GPU processes and per-lease used MiB,
    where the service has node agents (else none)."""
    nodes = getattr(service, "nodes", None)
    if nodes is None:
        return {}, {}, 0, {}
    return (
        nodes.node_states(),
        nodes.gpu_used_mb(),
        nodes.unleased_processes(),
        nodes.lease_used_mb(),
    )


class _PoolCollector(Collector):
    """Reads the pool when Prometheus scrapes; yields nothing but ``info`` before start."""

    def __init__(self, service_getter: Callable[[], ServiceView | None], per_user: bool) -> None:
        self._get = service_getter
        self._per_user = per_user

    def describe(self) -> Iterator[Metric]:
        """Nothing: registering must not call ``service_getter`` (the service may not exist)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "gpu_lease_info", "Version of the GPU lease broker (always 1).", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        service = self._get()
        if service is None:
            return
        state = service.state
        capacity = service.policy.capacity_ppm
        labels = ["uuid", "node", "name"]
        allocated = GaugeMetricFamily(
            "gpu_lease_gpu_allocated_fraction",
            "Sum of the fractions of the active leases on this GPU (0..1).",
            labels=labels,
        )
        capacity_f = GaugeMetricFamily(
            "gpu_lease_gpu_capacity_fraction",
            "Fraction of this GPU that may be leased (1 minus the admin's reserve).",
            labels=labels,
        )
        leases = GaugeMetricFamily(
            "gpu_lease_gpu_leases", "Active leases on this GPU.", labels=labels
        )
        memory = GaugeMetricFamily(
            "gpu_lease_gpu_memory_bytes", "Memory of this GPU in bytes.", labels=labels
        )
        allocated_memory = GaugeMetricFamily(
            "gpu_lease_gpu_allocated_memory_bytes",
            "GPU memory in bytes reserved by the active leases on this GPU.",
            labels=labels,
        )
        for gpu in list(state.ordered_gpus()):
            key = [gpu.uuid, gpu.node, gpu.name]
            ppm = state.allocated.get(gpu.uuid, 0)
            allocated.add_metric(key, ppm_to_fraction(ppm))
            capacity_f.add_metric(key, ppm_to_fraction(capacity))
            leases.add_metric(key, state.lease_count.get(gpu.uuid, 0))
            memory.add_metric(key, gpu.memory_mb * MIB)
            allocated_memory.add_metric(key, reserved_mb(ppm, gpu.memory_mb) * MIB)
        used = GaugeMetricFamily(
            "gpu_lease_gpu_used_memory_bytes",
            "GPU memory in bytes its processes use, as the node agent last reported "
            "(only GPUs of nodes with an agent).",
            labels=labels,
        )
        node_states, used_mb, unleased, lease_used = _node_view(service)
        for gpu in list(state.ordered_gpus()):
            if gpu.uuid in used_mb:
                used.add_metric([gpu.uuid, gpu.node, gpu.name], used_mb[gpu.uuid] * MIB)
        yield from (allocated, capacity_f, leases, memory, allocated_memory, used)
        nodes = GaugeMetricFamily(
            "gpu_lease_nodes", "Registered GPU nodes by state.", labels=["state"]
        )
        for node_state, count in node_states.items():
            nodes.add_metric([node_state], count)
        yield nodes
        yield GaugeMetricFamily(
            "gpu_lease_unleased_gpu_processes",
            "GPU processes on nodes with an agent that belong to no lease.",
            unleased,
        )
        if self._per_user and lease_used:
            by_lease = GaugeMetricFamily(
                "gpu_lease_lease_used_memory_bytes",
                "GPU memory in bytes a lease's kernel and its child processes use, as its "
                "node agent last reported.",
                labels=["lease_id", "user", "uuid"],
            )
            for lease_id, mb in sorted(lease_used.items()):
                lease = state.leases.get(lease_id)
                if lease is not None:
                    by_lease.add_metric([lease_id, lease.user, lease.gpu_uuid], mb * MIB)
            yield by_lease
        yield from _session_gauges(service, state)
        yield GaugeMetricFamily(
            "gpu_lease_queue_length", "Acquire requests waiting in the queue.", len(state.queue)
        )
        yield GaugeMetricFamily(
            "gpu_lease_active_leases", "Active leases on all GPUs.", len(state.leases)
        )
        yield GaugeMetricFamily(
            "gpu_lease_leases_parked",
            "Leases parked: their kernel's GPU memory is in its node's RAM, they hold none.",
            len(state.parked),
        )
        if self._per_user:
            held = GaugeMetricFamily(
                "gpu_lease_user_held_fraction",
                "Sum of the fractions of GPU held by this user's active leases.",
                labels=["user"],
            )
            for user, ppm in sorted(dict(state.held_by_user).items()):
                held.add_metric([user], ppm_to_fraction(ppm))
            yield held


def _session_gauges(service: ServiceView, state: PoolState) -> Iterator[Metric]:
    """The class sessions held now (lead time or hours): reserved, used, lent, per course."""
    held = sessions.shares(state, state_now(), service.policy).held if state.sessions else []
    names = {
        "reserved": "The GPU (in whole GPUs) a class session under way or about to start "
        "reserves for its course's members.",
        "used": "The part of a class session's reserved GPU its course's members use.",
        "lent": "The part of a class session's reserved GPU lent back to everyone (unused "
        "past session_lend_after, until a member asks).",
    }
    for what, doc in names.items():
        family = GaugeMetricFamily(f"gpu_lease_session_{what}_fraction", doc, labels=["course"])
        totals: dict[str, int] = {}
        for h in held:
            ppm = {"reserved": h.reserved_ppm, "used": h.used_ppm, "lent": h.lent_ppm}[what]
            totals[h.course] = totals.get(h.course, 0) + ppm
        for course, ppm in sorted(totals.items()):
            family.add_metric([course], ppm_to_fraction(ppm))
        yield family


def state_now() -> float:
    """The scrape's clock (the broker's wall clock)."""
    return time.time()


class BrokerMetrics:
    """The broker's metrics; pass it to ``BrokerService(metrics=...)``.

    ``service_getter`` returns the running service (or None before it started);
    it is called at each scrape, so the metrics object can be built before the
    service. ``per_user=False`` leaves out ``gpu_lease_user_held_fraction`` (one
    series per user holding a lease) for very large hubs. The handler of
    ``GET /metrics`` answers with :meth:`render`.
    """

    def __init__(
        self,
        service_getter: Callable[[], ServiceView | None],
        *,
        per_user: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self._acquire = Histogram(
            "gpu_lease_acquire_seconds",
            "Time the broker took to answer an acquire (POST /api/v1/leases), by outcome.",
            ["outcome"],
            buckets=ACQUIRE_BUCKETS,
            registry=self.registry,
        )
        self._queue_wait = Histogram(
            "gpu_lease_queue_wait_seconds",
            "Time a queued request waited until it was granted a lease.",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self._refusals = Counter(
            "gpu_lease_refusals",
            "Acquire requests refused, by error code (quota_exceeded, cannot_fit, ...).",
            ["reason"],
            registry=self.registry,
        )
        self._ended = Counter(
            "gpu_lease_leases_ended",
            "Leases that ended, by how (released, expired, revoked).",
            ["state"],
            registry=self.registry,
        )
        self._enforced = Counter(
            "gpu_lease_enforcement_actions",
            "What node agents' enforcement did to leases over their cap, by action "
            "(reported, revoked, killed).",
            ["action"],
            registry=self.registry,
        )
        self._parks = Counter(
            "gpu_lease_parks",
            "Idle leases the reaper chose to park, by outcome (done, failed, timeout: not "
            "parked within park_timeout, refused: revoked instead, its node could not park it).",
            ["outcome"],
            registry=self.registry,
        )
        self._resumes = Counter(
            "gpu_lease_resumes",
            "Restores of parked kernels by their node agents, by outcome (done, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self._resume_wait = Histogram(
            "gpu_lease_resume_wait_seconds",
            "Time from a parked lease's resume request to the lease active again.",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self._batches = Histogram(
            "gpu_lease_commit_batch_size",
            "Changes (acquires, releases, reaper passes, ...) persisted per database "
            "transaction by the broker's group commit.",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self._freed = Counter(
            "gpu_lease_session_freed_kernels",
            "Non-members' kernels freed (parked or revoked) from a class session's share.",
            ["course"],
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(service_getter, per_user))

    # -- service.Metrics ------------------------------------------------------------
    def observe_acquire(self, seconds: float, outcome: str) -> None:
        """Called by ``LeaseService.acquire`` once per answered acquire."""
        self._acquire.labels(outcome=outcome).observe(max(0.0, seconds))

    def observe_queue_wait(self, seconds: float) -> None:
        """Called by the service when a queued request is granted."""
        self._queue_wait.observe(max(0.0, seconds))

    def refused(self, reason: str) -> None:
        """Called by the service when an acquire fails; ``reason`` is the error code."""
        self._refusals.labels(reason=reason).inc()

    def ended(self, state: str, count: int) -> None:
        """Called by the service after ``count`` leases ended in ``state``."""
        if count > 0:
            self._ended.labels(state=state).inc(count)

    def enforced(self, action: str, count: int) -> None:
        """Called by the service when enforcement reported, revoked or killed ``count``."""
        if count > 0:
            self._enforced.labels(action=action).inc(count)

    def parked(self, outcome: str, count: int) -> None:
        """Called by the service for parks decided: done, failed, timeout, refused."""
        if count > 0:
            self._parks.labels(outcome=outcome).inc(count)

    def resumed(self, outcome: str, count: int) -> None:
        """Called by the service when node agents report restores done or failed."""
        if count > 0:
            self._resumes.labels(outcome=outcome).inc(count)

    def observe_resume_wait(self, seconds: float) -> None:
        """Called by the service when a resumed lease is active again."""
        self._resume_wait.observe(max(0.0, seconds))

    def session_freed(self, course: str, count: int) -> None:
        """Called by the reaper for kernels freed from ``course``'s session share."""
        if count > 0:
            self._freed.labels(course=course).inc(count)

    def committed(self, changes: int) -> None:
        """Called by the writer's thread after each transaction of ``changes`` mutations."""
        self._batches.observe(changes)

    # -- exposition -------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The text exposition (body, Content-Type) for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = [
    "ACQUIRE_BUCKETS",
    "BATCH_BUCKETS",
    "MIB",
    "QUEUE_WAIT_BUCKETS",
    "BrokerMetrics",
    "ServiceView",
]
