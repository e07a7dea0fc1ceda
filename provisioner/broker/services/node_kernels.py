"""Remote kernels, the holder's side: ``PUT``/``GET /api/v1/leases/{id}/kernel`` and
``POST /api/v1/leases/{id}/kernel/signal``.

Who calls this: the HTTP handlers (``service.kernels``). The node's side (the agent takes
launches, signals and ends from its heartbeat's answer and reports its kernels) is the
node feature ``RemoteKernels`` in :mod:`.node_features`; both keep
:class:`~provisioner.broker.rules.node_kernels.NodeKernels`, in memory only.

Who may launch what: only the lease's holder (not an admin: the kernel runs as the
holder's account), only for an active lease (not parked), only on the node that holds the
lease's GPU, and only where that node's agent launches kernels. The broker relays the
launch to that node's agent alone (its token names the node); no node listens for
launches. Every refusal is logged with who asked.
"""

from __future__ import annotations

import asyncio
import logging

from ...errors import Conflict, Forbidden, LeaseNotFound, NotFound
from ...model import Identity, Lease
from ...node_report import KernelLaunch
from ..rules import node_rules
from ..rules.node_kernels import NodeKernel, unfinished
from .service_core import ServiceCore, check_owner

log = logging.getLogger("gpu_lease.broker")


class NodeKernelService:
    """The holders' remote kernels: launch, state (with its long-poll), signals."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    async def _lease(self, ident: Identity, lease_id: str) -> Lease:
        lease = self.core.state.find_lease(lease_id)
        if lease is None:
            lease = await self.core.adopt(ident, lease_id)  # 404, 410, or adopted
        return lease

    async def launch(self, ident: Identity, lease_id: str, launch: KernelLaunch) -> NodeKernel:
        """``PUT /api/v1/leases/{id}/kernel``: start the lease's kernel on its node.

        A new generation each time (a restart): the node ends the older one first.
        Refusals: another user's lease is 404 like an unknown id (an admin's too: the
        kernel would run as someone else's account), an ended one 410, a parked one,
        one on a node without a launching agent, or on a lost node, 409."""
        await self.core.ready()
        lease = await self._lease(ident, lease_id)
        if lease.user != ident.user:
            log.warning(
                "Refused a kernel launch for lease %s… by %s: the lease is %s's",
                lease_id[:6],
                ident.user,
                lease.user,
            )
            if ident.admin:
                raise Forbidden(
                    f"Only the holder of lease {lease_id} ({lease.user}) may launch its "
                    "kernel: it runs as their account."
                )
            check_owner(ident, lease)
        if lease.park is not None:
            raise Conflict(
                f"Lease {lease_id} is {lease.park}; resume it before launching its kernel."
            )
        node = node_rules.node_of(self.core.state, self.core.nodes, lease.gpu_uuid)
        if node is None:
            raise Conflict(
                f"No node agent reports GPU {lease.gpu_uuid} of lease {lease_id}, so no "
                "node can launch its kernel; start the kernel beside the server "
                "(launcher 'local') or register the node's agent."
            )
        book = self.core.node_kernels
        if not book.launchers.get(node.name):
            log.warning(
                "Refused a kernel launch for lease %s… of %s: node %s's agent does not "
                "launch kernels",
                lease_id[:6],
                ident.user,
                node.name,
            )
            raise Conflict(
                f"Node {node.name}'s agent does not launch kernels; its admin starts it with "
                "`gpu-lease agent --launch-kernels`, or the kernel runs beside the server "
                "(launcher 'local')."
            )
        now = self.core.clock()
        state = node_rules.node_state(node, now, self.core.policy)
        if state == "lost":
            raise Conflict(
                f"Node {node.name}'s agent has not been heard from for "
                f"{now - node.last_seen:.0f} s; its kernels cannot start now. Try again "
                "later, or ask an admin."
            )
        kernel = book.ask(lease.id, node.name, lease.user, launch, now)
        log.info(
            "Kernel %s of %s (lease %s…) to be launched on node %s (generation %d)",
            launch.kernel_id,
            lease.user,
            lease.id[:6],
            node.name,
            kernel.generation,
        )
        self.core.polls.wake_orders([node.name])
        self.core.polls.wake_kernels([lease.id])
        return unfinished(kernel)

    def _kernel(self, lease: Lease) -> NodeKernel:
        kernel = self.core.node_kernels.on(lease.id)
        if kernel is None:
            raise NotFound(
                f"No kernel was launched on a node for lease {lease.id}; its provisioner "
                "launches one with PUT /api/v1/leases/{id}/kernel."
            )
        return kernel

    async def kernel(
        self, ident: Identity, lease_id: str, after: str | None = None, timeout: float = 0.0
    ) -> NodeKernel:
        """``GET /api/v1/leases/{id}/kernel?after=CURSOR&timeout=S``: the lease's remote
        kernel; with ``after``, once its cursor (generation and state) differs, or after
        ``timeout`` s. The holder or an admin; a lease that ended still answers for its
        last kernel (the node ends it)."""
        await self.core.ready()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with self.core.polls.for_kernel(lease_id) as waiter:
            while True:
                self.core.check_serving()
                kernel = await self._visible(ident, lease_id)
                remaining = deadline - loop.time()
                if after is None or kernel.cursor != after or remaining <= 0:
                    return unfinished(kernel)
                await waiter.pause(remaining)

    async def _visible(self, ident: Identity, lease_id: str) -> NodeKernel:
        lease = self.core.state.find_lease(lease_id)
        book = self.core.node_kernels
        kernel = book.on(lease_id)
        if lease is not None:
            check_owner(ident, lease)
            kernel = self._kernel(lease)
        else:
            if kernel is None or (kernel.user != ident.user and not ident.admin):
                raise LeaseNotFound(f"No GPU lease has the id {lease_id!r}.")
            if kernel.state == "launching":  # the lease ended before the node took it
                ended = "its lease ended before the node started it"
                kernel = book.fail(lease_id, ended, self.core.clock()) or kernel
        if kernel.state == "launching":
            node = self.core.nodes.get(kernel.node)
            now = self.core.clock()
            if node is None or node_rules.node_state(node, now, self.core.policy) == "lost":
                silent = f"node {kernel.node}'s agent stopped answering before it started it"
                kernel = book.fail(lease_id, silent, now) or kernel
        return kernel

    async def signal(self, ident: Identity, lease_id: str, name: str) -> NodeKernel:
        """``POST /api/v1/leases/{id}/kernel/signal {signal}``: the node sends ``signal`` to
        the running kernel's process group (the holder or an admin; 409 when it does not
        run)."""
        await self.core.ready()
        lease = await self._lease(ident, lease_id)
        check_owner(ident, lease)
        kernel = self._kernel(lease)
        if kernel.state != "running":
            raise Conflict(
                f"The kernel of lease {lease_id} is {kernel.state}, not running; nothing to "
                f"send {name} to."
            )
        self.core.node_kernels.signal(kernel, name)
        self.core.polls.wake_orders([kernel.node])
        return unfinished(kernel)


__all__ = ["NodeKernelService"]
