"""Persistence: the only module that speaks SQL (SQLAlchemy Core, no ORM).

The broker keeps its working state in memory (:class:`provisioner.model.PoolState`)
and writes every change here, one transaction per change, so leases, the queue and
quotas survive a restart. SQLite is the embedded default (WAL journal,
``synchronous=NORMAL``, a busy timeout, and ``BEGIN IMMEDIATE`` for every write);
PostgreSQL is supported through psycopg2.

The capacity invariant is enforced by the database itself, not only by the broker's
memory: :meth:`Store.insert_leases` locks the GPU rows it grants on (``SELECT … FOR
UPDATE`` on PostgreSQL, the database write lock on SQLite), re-checks that the active
fractions on each GPU plus the new ones fit, and that the kernel holds no other
active lease, all in the transaction that inserts. Two broker processes writing at
once therefore cannot over-allocate a GPU.

Tables (Alembic revision ``migrate.HEAD``; the revisions in ``migrations/versions/``)::

    gpu_lease_alembic_version  version_num (Alembic's: the revision the database is at)
    schema_version  version PK, description, applied_at (versions 1-7, before Alembic)
    gpus            uuid PK, node, name, memory_mb, idx, capacity_ppm
    leases          id PK, user, kernel_id, gpu_uuid, fraction_ppm, memory_limit_mb,
                    state, grp, created_at, renewed_at, expires_at, ended_at, reason,
                    pid, execution_state, last_activity, user_groups (JSON, v2),
                    park_state (NULL|'parking'|'parked'|'resuming'), parked_at (v7)
                    indexes: (state), (user), (gpu_uuid) WHERE state='active',
                    UNIQUE (user, kernel_id) WHERE state='active', (ended_at) (v3)
    requests        id PK, user, kernel_id, fraction_ppm, groups (JSON), grp, node,
                    gpu_uuids (JSON or NULL), priority, arrived_at, last_polled_at,
                    resume_of (v7: the parked lease a resume request brings back)
                    UNIQUE (user, kernel_id)
    queue_log       id PK (the request's), user, kernel_id, fraction_ppm, grp,
                    user_groups (JSON), arrived_at, left_at, outcome (NULL while
                    waiting | 'granted' | 'cancelled' | 'dropped')        (v3)
    quotas          level ('default'|'group'|'user'), name, max_fraction_ppm,
                    max_leases, max_lease_fraction_ppm, budget_fraction_hours,
                    budget_window_s, priority; PK (level, name)
    nodes           name PK, gpus (JSON), agent_version, registered_at, drained (v4),
                    enforce (v5)
    leadership      id PK (always 1), holder, epoch, acquired_at, renewed_at,
                    expires_at (v6; used on PostgreSQL with ``--ha-lock``)

Times are float POSIX seconds; fractions are integer parts per million.

Parking (v7): a parked lease's row stays ``state='active'`` (it is not ended: the
one-lease-per-kernel index still holds) with ``park_state='parked'``, and holds no
capacity: every capacity sum skips it (``store_schema._HOLDS``). Loading puts it into
``PoolState.parked`` (``PoolState.build``), so a restarted broker keeps it parked.

Fenced leadership (PostgreSQL, ``--ha-lock``): ``store.fencing``
(:class:`~provisioner.broker.store.fencing.Fencing`, ``store_fencing.py``) takes, renews and
gives up the ``leadership`` row, and once its fence is set every write transaction first
checks it: a deposed broker can never commit.

The parts: ``schema.py`` (tables, statements, rows to objects by column name),
``migrate.py`` (Alembic at open; ``legacy.py``: the steps before it), ``engine.py``
(connections and transactions: :class:`~provisioner.broker.store.engine.Database`),
``store_writes.py`` (grants and the group commit: :class:`~provisioner.broker.store.writes.LeaseWrites`),
and this module's :class:`Store`, the one class its callers use.

Errors: every SQLAlchemy or driver error is translated here into
:class:`~provisioner.errors.StoreError`; a grant the database refuses raises
:class:`~provisioner.errors.CapacityConflict` (or its subclass ``DuplicateLease``, so
``except CapacityConflict`` catches every refused grant: the caller's view of the pool is
stale), and nothing was changed. An unusable URL or setting given to the constructor
raises ``StoreError`` too. A write refused by the fence raises
:class:`~provisioner.errors.NotActive`.
"""

from __future__ import annotations

import json
import time

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from ...errors import (
    DuplicateRequest,
)
from ...model import (
    GPU,
    LEASE_STATES,
    QUEUE_OUTCOMES,
    Lease,
    Node,
    QueueRecord,
    Quota,
    QuotaBook,
    Request,
    attribution,
    quota_key_problem,
)
from .engine import (
    DEFAULT_PG_TIMEOUT,
    DEFAULT_SQLITE_BUSY_TIMEOUT,
    DEFAULT_SQLITE_CHECKPOINT_INTERVAL,
    DEFAULT_SQLITE_SYNCHRONOUS,
    SQLITE_SYNCHRONOUS,
)
from .fencing import Fence
from .migrate import HEAD, upgrade_schema
from .schema import (
    _COUNTS,
    _DELETE_REQUEST,
    _EXTEND,
    _GET_LEASE,
    _LEAVE_QUEUE,
    _PPM_HOURS,
    _SELECT_ACTIVE,
    _SELECT_LEASES,
    _SELECT_REQUESTS,
    _TOUCH_REQUEST,
    _UPDATE_GPU,
    _UPDATE_QUOTA,
    _USAGE_BY_GROUP,
    _USAGE_BY_USER,
    _USER_USAGE,
    _gpu_table,
    _lease_from_row,
    _queue_log_row,
    _queue_record_from_row,
    _quota_from_row,
    _request_from_row,
    _request_row,
    gpus,
    leases,
    nodes,
    queue_log,
    quotas,
    requests,
)
from .writes import LeaseWrites

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "DEFAULT_SQLITE_BUSY_TIMEOUT",
    "DEFAULT_SQLITE_CHECKPOINT_INTERVAL",
    "DEFAULT_SQLITE_SYNCHRONOUS",
    "HEAD",
    "SQLITE_SYNCHRONOUS",
    "Fence",
    "Store",
    "upgrade_schema",
]


class Store(LeaseWrites):
    """The lease database as the broker uses it: the connection and its timeouts are
    :class:`~provisioner.broker.store.engine.Database`'s, the lease writes
    :class:`~provisioner.broker.store.writes.LeaseWrites`', leadership ``self.fencing``;
    here the GPUs, lease reads, the queue, quotas, usage, history and nodes. Every method
    is one transaction."""

    def sync_gpus(self, gpus: list[GPU], capacity_ppm: int) -> None:
        """Record the broker's GPUs (declared or discovered) with their capacity.

        Called at broker start. GPUs no longer present are removed unless they still
        carry active leases (those rows stay until the leases end).
        """
        rows = [
            {
                "b_uuid": g.uuid,
                "node": g.node,
                "name": g.name,
                "memory_mb": g.memory_mb,
                "idx": g.index,
                "capacity_ppm": capacity_ppm,
            }
            for g in gpus
        ]
        keep = [g.uuid for g in gpus]
        with self._tx("record the GPU inventory") as conn:
            existing = set(conn.execute(sa.select(_gpu_table.c.uuid)).scalars())
            updates = [r for r in rows if r["b_uuid"] in existing]
            inserts = [
                {("uuid" if k == "b_uuid" else k): v for k, v in r.items()}
                for r in rows
                if r["b_uuid"] not in existing
            ]
            if updates:
                conn.execute(_UPDATE_GPU, updates)
            if inserts:
                conn.execute(_gpu_table.insert(), inserts)
            gone = existing.difference(keep)
            if gone:
                busy = sa.select(leases.c.gpu_uuid).where(leases.c.state == "active")
                t = _gpu_table
                conn.execute(t.delete().where(t.c.uuid.in_(gone), t.c.uuid.not_in(busy)))

    def list_gpus(self) -> list[tuple[GPU, int]]:
        """The recorded GPUs with their capacity (ppm), ordered by node and index."""
        stmt = sa.select(
            gpus.c.uuid, gpus.c.node, gpus.c.name, gpus.c.memory_mb, gpus.c.idx, gpus.c.capacity_ppm
        ).order_by(gpus.c.node, gpus.c.idx, gpus.c.uuid)
        with self._tx("list the GPUs", write=False) as conn:
            return [(GPU(u, n, nm, m, i), cap) for (u, n, nm, m, i, cap) in conn.execute(stmt)]

    def load_active(self) -> tuple[list[Lease], list[Request]]:
        """Active leases (parked ones too, with ``park``; ``PoolState.build`` files them
        apart) and queued requests (in arrival order, resume requests with ``resume_of``),
        read at broker start."""
        with self._tx("load the active leases and the queue", write=False) as conn:
            active = [_lease_from_row(row) for row in conn.execute(_SELECT_ACTIVE)]
            queued = [_request_from_row(row) for row in conn.execute(_SELECT_REQUESTS)]
        return active, queued

    def extend_active(self, expires_at_min: float) -> int:
        """Grace after a restart: raise every active lease's expiry to at least ``expires_at_min``.

        Returns how many leases were extended (those already expiring later are left alone).
        """
        with self._tx("extend the active leases after a restart") as conn:
            return conn.execute(_EXTEND, {"b_min": expires_at_min}).rowcount

    def get_lease(self, lease_id: str) -> Lease | None:
        """One lease in any state (history included), or ``None``."""
        with self._tx("read a lease", write=False) as conn:
            row = conn.execute(_GET_LEASE, {"lid": lease_id}).first()
        return None if row is None else _lease_from_row(row)

    def list_leases(
        self,
        *,
        user: str | None = None,
        states: tuple[str, ...] | None = None,
        limit: int = 1000,
    ) -> list[Lease]:
        """Leases, newest first, optionally of one user and/or in some states."""
        stmt = _SELECT_LEASES
        if user is not None:
            stmt = stmt.where(leases.c.user == user)
        if states is not None:
            stmt = stmt.where(leases.c.state.in_(states))
        stmt = stmt.order_by(leases.c.created_at.desc(), leases.c.id).limit(limit)
        with self._tx("list leases", write=False) as conn:
            return [_lease_from_row(row) for row in conn.execute(stmt)]

    def insert_request(self, req: Request) -> None:
        """Record a request that waits; raises :class:`DuplicateRequest` if the kernel already waits."""
        with self._tx("queue a request") as conn:
            try:
                conn.execute(requests.insert(), _request_row(req))
                conn.execute(queue_log.insert(), _queue_log_row(req))
            except IntegrityError as exc:
                raise DuplicateRequest(
                    f"Kernel {req.kernel_id} of {req.user} is already waiting for a GPU; "
                    "keep polling the same request.",
                ) from exc

    def touch_request(self, request_id: str, last_polled_at: float) -> None:
        """Record that the client of a queued request is still polling."""
        with self._tx("refresh a queued request") as conn:
            conn.execute(_TOUCH_REQUEST, {"b_id": request_id, "b_last_polled_at": last_polled_at})

    def delete_requests(
        self, request_ids: list[str], *, outcome: str = "cancelled", at: float | None = None
    ) -> None:
        """Take queued requests out of the queue without a lease, logging how and when.

        ``outcome`` is ``"cancelled"`` (its client withdrew it) or ``"dropped"`` (its
        client stopped polling); ``at`` defaults to now.
        """
        if outcome not in QUEUE_OUTCOMES or outcome == "granted":
            raise ValueError(
                f"a request leaves without a lease cancelled or dropped, not {outcome!r}"
            )
        if not request_ids:
            return
        left_at = time.time() if at is None else at
        with self._tx("drop queued requests") as conn:
            conn.execute(_DELETE_REQUEST, [{"b_id": rid} for rid in request_ids])
            conn.execute(
                _LEAVE_QUEUE,
                [{"b_id": rid, "b_left_at": left_at, "b_outcome": outcome} for rid in request_ids],
            )

    def get_request(self, request_id: str) -> Request | None:
        """One queued request by id, or ``None``."""
        stmt = sa.select(requests).where(requests.c.id == request_id)
        with self._tx("read a queued request", write=False) as conn:
            row = conn.execute(stmt).first()
        return None if row is None else _request_from_row(row)

    def load_quotas(self) -> QuotaBook:
        """Every quota: the default, per group and per user."""
        book = QuotaBook()
        with self._tx("load the quotas", write=False) as conn:
            rows = conn.execute(sa.select(quotas)).all()
        for row in rows:
            level, name, quota = row.level, row.name, _quota_from_row(row)
            if level == "default":
                book.default = quota
            elif level == "group":
                book.groups[name] = quota
            else:
                book.users[name] = quota
        return book

    @staticmethod
    def _check_level(level: str, name: str) -> None:
        why = quota_key_problem(level, name)
        if why:
            raise ValueError(why)

    def put_quota(self, level: str, name: str, quota: Quota) -> None:
        """Set (replace) the quota of the default (name ``''``), a group or a user."""
        self._check_level(level, name)
        values = {f: getattr(quota, f) for f in Quota.FIELDS}
        with self._tx("save a quota") as conn:
            if not conn.execute(
                _UPDATE_QUOTA, {"b_level": level, "b_name": name, **values}
            ).rowcount:
                conn.execute(quotas.insert(), {"level": level, "name": name, **values})

    def delete_quota(self, level: str, name: str) -> bool:
        """Remove a quota; returns whether there was one."""
        self._check_level(level, name)
        stmt = quotas.delete().where(quotas.c.level == level, quotas.c.name == name)
        with self._tx("remove a quota") as conn:
            return bool(conn.execute(stmt).rowcount)

    def usage(self, since: float, until: float, by: str = "user") -> dict[str, float]:
        """Fraction-hours used in ``[since, until)`` per user or per group.

        Active leases count up to ``until``. By group, each lease counts as
        :func:`~provisioner.model.attribution` says: wholly for its course kernel's
        group, else split equally among its user's groups, else under ``""``.
        """
        if by not in ("user", "group"):
            raise ValueError(f"usage is by 'user' or 'group', not {by!r}")
        params = {"since": since, "until": until}
        out: dict[str, float] = {}
        with self._tx("compute usage", write=False) as conn:
            if by == "user":
                for user, ppm_s in conn.execute(_USAGE_BY_USER, params):
                    out[user] = out.get(user, 0.0) + float(ppm_s or 0) / _PPM_HOURS
                return out
            rows = conn.execute(_USAGE_BY_GROUP, params).all()
        for grp, user_groups, ppm_s in rows:
            hours = float(ppm_s or 0) / _PPM_HOURS
            for name, share in attribution(grp, json.loads(user_groups or "[]")).items():
                out[name] = out.get(name, 0.0) + hours * share
        return out

    def user_usage(self, user: str, since: float, until: float) -> float:
        """Fraction-hours one user used in ``[since, until)`` (for the budget quota)."""
        with self._tx("compute a user's usage", write=False) as conn:
            ppm_s = conn.execute(
                _USER_USAGE, {"since": since, "until": until, "b_user": user}
            ).scalar()
        return float(ppm_s or 0) / _PPM_HOURS

    def history(
        self, since: float, until: float, *, user: str | None = None
    ) -> tuple[list[Lease], list[QueueRecord]]:
        """Leases held and requests queued at some time in ``[since, until)``.

        Read for :func:`provisioner.broker.rules.history.compute` (``GET /api/v1/history``); an active
        lease or a request still waiting counts as lasting up to ``until``. ``user``:
        only that user's.
        """
        stmt = _SELECT_LEASES.where(
            leases.c.created_at < until,
            sa.or_(leases.c.state == "active", leases.c.ended_at >= since),
        )
        qstmt = sa.select(queue_log).where(
            queue_log.c.arrived_at < until,
            sa.or_(queue_log.c.left_at.is_(None), queue_log.c.left_at >= since),
        )
        if user is not None:
            stmt = stmt.where(leases.c.user == user)
            qstmt = qstmt.where(queue_log.c.user == user)
        with self._tx("read the history", write=False) as conn:
            held = [_lease_from_row(row) for row in conn.execute(stmt)]
            queued = [_queue_record_from_row(row) for row in conn.execute(qstmt)]
        return held, queued

    def counts(self) -> dict[str, int]:
        """Number of leases in each wire state (every state present, zero included): a
        live lease being parked, parked or resumed counts under that state, not active."""
        out: dict[str, int] = dict.fromkeys(LEASE_STATES, 0)
        with self._tx("count leases", write=False) as conn:
            for state, park, n in conn.execute(_COUNTS):
                key = park if park is not None and state == "active" else state
                out[key] += int(n)
        return out

    def put_node(self, node: Node) -> None:
        """Record a node's registration (insert or replace); ``last_seen`` stays in memory."""
        row = {
            "gpus": json.dumps(
                [
                    {"uuid": g.uuid, "name": g.name, "memory_mb": g.memory_mb, "index": g.index}
                    for g in node.gpus
                ]
            ),
            "agent_version": node.agent_version,
            "registered_at": node.registered_at,
            "drained": node.drained,
            "enforce": node.enforce,
        }
        with self._tx(f"record node {node.name}") as conn:
            done = conn.execute(nodes.update().where(nodes.c.name == node.name).values(**row))
            if not done.rowcount:
                conn.execute(nodes.insert().values(name=node.name, **row))

    def set_node_drained(self, name: str, drained: bool) -> None:
        with self._tx(f"drain node {name}") as conn:
            conn.execute(nodes.update().where(nodes.c.name == name).values(drained=drained))

    def load_nodes(self, seen_at: float) -> list[Node]:
        """The registered nodes, each seen at ``seen_at`` (a restart gives agents a grace)."""
        stmt = sa.select(nodes).order_by(nodes.c.name)
        with self._tx("load the nodes", write=False) as conn:
            rows = list(conn.execute(stmt))
        return [
            Node(
                name=row.name,
                gpus=[
                    GPU(g["uuid"], row.name, g["name"], int(g["memory_mb"]), int(g["index"]))
                    for g in json.loads(row.gpus)
                ],
                agent_version=row.agent_version,
                registered_at=float(row.registered_at),
                last_seen=seen_at,
                drained=bool(row.drained),
                enforce=row.enforce or "report",
            )
            for row in rows
        ]
