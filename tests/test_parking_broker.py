"""Lease parking, the broker's side, over a REAL broker subprocess.

A node agent is played by HTTP calls with its node token (as ``test_nodes.py`` does): it
registers one 16 GiB GPU, says in its heartbeats whether it can checkpoint and how much
host memory is free, and reports the outcomes of the park and resume orders the answers
give it. Idle reclaim is on with a short ``idle_reclaim_after`` and a fast reaper, so a
lease idle for half a second is parked (or revoked) as soon as someone waits.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import wait_for

from .test_dashboard import open_dashboard
from .test_nodes import NodeBroker, gpus_of, register

pytestmark = pytest.mark.slow

GPU = "GPU-gpu-a-0"
GPU_MB = 16384
ARGS = (
    "--gpus",
    "agents",
    "--GPULeaseBroker.reap_interval=0.2",
    "--GPULeaseBroker.idle_reclaim_after=0.5",
)


@pytest.fixture
def pb(
    request: pytest.FixtureRequest, tmp_path: Path, broker_db_url: str, broker_http_processes: int
) -> Iterator[NodeBroker]:
    """A broker with idle reclaim (0.5 s) and agent tokens; more options from ``broker_args``."""
    marker = request.node.get_closest_marker("broker_args")
    extra = ARGS + (tuple(marker.args) if marker else ())
    if broker_http_processes:
        extra += ("--http-processes", str(broker_http_processes))
    b = NodeBroker(tmp_path, broker_db_url, extra)
    with b.running(timeout=60):
        yield b


def beat(agent: httpx.Client, **fields: Any) -> dict[str, Any]:
    """One heartbeat of gpu-a's agent (no GPU processes); its answer."""
    r = agent.post("/nodes/gpu-a/heartbeat", json={"usage": [], **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def lease_of(c: httpx.Client, lease_id: str) -> dict[str, Any]:
    r = c.get(f"/leases/{lease_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


class Scene:
    """gpu-a registered; alice's idle kernel holds all of its GPU; bob waits for it."""

    def __init__(self, pb: NodeBroker, *, checkpoint: bool = True, host: int = 100_000) -> None:
        self.pb = pb
        self.agent = pb.http("agent:gpu-a")
        self.alice = pb.http("alice")
        self.bob = pb.http("bob")
        self.host = host
        self.checkpoint = checkpoint
        assert register(self.agent, "gpu-a", gpus_of("gpu-a", 1, GPU_MB)).status_code == 200
        self.beat()
        r = self.alice.post("/leases", json={"kernel_id": "k1", "fraction": 1.0})
        assert r.status_code == 201, r.text
        self.id = r.json()["id"]
        r = self.alice.post(
            f"/leases/{self.id}/renew", json={"pid": 4242, "execution_state": "idle"}
        )
        assert r.status_code == 200, r.text

    def beat(self, **fields: Any) -> dict[str, Any]:
        """A heartbeat that says what the agent can (checkpoint, host memory)."""
        return beat(
            self.agent,
            checkpoint=self.checkpoint,
            host_memory_available_mb=self.host,
            **fields,
        )

    def bob_asks(self, fraction: float = 1.0) -> httpx.Response:
        return self.bob.post("/leases", json={"kernel_id": "k2", "fraction": fraction})

    def state(self) -> str:
        return str(lease_of(self.alice, self.id)["state"])

    def wait_state(self, state: str, timeout: float = 20.0) -> dict[str, Any]:
        return dict(
            wait_for(
                lambda: (x := lease_of(self.alice, self.id))["state"] == state and x,
                timeout,
                what=f"alice's lease to be {state}",
                detail=self.pb.log,
            )
        )

    def outcome(self, action: str, outcome: str, **more: Any) -> dict[str, Any]:
        entry = {"lease_id": self.id, "action": action, "outcome": outcome, **more}
        return self.beat(parking=[entry])

    def park(self) -> None:
        """Bob asks for the whole GPU; alice's idle lease is ordered parked, and parks."""
        assert self.bob_asks().status_code == 202
        self.wait_state("parking")
        orders = self.beat()["orders"]
        assert orders == [
            {
                "lease_id": self.id,
                "action": "park",
                "pid": 4242,
                "pid_ns": None,
                "gpu_uuid": GPU,
                "memory_mb": GPU_MB,
            }
        ]
        assert self.outcome("park", "done", pids=[4243], mb=900, seconds=0.4)["orders"] == []
        r = self.bob_asks()  # the park freed the GPU: bob's request was granted
        assert r.status_code == 200, r.text
        self.bob_id = r.json()["id"]
        # bob's kernel is busy: never a victim of idle reclaim
        r = self.bob.post(f"/leases/{self.bob_id}/renew", json={"execution_state": "busy"})
        assert r.status_code == 200

    def close(self) -> None:
        for c in (self.agent, self.alice, self.bob):
            c.close()


@pytest.fixture
def scene(pb: NodeBroker) -> Iterator[Scene]:
    s = Scene(pb)
    yield s
    s.close()


def metric(pb: NodeBroker, name: str) -> float:
    """The value of one sample of /metrics (0 if absent)."""
    text = httpx.get(f"{pb.url}/metrics", headers=pb.headers("admin"), timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def allocated(c: httpx.Client) -> float:
    return float(
        next(g for g in c.get("/gpus").json()["gpus"] if g["uuid"] == GPU)["allocated_fraction"]
    )


# -- parking ----------------------------------------------------------------------------


def test_an_idle_lease_is_parked_for_a_waiter(pb: NodeBroker, scene: Scene) -> None:
    assert scene.bob_asks().status_code == 202
    parking = scene.wait_state("parking")
    assert parking["parked_at"] is not None
    assert allocated(scene.bob) == 1.0  # a parking lease still holds its share
    scene.park()
    parked = lease_of(scene.alice, scene.id)
    assert parked["state"] == "parked" and parked["gpu"]["uuid"] == GPU
    assert "resume" not in parked  # nobody asked to resume it
    assert allocated(scene.bob) == 1.0  # bob's lease now; alice's holds none
    listed = scene.alice.get("/leases").json()["leases"]
    assert [(x["id"], x["state"]) for x in listed] == [(scene.id, "parked")]
    with pb.http("admin") as admin:
        every = {x["id"]: x["state"] for x in admin.get("/leases?all=1").json()["leases"]}
    assert every == {scene.id: "parked", scene.bob_id: "active"}
    assert metric(pb, 'gpu_lease_parks_total{outcome="done"}') == 1.0
    assert metric(pb, "gpu_lease_leases_parked") == 1.0
    assert f"Parked lease {scene.id[:6]}" in pb.log(limit=10**7)
    # a late or repeated outcome is ignored
    assert scene.outcome("park", "done")["orders"] == []
    assert scene.state() == "parked"


def test_a_failed_park_revokes_with_the_agents_reason(scene: Scene) -> None:
    assert scene.bob_asks().status_code == 202
    scene.wait_state("parking")
    scene.outcome("park", "failed", message="not enough host memory for 900 MiB")
    revoked = scene.wait_state("revoked")
    assert "not enough host memory for 900 MiB" in revoked["reason"]
    assert scene.bob_asks().status_code == 200  # the waiter got the GPU


def test_a_node_without_checkpoint_revokes_as_before(pb: NodeBroker) -> None:
    s = Scene(pb, checkpoint=False)
    try:
        assert s.bob_asks().status_code == 202
        revoked = s.wait_state("revoked")
        # where the node never parks, the student's reason is today's; the log says why
        assert "idle" in revoked["reason"] and "park" not in revoked["reason"]
        said = "\n".join(p.read_text() for p in pb.logs() if p.exists())
        assert "instead of parking it: the CUDA driver on node" in said
        assert s.bob_asks().status_code == 200
        assert s.beat()["orders"] == []
        assert metric(pb, 'gpu_lease_parks_total{outcome="refused"}') == 1.0
    finally:
        s.close()


def test_too_little_host_memory_revokes(pb: NodeBroker) -> None:
    s = Scene(pb, host=GPU_MB)  # less the 2048 MiB reserve: too little for 16 GiB
    try:
        assert s.bob_asks().status_code == 202
        revoked = s.wait_state("revoked")
        assert "host memory" in revoked["reason"]
        assert s.bob_asks().status_code == 200
    finally:
        s.close()


@pytest.mark.broker_args("--GPULeaseBroker.park_timeout=2")
def test_a_park_that_does_not_finish_is_revoked(pb: NodeBroker, scene: Scene) -> None:
    assert scene.bob_asks().status_code == 202
    scene.wait_state("parking")
    revoked = scene.wait_state("revoked")
    assert "did not finish" in revoked["reason"]
    assert scene.bob_asks().status_code == 200
    assert metric(pb, 'gpu_lease_parks_total{outcome="timeout"}') == 1.0


def test_bad_outcomes_are_refused_and_change_nothing(pb: NodeBroker, scene: Scene) -> None:
    assert scene.bob_asks().status_code == 202
    scene.wait_state("parking")
    good = {"lease_id": scene.id, "action": "park", "outcome": "done"}
    bad: list[dict[str, Any]] = [
        {"parking": [{**good, "action": "sleep"}]},
        {"parking": [{**good, "outcome": "maybe"}]},
        {"parking": [{**good, "lease_id": 7}]},
        {"parking": [{**good, "mb": -1}]},
        {"parking": [{**good, "pids": [0]}]},
        {"parking": [{**good, "colour": "red"}]},
        {"parking": [good, good]},
        {"parking": {"lease_id": scene.id}},
        {"parking": ["done"]},
        {"checkpoint": "yes"},
        {"host_memory_available_mb": -5},
        {"host_memory_available_mb": 1.5},
    ]
    for body in bad:
        r = scene.agent.post("/nodes/gpu-a/heartbeat", json={"usage": [], **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"] == "invalid_request"
    assert scene.state() == "parking"
    # another node's agent may not report on gpu-a's leases
    with pb.http("agent:gpu-b") as b:
        assert register(b, "gpu-b", gpus_of("gpu-b", 1)).status_code == 200
        r = b.post("/nodes/gpu-b/heartbeat", json={"parking": [good]})
        assert r.status_code == 403, r.text
    assert scene.state() == "parking"
    # unknown ids and outcomes of another state are ignored
    ghost = {"lease_id": "no-such-lease", "action": "park", "outcome": "done"}
    assert scene.beat(parking=[ghost])["orders"][0]["lease_id"] == scene.id
    scene.outcome("resume", "done")
    assert scene.state() == "parking"


# -- resume -----------------------------------------------------------------------------


def test_resume_waits_for_the_gpu_then_restores(pb: NodeBroker, scene: Scene) -> None:
    scene.park()
    url = f"/leases/{scene.id}/resume"
    r = scene.alice.post(url, json={})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "parked" and body["position"] == 1 and body["queue_length"] == 1
    assert body["lease"]["id"] == scene.id and body["lease"]["state"] == "parked"
    assert lease_of(scene.alice, scene.id)["resume"]["position"] == 1
    assert scene.alice.post(url).status_code == 202  # idempotent: the same request
    assert len(scene.alice.get("/queue").json()["queue"]) == 1
    # another user's lease is answered as an unknown one
    for who in (scene.bob,):
        r = who.post(url, json={})
        assert r.status_code == 404
        assert r.json()["message"] == f"No GPU lease has the id {scene.id!r}."
    assert scene.alice.post("/leases/nope/resume", json={}).status_code == 404
    for bad in ({"wait": -1}, {"wait": "5"}, {"wait": 301}, {"later": True}):
        assert scene.alice.post(url, json=bad).status_code == 400, bad
    # a parked lease is renewed like any other
    before = lease_of(scene.alice, scene.id)["expires_at"]
    r = scene.alice.post(f"/leases/{scene.id}/renew", json={"execution_state": "idle"})
    assert r.status_code == 200 and r.json()["state"] == "parked"
    assert r.json()["expires_at"] >= before
    # alice long-polls while bob releases and the agent restores
    with concurrent.futures.ThreadPoolExecutor(1) as pool, pb.http("alice") as poller:
        waiting = pool.submit(lambda: poller.post(url, json={"wait": 30}))
        assert scene.bob.delete(f"/leases/{scene.bob_id}").status_code == 204
        scene.wait_state("resuming")
        assert allocated(scene.alice) == 1.0  # re-reserved before the restore is ordered
        orders = scene.beat()["orders"]
        assert [(o["lease_id"], o["action"], o["memory_mb"]) for o in orders] == [
            (scene.id, "resume", GPU_MB)
        ]
        # the GPU lacks memory for the restore yet: nothing changes, the order repeats
        assert scene.outcome("resume", "waiting", message="GPU busy")["orders"] == orders
        assert not waiting.done()
        assert scene.outcome("resume", "done", mb=900, seconds=1.5)["orders"] == []
        r = waiting.result(timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "active" and r.json()["parked_at"] is None
    assert scene.alice.post(url, json={}).status_code == 200
    assert metric(pb, 'gpu_lease_resumes_total{outcome="done"}') == 1.0
    assert metric(pb, "gpu_lease_resume_wait_seconds_count") == 1.0
    assert metric(pb, "gpu_lease_leases_parked") == 0.0
    # an ended lease: 410 with its state
    assert scene.alice.delete(f"/leases/{scene.id}").status_code == 204
    r = scene.alice.post(url, json={})
    assert r.status_code == 410 and r.json()["state"] == "released"


def test_a_resume_asked_while_parking_queues_once_the_lease_is_parked(
    pb: NodeBroker, scene: Scene
) -> None:
    """The student runs a cell while the agent is still checkpointing: the long-poll that
    answered "parking" queues the resume itself as soon as the park is done."""
    assert scene.bob_asks().status_code == 202
    scene.wait_state("parking")
    url = f"/leases/{scene.id}/resume"
    r = scene.alice.post(url, json={})
    assert r.status_code == 202 and r.json()["state"] == "parking", r.text
    assert r.json()["position"] is None
    with concurrent.futures.ThreadPoolExecutor(1) as pool, pb.http("alice") as poller:
        waiting = pool.submit(lambda: poller.post(url, json={"wait": 3}))
        # nothing outside the broker shows a long-poll in flight: give it a moment to
        # arrive first (were it late, the test would still pass, through the plain path)
        time.sleep(0.5)
        assert scene.outcome("park", "done", pids=[4243], mb=900)["orders"] == []
        # bob's waiting request gets the GPU; alice's resume waits behind nobody else
        assert scene.bob_asks().status_code == 200
        r = waiting.result(timeout=20)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "parked" and body["position"] == 1, body
    assert lease_of(scene.alice, scene.id)["resume"]["position"] == 1


def test_a_failed_resume_revokes(scene: Scene) -> None:
    scene.park()
    assert scene.bob.delete(f"/leases/{scene.bob_id}").status_code == 204
    r = scene.alice.post(f"/leases/{scene.id}/resume", json={})
    assert r.status_code == 202 and r.json()["state"] == "resuming"
    scene.outcome("resume", "failed", message="the checkpoint was lost")
    revoked = scene.wait_state("revoked")
    assert "the checkpoint was lost" in revoked["reason"]
    assert allocated(scene.alice) == 0.0
    r = scene.alice.post(f"/leases/{scene.id}/resume", json={})
    assert r.status_code == 410 and r.json()["state"] == "revoked"


def test_releasing_a_parked_lease_drops_its_resume(scene: Scene) -> None:
    scene.park()
    assert scene.alice.post(f"/leases/{scene.id}/resume", json={}).status_code == 202
    assert scene.alice.delete(f"/leases/{scene.id}").status_code == 204
    assert scene.state() == "released"
    assert scene.alice.get("/queue").json()["queue"] == []
    assert scene.alice.get("/leases").json()["leases"] == []


@pytest.mark.broker_args("--GPULeaseBroker.ttl=4")
def test_a_parked_lease_not_renewed_expires(scene: Scene) -> None:
    scene.park()
    r = scene.alice.post(f"/leases/{scene.id}/renew", json={})
    assert r.status_code == 200 and r.json()["state"] == "parked"
    scene.wait_state("expired", timeout=30)


def test_a_restart_keeps_a_parked_lease_parked(pb: NodeBroker, scene: Scene) -> None:
    scene.park()
    pb.restart()
    with pb.http("alice") as alice, pb.http("bob") as bob:
        assert lease_of(alice, scene.id)["state"] == "parked"
        assert lease_of(bob, scene.bob_id)["state"] == "active"
        assert allocated(alice) == 1.0  # bob's share only
        # the kernel restarted (its checkpoint is gone): a new acquire ends the parked lease
        r = alice.post("/leases", json={"kernel_id": "k1", "fraction": 0.5})
        assert r.status_code == 202, r.text
        gone = lease_of(alice, scene.id)
        assert gone["state"] == "released"


def test_the_dashboard_shows_a_parked_lease_and_its_place(
    chromium: Any, pb: NodeBroker, scene: Scene
) -> None:
    scene.park()
    assert scene.alice.post(f"/leases/{scene.id}/resume", json={}).status_code == 202
    context, page, problems = open_dashboard(chromium, pb, "alice")
    try:
        page.wait_for_selector("#leases table")
        assert "parked, 1st to resume" in page.inner_text("#leases")
        assert problems == []
    finally:
        context.close()
