"""A client's node calls: ``client.nodes`` of a :class:`~provisioner.client.BrokerClient`.

The node agent's calls (``gpu-lease agent``: register, heartbeat, drain) and the list of
nodes. Each call goes through the client's core (:meth:`BrokerClient.send`).
"""

from __future__ import annotations

from typing import Any

from .client_calls import Core, segment


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

    async def heartbeat(
        self,
        node: str,
        usage: list[dict[str, Any]],
        at: float | None = None,
        mps: dict[str, str] | None = None,
        mps_uid: dict[str, int | None] | None = None,
        kernels: list[dict[str, Any]] | None = None,
        driver_limits: list[str] | None = None,
        checkpoint: bool | None = None,
        host_memory_available_mb: int | None = None,
        parking: list[dict[str, Any]] | None = None,
        refused: list[dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        """``POST /api/v1/nodes/{node}/heartbeat``; raises ``LeaseNotFound`` if unregistered.

        ``mps``: GPU uuid -> ``running`` | ``down`` of the agent's MPS daemons (``--mps``);
        ``mps_uid``: GPU uuid -> the uid its MPS server serves clients of (None: none).
        ``kernels``: ``{pid, pid_ns, host_pid}`` of the namespaced kernels the agent found
        (an agent that proves claims: ``lease_id``, ``uid``, ``cgroup``, ``escaped`` and
        ``left_mps`` too, one per proven kernel); ``refused``: ``{lease_id, reason}`` of the claims it refused
        (sent, even empty, by an agent that proves claims);
        ``driver_limits``: the kernel cgroups whose driver memory limit is in force.
        Parking: ``checkpoint``, whether this node's driver can checkpoint
        kernels; ``host_memory_available_mb``, MemAvailable in MiB; ``parking``, the
        outcomes of park/resume orders not yet delivered. Each is sent only when not None
        (a broker older than parking refuses them). Returns the answer, with the broker's
        park/resume ``orders`` when it has any. Not retried (``retries=0``).
        """
        body: dict[str, Any] = {"usage": usage}
        if at is not None:
            body["at"] = at
        if mps is not None:
            body["mps"] = mps
        if mps_uid is not None:
            body["mps_uid"] = mps_uid
        if kernels:
            body["kernels"] = kernels
        if driver_limits is not None:
            body["driver_limits"] = driver_limits
        if refused is not None:
            body["refused"] = refused
        if checkpoint is not None:
            body["checkpoint"] = checkpoint
        if host_memory_available_mb is not None:
            body["host_memory_available_mb"] = host_memory_available_mb
        if parking is not None:
            body["parking"] = parking
        client = self._client
        path = _node_path(node, "heartbeat")
        return client.json_object(await client.send("POST", path, body=body, retries=0))

    async def drain(self, node: str) -> None:
        """``DELETE /api/v1/nodes/{node}``: no new leases there (a clean agent stop)."""
        await self._client.send("DELETE", _node_path(node))

    async def listing(self) -> list[dict[str, Any]]:
        """``GET /api/v1/nodes``."""
        return self._client.json_list(await self._client.send("GET", "/nodes"), "nodes")


__all__ = ["NodeCalls"]
