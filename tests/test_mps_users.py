"""Two Unix users' ``enforcement=mps`` kernels on a one-GPU node: the second waits in the
broker's queue with a reason it can read, none hangs in CUDA, and when the first user's
kernel ends the second is granted.

Real processes throughout: a broker, a node agent with ``--mps`` (the stand-in
``nvidia-cuda-mps-control`` of ``tests/fake_mps``, which serves one uid at a time as the
real one does and makes a client of another uid *wait*), and for each user a process
running as that user that starts a real ipykernel through the GPU lease provisioner and
allocates GPU memory in it (the stand-in CuPy connects to the MPS daemon as CUDA does).
The first user is this test's own account; the second is a Unix account made here with
``useradd`` (a unique random-suffix name, removed at teardown): a uid the provisioner
only *reports* would not show that the MPS daemon really sees another user.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from provisioner.devtools.testing import wait_for
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json

from .accounts import account_command
from .test_agent import FAKE_MPS, Agent, nodes_of
from .test_nodes import NodeBroker

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STANDIN_GPU = HERE / "standin_gpu"
RUNNER = HERE / "mps_kernel_runner.py"
REASON = "serving another user's kernels"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("setpriv")),
        reason="needs root, useradd and setpriv to run a kernel as a second Unix user",
    ),
]


@pytest.fixture
def account() -> Iterator[pwd.struct_passwd]:
    """A Unix account of its own (no home, no login), removed afterwards."""
    name = f"glmps-{secrets.token_hex(4)}"
    account_command(["useradd", "-M", "-s", "/usr/sbin/nologin", name])
    try:
        yield pwd.getpwnam(name)
    finally:
        account_command(["userdel", name], check=False)


def world_reachable(path: str) -> bool:
    """Whether every directory above ``path`` lets any user through (``o+x``)."""
    parent = Path(os.path.realpath(path)).parent
    return all(os.stat(p).st_mode & 0o001 for p in (parent, *parent.parents))


def as_user(user: pwd.struct_passwd) -> list[str]:
    """``setpriv`` running a command as ``user`` (its uid, its group, no others). Where
    this machine's Python lives under a directory other users cannot enter (``/root``,
    as here: pyenv), the command also gets CAP_DAC_READ_SEARCH, only to reach it: the
    processes still run as ``user``, which is all the MPS daemon looks at."""
    cmd = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    if not world_reachable(sys.executable):
        cmd += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return cmd


class Runner:
    """``tests/mps_kernel_runner.py`` as one user: its kernel, its output in a file."""

    def __init__(
        self, base: Path, who: str, token: str, broker_url: str, user: pwd.struct_passwd | None
    ) -> None:
        self.who = who
        self.home = base / who
        self.home.mkdir()
        if user is not None:
            os.chown(self.home, user.pw_uid, user.pw_gid)
        self.out = base / f"{who}.out"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "PYTHONPATH": os.pathsep.join([str(STANDIN_GPU), str(ROOT)]),
            "JUPYTER_PATH": str(base / "jupyter"),
            "JUPYTER_RUNTIME_DIR": str(self.home / "runtime"),
            "JUPYTER_DATA_DIR": str(self.home / "data"),
            "IPYTHONDIR": str(self.home / "ipython"),
            "GPU_LEASE_URL": broker_url,
            "GPU_LEASE_TOKEN": token,
        }
        cmd = [sys.executable, str(RUNNER), "gpu-mps"]
        if user is not None:
            cmd = [*as_user(user), *cmd]
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.home,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def stop(self) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(b"stop\n")
        stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the runner and its kernel
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def test_two_users_mps_kernels_on_one_gpu_the_second_waits_with_a_reason_and_none_hangs(
    tmp_path: Path, account: pwd.struct_passwd
) -> None:
    nb = NodeBroker(
        tmp_path,
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        ("--ttl", "6", "--GPULeaseBroker.node_grace=3", "--GPULeaseBroker.reap_interval=0.2"),
    )
    base = Path(tempfile.mkdtemp(prefix="gl-mps-users-"))
    base.chmod(0o755)  # the second user reaches the kernelspec and the MPS pipes
    mps_dir = base / "mps"
    agent = Agent(
        nb, "gpu-a", tmp_path, "--mps", "--mps-dir", str(mps_dir), "--mps-control", str(FAKE_MPS)
    )
    agent.gpus = agent.gpus[:1]  # a one-GPU node
    agent.set_processes({})
    gpu = agent.gpus[0]["uuid"]
    control_log = mps_dir / gpu / "log" / "control.log"
    spec = build_kernelspec(0.25, enforcement="mps")
    spec["metadata"]["kernel_provisioner"]["config"].update(
        {"renew_interval": 1.0, "long_poll": 1.0, "queue_timeout": 120, "node": "gpu-a"}
    )
    spec["metadata"]["kernel_provisioner"]["config"]["mps_dir"] = str(mps_dir)
    (base / "jupyter" / "kernels" / "gpu-mps").mkdir(parents=True)
    (base / "jupyter" / "kernels" / "gpu-mps" / "kernel.json").write_text(spec_json(spec))
    runners: list[Runner] = []

    def gpu_mps_uid() -> Any:
        with nb.http("alice") as c:
            return {g["uuid"]: g for g in c.get("/gpus").json()["gpus"]}[gpu].get("mps_uid")

    def detail() -> str:
        return "\n".join(f"--- {r.who}:\n{r.text()[-3000:]}" for r in runners) + (
            f"\n--- control.log:\n{control_log.read_text() if control_log.exists() else ''}"
        )

    try:
        with nb.running(timeout=60):
            agent.start()
            wait_for(lambda: nodes_of(nb).get("gpu-a", {}).get("mps") == {gpu: "running"}, 30)
            wait_for(control_log.exists, 10, "the MPS daemon's start")

            # 1. the first user's kernel is granted and is a client of the GPU's MPS server
            first = Runner(base, "first", nb.tokens["alice"], nb.url, None)
            runners.append(first)
            wait_for(lambda: "ON-MPS" in first.text(), 90, "the first kernel on MPS", detail=detail)
            assert f"ON-MPS uid={os.getuid()}" in first.text()
            wait_for(lambda: gpu_mps_uid() == os.getuid(), 15, "the agent's report of the uid")

            # 2. the second user's kernel waits in the queue, with the reason, not in CUDA
            second = Runner(base, "second", nb.tokens["bob"], nb.url, account)
            runners.append(second)
            wait_for(
                lambda: REASON in second.text(), 60, "the second kernel's reason", detail=detail
            )
            with nb.http("admin") as c:
                queue = c.get("/queue").json()["queue"]
            assert [q["user"] for q in queue] == ["bob"], queue
            with nb.http("bob") as c:
                kernel_id = queue[0]["kernel_id"]
                answer = c.post("/leases", json={"kernel_id": kernel_id, "fraction": 0.25})
            assert answer.status_code == 202, answer.text
            assert answer.json()["reason"].startswith(
                f"The MPS server of GPU 0 (T4) on node gpu-a is {REASON}"
            ), answer.json()
            assert "LEASED" not in second.text() and first.proc.poll() is None

            # 3. the first user's kernel ends: the second is granted and runs on MPS as its uid
            first.stop()
            assert first.proc.wait(60) == 0, detail()
            wait_for(
                lambda: f"ON-MPS uid={account.pw_uid}" in second.text(),
                60,
                "the second kernel on MPS",
                detail=detail,
            )
            wait_for(lambda: gpu_mps_uid() == account.pw_uid, 15, "the report of the second uid")
            # no client ever waited at the MPS daemon: nothing hung
            assert " waits: " not in control_log.read_text(), detail()
            with nb.http("admin") as c:
                (lease,) = [
                    x for x in c.get("/leases?all=1").json()["leases"] if x["state"] == "active"
                ]
            assert lease["user"] == "bob" and lease["mps_uid"] == account.pw_uid
            assert lease["mps_server_uid"] == account.pw_uid

            # the danger is real: a CUDA process of another user outside the broker hangs
            rogue = subprocess.Popen(
                [sys.executable, "-c", "import cupy; cupy.empty(1); print('never')"],
                env={
                    "PYTHONPATH": str(STANDIN_GPU),
                    "CUDA_MPS_PIPE_DIRECTORY": str(mps_dir / gpu / "pipe"),
                    "CUDA_VISIBLE_DEVICES": gpu,
                },
                stdout=subprocess.DEVNULL,
            )
            try:
                wait_for(lambda: " waits: " in control_log.read_text(), 15, "the rogue to wait")
                assert rogue.poll() is None, "a client of another uid must wait, as MPS's does"
            finally:
                rogue.kill()
                rogue.wait()
            second.stop()
            assert second.proc.wait(60) == 0, detail()
            assert "DONE" in second.text()
    finally:
        for runner in runners:
            runner.kill()
        if agent.proc is not None and agent.proc.poll() is None:
            agent.signal(signal.SIGTERM)  # its MPS daemons quit and stop their servers
        agent.stop()
        shutil.rmtree(base, ignore_errors=True)
