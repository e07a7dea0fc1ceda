"""Reads: leases, the queue, the GPUs, health, what a lease's node reports, history.

Who calls this: the HTTP handlers (``service.queries.gpus()``), and ``remote.py``
(:meth:`QueryService.lease_facts` goes with every lease a front is answered). Reads
from memory, or (history, a lease memory does not hold) from the database on the
writer's thread; a lease active in the database is adopted (``ServiceCore.adopt``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..._version import __version__
from ...errors import Forbidden, InvalidRequest
from ...model import GPU, Identity, Lease, Request, ppm_to_fraction
from ...wire import lease_enforcement
from ..rules import history, node_rules, scheduling, sessions
from .service_core import ServiceCore, check_owner

log = logging.getLogger("gpu_lease.broker")


@dataclass(frozen=True)
class GPUHolding:
    """A GPU of the pool and what is leased on it now (``gpus()``)."""

    gpu: GPU
    allocated_ppm: int
    leases: int
    #: the uid its MPS server serves clients of now (its agent's report; None: none)
    mps_uid: int | None = None


@dataclass(frozen=True)
class Health:
    gpus: int
    active_leases: int
    queued: int
    uptime_s: float
    version: str = __version__


@dataclass(frozen=True)
class Waiting:
    """A waiting request at its place in the queue (``queue()``)."""

    position: int
    request: Request
    waiting_s: float
    eta_seconds: float | None
    #: a class session of another course holds part of its GPUs back: the sentence
    session: str | None = None


@dataclass(frozen=True)
class History:
    """The pool's history in ``step``-second buckets (``history()``)."""

    since: float
    until: float
    step: float
    user: str | None
    group: str | None
    capacity: float
    points: list[history.Point]


@dataclass(frozen=True)
class LeaseUsage:
    """``used_mb``: GPU memory its kernel's processes used at the node's last heartbeat (None
    without an agent); ``enforcement``: the layer that holds the cap (``cooperative`` or
    ``agent-MODE``, ``driver+agent-MODE`` where the driver caps the kernel's cgroup); ``mps``: the state of the GPU's MPS daemon where the agent runs one;
    ``mps_server_uid``: the uid the GPU's MPS server serves clients of now (None: none)."""

    used_mb: int | None
    enforcement: str
    mps: str | None
    mps_server_uid: int | None = None
    #: a parked lease whose resume request waits: ``{position, eta_seconds}`` (else None)
    resume: dict[str, float | int | None] | None = None
    #: why the node's agent does not act on the kernel the lease's renewals claim (None:
    #: proven, or no agent said)
    kernel_refused: str | None = None
    #: while a class session of one of the lease's user's courses is held: "GPU reserved
    #: for ml101 until 11:30" (``rules/sessions.member_note``)
    session: str | None = None


class QueryService:
    """What the broker answers about its state, changing nothing but what it adopts."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    async def get_lease(self, ident: Identity, lease_id: str) -> Lease:
        """One lease; one that memory does not hold comes from the database (adopted if active)."""
        await self.core.ready()
        lease = self.core.state.find_lease(lease_id)  # parked ones too
        if lease is not None:
            check_owner(ident, lease)
            return lease
        found = await self.core.visible_lease(ident, lease_id)
        return await self.core.adopt(ident, lease_id, found) if found.active else found

    async def list_leases(
        self,
        ident: Identity,
        *,
        user: str | None = None,
        all_users: bool = False,
        history: bool = False,
    ) -> list[Lease]:
        """Own leases; admins may ask for ``all_users`` or another ``user``."""
        await self.core.ready()
        if (all_users or (user is not None and user != ident.user)) and not ident.admin:
            raise Forbidden("Only GPU lease admins may list other users' leases.")
        who = None if all_users and user is None else (user or ident.user)
        if history:
            return await self.core.writer.call(
                lambda: self.core.store.list_leases(user=who), read=True
            )
        leases = [*self.core.state.leases.values(), *self.core.state.parked.values()]
        return sorted(
            (x for x in leases if who is None or x.user == who), key=lambda x: x.created_at
        )

    async def queue(self, ident: Identity) -> list[Waiting]:
        """``GET /api/v1/queue``: the waiting requests in queue order; a user sees their own."""
        await self.core.ready()
        now = self.core.clock()
        state = self.core.state
        held = sessions.shares(state, now, self.core.policy) if state.sessions else None
        out = []
        for pos, req in enumerate(scheduling.queue_order(state, now, self.core.policy), start=1):
            if not (ident.admin or req.user == ident.user):
                continue
            note = None
            if held:
                gpus = scheduling.candidate_gpus(state, req.node, req.gpu_uuids)
                blocking = held.blocking(req.groups, [g.uuid for g in gpus])
                note = sessions.waiting_reason(blocking) if blocking else None
            out.append(Waiting(pos, req, now - req.arrived_at, self.core.eta(req.key, now), note))
        return out

    def queue_length(self) -> int:
        """How many requests wait in the queue (everyone's, also for a student)."""
        return len(self.core.state.queue)

    async def gpus(self) -> list[GPUHolding]:
        """``GET /api/v1/gpus``: each GPU in the pool's order, with what is leased on it."""
        await self.core.ready()
        st = self.core.state
        return [
            GPUHolding(
                g,
                st.allocated.get(g.uuid, 0),
                st.lease_count.get(g.uuid, 0),
                st.mps_uid.get(g.uuid),
            )
            for g in st.ordered_gpus()
        ]

    def health(self) -> Health:
        self.core.check_serving()
        return Health(
            gpus=len(self.core.state.gpus),
            active_leases=len(self.core.state.leases),
            queued=len(self.core.state.queue),
            uptime_s=self.core.clock() - self.core.started_at,
        )

    def lease_facts(self, lease: Lease) -> tuple[GPU | None, LeaseUsage]:
        """What a lease's answer shows beside the lease: its GPU and :meth:`lease_usage`."""
        return self.core.state.gpus.get(lease.gpu_uuid), self.lease_usage(lease)

    def lease_usage(self, lease: Lease) -> LeaseUsage:
        """What the lease's node reports: see :class:`LeaseUsage`."""
        node = node_rules.node_of(self.core.state, self.core.nodes, lease.gpu_uuid)
        resume = self.resume_place(lease)
        note = (
            sessions.member_note(
                self.core.state.sessions, lease.groups, self.core.clock(), self.core.policy
            )
            if self.core.state.sessions
            else None
        )
        if node is None:
            return LeaseUsage(None, lease_enforcement(None), None, resume=resume, session=note)
        return LeaseUsage(
            self.core.used_mb.get(lease.id),
            lease_enforcement(
                node.enforce, self.core.kernel_places.driver_limited_on(node.name, lease.id)
            ),
            node.mps.get(lease.gpu_uuid),
            node.mps_uid.get(lease.gpu_uuid),
            resume,
            self.core.kernel_places.refused.get(lease.id),
            note,
        )

    def resume_place(self, lease: Lease) -> dict[str, float | int | None] | None:
        """A parked lease's waiting resume request's ``{position, eta_seconds}``, else None
        (``GET /api/v1/leases/{id}``'s ``resume``; the dashboard, ``gpu-lease leases``)."""
        if lease.park != "parked":
            return None
        req = self.core.state.queue.get(lease.user_kernel)
        if req is None or req.resume_of != lease.id:
            return None
        now = self.core.clock()
        return {
            "position": scheduling.position_of(self.core.state, req.key, now, self.core.policy),
            "eta_seconds": self.core.eta(req.key, now),
        }

    async def history(
        self,
        ident: Identity,
        since: float,
        step: float,
        *,
        group: str | None = None,
        user: str | None = None,
    ) -> History:
        """Allocation, queue length and waits per ``step`` seconds since ``since``.

        Called by ``GET /api/v1/history`` (the dashboard's plots). Admins see the whole
        pool, or one ``user``'s or one course's (``group``, ``""``: no course) part; anyone
        else only their own leases and requests (``user`` may name only themselves).
        """
        await self.core.ready()
        if not ident.admin:
            if user is not None and user != ident.user:
                raise Forbidden("Only GPU lease admins may see other users' history.")
            user = ident.user
        now = self.core.clock()
        if since > now:
            raise InvalidRequest("'since' is in the future.")
        held, queued = await self.core.writer.call(
            lambda: self.core.store.history(since, now, user=user), read=True
        )
        try:
            points = history.compute(held, queued, since, now, step, group=group)
        except ValueError as exc:
            raise InvalidRequest(
                f"A step of {step:g} s since then gives more than {history.MAX_POINTS} "
                "points; choose a larger 'step' or a later 'since'."
            ) from exc
        return History(
            since=points[0].t if points else since,
            until=now,
            step=step,
            user=user,
            group=group,
            capacity=len(self.core.state.gpus) * ppm_to_fraction(self.core.policy.capacity_ppm),
            points=points,
        )


__all__ = ["GPUHolding", "Health", "History", "LeaseUsage", "QueryService", "Waiting"]
