"""Park and resume orders for node agents, and the outcomes they report (parking).

Who calls this: :class:`~provisioner.broker.services.nodes.NodeService` at each heartbeat
(``POST /api/v1/nodes/{node}/heartbeat``): it checks the reported outcomes
(:meth:`ParkOrders.check_outcomes`), applies them through ``scheduling``'s
``park_done``/``park_failed``/``resume_done``/``resume_failed``
(:meth:`ParkOrders.apply_outcomes`), and answers the node's ``orders``
(:meth:`ParkOrders.orders`). The leases' park states live in the shared
:class:`~provisioner.broker.services.service_core.ServiceCore`.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import Forbidden
from ...model import GPU, Changes, Lease, Node, reserved_mb
from ...node_report import ParkOutcome
from ..rules import scheduling
from .service_core import ServiceCore

log = logging.getLogger("gpu_lease.broker")


class ParkOrders:
    """What each node's agent is to park or resume, and what it reports it did."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def check_outcomes(
        self, name: str, mine: dict[str, GPU], outcomes: tuple[ParkOutcome, ...]
    ) -> None:
        """403 (nothing changed) if an outcome names a lease of another node's GPU; an id
        the broker does not hold is not checked (it is ignored when applied)."""
        for o in outcomes:
            lease = self.core.state.find_lease(o.lease_id)
            if lease is not None and lease.gpu_uuid not in mine:
                raise Forbidden(
                    f"Lease {o.lease_id[:6]}… is not on one of node {name!r}'s GPUs; an agent "
                    "reports the outcomes of its own node's park and resume orders only."
                )

    async def apply_outcomes(self, node: Node, outcomes: tuple[ParkOutcome, ...]) -> None:
        """Apply each outcome whose lease is in the state it settles (``scheduling``'s
        ``park_done``, ``park_failed``, ``resume_done``, ``resume_failed``), all before
        the first ``await``; commit them; then count and log them (INFO)."""
        st, policy = self.core.state, self.core.policy
        now = self.core.clock()
        done: list[tuple[ParkOutcome, Lease, Changes]] = []
        for o in outcomes:
            lease = st.find_lease(o.lease_id)
            want = "parking" if o.action == "park" else "resuming"
            if lease is None or lease.park != want or o.outcome == "waiting":
                if o.outcome == "waiting" and lease is not None and lease.park == want:
                    log.debug(
                        "Node %s waits to %s lease %s…: %s",
                        node.name,
                        o.action,
                        o.lease_id[:6],
                        o.message or "no reason given",
                    )
                else:
                    log.debug(
                        "Ignored a late or repeated %s %s outcome for lease %s… from node %s",
                        o.action,
                        o.outcome,
                        o.lease_id[:6],
                        node.name,
                    )
                continue
            why = o.message or f"the node's agent could not {o.action} the kernel"
            if o.action == "park" and o.outcome == "done":
                changes = scheduling.park_done(st, o.lease_id, now, policy)
            elif o.action == "park":
                changes = scheduling.park_failed(st, o.lease_id, why, now, policy)
            elif o.outcome == "done":
                changes = scheduling.resume_done(st, o.lease_id, now)
            else:
                changes = scheduling.resume_failed(st, o.lease_id, why, now, policy)
            done.append((o, lease, changes))
        for _, _, changes in done:
            await self.core.commit(changes)
        for o, lease, _ in done:
            self._note_outcome(node, o, lease, now)

    def _note_outcome(self, node: Node, o: ParkOutcome, lease: Lease, now: float) -> None:
        """Count and log (INFO, the lease id cut to 6 characters) one applied outcome."""
        metrics = self.core.metrics
        took = "" if o.seconds is None else f" in {o.seconds:.1f} s"
        moved = "" if o.mb is None else f", {o.mb} MiB"
        if o.action == "park":
            metrics.parked(o.outcome, 1)
        else:
            metrics.resumed(o.outcome, 1)
            asked = self.core.resume_asked.pop(lease.id, None)
            if o.outcome == "done" and asked is not None:
                metrics.observe_resume_wait(now - asked)
        if o.outcome == "done":
            log.info(
                "%s lease %s… of %s kernel %s on node %s%s%s%s",
                "Parked" if o.action == "park" else "Resumed",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                node.name,
                took,
                moved,
                ": its GPU memory is free" if o.action == "park" else "",
            )
        else:
            log.info(
                "Revoked lease %s… of %s kernel %s: node %s could not %s it: %s",
                lease.id[:6],
                lease.user,
                lease.kernel_id,
                node.name,
                o.action,
                o.message or "no reason given",
            )

    def orders(self, here: list[Lease]) -> list[dict[str, Any]]:
        """The heartbeat answer's ``orders``: park each lease of ``here`` (the node's
        leases holding capacity) that is ``parking``, resume each that is ``resuming``;
        the kernel named as in ``kernels`` (its provisioner's ``pid``, ``pid_ns``), with
        the memory its lease reserves."""
        out = []
        places = self.core.kernel_places.places
        for lease in here:
            if lease.park not in ("parking", "resuming"):
                continue
            gpu = self.core.state.gpus.get(lease.gpu_uuid)
            out.append(
                {
                    "lease_id": lease.id,
                    "action": "park" if lease.park == "parking" else "resume",
                    "pid": lease.pid,
                    "pid_ns": places[lease.id].pid_ns if lease.pid and lease.id in places else None,
                    "gpu_uuid": lease.gpu_uuid,
                    "memory_mb": reserved_mb(lease.fraction_ppm, gpu.memory_mb) if gpu else 0,
                }
            )
        return sorted(out, key=lambda x: str(x["lease_id"]))


__all__ = ["ParkOrders"]
