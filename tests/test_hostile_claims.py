"""A student's renewal claims processes that are not their kernel, with
REAL processes: a broker subprocess with a static token per student (each holds only their
own), the node agent subprocess with ``--enforce kill`` (stand-in NVML, ``tests/fake_nvml``,
offering driver memory limits), two Unix accounts made with ``useradd`` (removed after),
and kernels started as the provisioner starts them (the lease's secret in their
environment, ``tests/proven.py``). The root agent must act only on kernels it has proven.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import wait_for
from provisioner.node import cgroups

from . import accounts
from .hostile import add_tokens
from .proven import claim, kernel_env
from .test_agent import enforcing_broker, metric, nodes_of
from .test_node_boundaries import R615Agent, alive, host_pid_of
from .test_nodes import NodeBroker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: useradd, setpriv, cgroups"),
    pytest.mark.skipif(
        not all(shutil.which(c) for c in ("useradd", "userdel", "setpriv", "unshare")),
        reason="needs useradd, userdel, setpriv and unshare (util-linux)",
    ),
]

_MiB = 1024 * 1024
#: a kernel: prints its child's pid, then waits; the child holds the "GPU memory"
KERNEL = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen(['sleep', '300'])\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(300)\n"
)


class Process:
    """A process run as ``user`` (``setpriv``), optionally as a kernel (with a secret), in
    a pid namespace of its own (``unshare --pid --fork``) or a cgroup."""

    def __init__(
        self,
        user: str | None,
        *,
        kernel: bool = True,
        namespace: bool = False,
        python: bool = False,
    ) -> None:
        env, self.proof = kernel_env()
        if not kernel:
            env.pop("GPU_LEASE_KERNEL_SECRET", None)
        cmd: list[str] = []
        if namespace:
            cmd += ["unshare", "--pid", "--fork"]
        if user is not None:
            cmd += ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
        cmd += [sys.executable, "-c", KERNEL] if python else ["sleep", "300"]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE if python else None, start_new_session=True
        )
        self.child: int | None = None
        if python:
            assert self.proc.stdout is not None
            self.child = int(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def nb(tmp_path: Path) -> Iterator[NodeBroker]:
    b = enforcing_broker(tmp_path)
    with b.running(timeout=60):
        yield b


@pytest.fixture
def students(nb: NodeBroker) -> Iterator[list[str]]:
    """Two Unix accounts, each with a broker token of its own (and no other's)."""
    names = [f"glp{n}{uuid.uuid4().hex[:6]}" for n in (1, 2)]
    try:
        for name in names:
            accounts.useradd(name, system=True)
        add_tokens(nb, {name: {"user": name} for name in names})
        yield names
    finally:
        for name in names:
            accounts.userdel(name)


@pytest.fixture
def agent(nb: NodeBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[R615Agent]:
    limits_log = tmp_path / "limits.jsonl"
    limits_log.touch()
    monkeypatch.setenv("FAKE_NVML_LIMITS_LOG", str(limits_log))  # the agent inherits it
    a = R615Agent(nb, "gpu-a", tmp_path, "--enforce", "kill")
    a.start()
    try:
        wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("state") == "up", 30)
        yield a
    finally:
        a.stop()


def acquire(c: httpx.Client, gpu: str, fraction: float, kernel_id: str) -> dict[str, Any]:
    r = c.post("/leases", json={"kernel_id": kernel_id, "fraction": fraction, "gpu_uuids": [gpu]})
    assert r.status_code == 201, r.text
    return dict(r.json())


def renew(c: httpx.Client, lease: dict[str, Any], body: dict[str, Any]) -> None:
    r = c.post(f"/leases/{lease['id']}/renew", json=body)
    assert r.status_code == 200, r.text


def beats(nb: NodeBroker, n: int = 4) -> None:
    """Wait for ``n`` more heartbeats of gpu-a (what the agent does, it has done)."""
    for _ in range(n):
        seen = nodes_of(nb)["gpu-a"]["last_seen"]
        wait_for(lambda s=seen: nodes_of(nb)["gpu-a"]["last_seen"] > s, 20, "a heartbeat")


def test_another_accounts_process_or_an_ancestor_is_never_charged_nor_killed(
    nb: NodeBroker, students: list[str], agent: R615Agent
) -> None:
    """s002 holds a 0.5 lease for its own kernel using 2,000 MiB; s001, with only their own
    token, takes a 0.05 lease and renews it claiming s002's kernel (with s001's own valid
    proof), then an ancestor of every student's process. Main killed s002's process 12 s
    later; now the claims are refused, logged once, shown to an admin and counted."""
    s1, s2 = students
    gpu = agent.gpus[0]["uuid"]
    victim = Process(s2)
    mine = Process(s1)
    try:
        with nb.http(s1) as u1, nb.http(s2) as u2, nb.http("admin") as adm:
            lease2 = acquire(u2, gpu, 0.5, "k2")
            renew(u2, lease2, claim(victim.proc.pid, victim.proof))
            lease1 = acquire(u1, gpu, 0.05, "k1")
            # the attack: s002's process, with s001's own (valid) proof
            renew(u1, lease1, claim(victim.proc.pid, mine.proof))
            agent.set_processes({gpu: [{"pid": victim.proc.pid, "used_mb": 2000}]})

            def lease(c: httpx.Client, x: dict[str, Any]) -> dict[str, Any]:
                return dict(c.get(f"/leases/{x['id']}").json())

            wait_for(lambda: lease(u2, lease2)["used_mb"] == 2000, 20, "s002's usage")
            beats(nb, 6)  # > overuse_grace (1 s) + a kill's beat, many times over
            assert alive(victim.proc.pid)
            one = lease(adm, lease1)
            assert one["state"] == "active" and one["used_mb"] == 0, one
            assert "does not carry this lease's kernel secret" in one["kernel_refused"]
            assert lease(u1, lease1)["kernel_refused"] == one["kernel_refused"]
            assert lease(u2, lease2)["kernel_refused"] is None

            # an ancestor of every student's process (this test started them all)
            renew(u1, lease1, claim(os.getpid(), mine.proof))
            beats(nb, 6)
            assert alive(victim.proc.pid)
            assert lease(adm, lease1)["used_mb"] == 0
            assert lease(u2, lease2)["used_mb"] == 2000
            assert f"process {os.getpid()} does not carry" in lease(adm, lease1)["kernel_refused"]
            top = subprocess.run(
                [sys.executable, "-m", "provisioner", "top"],
                env={**os.environ, "GPU_LEASE_URL": nb.url, "GPU_LEASE_TOKEN": nb.tokens["admin"]},
                capture_output=True,
                text=True,
                timeout=60,
            )
            row = next((x for x in top.stdout.splitlines() if s1 in x), top.stdout + top.stderr)
            assert "0/307 MiB" in row and "agent-kill, kernel unproven" in row, top.stdout

        log = agent.log_path.read_text()
        said = [x for x in log.splitlines() if f"kernel lease {lease1['id'][:6]}" in x]
        assert len(said) == 2, said  # once per (lease, reason): two claims, two lines
        assert "Killed GPU process" not in log
        proofs = {victim.proof, mine.proof}
        for text in (log, nb.log_path.read_text()):
            assert not any(p in text for p in proofs)  # never a proof (nor a secret) logged
        assert f"does not act on the kernel lease {lease1['id'][:6]}" in nb.log_path.read_text()
        admin_auth = {"Authorization": f"token {nb.tokens['admin']}"}
        metrics = httpx.get(f"{nb.url}/metrics", headers=admin_auth, timeout=30).text
        assert metric(metrics, "gpu_lease_enforcement_actions_total", "claim_refused") == 2
        assert metric(metrics, "gpu_lease_enforcement_actions_total", 'action="killed"') is None
    finally:
        victim.stop()
        mine.stop()


def test_a_claimed_cgroup_is_ignored_the_proven_one_is_limited_escape_is_over_cap(
    nb: NodeBroker, students: list[str], agent: R615Agent, tmp_path: Path
) -> None:
    """s001 renews its proven kernel claiming ``"cgroup": "/user.slice"``: main set a hard
    limit there that nothing lifted. Now the limit goes on the kernel's own cgroup, read by
    the agent; a double-forked process inside that cgroup counts for the lease; a kernel
    process that moves itself out of it puts the lease over its cap (revoked, killed); the
    lease's end lifts the limit (NVML documents no removal: the GPU's whole memory)."""
    mount = cgroups.v2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy mounted here")
    s1, _ = students
    gpu = agent.gpus[0]["uuid"]
    base = f"/glp-test-{uuid.uuid4().hex[:8]}"
    group, why = cgroups.create("kernel-k1", f"{base}/gpu-lease")
    assert group is not None, why
    kernel = Process(s1, python=True)
    orphan = Process(s1, kernel=False)
    try:
        group.add(kernel.proc.pid)
        group.add(orphan.proc.pid)  # a double-forked child: no longer a descendant
        with nb.http(s1) as u1:
            lease = acquire(u1, gpu, 0.1, "k1")
            renew(u1, lease, claim(kernel.proc.pid, kernel.proof, cgroup="/user.slice"))

            def state() -> dict[str, Any]:
                return dict(u1.get(f"/leases/{lease['id']}").json())

            wait_for(lambda: "driver" in state()["enforcement"], 20, "the driver limit")
            memory = (lease["memory_limit_mb"] + 512) * _MiB
            limits_log = Path(os.environ["FAKE_NVML_LIMITS_LOG"])
            calls = [json.loads(x) for x in limits_log.read_text().splitlines()]
            assert calls == [
                {"uuid": gpu, "nameSpace": group.path, "softLimit": memory, "hardLimit": memory}
            ]
            agent.set_processes({gpu: [{"pid": orphan.proc.pid, "used_mb": 300}]})
            wait_for(lambda: state()["used_mb"] == 300, 20, "the orphan's usage on the lease")

            # a kernel process moves itself out of the limited cgroup: over its cap
            assert kernel.child is not None
            with open(os.path.join(mount, "cgroup.procs"), "w") as f:
                f.write(str(kernel.child))
            agent.set_processes({gpu: [{"pid": kernel.child, "used_mb": 100}]})
            wait_for(lambda: state()["state"] == "revoked", 30, "the revocation")
            assert "left the kernel's cgroup" in state()["reason"]
            wait_for(lambda: not alive(kernel.child or 0), 20, "the escaped process killed")

        # the lease ended: its limit is lifted to the GPU's whole memory
        def lifted() -> bool:
            return any(
                json.loads(x)["hardLimit"] == 16384 * _MiB
                for x in limits_log.read_text().splitlines()
            )

        wait_for(lifted, 20, "the limit to be lifted")
        calls = [json.loads(x) for x in limits_log.read_text().splitlines()]
        assert {c["nameSpace"] for c in calls} == {group.path}  # never /user.slice
        assert "Driver memory limit on cgroup" in agent.log_path.read_text()
    finally:
        kernel.stop()
        orphan.stop()
        directory = Path(group.directory)
        for sub in (directory, directory.parent, directory.parent.parent):
            try:
                sub.rmdir()
            except OSError:
                pass


def test_one_uid_in_two_pid_namespaces_the_secret_decides(
    nb: NodeBroker, students: list[str], agent: R615Agent
) -> None:
    """Kubernetes-like: alice's and bob's kernels are the same Unix uid, each pid 1 of a pid
    namespace of its own (the broker's users have no account here, so no uid to compare).
    Alice claims bob's kernel (pid 1 of bob's namespace) with her own proof: refused;
    nothing of bob's is charged to her or killed; bob's own claim is proven."""
    s1, _ = students
    gpu = agent.gpus[0]["uuid"]
    a, b = Process(s1, namespace=True), Process(s1, namespace=True)
    try:

        def pod(p: Process) -> tuple[int, int]:
            """(pid namespace, host pid of its pid 1)."""
            ns = wait_for(lambda: _child_ns(p.proc.pid), 10, "the namespace")
            host = wait_for(lambda: host_pid_of(1, ns), 10, "pid 1 of the namespace")
            return ns, host

        (ns_a, host_a), (ns_b, host_b) = pod(a), pod(b)
        assert ns_a != ns_b
        with nb.http("alice") as ua, nb.http("bob") as ub, nb.http("admin") as adm:
            lease_b = acquire(ub, gpu, 0.5, "kb")
            renew(ub, lease_b, claim(1, b.proof, ns_b))
            lease_a = acquire(ua, gpu, 0.05, "ka")
            renew(ua, lease_a, claim(1, a.proof, ns_b))  # bob's pod's pid 1, her proof
            agent.set_processes(
                {gpu: [{"pid": host_b, "used_mb": 2000}, {"pid": host_a, "used_mb": 50}]}
            )

            def lease(x: dict[str, Any]) -> dict[str, Any]:
                return dict(adm.get(f"/leases/{x['id']}").json())

            wait_for(lambda: lease(lease_b)["used_mb"] == 2000, 20, "bob's usage")
            beats(nb, 6)
            assert alive(host_b)
            assert lease(lease_a)["state"] == "active" and lease(lease_a)["used_mb"] == 0
            assert "does not carry this lease's kernel secret" in lease(lease_a)["kernel_refused"]
            # her own pod's kernel, claimed honestly, is hers
            renew(ua, lease_a, claim(1, a.proof, ns_a))
            wait_for(lambda: lease(lease_a)["used_mb"] == 50, 20, "alice's own usage")
            assert lease(lease_a)["kernel_refused"] is None
        assert "Killed GPU process" not in agent.log_path.read_text()
    finally:
        a.stop()
        b.stop()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _child_ns(pid: int) -> int | None:
    """The pid namespace of ``unshare``'s child (the pod's pid 1), once it runs."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
        mine = os.stat("/proc/self/ns/pid").st_ino
        for kid in kids:
            ns = os.stat(f"/proc/{kid}/ns/pid").st_ino
            if ns != mine:
                return ns
    except (OSError, ValueError):
        return None
    return None


async def test_the_provisioner_gives_its_kernel_a_secret_and_renews_with_its_digest_only(
    nb: NodeBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel started by GPULeaseProvisioner carries ``GPU_LEASE_KERNEL_SECRET``; the
    renewals report its sha256 (the claim the broker hands the node's agent), the same after
    a restart of the kernel; the secret is in no log, state file, connection file, the
    provisioner's saved info or an answer, and the proof in no log."""
    from provisioner.wire import kernel_proof

    from .test_provisioner import Specs, kernel, run

    gpu = "GPU-proof-0"
    with nb.http("agent:gpu-a") as a:
        body = {"gpus": [{"uuid": gpu, "name": "T4", "memory_mb": 16384, "index": 0}]}
        assert a.put("/nodes/gpu-a", json={**body, "agent_version": "test"}).status_code == 200
    root = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("GPU_LEASE_URL", nb.url)
    monkeypatch.setenv("GPU_LEASE_TOKEN", nb.tokens["alice"])
    monkeypatch.setenv("GPU_LEASE_GPU_UUIDS", gpu)
    for name in ("JUPYTERHUB_API_TOKEN", "GPU_LEASE_NODE"):
        monkeypatch.delenv(name, raising=False)
    Specs(root).add("gpu-0.1", 0.1)
    code = "import os; print(os.environ.get('GPU_LEASE_KERNEL_SECRET', ''))"

    def claims() -> list[dict[str, Any]]:
        with nb.http("agent:gpu-a") as a:
            answer = a.post("/nodes/gpu-a/heartbeat", json={"usage": []}).json()
        return list(answer["kernels"])

    async with kernel("gpu-0.1", tmp_path) as km:
        secret = (await run(km, code)).strip().splitlines()[-1]
        assert len(secret) >= 40, "the kernel got no secret"
        proof = kernel_proof(secret)
        wait_for(lambda: [k.get("proof") for k in claims()] == [proof], 20, "the proof")
        await km.restart_kernel(now=True)
        assert (await run(km, code)).strip().splitlines()[-1] == secret  # reused
        info = await km.provisioner.get_provisioner_info()  # type: ignore[union-attr]
        assert info["gpu_lease"]["proof"] == proof
        where = "import os; print(os.environ['GPU_LEASE_STATE_FILE'])"
        state_file = (await run(km, where)).strip().splitlines()[-1]
        saved = [km.connection_file, state_file]
        texts = [_read(p) for p in saved] + [repr(info)]
        with nb.http("alice") as u:
            texts.append(u.get("/leases").text)
        assert not any(secret in t for t in texts)
    for log in nb.logs():
        assert secret not in log.read_text() and proof not in log.read_text()
