"""The Slurm variant of hub_config: each student's server runs as a Slurm job (batchspawner).

Loaded by ``jupyterhub_config.py`` (after everything else) when ``GPU_LEASE_SPAWNER=slurm``;
the rest of the hub (the broker as hub service, scopes, the servers' arguments and
environment) stays as there. What an HPC site sets:

- ``SLURM_CONF`` (where ``sbatch``/``squeue`` find the cluster) in the hub's environment;
- ``GPU_LEASE_SLURM_PARTITION`` (default ``gpu``) and ``GPU_LEASE_SLURM_OPTIONS`` (more
  ``#SBATCH`` options, e.g. ``--gres=gpu:1 --time=8:00:00``);
- ``GPU_LEASE_GPUS=agents``: the broker's pool is what the node agents register (one
  ``gpu-lease agent`` per GPU node, a systemd unit; docs/admins.md), and
  ``GPU_LEASE_AGENT_TOKENS`` their tokens file;
- ``GPU_LEASE_SLURM_HOST``: the address the hub reaches the servers at when the compute
  nodes' names do not resolve on the hub's host (a one-machine test cluster: 127.0.0.1).

The hub runs as root and submits each job as the student's own Unix account (batchspawner's
``exec_prefix``, ``sudo -E -u USER``: ``sbatch``, ``squeue`` and ``scancel`` run as the
user), so the job, its server and its kernels run as that account; each server's runtime
and temporary directories are the account's, 0700 (``jupyterhub_config.py``,
``_private_dirs``). ``GPU_LEASE_SLURM_SUBMIT_AS_HUB=1`` instead submits every job as the
hub's own user: only for a test cluster whose students have no accounts (the benchmark's).

Every server's kernels find their node in the job (``SLURMD_NODENAME``, and the GPUs Slurm
gave the job) and lease GPUs of that node only (``provisioner/kernel/placement.py``).
The servers reach the broker at ``GPU_LEASE_URL``: on a real cluster set
``GPU_LEASE_BROKER_URL`` to the hub host's broker address that the nodes can reach.
"""

from __future__ import annotations

import os
import pwd
import shlex
import sys
from pathlib import Path
from typing import Any

from batchspawner import SlurmSpawner  # type: ignore[import-untyped]
from traitlets import default

c: Any = get_config()  # type: ignore[name-defined]  # noqa: F821 (JupyterHub's config loader)

STATE = Path(os.environ.get("GPU_LEASE_STATE_DIR") or Path(__file__).parent.parent / ".demo")
#: every job as the hub's own user (a test cluster whose students have no Unix accounts)
SUBMIT_AS_HUB = os.environ.get("GPU_LEASE_SLURM_SUBMIT_AS_HUB") == "1"
#: what ``sudo`` (Debian's sudoers: ``secure_path``, and its list of unsafe variables)
#: resets or drops even with ``-E``; the job script sets them back to the hub's values
SUDO_RESETS = ("PATH", "PYTHONPATH")


class GPULeaseSlurmSpawner(SlurmSpawner):  # type: ignore[misc]
    """batchspawner's SlurmSpawner, each job submitted as its user (``sudo -E -u USER``);
    with ``SUBMIT_AS_HUB``, as the hub's user, and a user without a Unix account (students
    of a test cluster) gets a home under the hub's state directory."""

    def _home(self) -> str:
        home = STATE.resolve() / "home" / self.user.name
        home.mkdir(parents=True, exist_ok=True)
        return str(home)

    @default("req_homedir")
    def _homedir(self) -> str:
        try:
            return str(pwd.getpwnam(self.user.name).pw_dir)
        except KeyError:  # no Unix account (a test cluster): a home in the state directory
            if not SUBMIT_AS_HUB:
                raise
            return self._home()

    def user_env(self, env: dict[str, str]) -> dict[str, str]:
        """USER, HOME and SHELL for the job, from the account if there is one."""
        try:
            return dict(super().user_env(env))
        except KeyError:
            if not SUBMIT_AS_HUB:
                raise
            env.update(USER=self.user.name, HOME=self._home(), SHELL="/bin/bash")
            return env

    @default("req_prologue")
    def _prologue(self) -> str:
        """With ``sudo``: the hub's ``PATH`` and ``PYTHONPATH`` for the job, as a server
        started by the hub itself gets them (sudo resets the one, drops the other)."""
        if SUBMIT_AS_HUB:
            return ""
        env = self.get_env()
        return "\n".join(f"export {k}={shlex.quote(env[k])}" for k in SUDO_RESETS if env.get(k))


c.JupyterHub.spawner_class = GPULeaseSlurmSpawner
c.SlurmSpawner.req_partition = os.environ.get("GPU_LEASE_SLURM_PARTITION") or "gpu"
c.SlurmSpawner.req_options = os.environ.get("GPU_LEASE_SLURM_OPTIONS") or ""
if SUBMIT_AS_HUB:
    c.SlurmSpawner.exec_prefix = ""
# else batchspawner's default, "sudo -E -u {username}": the hub (root) submits as the user
if os.environ.get("GPU_LEASE_SLURM_HOST"):
    c.SlurmSpawner.state_exechost_exp = os.environ["GPU_LEASE_SLURM_HOST"]
BIN = Path(sys.executable).parent  # the hub's environment, installed on every node alike
c.SlurmSpawner.batchspawner_singleuser_cmd = str(BIN / "batchspawner-singleuser")
# batchspawner-singleuser runs the next word as a Python script, in its own process
c.Spawner.cmd = [str(BIN / "jupyterhub-singleuser")]
# the job reports its port to the hub; the hub waits for the queue as well as the start
c.SlurmSpawner.start_timeout = int(os.environ.get("GPU_LEASE_SPAWN_TIMEOUT") or 300)
c.SlurmSpawner.startup_poll_interval = 0.5
# batchspawner runs sbatch/squeue/scancel with the user's environment, not the hub's
if os.environ.get("SLURM_CONF"):
    c.Spawner.environment.update({"SLURM_CONF": os.environ["SLURM_CONF"]})  # merged
if os.environ.get("GPU_LEASE_BROKER_URL"):
    c.Spawner.environment.update({"GPU_LEASE_URL": os.environ["GPU_LEASE_BROKER_URL"]})
