"""``launcher='node'``: the lease's node agent launches the kernel (a :class:`~.remote.RemoteKernel`).

The sequence of one start, and who asks whom with what identity:

1. the provisioner (in the student's server, with the server's token: the broker learns
   from JupyterHub that it is the student's) acquires the lease; the broker places it on
   any node of the pool;
2. the provisioner asks the broker, with the same token, to launch the kernel
   (``PUT /api/v1/leases/{id}/kernel``: argv, the environment of :func:`~.remote.
   remote_environment`, the notebook's folder and the HMAC key of the kernel manager's
   session). The broker checks that the token's user holds the lease and that its node's
   agent launches kernels, keeps the launch in memory and wakes the node's orders
   long-poll;
3. the node's agent (its own token, which names its node) heartbeats at once and takes the
   launch from the answer; it checks the lease is its node's and the account exists,
   starts the kernel as the student and reports its address and ports in its next
   heartbeat; the broker forgets the key;
4. the provisioner's long-poll (``GET .../kernel?after=CURSOR``) answers ``running`` with
   the address and ports (or ``failed`` with the node's reason), and jupyter_client
   connects to the kernel as to a local one.

Signals (interrupt, terminate, kill) go the same way (``POST .../kernel/signal``); the
kernel's life is read with ``GET .../kernel`` (``poll``) and its end waited for with the
long-poll (``wait``). Releasing the lease ends the kernel: the node ends the kernels of
leases that ended.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from ..client.answers import NodeKernelAnswer
from ..errors import BrokerUnavailable, GPULeaseError, KernelLaunchFailed, LeaseGone, NotFound
from ..node_report import KernelLaunch
from ..wire import KERNEL_SIGNALS, MAX_WAIT
from .broker_clients import BrokerClients
from .remote import Launched, LaunchJob

#: seconds a launch may wait for the node to answer before the start fails
LAUNCH_TIMEOUT = 120.0
#: seconds a kernel's state read from the broker stays fresh for ``poll``
POLL_FRESH = 0.5


class AgentKernel:
    """One remote kernel launched by its lease's node agent, through the broker."""

    def __init__(self, clients: BrokerClients, launch_timeout: float = LAUNCH_TIMEOUT) -> None:
        self.clients = clients
        self.launch_timeout = launch_timeout
        self.lease_id = ""
        self.generation = 0
        self.node = ""
        self.last: NodeKernelAnswer | None = None
        self._read_at = 0.0

    async def launch(self, job: LaunchJob) -> Launched:
        client = self.clients.get()
        launch = KernelLaunch(
            kernel_id=job.kernel_id,
            argv=tuple(job.argv),
            env=dict(job.env),
            key=job.key,
            cwd=job.cwd,
            signature_scheme=job.signature_scheme,
        )
        answer = await client.leases.launch_kernel(job.lease.id, launch)
        self.lease_id, self.generation, self.node = job.lease.id, answer.generation, answer.node
        deadline = time.monotonic() + self.launch_timeout
        while answer.state == "launching":
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KernelLaunchFailed(
                    f"Node {answer.node} did not start the kernel within "
                    f"{self.launch_timeout:g} s: its agent may be down or busy. Try again, "
                    "or ask an admin to check the node's agent."
                )
            try:
                answer = await client.leases.kernel(
                    job.lease.id, after=answer.cursor, wait=min(remaining, 30.0)
                )
            except BrokerUnavailable:
                await asyncio.sleep(0.5)
        self._keep(answer)
        if answer.generation != self.generation or answer.state != "running":
            why = answer.reason or (
                f"it exited with code {answer.exit_code}"
                if answer.exit_code is not None
                else f"it is {answer.state}"
            )
            raise KernelLaunchFailed(f"The kernel could not start on node {answer.node}: {why}")
        assert answer.ip is not None and answer.ports is not None
        return Launched(
            ip=answer.ip,
            ports=answer.ports,
            node=answer.node,
            cwd=answer.cwd or "",
            cwd_shared=bool(answer.cwd_shared),
            handle=str(answer.generation),
            extra={"pid": answer.pid, "pid_ns": answer.pid_ns, "cgroup": answer.cgroup},
        )

    def _keep(self, answer: NodeKernelAnswer) -> None:
        self.last, self._read_at = answer, time.monotonic()

    def _exit_code(self, answer: NodeKernelAnswer) -> int | None:
        """None while this generation runs; else how it ended (a newer one: ended too)."""
        if answer.generation == self.generation and answer.state in ("launching", "running"):
            return None
        if answer.generation == self.generation and answer.exit_code is not None:
            return answer.exit_code
        return 1 if answer.state == "failed" else -signal.SIGTERM

    async def poll(self) -> int | None:
        if not self.lease_id:
            return 0
        last = self.last
        if last is not None and time.monotonic() - self._read_at < POLL_FRESH:
            return self._exit_code(last)
        try:
            answer = await self.clients.get(renewal=True).leases.kernel(self.lease_id)
        except BrokerUnavailable:
            return None if last is None else self._exit_code(last)  # unknown: as last seen
        except (NotFound, LeaseGone):
            return -signal.SIGKILL  # the lease (and so its kernel) is gone
        self._keep(answer)
        return self._exit_code(answer)

    async def signal(self, signum: int) -> None:
        if not self.lease_id or signum == 0:
            return
        name = signal.Signals(signum).name
        if name not in KERNEL_SIGNALS:
            raise GPULeaseError(f"Signal {name} cannot be sent to a kernel on another node.")
        try:
            self._keep(await self.clients.get().leases.signal_kernel(self.lease_id, name))
        except (NotFound, LeaseGone):
            pass  # the lease ended: its node ends the kernel (or has)
        except GPULeaseError as exc:
            if exc.status != 409:  # 409: it does not run any more (nothing to signal)
                raise

    async def wait(self, timeout: float | None = None) -> int | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            code = await self.poll()
            if code is not None:
                return code
            remaining = MAX_WAIT if deadline is None else deadline - loop.time()
            if remaining <= 0:
                return None
            after = self.last.cursor if self.last is not None else None
            try:
                answer = await self.clients.get(renewal=True).leases.kernel(
                    self.lease_id, after=after, wait=min(remaining, 30.0)
                )
            except BrokerUnavailable:
                await asyncio.sleep(min(0.5, max(remaining, 0)))
                continue
            except (NotFound, LeaseGone):
                return -signal.SIGKILL
            self._keep(answer)

    def to_json(self) -> dict[str, Any]:
        return {
            "launcher": "node",
            "lease_id": self.lease_id,
            "generation": self.generation,
            "node": self.node,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        self.lease_id = str(saved.get("lease_id") or "")
        self.generation = int(saved.get("generation") or 0)
        self.node = str(saved.get("node") or "")


__all__ = ["LAUNCH_TIMEOUT", "AgentKernel"]
