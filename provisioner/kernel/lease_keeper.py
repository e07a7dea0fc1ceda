"""``LeaseKeeper``: one kernel's lease, from the acquire to the release.

The keeper is the lease's state machine; the provisioner decides *when* (jupyter_client's
hooks), the keeper does *what*:

- :meth:`~LeaseKeeper.acquire` asks the broker, waiting in its queue while the pool is
  full (its :class:`~.queue_wait.QueueWait`, ``queue_wait``, keeps and logs the broker's
  answers meanwhile, and gives the place up when the student stops waiting);
- :meth:`~LeaseKeeper.start_renewing` renews at once (right after the launch) and then
  every ``renew_interval`` seconds (default: a third of the lease's TTL), reporting the
  kernel's pid (with its pid namespace and cgroup), execution state and last activity,
  and rewriting the ``%gpu`` state file;
- :meth:`~LeaseKeeper.end` stops renewing and releases the lease (idempotent).

What ends a lease from the broker's side, seen on renewal:

- ``BrokerUnavailable``: a warning; the kernel keeps running; the next renewal retries
  (the broker gives every lease a TTL of grace when it comes back).
- ``LeaseRevoked`` (an admin, or idle reclaim while others wait): the reason goes to the
  log and the state file, and the kernel is shut down.
- ``LeaseExpired`` / unknown lease (the server was cut off longer than the TTL): one
  attempt to get the same fraction of the same GPU back; if it cannot fit, as revoked.
  A parked lease is not taken back that way (a new lease would not restore the parked
  memory): its kernel is shut down as revoked.

Parking (``PARK_STATES``): the broker may park an idle kernel's GPU memory in
host RAM while others wait. Renewals go on (``parking``/``parked``/``resuming`` are not
ends) and write the wire state to the state file; a parked lease's way back (the kernel's
``.resume`` request, the resume calls) is the keeper's :class:`~.parked.ParkWatch`
(``park_watch``), which hands each answer back to :meth:`~LeaseKeeper.hold`; a lease that
ended meanwhile is handled as a revoke (:meth:`~LeaseKeeper.lost_parked`).

The keeper knows its kernel only through :class:`KernelHandle` (the provisioner), and
its request only through :class:`LeaseAsk` (the provisioner's traits, read at each call).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..client.answers import GrantedLease, short_id
from ..errors import (
    BrokerUnavailable,
    GPULeaseError,
    InvalidRequest,
    LeaseExpired,
    LeaseGone,
    LeaseNotFound,
    NoCapacity,
)
from ..wire import Renewal
from .broker_clients import BrokerClients
from .kernel_secret import KernelSecret
from .kernelspecs import format_fraction
from .loops import BackgroundLoop, cancel_and_wait, wait_done
from .parked import ParkWatch
from .queue_wait import QueueWait
from .state_file import StateFile
from .status import LeaseBoard

#: renewal period when neither ``renew_interval`` nor the lease's TTL says otherwise (s)
DEFAULT_RENEW_INTERVAL = 30.0
#: never renew more often than this (s), whatever the TTL
MIN_RENEW_INTERVAL = 0.2


@dataclass(frozen=True)
class LeaseAsk:
    """What the kernel asks the broker for (the provisioner's traits, at the time of asking)."""

    kernel_id: str
    fraction: float
    node: str | None = None
    gpu_uuids: tuple[str, ...] = ()
    group: str | None = None
    #: seconds the broker may hold each queued acquire (long-poll)
    long_poll: float = 30.0
    #: seconds to wait in the queue before giving up
    queue_timeout: float = 600.0
    #: seconds between renewals; None: a third of the lease's TTL
    renew_interval: float | None = None
    #: enforcement=mps kernels: the Unix uid the kernel runs as (a placement hint: MPS
    #: serves one uid per GPU at a time); None for other kernels
    mps_uid: int | None = None


class KernelReport(NamedTuple):
    """What each renewal tells the broker about the kernel."""

    pid: int | None
    execution_state: str | None
    last_activity: float | None
    #: the pid namespace ``pid`` is numbered in (see :mod:`provisioner.node.pidns`)
    pid_ns: int | None = None
    #: the kernel's cgroup v2 path, where it has one (see :mod:`provisioner.node.cgroups`)
    cgroup: str | None = None


class KernelHandle(Protocol):
    """What the keeper needs of its kernel (implemented by ``GPULeaseProvisioner``)."""

    def kernel_report(self) -> KernelReport:
        """The kernel's pid, execution state and last activity, for a renewal."""
        ...

    def kernel_exited_for_good(self) -> bool:
        """The kernel process is gone and nothing will start it again."""
        ...

    async def shut_kernel_down(self) -> None:
        """Shut the kernel down (the broker ended its lease)."""
        ...

    def lease_ended(self) -> None:
        """The lease is over (released, lost, or never prepared): stop watching the kernel."""
        ...


class LeaseKeeper:
    """Holds one kernel's lease (see the module docstring)."""

    def __init__(
        self,
        kernel: KernelHandle,
        clients: BrokerClients,
        *,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        self.kernel = kernel
        self.clients = clients
        self.log = log
        #: the lease held now, as the broker last described it
        self.lease: GrantedLease | None = None
        #: where ``%gpu`` reads the lease's state (set by the provisioner before launch)
        self.state_file: StateFile | None = None
        self.renew_task: asyncio.Task[None] | None = None
        #: the server's board JupyterLab reads (set by the provisioner; None outside a server)
        self.board: LeaseBoard | None = None
        self._ask: LeaseAsk | None = None
        #: done when the :meth:`end` under way is (a second caller waits for the first)
        self._ending: asyncio.Future[None] | None = None
        #: the acquire while it waits in the broker's queue, and the student's "Stop waiting"
        self.queue_wait = QueueWait(self, clients, log=log)
        #: a parked lease's way back: the kernel's resume request, the resume calls
        self.park_watch = ParkWatch(self, clients, log=log)
        #: the kernel's secret and its proof (:mod:`.kernel_secret`)
        self.secret = KernelSecret()

    # -- acquire -------------------------------------------------------------------------
    async def acquire(self, ask: LeaseAsk) -> GrantedLease:
        """Get a lease for ``ask`` (the same one again after a restart: acquire is idempotent
        per user and kernel). Raises our errors; ``NoCapacity`` after ``queue_timeout``."""
        self._ask = ask
        client = self.clients.get()
        self.log.info(
            "Requesting %s of a GPU for kernel %s from the broker at %s",
            format_fraction(ask.fraction),
            ask.kernel_id,
            client.url,
        )
        acquiring = client.leases.acquire(
            ask.kernel_id,
            ask.fraction,
            node=ask.node,
            gpu_uuids=list(ask.gpu_uuids) or None,
            group=ask.group,
            wait=ask.long_poll,
            queue_timeout=ask.queue_timeout,
            on_queued=self.queue_wait.on_queued,
            mps_uid=ask.mps_uid,
        )
        try:
            lease = await self.queue_wait.wait(acquiring)
        except asyncio.CancelledError:
            if not self.queue_wait.stopped:
                raise
            self.log.info("GPU request for kernel %s: the student stopped waiting", ask.kernel_id)
            await self.clients.aclose()
            raise NoCapacity(
                "You stopped waiting for a GPU, so this kernel did not start and its place in "
                "the GPU queue was given up. Start the kernel again when you want to rejoin "
                "the queue.",
                stopped_by="student",
            ) from None
        except NoCapacity as exc:
            self.log.warning("GPU request for kernel %s gave up: %s", ask.kernel_id, exc)
            await self.clients.aclose()
            raise
        except GPULeaseError as exc:
            self.log.warning("GPU request for kernel %s failed: %s", ask.kernel_id, exc)
            await self.clients.aclose()
            raise
        previous = self.lease.id if self.lease else None
        self.lease = lease
        self._show(lease)
        if self.state_file is not None:
            self.state_file.keep = False
        self.log.info(
            "Kernel %s %s GPU lease %s: %s of %s %s (%s MiB cap)",
            ask.kernel_id,
            "keeps" if previous == lease.id else "holds",
            lease.short_id,
            format_fraction(lease.fraction or ask.fraction),
            lease.gpu.name or "GPU",
            lease.gpu.uuid,
            lease.memory_limit_mb,
        )
        return lease

    def resume(self, lease: GrantedLease, ask: LeaseAsk) -> None:
        """Hold ``lease`` again without asking (a restarted server's saved lease)."""
        self._ask = ask
        self.lease = lease

    def save_state(self) -> None:
        """Write the held lease to the state file (before launch, and after each renewal)."""
        if self.lease is not None:
            self._write_state(self.lease)

    # -- renewals ------------------------------------------------------------------------
    def start_renewing(self, background: BackgroundLoop | None = None) -> None:
        """Start the renewal task, unless it runs already (a restart keeps it).

        It runs on the running loop, or on ``background`` where that loop runs only during
        calls (jupyter_client's blocking ``KernelManager``: see :mod:`.loops`).
        """
        task = self.renew_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            return
        if background is None:
            self.renew_task = asyncio.ensure_future(self._renew_loop())
        else:
            self.renew_task = background.spawn(self._renew_loop())

    async def _renew_loop(self) -> None:
        """Renew once at once (so the broker learns the new kernel's pid, pid namespace and
        cgroup before its first allocation: the node agent attributes it, and sets its
        driver memory limit, from then on), then every renewal interval: renew, or find
        out why not. Runs until the lease ends."""
        if self.lease is not None and not await self.renew_once():
            return
        while self.lease is not None:
            await asyncio.sleep(self.interval())
            if not await self.renew_once():
                return

    def interval(self) -> float:
        """Seconds until the next renewal."""
        if self._ask is not None and self._ask.renew_interval:
            return max(MIN_RENEW_INTERVAL, float(self._ask.renew_interval))
        ttl = self.lease.ttl if self.lease is not None else None
        if ttl is not None:
            return max(MIN_RENEW_INTERVAL, ttl / 3)
        return DEFAULT_RENEW_INTERVAL

    async def renew_once(self) -> bool:
        """One renewal; False when the lease has ended (and the loop must stop)."""
        lease = self.lease
        if lease is None:
            return False
        if self.kernel.kernel_exited_for_good():
            self.log.warning(
                "Kernel %s has exited and nothing will restart it; releasing its GPU lease.",
                self.kernel_id,
            )
            await self.end("the kernel exited")
            return False
        report = self.kernel.kernel_report()
        try:
            fresh = await self.clients.get(renewal=True).leases.renew(
                lease.id,
                Renewal(
                    pid=report.pid,
                    execution_state=report.execution_state,
                    last_activity=report.last_activity,
                    pid_ns=report.pid_ns,
                    cgroup=report.cgroup,
                    proof=self.secret.renewal_proof(lease.id),
                ),
            )
        except InvalidRequest as exc:
            if (
                "proof" in (exc.details.get("fields") or [])
                and not self.secret.broker_without_proofs
            ):
                self.log.warning(
                    "The GPU lease broker is older than kernel proofs (it refused 'proof'): "
                    "kernel %s renews without it; its node agent, if newer, will not count "
                    "it until the broker is upgraded.",
                    self.kernel_id,
                )
                self.secret.broker_without_proofs = True
                return await self.renew_once()
            if not self.holds(lease):
                return False
            return await self._renewal_failed(lease, exc)
        except GPULeaseError as exc:
            if not self.holds(lease):  # ended meanwhile: cancelled on a loop that was blocked
                return False
            return await self._renewal_failed(lease, exc)
        if self.lease is not None and self.lease.id == fresh.id:
            self.hold(fresh)
        return True

    def hold(self, fresh: GrantedLease) -> None:
        """The broker's latest word on the lease held (a renewal's, or a resume's): keep it,
        write the state file, show it; a parked lease's watch starts (once)."""
        self.lease = fresh
        self.park_watch.follow(fresh, self.state_file)
        self._write_state(fresh)
        self._show(fresh)

    async def _renewal_failed(self, lease: GrantedLease, exc: GPULeaseError) -> bool:
        """What a failed renewal of ``lease`` means; False when the lease has ended."""
        if isinstance(exc, (LeaseExpired, LeaseNotFound, LeaseGone)) and lease.parked:
            await self.lost_parked(exc)
            return False
        if isinstance(exc, (LeaseExpired, LeaseNotFound)):
            return await self._recover(exc)
        if isinstance(exc, LeaseGone):
            await self._lost(exc.details.get("state") or "revoked", _reason(exc))
            return False
        if isinstance(exc, BrokerUnavailable):
            problem = "Could not renew GPU lease %s of kernel %s; the kernel keeps running and "
            problem += "the renewal is retried in %g s: %s"
        else:
            problem = "Renewing GPU lease %s of kernel %s failed; retrying in %g s: %s"
        self.log.warning(problem, lease.short_id, self.kernel_id, self.interval(), exc)
        return True

    async def _recover(self, exc: GPULeaseError) -> bool:
        """The lease expired (or the broker forgot it): ask once for the same share again."""
        old = self.lease
        uuid = old.gpu.uuid if old is not None else None
        ask = self._ask or LeaseAsk(kernel_id=self.kernel_id, fraction=0.0)
        self.log.warning(
            "GPU lease %s of kernel %s has ended (%s); asking for %s of the same GPU again.",
            short_id(old.id if old else None),
            self.kernel_id,
            _reason(exc),
            format_fraction(ask.fraction),
        )
        try:
            lease = await self.clients.get().leases.acquire(
                ask.kernel_id,
                ask.fraction,
                node=ask.node,
                gpu_uuids=[uuid] if uuid else (list(ask.gpu_uuids) or None),
                group=ask.group,
                wait=0,
                queue_timeout=0,
                mps_uid=ask.mps_uid,
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
        self.lease = lease
        self._write_state(lease)
        self._show(lease)
        self.log.info(
            "Kernel %s holds GPU lease %s again (%s of GPU %s).",
            self.kernel_id,
            lease.short_id,
            format_fraction(ask.fraction),
            uuid,
        )
        return True

    async def _lost(self, state: str, reason: str) -> None:
        """The broker ended the lease: record why, then shut the kernel down."""
        lease = self.lease
        self.log.warning(
            "GPU lease %s of kernel %s was %s: %s. Shutting the kernel down.",
            short_id(lease.id if lease else None),
            self.kernel_id,
            state,
            reason,
        )
        if lease is not None:
            self._write_state(lease, state=state, reason=reason)
        if self.state_file is not None:
            self.state_file.keep = True  # the reason stays readable after the kernel is gone
        if self.board is not None:
            self.board.end(self.kernel_id, state, reason)  # JupyterLab shows the reason
        self.lease = None
        if self.renew_task is asyncio.current_task():
            self.renew_task = None  # this is the renewal task: shutdown must not cancel it
        self.park_watch.forget_if_caller()  # the same for the resume under way
        try:
            await self.kernel.shut_kernel_down()
        except Exception:
            self.log.exception(
                "Could not shut down kernel %s after losing its lease", self.kernel_id
            )
        await self.end(f"the lease was {state}")

    async def lost_parked(self, exc: GPULeaseError) -> None:
        """A parked lease has ended (a renewal or a resume found it gone): as revoked, with
        the broker's reason and the news that the parked memory is lost."""
        state = "expired" if isinstance(exc, (LeaseExpired, LeaseNotFound)) else None
        await self._lost(state or str(exc.details.get("state") or "revoked"), _parked_reason(exc))

    # -- the end -------------------------------------------------------------------------
    async def end(self, why: str) -> None:
        """Stop renewing, release the lease (errors logged), close the clients. Idempotent.

        ``why`` completes the log line ("Released GPU lease ... of kernel ...: <why>.").
        A second call while one is under way (the kernel died while being shut down) waits
        for the first, where waiting is safe (:func:`.loops.wait_done`), and does nothing
        more: it must not close the clients under the first one's release.
        """
        ending = self._ending
        if ending is not None and not ending.done():
            await wait_done(ending)
            return
        self._ending = ending = asyncio.get_running_loop().create_future()
        try:
            await self._end(why)
        finally:
            ending.set_result(None)

    async def _end(self, why: str) -> None:
        task = self.renew_task
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait(task)
        await self.park_watch.stop()
        self.renew_task = None
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                await self.clients.get().leases.release(lease.id)
            except Exception as exc:  # never raised into a shutdown: the TTL ends the lease
                self.log.warning(
                    "Could not release GPU lease %s of kernel %s (%s); the broker ends it when "
                    "its TTL runs out: %s",
                    lease.short_id,
                    self.kernel_id,
                    why,
                    exc,
                )
            else:
                self.log.info(
                    "Released GPU lease %s of kernel %s: %s.", lease.short_id, self.kernel_id, why
                )
        if self.board is not None and lease is not None:
            self.board.end(self.kernel_id, "released", why)
        if self.state_file is not None:
            self.state_file.remove()
        self.kernel.lease_ended()
        await self.clients.aclose()

    # -- helpers -------------------------------------------------------------------------
    def _show(self, lease: GrantedLease) -> None:
        if self.board is not None:
            fraction = self._ask.fraction if self._ask is not None else 0.0
            if lease.parked:
                progress = self.park_watch.progress or {}
                self.board.parked(
                    self.kernel_id,
                    fraction,
                    lease,
                    state=lease.state,
                    position=progress.get("position"),
                    waiting=progress.get("queue_length"),
                    eta_seconds=progress.get("eta_seconds"),
                )
            else:
                self.board.active(self.kernel_id, fraction, lease)

    def holds(self, lease: GrantedLease) -> bool:
        """Whether ``lease`` is still the one held (its object may have been replaced by a
        fresher answer: renewals and the resume loop both update it)."""
        return self.lease is not None and self.lease.id == lease.id

    @property
    def kernel_id(self) -> str:
        return self._ask.kernel_id if self._ask is not None else "?"

    @property
    def long_poll(self) -> float:
        """The longest the broker may hold one of this kernel's requests (s)."""
        return self._ask.long_poll if self._ask is not None else 30.0

    def kernel_busy(self) -> bool:
        """Whether the kernel is executing now (the park watch resumes a busy kernel)."""
        return self.kernel.kernel_report().execution_state == "busy"

    def _write_state(
        self, lease: GrantedLease, *, state: str | None = None, reason: str | None = None
    ) -> None:
        if self.state_file is not None:
            fraction = self._ask.fraction if self._ask is not None else 0.0
            progress = (self.park_watch.progress or {}) if lease.parked and state is None else {}
            self.state_file.write(
                lease,
                fraction=fraction,
                state=state,
                reason=reason,
                position=progress.get("position"),
                eta_seconds=progress.get("eta_seconds"),
            )


def _reason(exc: GPULeaseError) -> str:
    reason = exc.details.get("reason")
    return str(reason) if reason else exc.message.rstrip(".")


def _parked_reason(exc: GPULeaseError) -> str:
    """Why a parked kernel is shut down: the broker's reason, and that its memory is lost."""
    return (
        f"{_reason(exc)}; this kernel's GPU memory was parked, and with the lease gone it "
        "cannot be restored. Start the kernel again and re-run your notebook"
    )


__all__ = ["KernelHandle", "KernelReport", "LeaseAsk", "LeaseKeeper"]
