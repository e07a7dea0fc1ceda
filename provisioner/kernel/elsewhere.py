"""The provisioner's hooks for a kernel that runs on its lease's node (``launcher`` other
than ``local``): what ``GPULeaseProvisioner`` does instead of ``LocalProvisioner``.

- ``pre_launch``: the command is formatted as jupyter_client does (``{connection_file}``
  is the server's file, replaced by the node's), no local ports are taken, and the
  environment that goes to the node is chosen (:func:`~.remote.remote_environment`: the
  kernelspec's, the lease's caps and kernel secret, the ``%gpu`` state; never the server's
  tokens);
- ``launch_kernel``: the launcher starts it (:class:`~.remote.RemoteKernel`) and its
  address and ports become the kernel manager's connection info (its own HMAC key);
- ``poll``/``send_signal``/``kill``/``terminate``/``wait``: through the launcher.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from jupyter_client.provisioning import KernelProvisionerBase, LocalProvisioner
from traitlets import Enum, Float, default

from ..client.answers import GrantedLease
from ..errors import InvalidRequest
from .broker_clients import BrokerClients
from .node_kernel import LAUNCH_TIMEOUT, AgentKernel
from .remote import (
    LAUNCHERS,
    LOCAL,
    NODE,
    Launched,
    LaunchJob,
    RemoteKernel,
    node_argv,
    remote_environment,
)

#: the server's environment variable that sets the default launcher (a site setting)
LAUNCHER_ENV = "GPU_LEASE_LAUNCHER"
#: what the lease environment sets that means nothing on another node (the node sets it)
SERVER_ONLY = ("GPU_LEASE_STATE_FILE",)


class Elsewhere:
    """One provisioner's remote kernel: the job it sends and what came back."""

    def __init__(self, kernel: RemoteKernel) -> None:
        self.kernel = kernel
        self.env: dict[str, str] = {}
        self.launched: Launched | None = None

    @staticmethod
    def command(km: Any, spec_argv: list[str], kwargs: dict[str, Any]) -> list[str]:
        """The kernel's argv as jupyter_client formats it (without taking local ports or
        writing the server's connection file: the kernel manager writes it from the
        node's answer)."""
        extra = kwargs.pop("extra_arguments", [])
        if km is not None:
            if not km.connection_file:  # a manager of its own (a MultiKernelManager names it)
                from jupyter_core.paths import jupyter_runtime_dir

                name = f"kernel-{km.kernel_id or os.getpid()}.json"
                km.connection_file = os.path.join(jupyter_runtime_dir(), name)
            return list(km.format_kernel_cmd(extra_arguments=extra))
        return [*spec_argv, *extra]

    def prepare(
        self,
        server_env: Mapping[str, str],
        spec_env: Mapping[str, str],
        lease_env: Mapping[str, str],
        state: str | None,
    ) -> None:
        """Choose what goes to the node: ``state`` is the ``%gpu`` state file's content."""
        env = remote_environment(server_env, spec_env, lease_env)
        for name in SERVER_ONLY:
            env.pop(name, None)
        if state is not None:
            env["GPU_LEASE_STATE_JSON"] = state
        self.env = env

    async def launch(
        self, km: Any, kernel_id: str, lease: GrantedLease, cmd: list[str], cwd: str | None
    ) -> dict[str, Any]:
        """Start the kernel on the lease's node; the connection info for ``km``."""
        if km is None or getattr(km, "session", None) is None:
            raise InvalidRequest("A remote kernel needs a kernel manager (its session key).")
        key = km.session.key
        key_text = key.decode() if isinstance(key, bytes) else str(key)
        if len(key_text) < 16:  # jupyter_client's default is a uuid4: 36 characters
            raise InvalidRequest(
                "A remote kernel needs an HMAC key of 16 characters or more; the kernel "
                "manager's session has a shorter one (Session.key)."
            )
        scheme = str(getattr(km.session, "signature_scheme", "hmac-sha256"))
        job = LaunchJob(
            kernel_id=kernel_id,
            lease=lease,
            argv=node_argv(cmd, str(getattr(km, "connection_file", ""))),
            env=self.env,
            cwd=cwd,
            key=key_text,
            signature_scheme=scheme,
        )
        self.launched = await self.kernel.launch(job)
        info = self.launched.connection_info(key_text, scheme)
        info["kernel_name"] = str(getattr(km, "kernel_name", "") or "")
        return info

    @property
    def pid(self) -> int | None:
        """The kernel's pid on its node (what renewals claim; the node's agent proves it)."""
        value = self.launched.extra.get("pid") if self.launched is not None else None
        return value if isinstance(value, int) else None

    @property
    def pid_ns(self) -> int | None:
        value = self.launched.extra.get("pid_ns") if self.launched is not None else None
        return value if isinstance(value, int) else None

    @property
    def cgroup(self) -> str | None:
        value = self.launched.extra.get("cgroup") if self.launched is not None else None
        return value if isinstance(value, str) else None

    async def poll(self) -> int | None:
        return await self.kernel.poll() if self.launched is not None else 0

    async def send_signal(self, signum: int) -> None:
        if self.launched is not None:
            await self.kernel.signal(signum)

    async def kill(self) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self) -> None:
        await self.send_signal(signal.SIGTERM)

    async def wait(self) -> int | None:
        if self.launched is None:
            return 0
        code = await self.kernel.wait()
        self.launched = None
        return code


class RemoteCapable(LocalProvisioner):
    """``LocalProvisioner`` whose process hooks go through :class:`Elsewhere` when the
    ``launcher`` setting is not ``local`` (the base of ``GPULeaseProvisioner``)."""

    launcher = Enum(
        list(LAUNCHERS),
        default_value=LOCAL,
        help="Where the kernel runs: 'local' (beside this server), 'node' (on the "
        "node its lease names, launched by that node's agent: remote kernels; the lease "
        "may then be on any node of the pool), 'slurm' (a Slurm job on the lease's node, "
        "submitted as the student). Default: $GPU_LEASE_LAUNCHER, else 'local'. See "
        "docs/admins.md, 'Remote kernels'.",
    ).tag(config=True)

    @default("launcher")
    def _default_launcher(self) -> str:
        """``GPU_LEASE_LAUNCHER`` in the server's environment (a site's setting, which a
        hub passes to every server); else ``local``."""
        value = os.environ.get(LAUNCHER_ENV, "").strip().lower()
        return value if value in LAUNCHERS else LOCAL

    launch_timeout = Float(
        LAUNCH_TIMEOUT,
        min=1.0,
        help="With a remote launcher: seconds the lease's node has to start the kernel "
        f"before the start fails with its reason. Default: {LAUNCH_TIMEOUT:g}.",
    ).tag(config=True)

    #: the remote kernel's half (``launcher`` other than local), made at the first start
    elsewhere: Elsewhere | None = None
    _clients: BrokerClients

    def _remote(self) -> Elsewhere | None:
        """The remote half for ``launcher`` (None: local), made once."""
        if self.launcher == LOCAL:
            return None
        if self.elsewhere is None:
            if self.launcher == NODE:
                kernel: RemoteKernel = AgentKernel(self._clients, self.launch_timeout)
            else:  # slurm
                from .slurm_kernel import SlurmKernel

                kernel = SlurmKernel.for_provisioner(self)
            self.elsewhere = Elsewhere(kernel)
        return self.elsewhere

    # -- the process hooks: a remote kernel's go through its launcher ---------------------
    @property
    def has_process(self) -> bool:
        if self.launcher != LOCAL:
            return self.elsewhere is not None and self.elsewhere.launched is not None
        return LocalProvisioner.has_process.fget(self)  # type: ignore[attr-defined]

    async def poll(self) -> int | None:
        if self.launcher != LOCAL and self.elsewhere is not None:
            return await self.elsewhere.poll()
        return await super().poll()

    async def wait(self) -> int | None:
        if self.launcher != LOCAL and self.elsewhere is not None:
            return await self.elsewhere.wait()
        return await super().wait()

    async def send_signal(self, signum: int) -> None:
        if self.launcher != LOCAL and self.elsewhere is not None:
            return await self.elsewhere.send_signal(signum)
        return await super().send_signal(signum)

    async def kill(self, restart: bool = False) -> None:
        if self.launcher != LOCAL and self.elsewhere is not None:
            return await self.elsewhere.kill()
        return await super().kill(restart)

    async def terminate(self, restart: bool = False) -> None:
        if self.launcher != LOCAL and self.elsewhere is not None:
            return await self.elsewhere.terminate()
        return await super().terminate(restart)

    def _prepare_remote(
        self, remote: Elsewhere, server_env: dict[str, str], env: dict[str, str]
    ) -> None:
        """What goes to the node: what ``pre_launch`` added to the server's environment
        (the lease's caps, its kernel secret), the kernelspec's, and the ``%gpu`` state."""
        lease_env = {k: v for k, v in env.items() if server_env.get(k) != v}
        spec_env = dict(getattr(self.kernel_spec, "env", None) or {})
        remote.prepare(server_env, spec_env, lease_env, self._state_text())

    async def _pre_launch_process(
        self, remote: Elsewhere | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """``LocalProvisioner.pre_launch``; for a remote kernel only the base's (the
        environment), with the command formatted: no local ports, no server connection
        file (the kernel manager writes it from the node's answer)."""
        if remote is None:
            return await LocalProvisioner.pre_launch(self, **kwargs)
        cmd = remote.command(self.parent, list(self.kernel_spec.argv), kwargs)
        return await KernelProvisionerBase.pre_launch(self, cmd=cmd, **kwargs)

    async def _launch_process(
        self, remote: Elsewhere | None, cmd: list[str], kwargs: dict[str, Any]
    ) -> Any:
        """``LocalProvisioner.launch_kernel``, or the launcher's on the lease's node."""
        if remote is None:
            return await LocalProvisioner.launch_kernel(self, cmd, **kwargs)
        lease = self.lease_keeper.lease  # type: ignore[attr-defined]
        assert lease is not None  # pre_launch acquired it
        return await remote.launch(self.parent, str(self.kernel_id), lease, cmd, kwargs.get("cwd"))

    def _remote_place(self) -> tuple[int | None, int | None, str | None]:
        """The remote kernel's pid, pid namespace and cgroup, as its node reported them."""
        remote = self.elsewhere
        if remote is None:
            return None, None, None
        return remote.pid, remote.pid_ns, remote.cgroup

    def _state_text(self) -> str | None:
        """The ``%gpu`` state file as written now (a remote kernel gets it by value)."""
        state = self.lease_keeper.state_file  # type: ignore[attr-defined]
        if state is None:
            return None
        try:
            with open(state.path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None


__all__ = ["SERVER_ONLY", "Elsewhere", "RemoteCapable"]
