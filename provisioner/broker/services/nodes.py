"""Nodes and over-use: node agents register their GPUs, heartbeat their processes'
usage, and are drained; leases over their cap are reported, revoked or killed.

Who calls this: the HTTP handlers (``service.nodes.node_heartbeat(...)``), and the
metrics collector (:meth:`NodeService.node_states` and the like). The registered nodes
and the over-use bookkeeping live in the shared
:class:`~provisioner.broker.services.service_core.ServiceCore`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import Forbidden, GPULeaseError, InvalidRequest, NodeNotFound
from ...model import GPU, Identity, Lease, Node
from ...node_report import KernelReport, NodeProofs, NodeReport
from ...wire import NODE_STATES
from ..rules import node_rules, scheduling
from .node_features import node_features
from .node_orders import NodeOrders, OrderPush
from .park_orders import ParkOrders
from .service_core import ServiceCore, require_admin

log = logging.getLogger("gpu_lease.broker")


@dataclass(frozen=True)
class NodeView:
    """A registered node and its state now (``up``, ``lost``, ``drained``)."""

    node: Node
    state: str


@dataclass(frozen=True)
class Heartbeat:
    """What a node agent's heartbeat gets back: the node's state, the kernel pids to watch
    (its leases' pids), the ones whose processes to kill (``--enforce kill``), and each
    node feature's fields (``answers``, :mod:`.node_features`: ``kernels``, ``limits``,
    ``leases``, ``orders``)."""

    node: str
    state: str
    at: float
    watch: list[int]
    kill: list[int]
    answers: dict[str, Any] = field(default_factory=dict)


class NodeService:
    """Registered nodes, their heartbeats, and the enforcement of each lease's cap."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        #: park and resume orders and their outcomes (``park_orders.py``)
        self.parking = ParkOrders(core)
        #: every node feature's side of the heartbeats (``node_features.py``)
        self.features = node_features(core, self.parking)
        #: each node's due orders and its agent's long-poll for them (``node_orders.py``)
        self.push = OrderPush(core, self.parking)
        #: nodes whose first registration is being stored: the pool (and placement) has
        #: their GPUs only once it is, so ``GET /nodes`` does not list them before
        self._storing: set[str] = set()

    async def register_node(
        self,
        ident: Identity,
        name: str,
        gpus: list[GPU],
        agent_version: str,
        enforce: str = "report",
    ) -> NodeView:
        """``PUT /api/v1/nodes/{node}``: (re-)register a node's GPUs; it is up (not drained).

        A GPU another node (or the ``--gpus`` declaration) already has is refused (403);
        a GPU missing from this registration that still carries leases stays in the pool,
        closed, until its leases end.
        """
        await self.core.ready()
        self._check_node_caller(ident, name)
        now = self.core.clock()
        declared = {g.uuid: g.node for g in self.core.declared}
        owners = dict(declared)
        for other in self.core.nodes.values():
            if other.name != name:
                owners.update((g.uuid, other.name) for g in other.gpus)
        for g in gpus:
            if g.uuid in declared:
                # declared with the broker's --gpus: an agent cannot take it over, even on
                # the node it was declared on (a name match would read "node 'a', not 'a'")
                raise Forbidden(
                    f"GPU {g.uuid} is declared by the broker's --gpus (on node "
                    f"{declared[g.uuid]!r}), so no agent may register it; drop it from the "
                    "broker's --gpus to let this node's agent report it.",
                    gpu_uuid=g.uuid,
                )
            if g.uuid in owners:
                raise Forbidden(
                    f"GPU {g.uuid} belongs to node {owners[g.uuid]!r}, not {name!r}; an agent "
                    "registers only its own node's GPUs (check the agent's --node).",
                    gpu_uuid=g.uuid,
                )
        old = self.core.nodes.get(name)
        node = Node(
            name=name,
            gpus=[replace(g, node=name) for g in gpus],
            agent_version=agent_version,
            registered_at=old.registered_at if old is not None else now,
            last_seen=now,
            enforce=enforce,
        )
        self.core.nodes[name] = node
        pool = self.core.pool()
        keep = pool + self._vanishing(pool)

        def record() -> None:
            self.core.store.sync_gpus(keep, self.core.policy.capacity_ppm)
            self.core.store.put_node(node)

        if old is None:
            self._storing.add(name)
        try:
            await self.core.writer.call(record)
        except GPULeaseError:
            if old is None:
                self.core.nodes.pop(name)
            else:
                self.core.nodes[name] = old
            raise
        finally:
            self._storing.discard(name)
        self._apply_pool(pool)
        self.core.close_gpus(now)
        log.info(
            "Node %s registered %d GPU(s) (agent %s)%s",
            name,
            len(gpus),
            agent_version,
            "" if old is None else " again",
        )
        await self.core.grant_waiting()
        return NodeView(node, node_rules.node_state(node, now, self.core.policy))

    async def node_heartbeat(self, ident: Identity, name: str, report: NodeReport) -> Heartbeat:
        """``POST /api/v1/nodes/{node}/heartbeat``: the node is alive; its per-process usage
        and each node feature's part of its ``report`` (:mod:`.node_features`: MPS daemons,
        proven kernels, driver limits, parking).

        Samples of a GPU this node did not register are refused (403), memory above the
        GPU's size is refused (400), and so is what a feature refuses; nothing is changed
        then. A report never frees or grants capacity: leases end only by release, revoke
        or TTL (a parking outcome settles its lease's park state; a change of MPS owners
        may let a waiting MPS kernel be placed: the queue drains).

        Proofs (``KernelReport.proofs``; None from an agent older than them): only the
        kernels the agent proved count for their leases; a proven kernel's GPU process
        outside its driver-limited cgroup or outside MPS puts its lease over its cap.
        """
        await self.core.ready()
        self._check_node_caller(ident, name)
        node = self.core.nodes.get(name)
        if node is None:
            raise NodeNotFound(
                f"Node {name!r} is not registered; its agent registers it with "
                f"PUT /api/v1/nodes/{name} first (restart the agent)."
            )
        mine = {g.uuid: g for g in node.gpus}
        usage = list(report.usage)
        for pid, uuid, used in usage:
            gpu = mine.get(uuid)
            if gpu is None:
                raise Forbidden(
                    f"GPU {uuid} is not one of node {name!r}'s registered GPUs; register it "
                    "again (PUT) before reporting its processes.",
                    gpu_uuid=uuid,
                )
            if used > gpu.memory_mb:
                raise InvalidRequest(
                    f"Process {pid} cannot use {used} MiB of GPU {uuid}, which has "
                    f"{gpu.memory_mb} MiB; report what NVML measures."
                )
        for feature in self.features:
            feature.check(node, mine, report)
        now = self.core.clock()
        was = node_rules.node_state(node, now, self.core.policy)
        node.last_seen = now
        node.usage = usage
        places = self.core.kernel_places
        places.forget_ended(set(self.core.state.leases) | set(self.core.state.parked))
        for feature in self.features:
            feature.read(node, report)
        kernels = report.part(KernelReport) or KernelReport()
        ends, kill = self._account_usage(node, usage, now, kernels.namespaced, kernels.proofs)
        mps_changed = self.core.refresh_mps_owners()  # its report, the kernels proven now
        if was == "lost":
            log.info("Node %s is back (its agent heartbeats again)", name)
            self.core.close_gpus(now)
        for feature in self.features:
            await feature.settle(node, report)
        if ends:
            await self.core.mutate(
                lambda: self.core.commit(
                    scheduling.end(self.core.state, ends, now, self.core.policy)
                )
            )
            self._log_overuse(node, ends, kill)
        elif was == "lost" or mps_changed:
            await self.core.grant_waiting()
        here = [x for x in self.core.state.leases.values() if x.gpu_uuid in mine]
        parked = [x for x in self.core.state.parked.values() if x.gpu_uuid in mine]
        watch = sorted({x.pid for x in here + parked if x.pid})
        answers: dict[str, Any] = {}
        for feature in self.features:
            answers.update(feature.answer(node, here, parked))
        state = node_rules.node_state(node, now, self.core.policy)
        return Heartbeat(name, state, now, watch, kill, answers)

    async def node_orders(
        self, ident: Identity, name: str, after: str | None, timeout: float
    ) -> NodeOrders:
        """``GET /api/v1/nodes/{node}/orders?after=CURSOR&timeout=S``: the node's due orders
        (park, resume: the heartbeat answer's ``orders``) with their cursor, at once when
        the cursor differs from ``after``, else when they change or ``timeout`` s have
        passed (:mod:`.node_orders`). The node's agent (or an admin) only; 404 for a node
        not registered."""
        await self.core.ready()
        self._check_node_caller(ident, name)
        return await self.push.wait(name, after, timeout)

    def _account_usage(
        self,
        node: Node,
        usage: list[tuple[int, str, int]],
        now: float,
        kernels: dict[tuple[int, int], int] | None = None,
        proofs: NodeProofs | None = None,
    ) -> tuple[list[tuple[Lease, str, str | None]], list[int]]:
        """Map samples to leases by kernel pid; which leases over their cap past the grace end.

        The agent reports a kernel's child processes under the kernel's host pid (it walks
        /proc), and ``kernels`` maps namespaced kernels to host pids. Returns the leases to
        revoke and the kernel host pids whose processes the agent should kill (``--enforce
        kill``). Changes no lease itself.
        """
        mine = {g.uuid for g in node.gpus}
        leases = [x for x in self.core.state.leases.values() if x.gpu_uuid in mine]
        by_pid = self.core.kernel_places.by_host_pid(leases, kernels, proofs)
        host_of = {x.id: pid for pid, x in by_pid.items()}
        used: dict[str, int] = {}
        node.unleased = []
        for pid, uuid, mb in usage:
            lease = by_pid.get(pid)
            if lease is None:
                node.unleased.append((pid, uuid, mb))
            else:
                used[lease.id] = used.get(lease.id, 0) + mb
        ends: list[tuple[Lease, str, str | None]] = []
        kill: list[int] = []
        for lease in leases:
            mb = used.get(lease.id, 0)
            self.core.used_mb[lease.id] = mb
            proven = proofs.proven.get(lease.id) if proofs is not None else None
            escaped = proven.escaped if proven is not None else ()
            left_mps = proven.left_mps if proven is not None else ()
            over = bool(escaped or left_mps) or node_rules.over_lease(lease, mb, self.core.policy)
            if node.enforce == "off" or not over:
                self.core.over_since.pop(lease.id, None)
                self.core.over_reported.discard(lease.id)
                continue
            since = self.core.over_since.setdefault(lease.id, now)
            if now - since < self.core.policy.overuse_grace:
                continue
            reason = node_rules.overuse_reason(mb, lease, self.core.policy)
            if escaped:
                reason = (
                    f"a kernel process (pid {escaped[0]}) left the kernel's cgroup, which "
                    "carries its driver memory limit: a lease's processes must stay in it"
                )
            if left_mps:
                reason = (
                    f"a kernel process (pid {left_mps[0]}) runs on GPU {lease.gpu_uuid} "
                    "outside MPS (it is no client of the GPU's MPS server, e.g. "
                    "CUDA_MPS_PIPE_DIRECTORY was unset), so outside its memory limit: an MPS "
                    "kernel's processes must run under MPS"
                )
            if node.enforce in ("revoke", "kill"):
                ends.append((lease, "revoked", reason))
                if node.enforce == "kill" and lease.id in host_of:
                    kill.append(host_of[lease.id])
            elif lease.id not in self.core.over_reported:  # once per episode over the cap
                self.core.over_reported.add(lease.id)
                self.core.metrics.enforced("reported", 1)
                log.warning(
                    "Lease %s… of %s on node %s: %s", lease.id[:6], lease.user, node.name, reason
                )
        return ends, kill

    def _log_overuse(
        self, node: Node, ends: list[tuple[Lease, str, str | None]], kill: list[int]
    ) -> None:
        self.core.metrics.enforced("revoked", len(ends))
        if kill:
            self.core.metrics.enforced("killed", len(kill))
        for lease, _, why in ends:
            log.warning(
                "Revoked lease %s… of %s kernel %s on node %s: %s",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                node.name,
                why,
            )

    async def drain_node(self, ident: Identity, name: str) -> None:
        """``DELETE /api/v1/nodes/{node}``: no new leases there; held ones stay. Idempotent."""
        await self.core.ready()
        self._check_node_caller(ident, name)
        node = self.core.nodes.get(name)
        if node is None:
            raise NodeNotFound(f"Node {name!r} is not registered; there is nothing to drain.")
        if not node.drained:
            await self.core.writer.call(lambda: self.core.store.set_node_drained(name, True))
            node.drained = True
            log.info("Node %s drained by %s", name, ident.user)
        self.core.close_gpus(self.core.clock())

    async def list_nodes(self, ident: Identity) -> list[NodeView]:
        """``GET /api/v1/nodes``: every registered node with its state (the handler shows
        admins their GPUs and usage too)."""
        await self.core.ready()
        now = self.core.clock()
        return [
            NodeView(node, node_rules.node_state(node, now, self.core.policy))
            for node in sorted(self.core.nodes.values(), key=lambda n: n.name)
            if node.name not in self._storing  # registered once its GPUs can be placed
        ]

    def node_states(self) -> dict[str, int]:
        """How many registered nodes are up, lost and drained (for /metrics)."""
        now = self.core.clock()
        counts = dict.fromkeys(NODE_STATES, 0)
        for node in self.core.nodes.values():
            counts[node_rules.node_state(node, now, self.core.policy)] += 1
        return counts

    def unleased_processes(self) -> int:
        """GPU processes the agents last reported that belong to no lease (for /metrics)."""
        return sum(len(node.unleased) for node in self.core.nodes.values())

    def lease_used_mb(self) -> dict[str, int]:
        """Lease id -> MiB its kernel's processes use, from the last heartbeats (for /metrics)."""
        return dict(self.core.used_mb)

    def gpu_used_mb(self) -> dict[str, int]:
        """GPU uuid -> MiB its processes use, from each node's last heartbeat (for /metrics)."""
        out: dict[str, int] = {}
        for node in self.core.nodes.values():
            for g in node.gpus:
                out[g.uuid] = 0
            for _, uuid, mb in node.usage:
                out[uuid] = out.get(uuid, 0) + mb
        return out

    def _check_node_caller(self, ident: Identity, name: str) -> None:
        if ident.node is not None:
            if ident.node != name:
                raise Forbidden(
                    f"This agent token belongs to node {ident.node!r}; it may not speak for "
                    f"node {name!r} (check the agent's --node)."
                )
            return
        require_admin(ident)

    def _vanishing(self, pool: list[GPU]) -> list[GPU]:
        """GPUs in the state but not in ``pool`` that still carry leases (they stay, closed)."""
        keep = {g.uuid for g in pool}
        return [
            g
            for u, g in self.core.state.gpus.items()
            if u not in keep and self.core.state.lease_count.get(u, 0) > 0
        ]

    def _apply_pool(self, pool: list[GPU]) -> None:
        """Make the in-memory pool ``pool`` plus the leased GPUs that left it."""
        keep = {g.uuid for g in pool}
        for g in pool:
            self.core.state.put_gpu(g)
        self.core.vanished = {g.uuid for g in self._vanishing(pool)}
        for u in list(self.core.state.gpus):
            if u not in keep and u not in self.core.vanished:
                self.core.state.drop_gpu(u)


__all__ = ["Heartbeat", "NodeService", "NodeView"]
