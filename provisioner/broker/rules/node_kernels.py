"""Remote kernels: the kernels node agents launch for their leases (pure, no I/O).

A lease's holder asks the broker to start its kernel on the lease's node
(``PUT /api/v1/leases/{id}/kernel``); the node's agent takes the launch from its next
heartbeat's answer, starts the kernel as the holder's account, and reports it in every
heartbeat after (``remote_kernels``). The broker keeps each lease's latest kernel here,
*in memory only*:

- the launch order (argv, environment, HMAC key) until the agent has reported its
  generation, then never again: the key is in no database, no answer but the node's, no
  log;
- what the agent reports (address, ports, pid, state, exit code, reason): after a broker
  restart or failover it comes back with each agent's next heartbeat;
- signals asked and not yet sent (``seq``), and which generation the node still runs.

Each :class:`NodeKernel` has a *generation*: a restart of the kernel (jupyter_client's
restart: kill, then launch again with the same lease) is generation + 1, and the agent ends
an older generation it still runs (``ends``). The agent also ends the kernel of a lease
that is no longer alive (released, revoked, expired): orders are state, as parking's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ...node_report import KernelLaunch, LaunchOrder, RemoteKernelStatus
from ...wire import REMOTE_KERNEL_ENDED


@dataclass
class NodeKernel:
    """A lease's latest remote kernel, as the broker knows it."""

    lease_id: str
    node: str
    user: str
    generation: int
    #: launching | running | exited | failed (``wire.REMOTE_KERNEL_STATES``)
    state: str
    asked_at: float
    #: the launch, until the agent reported this generation (then None: the key is gone)
    launch: KernelLaunch | None = None
    kernel_id: str = ""
    #: the agent's latest report of this generation
    status: RemoteKernelStatus | None = None
    #: signals asked: ``(seq, name)``, dropped once the agent's ``signaled`` reaches them
    signals: list[tuple[int, str]] = field(default_factory=list)
    next_seq: int = 1
    changed_at: float = 0.0

    @property
    def cursor(self) -> str:
        """What a long-poll compares: the generation and the state."""
        return f"{self.generation}:{self.state}"

    def to_json(self) -> dict[str, Any]:
        """``GET /api/v1/leases/{id}/kernel``: never the launch (its key, its environment)."""
        out: dict[str, Any] = {
            "lease_id": self.lease_id,
            "node": self.node,
            "generation": self.generation,
            "state": self.state,
            "cursor": self.cursor,
        }
        if self.kernel_id:
            out["kernel_id"] = self.kernel_id
        if self.status is not None and self.status.generation == self.generation:
            reported = self.status.to_json()
            for name in ("lease_id", "generation", "state", "signaled"):
                reported.pop(name, None)
            out.update(reported)
        return out


@dataclass
class NodeKernels:
    """Every lease's latest remote kernel, and what each node's agent said last."""

    #: lease id -> its latest kernel
    kernels: dict[str, NodeKernel] = field(default_factory=dict)
    #: node -> whether its agent launches kernels (its last heartbeat's ``launches_kernels``)
    launchers: dict[str, bool] = field(default_factory=dict)
    #: node -> lease id -> the generation its agent last reported running or ended there
    reported: dict[str, dict[str, RemoteKernelStatus]] = field(default_factory=dict)

    def ask(
        self, lease_id: str, node: str, user: str, launch: KernelLaunch, now: float
    ) -> NodeKernel:
        """A new generation of ``lease_id``'s kernel, to be launched on ``node``."""
        old = self.kernels.get(lease_id)
        generation = 1
        if old is not None:
            generation = old.generation + 1
        on_node = self.reported.get(node, {}).get(lease_id)
        if on_node is not None:
            generation = max(generation, on_node.generation + 1)
        kernel = NodeKernel(
            lease_id=lease_id,
            node=node,
            user=user,
            generation=generation,
            state="launching",
            asked_at=now,
            launch=launch,
            kernel_id=launch.kernel_id,
            changed_at=now,
        )
        self.kernels[lease_id] = kernel
        return kernel

    def signal(self, kernel: NodeKernel, name: str) -> int:
        """Queue ``name`` for ``kernel``'s running generation; its ``seq``."""
        seq = kernel.next_seq
        kernel.next_seq += 1
        kernel.signals.append((seq, name))
        return seq

    def read(
        self, node: str, launches: bool | None, statuses: tuple[RemoteKernelStatus, ...], now: float
    ) -> list[str]:
        """A heartbeat's report: which leases' kernels changed (their long-polls wake).

        A report of the latest generation updates it (and drops its launch: the agent has
        it); a report of a lease the broker has no kernel for (it restarted, or failed
        over) is adopted; signals the agent has sent are dropped."""
        self.launchers[node] = bool(launches)
        self.reported[node] = {s.lease_id: s for s in statuses}
        changed: list[str] = []
        for status in statuses:
            kernel = self.kernels.get(status.lease_id)
            if kernel is None or status.generation > kernel.generation:
                kernel = NodeKernel(
                    lease_id=status.lease_id,
                    node=node,
                    user="",
                    generation=status.generation,
                    state=status.state,
                    asked_at=now,
                    status=status,
                    changed_at=now,
                    next_seq=status.signaled + 1,
                )
                self.kernels[status.lease_id] = kernel
                changed.append(status.lease_id)
                continue
            if status.generation != kernel.generation or kernel.node != node:
                continue  # an older generation, which the answer ends
            kernel.launch = None  # the agent has it: the key leaves the broker's memory
            kernel.signals = [(q, s) for q, s in kernel.signals if q > status.signaled]
            if kernel.status != status or kernel.state != status.state:
                moved = kernel.state != status.state
                kernel.status = status
                kernel.state = status.state
                if moved:
                    kernel.changed_at = now
                    changed.append(status.lease_id)
        return changed

    def fail(self, lease_id: str, reason: str, now: float) -> NodeKernel | None:
        """A launch that can no longer happen (its node left, its lease ended first)."""
        kernel = self.kernels.get(lease_id)
        if kernel is None or kernel.state != "launching":
            return None
        kernel.launch = None
        kernel.state = "failed"
        kernel.status = RemoteKernelStatus(lease_id, kernel.generation, "failed", reason=reason)
        kernel.changed_at = now
        return kernel

    def orders(self, node: str, alive: dict[str, float]) -> dict[str, Any]:
        """The answer's remote-kernel orders for ``node``: kernels to launch, signals to send,
        kernels to end, and when each alive kernel's lease expires.

        ``alive``: lease id -> expiry of the node's leases that are alive (active or
        parked). A kernel whose lease is not alive, or whose generation is older than the
        lease's latest, is ended."""
        launch: list[dict[str, Any]] = []
        signals: list[dict[str, Any]] = []
        for kernel in sorted(self.kernels.values(), key=lambda k: k.lease_id):
            if kernel.node != node or kernel.lease_id not in alive:
                continue
            if kernel.state == "launching" and kernel.launch is not None:
                launch.append(
                    LaunchOrder(
                        kernel.lease_id, kernel.generation, kernel.user, kernel.launch
                    ).to_json()
                )
            if kernel.state == "running":
                signals += [
                    {
                        "lease_id": kernel.lease_id,
                        "generation": kernel.generation,
                        "seq": seq,
                        "signal": name,
                    }
                    for seq, name in kernel.signals
                ]
        ends: list[dict[str, Any]] = []
        expiry: dict[str, float] = {}
        for lease_id, status in sorted(self.reported.get(node, {}).items()):
            if status.state in REMOTE_KERNEL_ENDED:
                continue
            latest = self.kernels.get(lease_id)
            if lease_id not in alive or (
                latest is not None and latest.generation > status.generation
            ):
                ends.append({"lease_id": lease_id, "generation": status.generation})
            else:
                expiry[lease_id] = alive[lease_id]
        return {
            "launch": launch,
            "kernel_signals": signals,
            "kernel_ends": ends,
            "kernel_expiry": expiry,
        }

    def forget(self, alive: set[str]) -> None:
        """Drop the kernels of leases no longer alive once no node reports them running."""
        running = {
            lease_id
            for statuses in self.reported.values()
            for lease_id, s in statuses.items()
            if s.state not in REMOTE_KERNEL_ENDED
        }
        for lease_id in list(self.kernels):
            if lease_id not in alive and lease_id not in running:
                del self.kernels[lease_id]

    def on(self, lease_id: str) -> NodeKernel | None:
        return self.kernels.get(lease_id)

    def remote(self, lease_id: str) -> bool:
        """Whether the lease's kernel is (or is being) launched by its node (never parked:
        its resume requests would come from a server the node cannot see)."""
        kernel = self.kernels.get(lease_id)
        return kernel is not None and kernel.state in ("launching", "running")


def unfinished(kernel: NodeKernel) -> NodeKernel:
    """A copy safe to hand out of the lock (its signals' list is the book's)."""
    return replace(kernel, signals=list(kernel.signals))


__all__ = ["NodeKernel", "NodeKernels", "unfinished"]
