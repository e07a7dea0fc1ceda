"""Remote GPU kernels: the kernel runs on the node its lease names, not beside its server.

The provisioner acquires first (the broker places the lease on any node of the pool),
then a *launcher* starts the kernel on the lease's node and answers where it listens;
the server then speaks ZMQ to it as to a local kernel (the HMAC key is the kernel
manager's own, per kernel). The provisioner's ``launcher`` setting chooses how:

- ``local`` (the default): beside the server (``LocalProvisioner``), as always;
- ``node``: the lease's node agent launches it (:class:`~.node_kernel.NodeKernel`: the
  order goes through the broker, which checks that the asker holds the lease and that
  the lease is on that node; the node opens no listener that takes launches);
- ``slurm``: a Slurm job on the lease's node, submitted as the student (``slurm_kernel``).

Each launcher is a :class:`RemoteKernel`: this module holds what they share, the job
(:class:`LaunchJob`), the answer (:class:`Launched`) and which of the server's
environment goes with the kernel (:func:`remote_environment`: the kernelspec's and the
lease's, never the server's tokens).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..client.answers import GrantedLease
from ..wire import KERNEL_CHANNELS
from .kernelspecs import LAUNCHERS

#: the provisioner's ``launcher`` values
LOCAL, NODE, SLURM = LAUNCHERS
assert LOCAL == "local" and NODE == "node" and SLURM == "slurm"

#: where the node's connection file goes in a remote kernel's argv
CONNECTION_FILE = "{connection_file}"

#: the server's environment variables a remote kernel gets (besides the kernelspec's
#: ``env`` and the lease's): locale and time zone; never tokens, paths or the server's
#: own JupyterHub variables (the node has its own PATH, HOME and accounts)
PASSED_THROUGH = re.compile(r"^(LANG|LANGUAGE|LC_[A-Z]+|TZ|JPY_SESSION_NAME)$")

#: the ZMQ channels of a kernel, as a connection file names their ports
CHANNELS = KERNEL_CHANNELS


@dataclass(frozen=True)
class LaunchJob:
    """One kernel to start on the lease's node."""

    kernel_id: str
    lease: GrantedLease
    #: the kernel's argv, with :data:`CONNECTION_FILE` where the node's connection file goes
    argv: tuple[str, ...]
    #: what the kernel gets on top of the node's own login environment (HOME, USER, PATH)
    env: Mapping[str, str]
    #: the notebook's directory on the server (the node uses it where the home is shared)
    cwd: str | None
    #: the HMAC key (the kernel manager's session key) and its scheme
    key: str
    signature_scheme: str = "hmac-sha256"


@dataclass(frozen=True)
class Launched:
    """Where a remote kernel listens, and where it runs."""

    ip: str
    ports: Mapping[str, int]
    node: str
    #: the kernel's working directory on the node, and whether it is the notebook's own
    cwd: str = ""
    cwd_shared: bool = False
    #: what the launcher knows it by (the agent's generation, the Slurm job id)
    handle: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def connection_info(self, key: str, signature_scheme: str) -> dict[str, Any]:
        """The connection info jupyter_client's ``KernelManager`` takes from
        ``launch_kernel`` (it writes the server's connection file from it)."""
        info: dict[str, Any] = {name: int(self.ports[name]) for name in CHANNELS}
        info.update(
            ip=self.ip,
            transport="tcp",
            key=key.encode(),
            signature_scheme=signature_scheme,
            kernel_name="",
        )
        return info


class RemoteKernel(Protocol):
    """A kernel that runs elsewhere, as the provisioner's process hooks see it."""

    async def launch(self, job: LaunchJob) -> Launched:
        """Start the kernel; raises a :class:`~provisioner.errors.GPULeaseError` whose
        sentence is the node's reason when it cannot."""
        ...

    async def poll(self) -> int | None:
        """None while the kernel runs, else its exit code (-N: ended by signal N)."""
        ...

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the kernel's process group."""
        ...

    async def wait(self, timeout: float | None = None) -> int | None:
        """Until the kernel ended (its exit code), or ``timeout`` s passed (None)."""
        ...

    def to_json(self) -> dict[str, Any]:
        """What a restarted server needs to take the kernel back."""
        ...


def remote_environment(
    server_env: Mapping[str, str], spec_env: Mapping[str, str], lease_env: Mapping[str, str]
) -> dict[str, str]:
    """The environment a remote kernel gets from the server: the locale and time zone of
    the server (:data:`PASSED_THROUGH`), the kernelspec's ``env`` and the lease's (the
    caps, the GPU, the state file). Nothing else: the server's tokens
    (``JUPYTERHUB_API_TOKEN``, ``GPU_LEASE_TOKEN``) and paths stay on the server."""
    env = {k: v for k, v in server_env.items() if PASSED_THROUGH.match(k)}
    env.update(spec_env)
    env.update(lease_env)
    return env


def node_argv(argv: list[str], connection_file: str) -> tuple[str, ...]:
    """The kernel's argv as the server formatted it, with the server's connection file
    replaced by :data:`CONNECTION_FILE` (the node writes its own)."""
    return tuple(CONNECTION_FILE if a == connection_file else a for a in argv)


__all__ = [
    "CHANNELS",
    "CONNECTION_FILE",
    "LAUNCHERS",
    "LOCAL",
    "NODE",
    "SLURM",
    "LaunchJob",
    "Launched",
    "RemoteKernel",
    "node_argv",
    "remote_environment",
]
