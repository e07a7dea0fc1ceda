"""A parked kernel in a real browser, behind a real JupyterHub: what the student sees.

Its own hub (``tests.test_hub.Hub``: the demo on free ports, lease TTL 6 s, reaper every
0.5 s) whose broker reclaims kernels idle for 2 s while someone waits
(``GPU_LEASE_IDLE_RECLAIM_AFTER``) and takes a node agent's token
(``GPU_LEASE_AGENT_TOKENS``; the pool is the GPU the agent registers). The test speaks as
that agent over REST, as ``gpu-lease agent`` does: it offers checkpoints (``checkpoint:
true``, 64 GiB of host memory) and reports every park/resume order it is given as done
(the agent's real parking is tested in tests/test_parking_agent.py; no CUDA here). The
browser (Debian's chromium through Playwright), the hub, the student's server, kernel,
provisioner, lease keeper and the broker are real; the other students are REST clients of
the broker (their leases renewed as busy kernels, so idle reclaim never picks them).

Screenshots (1280 px wide) go to ``docs/img/`` when ``GPU_LEASE_SCREENSHOTS=1``, else to a
temporary folder. Skipped when the JupyterLab extension is not installed in this Python.
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

from provisioner.devtools.testing import wait_for

from .test_browser_hub import KERNEL_MS
from .test_browser_lab import (
    STATUS,
    TOAST,
    _extension_installed,
    assert_whole,
    open_gpu_notebook,
    open_lab,
    session_kernel,
    wait_status,
)
from .test_hub import Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]

NODE = "gpu-a"
GPU = "GPU-00000000-0000-4000-8000-00000000a100"
IDLE_RECLAIM_AFTER = 2.0
#: the lease's own text: its cap, then (the agent watches the kernel) its GPU memory in use
LEASE_TEXT = r"^GPU 0\.02 · (V100 · cap 143 MiB|0 / 143 MiB)$"
CELL = ".jp-NotebookPanel .jp-Cell"


class Agent:
    """The node agent of ``NODE`` over REST: registers its V100, then heartbeats every
    0.2 s offering checkpoints, and answers each park/resume order with ``done`` in the
    next heartbeat. It also renews ``busy`` leases as busy kernels (the other students)."""

    def __init__(self, hub: Hub, token: str) -> None:
        self.hub = hub
        self.http = httpx.Client(
            base_url=f"{hub.broker}/api/v1", headers={"Authorization": f"token {token}"}
        )
        self.orders: list[dict[str, Any]] = []  # every order seen, in order
        self.busy: dict[str, str] = {}  # lease id -> its user's token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        r = self.http.put(
            f"/nodes/{NODE}",
            json={
                "gpus": [{"uuid": GPU, "name": "V100", "memory_mb": 32768, "index": 0}],
                "agent_version": "test",
            },
        )
        assert r.status_code in (200, 201), r.text
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.http.close()

    def _run(self) -> None:
        done: list[dict[str, Any]] = []
        beats = 0
        while not self._stop.is_set():
            for lease_id, token in list(self.busy.items()) if beats % 5 == 0 else []:
                self.http.post(
                    f"/leases/{lease_id}/renew",
                    headers={"Authorization": f"token {token}"},
                    json={"execution_state": "busy"},
                )
            beats += 1
            beat = {
                "usage": [],
                "at": time.time(),
                "checkpoint": True,
                "host_memory_available_mb": 65536,
                "parking": done,
            }
            r = self.http.post(f"/nodes/{NODE}/heartbeat", json=beat)
            if r.status_code == 200:
                orders = list(r.json().get("orders") or [])
                self.orders += [o for o in orders if o not in self.orders]
                done = [
                    {"lease_id": o["lease_id"], "action": o["action"], "outcome": "done"}
                    for o in orders
                ]
            self._stop.wait(0.2)


@pytest.fixture(scope="module")
def parking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, Agent]]:
    from provisioner.devtools.slurmcluster import agent_tokens

    if not _extension_installed():
        pytest.skip("the JupyterLab extension is not installed here (make install builds it)")
    tmp = tmp_path_factory.mktemp("parkhub")
    tokens_file = tmp / "agents.json"
    (token,) = agent_tokens(tokens_file, [NODE]).values()
    env = {
        "GPU_LEASE_AGENT_TOKENS": str(tokens_file),
        "GPU_LEASE_IDLE_RECLAIM_AFTER": str(IDLE_RECLAIM_AFTER),
    }
    with running_hub(tmp, env=env, gpus="agents") as h:
        agent = Agent(h, token)
        agent.start()
        try:
            yield h, agent
        finally:
            agent.stop()


@contextmanager
def busy_lease(hub: Hub, agent: Agent, user: str, fraction: float) -> Iterator[dict[str, Any]]:
    """``user`` holds ``fraction`` (granted at once) as a busy kernel would, until the end."""
    token = hub.token(user)
    r = hub.req(
        "PUT",
        f"{hub.broker}/api/v1/quotas/users/{user}",
        hub.admin,
        json={"max_fraction": 1, "max_leases": 4, "max_lease_fraction": 1},
    )
    assert r.status_code == 200, r.text
    body = {"kernel_id": str(uuid.uuid4()), "fraction": fraction, "wait": 0}
    r = hub.req("POST", f"{hub.broker}/api/v1/leases", token, json=body)
    assert r.status_code == 201, r.text
    lease = r.json()
    agent.busy[lease["id"]] = token
    try:
        yield lease
    finally:
        agent.busy.pop(lease["id"], None)
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{lease['id']}", token)


class Waiter:
    """``user``'s kernel-less request that waits in the queue (long-polling keeps its place)
    until granted; then its lease is renewed as a busy kernel's until :meth:`release`."""

    def __init__(self, hub: Hub, agent: Agent, user: str, fraction: float) -> None:
        self.hub, self.agent, self.token = hub, agent, hub.token(user)
        self.body = {"kernel_id": str(uuid.uuid4()), "fraction": fraction, "wait": 0}
        r = hub.req("POST", f"{hub.broker}/api/v1/leases", self.token, json=self.body)
        assert r.status_code == 202, r.text  # the GPU is full: it waits
        self.lease: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        headers = {"Authorization": f"token {self.token}"}
        with httpx.Client(timeout=30, headers=headers) as http:
            while not self._stop.is_set():
                r = http.post(f"{self.hub.broker}/api/v1/leases", json={**self.body, "wait": 5})
                if r.status_code == 201:
                    self.lease = r.json()
                    self.agent.busy[self.lease["id"]] = self.token
                    return

    def granted(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        assert self.lease is not None, "the waiting request was not granted"
        return self.lease

    def release(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self.lease:
            self.agent.busy.pop(self.lease["id"], None)
            r = self.hub.req(
                "DELETE", f"{self.hub.broker}/api/v1/leases/{self.lease['id']}", self.token
            )
            assert r.status_code in (200, 204), r.text


def run_cell(page: Any, index: int, code: str) -> Any:
    """Type ``code`` into the notebook's cell ``index`` and run it (Shift+Enter)."""
    cell = page.locator(CELL).nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")
    return cell


def outputs(cell: Any) -> list[str]:
    return [x.strip() for x in cell.locator(".jp-OutputArea-output").all_inner_texts()]


def lease_state(hub: Hub, user: str, lease_id: str) -> dict[str, Any]:
    r = hub.req("GET", f"{hub.broker}/api/v1/leases/{lease_id}", hub.token(user))
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_parked_kernel_says_so_and_resumes_with_its_variables(
    chromium: Any,
    parking: tuple[Hub, Agent],
    shots: Path,
) -> None:
    """student01's idle notebook is parked for student03, who waits; the status bar says
    "GPU parked" and a notification says what that means. student03 holds the GPU; student01
    runs ``x + 1``: the status bar says "resuming: 1st in queue", the cell prints the
    hook's waiting lines; student03 leaves: the cell prints 42 with the variable kept, and
    the status bar shows the lease again."""
    hub, agent = parking
    user = "student01"
    context, page = open_lab(chromium, hub, user)
    open_gpu_notebook(page)
    wait_status(page, LEASE_TEXT, timeout=KERNEL_MS / 1000)
    normal = wait_status(page, r"^GPU 0\.02 · 0 / 143 MiB$", timeout=30)
    kernel_id = session_kernel(hub, user, "Untitled.ipynb")
    (mine,) = [x for x in hub.leases(user) if x["kernel_id"] == kernel_id]
    assert mine["gpu"]["uuid"] == GPU, mine
    first = run_cell(page, 0, "x = 41")
    first.locator(".jp-InputPrompt", has_text="[1]:").wait_for(timeout=KERNEL_MS)
    free = round(1 - sum(x["fraction"] for x in hub.leases()), 6)
    with busy_lease(hub, agent, "student59", free):
        waiter = Waiter(hub, agent, "student03", 0.02)
        try:
            # the reaper parks student01's idle kernel for student03
            text = wait_status(page, r"^GPU parked$", timeout=60)
            assert page.locator(STATUS).get_attribute("data-parked") == "yes", text
            toast = page.locator(TOAST).filter(has_text="was parked")
            toast.first.wait_for(timeout=30_000)
            (message,) = assert_whole(page, f"{TOAST} .jp-toast-message")  # slid in, whole
            assert " ".join(message.split()).startswith(
                "The GPU memory of Untitled.ipynb was parked while others waited; running a "
                "cell resumes it — variables are kept."
            ), message
            title = page.locator(STATUS).get_attribute("title") or ""
            assert "Running a cell resumes it; your variables are kept." in title, title
            page.screenshot(path=str(shots / "lab-parked.png"))
            parks = [o for o in agent.orders if o["lease_id"] == mine["id"]]
            assert [o["action"] for o in parks] == ["park"], agent.orders
            assert lease_state(hub, user, mine["id"])["state"] == "parked"
            # the kernel's keeper learns "parked" at its next renewal (up to TTL/3 after the
            # broker did; the toast came with "parking"): until then the state file the
            # cell's hook reads says "parking", and the cell would print that first
            wait_for(
                lambda: page.locator(STATUS).get_attribute("data-state") == "parked",
                timeout=30,
                what="the kernel's own view of its lease to say parked",
                interval=0.25,
            )
            # student03 holds the GPU now
            theirs = waiter.granted(timeout=30)
            assert lease_state(hub, "student03", theirs["id"])["state"] == "active"
            # student01 comes back: the cell waits for the resume, behind student03
            second = run_cell(page, 1, "x + 1")
            wait_status(page, r"^resuming: 1st in queue", timeout=30)
            second.locator(".jp-OutputArea-output", has_text="resuming: 1st in queue").wait_for(
                timeout=30_000
            )
            (waiting,) = outputs(second)
            assert waiting.splitlines()[0] == "GPU parked: resuming before this cell runs…"
            assert waiting.splitlines()[1].startswith("resuming: 1st in queue"), waiting
            page.screenshot(path=str(shots / "lab-resuming.png"))
            time.sleep(2)  # it keeps waiting while student03 holds the GPU
            assert lease_state(hub, user, mine["id"])["state"] == "parked"
            assert "42" not in outputs(second)
        finally:
            waiter.release()
        # student03 left: the resume is granted, the agent restores, the cell runs
        second.locator(".jp-OutputArea-output", has_text="42").wait_for(timeout=60_000)
    said = outputs(second)
    assert said[-1] == "42", said
    lines = said[0].splitlines()
    assert lines[0] == "GPU parked: resuming before this cell runs…", said
    assert lines[-1].startswith("GPU resumed in ") and lines[-1].endswith(
        "your variables are intact."
    ), said
    assert second.locator(".jp-InputPrompt").inner_text().strip() == "[2]:"
    wait_status(page, f"^{re.escape(normal)}$", timeout=30)  # the lease's text, as before
    assert page.locator(STATUS).get_attribute("data-state") == "active"
    assert page.locator(STATUS).get_attribute("data-parked") == ""
    assert [o["action"] for o in agent.orders if o["lease_id"] == mine["id"]] == [
        "park",
        "resume",
    ]
    assert lease_state(hub, user, mine["id"])["state"] == "active"
    context.close()
