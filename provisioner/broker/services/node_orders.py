"""A node's orders as they arise: the long-poll its agent keeps open
(``GET /api/v1/nodes/{node}/orders?after=CURSOR&timeout=S``).

Orders are state, not messages: a lease that is ``parking`` is a park order for its node
until the agent's outcome settles it (``park_orders.py``), and the heartbeat's answer
repeats it every time. What this adds is *when* the agent hears of it: the long-poll
answers as soon as the node's orders differ from those the agent last saw, so the agent
heartbeats at once instead of at its next interval, and takes the orders from that
heartbeat's answer (which proves the kernels they name and carries their outcomes back).

The cursor is a digest of the node's due orders (each with the moment it was issued), so
it survives a restart of either side: a broker that restarted computes the same cursor
from the same state, and an agent that restarted (no cursor) is answered at once. Nothing
is handed twice or lost when a long-poll and a heartbeat race: both only read the state.

Who calls this: :meth:`~provisioner.broker.services.nodes.NodeService.node_orders`. The
long-polls wait on ``LongPolls.orders``, woken by each commit that changes a lease's park
state on the node (``ServiceCore.commit``), and by each remote kernel's launch or signal
(``node_kernels.py``): those join the cursor of :meth:`OrderPush.due`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ...errors import NodeNotFound
from ...model import Lease, Node
from .park_orders import ParkOrders
from .service_core import ServiceCore


@dataclass(frozen=True)
class NodeOrders:
    """A long-poll's answer: the node, the cursor of its due orders, and those orders (the
    heartbeat answer's ``orders`` entries)."""

    node: str
    cursor: str
    orders: list[dict[str, Any]]
    #: how many remote-kernel orders are due (launch, signal, end: in the heartbeat's answer)
    remote: int = 0


def orders_cursor(issued: list[tuple[dict[str, Any], float | None]]) -> str:
    """The cursor of a node's due orders: a digest of each order and when it was issued
    (a lease parked, resumed and parked again gets a new park order, and a new cursor)."""
    text = json.dumps(sorted(issued, key=lambda x: json.dumps(x, sort_keys=True)), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class OrderPush:
    """Each node's due orders and the long-polls that wait for them to change."""

    def __init__(self, core: ServiceCore, parking: ParkOrders) -> None:
        self.core = core
        self.parking = parking

    def _here(self, node: Node) -> list[Lease]:
        mine = {g.uuid for g in node.gpus}
        return [x for x in self.core.state.leases.values() if x.gpu_uuid in mine]

    def due(self, node: Node) -> tuple[str, list[dict[str, Any]], int]:
        """The node's orders now and their cursor: park and resume orders, and its remote
        kernels' (launch, signal, end; in the cursor only: the agent takes them from the
        heartbeat's answer, and the launch's key goes nowhere else)."""
        here = self._here(node)
        orders = self.parking.orders(here)
        issued = {x.id: x.parked_at for x in here}
        marks = [(o, issued.get(o["lease_id"])) for o in orders]
        mine = {g.uuid for g in node.gpus}
        alive = {
            x.id: x.expires_at
            for x in [*here, *self.core.state.parked.values()]
            if x.gpu_uuid in mine
        }
        kernels = self.core.node_kernels.orders(node.name, alive)
        marks += [
            (
                {
                    "remote": kind,
                    "lease_id": o["lease_id"],
                    "generation": o["generation"],
                    "seq": o.get("seq"),
                },
                None,
            )
            for kind in ("launch", "kernel_signals", "kernel_ends")
            for o in kernels[kind]
        ]
        return orders_cursor(marks), orders, len(marks) - len(orders)

    async def wait(self, name: str, after: str | None, timeout: float) -> NodeOrders:
        """The node's orders once their cursor differs from ``after`` (at once when it does
        already, or ``after`` is None), else after ``timeout`` s; answered only once what it
        answers is in the database. 404 for a node not registered (``node`` names it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with self.core.polls.for_orders(name) as waiter:
            while True:
                self.core.check_serving()
                node = self.core.nodes.get(name)
                if node is None:
                    raise NodeNotFound(
                        f"Node {name!r} is not registered; its agent registers it with "
                        f"PUT /api/v1/nodes/{name} first (restart the agent).",
                        node=name,
                    )
                cursor, orders, remote = self.due(node)
                remaining = deadline - loop.time()
                if cursor != after or remaining <= 0:
                    await self.core.writer.barrier()  # what it says is in the database
                    node = self.core.nodes.get(name, node)
                    cursor, orders, remote = self.due(node)
                    return NodeOrders(name, cursor, orders, remote)
                await waiter.pause(remaining)


__all__ = ["NodeOrders", "OrderPush", "orders_cursor"]
