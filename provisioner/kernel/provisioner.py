"""``GPULeaseProvisioner``: a kernel's GPU lease, held exactly as long as the kernel lives.

A jupyter_client kernel provisioner (entry point ``gpu-lease-provisioner`` in group
``jupyter_client.kernel_provisioners``), a subclass of ``LocalProvisioner``: the kernel
runs on this machine exactly as it would without us; around it, this class

- **acquires** a lease from the broker before the kernel exists (``pre_launch``), waiting
  in the queue while the pool is full and logging the place in the queue;
- **prepares** the kernel: the lease's environment (``env.lease_environment``), the
  kernel command started under the launcher (``env.kernel_argv``), a private JSON state
  file the ``%gpu`` magic reads, and no broker token in the kernel's environment;
- **renews** the lease every ``renew_interval`` seconds while the kernel lives (a task
  started by ``post_launch``), reporting the pid, execution state and last activity;
- **releases** it on shutdown (``cleanup(restart=False)``), on launch failure, and on
  kernel death: jupyter_client never calls ``cleanup`` for a kernel its restarter gave
  up on, so a ``"dead"`` restart callback on the ``KernelManager`` does it; a kernel
  managed without a restarter is found exited by the renewal task.

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

What ends a lease from the broker's side, seen on renewal:

- ``BrokerUnavailable``: a warning; the kernel keeps running; the next renewal retries
  (the broker gives every lease a TTL of grace when it comes back).
- ``LeaseRevoked`` (an admin, or idle reclaim while others wait): the reason goes to the
  log and the state file, and the kernel is shut down.
- ``LeaseExpired`` / unknown lease (the server was cut off longer than the TTL): one
  attempt to get the same fraction of the same GPU back; if it cannot fit, as revoked.

The broker token (``GPU_LEASE_TOKEN``, else the server's ``JUPYTERHUB_API_TOKEN``) is read
when a call needs it; it is never logged, written to a file or kernel.json, nor added to
the kernel's environment (``GPU_LEASE_TOKEN`` is removed from it; ``JUPYTERHUB_API_TOKEN``
is left exactly as jupyter_client hands it over).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import textwrap
import time
from datetime import datetime, timezone
from typing import Any, cast

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.multikernelmanager import MultiKernelManager
from jupyter_client.provisioning import LocalProvisioner
from traitlets import Enum, Float, List, TraitError, Unicode, default, validate

from ..client import BrokerClient
from ..errors import (
    BrokerUnavailable,
    GPULeaseError,
    InvalidRequest,
    LeaseExpired,
    LeaseGone,
    LeaseNotFound,
    NoCapacity,
)
from ..kernelspecs import format_fraction, validate_fraction
from .env import ENFORCEMENTS, kernel_argv, lease_environment

#: removed from every kernel's environment: the server's broker credential
TOKEN_ENV = "GPU_LEASE_TOKEN"
#: renewal period when neither ``renew_interval`` nor the lease's TTL says otherwise (s)
DEFAULT_RENEW_INTERVAL = 30.0
#: never renew more often than this (s), whatever the TTL
MIN_RENEW_INTERVAL = 0.2
#: retries of one acquire or release call (backoff 0.5, 1, 2, 4, 8 s): rides out a broker restart
ACQUIRE_RETRIES = 5
#: retries of one renewal: the renewal loop is the retry
RENEW_RETRIES = 1


class GPULeaseProvisioner(LocalProvisioner):
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
        default_value="cooperative",
        help="How the GPU memory cap is enforced: 'cooperative' (framework caps) or 'mps' "
        "(also CUDA_MPS_PINNED_DEVICE_MEM_LIMIT). Default: cooperative.",
    ).tag(config=True)

    node = Unicode(
        None,
        allow_none=True,
        help="Node name whose GPUs the lease must be on (multi-node pools). "
        "Default: env GPU_LEASE_NODE, else any node.",
    ).tag(config=True)

    gpu_uuids = List(
        Unicode(),
        help="UUIDs of the GPUs this machine exposes (e.g. a KubeSpawner pod); the lease is "
        "placed on one of them. Default: env GPU_LEASE_GPU_UUIDS (comma-separated), else any.",
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

    # -- trait defaults and validation (the environment is read here, never at import) --
    @default("broker_url")
    def _default_broker_url(self) -> str:
        return os.environ.get("GPU_LEASE_URL", "")

    @default("node")
    def _default_node(self) -> str | None:
        return os.environ.get("GPU_LEASE_NODE") or None

    @default("gpu_uuids")
    def _default_gpu_uuids(self) -> list[str]:
        raw = os.environ.get("GPU_LEASE_GPU_UUIDS", "")
        return [u.strip() for u in raw.split(",") if u.strip()]

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
        self._lease: dict[str, Any] | None = None
        self._clients: dict[bool, BrokerClient] = {}
        self._client_key: tuple[str, str | None] | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._state_file: str | None = None
        self._keep_state_file = False
        self._restarting = False
        self._dead_callback_on: Any = None

    # -- jupyter_client hooks ------------------------------------------------------------
    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Acquire the lease, then prepare the launch (``LocalProvisioner.pre_launch``) with it.

        Called from ``KernelManager.pre_start_kernel()`` on every start and restart. The
        lease comes first, so a kernel that cannot get a GPU allocates nothing else; its
        error is the sentence the student sees in JupyterLab's "Error Starting Kernel".
        """
        try:
            lease = await self._acquire()
        except GPULeaseError as exc:
            raise _for_jupyter_server(exc) from exc
        try:
            kwargs = await super().pre_launch(**kwargs)
            env: dict[str, str] = kwargs["env"]
            self._state_file = self._state_file or self._state_file_path()
            env.update(
                lease_environment(
                    lease,
                    enforcement=self.enforcement,
                    state_file=self._state_file,
                    base_env=env,
                )
            )
            env.pop(TOKEN_ENV, None)
            wrapped = kernel_argv(kwargs["cmd"])
            if not wrapped.wrapped:
                self.log.warning("Kernel %s: %s", self.kernel_id, wrapped.reason)
            kwargs["cmd"] = wrapped.argv
            self._write_state(lease)
        except BaseException:
            await self._end_lease("the kernel could not be prepared for launch")
            raise
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel process (``LocalProvisioner``); on failure release the lease.

        Called from ``KernelManager._launch_kernel()`` right after ``pre_launch``.
        """
        try:
            info = await super().launch_kernel(cmd, **kwargs)
        except BaseException as exc:
            self.log.warning(
                "Kernel %s could not be launched (%s); releasing its GPU lease.",
                self.kernel_id,
                exc,
            )
            await self._end_lease("the kernel could not be launched")
            raise
        self._restarting = False
        return info

    async def post_launch(self, **kwargs: Any) -> None:
        """Start renewing and watch for death. Called from ``KernelManager.post_start_kernel()``
        after the restarter was started, so the ``"dead"`` callback can be registered."""
        await super().post_launch(**kwargs)
        self._restarting = False
        self._watch_death()
        self._start_renewing()

    async def cleanup(self, restart: bool = False) -> None:
        """Restart: keep the lease and its renewals. Shutdown: stop renewing and release.

        Called from ``KernelManager.cleanup_resources()`` at the end of every shutdown and
        restart; release failures are logged, never raised into the shutdown.
        """
        try:
            await super().cleanup(restart=restart)
        finally:
            if restart:
                self._restarting = True
            else:
                await self._end_lease("the kernel was shut down")

    def _finalize_env(self, env: dict[str, str]) -> None:
        """Drop the broker token from the kernel's environment (called by ``pre_launch``)."""
        super()._finalize_env(env)
        env.pop(TOKEN_ENV, None)

    async def get_provisioner_info(self) -> dict[str, Any]:
        """``LocalProvisioner``'s info plus the lease, so a restarted server resumes renewing."""
        info: dict[str, Any] = await super().get_provisioner_info()
        if self._lease is not None:
            info["gpu_lease"] = {
                "lease_id": self._lease.get("id"),
                "fraction": self.fraction,
                "lease": self._lease,
                "state_file": self._state_file,
            }
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """The inverse of :meth:`get_provisioner_info`; resumes renewing the saved lease."""
        await super().load_provisioner_info(provisioner_info)
        saved = provisioner_info.get("gpu_lease")
        if not isinstance(saved, dict) or not saved.get("lease_id"):
            return
        lease = saved.get("lease")
        self._lease = dict(lease) if isinstance(lease, dict) else {"id": saved["lease_id"]}
        self._lease["id"] = saved["lease_id"]
        if saved.get("fraction"):
            self.fraction = float(saved["fraction"])
        if isinstance(saved.get("state_file"), str):
            self._state_file = saved["state_file"]
        self._watch_death()
        self._start_renewing()

    # -- acquire -------------------------------------------------------------------------
    async def _acquire(self) -> dict[str, Any]:
        if not self.fraction:
            raise InvalidRequest(
                f"The kernelspec {self._spec_name()!r} sets no GPU fraction: add "
                '"config": {"fraction": 0.02} under metadata.kernel_provisioner in its '
                "kernel.json (or reinstall it with `gpu-lease kernelspec install --fraction`)."
            )
        client = self._broker()
        self.log.info(
            "Requesting %s of a GPU for kernel %s from the broker at %s",
            format_fraction(self.fraction),
            self.kernel_id,
            client.url,
        )
        try:
            lease = await client.acquire(
                str(self.kernel_id),
                self.fraction,
                node=self.node,
                gpu_uuids=list(self.gpu_uuids) or None,
                group=self.group,
                wait=self.long_poll,
                queue_timeout=self.queue_timeout,
                on_queued=self._on_queued,
            )
        except NoCapacity as exc:
            self.log.warning("GPU request for kernel %s gave up: %s", self.kernel_id, exc)
            await self._close_client()
            raise
        except GPULeaseError as exc:
            self.log.warning("GPU request for kernel %s failed: %s", self.kernel_id, exc)
            await self._close_client()
            raise
        previous = self._lease.get("id") if self._lease else None
        self._lease = lease
        self._keep_state_file = False
        gpu = lease.get("gpu") or {}
        self.log.info(
            "Kernel %s %s GPU lease %s: %s of %s %s (%s MiB cap)",
            self.kernel_id,
            "keeps" if previous == lease.get("id") else "holds",
            _short(lease.get("id")),
            format_fraction(float(lease.get("fraction") or self.fraction)),
            gpu.get("name") or "GPU",
            gpu.get("uuid"),
            lease.get("memory_limit_mb"),
        )
        return lease

    def _on_queued(self, answer: dict[str, Any]) -> None:
        position = answer.get("position")
        self.log.info(
            "GPU request for kernel %s waits at position %d: %s",
            self.kernel_id,
            position if isinstance(position, int) else 0,
            answer.get("message") or answer.get("reason") or "the GPU pool is full",
        )

    # -- renewals ------------------------------------------------------------------------
    def _start_renewing(self) -> None:
        if self._renew_task is not None and not self._renew_task.done():
            return
        self._renew_task = asyncio.ensure_future(self._renew_loop())

    async def _renew_loop(self) -> None:
        """Every renewal interval: renew, or find out why not. Runs until the lease ends."""
        while self._lease is not None:
            await asyncio.sleep(self._interval())
            if not await self._renew_once():
                return

    def _interval(self) -> float:
        if self.renew_interval:
            return max(MIN_RENEW_INTERVAL, float(self.renew_interval))
        lease = self._lease or {}
        expires, since = lease.get("expires_at"), lease.get("renewed_at") or lease.get("created_at")
        if (
            isinstance(expires, (int, float))
            and isinstance(since, (int, float))
            and expires > since
        ):
            return max(MIN_RENEW_INTERVAL, (expires - since) / 3)
        return DEFAULT_RENEW_INTERVAL

    async def _renew_once(self) -> bool:
        """One renewal; False when the lease has ended (and the loop must stop)."""
        lease = self._lease
        if lease is None:
            return False
        if self._exited_for_good():
            self.log.warning(
                "Kernel %s has exited and nothing will restart it; releasing its GPU lease.",
                self.kernel_id,
            )
            await self._end_lease("the kernel exited")
            return False
        execution_state, last_activity = self._activity()
        try:
            fresh = await self._broker(renewal=True).renew(
                lease["id"],
                pid=self.pid,
                execution_state=execution_state,
                last_activity=last_activity,
            )
        except BrokerUnavailable as exc:
            self.log.warning(
                "Could not renew GPU lease %s of kernel %s; the kernel keeps running and the "
                "renewal is retried in %g s: %s",
                _short(lease["id"]),
                self.kernel_id,
                self._interval(),
                exc,
            )
            return True
        except (LeaseExpired, LeaseNotFound) as exc:
            return await self._recover(exc)
        except LeaseGone as exc:
            await self._lost(exc.details.get("state") or "revoked", _reason(exc))
            return False
        except GPULeaseError as exc:
            self.log.warning(
                "Renewing GPU lease %s of kernel %s failed; retrying in %g s: %s",
                _short(lease["id"]),
                self.kernel_id,
                self._interval(),
                exc,
            )
            return True
        if self._lease is not None and self._lease.get("id") == fresh.get("id"):
            self._lease = fresh
            self._write_state(fresh)
        return True

    async def _recover(self, exc: GPULeaseError) -> bool:
        """The lease expired (or the broker forgot it): ask once for the same share again."""
        old = self._lease or {}
        gpu = old.get("gpu") or {}
        uuid = gpu.get("uuid") if isinstance(gpu, dict) else None
        self.log.warning(
            "GPU lease %s of kernel %s has ended (%s); asking for %s of the same GPU again.",
            _short(old.get("id")),
            self.kernel_id,
            _reason(exc),
            format_fraction(self.fraction),
        )
        try:
            lease = await self._broker().acquire(
                str(self.kernel_id),
                self.fraction,
                node=self.node,
                gpu_uuids=[uuid] if uuid else (list(self.gpu_uuids) or None),
                group=self.group,
                wait=0,
                queue_timeout=0,
            )
        except BrokerUnavailable as err:
            self.log.warning(
                "Could not re-acquire the GPU lease of kernel %s: %s", self.kernel_id, err
            )
            return True
        except GPULeaseError as err:
            await self._lost(
                "expired",
                f"{_reason(exc)}; its GPU share could not be taken back ({err.message})",
            )
            return False
        self._lease = lease
        self._write_state(lease)
        self.log.info(
            "Kernel %s holds GPU lease %s again (%s of GPU %s).",
            self.kernel_id,
            _short(lease.get("id")),
            format_fraction(self.fraction),
            uuid,
        )
        return True

    async def _lost(self, state: str, reason: str) -> None:
        """The broker ended the lease: record why, then shut the kernel down."""
        lease = self._lease or {}
        self.log.warning(
            "GPU lease %s of kernel %s was %s: %s. Shutting the kernel down.",
            _short(lease.get("id")),
            self.kernel_id,
            state,
            reason,
        )
        self._write_state(lease, state=state, reason=reason)
        self._keep_state_file = True  # the reason stays readable after the kernel is gone
        self._lease = None
        self._renew_task = None  # this is the renewal task: shutdown must not cancel it
        try:
            await self._stop_kernel()
        except Exception:
            self.log.exception(
                "Could not shut down kernel %s after losing its lease", self.kernel_id
            )
        await self._end_lease(f"the lease was {state}")

    async def _stop_kernel(self) -> None:
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

    def _activity(self) -> tuple[str | None, float | None]:
        """The parent KernelManager's execution state and last activity (jupyter_server's)."""
        km = self.parent
        state = getattr(km, "execution_state", None)
        activity = getattr(km, "last_activity", None)
        when: float | None = None
        if isinstance(activity, datetime):
            if activity.tzinfo is None:
                activity = activity.replace(tzinfo=timezone.utc)
            when = activity.timestamp()
        elif isinstance(activity, (int, float)) and not isinstance(activity, bool):
            when = float(activity)
        return (state if isinstance(state, str) else None), when

    # -- death and the end of the lease ------------------------------------------------------
    def _watch_death(self) -> None:
        """Register the ``"dead"`` restart callback (the restarter exists after start)."""
        km = self.parent
        if km is None or not hasattr(km, "add_restart_callback"):
            return
        if self._dead_callback_on is km:
            km.remove_restart_callback(self._on_dead, "dead")
        km.add_restart_callback(self._on_dead, "dead")
        self._dead_callback_on = km

    def _on_dead(self) -> None:
        """The restarter gave up on the kernel: release (called synchronously by the restarter)."""
        self.log.warning(
            "Kernel %s died and will not be restarted; releasing its GPU lease.", self.kernel_id
        )
        task = asyncio.ensure_future(self._end_lease("the kernel died"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _exited_for_good(self) -> bool:
        """The kernel process is gone and no restarter, restart or shutdown is under way."""
        km = self.parent
        if self._restarting or getattr(km, "shutting_down", False):
            return False
        if getattr(km, "autorestart", False) and getattr(km, "_restarter", None) is not None:
            return False  # the restarter restarts it, or calls _on_dead
        process = getattr(self, "process", None)
        if process is not None:
            return bool(process.poll() is not None)
        if self.pid:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                return False
        return False

    async def _end_lease(self, why: str) -> None:
        """Stop renewing, release the lease (errors logged), close the client. Idempotent."""
        task, self._renew_task = self._renew_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        lease, self._lease = self._lease, None
        if lease is not None and lease.get("id"):
            try:
                await self._broker().release(lease["id"])
            except GPULeaseError as exc:
                self.log.warning(
                    "Could not release GPU lease %s of kernel %s (%s); the broker ends it when "
                    "its TTL runs out: %s",
                    _short(lease["id"]),
                    self.kernel_id,
                    why,
                    exc,
                )
            else:
                self.log.info(
                    "Released GPU lease %s of kernel %s: %s.",
                    _short(lease["id"]),
                    self.kernel_id,
                    why,
                )
        if not self._keep_state_file and self._state_file:
            with contextlib.suppress(OSError):
                os.unlink(self._state_file)
        km = self._dead_callback_on
        if km is not None:
            km.remove_restart_callback(self._on_dead, "dead")
            self._dead_callback_on = None
        await self._close_client()

    # -- the broker client and the state file ------------------------------------------------
    def _broker(self, *, renewal: bool = False) -> BrokerClient:
        """The broker client, made again when the URL or the token changed (tokens rotate).

        Renewals get a client that retries once: the renewal loop itself is the retry, and
        a long backoff inside one renewal would only delay the warning.
        """
        token = os.environ.get(TOKEN_ENV) or os.environ.get("JUPYTERHUB_API_TOKEN") or None
        key = (self.broker_url, token)
        if self._client_key != key:
            for old in self._clients.values():
                self._close_later(old)
            self._clients = {}
            self._client_key = key
        client = self._clients.get(renewal)
        if client is None:
            if not self.broker_url:
                raise InvalidRequest(
                    "No GPU lease broker URL is set: set GPU_LEASE_URL in the Jupyter server's "
                    "environment (the hub admin can pass it with c.Spawner.environment), or "
                    "c.GPULeaseProvisioner.broker_url."
                )
            retries = RENEW_RETRIES if renewal else ACQUIRE_RETRIES
            client = BrokerClient(self.broker_url, token, retries=retries)
            self._clients[renewal] = client
        return client

    def _close_later(self, client: BrokerClient) -> None:
        task = asyncio.ensure_future(client.aclose())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_client(self) -> None:
        clients, self._clients, self._client_key = list(self._clients.values()), {}, None
        for client in clients:
            await client.aclose()

    def _state_file_path(self) -> str:
        """Next to the connection file (the server's private runtime dir), else a temp dir."""
        connection_file = getattr(self.parent, "connection_file", "") or ""
        if connection_file:
            folder = os.path.dirname(os.path.abspath(connection_file))
        else:
            from jupyter_core.paths import jupyter_runtime_dir

            folder = jupyter_runtime_dir()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return os.path.join(folder, f"gpu-lease-{self.kernel_id}.json")

    def _write_state(
        self, lease: dict[str, Any], *, state: str | None = None, reason: str | None = None
    ) -> None:
        """Write the lease's state for ``%gpu`` atomically, mode 0600. Errors are logged."""
        if not self._state_file:
            return
        data = {
            "state": state or lease.get("state") or "active",
            "expires_at": lease.get("expires_at"),
            "reason": reason if reason is not None else lease.get("reason"),
            "lease_id": lease.get("id"),
            "kernel_id": self.kernel_id,
            "fraction": lease.get("fraction", self.fraction),
            "memory_limit_mb": lease.get("memory_limit_mb"),
            "gpu": lease.get("gpu"),
            "updated_at": time.time(),
        }
        tmp = f"{self._state_file}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self._state_file)
        except OSError as exc:
            self.log.warning(
                "Could not write the GPU lease state file %s: %s", self._state_file, exc
            )

    def _spec_name(self) -> str:
        spec = self.kernel_spec
        return str(getattr(spec, "display_name", "") or getattr(self.parent, "kernel_name", "?"))


async def _call_async(obj: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``obj.name(...)``, or its ``_async_`` twin where the public one is the sync wrapper."""
    method = getattr(obj, name)
    if not inspect.iscoroutinefunction(method):
        method = getattr(obj, f"_async_{name}", method)
    result = method(*args, **kwargs)
    if inspect.isawaitable(result):
        await result


def _short(lease_id: Any) -> str:
    """A lease id shortened for logs, as the broker logs it."""
    return f"{str(lease_id)[:6]}…" if lease_id else "?"


_SERVER_ERRORS: dict[type, type] = {}


def _for_jupyter_server(exc: GPULeaseError) -> GPULeaseError:
    """``exc`` as an instance of its own class *and* of tornado's ``HTTPError``.

    Called by ``pre_launch`` when the broker refuses or cannot be reached. jupyter_server's
    REST API (``POST /api/kernels``, ``/api/sessions``) answers any exception that is not
    an ``HTTPError`` with "Unhandled error", so the student would never read the broker's
    sentence in JupyterLab's "Error Starting Kernel"; with this its ``message`` is the
    error's ``message`` and its status ours (403 quota/course, 503 broker down, ...).
    Callers that catch our errors (``except NoCapacity``) still do.
    """
    from tornado.web import HTTPError

    cls = type(exc)
    mixed = _SERVER_ERRORS.get(cls)
    if mixed is None:
        mixed = type(
            cls.__name__,
            (cls, HTTPError),
            {"__module__": cls.__module__, "__str__": lambda self: self.message},
        )
        _SERVER_ERRORS[cls] = mixed
    out: Any = Exception.__new__(mixed)
    out.__dict__.update(exc.__dict__)
    out.args = ()  # tornado formats log_message % args when it logs the error
    out.status_code = exc.status if 400 <= exc.status < 600 else 500
    shown = _for_dialog(exc.message)
    if isinstance(getattr(HTTPError, "log_message", None), property):  # tornado >= 6.5
        out._log_message = shown
    else:
        out.log_message = shown
    out.reason = None
    return cast(GPULeaseError, out)


def _for_dialog(message: str, width: int = 100) -> str:
    """One sentence per line, long ones wrapped: JupyterLab shows the message in an
    unwrapped ``<pre>``, which cut the broker's advice off after ~110 characters."""
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", message.strip())
    return "\n".join(
        textwrap.fill(s, width, break_long_words=False, break_on_hyphens=False) for s in sentences
    )


def _reason(exc: GPULeaseError) -> str:
    reason = exc.details.get("reason")
    return str(reason) if reason else exc.message.rstrip(".")


__all__ = ["GPULeaseProvisioner"]
