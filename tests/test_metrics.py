"""Prometheus metrics: the scrape-time pool collector and the service's event metrics.

The exposition is parsed back with prometheus_client's own parser, so these tests
check what Prometheus would read, not strings.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from provisioner._version import __version__
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.services.broker_service import BrokerService
from provisioner.broker.store.store import Store
from provisioner.broker.web.metrics import BrokerMetrics
from provisioner.errors import CannotFit
from provisioner.inventory import parse_gpu_spec
from provisioner.model import Identity, Lease, PoolState, Request

MIB = 1024 * 1024

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics: BrokerMetrics) -> Samples:
    body, ctype = metrics.render()
    assert ctype == prometheus_client.CONTENT_TYPE_LATEST
    assert ctype.startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def lease(n: int, gpu_uuid: str, ppm: int, user: str) -> Lease:
    return Lease(
        id=f"lease-{n}",
        user=user,
        kernel_id=f"k{n}",
        gpu_uuid=gpu_uuid,
        fraction_ppm=ppm,
        memory_limit_mb=100,
        state="active",
        created_at=0.0,
        renewed_at=0.0,
        expires_at=90.0,
    )


@pytest.fixture
def pool() -> SimpleNamespace:
    """What BrokerService exposes to the collector: ``state`` and ``policy``."""
    v100, t4 = parse_gpu_spec("gpu-a/1x32768:V100,gpu-b/1x16384:T4")
    leases = [
        lease(1, v100.uuid, 20_000, "alice"),
        lease(2, v100.uuid, 20_000, "alice"),
        lease(3, v100.uuid, 20_000, "bob"),
        lease(4, t4.uuid, 500_000, "bob"),
    ]
    queue = [Request("r1", "carol", "k9", 600_000, arrived_at=1.0, last_polled_at=1.0)]
    state = PoolState.build([v100, t4], leases, queue)
    return SimpleNamespace(state=state, policy=Policy(reserve_ppm=100_000), v100=v100, t4=t4)


def test_pool_gauges_read_state_at_scrape(pool: SimpleNamespace) -> None:
    metrics = BrokerMetrics(lambda: pool)
    s = scrape(metrics)
    v100 = {"uuid": pool.v100.uuid, "node": "gpu-a", "name": "V100"}
    t4 = {"uuid": pool.t4.uuid, "node": "gpu-b", "name": "T4"}
    assert value(s, "gpu_lease_gpu_allocated_fraction", **v100) == 0.06
    assert value(s, "gpu_lease_gpu_allocated_fraction", **t4) == 0.5
    assert value(s, "gpu_lease_gpu_leases", **v100) == 3
    assert value(s, "gpu_lease_gpu_leases", **t4) == 1
    # bytes (Prometheus's base unit) of the MiB GET /api/v1/gpus reports
    assert value(s, "gpu_lease_gpu_memory_bytes", **v100) == 32768 * MIB
    # as GET /api/v1/gpus reports it: floor(allocated fraction x memory)
    assert (
        value(s, "gpu_lease_gpu_allocated_memory_bytes", **v100)
        == 60_000 * 32768 // 1_000_000 * MIB
    )
    assert value(s, "gpu_lease_gpu_allocated_memory_bytes", **t4) == 8192 * MIB
    assert not any(name.endswith("_mb") for name, _ in s)  # promtool refuses unit abbreviations
    assert value(s, "gpu_lease_gpu_capacity_fraction", **t4) == 0.9
    assert value(s, "gpu_lease_queue_length") == 1
    assert value(s, "gpu_lease_active_leases") == 4
    assert value(s, "gpu_lease_user_held_fraction", user="alice") == 0.04
    assert value(s, "gpu_lease_user_held_fraction", user="bob") == 0.52
    assert ("gpu_lease_user_held_fraction", (("user", "carol"),)) not in s
    assert value(s, "gpu_lease_info", version=__version__) == 1

    # read at scrape time, not at construction
    pool.state.remove_lease("lease-1")
    s = scrape(metrics)
    assert value(s, "gpu_lease_gpu_allocated_fraction", **v100) == 0.04
    assert value(s, "gpu_lease_active_leases") == 3


def test_per_user_series_can_be_turned_off(pool: SimpleNamespace) -> None:
    s = scrape(BrokerMetrics(lambda: pool, per_user=False))
    assert not any(name == "gpu_lease_user_held_fraction" for name, _ in s)
    assert value(s, "gpu_lease_active_leases") == 4


def test_before_the_service_exists_only_info() -> None:
    calls = []

    def getter() -> None:
        calls.append(1)
        return None

    metrics = BrokerMetrics(getter)
    assert calls == []  # registering does not call the getter
    s = scrape(metrics)
    assert value(s, "gpu_lease_info", version=__version__) == 1
    assert not any(name.startswith("gpu_lease_gpu_") for name, _ in s)
    assert ("gpu_lease_queue_length", ()) not in s


def test_event_metrics() -> None:
    metrics = BrokerMetrics(lambda: None)
    metrics.observe_acquire(0.0004, "granted")
    metrics.observe_acquire(0.003, "granted")
    metrics.observe_acquire(299.0, "queued")
    metrics.observe_queue_wait(42.0)
    metrics.refused("quota_exceeded")
    metrics.refused("quota_exceeded")
    metrics.refused("cannot_fit")
    metrics.ended("expired", 3)
    metrics.ended("released", 1)
    metrics.ended("revoked", 0)
    s = scrape(metrics)
    h = "gpu_lease_acquire_seconds"
    assert value(s, h + "_count", outcome="granted") == 2
    assert value(s, h + "_bucket", outcome="granted", le="0.0005") == 1
    assert value(s, h + "_bucket", outcome="granted", le="0.005") == 2
    assert value(s, h + "_bucket", outcome="queued", le="300.0") == 1
    assert value(s, h + "_sum", outcome="queued") == 299.0
    assert value(s, "gpu_lease_queue_wait_seconds_count") == 1
    assert value(s, "gpu_lease_queue_wait_seconds_bucket", le="60.0") == 1
    assert value(s, "gpu_lease_refusals_total", reason="quota_exceeded") == 2
    assert value(s, "gpu_lease_refusals_total", reason="cannot_fit") == 1
    assert value(s, "gpu_lease_leases_ended_total", state="expired") == 3
    assert value(s, "gpu_lease_leases_ended_total", state="released") == 1
    assert ("gpu_lease_leases_ended_total", (("state", "revoked"),)) not in s


def test_own_registry_not_the_global_one(pool: SimpleNamespace) -> None:
    a = BrokerMetrics(lambda: pool)
    b = BrokerMetrics(lambda: None)  # a second one in the same process does not collide
    a.refused("forbidden")
    assert a.registry is not prometheus_client.REGISTRY
    assert value(scrape(a), "gpu_lease_refusals_total", reason="forbidden") == 1
    assert ("gpu_lease_refusals_total", (("reason", "forbidden"),)) not in scrape(b)
    assert b"gpu_lease_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


async def test_with_a_real_broker_service(tmp_path: Any) -> None:
    """The real service reports into BrokerMetrics; the collector reads its state."""
    now = [1000.0]
    gpus = parse_gpu_spec("1x32768:V100")
    service: BrokerService | None = None
    metrics = BrokerMetrics(lambda: service)
    service = BrokerService(
        Store(f"sqlite:///{tmp_path / 'broker.sqlite'}"),
        gpus,
        Policy(),
        clock=lambda: now[0],
        metrics=metrics,
    )
    service.start()
    try:
        alice = Identity("alice")
        ids = []
        for k in range(3):
            result = await service.leases.acquire(alice, Ask("alice", f"kernel-{k}", 20_000))
            assert result.outcome == "granted" and result.lease is not None
            ids.append(result.lease.id)
        again = await service.leases.acquire(alice, Ask("alice", "kernel-0", 20_000))
        assert again.outcome == "repeated"
        with pytest.raises(CannotFit):  # 0.001 of 32 GiB is below the context overhead
            await service.leases.acquire(alice, Ask("alice", "tiny", 1_000))
        s = scrape(metrics)
        labels = {"uuid": gpus[0].uuid, "node": "local", "name": "V100"}
        assert value(s, "gpu_lease_gpu_allocated_fraction", **labels) == 0.06
        assert value(s, "gpu_lease_gpu_leases", **labels) == 3
        assert value(s, "gpu_lease_active_leases") == 3
        assert value(s, "gpu_lease_user_held_fraction", user="alice") == 0.06
        assert value(s, "gpu_lease_acquire_seconds_count", outcome="granted") == 3
        assert value(s, "gpu_lease_acquire_seconds_count", outcome="repeated") == 1
        assert value(s, "gpu_lease_refusals_total", reason="cannot_fit") == 1

        await service.leases.release(alice, ids[0])
        s = scrape(metrics)
        assert value(s, "gpu_lease_gpu_allocated_fraction", **labels) == 0.04
        assert value(s, "gpu_lease_leases_ended_total", state="released") == 1
    finally:
        service.close()


# -- Prometheus's own linter on a live broker -------------------------------------------------
@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    """SQLite only: the metrics do not depend on the database."""
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool is missing: `make install` installs Debian's prometheus package "
            "where apt-get exists"
        )
    return path


@pytest.mark.slow
def test_promtool_accepts_a_live_brokers_metrics(promtool: str, broker: Any) -> None:
    """``promtool check metrics`` (names, units, types, help) on every family, each with samples."""
    headers = broker.headers("alice")
    api = f"{broker.url}/api/v1"
    held = httpx.post(f"{api}/leases", json={"kernel_id": "k1", "fraction": 0.5}, headers=headers)
    assert held.status_code == 201, held.text
    other = httpx.post(f"{api}/leases", json={"kernel_id": "k2", "fraction": 0.25}, headers=headers)
    assert other.status_code == 201, other.text
    # 327 MiB of a 32 GiB GPU: below the CUDA context overhead, so it can never fit
    refused = httpx.post(
        f"{api}/leases", json={"kernel_id": "k3", "fraction": 0.01}, headers=headers
    )
    assert refused.status_code == 422, refused.text
    assert httpx.delete(f"{api}/leases/{other.json()['id']}", headers=headers).status_code == 204
    r = httpx.get(f"{broker.url}/metrics", headers=broker.headers("admin"))
    assert r.status_code == 200
    body = r.text
    done = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in (
        "gpu_lease_gpu_memory_bytes",
        "gpu_lease_gpu_allocated_memory_bytes",
        "gpu_lease_refusals_total",
        "gpu_lease_leases_ended_total",
        "gpu_lease_acquire_seconds_bucket",
        "gpu_lease_user_held_fraction",
    ):
        assert f"\n{name}{{" in body or f"\n{name} " in body, name
