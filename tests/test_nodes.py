"""Node agents' REST side over a REAL broker subprocess: register, heartbeat, lost, drain.

Agents' tokens come from the static tokens file (``{"agent": true, "node": "gpu-a"}``);
the broker declares one V100 itself, so the pool is that GPU plus the registered nodes'.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provisioner.broker.web.validation import parse_node_heartbeat, parse_node_registration
from provisioner.devtools.testing import wait_for
from provisioner.errors import InvalidRequest
from provisioner.wire import MAX_GPU_MEMORY_MB, MAX_PID

from .conftest import Broker

NODE_GRACE = 1.5


def gpus_of(node: str, count: int = 2, memory_mb: int = 16384) -> list[dict[str, Any]]:
    return [
        {"uuid": f"GPU-{node}-{i}", "name": "T4", "memory_mb": memory_mb, "index": i}
        for i in range(count)
    ]


class NodeBroker(Broker):
    """A broker whose tokens file also holds agent tokens for gpu-a and gpu-b."""

    def __init__(self, tmp: Path, db_url: str, extra: tuple[str, ...] = ()) -> None:
        super().__init__(tmp, db_url, extra)
        data = json.loads(self.tokens_file.read_text())
        for node in ("gpu-a", "gpu-b"):
            token = f"agent-{node}-{uuid.uuid4().hex}"
            self.tokens[f"agent:{node}"] = token
            data[token] = {"agent": True, "node": node}
        self.tokens_file.write_text(json.dumps(data))

    def http(self, who: str) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.url}/api/v1",
            headers=self.headers(who),
            timeout=30,
            event_hooks=self.conformance.sync_hooks(),
        )


@pytest.fixture
def nb(tmp_path: Path, broker_db_url: str) -> Iterator[NodeBroker]:
    b = NodeBroker(
        tmp_path,
        broker_db_url,
        (
            f"--GPULeaseBroker.node_grace={NODE_GRACE}",
            "--GPULeaseBroker.reap_interval=0.2",
        ),
    )
    with b.running(timeout=60):
        yield b


def register(c: httpx.Client, node: str, gpus: list[dict[str, Any]]) -> httpx.Response:
    return c.put(f"/nodes/{node}", json={"gpus": gpus, "agent_version": "test"})


def node_state(c: httpx.Client, node: str) -> str:
    nodes = {n["node"]: n for n in c.get("/nodes").json()["nodes"]}
    return str(nodes[node]["state"])


def pool(c: httpx.Client) -> dict[str, dict[str, Any]]:
    return {g["uuid"]: g for g in c.get("/gpus").json()["gpus"]}


@pytest.mark.slow
def test_two_agents_register_and_the_pool_is_the_union(nb: NodeBroker) -> None:
    with nb.http("agent:gpu-a") as a, nb.http("agent:gpu-b") as b, nb.http("alice") as u:
        assert register(a, "gpu-a", gpus_of("gpu-a")).status_code == 200
        assert register(b, "gpu-b", gpus_of("gpu-b", 1)).status_code == 200
        gpus = pool(u)
        assert len(gpus) == 1 + 2 + 1
        assert gpus["GPU-gpu-a-1"]["node"] == "gpu-a"
        # a user sees a summary, an admin the detail
        summary = {n["node"]: n for n in u.get("/nodes").json()["nodes"]}
        assert summary["gpu-a"]["gpus"] == 2 and summary["gpu-a"]["state"] == "up"
        with nb.http("admin") as adm:
            detail = {n["node"]: n for n in adm.get("/nodes").json()["nodes"]}
        assert [g["uuid"] for g in detail["gpu-b"]["gpus"]] == ["GPU-gpu-b-0"]
        # an agent restart re-registers without duplicating GPUs
        assert register(a, "gpu-a", gpus_of("gpu-a")).status_code == 200
        assert len(pool(u)) == 4
        # a lease may be placed on a registered node
        r = u.post("/leases", json={"kernel_id": "k1", "fraction": 0.5, "node": "gpu-b"})
        assert r.status_code == 201 and r.json()["gpu"]["uuid"] == "GPU-gpu-b-0"
    nb.restart()  # registrations are persisted
    with nb.http("alice") as u:
        assert len(pool(u)) == 4
        assert {n["node"] for n in u.get("/nodes").json()["nodes"]} == {"gpu-a", "gpu-b"}
        assert u.get("/leases").json()["leases"][0]["gpu"]["node"] == "gpu-b"


@pytest.mark.slow
def test_agent_tokens_may_call_only_their_own_node(nb: NodeBroker) -> None:
    with nb.http("agent:gpu-a") as a, nb.http("agent:gpu-b") as b, nb.http("alice") as u:
        assert register(a, "gpu-a", gpus_of("gpu-a")).status_code == 200
        for method, path in (("GET", "/gpus"), ("GET", "/leases"), ("GET", "/queue")):
            assert a.request(method, path).status_code == 403
        r = a.post("/leases", json={"kernel_id": "k", "fraction": 0.1})
        assert r.status_code == 403 and "node agent" in r.json()["message"]
        # another node's name, another node's GPU
        assert register(a, "gpu-b", gpus_of("gpu-b")).status_code == 403
        assert register(b, "gpu-b", gpus_of("gpu-a")).status_code == 403
        # a GPU the broker's --gpus declares (on node 'local'), even by an agent of that name
        declared = [g for g in pool(u).values() if g["uuid"] in _declared(u)][0]
        mine = [{k: declared[k] for k in ("uuid", "name", "memory_mb")} | {"index": 99}]
        r = register(a, "gpu-a", gpus_of("gpu-a") + mine)
        assert r.status_code == 403, r.text
        assert "declared by the broker's --gpus" in r.json()["message"], r.text
        assert a.delete("/nodes/gpu-b").status_code == 403
        assert a.post("/nodes/gpu-b/heartbeat", json={"usage": []}).status_code == 403
        # a user may not register or drain nodes
        assert register(u, "gpu-c", gpus_of("gpu-c")).status_code == 403
        assert u.delete("/nodes/gpu-a").status_code == 403
        assert set(pool(u)) == {*(g["uuid"] for g in gpus_of("gpu-a")), *_declared(u)}
        assert {n["node"] for n in u.get("/nodes").json()["nodes"]} == {"gpu-a"}


def _declared(c: httpx.Client) -> set[str]:
    return {u for u, g in pool(c).items() if not g["uuid"].startswith("GPU-gpu-")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, status",
    [
        ({"gpus": [], "agent_version": "1", "extra": 1}, 400),
        ({"gpus": [{"uuid": "x", "name": "T4", "memory_mb": -5, "index": 0}]}, 400),
        (
            {
                "gpus": [{"uuid": "x", "name": "T4", "memory_mb": -5, "index": 0}],
                "agent_version": "1",
            },
            400,
        ),
        (
            {
                "gpus": [{"uuid": "x", "name": "T4", "memory_mb": 5, "index": 0, "z": 1}],
                "agent_version": "1",
            },
            400,
        ),
        ({"gpus": gpus_of("n", 1) * 2, "agent_version": "1"}, 400),
        ({"gpus": "all", "agent_version": "1"}, 400),
        ({"gpus": gpus_of("n", 1), "agent_version": "1", "pad": "x" * 100_000}, 413),
    ],
)
def test_malformed_registrations_change_nothing(
    nb: NodeBroker, body: dict[str, Any], status: int
) -> None:
    with nb.http("agent:gpu-a") as a:
        assert a.put("/nodes/gpu-a", json=body).status_code == status
        assert a.get("/nodes").json()["nodes"] == []
    with nb.http("alice") as u:
        assert len(pool(u)) == 1


@pytest.mark.slow
def test_heartbeat_reports_are_validated_and_never_change_capacity(nb: NodeBroker) -> None:
    with nb.http("agent:gpu-a") as a, nb.http("admin") as adm, nb.http("alice") as u:
        assert a.post("/nodes/gpu-a/heartbeat", json={"usage": []}).status_code == 404
        assert register(a, "gpu-a", gpus_of("gpu-a", 1)).status_code == 200
        r = u.post("/leases", json={"kernel_id": "k1", "fraction": 0.5, "node": "gpu-a"})
        assert r.status_code == 201
        good = {"usage": [{"pid": 4242, "gpu_uuid": "GPU-gpu-a-0", "used_mb": 900}], "at": 1.0}
        assert a.post("/nodes/gpu-a/heartbeat", json=good).status_code == 200
        bad = [
            ({"usage": [{"pid": 1, "gpu_uuid": "GPU-gpu-b-0", "used_mb": 1}]}, 403),
            ({"usage": [{"pid": 1, "gpu_uuid": "V100-declared", "used_mb": 1}]}, 403),
            ({"usage": [{"pid": 1, "gpu_uuid": "GPU-gpu-a-0", "used_mb": -1}]}, 400),
            ({"usage": [{"pid": 1, "gpu_uuid": "GPU-gpu-a-0", "used_mb": 10**6}]}, 400),
            ({"usage": [{"pid": 0, "gpu_uuid": "GPU-gpu-a-0", "used_mb": 1}]}, 400),
            ({"usage": [{"pid": 1, "gpu_uuid": "GPU-gpu-a-0", "used_mb": 1, "x": 0}]}, 400),
            ({"usage": [], "free": True}, 400),
            ({"usage": [{"pid": 1, "gpu_uuid": "GPU-gpu-a-0", "used_mb": 1}] * 2}, 400),
            ({"usage": [{"pid": 1, "gpu_uuid": "GPU-gpu-a-0", "used_mb": 1}] * 5000}, 413),
        ]
        for body, status in bad:
            assert a.post("/nodes/gpu-a/heartbeat", json=body).status_code == status, body
        detail = adm.get("/nodes").json()["nodes"][0]
        assert detail["usage"] == good["usage"]
        gpu = pool(u)["GPU-gpu-a-0"]
        assert gpu["allocated_fraction"] == 0.5 and gpu["leases"] == 1


@pytest.mark.slow
def test_silent_node_is_lost_then_back_and_a_drained_node_takes_nothing(nb: NodeBroker) -> None:
    with nb.http("agent:gpu-a") as a, nb.http("alice") as u, nb.http("bob") as bob:
        assert register(a, "gpu-a", gpus_of("gpu-a", 1)).status_code == 200
        held = u.post("/leases", json={"kernel_id": "k1", "fraction": 0.25, "node": "gpu-a"})
        assert held.status_code == 201
        wait_for(lambda: node_state(u, "gpu-a") == "lost")
        r = bob.post("/leases", json={"kernel_id": "k2", "fraction": 0.25, "node": "gpu-a"})
        assert r.status_code == 202  # waits: nothing new is placed on a lost node
        assert u.get(f"/leases/{held.json()['id']}").json()["state"] == "active"
        assert a.post("/nodes/gpu-a/heartbeat", json={"usage": []}).json()["state"] == "up"
        # the waiting request is granted now that the node is back
        r = bob.post("/leases", json={"kernel_id": "k2", "fraction": 0.25, "node": "gpu-a"})
        assert r.status_code in (200, 201) and r.json()["gpu"]["node"] == "gpu-a"
        # a clean stop drains: held leases stay, nothing new lands there
        assert a.delete("/nodes/gpu-a").status_code == 204
        assert node_state(u, "gpu-a") == "drained"
        r = u.post("/leases", json={"kernel_id": "k3", "fraction": 0.1, "node": "gpu-a"})
        assert r.status_code == 202
        assert u.get(f"/leases/{held.json()['id']}").json()["state"] == "active"
        # a heartbeat does not undrain; registering again does
        assert a.post("/nodes/gpu-a/heartbeat", json={"usage": []}).json()["state"] == "drained"
        assert register(a, "gpu-a", gpus_of("gpu-a", 1)).json()["state"] == "up"


@pytest.mark.slow
@pytest.mark.parametrize("broker_db_url", ["sqlite"], indirect=True)
def test_a_node_is_listed_only_once_its_gpus_can_be_placed(nb: NodeBroker) -> None:
    """A first registration still being stored (here: another connection holds the SQLite
    database) is not listed yet: a client that waits for the node in ``GET /nodes`` and then
    asks for a GPU there is placed, never told "No GPU of the pool is on node"."""
    locker = sqlite3.connect(nb.db_url[len("sqlite:///") :], isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    with (
        nb.http("agent:gpu-a") as a,
        nb.http("alice") as u,
        ThreadPoolExecutor(1) as pool_,
    ):
        try:
            registering = pool_.submit(register, a, "gpu-a", gpus_of("gpu-a", 1))
            deadline = time.monotonic() + 1.5  # within the store's 5 s busy timeout
            while time.monotonic() < deadline:
                assert "gpu-a" not in {n["node"] for n in u.get("/nodes").json()["nodes"]}
                time.sleep(0.05)
            assert not registering.done()
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert registering.result(timeout=30).status_code == 200
        # (the wait may have outlasted this module's short node grace: the agent's beat)
        assert a.post("/nodes/gpu-a/heartbeat", json={"usage": []}).json()["state"] == "up"
        r = u.post("/leases", json={"kernel_id": "k1", "fraction": 0.25, "node": "gpu-a"})
        assert r.status_code == 201, r.text


@pytest.mark.slow
def test_a_gpu_that_vanishes_while_leased_is_drained_not_deleted(nb: NodeBroker) -> None:
    with nb.http("agent:gpu-a") as a, nb.http("alice") as u:
        assert register(a, "gpu-a", gpus_of("gpu-a", 2)).status_code == 200
        r = u.post(
            "/leases", json={"kernel_id": "k1", "fraction": 0.5, "gpu_uuids": ["GPU-gpu-a-1"]}
        )
        assert r.status_code == 201
        lease_id = r.json()["id"]
        assert register(a, "gpu-a", gpus_of("gpu-a", 1)).status_code == 200
        gpus = pool(u)
        assert "GPU-gpu-a-1" in gpus and gpus["GPU-gpu-a-1"]["leases"] == 1
        r = u.post(
            "/leases", json={"kernel_id": "k2", "fraction": 0.1, "gpu_uuids": ["GPU-gpu-a-1"]}
        )
        assert r.status_code == 202  # closed: nothing new there
        assert u.delete("/leases/" + r.json()["id"]).status_code == 204
        assert u.delete(f"/leases/{lease_id}").status_code == 204
        wait_for(lambda: "GPU-gpu-a-1" not in pool(u))


# -- the validation of agent reports, as a property ---------------------------------------

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_sample = st.dictionaries(
    st.sampled_from(["pid", "gpu_uuid", "used_mb", "extra"]),
    st.one_of(_json_leaf, st.integers(min_value=-5, max_value=70000)),
    max_size=4,
)
_bodies = st.dictionaries(
    st.sampled_from(["usage", "at", "mps", "other"]),
    st.one_of(
        _json_leaf,
        st.lists(st.one_of(_sample, _json_leaf), max_size=5),
        st.dictionaries(
            st.text(max_size=6),
            st.one_of(st.sampled_from(["running", "down"]), _json_leaf),
            max_size=3,
        ),
    ),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_heartbeat_validation_accepts_only_well_formed_reports(body: dict[str, Any]) -> None:
    try:
        usage, at, mps = parse_node_heartbeat(body)
    except InvalidRequest:
        return
    assert set(body) <= {"usage", "at", "mps"}
    assert mps is None or all(
        isinstance(k, str) and k and v in ("running", "down") for k, v in mps.items()
    )
    assert at is None or 0 <= at <= 1e11
    assert len({(p, g) for p, g, _ in usage}) == len(usage)
    for pid, gpu_uuid, used in usage:
        assert 1 <= pid <= MAX_PID and isinstance(pid, int)
        assert isinstance(gpu_uuid, str) and gpu_uuid
        assert 0 <= used <= MAX_GPU_MEMORY_MB and isinstance(used, int)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "uuid": st.text(min_size=0, max_size=4),
                "name": st.text(max_size=4),
                "memory_mb": st.integers(min_value=-3, max_value=2**25),
                "index": st.integers(min_value=-1, max_value=3),
            }
        ),
        max_size=4,
    )
)
def test_registration_validation_keeps_gpus_distinct_and_positive(
    gpus: list[dict[str, Any]],
) -> None:
    try:
        out, _, enforce = parse_node_registration({"gpus": gpus, "agent_version": "1"}, "n")
    except InvalidRequest:
        return
    assert len({g.uuid for g in out}) == len(out) == len({g.index for g in out})
    assert all(0 < g.memory_mb <= MAX_GPU_MEMORY_MB and g.node == "n" for g in out)
    assert enforce == "report"


@pytest.mark.slow
def test_mps_uids_in_heartbeats_place_mps_kernels_and_a_change_drains_the_queue(
    nb: NodeBroker,
) -> None:
    """The agent reports whom each GPU's MPS server serves; an enforcement=mps
    acquire (``mps_uid``) goes where it serves the same uid or no one, or waits with the
    reason; the report that frees the GPU grants it."""
    a0, a1 = "GPU-gpu-a-0", "GPU-gpu-a-1"
    with nb.http("agent:gpu-a") as a, nb.http("alice") as u, nb.http("bob") as b:
        assert register(a, "gpu-a", gpus_of("gpu-a")).status_code == 200
        beat = {"usage": [], "mps": {a0: "running", a1: "running"}, "mps_uid": {a0: 1000}}
        assert a.post("/nodes/gpu-a/heartbeat", json=beat).status_code == 200
        assert {g: pool(u)[g]["mps_uid"] for g in (a0, a1)} == {a0: 1000, a1: None}
        for bad, status in (
            ({"mps_uid": {"GPU-gpu-b-0": 1}}, 403),
            ({"mps_uid": {a0: -1}}, 400),
            ({"mps_uid": "1000"}, 400),
        ):
            assert a.post("/nodes/gpu-a/heartbeat", json=bad).status_code == status, bad
        assert pool(u)[a0]["mps_uid"] == 1000  # a refused report changed nothing
        # bob's MPS kernel goes to the GPU whose server serves no one
        ask = {"kernel_id": "k", "fraction": 0.25, "node": "gpu-a", "mps_uid": 1001}
        r = b.post("/leases", json=ask)
        assert r.status_code == 201 and r.json()["gpu"]["uuid"] == a1, r.text
        assert r.json()["mps_uid"] == 1001 and r.json()["mps_server_uid"] is None
        # alice's MPS kernel may use GPU 0 only, whose server serves uid 1000's clients
        mine = {"kernel_id": "k", "fraction": 0.25, "gpu_uuids": [a0], "mps_uid": 1002}
        r = u.post("/leases", json=mine)
        assert r.status_code == 202, r.text
        assert r.json()["reason"].startswith(
            "The MPS server of GPU 0 (T4) on node gpu-a is serving another user's kernels"
        ), r.json()
        # a cooperative kernel does not use MPS: placed as before (not on GPU 0, which
        # alice's waiting kernel reserves, as any queue head does)
        coop = {"kernel_id": "c", "fraction": 0.25, "node": "gpu-a"}
        r = b.post("/leases", json=coop)
        assert r.status_code == 201 and r.json()["mps_uid"] is None, r.text
        # the server's clients are gone: the heartbeat's drain grants alice's kernel
        beat["mps_uid"] = {a0: None, a1: 1001}
        assert a.post("/nodes/gpu-a/heartbeat", json=beat).status_code == 200
        r = u.post("/leases", json=mine)
        assert r.status_code == 200 and r.json()["gpu"]["uuid"] == a0, r.text


@pytest.mark.slow
def test_kernels_of_other_pid_namespaces_are_matched_by_identity_never_by_number(
    nb: NodeBroker,
) -> None:
    """Two kernels both numbered pid 7 in two containers: each one's usage reaches its own
    lease through the agent's ``kernels`` map; pid namespaces and cgroups are validated."""
    with nb.http("agent:gpu-a") as a, nb.http("alice") as u:
        assert register(a, "gpu-a", gpus_of("gpu-a", 1)).status_code == 200
        ids = []
        for kernel, ns in (("k1", 4026531001), ("k2", 4026531002)):
            r = u.post("/leases", json={"kernel_id": kernel, "fraction": 0.25, "node": "gpu-a"})
            assert r.status_code == 201
            ids.append(r.json()["id"])
            beat = {
                "pid": 7,
                "pid_ns": ns,
                "cgroup": f"/gpu-lease/kernel-{kernel}",
                "proof": kernel[-1] * 64,
            }
            assert u.post(f"/leases/{ids[-1]}/renew", json=beat).status_code == 200
        for bad in (
            {"pid_ns": 0},
            {"pid_ns": "x"},
            {"cgroup": "../etc"},
            {"cgroup": "/a/../b"},
            {"proof": "A" * 64},  # 64 lowercase hex digits
            {"proof": "1" * 63},
            {"proof": 7},
        ):
            r = u.post(f"/leases/{ids[0]}/renew", json={"pid": 7, **bad})
            assert r.status_code == 400, bad
        answer = a.post("/nodes/gpu-a/heartbeat", json={"usage": []}).json()
        # each claim with what the agent needs to prove it and act on it
        assert answer["kernels"] == [
            {
                "pid": 7,
                "pid_ns": ns,
                "lease_id": lease_id,
                "user": "alice",
                "kernel_id": kernel,
                "proof": kernel[-1] * 64,
                "gpu_uuid": "GPU-gpu-a-0",
                "memory_mb": 4096,  # cap + context: 0.25 of 16 GiB
                "enforcement": "cooperative",
            }
            for (kernel, ns), lease_id in zip(
                (("k1", 4026531001), ("k2", 4026531002)), ids, strict=True
            )
        ]
        assert answer["limits"] == []  # a claimed cgroup is never handed to an agent
        gpu = "GPU-gpu-a-0"
        report = {
            "usage": [
                {"pid": 7, "gpu_uuid": gpu, "used_mb": 50},  # a host process numbered 7
                {"pid": 30001, "gpu_uuid": gpu, "used_mb": 100},
                {"pid": 30002, "gpu_uuid": gpu, "used_mb": 200},
            ],
            "kernels": [
                {"pid": 7, "pid_ns": 4026531001, "host_pid": 30001},
                {"pid": 7, "pid_ns": 4026531002, "host_pid": 30002},
            ],
            "driver_limits": ["/gpu-lease/kernel-k2"],
        }
        assert a.post("/nodes/gpu-a/heartbeat", json=report).status_code == 200
        k1, k2 = (u.get(f"/leases/{i}").json() for i in ids)
        assert (k1["used_mb"], k2["used_mb"]) == (100, 200)
        assert (k1["enforcement"], k2["enforcement"]) == ("agent-report", "driver+agent-report")
        with nb.http("admin") as adm:
            unleased = adm.get("/nodes").json()["nodes"][0]["unleased"]
        assert unleased == [{"pid": 7, "gpu_uuid": gpu, "used_mb": 50}]
        for bad in (
            {"kernels": [{"pid": 7, "pid_ns": 1}]},
            {"kernels": [{"pid": 7, "pid_ns": 1, "host_pid": 0}]},
            {"kernels": [{"pid": 7, "pid_ns": 1, "host_pid": 2}] * 2},
            {"kernels": {"pid": 7}},
            {"driver_limits": ["relative/path"]},
            {"driver_limits": "/a"},
        ):
            r = a.post("/nodes/gpu-a/heartbeat", json={"usage": [], **bad})
            assert r.status_code == 400, bad
        # an agent that proves claims (it sends ``refused``): only the kernels it
        # proved count, whatever the renewals claim; a refusal shows on the lease
        why = "process 30001 does not carry this lease's kernel secret"
        proving = {
            "usage": [
                {"pid": 30001, "gpu_uuid": gpu, "used_mb": 100},
                {"pid": 30002, "gpu_uuid": gpu, "used_mb": 200},
            ],
            "kernels": [
                {
                    "pid": 7,
                    "pid_ns": 4026531002,
                    "host_pid": 30002,
                    "lease_id": ids[1],
                    "uid": 1000,
                    "cgroup": "/gpu-lease/kernel-k2",
                    "escaped": [],
                }
            ],
            "refused": [{"lease_id": ids[0], "reason": why}],
            "driver_limits": ["/gpu-lease/kernel-k2"],
        }
        assert a.post("/nodes/gpu-a/heartbeat", json=proving).status_code == 200
        k1, k2 = (u.get(f"/leases/{i}").json() for i in ids)
        assert (k1["used_mb"], k2["used_mb"]) == (0, 200)
        assert (k1["kernel_refused"], k2["kernel_refused"]) == (why, None)
        assert k2["enforcement"] == "driver+agent-report"
        for bad in (
            {"refused": [{"lease_id": ids[0]}]},
            {"refused": "x"},
            {"refused": [{"lease_id": ids[0], "reason": "x" * 301}]},
            {"refused": [], "kernels": [{**proving["kernels"][0], "uid": -1}]},
            {"refused": [], "kernels": [{**proving["kernels"][0], "cgroup": "x"}]},
            {"refused": [], "kernels": [proving["kernels"][0]] * 2},
        ):
            r = a.post("/nodes/gpu-a/heartbeat", json={"usage": [], **bad})
            assert r.status_code == 400, bad
