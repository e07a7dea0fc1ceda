"""A real Slurm cluster on this machine: ``slurmctld`` and one ``slurmd -N NODE`` per node.

For the Slurm variant's tests and benchmarks (Debian's ``slurm-wlm``, which ``make install``
installs). Every daemon listens on loopback on a free port, with ``AuthType=auth/none``
(no munge), its state, spool, logs and pid files in one temporary directory, and runs as
this user; jobs run as the user who submits them (``slurmd``, as root, becomes the
submitter's uid: the hub's ``sudo -u STUDENT sbatch`` makes the job the student's; the
students must then read ``slurm.conf``, which is 0644 in a directory they can pass). A job takes one CPU, so each node runs
``cpus`` jobs at once (``oversubscribe``: Slurm's ``OverSubscribe`` of the partition).
Nodes are all ``127.0.0.1``, so the hub reaches a job's server at 127.0.0.1
(``GPU_LEASE_SLURM_HOST``). Use::

    cluster = SlurmCluster(tmp)
    cluster.start()            # returns once every node is idle
    env = cluster.env()        # SLURM_CONF for sbatch, squeue, the hub
    cluster.kill_node("node2") # as a host that died: its slurmd and its jobs' processes
    cluster.stop()             # cancels every job, stops every daemon

Nothing in the runtime imports this module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import psutil

from .testing import ROOT, free_port, stop_process, wait_for, write_private

SLURMCTLD = "slurmctld"
SLURMD = "slurmd"


def available() -> str | None:
    """None when ``slurmctld`` and ``slurmd`` are installed, else why not."""
    missing = [p for p in (SLURMCTLD, SLURMD, "sbatch", "squeue") if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (make install installs Debian's slurm-wlm)"
    return None


class SlurmCluster:
    """slurmctld and one slurmd per node in ``tmp``; see the module docstring."""

    def __init__(
        self,
        tmp: Path,
        nodes: Sequence[str] = ("node1", "node2"),
        *,
        cpus: int = 2,
        partition: str = "gpu",
        oversubscribe: str = "NO",
    ) -> None:
        self.dir = tmp
        self.nodes = list(nodes)
        self.partition = partition
        self.conf = tmp / "slurm.conf"
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in self.nodes}
        self.ctld: subprocess.Popen[bytes] | None = None
        self.slurmds: dict[str, subprocess.Popen[bytes]] = {}
        node_lines = [
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={self.node_ports[n]} "
            f"CPUs={cpus} RealMemory=1000 State=UNKNOWN"
            for n in self.nodes
        ]
        (tmp / "state").mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=gpulease",
                    "SlurmctldHost=localhost(127.0.0.1)",
                    f"SlurmctldPort={self.ctld_port}",
                    "AuthType=auth/none",
                    "CredType=cred/none",
                    f"SlurmUser={_user()}",
                    f"StateSaveLocation={tmp / 'state'}",
                    f"SlurmdSpoolDir={tmp / 'spool-%n'}",
                    f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
                    f"SlurmdPidFile={tmp / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={tmp / 'slurmctld.log'}",
                    f"SlurmdLogFile={tmp / 'slurmd-%n.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmdTimeout=30",
                    "KillWait=10",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    *node_lines,
                    f"PartitionName={partition} Nodes={','.join(self.nodes)} Default=YES "
                    f"MaxTime=INFINITE State=UP OverSubscribe={oversubscribe}",
                    "",
                ]
            )
        )

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def hub_env(self, agent_tokens: Path, *, submit_as_hub: bool = False) -> dict[str, str]:
        """The environment of a hub_config hub in its Slurm variant on this cluster, its
        broker taking the agents' tokens from ``agent_tokens`` (see :func:`agent_tokens`).
        The hub submits each job as its student's account (``sudo -u``), or, with
        ``submit_as_hub`` (students without Unix accounts), as the hub's own user."""
        env = {
            **self.env(),
            "GPU_LEASE_SPAWNER": "slurm",
            "GPU_LEASE_SLURM_HOST": "127.0.0.1",  # the nodes are this machine
            "GPU_LEASE_SLURM_PARTITION": self.partition,
            "GPU_LEASE_AGENT_TOKENS": str(agent_tokens),
        }
        if submit_as_hub:
            env["GPU_LEASE_SLURM_SUBMIT_AS_HUB"] = "1"
        return env

    def _run(self, *cmd: str, timeout: float = 30.0) -> str:
        done = subprocess.run(
            cmd,
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return done.stdout if done.returncode == 0 else ""

    def states(self) -> dict[str, str]:
        """node -> its state as ``sinfo`` says it (idle, mixed, down*, ...)."""
        out = self._run("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def queued_users(self) -> set[str]:
        """The users of the jobs ``squeue`` lists (pending or running)."""
        return set(self._run("squeue", "-h", "-o", "%u").split())

    def start(self, timeout: float = 60.0) -> None:
        env = {**os.environ, **self.env()}
        with open(self.dir / "slurmctld.out", "wb") as out:
            self.ctld = subprocess.Popen(
                [SLURMCTLD, "-D", "-c", "-f", str(self.conf)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
            )
        wait_for(lambda: "UP" in self._run("scontrol", "ping"), timeout, "slurmctld", 0.2, self.log)
        for node in self.nodes:
            self.start_node(node)
        wait_for(
            lambda: all(self.states().get(n) == "idle" for n in self.nodes),
            timeout,
            "every node idle",
            0.2,
            self.log,
        )

    def start_node(self, node: str) -> None:
        with open(self.dir / f"slurmd-{node}.out", "wb") as out:
            self.slurmds[node] = subprocess.Popen(
                [SLURMD, "-D", "-N", node, "-f", str(self.conf)],
                env={**os.environ, **self.env()},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
            )

    def jobs_on(self, node: str) -> list[psutil.Process]:
        """The processes of the jobs running on ``node`` (their environment names it)."""
        out = []
        for p in psutil.process_iter():
            try:
                environ = p.environ()
            except psutil.Error:
                continue
            if environ.get("SLURMD_NODENAME") == node and environ.get("SLURM_CONF") == str(
                self.conf
            ):
                out.append(p)
        return out

    def kill_node(self, node: str) -> None:
        """SIGKILL ``node``'s slurmd and every process of its jobs, as a host that died."""
        daemon = self.slurmds.pop(node, None)
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        for p in self.jobs_on(node):
            try:
                p.kill()
            except psutil.Error:
                pass

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (and kill what is left of the jobs)."""
        if self.ctld is not None and self.ctld.poll() is None:
            self._run("scancel", "--partition", self.partition)
            try:
                wait_for(lambda: not self._run("squeue", "-h", "-o", "%i").strip(), 30, "", 0.2)
            except AssertionError:
                pass  # their processes are killed below
        for node in list(self.slurmds):
            stop_process(self.slurmds.pop(node))
        for node in self.nodes:
            for p in self.jobs_on(node):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        if self.ctld is not None:
            stop_process(self.ctld)

    def log(self) -> str:
        parts = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in self.nodes)):
            path = self.dir / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(parts)


def agent_tokens(path: Path, nodes: Sequence[str]) -> dict[str, str]:
    """A fresh agent token per node, written to ``path`` as the broker reads them
    (``{"TOKEN": {"agent": true, "node": NODE}}``); returns node -> token."""
    tokens = {n: f"agent-{n}-{uuid.uuid4().hex}" for n in nodes}
    write_private(path, json.dumps({t: {"agent": True, "node": n} for n, t in tokens.items()}))
    return tokens


def start_agent(
    broker_url: str, node: str, token: str, gpus: str, log: Path, interval: float = 0.5
) -> subprocess.Popen[bytes]:
    """``python -m provisioner.node.agent`` for ``node`` declaring ``gpus``, logging to ``log``."""
    env = {**os.environ, "GPU_LEASE_AGENT_TOKEN": token}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "provisioner.node.agent", "--broker-url", broker_url,
                "--node", node, "--gpus", gpus, "--interval", str(interval),
            ],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


__all__ = ["SlurmCluster", "agent_tokens", "available", "start_agent"]
