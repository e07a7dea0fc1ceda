"""The dashboard at ``GET {prefix}``: content negotiation, hub OAuth wiring, a real browser.

- Without a browser: ``Accept: text/html`` gets the page (with a strict CSP), anything
  else the JSON index; ``{prefix}api/v1/`` is the JSON index; the script is served.
- Hub OAuth (``--auth hub``), in-process around a stand-in for the hub's ``/hub/api/user``
  (JupyterHub itself is tested with the dashboard in the hub tests): an anonymous browser
  is sent to ``/hub/api/oauth2/authorize``; the login cookie identifies the user for the
  page and, with the page's XSRF token, for the API; without that token the cookie is
  not accepted for a POST. A real ``gpu-lease broker --auth hub`` redirects as well.
- ``slow``: Debian's chromium, driven by Playwright, against a real broker with static
  tokens: an admin sees every lease and the allocation bars, a student only their own;
  over two lab sessions replayed into the database (``devtools/classday.py``) and a full
  pool, the history plots render, the course filter narrows leases, queue and plots,
  and an admin revokes a lease with a reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib
from tornado import web
from tornado.httpserver import HTTPServer

from provisioner.broker.rules.policy import Policy
from provisioner.broker.services.broker_service import BrokerService
from provisioner.broker.store.store import Store
from provisioner.broker.web.auth import HubTokens, make_hub_oauth
from provisioner.broker.web.routes import make_app
from provisioner.devtools import classday
from provisioner.devtools.testing import BrokerProcess, free_port, wait_for, wait_for_http
from provisioner.inventory import parse_gpu_spec

from .conftest import ROOT, Broker

sqlite_only = pytest.mark.parametrize("broker_db_url", ["sqlite"], indirect=True)
HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
PREFIX = "/services/gpu-lease/"
CLIENT_ID = "service-gpu-lease"


def acquire(broker: Broker, user: str, kernel_id: str, fraction: float) -> dict[str, Any]:
    r = httpx.post(
        f"{broker.url}/api/v1/leases",
        json={"kernel_id": kernel_id, "fraction": fraction, "wait": 0},
        headers=broker.headers(user),
        timeout=10,
    )
    assert r.status_code in (201, 202), r.text
    body: dict[str, Any] = r.json()
    return body


# -- without a browser ----------------------------------------------------------------------
@pytest.mark.slow
@sqlite_only
def test_page_or_index_by_accept(broker: Broker) -> None:
    page = httpx.get(f"{broker.url}/", headers=HTML)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    # no page of any origin may frame it (clickjacking): nor may any other answer be framed
    assert "frame-ancestors 'none'" in csp and page.headers["x-frame-options"] == "DENY"
    for other in (f"{broker.url}/api/v1/", f"{broker.url}/nope", f"{broker.url}/api/v1/gpus"):
        r = httpx.get(other, headers=HTML)
        assert r.headers["content-security-policy"] == "frame-ancestors 'none'", other
        assert r.headers["x-frame-options"] == "DENY", other
    assert '<html lang="en">' in page.text and 'data-auth="token"' in page.text
    script = re.search(r'<script src="([^"]+)"', page.text)
    assert script is not None and script.group(1).startswith("/static/dashboard.js?v=")
    assert "http://" not in page.text and "https://" not in page.text  # no external assets
    js = httpx.get(f"{broker.url}{script.group(1)}")
    assert js.status_code == 200 and "sessionStorage" in js.text
    for url, headers in (
        (f"{broker.url}/", {}),
        (f"{broker.url}/", {"Accept": "application/json"}),
        (f"{broker.url}/api/v1/", HTML),
        (f"{broker.url}/api/v1", {}),
    ):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 200, url
        assert r.json()["api"] == "/api/v1/" and r.json()["dashboard"] == "/"


# -- hub OAuth, in-process -----------------------------------------------------------------------
class FakeHubUser(web.RequestHandler):
    """``GET /hub/api/user``: the model of the token in ``Authorization`` (403 if unknown)."""

    def get(self) -> None:
        token = self.request.headers.get("Authorization", "").partition(" ")[2]
        model = self.settings["models"].get(token)
        if model is None:
            raise web.HTTPError(403)
        self.write(model)


MODELS = {
    "oauth-teacher": {
        "kind": "user",
        "name": "teacher",
        "admin": False,
        "groups": ["ml101"],
        "scopes": ["access:services!service=gpu-lease", "custom:gpu-lease:admin"],
    },
    "oauth-outsider": {"kind": "user", "name": "eve", "groups": [], "scopes": []},
}


class HubBroker:
    def __init__(self, url: str, app: web.Application, service: BrokerService) -> None:
        self.url = url
        self.app = app
        self.service = service

    def cookie(self, token: str) -> str:
        signed = web.create_signed_value(self.app.settings["cookie_secret"], CLIENT_ID, token)
        return f"{CLIENT_ID}={signed.decode()}"


@pytest.fixture
async def hub_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HubBroker]:
    for name in list(os.environ):
        if name.startswith("JUPYTERHUB_"):
            monkeypatch.delenv(name)
    hub_port, port = free_port(), free_port()
    hub = HTTPServer(web.Application([(r"/hub/api/user", FakeHubUser)], models=MODELS))
    hub.listen(hub_port, "127.0.0.1")
    oauth = make_hub_oauth(
        PREFIX,
        api_url=f"http://127.0.0.1:{hub_port}/hub/api",
        api_token="service-token",
        oauth_client_id=CLIENT_ID,
        service_name="gpu-lease",
    )
    assert oauth is not None
    store = Store(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    service = BrokerService(store, parse_gpu_spec("1x32768:V100"), Policy())
    service.start()
    app = make_app(service, HubTokens(hub_auth=oauth), base_url=PREFIX)
    server = HTTPServer(app)
    server.listen(port, "127.0.0.1")
    try:
        yield HubBroker(f"http://127.0.0.1:{port}{PREFIX}", app, service)
    finally:
        for srv in (server, hub):
            srv.stop()
            await srv.close_all_connections()
        service.close()


async def test_hub_anonymous_browser_is_sent_to_hub_login(hub_broker: HubBroker) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.get(hub_broker.url, headers=HTML)
        assert r.status_code == 302
        assert r.headers["x-frame-options"] == "DENY"
        location = httpx.URL(r.headers["location"])
        assert location.path == "/hub/api/oauth2/authorize"
        assert location.params["client_id"] == CLIENT_ID
        assert location.params["redirect_uri"] == f"{PREFIX}oauth_callback"
        assert location.params["response_type"] == "code" and location.params["state"]
        assert location.params["code_challenge_method"] == "S256"
        assert any(k.startswith(f"{CLIENT_ID}-oauth-state") for k in r.cookies)
        # the API answers 401 JSON to anonymous callers (never a redirect)
        r = await c.get(f"{hub_broker.url}api/v1/gpus", headers=HTML)
        assert r.status_code == 401 and "log in through the dashboard" in r.json()["message"]
        # non-browsers still get the JSON index at the prefix
        assert (await c.get(hub_broker.url)).json()["api"] == f"{PREFIX}api/v1/"
        # the OAuth callback is served (and refuses a visit without a code)
        r = await c.get(f"{hub_broker.url}oauth_callback")
        assert r.status_code == 400
        assert r.headers["content-security-policy"] == "frame-ancestors 'none'"
        assert r.headers["x-frame-options"] == "DENY"


async def test_hub_cookie_identifies_page_and_api_with_xsrf(hub_broker: HubBroker) -> None:
    login = hub_broker.cookie("oauth-teacher")
    async with httpx.AsyncClient(headers={"User-Agent": "test-browser"}) as c:
        page = await c.get(
            hub_broker.url, headers={**HTML, "Cookie": login, "Sec-Fetch-Mode": "navigate"}
        )
        assert page.status_code == 200, page.text
        assert 'data-auth="hub"' in page.text and 'data-user="teacher"' in page.text
        xsrf = re.search(r'data-xsrf="([^"]+)"', page.text)
        assert xsrf is not None
        cookies = f"{login}; _xsrf={page.cookies['_xsrf']}"
        fetch = {"Cookie": cookies, "Sec-Fetch-Mode": "cors", "Sec-Fetch-Site": "same-origin"}
        api = f"{hub_broker.url}api/v1/"
        # a fetch() from the page: cookie + X-XSRFToken
        r = await c.get(f"{api}quotas/me", headers={**fetch, "X-XSRFToken": xsrf.group(1)})
        assert r.status_code == 200 and r.json()["user"] == "teacher"
        # the admin scope makes the teacher a GPU lease admin
        r = await c.get(f"{api}quotas", headers={**fetch, "X-XSRFToken": xsrf.group(1)})
        assert r.status_code == 200
        # without the XSRF token the cookie is not accepted (GET by fetch, and POST)
        r = await c.get(f"{api}quotas/me", headers=fetch)
        assert r.status_code == 401
        r = await c.post(f"{api}leases/nope/revoke", json={"reason": "x"}, headers=fetch)
        assert r.status_code == 401
        r = await c.post(
            f"{api}leases/nope/revoke",
            json={"reason": "x"},
            headers={**fetch, "X-XSRFToken": "forged"},
        )
        assert r.status_code == 401
        r = await c.post(
            f"{api}leases/nope/revoke",
            json={"reason": "x"},
            headers={**fetch, "X-XSRFToken": xsrf.group(1)},
        )
        assert r.status_code == 404  # identified as an admin; the lease does not exist


async def test_hub_user_without_access_scope_is_refused(hub_broker: HubBroker) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.get(
            hub_broker.url,
            headers={**HTML, "Cookie": hub_broker.cookie("oauth-outsider")},
        )
        assert r.status_code == 403
        assert "access:services!service=gpu-lease" in r.json()["message"]


@pytest.mark.slow
def test_real_broker_with_auth_hub_redirects_to_hub(tmp_path: Path) -> None:
    """``gpu-lease broker --auth hub`` as JupyterHub starts a managed service with a URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    env.update(
        PYTHONPATH=str(ROOT),
        JUPYTERHUB_API_TOKEN="service-token",
        JUPYTERHUB_API_URL=f"http://127.0.0.1:{free_port()}/hub/api",
        JUPYTERHUB_CLIENT_ID=CLIENT_ID,
        JUPYTERHUB_SERVICE_NAME="gpu-lease",
        JUPYTERHUB_SERVICE_PREFIX=PREFIX,
        JUPYTERHUB_OAUTH_CALLBACK_URL=f"{PREFIX}oauth_callback",
        JUPYTERHUB_SERVICE_URL=f"http://127.0.0.1:{port}",
    )
    cmd = [sys.executable, "-m", "provisioner.broker.app", "--gpus", "1x16384:T4"]
    cmd += ["--db-url", f"sqlite:///{tmp_path / 'b.sqlite'}"]
    log = tmp_path / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}{PREFIX}"
        wait_for_http(f"{base}api/v1/health", proc, log.read_text, 20, what="the broker")
        r = httpx.get(base, headers=HTML)
        assert r.status_code == 302, r.text
        assert r.headers["location"].startswith("/hub/api/oauth2/authorize?client_id=")
        assert "auth hub" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


# -- in a real browser (the chromium fixture is in conftest.py) ---------------------------
def open_dashboard(chromium: Any, broker: Broker, user: str | None) -> tuple[Any, Any, list[str]]:
    """A fresh browser context (its own sessionStorage) signed in as ``user``."""
    context = chromium.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.goto(f"{broker.url}/")
    page.wait_for_selector("#login-form", state="visible")
    if user is not None:
        page.fill("#token", broker.tokens[user])
        page.click("button[type=submit]")
    return context, page, problems


@pytest.mark.slow
@sqlite_only
def test_browser_admin_and_student(chromium: Any, broker: Broker, tmp_path: Path) -> None:
    acquire(broker, "alice", "aaaaaaaa-1111", 0.25)
    acquire(broker, "bob", "bbbbbbbb-2222", 0.25)
    acquire(broker, "carol", "cccccccc-3333", 0.75)  # waits
    httpx.put(
        f"{broker.url}/api/v1/quotas/groups/ml101",
        json={"max_fraction": 0.5, "priority": 3},
        headers=broker.headers("admin"),
    ).raise_for_status()

    context, page, problems = open_dashboard(chromium, broker, "admin")
    page.wait_for_selector("#quotas table")
    assert page.inner_text("#who") == "Signed in as admin (admin)"
    gpus = page.inner_text("#gpus")
    assert "GPU 0 · V100" in gpus and "50% allocated" in gpus and "16384 / 32768 MiB" in gpus
    meter = page.locator("#gpus [role=meter]")
    assert meter.get_attribute("aria-valuenow") == "50"
    assert meter.locator("span").evaluate("e => e.style.width") == "50%"
    leases = page.inner_text("#leases")
    assert "alice" in leases and "bob" in leases and "aaaaaaaa" in leases and "25%" in leases
    queue = page.inner_text("#queue")
    assert "carol" in queue and "75%" in queue
    assert "ml101" in page.inner_text("#quotas")
    page.screenshot(path=str(tmp_path / "admin.png"), full_page=True)
    assert problems == []
    context.close()

    context, page, problems = open_dashboard(chromium, broker, "alice")
    page.wait_for_selector("#leases table")
    assert page.inner_text("#who") == "Signed in as alice"
    leases = page.inner_text("#leases")
    assert "alice" in leases and "bob" not in leases
    assert "carol" not in page.inner_text("#queue")
    assert "Holding now: 25% of a GPU in 1 lease." in page.inner_text("#quota")
    assert "0.5" in page.inner_text("#quota")  # ml101's quota applies to her
    assert page.locator("#quotas-section").is_hidden()
    page.screenshot(path=str(tmp_path / "student.png"), full_page=True)
    # "Forget the token" returns to the sign-in form
    page.click("#logout")
    page.wait_for_selector("#login-form", state="visible")
    assert page.evaluate("sessionStorage.length") == 0
    assert problems == []
    context.close()


@pytest.mark.slow
@sqlite_only
def test_browser_a_page_that_frames_the_dashboard_shows_nothing(
    chromium: Any, broker: Broker, tmp_path: Path
) -> None:
    """A page a student serves from their own server frames the dashboard to drive an
    instructor's session by clicks. Without ``subdomain_host`` the
    student's server and the broker share the hub's origin (``/user/s002/`` and
    ``/services/gpu-lease/`` behind one proxy), so the page here is served at the broker's
    origin, as the proxy would serve it: the browser still shows nothing in the frame."""
    context = chromium.new_context()
    page = context.new_page()
    student_page = f"{broker.url}/user/s002/files/prize.html"
    framing = f'<iframe id="d" src="{broker.url}/" width="800" height="600"></iframe>'
    page.route(student_page, lambda route: route.fulfill(body=framing, content_type="text/html"))
    refused: list[str] = []
    page.on("console", lambda m: refused.append(m.text) if "frame-ancestors" in m.text else None)
    page.goto(student_page)
    wait_for(
        lambda: page.evaluate("1") and refused,  # evaluate: Playwright delivers events
        what="chromium to refuse the frame",
        interval=0.2,
    )
    assert page.frame_locator("#d").locator("#token").count() == 0  # no dashboard inside
    page.screenshot(path=str(tmp_path / "framed.png"))
    context.close()


@pytest.mark.slow
@sqlite_only
def test_browser_bad_token_and_refresh(chromium: Any, broker: Broker) -> None:
    context = chromium.new_context()
    page = context.new_page()
    page.goto(f"{broker.url}/")
    page.fill("#token", "not-a-real-token")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-error:has-text('not valid')")
    assert page.locator("#content").is_hidden()
    # a valid token survives a reload (sessionStorage), and the page refreshes by itself
    page.fill("#token", broker.tokens["bob"])
    page.click("button[type=submit]")
    page.wait_for_selector("#leases:has-text('You hold no GPU lease.')")
    page.reload()
    page.wait_for_selector("#leases:has-text('You hold no GPU lease.')")
    acquire(broker, "bob", "b0b0b0b0-1", 0.5)
    page.wait_for_selector("#leases:has-text('b0b0b0b0')", timeout=15_000)
    context.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_browser_history_plots_course_view_and_revoke(chromium: Any, tmp_path: Path) -> None:
    """Two lab sessions replayed through the broker's service, then a full pool live."""
    db_url = f"sqlite:///{tmp_path / 'gpu-lease.sqlite'}"
    users = classday.classroom_users()
    sessions = (("ml101", 2.0, 60), ("cs50", 1.8, 45))
    counts = classday.seed_history(db_url, users, end=time.time() - 60, hours=3, sessions=sessions)
    assert counts["queued"] > 0 and counts["granted"] > 20, counts
    broker = BrokerProcess(tmp_path, db_url, users, gpus=classday.GPUS, extra=("--ttl", "600"))
    broker.start()
    try:
        live = classday.fill_pool(broker.url, broker.tokens)
        context = chromium.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda exc: problems.append(str(exc)))
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.goto(f"{broker.url}/")
        page.fill("#token", broker.tokens["admin"])
        page.click("button[type=submit]")
        # the three plots, drawn as inline SVG from GET /api/v1/history
        page.wait_for_selector("#history svg[data-plot=waits]")
        plots = page.locator("#history svg.plot")
        assert plots.count() == 3
        assert [plots.nth(i).get_attribute("data-plot") for i in range(3)] == [
            "allocation",
            "queue",
            "waits",
        ]
        mean = page.locator("svg[data-plot=allocation] path[data-series=allocated]")
        assert len(mean.get_attribute("d") or "") > 100  # a shape, not an empty path
        box = page.locator("svg[data-plot=allocation]").bounding_box()
        assert box is not None and box["width"] > 250 and box["height"] > 120
        assert page.locator("svg[data-plot=allocation] .s-capacity").count() == 1
        captions = page.inner_text("#history")
        assert "Peak 1.00 GPU at " in captions and " · mean 0." in captions, captions
        assert "Peak " in captions and " waiting at " in captions
        assert "grants waited" in captions
        assert page.locator("svg[data-plot=waits] rect").count() >= 1
        label = page.locator("svg[data-plot=queue]").get_attribute("aria-label") or ""
        assert label.startswith("Queue length. Peak ")
        # lease ids in full, and the per-course summary
        page.wait_for_selector("#courses table")
        leases_text = page.inner_text("#leases")
        assert all(lease_id in leases_text for lease_id in live["held"])
        courses = page.inner_text("#courses")
        assert "cs50" in courses and "ml101" in courses and "(no course)" in courses
        # the per-course view: leases, queue and plots of cs50 only
        page.select_option("#course", "cs50")
        page.wait_for_selector("#history figcaption:has-text('cs50: GPU allocation')")
        rows = page.locator("#leases tbody tr")
        assert rows.count() == 4  # cs01, cs03; cs04, cs05 from the queue (cs02 released)
        assert set(page.locator("#leases tbody tr td:nth-child(3)").all_inner_texts()) == {"cs50"}
        assert "guest01" not in page.inner_text("#queue") and "cs06" in page.inner_text("#queue")
        page.select_option("#course", "")
        page.wait_for_selector("#queue:has-text('guest01')")
        assert "student" not in page.inner_text("#queue")
        page.select_option("#course", "*")
        page.wait_for_selector("#history figcaption:has-text('GPU allocation')")
        # revoke student05's lease with a reason
        row = page.locator("#leases tbody tr", has_text="student05")
        lease_id = row.locator("code.lease-id").inner_text()
        row.locator("button.danger").click()
        assert page.locator("#revoke-dialog").is_visible()
        assert lease_id in page.inner_text("#revoke-what")
        page.click("#revoke-confirm")  # no reason: refused in the page
        assert "Say why" in page.inner_text("#revoke-error")
        # a long reason is seen whole while typed; the box says where its limit is
        long_reason = ("The V100 of node gpu01 is needed for the exam of ml101 at 18:00. " * 5)[
            :320
        ]
        page.fill("#revoke-reason", long_reason)
        box = page.locator("#revoke-reason").evaluate(
            "e => ({scroll: e.scrollHeight, client: e.clientHeight, width: e.scrollWidth,"
            " shown: e.clientWidth})"
        )
        assert box["scroll"] <= box["client"] + 1 and box["width"] <= box["shown"] + 1, box
        assert page.inner_text("#revoke-count") == "320 of 500 characters"
        page.fill("#revoke-reason", "x" * 600)
        assert len(page.input_value("#revoke-reason")) == 500
        assert page.inner_text("#revoke-count") == "500 of 500 characters: a reason holds no more"
        page.fill("#revoke-reason", "maintenance at 18:00")
        page.click("#revoke-confirm")
        page.wait_for_selector("#revoke-dialog", state="hidden")
        page.wait_for_selector("#leases tbody tr:has-text('student05')", state="detached")
        assert f"Revoked lease {lease_id} of student05" in page.inner_text("#status")
        r = httpx.get(
            f"{broker.url}/api/v1/leases/{lease_id}",
            headers={"Authorization": f"token {broker.tokens['student05']}"},
        )
        assert r.json()["state"] == "revoked" and r.json()["reason"] == "maintenance at 18:00"
        page.screenshot(path=str(tmp_path / "admin.png"), full_page=True)
        assert problems == []
        context.close()

        # a student: their own history, no course filter, no revoke
        context = chromium.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.goto(f"{broker.url}/")
        page.fill("#token", broker.tokens["student01"])
        page.click("button[type=submit]")
        page.wait_for_selector("#history svg[data-plot=allocation]")
        assert "Your GPU allocation" in page.inner_text("#history")
        assert "Your requests in the queue" in page.inner_text("#history")
        for plot in ("allocation", "queue"):  # no value twice on an axis
            ticks = page.locator(f"svg[data-plot={plot}] text.tick").all_text_contents()
            values = [t for t in ticks if re.fullmatch(r"[\d.]+", t)]
            assert len(values) == 3 and len(set(values)) == 3, (plot, ticks)
        assert page.locator("#view").is_hidden() and page.locator("#courses-section").is_hidden()
        assert page.locator("#leases button.danger").count() == 0
        assert page.locator("#leases tbody tr").count() == 1
        context.close()
    finally:
        broker.stop()


@pytest.mark.slow
def test_dashboard_assets_are_packaged() -> None:
    here = ROOT / "provisioner" / "broker"
    assert (here / "templates" / "dashboard.html").is_file()
    assert {p.name for p in (here / "static").iterdir()} >= {"dashboard.js", "dashboard.css"}
    # hatchling puts every file of the listed packages into the wheel unless git ignores it
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["provisioner"]
    assets = [
        "provisioner/broker/templates/dashboard.html",
        "provisioner/broker/static/dashboard.js",
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", *assets], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert ignored.returncode == 1 and not ignored.stdout, ignored.stdout  # 1: none is ignored
