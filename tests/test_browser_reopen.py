"""Reopening JupyterLab, in a real browser behind a real JupyterHub: what comes back and what not.

One hub per module (``tests.test_hub.Hub``: the demo on free ports, 1x32768:V100) and
Debian's chromium driven by Playwright, as in ``test_browser_lab.py``, whose helpers these
tests share:

1. A cell run while its kernel waits for a GPU survives a save and a reload and runs when
   the kernel starts; its "Waiting for a GPU" line is never written into the notebook.
2. A notebook saved with a GPU kernel opens without starting it: a banner says what starting
   it would take ("GPU 0.02 · 2 % of a V100 · free now", "1st in queue") and offers Start;
   a notebook with a CPU kernel starts it as before; the setting ``startGpuKernelsOnOpen``
   restores JupyterLab's own behaviour.
3. A revoked lease's news stays old: dismissed, it does not come back on a reload, and a
   later kernel of the notebook that ends normally says nothing about the old revocation.

Screenshots (1280 px wide) go to ``docs/img/`` when ``GPU_LEASE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .test_browser_hub import KERNEL_MS
from .test_browser_lab import (
    BANNER,
    STATUS,
    TOAST,
    WAITING,
    _extension_installed,
    assert_whole,
    filling,
    open_gpu_notebook,
    open_lab,
    put_notebook,
    queued_for,
    session_kernel,
    status_text,
    wait_status,
)
from .test_hub import Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]

#: the banner of a notebook whose GPU kernel was not started on opening
HELD = ".jp-NotebookPanel .jp-GPULease-held"
START = f"{HELD} button.jp-GPULease-start"
CELL = ".jp-NotebookPanel .jp-Cell"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    if not _extension_installed():
        pytest.skip("the JupyterLab extension is not installed here (make install builds it)")
    with running_hub(tmp_path_factory.mktemp("hub")) as h:
        yield h


def saved(hub: Hub, user: str, path: str) -> dict[str, Any]:
    r = hub.req("GET", f"{hub.url}/user/{user}/api/contents/{path}", hub.token(user))
    assert r.status_code == 200, r.text
    return dict(r.json()["content"])


def last_modified(hub: Hub, user: str, path: str) -> str:
    url = f"{hub.url}/user/{user}/api/contents/{path}?content=0"
    r = hub.req("GET", url, hub.token(user))
    assert r.status_code == 200, r.text
    return str(r.json()["last_modified"])


def sessions(hub: Hub, user: str) -> list[dict[str, Any]]:
    r = hub.req("GET", f"{hub.url}/user/{user}/api/sessions", hub.token(user))
    assert r.status_code == 200, r.text
    return list(r.json())


def board(hub: Hub, user: str) -> list[dict[str, Any]]:
    r = hub.req("GET", f"{hub.url}/user/{user}/gpu-lease/api/kernels", hub.token(user))
    assert r.status_code == 200, r.text
    return list(r.json()["kernels"])


def wait_until(what: str, check: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.25)


def quiet_pool(hub: Hub) -> None:
    """Wait until no lease is held: a server an earlier test stopped may leave its kernel's
    lease to expire (TTL 6 s), which would free a share under a test's filler."""
    wait_until("no lease held", lambda: hub.leases() == [])


def next_polls(page: Any, n: int = 2) -> None:
    """Wait until the page has asked the server about its GPU kernels ``n`` more times
    (what it shows then is what it knows now)."""
    for _ in range(n):
        with page.expect_response(lambda r: "gpu-lease/api/kernels" in r.url, timeout=30_000):
            pass


def save(page: Any, hub: Hub, user: str, path: str, code: str) -> dict[str, Any]:
    """Ctrl+S, accepting JupyterLab's "Rename file" for an untitled notebook as it is."""
    page.keyboard.press("Control+s")
    rename = page.locator(".jp-Dialog .jp-mod-accept")

    def done() -> dict[str, Any] | None:
        if rename.is_visible():
            rename.click()
        nb = saved(hub, user, path)
        return nb if nb["cells"] and code in "".join(nb["cells"][0]["source"]) else None

    return dict(wait_until(f"{path} saved with its cell", done))


def test_a_cell_run_while_waiting_survives_a_reload_and_is_never_saved(
    chromium: Any, hub: Hub, shots: Path
) -> None:
    user = "student11"
    code = "print(6 * 7)"
    quiet_pool(hub)
    with filling(hub) as filler:
        context, page = open_lab(chromium, hub, user)
        open_gpu_notebook(page)
        wait_status(page, r"^GPU queue: 1st of 1")
        page.click(f"{CELL} .jp-InputArea-editor")
        page.keyboard.type(code)
        page.keyboard.press("Shift+Enter")
        cell = page.locator(CELL).first
        cell.get_by_text(WAITING).wait_for(timeout=10_000)
        notebook = save(page, hub, user, "Untitled.ipynb", code)
        page.reload()
        page.wait_for_selector(f"{CELL} .jp-InputArea-editor", timeout=60_000)
        wait_status(page, r"^GPU queue: 1st of 1")
        cell = page.locator(CELL).first
        cell.get_by_text(WAITING).wait_for(timeout=30_000)
        # the line is the page's, not an output of the notebook
        assert cell.locator(".jp-OutputArea-output").count() == 0
        assert cell.locator(".jp-InputPrompt").inner_text().strip() == "[*]:"
        assert_whole(page, f"{TOAST} .jp-toast-message")  # the notification slid in
        page.screenshot(path=str(shots / "lab-waiting-reloaded.png"))
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{filler['id']}", hub.token("student59"))
        wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
        cell.locator(".jp-OutputArea-output", has_text="42").wait_for(timeout=60_000)
        outputs = [x.strip() for x in cell.locator(".jp-OutputArea-output").all_inner_texts()]
        assert outputs == ["42"], outputs
        assert cell.locator(".jp-InputPrompt").inner_text().strip() == "[1]:"
        assert not cell.get_by_text(WAITING).count()
        context.close()
    # what was saved while the kernel waited: the cell, without the waiting line
    assert notebook["cells"][0]["outputs"] == [], notebook["cells"][0]
    assert WAITING not in json.dumps(notebook)
    hub.stop_server(user)


def start_if_held(page: Any) -> None:
    """Click the banner's Start when the notebook's GPU kernel was held on opening."""
    wait_until(
        "the notebook's kernel started, or its Start button",
        lambda: page.locator(START).is_visible() or status_text(page),
    )
    if page.locator(START).is_visible():
        page.locator(START).click()


def test_a_reopened_gpu_notebook_starts_no_kernel_until_asked(
    chromium: Any, hub: Hub, shots: Path
) -> None:
    user = "student12"
    hub.spawn(user)
    put_notebook(hub, user, "gpu.ipynb", "python3-gpu-0.02", "Python 3 (GPU 0.02)", "1 + 1")
    put_notebook(hub, user, "cpu.ipynb", "python3", "Python 3 (ipykernel)", "1 + 1")
    context, page = open_lab(chromium, hub, user, "lab/tree/gpu.ipynb")
    held = page.locator(HELD)
    held.wait_for(timeout=60_000)
    wait_until("what starting it would take", lambda: "free now" in held.inner_text())
    text = " ".join(held.inner_text().split())
    assert "GPU 0.02 · 2 % of a V100 · free now" in text, text
    assert sessions(hub, user) == [] and hub.leases(user) == []
    assert status_text(page) == ""
    page.screenshot(path=str(shots / "lab-held.png"))
    # saving the held notebook keeps its GPU kernel in the file (held is not "No Kernel")
    before = last_modified(hub, user, "gpu.ipynb")
    page.locator(".jp-Cell .jp-InputPrompt").first.click()
    page.keyboard.press("Control+s")
    wait_until("gpu.ipynb saved", lambda: last_modified(hub, user, "gpu.ipynb") != before)
    assert saved(hub, user, "gpu.ipynb")["metadata"]["kernelspec"]["name"] == "python3-gpu-0.02"
    assert sessions(hub, user) == [] and hub.leases(user) == []
    # the GPU fills: the banner says where the kernel would wait
    quiet_pool(hub)
    with filling(hub):
        wait_until(
            "the banner's queue place", lambda: "1st in queue" in held.inner_text(), timeout=30
        )
    page.locator(START).click()
    wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
    assert not held.is_visible()
    (lease,) = hub.leases(user)
    # a notebook with a CPU kernel starts it on opening, as JupyterLab always did
    page.goto(f"{hub.url}/user/{user}/lab/tree/cpu.ipynb")
    wait_until(
        "the CPU notebook's kernel",
        lambda: any(s["path"] == "cpu.ipynb" for s in sessions(hub, user)),
    )
    assert [x["id"] for x in hub.leases(user)] == [lease["id"]]
    context.close()
    # the site (or the student) may restore JupyterLab's own behaviour
    for s in sessions(hub, user):
        hub.req("DELETE", f"{hub.url}/user/{user}/api/sessions/{s['id']}", hub.token(user))
    wait_until("no lease left", lambda: hub.leases(user) == [])
    r = hub.req(
        "PUT",
        f"{hub.url}/user/{user}/lab/api/settings/jupyter-gpu-lease:plugin",
        hub.token(user),
        json={"raw": json.dumps({"startGpuKernelsOnOpen": True})},
    )
    assert r.status_code == 204, r.text
    context, page = open_lab(chromium, hub, user, "lab/tree/gpu.ipynb")
    wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
    assert not page.locator(HELD).is_visible()
    context.close()
    hub.stop_server(user)


def test_an_old_revocation_stays_old(chromium: Any, hub: Hub, shots: Path) -> None:
    user = "student13"
    reason = "maintenance at 18:00"
    hub.spawn(user)
    put_notebook(hub, user, "nb.ipynb", "python3-gpu-0.02", "Python 3 (GPU 0.02)", "1 + 1")
    context, page = open_lab(chromium, hub, user, "lab/tree/nb.ipynb")
    start_if_held(page)
    wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
    kernel_id = session_kernel(hub, user, "nb.ipynb")
    (lease,) = [x for x in hub.leases(user) if x["kernel_id"] == kernel_id]
    r = hub.req("POST", f"{hub.broker}/api/v1/leases/{lease['id']}/revoke", json={"reason": reason})
    assert r.status_code == 200, r.text
    page.locator(BANNER).wait_for(timeout=60_000)
    toast = page.locator(TOAST).filter(has_text=reason)
    toast.first.wait_for(timeout=60_000)
    # the student reads it and dismisses it: it stays dismissed over a reload
    page.locator(".jp-GPULease-banner-close").click()
    page.reload()
    page.wait_for_selector(f"{CELL} .jp-InputArea-editor", timeout=60_000)
    next_polls(page)
    assert not page.locator(BANNER).is_visible(), page.locator(BANNER).inner_text()
    assert page.locator(TOAST).filter(has_text=reason).count() == 0
    assert status_text(page) in ("", "GPU lease revoked")
    # the kernel again, waiting first; a reload while it waits; the GPU comes
    quiet_pool(hub)
    with filling(hub) as filler:
        start_if_held(page)
        wait_status(page, r"^GPU queue: 1st of 1")
        page.reload()
        page.wait_for_selector(f"{CELL} .jp-InputArea-editor", timeout=60_000)
        wait_status(page, r"^GPU queue: 1st of 1")
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{filler['id']}", hub.token("student59"))
        wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
    second = session_kernel(hub, user, "nb.ipynb")
    assert second != kernel_id
    # a normal end: Kernel -> Shut Down Kernel
    page.click("#jp-menu-panel .lm-MenuBar-itemLabel:text-is('Kernel')")
    page.click(".lm-Menu-itemLabel:text-is('Shut Down Kernel')")
    wait_until(
        "the second kernel's lease released on the server's board",
        lambda: any(
            k["kernel_id"] == second and k["state"] == "released" for k in board(hub, user)
        ),
    )
    next_polls(page)
    assert status_text(page) == "", page.locator(STATUS).get_attribute("title")
    assert not page.locator(BANNER).is_visible(), page.locator(BANNER).inner_text()
    page.reload()
    page.wait_for_selector(f"{CELL} .jp-InputArea-editor", timeout=60_000)
    next_polls(page)
    assert not page.locator(BANNER).is_visible(), page.locator(BANNER).inner_text()
    assert page.locator(TOAST).filter(has_text=reason).count() == 0
    assert status_text(page) == ""
    context.close()
    hub.stop_server(user)


#: JupyterLab as if a release had renamed SessionContext's private ``_pendingKernelName``:
#: an accessor on Object.prototype swallows every write, so no session context has it
NO_PENDING_NAME = """Object.defineProperty(Object.prototype, '_pendingKernelName', {
  configurable: true, get() { return undefined; }, set(value) {} });"""


def test_a_jupyterlab_without_the_private_field_says_so_and_still_reattaches(
    chromium: Any, hub: Hub
) -> None:
    user = "student14"
    quiet_pool(hub)
    with filling(hub):
        context, page = open_lab(chromium, hub, user)
        open_gpu_notebook(page)
        wait_status(page, r"^GPU queue: 1st of 1")
        (waiting,) = queued_for(hub, user)
        context.add_init_script(NO_PENDING_NAME)
        with page.expect_console_message(
            lambda m: m.type == "error" and "has no SessionContext._pendingKernelName" in m.text,
            timeout=60_000,
        ) as message:
            page.reload()
        told = [message.value.text]
        page.wait_for_selector(f"{CELL} .jp-InputArea-editor", timeout=60_000)
        assert "supported JupyterLab: >=4.2 <5" in told[0], told
        wait_status(page, r"^GPU queue: 1st of 1")
        # the same request: re-attached, not a second kernel
        assert [q["kernel_id"] for q in queued_for(hub, user)] == [waiting["kernel_id"]]
        context.close()
    hub.stop_server(user)
