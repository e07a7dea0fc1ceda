"""A client's node calls: ``client.nodes`` of a :class:`~provisioner.client.BrokerClient`.

The node agent's calls (``gpu-lease agent``: register, heartbeat, the orders long-poll,
drain) and the list of
nodes. Each call goes through the client's core (:meth:`BrokerClient.send`).
"""

from __future__ import annotations

from typing import Any

from ..node_report import NodeReport
from .calls import Core, segment


def _node_path(node: str, action: str = "") -> str:
    return f"/nodes/{segment(node)}" + (f"/{action}" if action else "")


class NodeCalls:
    """``/api/v1/nodes`` over ``client``'s core."""

    def __init__(self, client: Core) -> None:
        self._client = client

    async def register(
        self, node: str, gpus: list[dict[str, Any]], agent_version: str, enforce: str = "report"
    ) -> dict[str, Any]:
        """``PUT /api/v1/nodes/{node}``: register or refresh the node's GPUs; undrains it."""
        body = {"gpus": gpus, "agent_version": agent_version, "enforce": enforce}
        return self._client.json_object(await self._client.send("PUT", _node_path(node), body=body))

    async def heartbeat(self, node: str, report: NodeReport) -> dict[str, Any]:
        """``POST /api/v1/nodes/{node}/heartbeat`` with ``report``
        (:class:`~provisioner.node_report.NodeReport`: the usage and each node feature's
        part, each field sent only when the agent has it, so that a broker older than a
        feature refuses nothing it does not know); raises ``LeaseNotFound`` if
        unregistered. Returns the answer (the node's kernels, and each feature's part, such
        as the park/resume ``orders``). Not retried (``retries=0``).
        """
        client = self._client
        path = _node_path(node, "heartbeat")
        body = report.to_json()
        return client.json_object(await client.send("POST", path, body=body, retries=0))

    async def orders(self, node: str, after: str | None, wait: float) -> dict[str, Any]:
        """``GET /api/v1/nodes/{node}/orders?after=&timeout=``: the node's due orders
        ``{node, cursor, orders}``, at once when their cursor differs from ``after``, else
        when they change or after ``wait`` s (a long-poll: read for ``wait`` plus the
        client's timeout). Not retried: the agent polls again itself. A broker older than
        this endpoint answers 404 (``LeaseNotFound`` with no ``node`` in its details)."""
        params = {"timeout": f"{wait:g}"}
        if after is not None:
            params["after"] = after
        client = self._client
        response = await client.send(
            "GET",
            _node_path(node, "orders"),
            params=params,
            read_timeout=wait + client.timeout,
            retries=0,
        )
        return client.json_object(response)

    async def drain(self, node: str) -> None:
        """``DELETE /api/v1/nodes/{node}``: no new leases there (a clean agent stop)."""
        await self._client.send("DELETE", _node_path(node))

    async def listing(self) -> list[dict[str, Any]]:
        """``GET /api/v1/nodes``."""
        return self._client.json_list(await self._client.send("GET", "/nodes"), "nodes")


__all__ = ["NodeCalls"]
