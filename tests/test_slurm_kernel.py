"""The ``slurm`` launcher for real: a kernel that is a Slurm job on its lease's node.

One Slurm cluster for the module (``slurmctld`` and ``slurmd`` node1 and node2 on this
machine, :mod:`provisioner.devtools.slurmcluster`), a real broker (static tokens) whose pool
is what the two nodes' agents register (a declared T4 each), and a student's Unix account
(``useradd``). The test runs as root, as a root server does: ``SlurmKernel`` submits as the
student with ``sudo -E -u STUDENT sbatch``. A lease is acquired for the student on node2;
the kernel's job must run there as the student, with the lease's GPU, and answer a
jupyter_client ``BlockingKernelClient`` on the address and ports the job reported; SIGINT
interrupts a ``time.sleep(60)`` cell; SIGKILL ends the job and ``poll`` says so; the key is
in no Slurm record, no job output, no process's argv or environment. A server that runs as
the student (``runuser``) submits with plain ``sbatch``; a shutdown request ends the job with
exit code 0, the root process takes the kernel back by ``from_json``, and a restart (the
same kernel id) is a new job. And the whole way: jupyter_client's ``AsyncKernelManager`` with
``GPULeaseProvisioner(launcher='slurm')``. A job that cannot
start says why at once: a bad argv, a kernel that exits before it listens (its stderr is
quoted), a node that is down (Slurm's pending reason), an unknown node (sbatch's refusal).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import queue
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.manager import AsyncKernelManager
from traitlets.config import Config

from provisioner.client import BrokerClient
from provisioner.client.answers import GrantedLease
from provisioner.devtools import slurmcluster
from provisioner.devtools.slurmcluster import SlurmCluster, agent_tokens, start_agent
from provisioner.devtools.testing import BrokerProcess, execute, stop_process, wait_for
from provisioner.errors import KernelLaunchFailed
from provisioner.kernel.env import lease_environment
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json
from provisioner.kernel.remote import CONNECTION_FILE, Launched, LaunchJob, remote_environment
from provisioner.kernel.slurm_kernel import SlurmKernel, SlurmSettings

from .accounts import needs_root, passable_dir, student_python, useradd, userdel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Site:
    cluster: SlurmCluster
    broker: BrokerProcess
    student: str
    python: str
    tmp: Path

    def settings(self, **kw: Any) -> SlurmSettings:
        return SlurmSettings(
            python=self.python, bind="127.0.0.1", slurm_env=self.cluster.env(), **kw
        )

    def slurm(self, *cmd: str) -> str:
        done = subprocess.run(
            cmd, env={**os.environ, **self.cluster.env()}, capture_output=True, text=True
        )
        return done.stdout + done.stderr


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    why = slurmcluster.available()
    if why:
        pytest.skip(why)
    needs_root("sudo")  # a root server submits as the student: sudo -E -u STUDENT sbatch
    student = f"glk-{secrets.token_hex(3)}"
    with passable_dir("gpu-lease-slurm-kernel-") as tmp:
        cluster = SlurmCluster(tmp / "slurm")
        agents: list[subprocess.Popen[bytes]] = []
        try:
            useradd(student)
            python = student_python(tmp, student)
            cluster.start()
            broker = BrokerProcess(
                tmp,
                f"sqlite:///{tmp / 'broker.sqlite'}",
                {student: ([], False), "admin": ([], True)},
                gpus="agents",
            )
            tokens = agent_tokens(tmp / "agents.json", cluster.nodes)
            data = json.loads(broker.tokens_file.read_text())
            data.update(json.loads((tmp / "agents.json").read_text()))
            broker.tokens_file.write_text(json.dumps(data))
            with broker.running(timeout=60):
                for node, token in tokens.items():
                    log = tmp / f"agent-{node}.log"
                    agents.append(start_agent(broker.url, node, token, "1x16384:T4", log))
                wait_for(lambda: _nodes_up(broker) == {"node1", "node2"}, 30, "both agents")
                yield Site(cluster, broker, student, python, tmp)
        finally:
            for agent in agents:
                stop_process(agent)
            cluster.stop()
            userdel(student)


def _nodes_up(broker: BrokerProcess) -> set[str]:
    import httpx

    r = httpx.get(
        f"{broker.url}/api/v1/nodes",
        headers={"Authorization": f"token {broker.tokens['admin']}"},
    )
    return {n["node"] for n in r.json()["nodes"] if n["state"] == "up"}


@pytest.fixture
async def client(site: Site) -> AsyncIterator[BrokerClient]:
    c = BrokerClient(site.broker.url, site.broker.tokens[site.student])
    try:
        yield c
    finally:
        await c.aclose()


async def lease_on(client: BrokerClient, node: str) -> GrantedLease:
    lease = await client.leases.acquire(str(uuid.uuid4()), 0.25, node=node)
    assert lease.gpu.node == node, lease
    return lease


def launch_job(site: Site, lease: GrantedLease, argv: tuple[str, ...] | None = None) -> LaunchJob:
    home = pwd.getpwnam(site.student).pw_dir
    return LaunchJob(
        kernel_id=str(lease.kernel_id),
        lease=lease,
        argv=argv or (site.python, "-m", "ipykernel_launcher", "-f", CONNECTION_FILE),
        env=remote_environment({"LANG": "C.UTF-8"}, {}, lease_environment(lease)),
        cwd=home,
        key=str(uuid.uuid4()),
    )


def kernel_client(launched: Launched, job: LaunchJob) -> BlockingKernelClient:
    """A client of the job's kernel, ready; :func:`close_client` it."""
    kc = BlockingKernelClient()
    info = launched.connection_info(job.key, job.signature_scheme)
    kc.load_connection_info(cast(KernelConnectionInfo, info))
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
    except BaseException:
        close_client(kc)
        raise
    return kc


def close_client(kc: BlockingKernelClient) -> None:
    """Its channels, then the ZMQ context it made: left to the garbage collector, the
    context may be collected before the client that would destroy it, and its
    ResourceWarning then fails whichever later test the collection runs in."""
    kc.stop_channels()
    kc.context.destroy(linger=0)


def run_cell(kc: BlockingKernelClient, code: str) -> tuple[str, dict[str, Any]]:
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=30, output_hook=hook)
    return "".join(out), dict(reply["content"])


def job_processes(site: Site, job_id: str) -> list[psutil.Process]:
    procs = []
    for node in site.cluster.nodes:
        for p in site.cluster.jobs_on(node):
            try:
                if p.environ().get("SLURM_JOB_ID") == job_id:
                    procs.append(p)
            except psutil.Error:
                continue
    return procs


async def test_the_kernel_is_the_students_job_on_the_leases_node(
    site: Site, client: BrokerClient
) -> None:
    lease = await lease_on(client, "node2")
    job = launch_job(site, lease)
    kernel = SlurmKernel(site.settings(), user=site.student)
    launched = await kernel.launch(job)
    kc = kernel_client(launched, job)
    try:
        assert (launched.node, launched.ip, launched.handle) == (
            "node2",
            "127.0.0.1",
            kernel.job_id,
        )
        assert launched.cwd_shared and launched.cwd == job.cwd
        out, reply = run_cell(
            kc,
            "import os; print(os.getuid(), os.environ['SLURM_JOB_ID'], "
            "os.environ['CUDA_VISIBLE_DEVICES'], os.environ['SLURMD_NODENAME'])",
        )
        assert reply["status"] == "ok", reply
        uid = pwd.getpwnam(site.student).pw_uid
        assert out.split() == [str(uid), kernel.job_id, str(lease.gpu.uuid), "node2"]
        queued = site.slurm("squeue", "-h", "-j", kernel.job_id, "-o", "%u %N %T")
        assert queued.split() == [site.student, "node2", "RUNNING"], queued

        # the key is in no Slurm record, no output of the job, no argv or environment
        assert not (Path(launched.extra["directory"]) / "kernel.json").exists()
        record = site.slurm("scontrol", "show", "job", "-dd", kernel.job_id)
        assert f"JobId={kernel.job_id}" in record and job.key not in record
        directory = Path(launched.extra["directory"])
        for name in ("slurm.out", "slurm.err", "job.json", "launched.json"):
            assert job.key not in (directory / name).read_text(), name
        procs = job_processes(site, kernel.job_id)
        assert len(procs) >= 2, procs  # the runner and the kernel
        for p in procs:
            assert job.key not in " ".join(p.cmdline())
            assert all(job.key not in v for v in p.environ().values())
            assert p.uids().real == uid

        # a restarted server takes the kernel back
        again = SlurmKernel.from_json(json.loads(json.dumps(kernel.to_json())), site.settings())
        assert await again.poll() is None

        # SIGINT interrupts a cell
        msg_id = kc.execute("import time; print('asleep', flush=True); time.sleep(60)")
        wait_for(lambda: _asleep(kc, msg_id), 20, "the cell to sleep")
        # why --full: --batch signals the batch step's first process only, the runner,
        # which outlives it; the cell sleeps on
        site.slurm("scancel", "--signal=INT", "--batch", kernel.job_id)
        with pytest.raises(queue.Empty):
            kc.get_shell_msg(timeout=3)
        t0 = time.monotonic()
        await kernel.signal(signal.SIGINT)
        reply_msg = kc.get_shell_msg(timeout=20)
        took = time.monotonic() - t0
        assert reply_msg["parent_header"]["msg_id"] == msg_id
        assert reply_msg["content"]["status"] == "error"
        assert reply_msg["content"]["ename"] == "KeyboardInterrupt", reply_msg["content"]
        assert took < 10, took
        assert await kernel.poll() is None  # an interrupt is not an end

        # SIGKILL ends the job, and poll says so (this kernel and the one taken back)
        await kernel.signal(signal.SIGKILL)
        code = await kernel.wait(30)
        assert code is not None and code != 0, code
        assert await again.wait(30) == code
        wait_for(
            lambda: kernel.job_id not in site.slurm("squeue", "-h", "-o", "%i"), 30, "job gone"
        )
        assert job_processes(site, kernel.job_id) == []
    finally:
        close_client(kc)
        await kernel.signal(signal.SIGKILL)
        kernel.cleanup()
        await client.leases.release(lease.id)


def _asleep(kc: BlockingKernelClient, msg_id: str) -> bool:
    """Whether the cell ``msg_id`` printed (it then sleeps). Not ``execute_input``: a SIGINT
    sent between it and the cell's first line reaches ipykernel's loop, not the cell."""
    try:
        msg = kc.get_iopub_msg(timeout=0.2)
    except queue.Empty:
        return False
    return msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id


async def test_a_bad_argv_says_why_at_once(site: Site, client: BrokerClient) -> None:
    lease = await lease_on(client, "node2")
    job = launch_job(site, lease, ("/nonexistent/python3", "-f", CONNECTION_FILE))
    kernel = SlurmKernel(site.settings(), user=site.student)
    t0 = time.monotonic()
    try:
        with pytest.raises(KernelLaunchFailed) as caught:
            await kernel.launch(job)
        assert time.monotonic() - t0 < 30  # not the launch timeout (120 s)
        said = caught.value.message
        assert "'/nonexistent/python3' could not be started on node node2" in said, said
        assert "No such file or directory" in said, said
        assert caught.value.code == "kernel_launch_failed" and caught.value.status == 502
        assert not (Path(str(kernel.directory)) / "kernel.json").exists()  # the key is gone
    finally:
        kernel.cleanup()
        await client.leases.release(lease.id)


async def test_a_kernel_that_exits_before_it_listens_quotes_its_stderr(
    site: Site, client: BrokerClient
) -> None:
    lease = await lease_on(client, "node1")
    code = "import sys; sys.stderr.write('cannot import torch here\\n'); sys.exit(3)"
    job = launch_job(site, lease, (site.python, "-c", code, CONNECTION_FILE))
    kernel = SlurmKernel(site.settings(), user=site.student)
    try:
        with pytest.raises(KernelLaunchFailed) as caught:
            await kernel.launch(job)
        said = caught.value.message
        assert "exited with code 3 on node node1 before it listened" in said, said
        assert "cannot import torch here" in said, said
        assert job.key not in said
    finally:
        kernel.cleanup()
        await client.leases.release(lease.id)


async def test_a_node_that_is_down_or_unknown_gives_slurms_reason(
    site: Site, client: BrokerClient
) -> None:
    lease = await lease_on(client, "node1")
    job = launch_job(site, lease)
    kernel = SlurmKernel(site.settings(), user=site.student)
    site.slurm("scontrol", "update", "NodeName=node1", "State=DOWN", "Reason=test-maintenance")
    try:
        wait_for(lambda: site.cluster.states().get("node1", "").startswith("down"), 20, "down")
        t0 = time.monotonic()
        with pytest.raises(KernelLaunchFailed) as caught:
            await kernel.launch(job)
        assert time.monotonic() - t0 < 30
        said = caught.value.message
        assert "node1" in said and "ReqNodeNotAvail" in said, said
        assert not (Path(str(kernel.directory)) / "kernel.json").exists()  # the job never ran
        assert kernel.job_id not in site.slurm("squeue", "-h", "-o", "%i").split()
    finally:
        site.slurm("scontrol", "update", "NodeName=node1", "State=RESUME")
        kernel.cleanup()
        await client.leases.release(lease.id)
    wait_for(lambda: site.cluster.states().get("node1") == "idle", 30, "node1 back")
    # a node Slurm does not know (a broker node name that is no Slurm node): sbatch refuses
    lease = await lease_on(client, "node2")
    ghost = LaunchJob(
        kernel_id=job.kernel_id,
        lease=GrantedLease.from_json({**lease.to_json(), "gpu": {"uuid": "G", "node": "node9"}}),
        argv=job.argv,
        env=job.env,
        cwd=job.cwd,
        key=job.key,
    )
    kernel = SlurmKernel(site.settings(), user=site.student)
    try:
        with pytest.raises(KernelLaunchFailed) as caught:
            await kernel.launch(ghost)
        assert "Slurm refused the kernel's job on node node9" in caught.value.message
    finally:
        await client.leases.release(lease.id)


#: a server that runs as the student (on a Slurm site, itself a job of theirs): it submits
#: with plain sbatch; the key comes on stdin, the answer goes to stdout as JSON
AS_STUDENT = """
import asyncio, json, sys
from provisioner.client.answers import GrantedLease
from provisioner.kernel.remote import LaunchJob
from provisioner.kernel.slurm_kernel import SlurmKernel, SlurmSettings

spec = json.loads(sys.stdin.read())
job = LaunchJob(**{**spec["job"], "lease": GrantedLease.from_json(spec["job"]["lease"])})
kernel = SlurmKernel(SlurmSettings(**spec["settings"]))
launched = asyncio.run(kernel.launch(job))
print(json.dumps({"kernel": kernel.to_json(), "ip": launched.ip, "ports": dict(launched.ports)}))
"""


async def test_a_server_running_as_the_student_submits_with_plain_sbatch(
    site: Site, client: BrokerClient
) -> None:
    lease = await lease_on(client, "node1")
    job = launch_job(site, lease)
    spec = {
        "job": {
            "kernel_id": job.kernel_id,
            "lease": lease.to_json(),
            "argv": list(job.argv),
            "env": dict(job.env),
            "cwd": job.cwd,
            "key": job.key,
        },
        "settings": {
            "python": site.python,
            "bind": "127.0.0.1",
            "slurm_env": site.cluster.env(),
        },
    }
    proc = await asyncio.create_subprocess_exec(
        "runuser", "-u", site.student, "--", site.python, "-c", AS_STUDENT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd="/",
    )  # fmt: skip
    out_b, err_b = await asyncio.wait_for(proc.communicate(json.dumps(spec).encode()), 120)
    stdout, stderr = out_b.decode(), err_b.decode()
    assert proc.returncode == 0, stderr
    answer = json.loads(stdout)
    assert job.key not in stdout + stderr
    # this (root) process takes the kernel back, as a restarted server would
    kernel = SlurmKernel.from_json(answer["kernel"], site.settings())
    assert kernel.user is None  # it submitted as itself
    launched = Launched(ip=answer["ip"], ports=answer["ports"], node="node1")
    kc = kernel_client(launched, job)
    try:
        out, reply = run_cell(kc, "import os; print(os.getuid(), os.environ['SLURMD_NODENAME'])")
        assert out.split() == [str(pwd.getpwnam(site.student).pw_uid), "node1"], reply
        queued = site.slurm("squeue", "-h", "-j", kernel.job_id, "-o", "%u %N")
        assert queued.split() == [site.student, "node1"], queued
        # a shutdown request ends the kernel, and with it its job: exit code 0
        kc.shutdown()
        assert await kernel.wait(30) == 0
        wait_for(
            lambda: kernel.job_id not in site.slurm("squeue", "-h", "-o", "%i"), 30, "job gone"
        )
        # a restart keeps the kernel id: a new job, whose poll is not the last one's exit
        again = SlurmKernel(site.settings(), user=site.student)
        relaunched = await again.launch(job)
        assert again.job_id != kernel.job_id and await again.poll() is None
        assert relaunched.extra["directory"] == str(kernel.directory)
        await again.signal(signal.SIGKILL)
        assert await again.wait(30) not in (None, 0)
    finally:
        close_client(kc)
        await kernel.signal(signal.SIGKILL)
        kernel.cleanup()
        await client.leases.release(lease.id)


async def test_jupyter_clients_kernel_manager_runs_a_slurm_kernel_through_the_provisioner(
    site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole way: ``AsyncKernelManager`` with ``GPULeaseProvisioner(launcher='slurm')``
    (a root server: the lease is the student's, so the job is too) acquires, submits, talks
    to the kernel, interrupts it, restarts it (a new job, the same lease) and shuts it down
    (the job ends, the lease is released)."""
    spec = build_kernelspec(0.25)
    spec["argv"] = [site.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec["metadata"]["kernel_provisioner"]["config"].update(
        {"launcher": "slurm", "node": "node2", "renew_interval": 1.0, "launch_timeout": 60.0}
    )
    folder = tmp_path / "jupyter" / "kernels" / "slurm-0.25"
    folder.mkdir(parents=True)
    (folder / "kernel.json").write_text(spec_json(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("GPU_LEASE_URL", site.broker.url)
    monkeypatch.setenv("GPU_LEASE_TOKEN", site.broker.tokens[site.student])
    config = Config(
        {
            "SlurmLauncher": {
                "python": site.python,
                "bind": "127.0.0.1",
                "slurm_conf": site.cluster.env()["SLURM_CONF"],
            }
        }
    )
    km = AsyncKernelManager(kernel_name="slurm-0.25", config=config)
    await km.start_kernel(cwd=pwd.getpwnam(site.student).pw_dir)
    try:
        lease = km.provisioner.lease_keeper.lease  # type: ignore[union-attr]
        assert lease is not None and lease.gpu.node == "node2"
        code = "import os; print(os.getuid(), os.environ['SLURMD_NODENAME'], os.environ['SLURM_JOB_ID'])"
        out, reply = await execute(km, code)
        uid, node, job_id = out.split()
        assert (int(uid), node) == (pwd.getpwnam(site.student).pw_uid, "node2"), (out, reply)
        queued = site.slurm("squeue", "-h", "-j", job_id, "-o", "%u %N")
        assert queued.split() == [site.student, "node2"], queued

        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=30)
            msg_id = kc.execute("import time; print('asleep', flush=True); time.sleep(60)")
            while True:
                msg = await kc.get_iopub_msg(timeout=30)
                if msg["msg_type"] == "stream" and msg["parent_header"]["msg_id"] == msg_id:
                    break
            await km.interrupt_kernel()
            while True:
                answer = await kc.get_shell_msg(timeout=20)
                if answer["parent_header"].get("msg_id") == msg_id:
                    break
            assert answer["content"]["ename"] == "KeyboardInterrupt", answer["content"]
        finally:
            kc.stop_channels()

        await km.restart_kernel(now=True)
        assert km.provisioner.lease_keeper.lease.id == lease.id  # type: ignore[union-attr]
        out, _ = await execute(km, code)
        assert out.split()[2] != job_id  # a new job
        await km.shutdown_kernel()
        wait_for(lambda: not site.slurm("squeue", "-h", "-u", site.student).strip(), 30, "no job")
        admin = BrokerClient(site.broker.url, site.broker.tokens["admin"])
        try:
            released = await admin.leases.get(lease.id)
        finally:
            await admin.aclose()
        assert released.state == "released", released
    finally:
        if km.has_kernel:
            await km.shutdown_kernel(now=True)


async def test_a_controller_that_does_not_answer_is_no_jobs_end(tmp_path: Path) -> None:
    """squeue failing as it does when slurmctld is too busy to answer leaves the kernel
    running as far as poll can tell; only Slurm's "Invalid job id" is an end. (A stand-in
    squeue first on PATH: a real controller that times out takes its MessageTimeout.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out on send/recv' >&2\nexit 1\n"
    )
    squeue.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    kernel = SlurmKernel(SlurmSettings(slurm_env={"PATH": path}))
    kernel.job_id, kernel.directory = "12345", tmp_path
    assert await kernel.poll() is None
    (tmp_path / "exit.json").write_text('{"returncode": 7}')  # the runner's word
    assert await kernel.poll() == 7
