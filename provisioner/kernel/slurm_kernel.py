"""The ``slurm`` launcher: a remote kernel that is a Slurm job on its lease's node.

The provisioner runs inside the student's server, which on a Slurm site is itself a job
running as the student: ``sbatch`` then runs as the current user. A server that runs as
root for another user (a root server) submits as the student with ``sudo -E -u USER
sbatch``, the way batchspawner submits servers. Either way the kernel is the student's
job, so Slurm's accounting, cgroups and ``pam_slurm_adopt`` see it.

One kernel, one job (:func:`sbatch_argv`): ``--nodelist=<the lease's node>`` (the broker's
node names are Slurm's: ``placement.discover`` takes them from ``SLURMD_NODENAME``), one
task, ``--export=NONE`` (nothing of the server's environment, its tokens above all, goes
into Slurm's job records), stdout and stderr into the kernel's *exchange directory*, and,
where the site sets :attr:`SlurmSettings.shards_per_gpu`, ``--gres=shard:N`` for the lease's
share. The job runs :mod:`.slurm_job` in the exchange directory, which:

- is ``~/.gpu-lease/slurm-kernels/<kernel id>`` of the student (0700): the home is shared
  between the server's node and the compute nodes, as on every Slurm site;
- holds the kernel's connection file with its key (0600), written by the server, read by
  the kernel and removed by the job once the kernel listens: the key is never on a command
  line, in the job's environment or script, in ``scontrol show job`` or in the job's
  output;
- gets the node's answer (``launched.json``: the address the kernel bound to, its ports,
  the working directory) and, at the end, the kernel's exit code (``exit.json``).

``poll`` reads ``exit.json``, else the job's state (``squeue``, then ``scontrol`` for a
finished job); ``signal`` is ``scancel --signal=SIG --full`` (``--full`` reaches the batch
step's processes, where the kernel is; without it Slurm signals only ``srun`` steps, of which
a kernel job has none); ``wait`` polls. A job that fails, is cancelled or cannot start (a
node that is down) before the kernel listens raises :class:`~provisioner.errors.KernelLaunchFailed`
with the job's state and reason and the tail of its stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pwd
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traitlets import Float, Integer, List, Unicode
from traitlets.config import Configurable

from ..errors import InvalidRequest, KernelLaunchFailed
from .remote import Launched, LaunchJob
from .slurm_job import CONNECTION, EXITED, JOB_FILE, LAUNCHED, PORTS, STDERR, STDOUT

#: what :meth:`SlurmKernel._queue_state` says when ``squeue`` could not answer
UNKNOWN = "UNKNOWN"
#: the job states in which the kernel may still run (squeue's ``%T``; UNKNOWN: no answer)
ALIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED"}
    | {UNKNOWN}
)
#: pending reasons that will not clear by waiting (``squeue``'s ``%r``): the job is
#: cancelled and the reason is the answer
HOPELESS_REASONS = re.compile(
    r"^(ReqNodeNotAvail|NodeDown|PartitionDown|PartitionInactive|PartitionNodeLimit|"
    r"PartitionTimeLimit|BadConstraints|InvalidAccount|InvalidQOS|DependencyNeverSatisfied|"
    r"JobHeldAdmin|JobLaunchFailure|launch failed)"
)
#: how much of the job's stderr a refusal quotes
STDERR_TAIL = 1200
#: the variables that would steer ``sbatch`` from the server's own job (a server that is a
#: Slurm job has SLURM_MEM_PER_NODE, SLURM_CPUS_PER_TASK, ...): never passed to it
_STEERING = re.compile(r"^(SLURM_|SBATCH_|SALLOC_|SRUN_)")


@dataclass(frozen=True)
class SlurmSettings:
    """What a site sets for its Slurm kernels (the provisioner's options; docs/slurm.md)."""

    #: the Python that runs :mod:`.slurm_job` on the nodes (the server's, on a shared path)
    python: str = sys.executable
    #: the exchange directories' parent, ``~`` being the student's home (shared with the nodes)
    exchange_dir: str = "~/.gpu-lease/slurm-kernels"
    #: the node address kernels bind to: an IP, an interface name or pattern (``ib0``,
    #: ``eth*``) or an address pattern (``10.1.*``); "" is the node's host name's address
    bind: str = ""
    #: ``--partition`` ("" : the cluster's default)
    partition: str = ""
    #: the site's ``shard`` GRES per GPU: 0 asks for none, N asks ``ceil(fraction x N)``
    shards_per_gpu: int = 0
    #: more ``sbatch`` options (``--account``, ``--time``, ``--mem``, ``--cpus-per-task``)
    sbatch_args: tuple[str, ...] = ()
    #: the kernel's PATH on the node
    path: str = ""
    #: seconds from the submission to the kernel's ports (a pending job counts)
    launch_timeout: float = 120.0
    #: seconds the kernel may take to listen once its job runs
    ready_timeout: float = 60.0
    #: more environment for Slurm's commands (``SLURM_CONF``)
    slurm_env: Mapping[str, str] = field(default_factory=dict)

    def kernel_path(self) -> str:
        return self.path or os.pathsep.join(
            [str(Path(self.python).parent), "/usr/local/bin", "/usr/bin", "/bin"]
        )


def exchange_directory(settings: SlurmSettings, account: pwd.struct_passwd, kernel_id: str) -> Path:
    """The kernel's exchange directory: ``exchange_dir`` in ``account``'s home."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", kernel_id) or kernel_id.startswith("."):
        raise InvalidRequest(f"Kernel id {kernel_id!r} cannot name a directory; use a UUID.")
    base = settings.exchange_dir.replace("{user}", account.pw_name)
    if base == "~" or base.startswith("~/"):
        base = account.pw_dir + base[1:]
    return Path(base) / kernel_id


def shard_count(fraction: float | None, shards_per_gpu: int) -> int:
    """The ``shard`` GRES a lease of ``fraction`` asks for (0: none)."""
    if shards_per_gpu <= 0 or fraction is None:
        return 0
    return max(1, min(shards_per_gpu, math.ceil(fraction * shards_per_gpu - 1e-9)))


def sbatch_argv(
    settings: SlurmSettings, *, kernel_id: str, node: str, fraction: float | None, directory: Path
) -> list[str]:
    """The ``sbatch`` command line of one kernel's job (no secret in it)."""
    argv = [
        "sbatch",
        "--parsable",
        f"--job-name=gpu-kernel-{kernel_id[:8]}",
        f"--nodelist={node}",
        "--nodes=1",
        "--ntasks=1",
        "--export=NONE",
        f"--chdir={directory}",
        f"--output={directory / STDOUT}",
        f"--error={directory / STDERR}",
    ]
    if settings.partition:
        argv.append(f"--partition={settings.partition}")
    shards = shard_count(fraction, settings.shards_per_gpu)
    if shards:
        argv.append(f"--gres=shard:{shards}")
    argv += list(settings.sbatch_args)
    runner = [settings.python, "-m", "provisioner.kernel.slurm_job", str(directory)]
    argv.append("--wrap=exec " + shlex.join(runner))
    return argv


def submit_prefix(user: str | None) -> list[str]:
    """``sudo -E -u USER`` when this process must submit as another account (a root server),
    else nothing: ``sbatch`` runs as the current user."""
    if user is None or user == pwd.getpwuid(os.getuid()).pw_name:
        return []
    return ["sudo", "-E", "-u", user]


def command_env(settings: SlurmSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of Slurm's commands: this process's, without the variables that a
    server's own job would steer ``sbatch`` with (``SLURM_CONF`` stays), plus the site's."""
    env = {k: v for k, v in environ.items() if not _STEERING.match(k) or k == "SLURM_CONF"}
    env.update(settings.slurm_env)
    return env


def exit_code_of(job_state: str, exit_code: str) -> int:
    """A finished job's kernel exit code from ``scontrol``'s ``JobState`` and ``ExitCode``
    (``code:signal``): -N for a signal, the code, else -SIGKILL for a cancelled job."""
    code, _, sig = exit_code.partition(":")
    if sig.isdigit() and int(sig):
        return -int(sig)
    if job_state.startswith("CANCELLED"):
        return -int(signal.SIGKILL)
    if code.isdigit():
        return int(code) if int(code) or job_state == "COMPLETED" else 1
    return 1


def _write_private(path: Path, data: Mapping[str, Any], account: pwd.struct_passwd) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    _own(path, account)


def _own(path: Path, account: pwd.struct_passwd) -> None:
    if os.geteuid() == 0 and account.pw_uid != 0:
        os.chown(path, account.pw_uid, account.pw_gid)


def _private_dirs(directory: Path, account: pwd.struct_passwd) -> None:
    """``directory`` and its missing parents, 0700 and the account's."""
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        d.mkdir(mode=0o700)
        _own(d, account)


class SlurmLauncher(Configurable):
    """The site's settings of Slurm kernels, as the server's configuration sets them
    (``c.SlurmLauncher.bind = "ib0"`` in ``jupyter_server_config.py``, or the server's
    command line): each trait is one :class:`SlurmSettings` field (docs/slurm.md)."""

    python = Unicode(
        sys.executable,
        help="The Python that runs the job's runner on the nodes (the server's environment, "
        "at the same path on every node). Default: this server's.",
    ).tag(config=True)
    exchange_dir = Unicode(
        SlurmSettings.exchange_dir,
        help="Where each kernel's exchange directory goes, '~' being the student's home, "
        "which the server's host and the nodes must share; may name {user}.",
    ).tag(config=True)
    bind = Unicode(
        "",
        help="The node address kernels bind to: an IP, an interface name or pattern (ib0, "
        "eth*) or an address pattern (10.1.*); empty: the node's host name's address.",
    ).tag(config=True)
    partition = Unicode("", help="sbatch --partition (empty: the default).").tag(config=True)
    shards_per_gpu = Integer(
        0,
        min=0,
        help="The site's shard GRES per GPU: a lease of fraction f asks "
        "--gres=shard:ceil(f x N). 0 (default): no GRES.",
    ).tag(config=True)
    sbatch_args = List(
        Unicode(), help="More sbatch options (--account, --time, --mem, --cpus-per-task)."
    ).tag(config=True)
    path = Unicode("", help="The kernel's PATH on the node (empty: python's bin first).").tag(
        config=True
    )
    ready_timeout = Float(
        SlurmSettings.ready_timeout,
        min=1.0,
        help="Seconds the kernel may take to listen once its job runs.",
    ).tag(config=True)
    slurm_conf = Unicode("", help="SLURM_CONF for sbatch, squeue and scancel (empty: theirs).").tag(
        config=True
    )

    def settings(self, launch_timeout: float = SlurmSettings.launch_timeout) -> SlurmSettings:
        return SlurmSettings(
            python=self.python,
            exchange_dir=self.exchange_dir,
            bind=self.bind,
            partition=self.partition,
            shards_per_gpu=self.shards_per_gpu,
            sbatch_args=tuple(self.sbatch_args),
            path=self.path,
            launch_timeout=launch_timeout,
            ready_timeout=self.ready_timeout,
            slurm_env={"SLURM_CONF": self.slurm_conf} if self.slurm_conf else {},
        )


class SlurmKernel:
    """One kernel as a Slurm job (see the module docstring); a ``RemoteKernel``."""

    @classmethod
    def for_provisioner(cls, provisioner: Any) -> SlurmKernel:
        """The provisioner's Slurm kernel: :class:`SlurmLauncher`'s settings from the
        server's configuration, the provisioner's ``launch_timeout``. It submits as this
        process's user, or, where this process is root, as the lease's user."""
        launcher = SlurmLauncher(parent=provisioner)
        timeout = float(getattr(provisioner, "launch_timeout", SlurmSettings.launch_timeout))
        return cls(launcher.settings(timeout))

    def __init__(self, settings: SlurmSettings, *, user: str | None = None) -> None:
        self.settings = settings
        #: the account that submits (None: this process's own)
        self.user = user
        self.job_id = ""
        self.directory: Path | None = None
        self.node = ""
        self._exit: int | None = None

    # -- the commands --------------------------------------------------------------------

    async def _command(self, argv: Sequence[str], timeout: float = 30.0) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=command_env(self.settings, os.environ),
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return 124, "", f"{argv[0]} did not answer within {timeout:.0f} s"
        code = proc.returncode if proc.returncode is not None else 1
        return code, out.decode(errors="replace"), err.decode(errors="replace")

    async def _queue_state(self) -> tuple[str, str] | None:
        """The job's (state, reason) while ``squeue`` lists it, else None; ``UNKNOWN``
        when ``squeue`` itself failed (a controller too busy to answer is no job's end)."""
        code, out, err = await self._command(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"])
        if code != 0 and "Invalid job id" not in err:
            return UNKNOWN, err.strip()[:200]
        line = out.strip().splitlines()[0] if code == 0 and out.strip() else ""
        if not line:
            return None
        state, _, reason = line.partition("|")
        return state.strip(), reason.strip()

    async def _finished_state(self) -> dict[str, str]:
        """``scontrol show job``'s fields of the finished job (empty once Slurm forgot it)."""
        code, out, _ = await self._command(["scontrol", "show", "job", "-o", self.job_id])
        if code != 0:
            return {}
        fields = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def _read(self, name: str) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        try:
            data = json.loads((self.directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def stderr_tail(self) -> str:
        """The end of the job's stderr (what the kernel and the runner said)."""
        if self.directory is None:
            return ""
        try:
            text = (self.directory / STDERR).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return text[-STDERR_TAIL:].strip()

    def _failure(self, what: str) -> KernelLaunchFailed:
        tail = self.stderr_tail().replace(f"gpu-lease: {what}", "").strip()
        said = f"{what} The job's stderr ends: {tail}" if tail else what
        return KernelLaunchFailed(said, node=self.node, job_id=self.job_id)

    # -- RemoteKernel --------------------------------------------------------------------

    async def launch(self, job: LaunchJob) -> Launched:
        node = job.lease.gpu.node
        if not node:
            raise InvalidRequest(
                f"Lease {job.lease.id} names no node; a Slurm kernel runs on its lease's node."
            )
        self.node = node
        if self.user is None and os.geteuid() == 0 and job.lease.user not in (None, "root"):
            self.user = job.lease.user  # a root server submits as the lease's student
        name = self.user or pwd.getpwuid(os.getuid()).pw_name
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            raise KernelLaunchFailed(
                f"{name} has no Unix account here; a Slurm kernel runs as the student's own "
                "account, which must exist on the server's host and on every node."
            ) from None
        directory = exchange_directory(self.settings, account, job.kernel_id)
        self.directory = directory
        # a restart keeps the kernel id: what the ended job left there is not this job's
        shutil.rmtree(directory, ignore_errors=True)
        _private_dirs(directory, account)
        _write_private(
            directory / JOB_FILE,
            {
                "kernel_id": job.kernel_id,
                "argv": list(job.argv),
                "env": dict(job.env),
                "cwd": job.cwd,
                "bind": self.settings.bind,
                "path": self.settings.kernel_path(),
                "ready_timeout": self.settings.ready_timeout,
            },
            account,
        )
        _write_private(
            directory / CONNECTION,
            {
                "ip": "",
                "transport": "tcp",
                "key": job.key,
                "signature_scheme": job.signature_scheme,
                "kernel_name": "",
                **dict.fromkeys(PORTS, 0),
            },
            account,
        )
        argv = sbatch_argv(
            self.settings,
            kernel_id=job.kernel_id,
            node=node,
            fraction=job.lease.fraction,
            directory=directory,
        )
        code, out, err = await self._command([*submit_prefix(self.user), *argv])
        if code != 0 or not out.strip():
            self.cleanup()
            raise KernelLaunchFailed(
                f"Slurm refused the kernel's job on node {node}: "
                f"{err.strip() or out.strip() or f'sbatch exited {code}'}",
                node=node,
            )
        self.job_id = out.strip().split(";")[0]
        try:
            return await self._until_listening()
        except BaseException as exc:
            # the key's file goes whatever happened (the runner removes it itself, but a
            # job that never ran cannot); a launch given up (cancelled) takes its job along
            (directory / CONNECTION).unlink(missing_ok=True)
            if not isinstance(exc, KernelLaunchFailed):
                await asyncio.shield(self._command(["scancel", self.job_id]))
            raise

    async def _until_listening(self) -> Launched:
        deadline = time.monotonic() + self.settings.launch_timeout
        next_check = time.monotonic() + 0.2
        last: tuple[str, str] | None = ("PENDING", "")
        while True:
            answer = self._read(LAUNCHED)
            if answer is not None:
                break
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                last = await self._queue_state()
                answer = self._read(LAUNCHED)
                if answer is not None:
                    break
                if last is None or last[0] not in ALIVE_STATES:
                    raise self._failure(await self._ended_before_listening(last))
                if last[0] == "PENDING" and HOPELESS_REASONS.match(last[1]):
                    await self._command(["scancel", self.job_id])
                    raise self._failure(
                        f"Slurm cannot start the kernel's job {self.job_id} on node "
                        f"{self.node}: it is pending with reason {last[1]}; the node is "
                        "down or closed to this job, so it was cancelled."
                    )
            if now > deadline:
                await self._command(["scancel", self.job_id])
                state = f"{last[0]}, reason {last[1] or 'none'}" if last else "unknown"
                raise self._failure(
                    f"The kernel's job {self.job_id} on node {self.node} did not start within "
                    f"{self.settings.launch_timeout:.0f} s (its state: {state}); it was cancelled."
                )
            await asyncio.sleep(0.02)
        if "error" in answer:
            await self._command(["scancel", self.job_id])
            raise self._failure(str(answer["error"]))
        return Launched(
            ip=str(answer["ip"]),
            ports={p: int(answer["ports"][p]) for p in PORTS},
            node=str(answer.get("node") or self.node),
            cwd=str(answer.get("cwd", "")),
            cwd_shared=bool(answer.get("cwd_shared")),
            handle=self.job_id,
            extra={
                "directory": str(self.directory),
                "pid": answer.get("pid"),
                "started_at": answer.get("started_at"),
                "listening_at": answer.get("listening_at"),
            },
        )

    async def _ended_before_listening(self, last: tuple[str, str] | None) -> str:
        fields = await self._finished_state()
        state = fields.get("JobState") or (last[0] if last else "ended")
        reason = fields.get("Reason", "None")
        code = fields.get("ExitCode", "?")
        why = f", reason {reason}" if reason and reason != "None" else ""
        return (
            f"The kernel's job {self.job_id} on node {self.node} ended ({state}{why}, "
            f"exit code {code}) before the kernel listened."
        )

    async def poll(self) -> int | None:
        if self._exit is not None:
            return self._exit
        ended = self._read(EXITED)
        if ended is not None:
            self._exit = int(ended["returncode"])
            return self._exit
        queued = await self._queue_state()
        if queued is not None and queued[0] in ALIVE_STATES and queued[0] != "COMPLETING":
            return None
        ended = self._read(EXITED)
        if ended is not None:
            self._exit = int(ended["returncode"])
            return self._exit
        if queued is not None and queued[0] == "COMPLETING":
            return None
        fields = await self._finished_state()
        self._exit = exit_code_of(fields.get("JobState", ""), fields.get("ExitCode", ""))
        return self._exit

    async def signal(self, signum: int) -> None:
        if not self.job_id:
            return
        name = signal.Signals(signum).name.removeprefix("SIG")
        await self._command(["scancel", f"--signal={name}", "--full", self.job_id])
        if signum == signal.SIGKILL:
            await self._command(["scancel", self.job_id])  # the job too, not only its step

    async def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = await self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.1)

    def cleanup(self) -> None:
        """Remove the exchange directory (its files hold no key once the kernel listens;
        before, ``kernel.json`` does)."""
        if self.directory is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.directory)

    def to_json(self) -> dict[str, Any]:
        return {
            "launcher": "slurm",
            "job_id": self.job_id,
            "directory": str(self.directory) if self.directory else None,
            "node": self.node,
            "user": self.user,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], settings: SlurmSettings) -> SlurmKernel:
        """The kernel :meth:`to_json` described, for a restarted server."""
        kernel = cls(settings, user=data.get("user"))
        kernel.job_id = str(data["job_id"])
        kernel.node = str(data.get("node") or "")
        if data.get("directory"):
            kernel.directory = Path(data["directory"])
        return kernel


__all__ = [
    "SlurmKernel",
    "SlurmLauncher",
    "SlurmSettings",
    "command_env",
    "exchange_directory",
    "exit_code_of",
    "sbatch_argv",
    "shard_count",
    "submit_prefix",
]
