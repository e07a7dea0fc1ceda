"""``GPULeaseProvisioner``: a kernel's GPU lease, held exactly as long as the kernel lives.

A jupyter_client kernel provisioner (entry point ``gpu-lease-provisioner`` in group
``jupyter_client.kernel_provisioners``), a subclass of ``LocalProvisioner``: the kernel
runs on this machine exactly as it would without us. This class is the jupyter_client
side: its hooks decide *when*; small collaborators in this package do each job:

- :mod:`.lease_keeper` — acquire (waiting in the queue), renew, take an expired lease
  back, release: the lease's state machine; :mod:`.loops` says which event loop runs
  the renewals (jupyter_client's blocking ``KernelManager`` runs one only during calls);
  :mod:`.queue_wait` holds the acquire while it waits in the queue ("Stop waiting");
  :mod:`.parked` resumes a parked lease when the kernel wants its GPU memory back;
- :mod:`.broker_clients` — the broker clients, made again when the token rotates;
- :mod:`.state_file` — the file the ``%gpu`` magic reads inside the kernel;
- :mod:`.death_watch` — noticing a kernel that died for good (jupyter_client does not
  call ``cleanup`` then);
- :mod:`.refusals` — the broker's refusal (and our own: no fraction, no MPS daemon) as the
  sentence JupyterLab shows;
- :mod:`.cgroup_keeper` — the kernel's own cgroup, entered after each launch;
- :mod:`.env` — the granted lease (``provisioner.client.GrantedLease``) -> the kernel's
  environment and argv.

Who calls what, and when (jupyter_client ``KernelManager``):

=====================================  ===================================================
``start_kernel``                       ``pre_launch`` → ``launch_kernel`` → ``post_launch``
``shutdown_kernel`` (also culling)     ``shutdown_requested``, ``wait``/``kill``, ``cleanup(restart=False)``
``restart_kernel`` (also auto-restart) ``kill``, ``cleanup(restart=True)``, then the start sequence again
restarter gives up                     the ``"dead"`` callbacks only — no ``cleanup``
=====================================  ===================================================

A restart keeps the lease: ``cleanup(restart=True)`` leaves it and its renewals alone, and
the ``pre_launch`` that follows asks the broker again with the same ``kernel_id``, which
answers with the same lease (acquire is idempotent per user and kernel).

The broker token (``GPU_LEASE_TOKEN``, else the server's ``JUPYTERHUB_API_TOKEN``: see
:func:`provisioner.client.broker_env`) is read when a call needs it; it is never logged,
written to a file or kernel.json, nor added to the kernel's environment
(``_finalize_env`` removes ``GPU_LEASE_TOKEN``; ``JUPYTERHUB_API_TOKEN`` is left exactly
as jupyter_client hands it over).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.multikernelmanager import MultiKernelManager
from traitlets import Enum, Float, List, TraitError, Unicode, default, validate

from ..client import TOKEN_ENV, broker_env
from ..client.answers import GrantedLease
from ..errors import GPULeaseError, InvalidRequest
from ..model import validate_fraction
from ..node.pidns import own_pid_ns
from ..wire import COOPERATIVE, DEFAULT_MPS_DIR, ENFORCEMENTS, KERNEL_SECRET_ENV
from .broker_clients import BrokerClients
from .cgroup_keeper import CgroupKeeper
from .death_watch import DeathWatch
from .elsewhere import RemoteCapable
from .env import REMOVE_FROM_KERNEL, kernel_argv, lease_environment
from .lease_keeper import KernelReport, LeaseAsk, LeaseKeeper
from .loops import renewal_loop
from .placement import discover, resolve_indexes
from .refusals import check_mps_daemon, for_jupyter_server, no_fraction, wait_for_mps_limit
from .remote import LOCAL
from .state_file import StateFile, state_file_path
from .status import LeaseBoard, board_for


class GPULeaseProvisioner(RemoteCapable):
    """Launch a local kernel holding a lease on a fraction of a GPU (see the module docstring).

    Configured by the kernelspec's ``metadata.kernel_provisioner.config`` (which wins) or
    ``c.GPULeaseProvisioner.*`` in the server's configuration.
    """

    fraction = Float(
        0.0,
        help="Fraction of one GPU the kernel leases, above 0 and at most 1 (0.02 = 2%%). "
        "Required; usually set by the kernelspec.",
    ).tag(config=True)

    broker_url = Unicode(
        help="Base URL of the gpu-lease broker, e.g. http://127.0.0.1:10101 or "
        "http://127.0.0.1:8000/services/gpu-lease. Default: env GPU_LEASE_URL."
    ).tag(config=True)

    group = Unicode(
        None,
        allow_none=True,
        help="Course group the lease is charged to (course kernelspecs); members only. "
        "Default: none.",
    ).tag(config=True)

    queue_timeout = Float(
        600.0,
        help="Seconds to wait in the broker's queue while the pool is full before the kernel "
        "start fails with the place in the queue. Default: 600.",
    ).tag(config=True)

    enforcement = Enum(
        list(ENFORCEMENTS),
        default_value=COOPERATIVE,
        help="How the GPU memory cap is enforced: 'cooperative' (framework caps) or 'mps' "
        "(also CUDA_MPS_PINNED_DEVICE_MEM_LIMIT). Default: cooperative.",
    ).tag(config=True)

    mps_dir = Unicode(
        DEFAULT_MPS_DIR,
        help="With enforcement='mps': the node agent's --mps-dir, where each GPU's MPS "
        f"daemon has its pipe directory (<dir>/<gpu uuid>/pipe). Default: {DEFAULT_MPS_DIR}.",
    ).tag(config=True)

    mps_limit_wait = Float(
        15.0,
        min=0.0,
        help="With enforcement='mps': seconds to wait, before the kernel starts, for the node "
        "agent to say that its GPU's MPS limits cover the new lease (an MPS client keeps "
        "the limit of its first CUDA call; the agent applies them at each heartbeat). Then "
        "the kernel starts anyway, with a warning. Default: 15.",
    ).tag(config=True)

    node = Unicode(
        None,
        allow_none=True,
        help="Node name whose GPUs the lease must be on (multi-node pools). Default: from "
        "the server's environment (GPU_LEASE_NODE, else Slurm's SLURMD_NODENAME), else "
        "any node; see provisioner/kernel/placement.py.",
    ).tag(config=True)

    gpu_uuids = List(
        Unicode(),
        help="UUIDs of the GPUs this server may use; the lease is placed on one of them. "
        "Default: from the server's environment (GPU_LEASE_GPU_UUIDS, a Slurm job's GPUs, "
        "a Kubernetes pod's NVIDIA_VISIBLE_DEVICES), else any GPU of the node.",
    ).tag(config=True)

    renew_interval = Float(
        None,
        allow_none=True,
        help="Seconds between lease renewals. Default: a third of the lease's TTL "
        "(expires_at - renewed_at), else 30.",
    ).tag(config=True)

    long_poll = Float(
        30.0,
        help="Seconds the broker may hold each acquire request while queued (long-poll; "
        "the broker caps it at 300). Default: 30.",
    ).tag(config=True)

    cgroup_parent = Unicode(
        "",
        help="Where each kernel's own cgroup (v2) is made, as a path from the v2 "
        "hierarchy's root (the node agent sets the driver's memory limit on it where the "
        "driver offers one). Default '': the server's own cgroup + /gpu-lease (on a per-user "
        "hub, delegate the server's unit to its user: systemd Delegate=yes). 'off': no "
        "cgroup per kernel. See provisioner/node/cgroups.py.",
    ).tag(config=True)

    # -- trait defaults and validation (the environment is read here, never at import) --
    @default("broker_url")
    def _default_broker_url(self) -> str:
        return broker_env().url or ""

    @validate("fraction")
    def _validate_fraction(self, proposal: Any) -> float:
        try:
            return validate_fraction(proposal["value"])
        except InvalidRequest as exc:
            raise TraitError(exc.message) from exc

    @validate("queue_timeout", "long_poll")
    def _validate_seconds(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value != value or value < 0:
            raise TraitError(f"{proposal['trait'].name} must be 0 or more seconds, not {value!r}.")
        return value

    @validate("renew_interval")
    def _validate_renew_interval(self, proposal: Any) -> float | None:
        value = proposal["value"]
        if value is not None and not value > 0:
            raise TraitError(f"renew_interval must be above 0 seconds, not {value!r}.")
        return value

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._clients = BrokerClients(lambda: self.broker_url)
        #: the lease's state machine: ``lease_keeper.lease`` is the lease held now, and
        #: ``lease_keeper.queue_wait.queued`` the broker's latest answer while the request waits
        self.lease_keeper = LeaseKeeper(self, self._clients, log=self.log)
        self._death = DeathWatch(self, on_death=lambda: self.lease_keeper.end("the kernel died"))
        #: the kernel's own cgroup (``cgroup.path`` None: none could be made)
        self.cgroup = CgroupKeeper(self.log)

    # -- jupyter_client hooks ------------------------------------------------------------
    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Acquire the lease, then prepare the launch (``LocalProvisioner.pre_launch``) with it.

        Called from ``KernelManager.pre_start_kernel()`` on every start and restart. The
        lease comes first, so a kernel that cannot get a GPU allocates nothing else; its
        error is the sentence the student sees in JupyterLab's "Error Starting Kernel".
        """
        board = self.lease_keeper.board = self._board()
        if board is not None and self.kernel_id and self.lease_keeper.lease is None:
            # not a restart (which keeps its lease): JupyterLab shows the kernel waiting
            board.waiting(
                str(self.kernel_id),
                self.fraction,
                kernel_name=getattr(self.parent, "kernel_name", None),
                session_path=(kwargs.get("env") or {}).get("JPY_SESSION_NAME"),
                stop=self.lease_keeper.queue_wait.stop_waiting,
            )
        try:
            if not self.fraction:
                raise no_fraction(self._spec_name())
            lease = await self.lease_keeper.acquire(await self._placed_ask())
        except GPULeaseError as exc:
            error = for_jupyter_server(exc)
            if board is not None and self.kernel_id:
                board.forget(str(self.kernel_id), str(error))  # its start error says why
            raise error from exc
        remote = self._remote()
        try:
            kwargs = await self._pre_launch_process(remote, kwargs)  # calls _finalize_env
            env: dict[str, str] = kwargs["env"]
            server_env = dict(env)
            if self.lease_keeper.state_file is None:
                path = state_file_path(getattr(self.parent, "connection_file", ""), self.kernel_id)
                self.lease_keeper.state_file = StateFile(
                    path, kernel_id=self.kernel_id, log=self.log
                )
            if self.enforcement == "mps" and remote is None:  # a remote node checks its own
                check_mps_daemon(self.mps_dir, lease.gpu.uuid or "")
                await self._wait_for_mps_limit(lease.id, lease.gpu.uuid or "")
            env.update(
                lease_environment(
                    lease,
                    enforcement=self.enforcement,
                    state_file=self.lease_keeper.state_file.path,
                    base_env=env,
                    mps_dir=self.mps_dir,
                )
            )
            for name in REMOVE_FROM_KERNEL:
                env.pop(name, None)
            # the proof the node agent checks (kernel_secret.py): the same secret for each restart
            env[KERNEL_SECRET_ENV] = self.lease_keeper.secret.for_lease(lease.id)
            wrapped = kernel_argv(kwargs["cmd"])
            if not wrapped.wrapped:
                self.log.warning("Kernel %s: %s", self.kernel_id, wrapped.reason)
            kwargs["cmd"] = wrapped.argv
            # no %gpu extension (not an IPython kernel: R, Julia...): no cell hook asks for a
            # parked lease back, so the keeper resumes it when the kernel is busy instead
            self.lease_keeper.park_watch.resume_when_busy = not wrapped.extension
            self.lease_keeper.save_state()
            if remote is not None:
                self._prepare_remote(remote, server_env, env)
        except BaseException:
            await self.lease_keeper.end("the kernel could not be prepared for launch")
            raise
        return kwargs

    def _board(self) -> LeaseBoard | None:
        """The board of the server whose ``MultiKernelManager`` manages this kernel (if any),
        which the server extension ``provisioner.lab`` reads for JupyterLab."""
        mkm = getattr(self.parent, "parent", None)
        return board_for(mkm) if isinstance(mkm, MultiKernelManager) else None

    def _finalize_env(self, env: dict[str, str]) -> None:
        """Drop the server's broker token from the kernel's environment.

        Called from ``KernelProvisionerBase.pre_launch()`` (through ``LocalProvisioner``'s)
        on every start and restart, with the environment the kernel will get.
        """
        super()._finalize_env(env)
        env.pop(TOKEN_ENV, None)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel process (``LocalProvisioner``); on failure release the lease.

        Called from ``KernelManager._launch_kernel()`` right after ``pre_launch``.
        """
        remote = self.elsewhere if self.launcher != LOCAL else None
        try:
            info = await self._launch_process(remote, cmd, kwargs)
        except BaseException as exc:
            self.log.warning(
                "Kernel %s could not be launched (%s); releasing its GPU lease.",
                self.kernel_id,
                exc,
            )
            await self.lease_keeper.end("the kernel could not be launched")
            if isinstance(exc, GPULeaseError):  # a remote node's reason, as JupyterLab shows it
                raise for_jupyter_server(exc) from exc
            raise
        self._death.launched()
        if remote is None:
            self.cgroup.enter(self.kernel_id, self.pid, self.cgroup_parent)
        return info

    async def _wait_for_mps_limit(self, lease_id: str, gpu_uuid: str) -> None:
        """Start an MPS kernel only once the agent's MPS limits cover its lease (or after
        ``mps_limit_wait`` s, with a warning)."""
        covered = await wait_for_mps_limit(self.mps_dir, gpu_uuid, lease_id, self.mps_limit_wait)
        if covered is False:
            self.log.warning(
                "Kernel %s starts before the node agent covered its lease with GPU %s's MPS "
                "limits (waited %g s): its first CUDA call may meet a tighter limit than "
                "its lease's; restart the kernel if it runs out of GPU memory early.",
                self.kernel_id,
                gpu_uuid,
                self.mps_limit_wait,
            )

    async def post_launch(self, **kwargs: Any) -> None:
        """Watch for death and start renewing.

        Called from ``KernelManager.post_start_kernel()`` after it started the restarter,
        so the ``"dead"`` callback can be registered.
        """
        await super().post_launch(**kwargs)
        self._death.launched()
        self._death.watch()
        self.lease_keeper.start_renewing(renewal_loop(self.parent))

    async def cleanup(self, restart: bool = False) -> None:
        """Restart: keep the lease and its renewals. Shutdown: stop renewing and release.

        Called from ``KernelManager.cleanup_resources()`` at the end of every shutdown and
        restart; release failures are logged, never raised into the shutdown.
        """
        try:
            await super().cleanup(restart=restart)
        finally:
            if restart:
                self._death.restarting()
            else:
                await self.lease_keeper.end("the kernel was shut down")
                self.cgroup.drop(self.kernel_id)

    async def get_provisioner_info(self) -> dict[str, Any]:
        """``LocalProvisioner``'s info plus the lease, so a restarted server resumes renewing.

        Called by applications that persist their kernels (jupyter_client's own managers
        never call it).
        """
        info: dict[str, Any] = await super().get_provisioner_info()
        lease = self.lease_keeper.lease
        if lease is not None:
            state_file = self.lease_keeper.state_file
            info["gpu_lease"] = {
                "lease_id": lease.id,
                "fraction": self.fraction,
                "lease": lease.to_json(),
                "state_file": state_file.path if state_file is not None else None,
                "resume_when_busy": self.lease_keeper.park_watch.resume_when_busy,
                # the digest only: the kernel keeps its secret, a restored server renews
                "proof": self.lease_keeper.secret.proof(lease.id),
            }
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """The inverse of :meth:`get_provisioner_info`; resumes renewing the saved lease.

        Called by the same applications, on a fresh provisioner, when they take a kernel
        back.
        """
        await super().load_provisioner_info(provisioner_info)
        saved = provisioner_info.get("gpu_lease")
        if not isinstance(saved, dict) or not saved.get("lease_id"):
            return
        raw = saved.get("lease")
        lease = GrantedLease.from_json(
            {**(raw if isinstance(raw, dict) else {}), "id": str(saved["lease_id"])}
        )
        if saved.get("fraction"):
            self.fraction = float(saved["fraction"])
        if isinstance(saved.get("state_file"), str):
            self.lease_keeper.state_file = StateFile(
                saved["state_file"], kernel_id=self.kernel_id, log=self.log
            )
        # as pre_launch set it (a kernel without %gpu's cell hook); absent in older saves
        self.lease_keeper.park_watch.resume_when_busy = saved.get("resume_when_busy") is True
        self.lease_keeper.resume(lease, self._ask())
        proof = saved.get("proof")
        self.lease_keeper.secret.restore(lease.id, proof if isinstance(proof, str) else None)
        self._death.watch()
        self.lease_keeper.start_renewing(renewal_loop(self.parent))

    # -- what the lease keeper asks of the kernel (lease_keeper.KernelHandle) -------------
    def kernel_report(self) -> KernelReport:
        """The pid, and the parent KernelManager's execution state and last activity
        (jupyter_server's ``ServerKernelManager`` has both; others report none)."""
        km = self.parent
        state = _trait(km, "execution_state")
        activity = _epoch(_trait(km, "last_activity"))
        busy = state if isinstance(state, str) else None
        if self.launcher != LOCAL:  # its pid on its node, which that node's agent proves
            pid, ns, group = self._remote_place()
            return KernelReport(pid, busy, activity, ns, group)
        return KernelReport(
            self.pid,
            busy,
            activity,
            own_pid_ns() if self.pid else None,  # self.pid is numbered in our namespace
            self.cgroup.path,
        )

    def kernel_exited_for_good(self) -> bool:
        return self._death.exited_for_good()

    async def shut_kernel_down(self) -> None:
        """Shut the kernel down through its managers, so that everything is cleaned up."""
        km = self.parent
        mkm = getattr(km, "parent", None)
        if isinstance(mkm, MultiKernelManager) and self.kernel_id in mkm:
            await _call_async(mkm, "shutdown_kernel", self.kernel_id, now=False)
        elif km is not None and hasattr(km, "shutdown_kernel"):
            await _call_async(km, "shutdown_kernel", now=False)
        else:
            await self.terminate()
            try:
                await asyncio.wait_for(self.wait(), timeout=self.get_shutdown_wait_time())
            except asyncio.TimeoutError:
                await self.kill()
                await self.wait()

    def lease_ended(self) -> None:
        self._death.stop()
        self.cgroup.drop(self.kernel_id)

    # -- helpers -------------------------------------------------------------------------
    async def _placed_ask(self) -> LeaseAsk:
        """:meth:`_ask` on the node and GPUs the server's engine gives it (configured
        ``node``/``gpu_uuids`` win); GPU indexes are looked up in the broker's pool."""
        ask = self._ask()
        if self.launcher != LOCAL:  # the kernel goes to the GPU: any node of the pool
            return ask
        placement = discover(os.environ)
        node = ask.node if ask.node is not None else placement.node
        uuids = ask.gpu_uuids or placement.gpu_uuids
        if not uuids and placement.gpu_indexes and ask.node is None:
            uuids = resolve_indexes(placement, await self._clients.get().gpus())
        if (node, uuids) != (ask.node, ask.gpu_uuids):
            self.log.debug("Kernel %s asks for a lease on %s", self.kernel_id, placement.describe())
        return replace(ask, node=node, gpu_uuids=tuple(uuids))

    def _ask(self) -> LeaseAsk:
        """What to ask the broker for, from the traits now."""
        return LeaseAsk(
            kernel_id=str(self.kernel_id),
            fraction=self.fraction,
            node=self.node,
            gpu_uuids=tuple(self.gpu_uuids),
            group=self.group,
            long_poll=self.long_poll,
            queue_timeout=self.queue_timeout,
            renew_interval=self.renew_interval,
            # the kernel runs as this process's user: MPS serves one uid per GPU at a time
            mps_uid=os.getuid() if self.enforcement == "mps" else None,
        )

    def _spec_name(self) -> str:
        spec = self.kernel_spec
        return str(getattr(spec, "display_name", "") or getattr(self.parent, "kernel_name", "?"))


def _trait(obj: Any, name: str) -> Any:
    """``obj.name``, or None while it is unset: jupyter_server's ``ServerKernelManager`` sets
    ``last_activity`` only after the start, and reading an unset trait without a default
    raises (the renewal right after launch comes before)."""
    try:
        return getattr(obj, name, None)
    except TraitError:
        return None


def _epoch(activity: Any) -> float | None:
    """A ``last_activity`` (a datetime, naive ones in UTC, or epoch seconds) as epoch seconds."""
    if isinstance(activity, datetime):
        if activity.tzinfo is None:
            activity = activity.replace(tzinfo=timezone.utc)
        return activity.timestamp()
    if isinstance(activity, (int, float)) and not isinstance(activity, bool):
        return float(activity)
    return None


async def _call_async(obj: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``obj.name(...)``, or its ``_async_`` twin where the public one is the sync wrapper.

    jupyter_client's synchronous managers define every method as ``_async_<name>`` and
    expose ``<name> = run_sync(_async_<name>)``, which cannot run inside the running event
    loop the provisioner lives in; only the ``Async*`` managers rebind ``<name>`` to the
    coroutine. The twins are not public API (https://github.com/jupyter/jupyter_client/issues/755
    "Clean up synchronous managers"; e.g. ``KernelManager.shutdown_kernel = run_sync(...)``
    in https://github.com/jupyter/jupyter_client/blob/main/jupyter_client/manager.py).
    """
    method = getattr(obj, name)
    if not inspect.iscoroutinefunction(method):
        method = getattr(obj, f"_async_{name}", method)
    result = method(*args, **kwargs)
    if inspect.isawaitable(result):
        await result


__all__ = ["GPULeaseProvisioner"]
