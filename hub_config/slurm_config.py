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

Every server's kernels find their node in the job (``SLURMD_NODENAME``, and the GPUs Slurm
gave the job) and lease GPUs of that node only (``provisioner/kernel/placement.py``).
The servers reach the broker at ``GPU_LEASE_URL``: on a real cluster set
``GPU_LEASE_BROKER_URL`` to the hub host's broker address that the nodes can reach.
"""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path
from typing import Any

from batchspawner import SlurmSpawner  # type: ignore[import-untyped]
from traitlets import default

c: Any = get_config()  # type: ignore[name-defined]  # noqa: F821 (JupyterHub's config loader)

STATE = Path(os.environ.get("GPU_LEASE_STATE_DIR") or Path(__file__).parent.parent / ".demo")


class GPULeaseSlurmSpawner(SlurmSpawner):  # type: ignore[misc]
    """batchspawner's SlurmSpawner; a user without a Unix account (students of a test
    cluster) gets a home under the hub's state directory, and with a root hub the job is
    submitted as the hub's user (no ``sudo -u`` to an account that does not exist)."""

    def _home(self) -> str:
        home = STATE.resolve() / "home" / self.user.name
        home.mkdir(parents=True, exist_ok=True)
        return str(home)

    @default("req_homedir")
    def _homedir(self) -> str:
        try:
            return str(pwd.getpwnam(self.user.name).pw_dir)
        except KeyError:  # no Unix account (a test cluster): a home in the state directory
            return self._home()

    def user_env(self, env: dict[str, str]) -> dict[str, str]:
        """USER, HOME and SHELL for the job, from the account if there is one."""
        try:
            return dict(super().user_env(env))
        except KeyError:
            env.update(USER=self.user.name, HOME=self._home(), SHELL="/bin/bash")
            return env


c.JupyterHub.spawner_class = GPULeaseSlurmSpawner
c.SlurmSpawner.req_partition = os.environ.get("GPU_LEASE_SLURM_PARTITION") or "gpu"
c.SlurmSpawner.req_options = os.environ.get("GPU_LEASE_SLURM_OPTIONS") or ""
if os.getuid() == 0 or os.environ.get("GPU_LEASE_SLURM_SUBMIT_AS_HUB") == "1":
    c.SlurmSpawner.exec_prefix = ""
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
