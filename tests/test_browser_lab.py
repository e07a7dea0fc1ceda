"""The JupyterLab extension in a real browser, behind a real JupyterHub: what a student sees.

One hub per module (``tests.test_hub.Hub``: the demo on free ports, 1x32768:V100, lease TTL
6 s) and Debian's chromium driven by Playwright (``tests/conftest.py``'s ``chromium``).
In file order, sharing the hub:

1. student01's GPU notebook: the status bar shows the lease ("GPU 0.02 · V100 · cap 143 MiB").
2. The pool is filled (a 0.98 lease of student59, whose quota the admin raised), student03
   waits first; student02's notebook waits: status bar "GPU queue: 2nd of 2", a notification
   with the place and "Stop waiting"; a cell run meanwhile is kept. A lease ends: the place
   moves to 1st. The filler ends: the kernel starts and the kept cell runs, once.
3. A second notebook of student02 waits; "Stop waiting" cancels the request: the broker's
   queue is empty, the start fails saying the student stopped waiting.
4. The admin revokes student02's lease with a reason: the notification and the status bar
   say it; reopening the page says it again.

Screenshots (1280 px wide) go to ``docs/img/`` when ``GPU_LEASE_SCREENSHOTS=1``, else to the
test's ``tmp_path``. Skipped when the JupyterLab extension is not installed in this Python
(``make install`` installs it: ``pip install -e .`` builds it).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from jupyter_core.paths import jupyter_path

from .test_browser_hub import KERNEL_MS, SPAWN_MS, launcher_card, log_in
from .test_hub import Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]

STATUS = ".jp-GPULease-status"
TOAST = ".Toastify__toast"


def _extension_installed() -> bool:
    return any(
        Path(p, "jupyter-gpu-lease", "package.json").exists() for p in jupyter_path("labextensions")
    )


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    if not _extension_installed():
        pytest.skip("the JupyterLab extension is not installed here (make install builds it)")
    with running_hub(tmp_path_factory.mktemp("hub")) as h:
        yield h


@contextmanager
def holding(
    hub: Hub, user: str, fraction: float, *, wait: bool = False
) -> Iterator[dict[str, Any]]:
    """A lease (or, ``wait``, a queued request kept by re-posting) of ``user`` without a kernel."""
    token = hub.token(user)
    if (
        fraction > 0.05
    ):  # above a student's per-kernel limit: the admin raises it (each test runs alone too)
        r = hub.req(
            "PUT",
            f"{hub.broker}/api/v1/quotas/users/{user}",
            hub.admin,
            json={"max_fraction": 1, "max_leases": 4, "max_lease_fraction": 1},
        )
        assert r.status_code == 200, r.text
    body = {"kernel_id": str(uuid.uuid4()), "fraction": fraction, "wait": 0}
    r = hub.req("POST", f"{hub.broker}/api/v1/leases", token, json=body)
    assert r.status_code == (202 if wait else 201), r.text
    answer = r.json()
    stop = threading.Event()

    def keep() -> None:
        with httpx.Client(timeout=10, headers={"Authorization": f"token {token}"}) as http:
            while not stop.wait(1.0):
                try:
                    got = http.get(f"{hub.broker}/api/v1/leases/{answer['id']}")
                    if got.status_code == 404:  # still queued: polling keeps the place
                        http.post(f"{hub.broker}/api/v1/leases", json=body)
                    elif got.status_code != 200:  # a busy broker's 503: keep at it
                        continue
                    elif got.json().get("state") == "active":
                        http.post(f"{hub.broker}/api/v1/leases/{answer['id']}/renew", json={})
                    else:  # ended (released by the test): done
                        return
                except httpx.HTTPError:  # a slow answer on a loaded machine: keep at it
                    continue

    thread = threading.Thread(target=keep, daemon=True)
    thread.start()
    try:
        yield answer
    finally:
        stop.set()
        thread.join()
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{answer['id']}", token)


def filling(hub: Hub) -> Any:
    """student59 holds what the V100 has free: the next kernel waits (each test runs alone too)."""
    free = round(1 - sum(x["fraction"] for x in hub.leases()), 6)
    return holding(hub, "student59", free)


def status_text(page: Any) -> str:
    item = page.locator(STATUS)
    return item.inner_text() if item.is_visible() else ""


def wait_status(page: Any, pattern: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = status_text(page)
        if re.search(pattern, text):
            return text
        time.sleep(0.25)
    raise AssertionError(f"the status bar said {text!r}, not /{pattern}/")


def open_lab(chromium: Any, hub: Hub, user: str, where: str = "lab?reset") -> tuple[Any, Any]:
    """Log in as ``user``, then open ``/user/{user}/{where}`` (default: a fresh launcher)."""
    context, page = log_in(chromium, f"{hub.url}/hub/login", user)
    try:
        page.wait_for_url(f"**/user/{user}/lab**", timeout=SPAWN_MS)
        page.goto(f"{hub.url}/user/{user}/{where}")
        page.wait_for_selector("#jp-main-statusbar", timeout=SPAWN_MS)
    except Exception:
        print(hub.log())
        raise
    return context, page


def open_gpu_notebook(page: Any, label: str = "Python 3 (GPU 0.02)") -> None:
    card = launcher_card(page, label).first
    card.wait_for(timeout=KERNEL_MS)
    card.click()
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor", timeout=KERNEL_MS)


def session_kernel(hub: Hub, user: str, path: str) -> str:
    r = hub.req("GET", f"{hub.url}/user/{user}/api/sessions", hub.token(user))
    assert r.status_code == 200, r.text
    (kernel_id,) = [s["kernel"]["id"] for s in r.json() if s["path"] == path]
    return str(kernel_id)


def test_status_bar_shows_the_lease(chromium: Any, hub: Hub, shots: Path) -> None:
    context, page = open_lab(chromium, hub, "student01")
    open_gpu_notebook(page)
    text = wait_status(page, r"^GPU 0\.02 · V100 · cap 143 MiB$", timeout=KERNEL_MS / 1000)
    assert page.locator(STATUS).get_attribute("data-state") == "active", text
    (lease,) = hub.leases("student01")
    assert lease["id"] in page.locator(STATUS).get_attribute("title")
    page.locator(".jp-StatusBar-Widget").screenshot(path=str(shots / "lab-status-lease.png"))
    context.close()


def test_waiting_kernel_shows_its_place_and_runs_the_kept_cell(
    chromium: Any, hub: Hub, shots: Path
) -> None:
    admin = hub.admin
    r = hub.req(
        "PUT",
        f"{hub.broker}/api/v1/quotas/users/student59",
        admin,
        json={"max_fraction": 1, "max_leases": 4, "max_lease_fraction": 1},
    )
    assert r.status_code == 200, r.text
    (first,) = hub.leases("student01")
    with holding(hub, "student59", 0.98) as filler, holding(hub, "student03", 0.02, wait=True):
        context, page = open_lab(chromium, hub, "student02")
        open_gpu_notebook(page)
        text = wait_status(page, r"^GPU queue: 2nd of 2")
        toast = page.locator(TOAST).filter(has_text="waits for a GPU")
        toast.first.wait_for(timeout=30_000)
        assert "2nd of 2 in the GPU queue" in toast.first.inner_text()
        assert toast.first.locator("button", has_text="Stop waiting").is_visible()
        # a cell run now is kept, not dropped
        page.click(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor")
        page.keyboard.type("print(6 * 7)")
        page.keyboard.press("Shift+Enter")
        kept = page.locator(".jp-NotebookPanel .jp-Cell").first
        kept.locator(LINE, has_text="Waiting for a GPU").wait_for(timeout=10_000)
        assert_whole(page, f"{TOAST} .jp-toast-message")  # slid in
        page.screenshot(path=str(shots / "lab-waiting.png"))
        page.locator(".jp-StatusBar-Widget").screenshot(path=str(shots / "lab-status-queue.png"))
        # student01's kernel ends: student03 gets that share, student02 moves up
        r = hub.req(
            "DELETE",
            f"{hub.url}/user/student01/api/kernels/{first['kernel_id']}",
            hub.token("student01"),
        )
        assert r.status_code == 204, r.text
        text = wait_status(page, r"^GPU queue: 1st of 1")
        page.wait_for_selector(f"{TOAST}:has-text('1st of 1 in the GPU queue')", timeout=30_000)
        # the filler ends: student02's kernel starts and runs the kept cell, once
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{filler['id']}", hub.token("student59"))
        wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
        kept.locator(".jp-OutputArea-output", has_text="42").wait_for(timeout=KERNEL_MS)
        outputs = [x.strip() for x in kept.locator(".jp-OutputArea-output").all_inner_texts()]
        assert outputs == ["42"], outputs
        assert kept.locator(".jp-InputPrompt").inner_text().strip() == "[1]:"
        context.close()
    assert text


def test_stop_waiting_cancels_the_request(chromium: Any, hub: Hub, shots: Path) -> None:
    held = [x["id"] for x in hub.leases("student02")]  # the first notebook's, in file order
    with filling(hub):
        context, page = open_lab(chromium, hub, "student02")
        open_gpu_notebook(page)
        wait_status(page, r"^GPU queue: 1st of 1")
        toast = page.locator(TOAST).filter(has_text="waits for a GPU")
        toast.first.wait_for(timeout=30_000)
        assert len(hub_queue(hub)) == 1
        # the notification is whole: JupyterLab cuts a message after 140 characters
        (message,) = assert_whole(page, f"{TOAST} .jp-toast-message")
        assert message.endswith("Cells you run now run when it starts."), message
        cell = run_kept_cell(page, "print(6 * 7)")
        toast.first.locator("button", has_text="Stop waiting").click()
        dialog = page.locator(".jp-Dialog")
        dialog.wait_for(timeout=30_000)
        assert "You stopped waiting for a GPU" in dialog.inner_text()
        assert hub_queue(hub) == []
        page.locator(".jp-Dialog button", has_text="Ok").click()
        assert [x["id"] for x in hub.leases("student02")] == held  # untouched
        # the cell run while waiting says it did not run, and keeps saying it
        output = cell.locator(LINE, has_text="This cell did not run")
        output.wait_for(timeout=10_000)
        time.sleep(4)
        assert cell_lines(cell) == [NOT_RUN]
        assert_whole(page, f".jp-NotebookPanel .jp-Cell {LINE}")
        assert_words_whole(page, f".jp-NotebookPanel .jp-Cell {LINE}")
        # JupyterLab then offers to start another kernel: not now
        choose = page.locator(".jp-Dialog-header", has_text="Select Kernel")
        choose.wait_for(timeout=10_000)
        page.locator(".jp-Dialog button", has_text="No Kernel").click()
        time.sleep(1)
        assert cell_lines(cell) == [NOT_RUN]
        # the notebook has no kernel, on purpose: not "Initializing" for good
        bar = page.locator("#jp-main-statusbar").inner_text()
        assert "No Kernel" in bar and "Initializing" not in bar, bar
        page.screenshot(path=str(shots / "lab-did-not-run.png"))
        context.close()


NOT_RUN = (
    "This cell did not run: its kernel did not start (see the message about the GPU queue). "
    "Start the kernel again, then run the cell."
)
WAITING = "Waiting for a GPU: this cell runs as soon as the kernel has started."
#: the line under a cell run while its kernel waits (the page's; not an output)
LINE = ".jp-GPULease-cellLine"


def cell_lines(cell: Any) -> list[str]:
    """What a cell shows of its own: outputs, then the extension's line (none saved)."""
    outputs = [x.strip() for x in cell.locator(".jp-OutputArea-output").all_inner_texts()]
    return outputs + [x.strip() for x in cell.locator(LINE).all_inner_texts()]


WORDS_WHOLE = r"""sel => [...document.querySelectorAll(sel)].filter(e => e.offsetParent).map(e => {
  // each line box of the text: a word cut in two ends a line with a letter and starts the
  // next with one, where the text had no line break
  const range = document.createRange();
  const node = e.firstChild;
  const cut = [];
  let top = null;
  for (let i = 1; node && i < node.length; i++) {
    range.setStart(node, i); range.setEnd(node, i + 1);
    const y = range.getBoundingClientRect().top;
    if (top !== null && y > top + 2 && /\w/.test(node.data[i - 1]) && /\w/.test(node.data[i])) {
      cut.push(node.data.slice(Math.max(0, i - 8), i) + '/' + node.data.slice(i, i + 8));
    }
    top = y;
  }
  return cut;
})"""


def assert_words_whole(page: Any, selector: str) -> None:
    """No word of the visible ``selector`` elements is broken across two lines."""
    cuts = page.evaluate(WORDS_WHOLE, selector)
    assert cuts and all(c == [] for c in cuts), cuts


WHOLE = """sel => [...document.querySelectorAll(sel)].filter(e => e.offsetParent).map(e => {
  const r = e.getBoundingClientRect();
  const p = e.parentElement.getBoundingClientRect();
  return {text: e.innerText, left: r.left, right: r.right, top: r.top, bottom: r.bottom,
          height: r.height, parent_top: p.top, parent_bottom: p.bottom,
          scroll: e.scrollWidth, client: e.clientWidth, window: window.innerWidth};
})"""


def assert_whole(page: Any, selector: str) -> list[str]:
    """Each visible ``selector`` lies inside the window, nothing cut off on its right (once
    a notification has slid in: up to 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        boxes = page.evaluate(WHOLE, selector)
        try:
            assert boxes, f"nothing visible matches {selector}"
            for b in boxes:
                assert b["left"] >= 0 and b["right"] <= b["window"], b
                assert b["height"] > 0, b  # laid out, not squeezed to nothing
                assert b["parent_top"] <= b["top"] and b["bottom"] <= b["parent_bottom"] + 1, b
                assert b["scroll"] <= b["client"] + 1, b
                assert not b["text"].rstrip().endswith("…"), b
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)
            continue
        return [str(b["text"]) for b in boxes]


def run_kept_cell(page: Any, code: str) -> Any:
    """Type ``code`` in the notebook's first cell and run it while the kernel waits: it is
    kept, and says so exactly once."""
    page.click(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor")
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")
    cell = page.locator(".jp-NotebookPanel .jp-Cell").first
    cell.locator(LINE, has_text="Waiting for a GPU").wait_for(timeout=10_000)
    time.sleep(1)
    assert cell_lines(cell) == [WAITING]
    return cell


def queued_for(hub: Hub, user: str) -> list[dict[str, Any]]:
    return [q for q in hub_queue(hub) if q.get("user") == user]


def test_reload_keeps_the_waiting_kernel(chromium: Any, hub: Hub, shots: Path) -> None:
    """A page reloaded while its notebook's kernel waits re-attaches to that kernel: no
    second request, no "Select Kernel", and the cell run after the reload runs there."""
    user = "student04"
    with filling(hub) as filler:
        context, page = open_lab(chromium, hub, user)
        open_gpu_notebook(page)
        wait_status(page, r"^GPU queue: 1st of 1")
        (waiting,) = queued_for(hub, user)
        page.reload()
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor", timeout=60_000)
        wait_status(page, r"^GPU queue: 1st of 1")
        time.sleep(3)  # what a second start would need to show up
        assert not page.locator(".jp-Dialog").is_visible(), page.locator(".jp-Dialog").inner_text()
        assert [q["kernel_id"] for q in queued_for(hub, user)] == [waiting["kernel_id"]]
        cell = run_kept_cell(page, "print(6 * 7)")
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{filler['id']}", hub.token("student59"))
        wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
        cell.locator(".jp-OutputArea-output", has_text="42").wait_for(timeout=KERNEL_MS)
        assert [x["kernel_id"] for x in hub.leases(user)] == [waiting["kernel_id"]]
        assert session_kernel(hub, user, "Untitled.ipynb") == waiting["kernel_id"]
        context.close()
    hub.stop_server(user)


def test_shutting_down_a_waiting_kernel_withdraws_it(chromium: Any, hub: Hub) -> None:
    user = "student05"
    with filling(hub) as filler:
        context, page = open_lab(chromium, hub, user)
        open_gpu_notebook(page)
        wait_status(page, r"^GPU queue: 1st of 1")
        assert len(queued_for(hub, user)) == 1
        page.click("#jp-menu-panel .lm-MenuBar-itemLabel:text-is('Kernel')")
        page.click(".lm-Menu-itemLabel:text-is('Shut Down Kernel')")
        deadline = time.monotonic() + 15
        while queued_for(hub, user) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert queued_for(hub, user) == []
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{filler['id']}", hub.token("student59"))
        time.sleep(3)
        assert hub.leases(user) == []  # nobody was granted a GPU after the shutdown
        context.close()
    hub.stop_server(user)


def test_no_queue_flash_on_a_free_gpu(chromium: Any, hub: Hub) -> None:
    """On a free GPU the status bar goes from nothing to the lease, never "GPU queue"."""
    user = "student06"
    context, page = open_lab(chromium, hub, user)
    page.evaluate(
        """() => { window.__gpuTexts = [];
          const record = () => { const e = document.querySelector('.jp-GPULease-status');
            if (e && !e.classList.contains('lm-mod-hidden')) window.__gpuTexts.push(e.textContent); };
          new MutationObserver(record).observe(document.body,
            {subtree: true, childList: true, characterData: true, attributes: true}); }"""
    )
    open_gpu_notebook(page)
    wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
    seen = page.evaluate("() => window.__gpuTexts")
    assert seen and not [t for t in seen if "queue" in t], seen
    context.close()
    hub.stop_server(user)


def hub_queue(hub: Hub) -> list[dict[str, Any]]:
    r = hub.req("GET", f"{hub.broker}/api/v1/queue")
    assert r.status_code == 200, r.text
    return list(r.json()["queue"])


def test_revoke_reason_reaches_the_student(chromium: Any, hub: Hub, tmp_path: Path) -> None:
    context, page = open_lab(chromium, hub, "student02", "lab/tree/Untitled.ipynb")
    wait_status(page, r"^GPU 0\.02 · V100", timeout=60)
    kernel_id = session_kernel(hub, "student02", "Untitled.ipynb")
    (lease,) = [x for x in hub.leases("student02") if x["kernel_id"] == kernel_id]
    r = hub.req(
        "POST",
        f"{hub.broker}/api/v1/leases/{lease['id']}/revoke",
        json={"reason": "maintenance at 18:00"},
    )
    assert r.status_code == 200, r.text
    toast = page.locator(TOAST).filter(has_text="maintenance at 18:00")
    toast.first.wait_for(timeout=60_000)
    assert "Untitled.ipynb was revoked: maintenance at 18:00" in toast.first.inner_text()
    wait_status(page, r"^GPU lease revoked$")
    page.screenshot(path=str(tmp_path / "lab-revoked.png"))
    context.close()
    # reopening the notebook in a fresh page says it again
    context, page = open_lab(chromium, hub, "student02", "lab/tree/Untitled.ipynb")
    toast = page.locator(TOAST).filter(has_text="maintenance at 18:00")
    toast.first.wait_for(timeout=60_000)
    context.close()


LONG_REASON = (
    "The V100 of node gpu01 is needed for the 18:00 exam of ml101: please save your "
    "notebooks now and restart your kernel after 20:00, when the GPU is free again"
)
BANNER = ".jp-NotebookPanel .jp-GPULease-banner-text"


def test_a_long_revoke_reason_is_shown_whole(chromium: Any, hub: Hub, shots: Path) -> None:
    """A reason longer than a notification holds: the notification is whole (shorter, with
    "Read why"), the banner above the notebook and the dialog give the whole reason, also
    after a reload; the notebook's kernel indicator no longer says "Idle"."""
    user = "student07"
    context, page = open_lab(chromium, hub, user)
    open_gpu_notebook(page)
    wait_status(page, r"^GPU 0\.02 · V100", timeout=KERNEL_MS / 1000)
    kernel_id = session_kernel(hub, user, "Untitled.ipynb")
    (lease,) = [x for x in hub.leases(user) if x["kernel_id"] == kernel_id]
    r = hub.req(
        "POST", f"{hub.broker}/api/v1/leases/{lease['id']}/revoke", json={"reason": LONG_REASON}
    )
    assert r.status_code == 200, r.text
    whole = (
        f"The GPU lease of Untitled.ipynb was revoked: {LONG_REASON}. The kernel was shut "
        "down; start it again when you need the GPU."
    )
    toast = page.locator(TOAST).filter(has_text="was revoked")
    toast.first.wait_for(timeout=60_000)
    (message,) = assert_whole(page, f"{TOAST} .jp-toast-message")
    assert "Untitled.ipynb was revoked" in message and len(message) <= 140, message
    page.locator(BANNER).wait_for(timeout=30_000)
    assert assert_whole(page, BANNER) == [whole]
    wait_status(page, r"^GPU lease revoked$")
    # the kernel was shut down: the notebook says it has none, not "Idle"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "Idle" in page.locator("#jp-main-statusbar").inner_text():
        time.sleep(0.25)
    bar = page.locator("#jp-main-statusbar").inner_text()
    assert "Idle" not in bar, bar
    assert assert_whole(page, BANNER) == [whole]  # it stays
    page.screenshot(path=str(shots / "lab-revoked.png"))
    toast.first.locator("button", has_text="Read why").click()
    dialog = page.locator(".jp-Dialog-body")
    dialog.wait_for(timeout=10_000)
    assert " ".join(dialog.inner_text().split()) == whole
    assert_whole(page, ".jp-Dialog-body")
    page.locator(".jp-Dialog button", has_text="OK").click()
    # a reload keeps it: the banner again, whole
    page.reload()
    page.locator(BANNER).wait_for(timeout=60_000)
    assert assert_whole(page, BANNER) == [whole]
    context.close()
    hub.stop_server(user)


def put_notebook(
    hub: Hub, user: str, path: str, kernel: str, display: str, code: str | None
) -> None:
    """Save ``path`` in ``user``'s server: a notebook of ``kernel`` with one code cell of
    ``code`` (none for None)."""
    cells = (
        [
            {
                "cell_type": "code",
                "id": "first-cell",
                "metadata": {},
                "execution_count": None,
                "outputs": [],
                "source": code,
            }
        ]
        if code is not None
        else []
    )
    notebook = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": kernel, "display_name": display, "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    r = hub.req(
        "PUT",
        f"{hub.url}/user/{user}/api/contents/{path}",
        hub.token(user),
        json={"type": "notebook", "format": "json", "content": notebook},
    )
    assert r.status_code in (200, 201), r.text


def test_a_notebook_with_a_kernel_not_for_you_says_why(chromium: Any, hub: Hub) -> None:
    """guest01 (in no course) opens a notebook saved with ml101's kernel, which the kernel
    list leaves out for them: the reason first, then JupyterLab's "Select Kernel"."""
    user = "guest01"
    hub.spawn(user)
    put_notebook(hub, user, "course.ipynb", "ml101-gpu-0.05", "Python 3 (GPU 0.05, ml101)", None)
    context, page = open_lab(chromium, hub, user, "lab/tree/course.ipynb")
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=60_000)
    assert "Kernel not available to you" in dialog.locator(".jp-Dialog-header").inner_text()
    (body,) = assert_whole(page, ".jp-Dialog-body")
    assert " ".join(body.split()) == (
        'This notebook was saved with the kernel "Python 3 (GPU 0.05, ml101)", which you '
        "cannot start: for course ml101 only. Choose another kernel next (the launcher shows "
        "the GPU kernels you may start), or ask your instructor for this one."
    )
    page.locator(".jp-Dialog button", has_text="Choose another kernel").click()
    page.locator(".jp-Dialog-header", has_text="Select Kernel").wait_for(timeout=30_000)
    assert hub.leases(user) == []
    context.close()
    hub.stop_server(user)


def test_the_status_bar_shows_the_kernels_gpu_memory(
    chromium: Any, tmp_path_factory: pytest.TempPathFactory, shots: Path
) -> None:
    """A node agent reports the kernel's GPU memory: the status bar shows it against the
    cap ("GPU 0.02 · 130 / 143 MiB"), in the warning colour near the cap. Its own hub: the
    broker takes a node agent's token, and the test speaks as that agent (the REST calls
    `gpu-lease agent` makes; NVML cannot exist here)."""
    from provisioner.devtools.slurmcluster import agent_tokens

    if not _extension_installed():
        pytest.skip("the JupyterLab extension is not installed here (make install builds it)")
    tmp = tmp_path_factory.mktemp("memhub")
    tokens_file = tmp / "agents.json"
    (token,) = agent_tokens(tokens_file, ["local"]).values()
    env = {"GPU_LEASE_AGENT_TOKENS": str(tokens_file)}
    with running_hub(tmp, env=env, gpus="agents") as h:
        node, gpu, pid = "local", "GPU-00000000-0000-4000-8000-00000000a100", 0
        agent = {"Authorization": f"token {token}"}
        r = h.http.put(
            f"{h.broker}/api/v1/nodes/{node}",
            headers=agent,
            json={
                "gpus": [{"uuid": gpu, "name": "V100", "memory_mb": 32768, "index": 0}],
                "agent_version": "test",
            },
        )
        assert r.status_code in (200, 201), r.text

        def report(used_mb: int) -> list[int]:
            """One heartbeat; returns the kernel pids the broker asks the agent to watch."""
            usage = [{"pid": pid, "gpu_uuid": gpu, "used_mb": used_mb}] if pid else []
            r = h.http.post(
                f"{h.broker}/api/v1/nodes/{node}/heartbeat",
                headers=agent,
                json={"usage": usage, "at": time.time()},
            )
            assert r.status_code == 200, r.text
            return list(r.json().get("watch") or [])

        report(0)
        user = "student01"
        context, page = open_lab(chromium, h, user)
        open_gpu_notebook(page)
        wait_status(page, r"^GPU 0\.02 · V100 · cap 143 MiB$", timeout=KERNEL_MS / 1000)
        deadline = time.monotonic() + 30
        while not (watch := report(0)) and time.monotonic() < deadline:
            time.sleep(0.5)  # the kernel's pid comes with its first renewal
        (pid,) = watch
        report(52)
        wait_status(page, r"^GPU 0\.02 · 52 / 143 MiB$", timeout=30)
        assert page.locator(STATUS).get_attribute("data-memory") == "ok"
        report(138)
        wait_status(page, r"^GPU 0\.02 · 138 / 143 MiB$", timeout=30)
        assert page.locator(STATUS).get_attribute("data-memory") == "high"
        assert "Near the cap" in (page.locator(STATUS).get_attribute("title") or "")
        page.locator(".jp-StatusBar-Widget").screenshot(path=str(shots / "lab-status-memory.png"))
        context.close()
