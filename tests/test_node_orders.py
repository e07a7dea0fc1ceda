"""A node's orders long-poll (``GET /api/v1/nodes/{node}/orders``), over a REAL broker.

The agent is played by HTTP calls with its node token, as in ``test_parking_broker.py``:
gpu-a registered, alice's idle kernel holding its GPU, bob asking for it, so that the
reaper orders alice's lease parked. The long-poll must answer as soon as the order is due
(not at its timeout), hand the same order as the heartbeat, wait while nothing changes,
keep its cursor across a broker restart (orders are state), and refuse what the heartbeat
refuses. On SQLite, PostgreSQL and behind a front process (``[sqlite-fronts]``), where it
must not hold up the front's other requests while it waits.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_nodes import NodeBroker, gpus_of, register
from .test_parking_broker import ARGS, Scene

pytestmark = pytest.mark.slow


@pytest.fixture
def pb(tmp_path: Path, broker_db_url: str, broker_http_processes: int) -> Iterator[NodeBroker]:
    """A broker with idle reclaim (0.5 s) and agent tokens (a front process in the
    ``[sqlite-fronts]`` variant)."""
    extra: tuple[str, ...] = ARGS
    if broker_http_processes:
        extra += ("--http-processes", str(broker_http_processes))
    b = NodeBroker(tmp_path, broker_db_url, extra)
    with b.running(timeout=60):
        yield b


@pytest.fixture
def scene(pb: NodeBroker) -> Iterator[Scene]:
    s = Scene(pb)
    yield s
    s.close()


def orders(c: httpx.Client, after: str | None = None, timeout: float = 0) -> dict[str, Any]:
    """One long-poll of gpu-a's orders; its answer."""
    params: dict[str, Any] = {"timeout": timeout}
    if after is not None:
        params["after"] = after
    r = c.get("/nodes/gpu-a/orders", params=params, timeout=timeout + 30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_long_poll_answers_as_soon_as_a_park_is_ordered(pb: NodeBroker, scene: Scene) -> None:
    first = orders(scene.agent)  # no cursor yet: at once
    assert first["node"] == "gpu-a" and first["orders"] == []
    assert orders(scene.agent, "no-such-cursor")["cursor"] == first["cursor"]  # at once too
    started = time.monotonic()
    nothing = orders(scene.agent, first["cursor"], 1.0)  # nothing changes: it waits
    assert time.monotonic() - started >= 0.9
    assert nothing == first

    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        pb.http("agent:gpu-a") as poller,
        pb.http("admin") as admin,
    ):
        waiting = pool.submit(orders, poller, first["cursor"], 60)
        # meanwhile the broker (and its front) answers everything else at once
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            t = time.monotonic()
            assert admin.get("/health").status_code == 200
            scene.beat()
            assert time.monotonic() - t < 1.0
        assert not waiting.done()
        asked = time.monotonic()
        assert scene.bob_asks().status_code == 202
        pushed = waiting.result(timeout=30)
        took = time.monotonic() - asked
    # the reaper runs every 0.2 s: the order arrives with it, not at the poll's 60 s
    assert took < 5.0, took
    assert scene.state() == "parking"
    assert pushed["cursor"] != first["cursor"]
    due = scene.beat()["orders"]
    assert pushed["orders"] == due and [o["action"] for o in due] == ["park"]
    assert due[0]["lease_id"] == scene.id
    # repeated until its outcome: the same cursor, so the next long-poll waits
    started = time.monotonic()
    assert orders(scene.agent, pushed["cursor"], 0.5) == pushed
    assert time.monotonic() - started >= 0.4
    # the outcome settles it: the long-poll of the old cursor answers at once, empty
    assert scene.outcome("park", "done")["orders"] == []
    settled = orders(scene.agent, pushed["cursor"], 30)
    assert settled["orders"] == [] and settled["cursor"] == first["cursor"]


def test_a_restarted_broker_answers_with_the_same_cursor(pb: NodeBroker, scene: Scene) -> None:
    """Orders are state: a broker that restarts while a park is due hands the same order
    under the same cursor (the agent's poll of it waits), and none twice or lost."""
    assert scene.bob_asks().status_code == 202
    scene.wait_state("parking")
    before = orders(scene.agent)
    assert [o["action"] for o in before["orders"]] == ["park"]
    pb.restart()
    with pb.http("agent:gpu-a") as agent:
        assert register(agent, "gpu-a", gpus_of("gpu-a", 1, 16384)).status_code == 200
        started = time.monotonic()
        again = orders(agent, before["cursor"], 1.0)
        assert time.monotonic() - started >= 0.9  # nothing new: it waited
        assert again == before
        assert orders(agent) == before


def test_the_long_poll_is_the_nodes_own(pb: NodeBroker, scene: Scene) -> None:
    with pb.http("agent:gpu-b") as other, pb.http("admin") as admin:
        r = other.get("/nodes/gpu-a/orders", params={"timeout": 0})
        assert r.status_code == 403 and "belongs to node 'gpu-b'" in r.json()["message"]
        r = scene.alice.get("/nodes/gpu-a/orders", params={"timeout": 0})
        assert r.status_code == 403, r.text
        r = admin.get("/nodes/gpu-a/orders", params={"timeout": 0})
        assert r.status_code == 200, r.text
        r = admin.get("/nodes/gpu-z/orders", params={"timeout": 0})
        assert r.status_code == 404 and r.json()["node"] == "gpu-z"
        r = httpx.get(f"{pb.url}/api/v1/nodes/gpu-a/orders", timeout=10)
        assert r.status_code == 401
        for bad in ({"timeout": "-1"}, {"timeout": "301"}, {"timeout": "soon"}, {"after": ""}):
            r = scene.agent.get("/nodes/gpu-a/orders", params=bad)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"] == "invalid_request"
