"""Helpers shared by the hostile-input and authorization tests (``test_authz``,
``test_fuzz_bodies``, ``test_fuzz_openapi``): extra static tokens, broker state
snapshots and the capacity invariant, all over HTTP against a real broker."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from typing import Any

import httpx

from .conftest import Broker
from .conftest import postgres_schema as _postgres_schema

#: a token the broker never issued (looks like the real ones)
FORGED = "tok-alice-00000000000000000000000000000000"


def add_tokens(broker: Broker, entries: dict[str, dict[str, Any]]) -> None:
    """Give each ``label`` a new token for ``entry`` (``{"user": ..., "expires_at": ...}``).

    The token goes into the running broker's tokens file (re-read when its modification
    time changes; the time is bumped explicitly so that a write within the file system's
    resolution counts) and into ``broker.tokens[label]``, so ``broker.headers(label)``
    sends it.
    """
    data = json.loads(broker.tokens_file.read_text(encoding="utf-8"))
    for label, entry in entries.items():
        token = f"tok-{uuid.uuid4().hex}"
        data[token] = entry
        broker.tokens[label] = token
    broker.tokens_file.write_text(json.dumps(data), encoding="utf-8")
    later = time.time() + 1
    os.utime(broker.tokens_file, (later, later))


def secrets_of(broker: Broker) -> list[str]:
    """Every token string the broker knows (static users and those added by ``add_tokens``)."""
    return sorted(set(broker.tokens.values()))


def state(broker: Broker) -> dict[str, Any]:
    """GPUs, active leases, the queue and every quota, as the admin sees them."""
    with httpx.Client(base_url=f"{broker.url}/api/v1", headers=broker.headers("admin")) as c:
        out = {}
        for name, path, params in (
            ("gpus", "/gpus", {}),
            ("leases", "/leases", {"all": "1"}),
            ("queue", "/queue", {}),
            ("quotas", "/quotas", {}),
        ):
            r = c.get(path, params=params)
            assert r.status_code == 200, (path, r.status_code, r.text)
            out[name] = r.json()
    # the clock moves: waiting times are not state
    for req in out["queue"]["queue"]:
        req.pop("waiting_s", None)
    return out


def assert_capacity(broker: Broker) -> dict[str, Any]:
    """Per GPU: allocated fraction <= capacity, and equal to the sum of its active leases."""
    st = state(broker)
    per_gpu: dict[str, float] = {}
    for lease in st["leases"]["leases"]:
        if lease["state"] == "active":
            per_gpu[lease["gpu"]["uuid"]] = per_gpu.get(lease["gpu"]["uuid"], 0.0) + float(
                lease["fraction"]
            )
    for gpu in st["gpus"]["gpus"]:
        allocated = float(gpu["allocated_fraction"])
        assert allocated <= float(gpu.get("capacity_fraction", 1.0)) + 1e-9, gpu
        assert allocated <= 1.0 + 1e-9, gpu
        assert abs(allocated - per_gpu.get(gpu["uuid"], 0.0)) < 1e-6, (gpu, per_gpu)
    return st


def postgres_schema() -> contextlib.AbstractContextManager[str]:
    """A database URL of a fresh PostgreSQL schema, dropped afterwards (skip if unreachable)."""
    return _postgres_schema("gl_hostile")
