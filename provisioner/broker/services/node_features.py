"""The node features on the broker's side: each reads its part of a node heartbeat's
report (:mod:`provisioner.node_report`) and adds its part of the answer.

:meth:`~provisioner.broker.services.nodes.NodeService.node_heartbeat` calls every feature of
:func:`node_features` at four points, in the list's order:

1. ``check(node, mine, report)``: refuse (403, 400) what the agent may not report, before
   anything changes;
2. ``read(node, report)``: keep what the agent said (in memory), after the node's usage;
3. ``settle(node, report)``: change the leases its part settles (awaited, after the usage
   is accounted);
4. ``answer(node, here, parked)``: its fields of the heartbeat's answer (``here``: the
   node's active leases; ``parked``: its parked ones).

The kernels' place and the usage accounting are the node service's own. A new feature adds
its class here and to :func:`node_features` (docs/developers.md, "Add a node feature").
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ...errors import Forbidden
from ...model import GPU, Lease, Node
from ...node_report import (
    DriverLimitsReport,
    KernelReport,
    MPSReport,
    NodeParkReport,
    NodeReport,
    RemoteKernelsReport,
)
from .park_orders import ParkOrders
from .service_core import NodeParking, ServiceCore

log = logging.getLogger("gpu_lease.broker")


class NodeFeature(Protocol):
    """One node feature's part of a heartbeat, on the broker's side."""

    def check(self, node: Node, mine: dict[str, GPU], report: NodeReport) -> None: ...

    def read(self, node: Node, report: NodeReport) -> None: ...

    async def settle(self, node: Node, report: NodeReport) -> None: ...

    def answer(self, node: Node, here: list[Lease], parked: list[Lease]) -> dict[str, Any]: ...


class KernelProofs:
    """Proven kernels and refused claims (``kernels``, ``refused``): a refusal is logged
    and counted once per (lease, reason); the answer's ``kernels`` are the node's lease
    kernels as claimed (with the proof the agent checks)."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def check(self, node: Node, mine: dict[str, GPU], report: NodeReport) -> None:
        pass

    def read(self, node: Node, report: NodeReport) -> None:
        part = report.part(KernelReport)
        if part is None or part.proofs is None:
            return  # an agent older than proofs
        mine = {g.uuid for g in node.gpus}
        state = self.core.state
        leases = [x for x in [*state.leases.values(), *state.parked.values()] if x.gpu_uuid in mine]
        for lease_id, why in self.core.kernel_places.agent_said(leases, part.proofs):
            lease = state.find_lease(lease_id)
            self.core.metrics.enforced("claim_refused", 1)
            log.warning(
                "Node %s does not act on the kernel lease %s… of %s claims: %s",
                node.name,
                lease_id[:6],
                lease.user if lease is not None else "?",
                why,
            )

    async def settle(self, node: Node, report: NodeReport) -> None:
        pass

    def answer(self, node: Node, here: list[Lease], parked: list[Lease]) -> dict[str, Any]:
        overhead = self.core.policy.context_overhead_mb
        return {"kernels": self.core.kernel_places.kernels(here + parked, overhead)}


class DriverLimits:
    """Driver memory limits (``driver_limits``): which kernel cgroups hold one (a lease
    shows ``driver+agent-…``). The answer's ``limits`` stays empty: an agent sets limits
    on the cgroups it proves, never on a claim."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def check(self, node: Node, mine: dict[str, GPU], report: NodeReport) -> None:
        pass

    def read(self, node: Node, report: NodeReport) -> None:
        part = report.part(DriverLimitsReport)
        self.core.kernel_places.driver_limited[node.name] = set(part.cgroups if part else ())

    async def settle(self, node: Node, report: NodeReport) -> None:
        pass

    def answer(self, node: Node, here: list[Lease], parked: list[Lease]) -> dict[str, Any]:
        return {"limits": []}


class MPSDaemons:
    """MPS (``mps``, ``mps_uid``): the node's daemons and whom each GPU's server serves,
    of its own GPUs only (403); the answer's ``leases`` are what the daemons' own memory
    limits follow."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def check(self, node: Node, mine: dict[str, GPU], report: NodeReport) -> None:
        part = report.part(MPSReport) or MPSReport()
        for uuid in {**(part.states or {}), **(part.uids or {})}:
            if uuid not in mine:
                raise Forbidden(
                    f"GPU {uuid} is not one of node {node.name!r}'s registered GPUs; an agent "
                    "reports MPS daemons of its own GPUs only.",
                    gpu_uuid=uuid,
                )

    def read(self, node: Node, report: NodeReport) -> None:
        part = report.part(MPSReport) or MPSReport()
        node.mps = dict(part.states or {})
        node.mps_uid = {u: uid for u, uid in (part.uids or {}).items() if uid is not None}

    async def settle(self, node: Node, report: NodeReport) -> None:
        pass

    def answer(self, node: Node, here: list[Lease], parked: list[Lease]) -> dict[str, Any]:
        overhead = self.core.policy.context_overhead_mb
        return {"leases": self.core.kernel_places.leases(here, overhead)}


class Parking:
    """Parking (``checkpoint``, ``host_memory_available_mb``, ``parking``): what the node
    can park, kept for the reaper; the outcomes of park and resume orders, checked (an
    outcome of another node's lease: 403) and applied; the answer's ``orders``
    (:class:`~provisioner.broker.services.park_orders.ParkOrders`)."""

    def __init__(self, core: ServiceCore, orders: ParkOrders) -> None:
        self.core = core
        self.orders = orders

    def check(self, node: Node, mine: dict[str, GPU], report: NodeReport) -> None:
        part = report.part(NodeParkReport) or NodeParkReport()
        self.orders.check_outcomes(node.name, mine, part.outcomes)

    def read(self, node: Node, report: NodeReport) -> None:
        part = report.part(NodeParkReport) or NodeParkReport()
        self.core.node_parking[node.name] = NodeParking(
            bool(part.checkpoint), part.host_memory_available_mb
        )

    async def settle(self, node: Node, report: NodeReport) -> None:
        part = report.part(NodeParkReport)
        if part is not None and part.outcomes:
            outcomes = part.outcomes
            await self.core.mutate(lambda: self.orders.apply_outcomes(node, outcomes))

    def answer(self, node: Node, here: list[Lease], parked: list[Lease]) -> dict[str, Any]:
        return {"orders": self.orders.orders(here)}


class RemoteKernels:
    """Remote kernels (``launches_kernels``, ``remote_kernels``): what the agent launched
    and how each runs, checked (a kernel of another node's lease: 403) and kept
    (:class:`~provisioner.broker.rules.node_kernels.NodeKernels`, in memory); the answer's
    ``launch``, ``kernel_signals``, ``kernel_ends`` and ``kernel_expiry``."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def check(self, node: Node, mine: dict[str, GPU], report: NodeReport) -> None:
        part = report.part(RemoteKernelsReport)
        if part is None:
            return
        for status in part.kernels:
            lease = self.core.state.find_lease(status.lease_id)
            kernel = self.core.node_kernels.on(status.lease_id)
            elsewhere = (lease is not None and lease.gpu_uuid not in mine) or (
                kernel is not None and kernel.node != node.name
            )
            if elsewhere:
                log.warning(
                    "Node %s reported a kernel of lease %s…, which is not on it: refused",
                    node.name,
                    status.lease_id[:6],
                )
                raise Forbidden(
                    f"Lease {status.lease_id} is not on node {node.name}; an agent reports "
                    "only the kernels it launched for its own node's leases."
                )

    def read(self, node: Node, report: NodeReport) -> None:
        part = report.part(RemoteKernelsReport) or RemoteKernelsReport()
        book = self.core.node_kernels
        changed = book.read(node.name, part.launches_kernels, part.kernels, self.core.clock())
        for lease_id in changed:
            kernel, lease = book.on(lease_id), self.core.state.find_lease(lease_id)
            if kernel is not None and lease is not None and not kernel.user:
                kernel.user = lease.user  # adopted after a restart: its holder
            if kernel is not None:
                log.info(
                    "Kernel of lease %s… on node %s: %s (generation %d)%s",
                    lease_id[:6],
                    node.name,
                    kernel.state,
                    kernel.generation,
                    f": {kernel.status.reason}"
                    if kernel.status is not None and kernel.status.reason
                    else "",
                )
        alive = set(self.core.state.leases) | set(self.core.state.parked)
        book.forget(alive)
        if changed:
            self.core.polls.wake_kernels(changed)

    async def settle(self, node: Node, report: NodeReport) -> None:
        pass

    def answer(self, node: Node, here: list[Lease], parked: list[Lease]) -> dict[str, Any]:
        book = self.core.node_kernels
        if not book.launchers.get(node.name) and not book.reported.get(node.name):
            return {}
        alive = {x.id: x.expires_at for x in [*here, *parked]}
        return book.orders(node.name, alive)


def node_features(core: ServiceCore, orders: ParkOrders) -> list[NodeFeature]:
    """Every node feature of the broker, in the order each point calls them."""
    return [
        KernelProofs(core),
        DriverLimits(core),
        MPSDaemons(core),
        Parking(core, orders),
        RemoteKernels(core),
    ]


__all__ = [
    "DriverLimits",
    "KernelProofs",
    "MPSDaemons",
    "NodeFeature",
    "Parking",
    "RemoteKernels",
    "node_features",
]
