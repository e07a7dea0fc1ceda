"""End to end through a real JupyterHub: the classroom as students, instructors and admins use it.

One hub per module (``python -m provisioner.devtools.demo`` on free ports, a fresh state
directory, kernelspecs in a temporary prefix, lease TTL 6 s, reaper every 0.5 s):
configurable-http-proxy, the broker as the hub-managed service ``gpu-lease`` (--auth
hub, quotas from hub_config/courses.toml), SimpleLocalProcessSpawner servers and real
ipykernel kernels started through each server's REST API. Tests run in file order
and share the hub (one starts a second hub beside it, with the same server ports); the
last one stops it with SIGINT and checks nothing survives.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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

from provisioner.devtools.demohub import demo_command
from provisioner.devtools.testing import free_port, load_example, wait_for

from .conftest import hub_env

ROOT = Path(__file__).resolve().parent.parent
TTL = 6.0

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]


class Hub:
    """The demo subprocess and helpers speaking to the hub, the servers and the broker."""

    def __init__(
        self,
        tmp: Path,
        server_port_base: int | None = None,
        env: dict[str, str] | None = None,
        gpus: str = "1x32768:V100",
        python: str | None = None,
    ) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.port = free_port()
        if server_port_base is None:
            server_port_base = random.randrange(10000, 24000)
        self.server_port_base = server_port_base
        self.log_path = tmp / "demo.log"
        args = demo_command(
            self.state,
            tmp / "prefix",
            self.port,
            gpus,
            *("--ttl", str(TTL), "--reap-interval", "0.5"),
            server_port_base=server_port_base,
        )
        if python:  # the demo, the hub and everything it starts on another interpreter
            args[0] = python
        #: the hub_config knobs this hub was started with (``env``)
        self.knobs = dict(env or {})
        extra, env = env, dict(os.environ)
        env.update(extra or {})  # hub_config's GPU_LEASE_* knobs
        env.pop("JUPYTERHUB_API_TOKEN", None)
        env.pop("GPU_LEASE_TOKEN", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        info_file = self.state / "demo.json"
        try:
            wait_for(
                lambda: info_file.exists() or self.proc.poll() is not None,
                180,
                "the demo to start",
                0.25,
                self.log,
            )
            if self.proc.poll() is not None:
                raise RuntimeError(f"the demo exited with {self.proc.returncode}:\n{self.log()}")
            self.info = json.loads(info_file.read_text())
        except BaseException:
            self.stop()  # whatever failed, no demo is left running
            raise
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

        def ready() -> bool:
            model = self.req("GET", f"{self.url}/hub/api/users/{user}", token).json()
            server = (model.get("servers") or {}).get("")
            if server is None and not model.get("pending"):  # the spawn failed: say why now
                raise AssertionError(f"the server of {user} failed to start:\n{self.log()}")
            return bool((server or {}).get("ready"))

        wait_for(ready, 180, f"the server of {user} to start", 0.5, self.log)

    def stop_server(self, user: str) -> None:
        self.req("DELETE", f"{self.url}/hub/api/users/{user}/server")

        def stopped() -> bool:
            model = self.req("GET", f"{self.url}/hub/api/users/{user}").json()
            return not model.get("servers") and not model.get("pending")

        wait_for(stopped, 60, f"the server of {user} to stop", 0.3, self.log)

    def holding(self, user: str, spec: str = "python3-gpu-0.02") -> list[dict[str, Any]]:
        """``user``'s active leases, after starting their server and a kernel of ``spec``
        if they hold none: each test makes what it needs and runs alone too (``-k``)."""
        self.spawn(user)
        if not self.leases(user):
            r = self.start_kernel(user, spec)
            assert r.status_code == 201, r.text
        return self.leases(user)

    def start_kernel(self, user: str, spec: str) -> httpx.Response:
        return self.req(
            "POST", f"{self.url}/user/{user}/api/kernels", self.token(user), json={"name": spec}
        )

    def active_in_database(self) -> list[str]:
        """The users of active leases in the broker's database file (read after it stopped)."""
        db = sqlite3.connect(self.state / "gpu-lease.sqlite")
        try:
            rows = db.execute("SELECT user FROM leases WHERE state = 'active'").fetchall()
        finally:
            db.close()
        return [str(user) for (user,) in rows]

    def leases(self, user: str | None = None) -> list[dict[str, Any]]:
        r = self.req("GET", f"{self.broker}/api/v1/leases", params={"all": "1"})
        assert r.status_code == 200, r.text
        return [
            x
            for x in r.json()["leases"]
            if x["state"] == "active" and (user is None or x["user"] == user)
        ]


@contextlib.contextmanager
def running_hub(tmp: Path, **kw: Any) -> Iterator[Hub]:
    """A :class:`Hub` for the ``with`` block (``kw``: Hub's options), then stopped."""
    h = Hub(tmp, **kw)
    try:
        yield h
    finally:
        h.stop()
        h.http.close()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, hub_http_processes: int) -> Iterator[Hub]:
    with running_hub(tmp_path_factory.mktemp("hub"), env=hub_env(hub_http_processes)) as h:
        yield h


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


def offered(hub: Hub, user: str) -> set[str]:
    """The kernelspecs ``user``'s server lists (what JupyterLab's launcher shows)."""
    r = hub.req("GET", f"{hub.url}/user/{user}/api/kernelspecs", hub.token(user))
    assert r.status_code == 200, r.text
    return set(r.json()["kernelspecs"])


GPU_SPECS = {f"python3-gpu-{f}" for f in ("0.02", "0.05", "0.1", "0.25", "0.5", "1")}


def test_the_launcher_offers_what_the_quota_allows(hub: Hub) -> None:
    """ml101 (0.05 per kernel): three GPU kernels, not seven; guest01 no course kernel;
    the admin every one. A start forced by name is still the broker's to refuse."""
    every = GPU_SPECS | {"ml101-gpu-0.05"}
    for user in ("student01", "guest01", "admin"):
        hub.spawn(user)
    mine = offered(hub, "student01")
    assert mine & every == {"python3-gpu-0.02", "python3-gpu-0.05", "ml101-gpu-0.05"}, mine
    assert "python3" in mine
    guest = offered(hub, "guest01")
    assert guest & every == {"python3-gpu-0.02", "python3-gpu-0.05"}, guest
    assert offered(hub, "admin") >= every
    r = hub.start_kernel("guest01", "python3-gpu-0.25")
    assert r.status_code == 403, r.text
    assert "above your per-kernel limit of 0.05" in " ".join(r.json()["message"].split())
    assert hub.leases("guest01") == []


async def terminal(hub: Hub, user: str, commands: list[str], marker: str) -> str:
    """Run ``commands`` in a JupyterLab terminal of ``user``'s server (terminado over the
    hub's proxy, as an instructor types them) and return its output up to ``marker``
    (the terminal echoes what is typed: choose a marker only the commands print)."""
    import asyncio
    import json as json_

    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    token = hub.token(user)
    r = hub.req("POST", f"{hub.url}/user/{user}/api/terminals", token)
    assert r.status_code == 200, r.text
    name = r.json()["name"]
    url = f"{hub.url.replace('http', 'ws', 1)}/user/{user}/terminals/websocket/{name}"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}))
    out = ""
    try:
        for command in commands:
            ws.write_message(json_.dumps(["stdin", command + "\r"]))
        deadline = asyncio.get_running_loop().time() + 120
        while marker not in out:
            left = deadline - asyncio.get_running_loop().time()
            assert left > 0, f"no {marker!r} in the terminal's output:\n{out}"
            message = await asyncio.wait_for(ws.read_message(), left)
            assert message is not None, f"the terminal closed:\n{out}"
            kind, *data = json_.loads(message)
            if kind == "stdout":
                out += str(data[0])
    finally:
        protocol = ws.protocol  # close() forgets it
        ws.close()
        # tornado closes the socket when the server answers the close frame, or from a 5 s
        # timer that never fires once this test's event loop has ended: close it now
        if protocol is not None and protocol.stream is not None:
            protocol.stream.close()
        hub.req("DELETE", f"{hub.url}/user/{user}/api/terminals/{name}", token)
    return out


async def test_instructor_publishes_a_kernel_from_a_server_terminal(hub: Hub) -> None:
    """`gpu-lease` works in a hub server's terminal (it was "command not found")."""
    for user in ("instructor", "student01", "guest01"):
        hub.spawn(user)
    prefix = hub.tmp / "prefix"  # in the servers' JUPYTER_PATH (--kernels-prefix)
    out = await terminal(
        hub,
        "instructor",
        [
            "command -v gpu-lease",
            f"gpu-lease kernelspec install --fraction 0.01 --group ml101 --prefix {prefix}"
            "; echo rc1=$?",
            f"gpu-lease kernelspec install --fraction 0.05 --group ml101 --name ml101-lab "
            f"--display-name 'ML101 lab' --prefix {prefix}; echo rc2=$?",
            f"gpu-lease kernelspec install --fraction 0.05 --name ml101-lab --prefix {prefix}"
            "; echo rc3=$?",
            "gpu-lease quota show --user student07; echo rc4=$?",
            "echo END-$((40 + 2))",  # the marker appears only once the commands ran
        ],
        "END-42",
    )
    text = out.replace("\r", "")
    assert f"{Path(sys.executable).parent}/gpu-lease" in text, text
    assert "command not found" not in text, text
    # the broker's pool was asked (GPU_LEASE_URL and the server's token): 0.01 never fits
    assert "error: Not installed: a GPU fraction of 0.01 gives at most 327 MiB" in text, text
    assert "rc1=1" in text and "rc2=0" in text, text
    assert "already installed" in text and "rc3=1" in text, text  # no silent overwrite
    # the instructor (custom:gpu-lease:admin) reads a student's effective quota, groups
    # from JupyterHub: the course's limits, not the default's
    assert "as the broker applies it to student07 in groups ml101 (from JupyterHub):" in text
    assert "rc4=0" in text, text
    lines = [x.split() for x in text.splitlines()]
    assert ["max", "leases", "2", "group", "ml101"] in lines, text
    assert ["priority", "10", "group", "ml101"] in lines, text
    # a member's launcher offers the new course kernel at once; an outsider's does not
    assert "ml101-lab" in offered(hub, "student01")
    assert "ml101-lab" not in offered(hub, "guest01")


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
    lease = hub.holding("student01")[0]
    other = hub.token("student02")
    for method in ("GET", "DELETE"):
        r = hub.req(method, f"{hub.broker}/api/v1/leases/{lease['id']}", other)
        # as a lease that does not exist: no oracle
        assert r.status_code == 404, r.text
        assert r.json()["message"] == f"No GPU lease has the id {lease['id']!r}.", r.text
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
    assert hub.holding("student02")  # three after the quota test, one when run alone
    hub.stop_server("student02")
    assert hub.leases("student02") == []


def test_killed_server_leases_expire_within_two_ttls(hub: Hub) -> None:
    (lease,) = hub.holding("student01")
    demo = psutil.Process(hub.proc.pid)
    server = next(
        p
        for p in demo.children(recursive=True)
        if p.ppid() == hub.info["hub_pid"]  # a server (its kernels are the server's children)
        and p.environ().get("JUPYTERHUB_USER") == "student01"
    )
    kernels = server.children(recursive=True)
    server.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        wait_for(lambda: not hub.leases("student01"), 4 * TTL, "the lease to expire", 0.2, hub.log)
        took = time.monotonic() - t0
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


def user_ids(hub: Hub) -> dict[int, str]:
    """id -> name of the students the tests above never use, from the hub's database."""
    db = sqlite3.connect(hub.state / "jupyterhub.sqlite")
    try:
        rows = db.execute("SELECT id, name FROM users WHERE name >= 'student21'").fetchall()
    finally:
        db.close()
    return {int(i): str(name) for i, name in rows if str(name).startswith("student")}


def test_two_hubs_route_each_student_to_their_own_server(
    hub: Hub, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two hubs from hub_config on one machine, with the same server port settings (as two
    installs with the defaults): students of the same user id on each spawn at once, and
    each one's requests through their hub reach their own server, never the other's."""
    with running_hub(
        tmp_path_factory.mktemp("hub2"), server_port_base=hub.server_port_base, env=hub.knobs
    ) as other:
        ids = [user_ids(h) for h in (hub, other)]
        same_id = min(set(ids[0]) & set(ids[1]))  # never used by the tests above
        students = [(hub, ids[0][same_id]), (other, ids[1][same_id])]
        for h, user in students:  # a file in the student's home on that hub says which hub
            home = h.state / "home" / user
            home.mkdir(parents=True, exist_ok=True)
            (home / "which-hub.txt").write_text(h.url)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(h.spawn, user) for h, user in students]:
                done.result()
        for h, user in students:
            token = h.token(user)
            me = h.req("GET", f"{h.url}/user/{user}/api/me", token)
            assert me.status_code == 200, (h.url, user, me.status_code, me.text[:300])
            assert me.json()["identity"]["username"] == user
            mark = h.req("GET", f"{h.url}/user/{user}/api/contents/which-hub.txt", token)
            assert mark.status_code == 200, (h.url, user, mark.status_code, mark.text[:300])
            assert mark.json()["content"] == h.url  # this hub's student's server, no other
        for h, user in students:
            h.stop_server(user)


def test_ctrl_c_stops_everything_without_orphans(hub: Hub) -> None:
    # a live server with a GPU kernel while Ctrl-C arrives (guest01: default quota, one 0.02)
    hub.spawn("guest01")
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
    assert hub.active_in_database() == []  # the servers stopped (and released) first
