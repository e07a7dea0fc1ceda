"""The jupyter_server extension ``provisioner.lab`` without a browser: real processes.

A real broker (1x32768:V100, TTL 3 s) and a real Jupyter server with GPU kernelspecs of
0.5 (two fill the GPU) and the extension enabled; kernels start the way JupyterLab starts
a notebook's kernel (``POST /api/sessions`` with a temporary path and the notebook's name,
answered only once the kernel has started). What the browser reads,
``GET /gpu-lease/api/kernels``, is checked at each step: the lease of a running kernel;
a waiting kernel's place in the queue, before its first long-poll answer and moving when
a lease ends; "Stop waiting" (``DELETE .../request``) failing the start with a sentence
that says so; an admin's revoke reason kept after the kernel is gone.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.labserver import JupyterServerProcess, install_kernelspecs
from provisioner.devtools.testing import BrokerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

USERS = {"alice": ([], False), "admin": ([], True)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, Any]]:
    tmp = tmp_path_factory.mktemp("lab")
    broker = BrokerProcess(
        tmp,
        f"sqlite:///{tmp / 'b.sqlite'}",
        USERS,
        extra=("--ttl", "3", "--GPULeaseBroker.reap_interval=0.5"),
    )
    broker.start()
    (spec,) = install_kernelspecs(tmp / "prefix", [0.5])
    server = JupyterServerProcess(
        tmp,
        broker.url,
        broker.tokens["alice"],
        kernels_prefix=tmp / "prefix",
        # the provisioner's long-poll stays out longer than the test waits: positions
        # must come from the server extension's own look at the queue
        config={"GPULeaseProvisioner": {"long_poll": 60.0}},
    )
    server.spec = spec  # type: ignore[attr-defined]
    try:
        server.start()
        yield broker, server
    finally:
        server.stop()
        broker.stop()


class Start(threading.Thread):
    """One notebook's kernel start, as JupyterLab posts it (blocks until started or failed)."""

    def __init__(self, server: Any, notebook: str) -> None:
        super().__init__(daemon=True)
        self.server, self.notebook = server, notebook
        self.response: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        body = self.server.session_body(str(uuid.uuid4()), self.server.spec)
        body["name"] = self.notebook
        with httpx.Client(
            base_url=self.server.url,
            headers={"Authorization": f"token {self.server.token}"},
            timeout=120,
        ) as http:
            r = http.post("/api/sessions", json=body)
            if r.status_code == 201:  # JupyterLab then moves the session to the real path
                r2 = http.patch(f"/api/sessions/{r.json()['id']}", json={"path": self.notebook})
                assert r2.status_code == 200, r2.text
            self.response = r

    def result(self, timeout: float = 60.0) -> httpx.Response:
        self.join(timeout)
        assert self.response is not None, "the kernel start did not answer"
        return self.response


def by_path(server: Any) -> dict[str, dict[str, Any]]:
    return {k.get("path", ""): k for k in server.gpu_kernels() if k["state"] != "released"}


def test_needs_the_servers_authentication(stack: Any) -> None:
    _, server = stack
    r = httpx.get(f"{server.url}/gpu-lease/api/kernels")
    assert r.status_code == 403
    r = httpx.get(f"{server.url}/gpu-lease/api/kernels", headers={"Authorization": "token nope"})
    assert r.status_code == 403
    assert server.gpu_kernels() == []


def test_what_starting_a_gpu_kernelspec_would_take(stack: Any) -> None:
    """``GET .../kernelspecs/{name}/outlook``: a notebook opened without starting its GPU
    kernel says what starting it would take; on an empty pool, a V100 free now."""
    _, server = stack
    r = server.http.get(f"/gpu-lease/api/kernelspecs/{server.spec}/outlook")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "name": server.spec,
        "display_name": r.json()["display_name"],
        "fraction": 0.5,
        "gpu_name": "V100",
        "free_now": True,
        "position": None,
        "queue_length": 0,
    }
    assert "GPU 0.5" in r.json()["display_name"]
    for name in ("python3", "no-such-kernel"):  # a CPU kernel, none: 404
        r = server.http.get(f"/gpu-lease/api/kernelspecs/{name}/outlook")
        assert r.status_code == 404, r.text
    r = httpx.get(f"{server.url}/gpu-lease/api/kernelspecs/{server.spec}/outlook")
    assert r.status_code == 403


def test_a_kernel_whose_page_went_away_is_listed_under_its_notebook(stack: Any) -> None:
    """JupyterLab starts a notebook's kernel on a temporary ``dir/<uuid>`` session path and
    moves the session to the notebook once the kernel has started. Reloaded meanwhile, the
    page never does: the kernel is still listed under its notebook (the name it was
    started with), so the reloaded page finds it, and its re-attach moves the session."""
    _, server = stack
    body = server.session_body(str(uuid.uuid4()), server.spec)
    body["name"] = "e.ipynb"
    r = server.http.post("/api/sessions", json=body)  # no PATCH after: the page is gone
    assert r.status_code == 201, r.text
    kernel_id = r.json()["kernel"]["id"]
    assert r.json()["path"] != "e.ipynb"
    listed = by_path(server)
    assert listed["e.ipynb"]["kernel_id"] == kernel_id, listed
    assert listed["e.ipynb"]["state"] == "active"
    where = {"path": "e.ipynb", "name": "e.ipynb", "type": "notebook"}
    r = server.http.post(f"/gpu-lease/api/kernels/{kernel_id}/session", json=where)
    assert r.status_code == 200, r.text
    assert r.json()["path"] == "e.ipynb" and r.json()["kernel"]["id"] == kernel_id
    assert server.http.delete(f"/api/kernels/{kernel_id}").status_code == 204
    wait_for(lambda: "e.ipynb" not in by_path(server), what="the kernel's lease released")


def test_waiting_kernel_shows_its_place_which_moves_then_runs(stack: Any) -> None:
    broker, server = stack
    first, second = Start(server, "a.ipynb"), Start(server, "b.ipynb")
    for s in (first, second):
        assert s.result().status_code == 201, s.response.text if s.response else ""
    mine = by_path(server)
    a = mine["a.ipynb"]
    assert a["state"] == "active" and a["fraction"] == 0.5
    assert a["lease"]["gpu"]["name"] == "V100" and a["lease"]["memory_limit_mb"] == 16384 - 512
    assert a["lease"]["kernel_id"] == a["kernel_id"]
    # two more notebooks: the pool is full, both wait; their places show within seconds
    third, fourth = Start(server, "c.ipynb"), Start(server, "d.ipynb")
    waiting = wait_for(
        lambda: (
            (m := by_path(server)).get("c.ipynb", {}).get("position")
            and m.get("d.ipynb", {}).get("position")
            and m
        ),
        what="the waiting kernels' places never showed",
    )
    c, d = waiting["c.ipynb"], waiting["d.ipynb"]
    assert (c["state"], d["state"]) == ("waiting", "waiting")
    assert {c["position"], d["position"]} == {1, 2} and c["waiting"] == d["waiting"] == 2
    assert c["fraction"] == 0.5 and "lease" not in c
    later = "c.ipynb" if c["position"] == 2 else "d.ipynb"
    sooner = "d.ipynb" if later == "c.ipynb" else "c.ipynb"
    # a lease ends: the first in line gets it, the second moves up
    r = server.http.delete(f"/api/kernels/{a['kernel_id']}")
    assert r.status_code == 204
    moved = wait_for(
        lambda: (m := by_path(server)).get(later, {}).get("position") == 1 and m,
        what="the place in the queue did not move when a lease ended",
    )
    assert moved[sooner]["state"] == "active"
    assert moved[later]["waiting"] == 1
    starts = {"c.ipynb": third, "d.ipynb": fourth}
    assert starts[sooner].result().status_code == 201
    # stop waiting: the start fails with a sentence that says so, the queue place is gone
    kernel_id = moved[later]["kernel_id"]
    r = server.http.delete(f"/gpu-lease/api/kernels/{kernel_id}/request")
    assert r.status_code == 204, r.text
    failed = starts[later].result()
    assert failed.status_code >= 400
    assert "You stopped waiting for a GPU" in failed.json()["message"], failed.text
    assert later not in by_path(server)
    queue = httpx.get(
        f"{broker.url}/api/v1/queue", headers={"Authorization": f"token {broker.tokens['admin']}"}
    ).json()["queue"]
    assert queue == []
    # not waiting (any more): 404
    r = server.http.delete(f"/gpu-lease/api/kernels/{kernel_id}/request")
    assert r.status_code == 404


def test_revoked_lease_keeps_its_reason_after_the_kernel_is_gone(stack: Any) -> None:
    broker, server = stack
    running = {p: k for p, k in by_path(server).items() if k["state"] == "active"}
    path, record = sorted(running.items())[0]
    lease_id = record["lease"]["id"]
    r = httpx.post(
        f"{broker.url}/api/v1/leases/{lease_id}/revoke",
        headers={"Authorization": f"token {broker.tokens['admin']}"},
        json={"reason": "maintenance at 18:00"},
    )
    assert r.status_code == 200, r.text
    ended = wait_for(
        lambda: (k := by_path(server).get(path)) and k["state"] == "revoked" and k,
        what="the revoke never reached the server extension",
    )
    assert ended["reason"] == "maintenance at 18:00"
    assert ended["lease"]["state"] == "revoked" and ended["lease"]["reason"] == ended["reason"]
    assert ended["kernel_id"] == record["kernel_id"]
    # the kernel was shut down; the record stays for the notebook's next opening
    wait_for(
        lambda: record["kernel_id"] not in {k["id"] for k in server.http.get("/api/kernels").json()}
    )
    assert by_path(server)[path]["state"] == "revoked"


def test_server_stop_releases_everything(stack: Any, tmp_path: Path) -> None:
    broker, server = stack
    server.stop()
    leases = httpx.get(
        f"{broker.url}/api/v1/leases",
        params={"all": "1"},
        headers={"Authorization": f"token {broker.tokens['admin']}"},
    ).json()["leases"]
    assert [x for x in leases if x["state"] == "active"] == []


def test_culling_and_server_stop_leave_no_request_for_nobody(tmp_path: Path) -> None:
    """jupyter_server's kernel culler and a server stopped while a kernel waits for a GPU.

    The culler (``MappingKernelManager.cull_idle_timeout``) sees only started kernels
    (jupyter_client keeps a starting one out of ``list_kernel_ids``), so a waiting kernel is
    not culled: its request stays queued as long as the server polls for it. Granted, the
    kernel is culled once idle for the timeout, and its lease is released. A server stopped
    (SIGTERM) while a kernel waits no longer polls: the broker drops the request after
    ``queue_poll_grace``, and nothing is granted to the stopped server.
    """
    grace = 4.0
    broker = BrokerProcess(
        tmp_path,
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        USERS,
        extra=(
            "--ttl",
            "30",
            "--GPULeaseBroker.reap_interval=0.5",
            f"--GPULeaseBroker.queue_poll_grace={grace}",
        ),
    )
    broker.start()
    (spec,) = install_kernelspecs(tmp_path / "prefix", [0.5])
    server = JupyterServerProcess(
        tmp_path,
        broker.url,
        broker.tokens["alice"],
        kernels_prefix=tmp_path / "prefix",
        config={
            "GPULeaseProvisioner": {"long_poll": 2.0},
            "MappingKernelManager": {"cull_idle_timeout": 3, "cull_interval": 1},
        },
    )
    server.spec = spec  # type: ignore[attr-defined]
    admin = {"Authorization": f"token {broker.tokens['admin']}"}

    def queue() -> list[dict[str, Any]]:
        r = httpx.get(f"{broker.url}/api/v1/queue", headers=admin)
        return list(r.json()["queue"])

    def active(user: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{broker.url}/api/v1/leases", params={"all": "1"}, headers=admin)
        return [x for x in r.json()["leases"] if x["state"] == "active" and x["user"] == user]

    try:
        server.start()
        # the admin holds the whole V100 (a lease without a kernel: the culler cannot free it)
        held = httpx.post(
            f"{broker.url}/api/v1/leases",
            headers=admin,
            json={"kernel_id": str(uuid.uuid4()), "fraction": 1.0, "wait": 0},
        )
        assert held.status_code == 201, held.text
        start = Start(server, "wait.ipynb")
        wait_for(lambda: len(queue()) == 1, what="the kernel never joined the queue")
        # three cull intervals past the idle timeout: still waiting, still queued
        time.sleep(7)
        assert [k["state"] for k in by_path(server).values()] == ["waiting"]
        assert len(queue()) == 1
        # the GPU frees: the kernel starts, sits idle, and the culler takes it and its lease
        r = httpx.delete(f"{broker.url}/api/v1/leases/{held.json()['id']}", headers=admin)
        assert r.status_code in (200, 204), r.text
        assert start.result().status_code == 201
        assert len(active("alice")) == 1
        wait_for(lambda: active("alice") == [], timeout=30, what="the culled kernel kept its lease")
        # the provisioner releases the lease in the kernel's cleanup, before jupyter_client
        # removes the kernel from its list: the list empties a moment after the release
        wait_for(
            lambda: server.http.get("/api/kernels").json() == [],
            timeout=10,
            what="the culled kernel to leave /api/kernels",
            detail=lambda: str(server.http.get("/api/kernels").json()),
        )
        assert "Culling" in server.log(50_000), server.log()
        # a server stopped while a kernel waits: the broker drops the unpolled request
        held = httpx.post(
            f"{broker.url}/api/v1/leases",
            headers=admin,
            json={"kernel_id": str(uuid.uuid4()), "fraction": 1.0, "wait": 0},
        )
        assert held.status_code == 201, held.text
        body = server.session_body(str(uuid.uuid4()), spec)

        def start_then_lose_the_server() -> None:  # its answer never comes: the server stops
            try:
                server.http.post("/api/sessions", json=body, timeout=60)
            except httpx.TransportError:
                pass

        threading.Thread(target=start_then_lose_the_server, daemon=True).start()
        wait_for(lambda: len(queue()) == 1, what="the kernel never joined the queue")
        server.stop()
        stopped = time.monotonic()
        wait_for(lambda: queue() == [], timeout=grace + 10, what="the request stayed queued")
        assert time.monotonic() - stopped <= grace + 10
        httpx.delete(f"{broker.url}/api/v1/leases/{held.json()['id']}", headers=admin)
        time.sleep(2)
        assert active("alice") == []
    finally:
        server.stop()
        broker.stop()
