"""The node agent across Unix users and pid namespaces, and per-kernel cgroups with a driver
memory limit (a renewal's pid is a claim), with REAL processes: a broker
subprocess, the agent subprocess (stand-in NVML: ``tests/fake_nvml``), a Unix account made
here with ``useradd`` (removed at teardown), and a Jupyter "server" that starts a real
ipykernel through ``GPULeaseProvisioner`` inside ``unshare --pid --fork`` (its own pid
namespace, as in a container).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from provisioner.devtools.testing import wait_for
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json
from provisioner.node import cgroups

from .accounts import account_command
from .test_agent import ENFORCING, Agent, enforcing_broker, nodes_of
from .test_nodes import NodeBroker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: useradd, unshare --pid, cgroups"),
    pytest.mark.skipif(
        not all(shutil.which(c) for c in ("useradd", "userdel", "setpriv", "unshare")),
        reason="needs useradd, userdel, setpriv and unshare (util-linux)",
    ),
]

_MiB = 1024 * 1024

#: the Jupyter server of this test: starts one GPU kernel through the provisioner, says
#: where it is, and shuts it down when its stdin closes
SERVER = r"""
import asyncio, json, os, sys
from jupyter_client.manager import AsyncKernelManager

async def main():
    km = AsyncKernelManager(kernel_name="gpu-ns")
    await km.start_kernel()
    prov = km.provisioner
    await asyncio.sleep(0)
    cg = prov.cgroup.path
    print(json.dumps({"pid": prov.pid, "pid_ns": os.stat("/proc/self/ns/pid").st_ino,
                      "lease": prov.lease_keeper.lease.id, "cgroup": cg}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    if await km.is_alive():
        await km.shutdown_kernel(now=True)

asyncio.run(main())
"""


def host_pid_of(ns_pid: int, pid_ns: int) -> int | None:
    """The host pid of the process numbered ``ns_pid`` in pid namespace ``pid_ns``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != pid_ns:
                continue
            with open(f"/proc/{entry}/status") as f:
                nspid = next(x for x in f if x.startswith("NSpid:")).split()
        except (OSError, StopIteration):
            continue
        if int(nspid[-1]) == ns_pid:
            return int(entry)
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def student() -> Iterator[str]:
    """A Unix account of its own (unique name), removed afterwards."""
    name = f"glst{uuid.uuid4().hex[:8]}"
    account_command(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name])
    try:
        yield name
    finally:
        account_command(["userdel", name], check=False)


@pytest.fixture
def enforcing(tmp_path: Path) -> Iterator[NodeBroker]:
    b = enforcing_broker(tmp_path, ("--ttl", "6", *ENFORCING))
    with b.running(timeout=60):
        yield b


class Server:
    """A Jupyter server process (this test's SERVER) in its own pid namespace."""

    def __init__(self, nb: NodeBroker, tmp: Path, gpu: str) -> None:
        jupyter = tmp / "jupyter"
        spec = build_kernelspec(0.1)
        spec["metadata"]["kernel_provisioner"]["config"].update(
            {"renew_interval": 1.0, "long_poll": 1.0, "gpu_uuids": [gpu]}
        )
        folder = jupyter / "kernels" / "gpu-ns"
        folder.mkdir(parents=True)
        (folder / "kernel.json").write_text(spec_json(spec))
        env = dict(os.environ)
        env.update(
            JUPYTER_PATH=str(jupyter),
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
            GPU_LEASE_URL=nb.url,
            GPU_LEASE_TOKEN=nb.tokens["alice"],
        )
        for name in ("GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS", "JUPYTERHUB_API_TOKEN"):
            env.pop(name, None)
        self.log = tmp / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", sys.executable, "-c", SERVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.log.read_text()
        self.kernel: dict[str, Any] = json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


class R615Agent(Agent):
    """An agent whose stand-in driver offers ``nvmlDeviceSetMemoryLimits_v1`` (R615+)."""

    def set_processes(self, processes: dict[str, list[dict[str, int]]]) -> None:
        tmp = self.nvml_file.with_suffix(".tmp")
        state = {"driver": "615.10", "gpus": self.gpus, "processes": processes}
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.nvml_file)


def test_kernel_in_its_own_pid_namespace_is_attributed_capped_and_revoked(
    enforcing: NodeBroker, tmp_path: Path, student: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--kill-unleased-after 3``: a process of a student's own Unix account on the
    GPU outside any kernel is killed; a kernel started through the provisioner in its own
    pid namespace, within its cap and renewing, keeps its lease (main killed it after 4 s),
    has its usage on its lease, gets its cgroup capped by the (stand-in) driver, and is
    revoked when it uses more than its lease."""
    limits_log = tmp_path / "limits.jsonl"
    limits_log.touch()
    monkeypatch.setenv("FAKE_NVML_LIMITS_LOG", str(limits_log))  # the agent inherits it
    agent = R615Agent(
        enforcing, "gpu-a", tmp_path, "--enforce", "revoke", "--kill-unleased-after", "3"
    )
    gpu = agent.gpus[0]["uuid"]
    stray: subprocess.Popen[bytes] | None = None
    server: Server | None = None
    try:
        agent.start()
        wait_for(lambda: nodes_of(enforcing).get("gpu-a", {}).get("state") == "up")
        # a process of the student's own Unix account on the GPU, outside any kernel
        stray = subprocess.Popen(
            ["setpriv", f"--reuid={student}", f"--regid={student}", "--clear-groups"]
            + ["sleep", "300"]
        )
        uid = pwd.getpwnam(student).pw_uid
        wait_for(lambda: f"\t{uid}\t" in Path(f"/proc/{stray.pid}/status").read_text())

        server = Server(enforcing, tmp_path, gpu)
        kernel = server.kernel
        own_ns = os.stat("/proc/self/ns/pid").st_ino
        assert kernel["pid_ns"] != own_ns  # the server and its kernel: another namespace
        host = host_pid_of(kernel["pid"], kernel["pid_ns"])
        assert host is not None and host != kernel["pid"], kernel
        with enforcing.http("alice") as u:

            def lease() -> dict[str, Any]:
                return dict(u.get(f"/leases/{kernel['lease']}").json())

            wait_for(lambda: lease()["pid"] == kernel["pid"], 20, "the first renewal")
            cap = lease()["memory_limit_mb"]  # 1126 MiB: 0.1 of 16 GiB less 512
            agent.set_processes(
                {gpu: [{"pid": host, "used_mb": 300}, {"pid": stray.pid, "used_mb": 200}]}
            )
            wait_for(lambda: lease()["used_mb"] == 300, 20, "the kernel's usage on its lease")
            # the student's stray process is killed after --kill-unleased-after ...
            wait_for(lambda: not alive(stray.pid), 20, "the unleased process to be killed")
            assert f"Killed GPU process {stray.pid} that belongs to no GPU lease" in (
                agent.log_path.read_text()
            )
            # ... the kernel, within its cap and renewing, keeps its lease well past that
            time.sleep(5)
            assert lease()["state"] == "active" and alive(host)

            # its own cgroup, and the driver's hard limit on it: the lease's memory
            assert kernel["cgroup"].endswith(f"/gpu-lease/kernel-{lease()['kernel_id']}")
            assert cgroups.cgroup_of(host) == kernel["cgroup"]
            wait_for(lambda: "driver" in lease()["enforcement"], 20, "the driver limit")
            assert lease()["enforcement"] == "driver+agent-revoke"
            calls = [json.loads(x) for x in limits_log.read_text().splitlines()]
            memory = (cap + 512) * _MiB
            assert calls == [
                {
                    "uuid": gpu,
                    "nameSpace": kernel["cgroup"],
                    "softLimit": memory,
                    "hardLimit": memory,
                }
            ]

            # over its lease: revoked; its provisioner stops it and removes its cgroup
            agent.set_processes({gpu: [{"pid": host, "used_mb": 4000}]})
            wait_for(lambda: lease()["state"] == "revoked", 30, "the revocation")
            assert "used 3.9 GiB of GPU memory" in lease()["reason"]
            wait_for(lambda: not alive(host), 30, "the provisioner to stop the kernel")
            directory = Path(cgroups.v2_mount() or "/nonexistent") / kernel["cgroup"].lstrip("/")
            wait_for(lambda: not directory.exists(), 30, "the kernel's cgroup to be removed")
        assert f"Killed GPU process {host}" not in agent.log_path.read_text()
    finally:
        agent.stop()
        if server is not None:
            server.stop()
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()


def test_a_kernel_without_a_writable_cgroup_v2_runs_on_and_says_why(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n")
    group, why = cgroups.create("kernel-x", mountinfo=str(mountinfo))
    assert group is None
    assert why.startswith("no cgroup v2 hierarchy is mounted on this node")
    # found where it is mounted, not at a fixed path (hybrid hosts: .../unified)
    mountinfo.write_text(
        "41 31 0:38 / /sys/fs/cgroup/with\\040space rw,relatime - cgroup2 cgroup2 rw\n"
    )
    assert cgroups.v2_mount(str(mountinfo)) == "/sys/fs/cgroup/with space"


def test_empty_kernel_cgroups_left_by_a_dead_server_are_pruned(tmp_path: Path) -> None:
    """A server killed with kill -9 never removes its kernels' cgroups; the next kernel's
    launch removes the empty ones old enough, and never a populated or a young one."""
    mount = cgroups.v2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy mounted here")
    parent = f"/gpu-lease-test-{uuid.uuid4().hex[:8]}"
    made = [cgroups.create(n, parent)[0] for n in ("kernel-old", "kernel-young", "kernel-busy")]
    busy = made[2]
    assert all(made) and busy is not None
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        busy.add(sleeper.pid)
        long_ago = time.time() - 2 * cgroups.STALE_AFTER
        for name in ("kernel-old", "kernel-busy"):
            os.utime(Path(mount) / parent.lstrip("/") / name, (long_ago, long_ago))
        new, why = cgroups.create("kernel-new", parent)
        assert new is not None, why
        left = sorted(p.name for p in (Path(mount) / parent.lstrip("/")).iterdir() if p.is_dir())
        assert left == ["kernel-busy", "kernel-new", "kernel-young"]
    finally:
        sleeper.kill()
        sleeper.wait()
        base = Path(mount) / parent.lstrip("/")
        for p in base.iterdir():
            if p.is_dir():
                p.rmdir()
        base.rmdir()
