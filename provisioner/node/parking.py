"""Parking on the node: the agent's side of the broker's park and resume orders.

Who calls what: :func:`provisioner.node.agent.run_agent` opens one :class:`Parker` when the
agent starts (:meth:`Parker.open`: one long-lived :class:`~.checkpoint.CudaCheckpoint`
handle, or none where the driver cannot checkpoint). Each heartbeat's answer carries the
broker's ``orders`` (``{lease_id, action: park|resume, pid, pid_ns, gpu_uuid,
memory_mb}``, repeated until an outcome settles them); the agent hands them to
:meth:`Parker.take`, which runs each in the Parker's one worker thread (a checkpoint of
GiBs takes seconds: the heartbeat loop never waits for it), at most one at a time per
lease. Outcomes (``{lease_id, action, outcome: done|failed|waiting, message?, pids, mb,
seconds}``) wait in :meth:`Parker.outcomes` for the next heartbeat and are dropped by
:meth:`Parker.delivered` only once a heartbeat carried them (a broker that is down gets
them again later).

*Park* acts on the kernel's GPU processes: those of a fresh NVML sample that are the
kernel's host pid or descend from it (:class:`~.pidns.KernelFinder`, pid namespaces
included). A kernel with none parks trivially (done, no pids). Park refuses when the
node's MemAvailable less ``host_reserve_mb`` cannot hold the processes' GPU memory (the
checkpoint lands in the kernel's host memory), and a checkpoint that fails is unlocked
again (the kernel runs on; the broker then reclaims it). *Resume* walks the kernel's host
pid and its descendants in ``/proc`` and restores those the driver holds CHECKPOINTED or
LOCKED, so an agent restarted while a kernel is parked still restores it. Before a
restore the GPU must have the memory free (NVML): a restore that lacks it hangs the
process for good (NVIDIA/cuda-checkpoint#44), so the outcome is ``waiting`` instead and
the broker repeats the order. Both are idempotent: a park of processes already
CHECKPOINTED is done, a resume of running ones is done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import GPULeaseError
from ..node_report import NodeParkReport, ParkOutcome
from ..wire import PARK_ACTIONS
from .checkpoint import LIBRARY, CheckpointFailed, CudaCheckpoint, ProcessState, open_checkpoint
from .feature import Beat, Proven
from .pidns import KernelFinder, ns_pid_of, parent_of, pid_ns_of

log = logging.getLogger("gpu_lease.agent")

#: host memory (MiB) that parking leaves to everything else on the node
DEFAULT_HOST_RESERVE_MB = 2048

#: ``(pid, gpu_uuid, used_mb)`` per GPU process, as the agent samples (agent.Sample)
Sample = list[tuple[int, str, int]]


def host_memory_available_mb(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of ``/proc/meminfo`` in MiB (heartbeat ``host_memory_available_mb``);
    None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(root: int, proc: str = "/proc") -> list[int]:
    """The pids descending from ``root`` (children, their children, ...), from one scan of
    the parents in ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    for name in names:
        if name.isdigit():
            parent = parent_of(int(name), proc)
            if parent is not None:
                children.setdefault(parent, []).append(int(name))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out and pid != root:
            out.append(pid)
            todo.extend(children.get(pid, []))
    return sorted(out)


def host_pid(pid: int, pid_ns: int | None, proc: str = "/proc") -> int | None:
    """The host pid of a kernel the broker names by ``(pid, pid_ns)`` (as its provisioner
    saw it), or None when no such process lives here."""
    if pid_ns is None or (pid_ns_of(pid, proc) == pid_ns and ns_pid_of(pid, proc) == pid):
        return pid if os.path.exists(f"{proc}/{pid}") else None
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    for name in names:
        matches = name.isdigit() and pid_ns_of(name, proc) == pid_ns
        if matches and ns_pid_of(int(name), proc) == pid:
            return int(name)
    return None


@dataclass
class _Parked:
    """What this agent parked for one lease (to report and to check free memory on resume)."""

    pids: list[int]
    mb_by_gpu: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Order:
    """One park or resume order of a heartbeat's answer."""

    lease_id: str
    action: str
    pid: int | None
    pid_ns: int | None
    gpu_uuid: str
    memory_mb: int

    @classmethod
    def parse(cls, raw: Any) -> Order | None:
        """The order, or None (logged) when the broker sent something this agent cannot
        read: it is never acted on."""
        try:
            action = str(raw["action"])
            if action not in PARK_ACTIONS:
                raise ValueError(f"unknown action {action!r}")
            pid = raw.get("pid")
            ns = raw.get("pid_ns")
            return cls(
                lease_id=str(raw["lease_id"]),
                action=action,
                pid=int(pid) if pid is not None else None,
                pid_ns=int(ns) if ns is not None else None,
                gpu_uuid=str(raw.get("gpu_uuid") or ""),
                memory_mb=int(raw.get("memory_mb") or 0),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("Ignoring a park/resume order this agent cannot read (%s): %r", exc, raw)
            return None


def _short(lease_id: str) -> str:
    return lease_id[:6]


class Parker:
    """Runs the broker's park and resume orders on this node, one worker thread, one handle.

    ``handle``: the driver's checkpoint API (None: this node cannot park; ``reason`` says
    why, and every order fails with it). ``sample``: a fresh NVML sample (the agent's
    sampler); ``free_mb``: a GPU uuid's free memory in MiB (None: unknown). Made by
    :meth:`open` in the agent; tests make one on the stand-in libcuda and NVML.
    """

    def __init__(
        self,
        handle: CudaCheckpoint | None,
        reason: str,
        sample: Callable[[], Sample],
        free_mb: Callable[[str], int | None],
        *,
        host_reserve_mb: int = DEFAULT_HOST_RESERVE_MB,
        meminfo: str = "/proc/meminfo",
        proc: str = "/proc",
    ) -> None:
        self.handle = handle
        self.reason = reason
        self.sample = sample
        self.free_mb = free_mb
        self.host_reserve_mb = host_reserve_mb
        self.meminfo = meminfo
        self.proc = proc
        #: set when a done/failed outcome is ready: the agent heartbeats at once
        self.ready = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpu-lease-park")
        # the event loop's side: leases with an order running, outcomes not yet delivered
        self._busy: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._pending: dict[tuple[str, str], dict[str, Any]] = {}
        # the worker thread's side: what it parked, per lease; the last waiting said
        self._parked: dict[str, _Parked] = {}
        self._said_waiting: dict[str, str] = {}

    @classmethod
    def open(
        cls,
        sample: Callable[[], Sample],
        free_mb: Callable[[str], int | None],
        *,
        enabled: bool = True,
        library: str = LIBRARY,
        host_reserve_mb: int = DEFAULT_HOST_RESERVE_MB,
    ) -> Parker:
        """The agent's Parker: the driver's handle opened once (its verdict logged)."""
        if not enabled:
            handle, reason = None, "parking is turned off on this node (--no-park)"
        else:
            handle, verdict = open_checkpoint(library)
            reason = verdict.reason
        if handle is not None:
            log.info("Parking idle kernels: %s (CUDA API %s)", reason, handle.driver_api)
        else:
            log.info("Parking idle kernels: no; %s", reason)
        return cls(handle, reason, sample, free_mb, host_reserve_mb=host_reserve_mb)

    @property
    def supported(self) -> bool:
        """Heartbeat ``checkpoint``: whether kernels here can be parked."""
        return self.handle is not None

    # -- the event loop's side -------------------------------------------------------
    def take(self, orders: list[Any]) -> None:
        """Start each order of a heartbeat's answer that is not running already, nor settled
        by an outcome waiting for delivery (the broker repeats an order until then)."""
        loop = asyncio.get_running_loop()
        for raw in orders:
            order = Order.parse(raw)
            if order is None or order.lease_id in self._busy:
                continue
            settled = self._pending.get((order.lease_id, order.action))
            if settled is not None and settled["outcome"] != "waiting":
                continue
            future = loop.run_in_executor(self._executor, self._run, order)
            self._busy[order.lease_id] = future
            future.add_done_callback(functools.partial(self._finished, order))

    def refuse(self, raw: Any, why: str) -> None:
        """Settle an order of a kernel the agent did not prove as failed at once,
        with ``why``: nothing is checkpointed or restored, and the broker reclaims the lease
        as it would without parking (rather than after its ``park_timeout``)."""
        order = Order.parse(raw)
        if order is None or order.lease_id in self._busy:
            return
        if (order.lease_id, order.action) in self._pending:
            return
        message = f"the node agent did not prove this lease's kernel: {why}"
        self._pending[(order.lease_id, order.action)] = self._outcome(order, "failed", message)
        self.ready.set()

    def _finished(self, order: Order, future: asyncio.Future[dict[str, Any]]) -> None:
        self._busy.pop(order.lease_id, None)
        if future.cancelled():
            return
        outcome = future.result()  # _run never raises
        self._pending[(order.lease_id, order.action)] = outcome
        if outcome["outcome"] != "waiting":
            self.ready.set()

    def outcomes(self) -> list[dict[str, Any]]:
        """Heartbeat ``parking``: the outcomes not yet delivered (copies)."""
        return [dict(o) for o in self._pending.values()]

    def delivered(self, sent: list[dict[str, Any]]) -> None:
        """A heartbeat carrying ``sent`` succeeded: drop those (not newer ones since)."""
        for outcome in sent:
            key = (outcome["lease_id"], outcome["action"])
            if self._pending.get(key) == outcome:
                del self._pending[key]

    async def close(self) -> None:
        """Wait for the order in progress (a process is never left LOCKED by a stop)."""
        for future in list(self._busy.values()):
            future.cancel()  # those queued behind the running one do not start
        await asyncio.to_thread(self._executor.shutdown, True)

    # -- the worker thread's side ----------------------------------------------------
    def _run(self, order: Order) -> dict[str, Any]:
        """One order to its outcome; never raises (an unexpected error is a failure)."""
        try:
            if self.handle is None:
                return self._outcome(order, "failed", f"this node cannot park: {self.reason}")
            if order.action == "park":
                return self._park(order, self.handle)
            return self._resume(order, self.handle)
        except Exception as exc:  # noqa: BLE001 - reported to the broker, which reclaims
            log.exception("The %s of lease %s failed", order.action, _short(order.lease_id))
            return self._outcome(order, "failed", f"the node agent's {order.action} failed: {exc}")

    @staticmethod
    def _outcome(
        order: Order,
        outcome: str,
        message: str | None = None,
        pids: list[int] | None = None,
        mb: int = 0,
        seconds: float = 0.0,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lease_id": order.lease_id,
            "action": order.action,
            "outcome": outcome,
            "pids": pids or [],
            "mb": mb,
            "seconds": round(seconds, 3),
        }
        if message:  # the broker takes a reason of at most 500 characters
            out["message"] = message if len(message) <= 500 else message[:499] + "…"
        return out

    @staticmethod
    def _state(handle: CudaCheckpoint, pid: int) -> ProcessState | None:
        """The driver's state of ``pid``; None for a process it does not know (no CUDA)."""
        try:
            return handle.state(pid)
        except CheckpointFailed:
            return None

    def _kernel_usage(self, order: Order) -> tuple[dict[int, int], dict[str, int]]:
        """The kernel's GPU processes in a fresh sample: MiB per pid and per GPU."""
        find = KernelFinder(
            {(order.pid, order.pid_ns)} if order.pid is not None else set(), self.proc
        )
        by_pid: dict[int, int] = {}
        by_gpu: dict[str, int] = {}
        for pid, uuid, used in self.sample():
            if find(pid) is not None:
                by_pid[pid] = by_pid.get(pid, 0) + used
                by_gpu[uuid] = by_gpu.get(uuid, 0) + used
        return by_pid, by_gpu

    def _park(self, order: Order, handle: CudaCheckpoint) -> dict[str, Any]:
        lease = _short(order.lease_id)
        if order.pid is None:
            return self._outcome(
                order,
                "failed",
                "the broker does not know this kernel's pid yet, so its GPU processes "
                "cannot be found: it is reclaimed instead.",
            )
        try:
            used, by_gpu = self._kernel_usage(order)
        except GPULeaseError as exc:
            return self._outcome(order, "failed", exc.message)
        if not used:
            log.info("Parked lease %s: its kernel has no GPU process (nothing to move)", lease)
            return self._outcome(order, "done")
        states = {pid: self._state(handle, pid) for pid in sorted(used)}
        todo = [pid for pid, s in states.items() if s is not ProcessState.CHECKPOINTED]
        if not todo:  # parked already (a repeated order): done, as it was
            known = self._parked.get(order.lease_id)
            mb = sum(known.mb_by_gpu.values()) if known else 0
            return self._outcome(order, "done", pids=sorted(used), mb=mb)
        need = sum(used[pid] for pid in todo)
        available = host_memory_available_mb(self.meminfo)
        if available is not None and available - self.host_reserve_mb < need:
            return self._outcome(
                order,
                "failed",
                f"the node has {available} MiB of host memory available and keeps "
                f"{self.host_reserve_mb} MiB in reserve: too little to hold the kernel's "
                f"{need} MiB of GPU memory, so it is not parked.",
            )
        started = time.perf_counter()
        done: list[int] = []
        for pid in todo:
            try:
                if states[pid] is ProcessState.LOCKED:  # locked by an earlier, cut-off try
                    handle.checkpoint(pid)
                elif states[pid] is ProcessState.RUNNING:
                    handle.park(pid)
                else:
                    state = states[pid]
                    raise CheckpointFailed(
                        f"process {pid} is {state.name if state else 'unknown to the driver'}"
                        " and cannot be checkpointed.",
                        pid=pid,
                        step="state",
                        state=state,
                    )
            except CheckpointFailed as exc:
                self._unlock(handle, pid)
                self._undo(handle, done)
                log.warning("Parking lease %s failed: %s", lease, exc)
                return self._outcome(
                    order,
                    "failed",
                    f"{_step_failed(exc)}; the process was unlocked and runs on with its GPU "
                    "memory.",
                    pids=[pid],
                    mb=need,
                )
            done.append(pid)
        seconds = time.perf_counter() - started
        known = self._parked.setdefault(order.lease_id, _Parked([]))
        known.pids = sorted(set(known.pids) | set(done))
        for uuid, mb in by_gpu.items():
            known.mb_by_gpu[uuid] = known.mb_by_gpu.get(uuid, 0) + mb
        log.info(
            "Parked lease %s: pids %s, %d MiB in %.2f s",
            lease,
            " ".join(map(str, done)),
            need,
            seconds,
        )
        return self._outcome(order, "done", pids=sorted(used), mb=need, seconds=seconds)

    def _unlock(self, handle: CudaCheckpoint, pid: int) -> None:
        """After a failed step: a process left LOCKED runs on (its CUDA calls go on)."""
        if self._state(handle, pid) is ProcessState.LOCKED:
            try:
                handle.unlock(pid)
            except CheckpointFailed as exc:
                log.error("Could not unlock GPU process %d after a failed park: %s", pid, exc)

    def _undo(self, handle: CudaCheckpoint, pids: list[int]) -> None:
        """A kernel parked only in part runs on whole: its parked processes are restored
        (the lease still holds their memory while it is parking)."""
        for pid in pids:
            try:
                handle.resume(pid)
            except CheckpointFailed as exc:
                log.error("Could not restore GPU process %d after a failed park: %s", pid, exc)

    def _resume(self, order: Order, handle: CudaCheckpoint) -> dict[str, Any]:
        lease = _short(order.lease_id)
        known = self._parked.get(order.lease_id)
        root = host_pid(order.pid, order.pid_ns, self.proc) if order.pid is not None else None
        candidates = set(known.pids if known else [])
        if root is not None:
            candidates |= {root, *descendants(root, self.proc)}
        candidates = {pid for pid in candidates if os.path.exists(f"{self.proc}/{pid}")}
        if not candidates and order.pid is not None:
            return self._outcome(
                order,
                "failed",
                f"the kernel's process {order.pid} is gone from this node: nothing to resume.",
            )
        states = {pid: self._state(handle, pid) for pid in sorted(candidates)}
        broken = [pid for pid, s in states.items() if s is ProcessState.FAILED]
        if broken:
            return self._outcome(
                order,
                "failed",
                f"the driver holds process(es) {', '.join(map(str, broken))} FAILED: they "
                "cannot be resumed; the kernel has to be restarted.",
                pids=broken,
            )
        parked = [pid for pid, s in states.items() if s is ProcessState.CHECKPOINTED]
        locked = [pid for pid, s in states.items() if s is ProcessState.LOCKED]
        if not parked and not locked:  # running already (resumed before, or never parked)
            self._parked.pop(order.lease_id, None)
            return self._outcome(order, "done")
        if parked:
            need = dict(known.mb_by_gpu) if known else {order.gpu_uuid: order.memory_mb}
            for uuid, mb in sorted(need.items()):
                free = self.free_mb(uuid)
                if free is None or free < mb:
                    said = "cannot be read" if free is None else f"is {free} MiB"
                    message = (
                        f"GPU {uuid}'s free memory {said}; the kernel's {mb} MiB must fit "
                        "before it is restored (a process outside the leases may hold it)."
                    )
                    again = self._said_waiting.get(lease) == message
                    self._said_waiting[lease] = message
                    level = logging.DEBUG if again else logging.INFO
                    log.log(level, "Resume of lease %s waits: %s", lease, message)
                    return self._outcome(order, "waiting", message, pids=parked)
        self._said_waiting.pop(lease, None)
        started = time.perf_counter()
        for pid in parked + locked:
            try:
                handle.resume(pid)
            except CheckpointFailed as exc:
                log.warning("Resuming lease %s failed: %s", lease, exc)
                return self._outcome(order, "failed", f"{_step_failed(exc)}.", pids=[pid])
        seconds = time.perf_counter() - started
        pids = sorted(parked + locked)
        try:
            mb = sum(used for pid, _, used in self.sample() if pid in set(pids))
        except GPULeaseError:
            mb = sum(known.mb_by_gpu.values()) if known else 0
        self._parked.pop(order.lease_id, None)
        log.info(
            "Resumed lease %s: pids %s, %d MiB in %.2f s",
            lease,
            " ".join(map(str, pids)),
            mb,
            seconds,
        )
        return self._outcome(order, "done", pids=pids, mb=mb, seconds=seconds)


# -- the feature: parking in each heartbeat ---------------------------------------------

#: the heartbeat fields of parking; a broker older than parking refuses them
PARK_FIELDS = frozenset({"checkpoint", "host_memory_available_mb", "parking"})
#: seconds before a broker that refused them is offered the parking fields again
PARK_FIELDS_RETRY = 600.0


def proven_orders(
    orders: list[Any], proven: dict[str, Proven], refused: dict[str, str]
) -> tuple[list[Any], list[tuple[Any, str]]]:
    """The park/resume orders to run: those of proven kernels, naming each by its host pid
    (and those that name no kernel, which move nothing); and those of refused claims, with
    why, which fail at once (:meth:`Parker.refuse`)."""
    run: list[Any] = []
    fail: list[tuple[Any, str]] = []
    for raw in orders:
        lease_id = str(raw.get("lease_id")) if isinstance(raw, dict) else ""
        p = proven.get(lease_id)
        if p is not None:
            run.append({**raw, "pid": p.host_pid, "pid_ns": None})
        elif lease_id in refused:
            fail.append((raw, refused[lease_id]))
        elif isinstance(raw, dict) and raw.get("pid") is None:
            run.append(raw)
    return run, fail


class Parking:
    """Parking as a node feature: each heartbeat says whether this node can park kernels
    (``checkpoint``) and its host memory available, with the outcomes of the orders not
    yet delivered; the answer's park/resume ``orders`` go to the parker's worker thread
    (those of proven kernels; one of a refused claim fails at once). A broker older than
    parking refuses those fields once, and is then sent none of them for
    :data:`PARK_FIELDS_RETRY` seconds (it may be upgraded meanwhile). ``ready`` is set
    when an outcome is ready (the next beat goes at once)."""

    def __init__(self, parker: Parker, clock: Callable[[], float] = time.monotonic) -> None:
        self.parker = parker
        self.ready: asyncio.Event | None = parker.ready
        self.clock = clock
        self.wire = True
        #: when a broker older than parking refused its fields
        self.refused_at: float | None = None
        self.said_older = False
        #: the outcomes the last report carried (dropped once delivered)
        self.sent: list[dict[str, Any]] = []

    async def observe(self, beat: Beat) -> None:
        pass

    def report(self, beat: Beat) -> NodeParkReport | None:
        self.sent = []
        if self.refused_at is not None and self.clock() - self.refused_at >= PARK_FIELDS_RETRY:
            self.wire, self.refused_at = True, None
        part = None
        if self.wire:
            self.sent = self.parker.outcomes()
            part = NodeParkReport(
                self.parker.supported,
                host_memory_available_mb(),
                tuple(_outcome(o) for o in self.sent),
            )
        self.parker.ready.clear()  # what is ready now goes with this beat
        return part

    async def answer(self, beat: Beat, answer: dict[str, Any]) -> None:
        self.parker.delivered(self.sent)
        orders = list(answer.get("orders") or [])
        if beat.claims:
            run, fail = proven_orders(orders, beat.proven, beat.refusals)
        else:  # a broker older than proofs: its orders as they are
            run, fail = orders, []
        self.parker.take(run)
        for raw, why in fail:
            self.parker.refuse(raw, why)

    def offered(self) -> frozenset[str]:
        return PARK_FIELDS if self.wire else frozenset()

    def refused(self, fields: set[str], node: str) -> None:
        if not self.wire or not fields & PARK_FIELDS:
            return
        log.log(
            logging.DEBUG if self.said_older else logging.WARNING,
            "The broker is older than parking (it refused %s): kernels on node %s are "
            "reclaimed, not parked, until the broker is upgraded.",
            ", ".join(sorted(fields & PARK_FIELDS)),
            node,
        )
        self.said_older = True
        self.wire, self.refused_at = False, self.clock()


def _outcome(raw: dict[str, Any]) -> ParkOutcome:
    """One of :meth:`Parker.outcomes` as the report carries it."""
    return ParkOutcome(
        lease_id=raw["lease_id"],
        action=raw["action"],
        outcome=raw["outcome"],
        message=raw.get("message"),
        pids=tuple(raw.get("pids") or ()),
        mb=raw.get("mb"),
        seconds=raw.get("seconds"),
    )


__all__ = [
    "DEFAULT_HOST_RESERVE_MB",
    "PARK_FIELDS",
    "PARK_FIELDS_RETRY",
    "Order",
    "Parker",
    "Parking",
    "proven_orders",
    "descendants",
    "host_memory_available_mb",
    "host_pid",
]


def _step_failed(exc: CheckpointFailed) -> str:
    """``exc`` as one clause that names its step once and no state the agent has since
    changed (a failed park is unlocked before it is reported)."""
    text = str(exc).split(" (the process is now", 1)[0].rstrip(".")
    return text if text.startswith(exc.step) else f"{exc.step} failed: {text}"
