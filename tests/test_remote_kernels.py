"""Remote kernels, the agent path, for real on one machine: a REAL broker subprocess, a REAL
node agent (``--launch-kernels``, stand-in NVML) and REAL ipykernel kernels the agent
starts as REAL Unix accounts (made here with ``useradd``), driven by jupyter_client's
``AsyncKernelManager`` with ``GPULeaseProvisioner(launcher='node')`` in this process (the
student's server; its token is the student's).

What each test breaks on purpose is in its name and its first line. Network namespaces
(a server on another "machine") are in ``tests/test_remote_netns.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jupyter_client.manager import AsyncKernelManager

from provisioner.devtools import testing
from provisioner.devtools.testing import execute, wait_for, wait_for_async
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json

from .accounts import needs_root, passable_dir, student_python, useradd, userdel
from .conftest import Broker
from .test_agent import FAKE_NVML, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODE = "gpu-r"
#: the lease TTL of these tests' brokers (s): a kernel cut off from its lease ends after it
TTL = 10


class Site:
    """Students with Unix accounts, a broker that knows them, node agents that launch."""

    def __init__(
        self,
        tmp: Path,
        students: list[str],
        python: str,
        node_root: Path,
        nodes: tuple[str, ...] = (NODE,),
        broker_extra: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        self.students = students
        self.python = python
        users = {s: ([], False) for s in students}
        users["ghost-" + uuid.uuid4().hex[:6]] = ([], False)  # a hub user with no account
        users["admin"] = ([], True)
        self.broker = Broker(
            tmp,
            f"sqlite:///{tmp / 'b.sqlite'}",
            (
                "--GPULeaseBroker.node_grace=4",
                "--GPULeaseBroker.reap_interval=0.2",
                f"--GPULeaseBroker.ttl={TTL}",
                *broker_extra,
            ),
            forked=False,  # started from the calling thread (its network namespace)
        )
        # the tokens file: the test's users (not conftest's) and one agent per node
        self.broker.tokens = {u: f"tok-{u}-{uuid.uuid4().hex}" for u in users}
        data: dict[str, Any] = {
            self.broker.tokens[u]: {"user": u, "groups": list(g), "admin": a}
            for u, (g, a) in users.items()
        }
        self.agent_tokens: dict[str, str] = {}
        self.gpus: dict[str, str] = {}
        for node in nodes:
            token = self.agent_tokens[node] = f"agent-{node}-{uuid.uuid4().hex}"
            data[token] = {"agent": True, "node": node}
            self.gpus[node] = f"GPU-{node}-0-{uuid.uuid4().hex[:8]}"
            (tmp / f"nvml-{node}.json").write_text(
                json.dumps(
                    {
                        "gpus": [{"uuid": self.gpus[node], "name": "T4", "memory_mb": 16384}],
                        "processes": {},
                    }
                )
            )
        self.broker.tokens_file.write_text(json.dumps(data))
        self.ghost = next(u for u in users if u.startswith("ghost-"))
        self.gpu = self.gpus[nodes[0]]
        # the nodes' folders: where a student may pass (the test's tmp_path is root's alone)
        self.node_root = node_root
        self.kernel_dir = node_root / f"kernels-{nodes[0]}"
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def agent_log(self, node: str = NODE) -> Path:
        return self.tmp / f"agent-{node}.log"

    def start_agent(
        self, node: str = NODE, *extra: str, url: str | None = None, ip: str = "127.0.0.1"
    ) -> None:
        """The node's agent, started from the calling thread (its network namespace)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML), str(ROOT), env.get("PYTHONPATH", "")])
        env["FAKE_NVML_FILE"] = str(self.tmp / f"nvml-{node}.json")
        env["GPU_LEASE_AGENT_TOKEN"] = self.agent_tokens[node]
        cmd = [
            sys.executable, "-m", "provisioner.node.agent",
            "--broker-url", url or self.broker.url,
            "--node", node, "--interval", "1", "--launch-kernels", "--kernel-ip", ip,
            "--kernel-dir", str(self.node_root / f"kernels-{node}"),
            "--scratch-dir", str(self.node_root / f"scratch-{node}"),
            "--shared-dirs", "/home", *extra,
        ]  # fmt: skip
        with open(self.agent_log(node), "ab") as log:
            self.agents[node] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_registered(self, node: str = NODE) -> None:
        wait_for(lambda: node in self.nodes(), timeout=30)

    def kill_agent(self, node: str = NODE) -> None:
        agent = self.agents.get(node)
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()

    def nodes(self) -> dict[str, Any]:
        r = httpx.get(f"{self.broker.url}/api/v1/nodes", headers=self.broker.headers("admin"))
        return {n["node"]: n for n in r.json()["nodes"]} if r.status_code == 200 else {}

    def spec(self, name: str, **config: Any) -> str:
        spec = build_kernelspec(0.1)
        spec["argv"] = [self.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        spec["metadata"]["kernel_provisioner"]["config"].update(
            {
                "renew_interval": 1.0,
                "long_poll": 1.0,
                "launcher": "node",
                "node": NODE,
                "launch_timeout": 60.0,
                **config,
            }
        )
        folder = self.tmp / "jupyter" / "kernels" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.json").write_text(spec_json(spec))
        return name

    def api(self, who: str) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.broker.url}/api/v1",
            headers=self.broker.headers(who),
            timeout=30,
            event_hooks=self.broker.conformance.sync_hooks(),
        )

    def kill_students(self) -> None:
        """Nothing of theirs survives a test."""
        for name in self.students:
            for pid in pids_of(pwd.getpwnam(name).pw_uid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[list[str], str, Path]]:
    needs_root()
    names = [f"glr{n}{uuid.uuid4().hex[:5]}" for n in range(2)]
    with passable_dir("gl-remote-") as base:
        try:
            for name in names:
                useradd(name)
            yield names, student_python(base, names[0]), base
        finally:
            for name in names:
                userdel(name)


@pytest.fixture
def site(
    tmp_path: Path, accounts: tuple[list[str], str, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Site]:
    names, python, base = accounts
    node_root = base / f"node-{uuid.uuid4().hex[:6]}"
    node_root.mkdir(mode=0o711)
    s = Site(tmp_path, names, python, node_root)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    with s.broker.running(timeout=60):
        monkeypatch.setenv("GPU_LEASE_URL", s.broker.url)
        monkeypatch.setenv("GPU_LEASE_TOKEN", s.broker.tokens[names[0]])
        monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "hub-token-of-the-server")
        try:
            s.start_agent()
            s.wait_registered()
            yield s
        finally:
            s.kill_agent()
            s.kill_students()


def pids_of(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def km(site: Site) -> AsyncIterator[AsyncKernelManager]:
    manager = AsyncKernelManager(kernel_name=site.spec("remote-0.1"))
    home = Path(pwd.getpwnam(site.students[0]).pw_dir)
    work = home / "course"
    work.mkdir(exist_ok=True)
    os.chown(work, pwd.getpwnam(site.students[0]).pw_uid, pwd.getpwnam(site.students[0]).pw_gid)
    await manager.start_kernel(cwd=str(work))
    try:
        yield manager
    finally:
        if manager.has_kernel:
            await manager.shutdown_kernel(now=True)


PROBE = (
    "import os, json; print(json.dumps({'uid': os.getuid(), 'cwd': os.getcwd(), "
    "'pid': os.getpid(), 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), "
    "'hub': os.environ.get('JUPYTERHUB_API_TOKEN'), 'tok': os.environ.get('GPU_LEASE_TOKEN'), "
    "'node': os.environ.get('GPU_LEASE_NODE')}))"
)


async def probe(km: AsyncKernelManager) -> dict[str, Any]:
    out, reply = await execute(km, PROBE)
    assert reply["status"] == "ok", (out, reply)
    return dict(json.loads(out.strip().splitlines()[-1]))


async def interrupt_a_sleeping_cell(km: AsyncKernelManager) -> tuple[dict[str, Any], float]:
    """Interrupt a ``time.sleep`` loop through the provisioner (JupyterLab's interrupt) and
    wait for the cell's reply: its content, and the seconds from the interrupt to it."""
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=30)
        return await testing.interrupt_a_sleeping_cell(km, kc)
    finally:
        kc.stop_channels()


def lease_of(site: Site, km: AsyncKernelManager) -> str:
    lease = km.provisioner.lease_keeper.lease  # type: ignore[union-attr]
    assert lease is not None
    return str(lease.id)


async def test_a_remote_kernel_runs_as_the_student_on_the_node_and_says_where(
    site: Site, km: AsyncKernelManager
) -> None:
    """The kernel runs as the student's account, with the lease's GPU, in the notebook's
    folder (under the shared /home), without the server's tokens; its first output says
    where it runs."""
    student = pwd.getpwnam(site.students[0])
    first, reply = await execute(km, "print('hello')")
    assert reply["status"] == "ok"
    assert f"runs on node {NODE}" in first and "course" in first, first
    facts = await probe(km)
    assert facts["uid"] == student.pw_uid
    assert facts["cuda"] == site.gpu
    assert facts["cwd"] == str(Path(student.pw_dir) / "course")
    assert facts["hub"] is None and facts["tok"] is None  # the server's tokens stay there
    assert facts["node"] == NODE
    again, _ = await execute(km, "print('again')")
    assert "runs on node" not in again  # said once
    # the key is the student's alone on the node: 0600 in a 0700 folder of theirs
    folder = next(site.kernel_dir.iterdir())
    conn = folder / "kernel.json"
    assert conn.stat().st_uid == student.pw_uid and (conn.stat().st_mode & 0o077) == 0
    # ... in a folder of root's that the student passes through but cannot change (no link
    # of theirs for the root agent to follow there)
    assert folder.stat().st_uid == 0 and (folder.stat().st_mode & 0o777) == 0o711
    out, _ = await execute(
        km,
        f"import os\ntry:\n    os.symlink('/etc/passwd', {str(folder / 'gpu-lease.json.x')!r})\n"
        "except OSError as e:\n    print(type(e).__name__)",
    )
    assert "PermissionError" in out, out
    # ... and not in the broker's database or logs, nor the agent's log
    key = km.session.key.decode()
    assert key not in site.agent_log().read_text()
    for path in site.broker.logs():
        assert key not in path.read_text(errors="replace")
    assert key.encode() not in (site.tmp / "b.sqlite").read_bytes()


async def test_interrupt_restart_and_shutdown_go_through_the_node(
    site: Site, km: AsyncKernelManager
) -> None:
    """An interrupt stops a sleeping cell; a restart keeps the lease (a new process); a
    shutdown releases it and the node ends the process."""
    lease_id = lease_of(site, km)
    pid = (await probe(km))["pid"]
    reply, seconds = await interrupt_a_sleeping_cell(km)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
    assert seconds < 10
    await km.restart_kernel(now=True)
    assert lease_of(site, km) == lease_id
    new_pid = (await probe(km))["pid"]
    assert new_pid != pid
    await wait_for_async(lambda: not alive(pid), timeout=15)
    await km.shutdown_kernel()
    await wait_for_async(lambda: not alive(new_pid), timeout=15)
    with site.api("admin") as c:
        assert c.get(f"/leases/{lease_id}").json()["state"] == "released"


async def test_another_students_token_and_an_admin_cannot_launch_or_signal(
    site: Site, km: AsyncKernelManager
) -> None:
    """Forged asks: another student's token on the lease (404, like an unknown id), an
    admin's (403: it would run as someone else), a launch for a lease whose node's agent
    does not launch kernels (409); each refused, logged, and nothing changes."""
    lease_id = lease_of(site, km)
    body = {"kernel_id": "k-forged", "argv": ["/bin/sleep", "100"], "key": "k" * 32}
    with site.api(site.students[1]) as other:
        assert other.put(f"/leases/{lease_id}/kernel", json=body).status_code == 404
        assert other.get(f"/leases/{lease_id}/kernel").status_code == 404
        r = other.post(f"/leases/{lease_id}/kernel/signal", json={"signal": "SIGKILL"})
        assert r.status_code == 404
    with site.api("admin") as admin:
        assert admin.put(f"/leases/{lease_id}/kernel", json=body).status_code == 403
        kernel = admin.get(f"/leases/{lease_id}/kernel").json()
        assert kernel["generation"] == 1 and kernel["state"] == "running"
        assert "key" not in kernel and "env" not in kernel
    with site.api(site.students[0]) as owner:  # bad input, refused with a sentence
        for bad in (
            {**body, "argv": []},
            {**body, "key": "short"},
            {**body, "env": {"A B": "x"}},
            {**body, "argv": ["x\x00y"]},
            {**body, "extra": 1},
        ):
            r = owner.put(f"/leases/{lease_id}/kernel", json=bad)
            assert r.status_code == 400 and r.json()["message"], r.text
        assert (
            owner.post(f"/leases/{lease_id}/kernel/signal", json={"signal": "SIGSEGV"}).status_code
            == 400
        )
    assert (await probe(km))["uid"] == pwd.getpwnam(site.students[0]).pw_uid  # untouched
    log = "\n".join(p.read_text(errors="replace") for p in site.broker.logs())
    assert f"by {site.students[1]}" in log and "Refused a kernel launch" in log
    # another student names the first one's kernel id (the node's cgroup name): the node
    # refuses it, and the first kernel is untouched
    with site.api(site.students[1]) as other:
        r = other.post(
            "/leases", json={"kernel_id": f"k-{uuid.uuid4()}", "fraction": 0.1, "node": NODE}
        )
        assert r.status_code == 201, r.text
        theirs = r.json()["id"]
        same = {**body, "kernel_id": str(km.kernel_id)}
        assert other.put(f"/leases/{theirs}/kernel", json=same).status_code == 202

        def settled() -> dict[str, Any] | None:
            answer = other.get(f"/leases/{theirs}/kernel").json()
            return answer if answer["state"] != "launching" else None

        refused = await wait_for_async(settled, timeout=20)
        assert refused["state"] == "failed", refused
        assert "already in use" in refused["reason"], refused
        assert other.delete(f"/leases/{theirs}").status_code == 204
    assert (await probe(km))["uid"] == pwd.getpwnam(site.students[0]).pw_uid
    # a lease on a GPU no agent launches kernels for (the broker's own declared GPU): 409
    with site.api(site.students[1]) as other:
        gpus = other.get("/gpus").json()["gpus"]
        declared = next(g["uuid"] for g in gpus if g["uuid"] != site.gpu)
        r = other.post(
            "/leases",
            json={"kernel_id": f"k-{uuid.uuid4()}", "fraction": 0.1, "gpu_uuids": [declared]},
        )
        assert r.status_code == 201, r.text
        r = other.put(f"/leases/{r.json()['id']}/kernel", json=body)
        assert r.status_code == 409 and "no node can launch" in r.json()["message"], r.text


async def test_no_account_on_the_node_says_so(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub user without a Unix account on the node: the start fails with the node's
    sentence (not a timeout), and the lease is released."""
    monkeypatch.setenv("GPU_LEASE_TOKEN", site.broker.tokens[site.ghost])
    manager = AsyncKernelManager(kernel_name=site.spec("ghost-0.1"))
    t0 = time.monotonic()
    with pytest.raises(Exception) as failed:
        await manager.start_kernel()
    assert time.monotonic() - t0 < 30
    assert f"no Unix account named {site.ghost!r} on node {NODE}" in " ".join(
        str(failed.value).split()
    )
    with site.api("admin") as c:
        held = [
            x
            for x in c.get("/leases", params={"all": "1"}).json()["leases"]
            if x["user"] == site.ghost and x["state"] == "active"
        ]
    assert held == []


async def test_the_node_ends_a_kernel_whose_lease_is_revoked_and_a_killed_agent_finds_its_kernels(
    site: Site, km: AsyncKernelManager
) -> None:
    """kill -9 of the agent: the kernel runs on, and the next agent finds it again (it
    still answers); an admin's revocation then ends it through that agent."""
    pid = (await probe(km))["pid"]
    site.kill_agent()
    assert alive(pid)
    site.start_agent()
    site.wait_registered()
    await wait_for_async(
        lambda: "Found kernel of lease" in site.agent_log().read_text(), timeout=20
    )
    assert (await probe(km))["pid"] == pid
    lease_id = lease_of(site, km)
    with site.api("admin") as c:
        assert c.post(f"/leases/{lease_id}/revoke", json={"reason": "test"}).status_code == 200
    await wait_for_async(lambda: not alive(pid), timeout=20)
    # the lease keeper shuts its kernel down (jupyter_client's managers take one at a time)
    await wait_for_async(lambda: not km.has_kernel, timeout=20)


async def test_a_killed_kernel_is_seen_dead(site: Site, km: AsyncKernelManager) -> None:
    """kill -9 of the kernel: the provisioner's poll says it ended (with the signal)."""
    pid = (await probe(km))["pid"]
    os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        return not await km.is_alive()

    await wait_for_async(dead, timeout=20)
