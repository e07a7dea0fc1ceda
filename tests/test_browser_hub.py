"""JupyterLab and the dashboard in a real browser, behind a real JupyterHub.

One hub per module (``tests.test_hub.Hub``: ``python -m provisioner.devtools.demo`` on free
ports, kernelspecs in a temporary prefix) and Debian's chromium driven by Playwright,
exactly as a person clicks:

1. student01 logs in at ``/hub/login`` with the demo's shared password, waits for the
   server and JupyterLab, clicks the launcher card "Python 3 (GPU 0.02)", runs ``%gpu``
   in the first cell and sees the lease (GPU V100, fraction 0.02).
2. guest01 (in no course) clicks the course kernel "Python 3 (GPU 0.05, ml101)" (this hub
   marks the kernels a user can never start instead of hiding them): the broker refuses,
   and JupyterLab's error dialog shows the broker's sentence.
3. The dashboard at ``/services/gpu-lease/`` through the hub's OAuth (no confirmation
   page): the instructor sees the V100's allocation bar and student01's lease; student01
   sees only their own.

Screenshots go to the test's ``tmp_path``. Tests share the hub; each also runs alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import hub_env
from .test_hub import Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]

PASSWORD = "gpu-lease-demo"  # SharedPasswordAuthenticator.user_password, the demo's default
SPAWN_MS = 180_000  # a server spawn takes 10-60 s on a busy machine
KERNEL_MS = 120_000


def require_demo_password() -> None:
    """The browser logs in with the demo's password: skip where it was changed."""
    env_password = os.environ.get("GPU_LEASE_USER_PASSWORD")
    if env_password and env_password != PASSWORD:
        pytest.skip("GPU_LEASE_USER_PASSWORD is set to another password")


def marked_hub(
    tmp_path_factory: pytest.TempPathFactory, http_processes: int = 0
) -> contextlib.AbstractContextManager[Hub]:
    """A hub for a browser: the demo's password, and kernels a user can never start kept in
    the launcher, marked (the hub's default hides them), so that a student can click one
    and read the refusal."""
    require_demo_password()
    env = hub_env(http_processes, GPU_LEASE_UNAVAILABLE_KERNELS="mark")
    return running_hub(tmp_path_factory.mktemp("hub"), env=env)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, hub_http_processes: int) -> Iterator[Hub]:
    with marked_hub(tmp_path_factory, hub_http_processes) as h:
        yield h


def log_in(chromium: Any, url: str, user: str) -> tuple[Any, Any]:
    """A fresh browser context that opens ``url`` and logs in as ``user`` on the hub's form."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("input[name=password]", timeout=30_000)
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", PASSWORD)
    page.click("input[type=submit], button[type=submit]")
    return context, page


def open_lab(chromium: Any, hub: Hub, user: str) -> tuple[Any, Any]:
    """Log in as ``user`` and wait until the spawned server's JupyterLab shows its launcher."""
    context, page = log_in(chromium, f"{hub.url}/hub/login", user)
    try:
        page.wait_for_url(f"**/user/{user}/lab**", timeout=SPAWN_MS)
        page.wait_for_selector(".jp-LauncherCard", timeout=SPAWN_MS)
    except Exception:
        print(hub.log())
        raise
    return context, page


def launcher_card(page: Any, label: str) -> Any:
    """The launcher's notebook card for the kernel whose display name is ``label``."""
    return page.locator(".jp-Launcher-section:has-text('Notebook') .jp-LauncherCard").filter(
        has_text=label
    )


def test_student_runs_gpu_magic_in_jupyterlab(chromium: Any, hub: Hub, tmp_path: Path) -> None:
    context, page = open_lab(chromium, hub, "student01")
    card = launcher_card(page, "Python 3 (GPU 0.02)")
    card.first.wait_for(timeout=10_000)
    assert card.count() == 1
    card.click()
    # the notebook opens on that kernel, and the kernel becomes idle (lease acquired)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor", timeout=KERNEL_MS)
    page.wait_for_selector(
        ".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName:has-text('Python 3 (GPU 0.02)')",
        timeout=KERNEL_MS,
    )
    page.wait_for_selector(
        ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status=idle]",
        timeout=KERNEL_MS,
    )
    page.click(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor")
    page.keyboard.type("%gpu")
    page.keyboard.press("Shift+Enter")
    output = page.locator(".jp-NotebookPanel .jp-OutputArea-output").first
    output.wait_for(timeout=KERNEL_MS)
    page.wait_for_selector(
        ".jp-NotebookPanel .jp-OutputArea-output:has-text('fraction')", timeout=KERNEL_MS
    )
    text = output.inner_text()
    page.screenshot(path=str(tmp_path / "student01-lab.png"))
    assert "GPU lease " in text and "V100" in text, text
    assert "fraction:   0.02" in text, text
    (lease,) = hub.leases("student01")
    assert lease["fraction"] == 0.02 and lease["id"] in text
    # the hub's JupyterLab defaults (hub_config's overrides become the schema's defaults):
    # no news consent toast over the notebook, no requests to jupyter.org
    r = page.request.get(
        f"{hub.url}/user/student01/lab/api/settings/@jupyterlab/apputils-extension:notification"
    )
    assert r.ok, r.status
    defaults = {k: v.get("default") for k, v in r.json()["schema"]["properties"].items()}
    assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, defaults
    assert page.get_by_text("official Jupyter news").count() == 0
    context.close()


def test_refused_course_kernel_shows_the_brokers_sentence(
    chromium: Any, hub: Hub, tmp_path: Path
) -> None:
    context, page = open_lab(chromium, hub, "guest01")
    card = launcher_card(page, "Python 3 (GPU 0.05, ml101)")
    card.first.wait_for(timeout=10_000)
    assert "(not for you: for course ml101 only)" in card.inner_text()
    card.click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=KERNEL_MS)
    header = dialog.locator(".jp-Dialog-header").inner_text()
    body = dialog.locator(".jp-Dialog-body").inner_text()
    page.screenshot(path=str(tmp_path / "guest01-refused.png"))
    assert "Error Starting Kernel" in header, header
    assert "reserved for course 'ml101'" in body and "not a member" in body, body
    assert hub.leases("guest01") == []
    context.close()


@contextmanager
def held_lease(hub: Hub, user: str, fraction: float) -> Iterator[dict[str, Any]]:
    """A lease ``user`` holds without a kernel, renewed in a thread (the TTL is short)."""
    token = hub.token(user)
    r = hub.req(
        "POST",
        f"{hub.broker}/api/v1/leases",
        token,
        json={"kernel_id": str(uuid.uuid4()), "fraction": fraction, "wait": 0},
    )
    assert r.status_code == 201, r.text
    lease = r.json()
    stop = threading.Event()

    def renew() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.wait(1.0):
                http.post(
                    f"{hub.broker}/api/v1/leases/{lease['id']}/renew",
                    headers={"Authorization": f"token {token}"},
                    json={},
                )

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join()
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{lease['id']}", token)


def open_dashboard(chromium: Any, hub: Hub, user: str) -> tuple[Any, Any, list[str]]:
    """Open the dashboard's URL anonymously: the hub's OAuth sends the browser to the hub's
    login form, and back (no confirmation page: ``oauth_no_confirm``)."""
    context, page = log_in(chromium, f"{hub.url}/services/gpu-lease/", user)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.wait_for_url(f"{hub.url}/services/gpu-lease/**", timeout=30_000)
    page.wait_for_selector("#leases table", timeout=30_000)
    return context, page, problems


def test_dashboard_behind_the_hub(chromium: Any, hub: Hub, tmp_path: Path) -> None:
    (mine,) = hub.holding("student01")  # the first test's kernel, or one of its own
    with held_lease(hub, "student02", 0.05) as other:
        # the instructor holds custom:gpu-lease:admin: the V100's bar and every lease
        context, page, problems = open_dashboard(chromium, hub, "instructor")
        assert page.inner_text("#who") == "Signed in as instructor (admin)"
        gpus = page.inner_text("#gpus")
        assert "V100" in gpus and "7% allocated" in gpus and "2 leases" in gpus, gpus
        meter = page.locator("#gpus [role=meter]")
        assert meter.get_attribute("aria-valuenow") == "7"
        leases = page.inner_text("#leases")
        assert "student01" in leases and mine["kernel_id"][:8] in leases, leases
        assert "student02" in leases and other["kernel_id"][:8] in leases, leases
        assert page.locator("#quotas-section").is_visible()
        page.screenshot(path=str(tmp_path / "instructor-dashboard.png"), full_page=True)
        assert problems == []
        context.close()
        # student01 sees only their own lease
        context, page, problems = open_dashboard(chromium, hub, "student01")
        assert page.inner_text("#who") == "Signed in as student01"
        leases = page.inner_text("#leases")
        assert "student01" in leases and mine["kernel_id"][:8] in leases, leases
        assert "student02" not in leases and other["kernel_id"][:8] not in leases, leases
        assert page.locator("#quotas-section").is_hidden()
        page.screenshot(path=str(tmp_path / "student01-dashboard.png"), full_page=True)
        assert problems == []
        context.close()


FITS = """() => {
  const wrap = document.querySelector('#leases .table-wrap');
  const w = wrap.getBoundingClientRect();
  const right = sel => [...wrap.querySelectorAll(sel)].map(e => e.getBoundingClientRect().right);
  const table = wrap.querySelector('table');
  table.style.width = 'auto';  // its natural width, the room left for longer cells
  const natural = table.getBoundingClientRect().width;
  table.style.width = '';
  return {wrap_right: w.right, scroll: wrap.scrollWidth, client: wrap.clientWidth,
          natural: natural, buttons: right('button.danger'), last_th: right('th:last-child')};
}"""
#: room for what grows with time and names ("2 h 40 min" for "1 s", a longer user name)
SLACK_PX = 80


def test_dashboard_leases_fit_and_the_course_filter_is_in_the_url(
    chromium: Any, hub: Hub, tmp_path: Path
) -> None:
    """The admin's leases table, "Revoke…" and its Action header included, lies inside its
    box at 1280 and 1920 px; the course picked is in the URL, and a reload keeps it."""
    hub.holding("student01")
    with held_lease(hub, "student02", 0.05):
        context, page, problems = open_dashboard(chromium, hub, "instructor")
        for width in (1280, 1920):
            page.set_viewport_size({"width": width, "height": 900})
            page.evaluate(
                "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
            )
            g = page.evaluate(FITS)
            assert g["scroll"] <= g["client"], (width, g)
            assert g["natural"] + SLACK_PX <= g["client"], (width, g)
            assert g["buttons"] and all(r <= g["wrap_right"] for r in g["buttons"]), (width, g)
            assert g["last_th"] and all(r <= g["wrap_right"] for r in g["last_th"]), (width, g)
            page.screenshot(path=str(tmp_path / f"dashboard-{width}.png"))
        page.select_option("#course", "ml101")
        assert "course=ml101" in page.url, page.url
        page.reload()
        page.wait_for_selector("#leases table", timeout=30_000)
        assert page.locator("#course").input_value() == "ml101"
        assert "Active leases in ml101" in page.inner_text("#leases")
        page.select_option("#course", "*")
        assert "course=" not in page.url, page.url
        assert problems == []
        context.close()
