"""End to end through a real JupyterHub: the classroom as students, instructors and admins use it.

One hub per module (``python -m provisioner.demo`` on free ports, a fresh state
directory, kernelspecs in a temporary prefix, lease TTL 6 s, reaper every 0.5 s):
configurable-http-proxy, the broker as the hub-managed service ``gpu-lease`` (--auth
hub, quotas from hub_config/courses.toml), SimpleLocalProcessSpawner servers and real
ipykernel kernels started through each server's REST API. Tests run in file order
and share the hub; the last one stops it with SIGINT and checks nothing survives.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from provisioner.testing import free_port, load_example

ROOT = Path(__file__).resolve().parent.parent
TTL = 6.0

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]


class Hub:
    """The demo subprocess and helpers speaking to the hub, the servers and the broker."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.port = free_port()
        self.log_path = tmp / "demo.log"
        args = [
            sys.executable,
            "-m",
            "provisioner.demo",
            "--state-dir",
            str(self.state),
            "--kernels-prefix",
            str(tmp / "prefix"),
            "--port",
            str(self.port),
            "--hub-api-port",
            str(free_port()),
            "--proxy-api-port",
            str(free_port()),
            "--broker-port",
            str(free_port()),
            "--gpus",
            "1x32768:V100",
            "--ttl",
            str(TTL),
            "--reap-interval",
            "0.5",
            "--server-port-base",
            str(random.randrange(10000, 24000)),
        ]
        env = dict(os.environ)
        env.pop("JUPYTERHUB_API_TOKEN", None)
        env.pop("GPU_LEASE_TOKEN", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 180
        info_file = self.state / "demo.json"
        while not info_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the demo did not start:\n{self.log()}")
            time.sleep(0.25)
        self.info = json.loads(info_file.read_text())
        self.url = self.info["url"]
        self.broker = self.info["broker_url"]
        self.admin = self.info["admin_token"]
        self.http = httpx.Client(timeout=120)
        self.tokens: dict[str, str] = {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    # -- requests --------------------------------------------------------------------------
    def req(self, method: str, url: str, token: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"token {token or self.admin}"}
        return self.http.request(method, url, headers=headers, **kw)

    def token(self, user: str) -> str:
        if user not in self.tokens:
            r = self.req("POST", f"{self.url}/hub/api/users/{user}/tokens", json={"note": "test"})
            assert r.status_code == 201, r.text
            self.tokens[user] = r.json()["token"]
        return self.tokens[user]

    def spawn(self, user: str) -> None:
        token = self.token(user)
        self.req("POST", f"{self.url}/hub/api/users/{user}/server", token)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            model = self.req("GET", f"{self.url}/hub/api/users/{user}", token).json()
            if (model.get("servers") or {}).get("", {}).get("ready"):
                return
            time.sleep(0.5)
        raise AssertionError(f"the server of {user} did not start:\n{self.log()}")

    def stop_server(self, user: str) -> None:
        self.req("DELETE", f"{self.url}/hub/api/users/{user}/server")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            model = self.req("GET", f"{self.url}/hub/api/users/{user}").json()
            if not model.get("servers") and not model.get("pending"):
                return
            time.sleep(0.3)
        raise AssertionError(f"the server of {user} did not stop")

    def start_kernel(self, user: str, spec: str) -> httpx.Response:
        return self.req(
            "POST", f"{self.url}/user/{user}/api/kernels", self.token(user), json={"name": spec}
        )

    def leases(self, user: str | None = None) -> list[dict[str, Any]]:
        r = self.req("GET", f"{self.broker}/api/v1/leases", params={"all": "1"})
        assert r.status_code == 200, r.text
        return [
            x
            for x in r.json()["leases"]
            if x["state"] == "active" and (user is None or x["user"] == user)
        ]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    h = Hub(tmp_path_factory.mktemp("hub"))
    try:
        yield h
    finally:
        h.stop()
        h.http.close()


def run_cell(hub: Hub, user: str, kernel_id: str) -> str:
    import asyncio

    room = load_example("classroom").Classroom(hub.url, hub.admin)

    async def go() -> str:
        try:
            return str(await room.run_cell(user, hub.token(user), kernel_id))
        finally:
            await room.aclose()

    return asyncio.run(go())


# -- tests, in the order a class meets them ----------------------------------------------
def test_student_kernel_holds_a_lease_its_code_sees(hub: Hub) -> None:
    hub.spawn("student01")
    r = hub.start_kernel("student01", "python3-gpu-0.02")
    assert r.status_code == 201, r.text
    kernel_id = r.json()["id"]
    out = run_cell(hub, "student01", kernel_id)
    lease_id = out.strip().partition("lease=")[2]
    # the student's own token lists the lease: identity came from the hub
    mine = hub.req("GET", f"{hub.broker}/api/v1/leases", hub.token("student01")).json()["leases"]
    assert [(x["id"], x["kernel_id"], x["fraction"]) for x in mine] == [(lease_id, kernel_id, 0.02)]
    # the effective quota is the course's, from courses.toml
    me = hub.req("GET", f"{hub.broker}/api/v1/quotas/me", hub.token("student01")).json()
    assert me["effective"]["max_leases"] == 2 and me["effective"]["priority"] == 10


def test_outsider_is_refused_the_course_kernel(hub: Hub) -> None:
    hub.spawn("guest01")
    r = hub.start_kernel("guest01", "ml101-gpu-0.05")
    assert r.status_code >= 400
    message = r.json()["message"]
    assert "reserved for course 'ml101'" in message and "not a member" in message, message
    assert hub.leases("guest01") == []


def test_course_quota_holds_and_an_admin_change_takes_effect(hub: Hub) -> None:
    hub.spawn("student02")
    for _ in range(2):
        r = hub.start_kernel("student02", "python3-gpu-0.02")
        assert r.status_code == 201, r.text
    r = hub.start_kernel("student02", "python3-gpu-0.02")
    assert r.status_code >= 400
    assert "(2)" in r.json()["message"] and "Shut down a GPU kernel" in r.json()["message"]
    # the admin raises the limit with the CLI, against the broker behind the hub
    env = dict(os.environ, GPU_LEASE_URL=hub.broker, GPU_LEASE_TOKEN=hub.admin)
    cli = [str(Path(sys.executable).parent / "gpu-lease"), "quota", "set", "--user", "student02"]
    done = subprocess.run([*cli, "--max-leases", "3"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    r = hub.start_kernel("student02", "python3-gpu-0.02")
    assert r.status_code == 201, r.text
    assert "lease=" in run_cell(hub, "student02", r.json()["id"])
    assert len(hub.leases("student02")) == 3
    r = hub.req("DELETE", f"{hub.broker}/api/v1/quotas/users/student02")
    assert r.status_code in (200, 204), r.text


def test_students_cannot_see_or_release_anothers_lease(hub: Hub) -> None:
    (lease,) = hub.leases("student01")
    other = hub.token("student02")
    for method in ("GET", "DELETE"):
        r = hub.req(method, f"{hub.broker}/api/v1/leases/{lease['id']}", other)
        assert r.status_code == 403, r.text
    r = hub.req("GET", f"{hub.broker}/api/v1/leases", other, params={"all": "1"})
    assert r.status_code == 403 or all(x["user"] == "student02" for x in r.json()["leases"])
    # the instructor holds custom:gpu-lease:admin through the hub role
    r = hub.req("GET", f"{hub.broker}/api/v1/leases", hub.token("instructor"), params={"all": "1"})
    assert r.status_code == 200 and {x["user"] for x in r.json()["leases"]} >= {"student01"}
    # a token without the service's access scope is refused
    r = hub.req(
        "POST",
        f"{hub.url}/hub/api/users/student03/tokens",
        json={"scopes": ["read:users:name!user=student03"]},
    )
    assert r.status_code == 201, r.text
    r = hub.req("GET", f"{hub.broker}/api/v1/leases", r.json()["token"])
    assert r.status_code == 403 and "access:services!service=gpu-lease" in r.json()["message"]


def test_stopping_a_server_releases_its_leases(hub: Hub) -> None:
    assert len(hub.leases("student02")) == 3
    hub.stop_server("student02")
    assert hub.leases("student02") == []


def test_killed_server_leases_expire_within_two_ttls(hub: Hub) -> None:
    (lease,) = hub.leases("student01")
    demo = psutil.Process(hub.proc.pid)
    server = next(
        p
        for p in demo.children(recursive=True)
        if "jupyterhub-singleuser" in " ".join(p.cmdline())
        and p.environ().get("JUPYTERHUB_USER") == "student01"
    )
    kernels = server.children(recursive=True)
    server.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        while hub.leases("student01") and time.monotonic() - t0 < 4 * TTL:
            time.sleep(0.2)
        took = time.monotonic() - t0
        assert hub.leases("student01") == [], hub.log()
        assert took <= 2 * TTL, f"the lease outlived its server by {took:.1f} s"
        r = hub.req("GET", f"{hub.broker}/api/v1/leases/{lease['id']}")
        assert r.json()["state"] == "expired"
    finally:
        for p in kernels:  # orphaned kernels (ipykernel also exits when its parent dies)
            try:
                p.kill()
            except psutil.Error:
                pass
    hub.stop_server("student01")  # lets the hub forget the dead server


async def test_classroom_of_ten_leaks_nothing(hub: Hub) -> None:
    classroom = load_example("classroom")
    names = [f"student{i:02d}" for i in range(11, 21)]
    report = await classroom.run_classroom(hub.url, hub.admin, len(names), names=names)
    print(report.summary())
    assert report.errors == []
    assert report.leases_held == 10
    assert report.leaks == 0
    assert hub.leases() == []


def test_ctrl_c_stops_everything_without_orphans(hub: Hub) -> None:
    # a live server with a GPU kernel while Ctrl-C arrives (guest01: default quota, one 0.02)
    r = hub.start_kernel("guest01", "python3-gpu-0.02")
    assert r.status_code == 201, r.text
    assert len(hub.leases("guest01")) == 1
    procs, cmdlines = [], []
    for p in psutil.Process(hub.proc.pid).children(recursive=True):
        try:
            cmdlines.append(" ".join(p.cmdline()))
            procs.append(p)
        except psutil.Error:  # exited meanwhile, or a zombie not yet collected
            pass
    names = " ".join(cmdlines)
    for part in ("jupyterhub", "configurable-http-proxy", "provisioner.broker.app", "ipykernel"):
        assert part in names
    assert hub.stop(signal.SIGINT) == 0, hub.log()
    survivors = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                survivors.append(" ".join(p.cmdline()))
        except psutil.NoSuchProcess:
            pass
    assert survivors == [], survivors
    db = sqlite3.connect(hub.state / "gpu-lease.sqlite")
    try:
        active = db.execute("SELECT user FROM leases WHERE state = 'active'").fetchall()
    finally:
        db.close()
    assert active == []  # the servers stopped (and released) before the broker
