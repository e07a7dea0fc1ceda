"""A notebook whose kernel runs on another machine, in a real browser, behind a real hub.

Machines are network namespaces (``tests/netns.py``): the *head* has JupyterHub
(``python -m provisioner.devtools.demo``, hub_config's system-users variant: each student
is a Unix account made here, servers run as them), configurable-http-proxy, the broker
(a hub service listening on every address of the head, ``GPU_LEASE_BROKER_IP``) and
Debian's chromium driven by Playwright; the GPU node ``n1`` has its agent
(``--launch-kernels``, stand-in NVML, the only GPU of the pool) and nothing else. The hub
tells the servers ``GPU_LEASE_LAUNCHER=node``: the student clicks "Python 3 (GPU 0.02)"
and the kernel starts on n1, as the student, reached from the server over the link.

The student sees where the kernel runs in the first output; a ``time.sleep`` loop is
interrupted from the toolbar; JupyterLab's restart keeps the lease (a new process on n1);
shutting the kernel down releases the lease and n1 ends the process.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from provisioner.devtools.testing import wait_for, write_private

from .accounts import courses, needs_root, passable_dir, student_python, useradd, userdel
from .conftest import CHROMIUM, CHROMIUM_ARGS
from .netns import Cluster, needs_netns
from .test_agent import FAKE_NVML, ROOT
from .test_browser_hub import KERNEL_MS
from .test_hub import Hub, running_hub
from .test_remote_kernels import pids_of

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(600)]

CARD = "Python 3 (GPU 0.02)"


class Site:
    def __init__(self, hub: Hub, cluster: Cluster, student: str, tmp: Path) -> None:
        self.hub, self.cluster, self.student, self.tmp = hub, cluster, student, tmp
        self.agent: subprocess.Popen[bytes] | None = None
        self.password = ""


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    needs_root()
    needs_netns()
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (make install installs Debian's chromium)")
    suffix = secrets.token_hex(3)
    student, broker_name = f"glh-{suffix}", f"glhbroker-{suffix}"
    cluster = Cluster(["n1"]).up()
    made: list[str] = []
    with passable_dir("gl-remote-hub-") as base:
        try:
            useradd(student)
            made.append(student)
            # the system-users hub logs students in with PAM: a password of the account's
            password = secrets.token_urlsafe(12)
            subprocess.run(["chpasswd"], input=f"{student}:{password}".encode(), check=True)
            broker = useradd(broker_name, system=True)
            made.append(broker_name)
            python = student_python(base, student)
            courses(base / "courses.toml", [student])
            agent_token = f"agent-{secrets.token_hex(16)}"
            tokens = base / "agent-tokens.json"
            write_private(tokens, json.dumps({agent_token: {"agent": True, "node": "n1"}}))
            os.chown(tokens, broker.pw_uid, broker.pw_gid)
            env = {
                "GPU_LEASE_SPAWNER": "system-users",
                "GPU_LEASE_BROKER_USER": broker_name,
                "GPU_LEASE_COURSES": str(base / "courses.toml"),
                "GPU_LEASE_AGENT_TOKENS": str(tokens),
                "GPU_LEASE_BROKER_IP": "0.0.0.0",
                "GPU_LEASE_LAUNCHER": "node",
            }
            write_private(base / "demo.log", "")
            with (
                cluster.inside("head"),
                running_hub(base, env=env, python=python, gpus="agents") as hub,
            ):
                s = Site(hub, cluster, student, base)
                s.password = password
                port = hub.info["broker_direct_url"].split(":")[2].split("/")[0]
                head_ip, node_ip = cluster.link["n1"]
                agent_env = dict(os.environ)
                agent_env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML), str(ROOT)])
                nvml = base / "nvml.json"
                nvml.write_text(
                    json.dumps(
                        {
                            "gpus": [
                                {"uuid": f"GPU-n1-{suffix}", "name": "A100", "memory_mb": 81920}
                            ],
                            "processes": {},
                        }
                    )
                )
                agent_env.update(FAKE_NVML_FILE=str(nvml), GPU_LEASE_AGENT_TOKEN=agent_token)
                node_root = base / "node"
                node_root.mkdir(mode=0o711)
                with cluster.inside("n1"), open(base / "agent.log", "wb") as log:
                    s.agent = subprocess.Popen(
                        [sys.executable, "-m", "provisioner.node.agent",
                         "--broker-url", f"http://{head_ip}:{port}/services/gpu-lease",
                         "--node", "n1", "--interval", "2", "--launch-kernels",
                         "--kernel-ip", node_ip, "--kernel-dir", str(node_root / "kernels"),
                         "--scratch-dir", str(node_root / "scratch"), "--shared-dirs", "/home"],
                        stdout=log, stderr=subprocess.STDOUT, env=agent_env,
                    )  # fmt: skip
                wait_for(
                    lambda: "Registered node n1" in (base / "agent.log").read_text(),
                    timeout=60,
                    detail=lambda: (base / "agent.log").read_text()[-3000:],
                )
                try:
                    yield s
                finally:
                    s.agent.kill()
                    s.agent.wait()
        finally:
            for name in made:
                userdel(name)
            cluster.down()


def test_a_notebook_runs_on_a_gpu_node_and_is_interrupted_restarted_and_shut_down(
    site: Site, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    hub, student = site.hub, site.student
    uid = pwd.getpwnam(student).pw_uid
    with site.cluster.inside("head"), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(f"{hub.url}/hub/login")
            page.fill("input[name=username]", student)
            page.fill("input[name=password]", site.password)
            page.click("input[type=submit], button[type=submit]")
            try:
                page.wait_for_url(f"**/user/{student}/lab**", timeout=180_000)
            except Exception:
                page.screenshot(path=str(tmp_path / "spawn.png"))
                print(page.content()[-3000:], hub.log(), sep="\n")
                raise
            card = page.locator(".jp-Launcher-section:has-text('Notebook') .jp-LauncherCard")
            try:
                card.filter(has_text=CARD).first.click(timeout=60_000)
            except Exception:
                page.screenshot(path=str(tmp_path / "launcher.png"))
                print(page.locator(".jp-Launcher-body").inner_text(), hub.log(), sep="\n")
                raise
            idle = ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status=idle]"
            page.wait_for_selector(idle, timeout=KERNEL_MS)
            run_cell(page, "import os, socket; print(os.getuid(), 6 * 7)")
            out = page.locator(".jp-NotebookPanel .jp-OutputArea-output").first
            page.wait_for_selector(
                f".jp-NotebookPanel .jp-OutputArea-output:has-text('{uid} 42')", timeout=KERNEL_MS
            )
            text = out.inner_text()
            assert "runs on node n1" in text, text
            page.screenshot(path=str(tmp_path / "remote-kernel.png"))
            (lease,) = hub.leases(student)
            kernel_pid = remote_pids(uid)
            assert kernel_pid, "no kernel process of the student's"
            # interrupt a running cell from the toolbar
            run_cell(page, "import time\nwhile True:\n    time.sleep(0.1)", new=True)
            page.wait_for_selector(
                ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status=busy]",
                timeout=KERNEL_MS,
            )
            t0 = time.monotonic()
            page.click(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']")
            page.wait_for_selector(
                ".jp-NotebookPanel .jp-OutputArea-output:has-text('KeyboardInterrupt')",
                timeout=KERNEL_MS,
            )
            interrupted = time.monotonic() - t0
            # restart: the same lease, a new process on the node
            page.click(".jp-NotebookPanel-toolbar [data-command='notebook:restart-kernel']")
            page.click(".jp-Dialog .jp-mod-accept", timeout=30_000)
            wait_for(lambda: remote_pids(uid) and remote_pids(uid) != kernel_pid, timeout=60)
            page.wait_for_selector(idle, timeout=KERNEL_MS)
            (again,) = hub.leases(student)
            assert again["id"] == lease["id"]
            # shut the kernel down: the lease is released, the node ends the process
            page.click("text=Kernel", timeout=30_000)
            page.click("text=Shut Down Kernel", timeout=30_000)
            wait_for(lambda: not hub.leases(student), timeout=60)
            wait_for(lambda: not remote_pids(uid), timeout=30)
            print(f"interrupt from the toolbar to KeyboardInterrupt shown: {interrupted:.2f} s")
        finally:
            browser.close()


def remote_pids(uid: int) -> list[int]:
    """The student's kernel processes (ipykernel started by the node's agent)."""
    out = []
    for pid in pids_of(uid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ipykernel" in cmd and b"kernels/" in cmd:
            out.append(pid)
    return sorted(out)


def run_cell(page: Any, code: str, new: bool = False) -> None:
    if new:
        page.click(".jp-NotebookPanel-toolbar [data-command='notebook:insert-cell-below']")
    page.locator(".jp-NotebookPanel .jp-Cell.jp-mod-active .jp-InputArea-editor").click()
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")
