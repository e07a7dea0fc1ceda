"""The store's lease writes: grants re-checked against capacity and uniqueness in their
own transaction, and the group commit of a batch of changes (``write_changes``).

:class:`LeaseWrites` is a base of :class:`~provisioner.broker.store.store.Store`; see ``store.py``
for the capacity invariant these writes keep.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from ...errors import (
    CapacityConflict,
    DuplicateLease,
    DuplicateRequest,
)
from ...model import (
    PPM,
    Changes,
    Lease,
    Request,
)
from ...wire import ENDED_LEASE_STATES
from .engine import Database
from .schema import (
    _ACTIVE_FOR_KERNEL,
    _DELETE_REQUEST,
    _END,
    _ENDED_AMONG,
    _HELD_ON_GPUS,
    _HELD_ON_GPUS_SQLITE,
    _INSERT_LEASE,
    _LEAVE_QUEUE,
    _LOCK_GPUS,
    _PARK,
    _RENEW,
    _lease_row,
    _park_params,
    _queue_log_row,
    _renew_params,
    _request_row,
    queue_log,
    requests,
)


class LeaseWrites(Database):
    """The writes that grant, renew and end leases, capacity re-checked in the database:
    one transaction per call (``write_changes``: one per group commit)."""

    def insert_lease(
        self, lease: Lease, capacity_ppm: int, *, drop_request_id: str | None = None
    ) -> None:
        """Persist one grant, re-checking capacity and uniqueness in the same transaction.

        ``drop_request_id`` (a queued request this grant serves) is deleted in that
        transaction too, and its stay in the queue logged as granted. Raises :class:`CapacityConflict` or :class:`DuplicateLease`
        when the database refuses; nothing is written then.
        """
        self.insert_leases([lease], capacity_ppm, [drop_request_id] if drop_request_id else [])

    def insert_leases(
        self, new: list[Lease], capacity_ppm: int, drop_request_ids: list[str]
    ) -> None:
        """Persist several grants (a queue drain) in one transaction, all or nothing.

        On each GPU, active fractions plus the new ones must stay within
        ``min(capacity_ppm, the GPU row's capacity_ppm)``; no kernel may hold two
        active leases.
        """
        if not new and not drop_request_ids:
            return
        what = "record a new lease" if len(new) == 1 else f"record {len(new)} new leases"
        with self._tx(what) as conn:
            if new:
                self._check_grants(conn, new, capacity_ppm)
                try:
                    conn.execute(_INSERT_LEASE, [_lease_row(lease) for lease in new])
                except IntegrityError as exc:
                    # the partial unique index caught a concurrent grant for the same kernel
                    raise DuplicateLease(
                        "This kernel already holds an active GPU lease (granted concurrently); "
                        "release it before asking for another.",
                    ) from exc
            if drop_request_ids:
                conn.execute(_DELETE_REQUEST, [{"b_id": rid} for rid in drop_request_ids])
                left_at = max((x.created_at for x in new), default=time.time())
                conn.execute(
                    _LEAVE_QUEUE,
                    [
                        {"b_id": rid, "b_left_at": left_at, "b_outcome": "granted"}
                        for rid in drop_request_ids
                    ],
                )

    def write_changes(
        self, batch: Sequence[Changes], capacity_ppm: int
    ) -> dict[str, tuple[str, str | None]]:
        """Persist the changes of several mutations (made in this order) in ONE transaction.

        The broker's group commit calls this with every change made while the previous
        transaction committed. The batch's net effect is written: leases that ended are
        updated, new leases inserted (those that also ended within the batch inserted
        ended), requests that joined and left within the batch only logged; capacity and
        the one-lease-per-kernel rule are re-checked for the leases still active, under
        the same locks as :meth:`insert_leases`. Parking (``Changes.parks``): each live
        lease's latest park state and ``parked_at`` are written (a parked row holds no
        capacity in the database's sums); a granted resume request (``Changes.resumed``)
        leaves the queue as granted, creates no lease, and its lease's GPU is re-checked
        for capacity with the park states written. All or nothing: on a refusal
        (:class:`CapacityConflict`, :class:`DuplicateLease`, :class:`DuplicateRequest`)
        or a failure (:class:`StoreError`) nothing of the batch is written.

        Returns the renewed leases that the database holds as ended (by another writer):
        ``{lease id: (state, reason)}``, for the caller to drop from memory.
        """
        new: dict[str, Lease] = {}
        served: dict[str, float] = {}  # request id -> when its lease was granted
        ended: dict[str, tuple[str, float, str | None]] = {}
        queued: dict[str, Request] = {}
        left: dict[str, tuple[str, float]] = {}  # request id -> (outcome, when)
        renewed: dict[str, Lease] = {}
        parks: dict[str, Lease] = {}  # lease id -> its latest park state
        retaken: set[str] = set()  # GPUs where a parked lease takes its share again
        for ch in batch:
            for g in ch.granted:
                new[g.lease.id] = g.lease
                if g.request is not None:
                    served[g.request.id] = g.lease.created_at
            for lease in ch.parks:
                parks[lease.id] = lease
            for req, lease in ch.resumed:
                served[req.id] = ch.now
                retaken.add(lease.gpu_uuid)
            for lease, state, reason in ch.ended:
                if state not in ENDED_LEASE_STATES:
                    raise ValueError(f"a lease ends as released, expired or revoked, not {state!r}")
                ended.setdefault(lease.id, (state, ch.now, reason))
                renewed.pop(lease.id, None)
            for req in ch.queued:
                queued[req.id] = req
            for req, outcome in ch.dropped:
                left.setdefault(req.id, (outcome, ch.now))
            for lease in ch.renewed:
                if lease.id not in ended:
                    renewed[lease.id] = lease
        for rid, at in served.items():
            left.setdefault(rid, ("granted", at))
        # a new lease is inserted with its latest park state
        new = {i: _parked_as(x, parks.get(i)) for i, x in new.items()}
        still = [x for x in new.values() if x.id not in ended]
        rows = [_lease_row(x) for x in still] + [
            {
                **_lease_row(x),
                **dict(zip(("state", "ended_at", "reason"), ended[x.id], strict=True)),
            }
            for x in new.values()
            if x.id in ended
        ]
        moves = [_park_params(x) for i, x in parks.items() if i not in new and i not in ended]
        gone: dict[str, tuple[str, str | None]] = {}
        if not (new or ended or queued or left or renewed or parks):
            return gone
        with self._tx(f"record {len(batch)} change(s)") as conn:
            old_ends = [
                {"b_id": lid, "b_state": st, "b_ended_at": at, "b_reason": why}
                for lid, (st, at, why) in ended.items()
                if lid not in new
            ]
            if old_ends:
                conn.execute(_END, old_ends)
            if moves:  # before the capacity sums: a parked row holds nothing, a resumed one does
                conn.execute(_PARK, moves)
            if still or retaken:
                # one-lease-per-kernel: the partial unique index (IntegrityError below)
                self._check_grants(conn, still, capacity_ppm, kernels=False, also=retaken)
            if rows:
                try:
                    conn.execute(_INSERT_LEASE, rows)
                except IntegrityError as exc:
                    raise DuplicateLease(
                        "This kernel already holds an active GPU lease (granted concurrently); "
                        "release it before asking for another.",
                    ) from exc
            beats = [
                _renew_params(
                    x.id, x.renewed_at, x.expires_at, x.pid, x.execution_state, x.last_activity
                )
                for x in renewed.values()
            ]
            if beats:
                conn.execute(_RENEW, beats)
                ids = sorted(renewed)
                for i in range(0, len(ids), 500):
                    for lid, st, why in conn.execute(_ENDED_AMONG, {"ids": ids[i : i + 500]}):
                        gone[lid] = (st, why)
            # requests that left first: a kernel whose resume request left may wait anew
            out = [{"b_id": rid} for rid in left if rid not in queued]
            if out:
                conn.execute(_DELETE_REQUEST, out)
            if queued:
                waiting = [_request_row(r) for r in queued.values() if r.id not in left]
                try:
                    if waiting:
                        conn.execute(requests.insert(), waiting)
                    conn.execute(queue_log.insert(), [_queue_log_row(r) for r in queued.values()])
                except IntegrityError as exc:
                    raise DuplicateRequest(
                        "A kernel of this batch is already waiting for a GPU; keep polling "
                        "the same request.",
                    ) from exc
            if left:
                conn.execute(
                    _LEAVE_QUEUE,
                    [
                        {"b_id": rid, "b_left_at": at, "b_outcome": outcome}
                        for rid, (outcome, at) in left.items()
                    ],
                )
        return gone

    @staticmethod
    def _check_grants(
        conn: Connection,
        new: list[Lease],
        capacity_ppm: int,
        *,
        kernels: bool = True,
        also: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """Capacity on each GPU of ``new`` and of ``also`` (GPUs where a parked lease's
        share was taken again: its row is already ``resuming``) with their rows locked,
        and, with ``kernels``, that no kernel of ``new`` holds another active lease (a
        query per lease, naming it)."""
        adding: dict[str, int] = dict.fromkeys(also, 0)
        for lease in new:
            if lease.state != "active":
                raise ValueError(f"insert_leases records new active leases, not {lease.state!r}")
            adding[lease.gpu_uuid] = adding.get(lease.gpu_uuid, 0) + lease.fraction_ppm
        uuids = sorted(adding)  # lock in a fixed order: no deadlock between two brokers
        caps: dict[str, int] = {u: c for u, c in conn.execute(_LOCK_GPUS, {"uuids": uuids})}
        held_sql = _HELD_ON_GPUS_SQLITE if conn.dialect.name == "sqlite" else _HELD_ON_GPUS
        held: dict[str, Any] = {u: n for u, n in conn.execute(held_sql, {"uuids": uuids})}
        for uuid in uuids:
            if uuid not in caps:
                raise CapacityConflict(
                    f"GPU {uuid} is not in the broker's inventory; restart the broker so it "
                    "records its GPUs, or ask for another GPU.",
                    gpu_uuid=uuid,
                )
            limit = min(capacity_ppm, caps[uuid])
            total = int(held.get(uuid) or 0) + adding[uuid]
            if total > limit and not adding[uuid]:
                raise CapacityConflict(
                    f"GPU {uuid} has no room to resume a parked lease: "
                    f"{int(held.get(uuid) or 0) / PPM:g} of {limit / PPM:g} would be leased "
                    "(another broker process granted it first); keep waiting to resume.",
                    gpu_uuid=uuid,
                )
            if total > limit:
                raise CapacityConflict(
                    f"GPU {uuid} cannot take {adding[uuid] / PPM:g} more of its capacity: "
                    f"{int(held.get(uuid) or 0) / PPM:g} of {limit / PPM:g} is already leased "
                    "(another broker process granted it first); wait in the queue or retry.",
                    gpu_uuid=uuid,
                )
        if not kernels:
            return
        seen: set[tuple[str, str]] = set()
        for lease in new:
            key = (lease.user, lease.kernel_id)
            other = conn.execute(
                _ACTIVE_FOR_KERNEL, {"b_user": lease.user, "b_kernel": lease.kernel_id}
            ).scalar()
            if key in seen or other is not None:
                raise DuplicateLease(
                    f"Kernel {lease.kernel_id} of {lease.user} already holds an active GPU "
                    "lease; release it before asking for another.",
                    lease_id=other,
                )
            seen.add(key)

    def end_leases(self, ends: list[tuple[str, str, float, str | None]]) -> None:
        """End leases ``[(lease_id, new_state, ended_at, reason)]`` in one transaction.

        Only rows still active change, so repeating a release is harmless.
        """
        if not ends:
            return
        params = []
        for lease_id, state, ended_at, reason in ends:
            if state not in ENDED_LEASE_STATES:
                raise ValueError(f"a lease ends as released, expired or revoked, not {state!r}")
            params.append(
                {"b_id": lease_id, "b_state": state, "b_ended_at": ended_at, "b_reason": reason}
            )
        with self._tx("end leases") as conn:
            conn.execute(_END, params)


def _parked_as(lease: Lease, latest: Lease | None) -> Lease:
    """``lease`` with the park state of ``latest`` (its latest record in a batch), if any."""
    if latest is None:
        return lease
    return replace(lease, park=latest.park, parked_at=latest.parked_at)


__all__ = ["LeaseWrites"]
