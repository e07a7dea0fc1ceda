"""Whether an idle lease may be parked rather than revoked.

Who calls this: the reaper (:meth:`~provisioner.broker.services.reaper.Reaper.tick`), once
per pass: :meth:`ParkPolicy.check` is the ``can_park`` it hands ``scheduling.reap``.
What it decides from lives in the shared :class:`~provisioner.broker.services.service_core.ServiceCore`:
the parking options (``core.park``), what each node's agent last said about parking
(``core.node_parking``, set by ``nodes.py`` at each heartbeat), the registered nodes and
the kernels' reported GPU memory. The park and resume orders that follow a park are
``park_orders.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable

from ...model import Lease, reserved_mb
from ..rules import node_rules
from .service_core import ServiceCore


class NotParked(str):
    """Why an idle lease is revoked rather than parked (:meth:`ParkPolicy.check`).

    ``tell_student``: the node parks kernels but could not park this one now (its agent
    lost, too little host memory), which the student's revoke reason says; where parking
    is not offered at all (turned off, no agent, no checkpoint API) only the log says why.
    """

    tell_student: bool

    def __new__(cls, text: str, *, tell_student: bool = False) -> NotParked:
        self = super().__new__(cls, text)
        self.tell_student = tell_student
        return self


class ParkPolicy:
    """The parking rule: which idle leases the reaper may park, given the nodes' reports."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def need_mb(self, lease: Lease) -> int:
        """Host MiB parking ``lease`` takes: its kernel's GPU memory as the node's agent last
        reported it, else the memory its lease reserves."""
        used = self.core.used_mb.get(lease.id)
        if used is not None:
            return used
        gpu = self.core.state.gpus.get(lease.gpu_uuid)
        return reserved_mb(lease.fraction_ppm, gpu.memory_mb) if gpu is not None else 0

    def check(self, now: float) -> Callable[[Lease], NotParked | None]:
        """The reaper's ``can_park`` for one pass (``Reaper.tick``): None when the
        lease may be parked instead of revoked, else why not (the revoke reason says it).

        Parking needs: ``park_idle`` on; the lease's GPU's node has a registered agent, up,
        whose latest heartbeat said ``checkpoint: true``; and that node's reported host
        memory, less ``park_host_reserve_mb`` and the GPU memory of the leases parking
        there already (those this pass approved included), holds the kernel's GPU memory.
        """
        core = self.core
        taken: dict[str, int] = {}
        for lease in core.state.leases.values():
            if lease.park == "parking":
                node = node_rules.node_of(core.state, core.nodes, lease.gpu_uuid)
                if node is not None:
                    taken[node.name] = taken.get(node.name, 0) + self.need_mb(lease)

        def can_park(lease: Lease) -> NotParked | None:
            if not core.park.idle:
                return NotParked("parking is turned off on this broker")
            node = node_rules.node_of(core.state, core.nodes, lease.gpu_uuid)
            if node is None:
                return NotParked("no node agent reports its GPU")
            if core.node_kernels.remote(lease.id):
                # its cells' resume requests come from a server the node does not see
                return NotParked(f"its kernel runs on node {node.name}, launched there")
            info = core.node_parking.get(node.name)
            if info is None:
                return NotParked(
                    f"node {node.name}'s agent has not said since this broker started "
                    "whether it can park kernels"
                )
            if not info.checkpoint:
                return NotParked(f"the CUDA driver on node {node.name} offers no checkpoint API")
            state = node_rules.node_state(node, now, core.policy)
            if state != "up":
                return NotParked(f"node {node.name}'s agent is {state}", tell_student=True)
            if info.host_memory_available_mb is None:
                return NotParked(f"node {node.name}'s agent did not report its host memory")
            need = self.need_mb(lease)
            already = taken.get(node.name, 0)
            room = info.host_memory_available_mb - core.park.host_reserve_mb - already
            if room < need:
                return NotParked(
                    f"node {node.name} has too little free host memory to hold its "
                    f"{need} MiB of GPU memory ({info.host_memory_available_mb} MiB "
                    f"available, {core.park.host_reserve_mb} MiB kept in reserve, "
                    f"{already} MiB taken by kernels parking there)",
                    tell_student=True,
                )
            taken[node.name] = already + need
            return None

        return can_park


__all__ = ["NotParked", "ParkPolicy"]
