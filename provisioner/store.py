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

Tables (schema version 6)::

    schema_version  version PK, description, applied_at
    gpus            uuid PK, node, name, memory_mb, idx, capacity_ppm
    leases          id PK, user, kernel_id, gpu_uuid, fraction_ppm, memory_limit_mb,
                    state, grp, created_at, renewed_at, expires_at, ended_at, reason,
                    pid, execution_state, last_activity, user_groups (JSON, v2)
                    indexes: (state), (user), (gpu_uuid) WHERE state='active',
                    UNIQUE (user, kernel_id) WHERE state='active', (ended_at) (v3)
    requests        id PK, user, kernel_id, fraction_ppm, groups (JSON), grp, node,
                    gpu_uuids (JSON or NULL), priority, arrived_at, last_polled_at
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

Fenced leadership (PostgreSQL, ``--ha-lock``): the one ``leadership`` row names the
active broker (``holder``), its ``epoch`` (raised by every takeover) and when its
leadership ends (``expires_at``, by the database's clock, ``now()``). A standby takes
the row only when it is free or expired (:meth:`Store.take_leadership`), the active
extends it while the row still names it (:meth:`Store.renew_leadership`), and once
:meth:`Store.set_fence` is called every write transaction first locks the row
``FOR SHARE`` and checks holder, epoch and expiry: a deposed broker can never commit
(:class:`~provisioner.errors.NotActive`, nothing written), and a takeover waits until
the writes in flight have committed. The fence also stamps the transaction with its
epoch (``current_setting('gpu_lease.epoch')``) for audit triggers.

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
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from .errors import (
    CapacityConflict,
    DuplicateLease,
    DuplicateRequest,
    NotActive,
    StoreError,
)
from .model import (
    GPU,
    LEASE_STATES,
    PPM,
    QUEUE_OUTCOMES,
    Changes,
    Lease,
    Node,
    QueueRecord,
    Quota,
    QuotaBook,
    Request,
    attribution,
    quota_key_problem,
)

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "DEFAULT_SQLITE_BUSY_TIMEOUT",
    "DEFAULT_SQLITE_CHECKPOINT_INTERVAL",
    "DEFAULT_SQLITE_SYNCHRONOUS",
    "MIGRATIONS",
    "SQLITE_SYNCHRONOUS",
    "Fence",
    "Migration",
    "Store",
    "upgrade_schema",
]


# --------------------------------------------------------------------------- schema

metadata = sa.MetaData()

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.String(255), nullable=False),
    sa.Column("applied_at", sa.Double, nullable=False),
)

_STATE_IN = "state IN ('active', 'revoked', 'released', 'expired')"


#: the partial indexes on active leases (schema version 1), created with the table
_PARTIAL_INDEXES = (
    "CREATE INDEX ix_leases_active_gpu ON leases (gpu_uuid) WHERE state = 'active'",
    'CREATE UNIQUE INDEX uq_leases_active_kernel ON leases ("user", kernel_id) '
    "WHERE state = 'active'",
)


def _define_v1(md: sa.MetaData) -> tuple[sa.Table, sa.Table, sa.Table, sa.Table]:
    """The tables and indexes exactly as schema version 1 created them (frozen: never edit).

    Later versions change the module's tables after this (``append_column``, new
    tables) and say so in their migration, so that an old database is always built the
    way version 1 built it and then upgraded step by step.
    """
    gpus = sa.Table(
        "gpus",
        md,
        sa.Column("uuid", sa.String(128), primary_key=True),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("memory_mb", sa.BigInteger, nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("capacity_ppm", sa.BigInteger, nullable=False),
    )

    leases = sa.Table(
        "leases",
        md,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("kernel_id", sa.String(255), nullable=False),
        sa.Column("gpu_uuid", sa.String(128), nullable=False),
        sa.Column("fraction_ppm", sa.BigInteger, nullable=False),
        sa.Column("memory_limit_mb", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("grp", sa.String(255), nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("renewed_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("ended_at", sa.Double, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("pid", sa.BigInteger, nullable=True),
        sa.Column("execution_state", sa.String(32), nullable=True),
        sa.Column("last_activity", sa.Double, nullable=True),
        sa.CheckConstraint(_STATE_IN, name="ck_leases_state"),
        sa.CheckConstraint("fraction_ppm > 0", name="ck_leases_fraction"),
        sa.CheckConstraint("state = 'active' OR ended_at IS NOT NULL", name="ck_leases_ended"),
    )
    sa.Index("ix_leases_state", leases.c.state)
    sa.Index("ix_leases_user", leases.c.user)
    # The partial indexes, as DDL both SQLite and PostgreSQL read the same way: the
    # ``postgresql_where=`` keyword would import SQLAlchemy's PostgreSQL dialect (~60 ms
    # of every broker's start) even on SQLite.
    for ddl in _PARTIAL_INDEXES:
        event.listen(leases, "after_create", sa.DDL(ddl))

    requests = sa.Table(
        "requests",
        md,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("kernel_id", sa.String(255), nullable=False),
        sa.Column("fraction_ppm", sa.BigInteger, nullable=False),
        sa.Column("groups", sa.Text, nullable=False),
        sa.Column("grp", sa.String(255), nullable=True),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("gpu_uuids", sa.Text, nullable=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("arrived_at", sa.Double, nullable=False),
        sa.Column("last_polled_at", sa.Double, nullable=False),
        sa.UniqueConstraint("user", "kernel_id", name="uq_requests_kernel"),
    )

    quotas = sa.Table(
        "quotas",
        md,
        sa.Column("level", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("max_fraction_ppm", sa.BigInteger, nullable=True),
        sa.Column("max_leases", sa.Integer, nullable=True),
        sa.Column("max_lease_fraction_ppm", sa.BigInteger, nullable=True),
        sa.Column("budget_fraction_hours", sa.Double, nullable=True),
        sa.Column("budget_window_s", sa.BigInteger, nullable=True),
        sa.Column("priority", sa.Integer, nullable=True),
        sa.CheckConstraint("level IN ('default', 'group', 'user')", name="ck_quotas_level"),
    )
    return gpus, leases, requests, quotas


gpus, leases, requests, quotas = _define_v1(metadata)
_gpu_table = gpus  # for methods whose parameter is named ``gpus``
# version 2: the user's groups (courses) when the lease was granted, a JSON list (NULL:
# granted before version 2); ``usage --by group`` attributes leases without a course
# kernel's group to them (model.attribution)
leases.append_column(sa.Column("user_groups", sa.Text, nullable=True))

# version 3: every request's stay in the queue, for the history of queue length and
# waits (``requests`` holds only those waiting now); leases by end time for the same
_OUTCOME_IN = "outcome IS NULL OR outcome IN ('granted', 'cancelled', 'dropped')"
queue_log = sa.Table(
    "queue_log",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("user", sa.String(255), nullable=False),
    sa.Column("kernel_id", sa.String(255), nullable=False),
    sa.Column("fraction_ppm", sa.BigInteger, nullable=False),
    sa.Column("grp", sa.String(255), nullable=True),
    sa.Column("user_groups", sa.Text, nullable=False),
    sa.Column("arrived_at", sa.Double, nullable=False),
    sa.Column("left_at", sa.Double, nullable=True),
    sa.Column("outcome", sa.String(16), nullable=True),
    sa.CheckConstraint(_OUTCOME_IN, name="ck_queue_log_outcome"),
)
_ix_queue_log_arrived = sa.Index("ix_queue_log_arrived", queue_log.c.arrived_at)
_ix_leases_ended = sa.Index("ix_leases_ended", leases.c.ended_at)


def _define_nodes(md: sa.MetaData) -> sa.Table:
    """Version 4: the nodes node agents registered (frozen: never edit)."""
    return sa.Table(
        "nodes",
        md,
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("gpus", sa.Text, nullable=False),  # JSON [{uuid, name, memory_mb, index}]
        sa.Column("agent_version", sa.String(64), nullable=False),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("drained", sa.Boolean, nullable=False),
    )


nodes = _define_nodes(metadata)
# version 5: the agent's --enforce mode (NULL: registered before version 5, 'report')
nodes.append_column(sa.Column("enforce", sa.String(8), nullable=True))


def _define_v6_leadership(md: sa.MetaData) -> sa.Table:
    """The leadership table as schema version 6 created it (frozen: never edit)."""
    return sa.Table(
        "leadership",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("holder", sa.String(255), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", sa.Double, nullable=True),
        sa.Column("renewed_at", sa.Double, nullable=True),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_leadership_one_row"),
    )


# version 6: fenced leadership of active/standby brokers (one row, see the module docstring)
leadership = _define_v6_leadership(metadata)

# --------------------------------------------------------------------------- migrations


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply(conn)`` runs inside the upgrade transaction."""

    version: int
    description: str
    apply: Callable[[Connection], None]


def _v1_initial(conn: Connection) -> None:
    md = sa.MetaData()
    md.create_all(conn, tables=list(_define_v1(md)), checkfirst=True)


def _v2_lease_groups(conn: Connection) -> None:
    conn.execute(sa.text("ALTER TABLE leases ADD COLUMN user_groups TEXT"))


def _v3_queue_log(conn: Connection) -> None:
    queue_log.create(conn)  # with its index
    _ix_leases_ended.create(conn)
    # the requests waiting now arrived before the log existed: log them too
    cols = ("id", "user", "kernel_id", "fraction_ppm", "grp", "arrived_at")
    conn.execute(
        queue_log.insert().from_select(
            [*cols, "user_groups"],
            sa.select(*(requests.c[c] for c in cols), requests.c.groups),
        )
    )


def _v5_node_enforce(conn: Connection) -> None:
    conn.execute(sa.text("ALTER TABLE nodes ADD COLUMN enforce VARCHAR(8)"))


def _v4_nodes(conn: Connection) -> None:
    md = sa.MetaData()
    md.create_all(conn, tables=[_define_nodes(md)], checkfirst=True)


def _v6_leadership(conn: Connection) -> None:
    table = _define_v6_leadership(sa.MetaData())
    table.create(conn, checkfirst=True)
    conn.execute(table.insert().values(id=1, holder=None, epoch=0, expires_at=0.0))


#: Ordered schema steps; append ``Migration(N + 1, ...)`` to change the schema (and change
#: the module's tables after ``_define_v1`` to match).
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", _v1_initial),
    Migration(2, "leases record their user's groups", _v2_lease_groups),
    Migration(3, "the queue's history", _v3_queue_log),
    Migration(4, "nodes registered by node agents", _v4_nodes),
    Migration(5, "nodes record their agent's enforcement mode", _v5_node_enforce),
    Migration(6, "fenced leadership of active/standby brokers", _v6_leadership),
)

_PG_UPGRADE_LOCK = 0x67_6C_5F_73_74_6F_72  # pg_advisory_xact_lock key ("gl_stor")


def upgrade_schema(
    conn: Connection, migrations: Sequence[Migration] = MIGRATIONS, *, now: float | None = None
) -> int:
    """Apply the migrations the database lacks, inside the caller's transaction.

    Called from :meth:`Store.upgrade` on every start; safe to repeat and safe when two
    processes start at once (SQLite: the write lock; PostgreSQL: an advisory lock).
    Returns the schema version the database has afterwards.
    """
    if conn.dialect.name == "postgresql":
        # a migration may take longer than the broker's statement timeout, and may wait
        # for another process's migration
        conn.execute(sa.text("SET LOCAL statement_timeout = 0"))
        conn.execute(sa.text("SET LOCAL lock_timeout = 0"))
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_UPGRADE_LOCK)))
    schema_version.create(conn, checkfirst=True)
    current = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar() or 0
    known = max((m.version for m in migrations), default=0)
    if current > known:
        raise StoreError(
            f"The lease database has schema version {current}, newer than the {known} this "
            "version of jupyter-gpu-lease understands; upgrade jupyter-gpu-lease on this host."
        )
    stamp = time.time() if now is None else now
    for migration in sorted(migrations, key=lambda m: m.version):
        if migration.version <= current:
            continue
        migration.apply(conn)
        conn.execute(
            schema_version.insert().values(
                version=migration.version, description=migration.description, applied_at=stamp
            )
        )
        current = migration.version
    return current


# --------------------------------------------------------------------------- statements
# Built once; SQLAlchemy caches their compiled form per dialect.

_LEASE_COLS = (
    # in the order of Lease's fields, so that ``_lease_from_row(row)`` builds one
    leases.c.id,
    leases.c.user,
    leases.c.kernel_id,
    leases.c.gpu_uuid,
    leases.c.fraction_ppm,
    leases.c.memory_limit_mb,
    leases.c.state,
    leases.c.created_at,
    leases.c.renewed_at,
    leases.c.expires_at,
    leases.c.grp,
    leases.c.ended_at,
    leases.c.reason,
    leases.c.pid,
    leases.c.execution_state,
    leases.c.last_activity,
    leases.c.user_groups,  # a JSON list: see _lease_from_row
)
_SELECT_LEASES = sa.select(*_LEASE_COLS)
_SELECT_ACTIVE = _SELECT_LEASES.where(leases.c.state == "active").order_by(
    leases.c.created_at, leases.c.id
)
_GET_LEASE = _SELECT_LEASES.where(leases.c.id == sa.bindparam("lid"))
_LOCK_GPUS = (
    sa.select(gpus.c.uuid, gpus.c.capacity_ppm)
    .where(gpus.c.uuid.in_(sa.bindparam("uuids", expanding=True)))
    .order_by(gpus.c.uuid)
    .with_for_update()
)
_HELD_ON_GPUS = (
    sa.select(leases.c.gpu_uuid, sa.func.sum(leases.c.fraction_ppm))
    .where(leases.c.state == "active", leases.c.gpu_uuid.in_(sa.bindparam("uuids", expanding=True)))
    .group_by(leases.c.gpu_uuid)
)
# The same on SQLite, pinned to the partial per-GPU index: without statistics SQLite's
# planner prefers ix_leases_state for a one-GPU IN list and reads every active lease
# (3-6 ms per grant at 10,000 leases instead of microseconds).
_HELD_ON_GPUS_SQLITE = sa.text(
    "SELECT gpu_uuid, sum(fraction_ppm) FROM leases INDEXED BY ix_leases_active_gpu "
    "WHERE state = 'active' AND gpu_uuid IN :uuids GROUP BY gpu_uuid"
).bindparams(sa.bindparam("uuids", expanding=True))
_ACTIVE_FOR_KERNEL = sa.select(leases.c.id).where(
    leases.c.state == "active",
    leases.c.user == sa.bindparam("b_user"),
    leases.c.kernel_id == sa.bindparam("b_kernel"),
)
_INSERT_LEASE = leases.insert()
_DELETE_REQUEST = requests.delete().where(requests.c.id == sa.bindparam("b_id"))
_RENEW = (
    leases.update()
    .where(leases.c.id == sa.bindparam("b_id"), leases.c.state == "active")
    .values(
        renewed_at=sa.bindparam("b_renewed_at"),
        expires_at=sa.bindparam("b_expires_at"),
        pid=sa.bindparam("b_pid"),
        execution_state=sa.bindparam("b_execution_state"),
        last_activity=sa.bindparam("b_last_activity"),
    )
)
_END = (
    leases.update()
    .where(leases.c.id == sa.bindparam("b_id"), leases.c.state == "active")
    .values(
        state=sa.bindparam("b_state"),
        ended_at=sa.bindparam("b_ended_at"),
        reason=sa.bindparam("b_reason"),
    )
)
_ENDED_AMONG = sa.select(leases.c.id, leases.c.state, leases.c.reason).where(
    leases.c.id.in_(sa.bindparam("ids", expanding=True)), leases.c.state != "active"
)
_EXTEND = (
    leases.update()
    .where(leases.c.state == "active", leases.c.expires_at < sa.bindparam("b_min"))
    .values(expires_at=sa.bindparam("b_min"))
)
_REQUEST_COLS = (
    requests.c.id,
    requests.c.user,
    requests.c.kernel_id,
    requests.c.fraction_ppm,
    requests.c.arrived_at,
    requests.c.last_polled_at,
    requests.c.groups,
    requests.c.grp,
    requests.c.node,
    requests.c.gpu_uuids,
    requests.c.priority,
)
_SELECT_REQUESTS = sa.select(*_REQUEST_COLS).order_by(requests.c.arrived_at, requests.c.id)
_TOUCH_REQUEST = (
    requests.update()
    .where(requests.c.id == sa.bindparam("b_id"))
    .values(last_polled_at=sa.bindparam("b_last_polled_at"))
)
_UPDATE_GPU = (
    gpus.update()
    .where(gpus.c.uuid == sa.bindparam("b_uuid"))
    .values(
        node=sa.bindparam("node"),
        name=sa.bindparam("name"),
        memory_mb=sa.bindparam("memory_mb"),
        idx=sa.bindparam("idx"),
        capacity_ppm=sa.bindparam("capacity_ppm"),
    )
)
_QUOTA_COLS = tuple(quotas.c[f] for f in Quota.FIELDS)
_UPDATE_QUOTA = (
    quotas.update()
    .where(quotas.c.level == sa.bindparam("b_level"), quotas.c.name == sa.bindparam("b_name"))
    .values({f: sa.bindparam(f) for f in Quota.FIELDS})
)
_COUNTS = sa.select(leases.c.state, sa.func.count()).group_by(leases.c.state)
_LEAVE_QUEUE = (
    queue_log.update()
    .where(queue_log.c.id == sa.bindparam("b_id"), queue_log.c.left_at.is_(None))
    .values(left_at=sa.bindparam("b_left_at"), outcome=sa.bindparam("b_outcome"))
)
_QUEUE_LOG_COLS = (
    # in the order of QueueRecord's fields
    queue_log.c.id,
    queue_log.c.user,
    queue_log.c.kernel_id,
    queue_log.c.fraction_ppm,
    queue_log.c.arrived_at,
    queue_log.c.grp,
    queue_log.c.user_groups,
    queue_log.c.left_at,
    queue_log.c.outcome,
)

# usage: fraction x overlap of [created_at, end) with [since, until), end = until while active
_SINCE: sa.BindParameter[float] = sa.bindparam("since", type_=sa.Double())
_UNTIL: sa.BindParameter[float] = sa.bindparam("until", type_=sa.Double())
_END_AT = sa.case(
    (leases.c.state == "active", _UNTIL), else_=sa.func.coalesce(leases.c.ended_at, _UNTIL)
)
_OVERLAP = sa.case((_END_AT < _UNTIL, _END_AT), else_=_UNTIL) - sa.case(
    (leases.c.created_at > _SINCE, leases.c.created_at), else_=_SINCE
)
_PPM_SECONDS = sa.func.sum(leases.c.fraction_ppm * _OVERLAP)
_IN_WINDOW = (leases.c.created_at < _UNTIL, _END_AT > _SINCE)
_USAGE_BY_USER = sa.select(leases.c.user, _PPM_SECONDS).where(*_IN_WINDOW).group_by(leases.c.user)
# per (course kernel's group, user's groups): few rows, split by model.attribution
_USAGE_BY_GROUP = (
    sa.select(leases.c.grp, leases.c.user_groups, _PPM_SECONDS)
    .where(*_IN_WINDOW)
    .group_by(leases.c.grp, leases.c.user_groups)
)
_USER_USAGE = sa.select(_PPM_SECONDS).where(*_IN_WINDOW, leases.c.user == sa.bindparam("b_user"))
_PPM_HOURS = PPM * 3600.0

# leadership (PostgreSQL): every time by the database's clock
_DB_NOW = "CAST(EXTRACT(EPOCH FROM now()) AS DOUBLE PRECISION)"
_TAKE_LEADERSHIP = sa.text(
    f"UPDATE leadership SET holder = :holder, epoch = epoch + 1, acquired_at = {_DB_NOW}, "
    f"renewed_at = {_DB_NOW}, expires_at = {_DB_NOW} + :ttl "
    f"WHERE id = 1 AND (holder IS NULL OR expires_at <= {_DB_NOW}) RETURNING epoch"
)
_LEADER = sa.text(f"SELECT holder, epoch, expires_at - {_DB_NOW} FROM leadership WHERE id = 1")
_RENEW_LEADERSHIP = sa.text(
    f"UPDATE leadership SET renewed_at = {_DB_NOW}, expires_at = {_DB_NOW} + :ttl "
    "WHERE id = 1 AND holder = :holder AND epoch = :epoch"
)
_RELEASE_LEADERSHIP = sa.text(
    f"UPDATE leadership SET holder = NULL, expires_at = {_DB_NOW} "
    "WHERE id = 1 AND holder = :holder AND epoch = :epoch"
)
# the fence: first statement of every write transaction of an active broker
_FENCE = sa.text(
    f"SELECT holder, epoch, expires_at > {_DB_NOW}, "
    "set_config('gpu_lease.epoch', CAST(epoch AS TEXT), true) "
    "FROM leadership WHERE id = 1 FOR SHARE"
)

SQLITE_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: the store's defaults (the broker's traits of the same names start from these)
DEFAULT_SQLITE_SYNCHRONOUS = "NORMAL"
DEFAULT_SQLITE_BUSY_TIMEOUT = 5.0
DEFAULT_PG_TIMEOUT = 5.0
#: seconds between two WAL checkpoints of a SQLite file, made by a thread of the store's
#: own (0: SQLite's automatic checkpoints, inside whichever commit crosses 1,000 pages)
DEFAULT_SQLITE_CHECKPOINT_INTERVAL = 0.5

log = logging.getLogger("gpu_lease.store")


class _Checkpointer:
    """Copies a SQLite file's write-ahead log into the database every ``interval`` seconds,
    on a connection and a thread of its own (``PRAGMA wal_checkpoint(PASSIVE)``).

    SQLite otherwise checkpoints inside the commit that crosses 1,000 WAL pages: that
    commit then writes those pages and fsyncs the file (about 4 ms here, every 40 or so
    acquire+release pairs), and the broker's event loop, which runs the commit, answers
    nothing meanwhile. A PASSIVE checkpoint never blocks writers or readers; the thread
    releases the GIL while SQLite works. Durability is unchanged (WAL with the broker's
    ``synchronous``): a checkpoint only moves committed pages.
    """

    def __init__(self, path: str, interval: float) -> None:
        self.path, self.interval = path, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-lease-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        failing = False
        try:
            while True:
                stopping = self._stop.wait(self.interval)
                try:  # auto-checkpoints are off: keep trying, or the log only grows
                    if conn is None:
                        conn = sqlite3.connect(self.path, timeout=1.0, check_same_thread=False)
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    failing = False
                except sqlite3.Error as exc:
                    if not failing:  # once per run of failures
                        log.warning("WAL checkpoint of %s failed (retrying): %s", self.path, exc)
                    failing = True
                    if conn is not None:
                        conn.close()
                        conn = None
                if stopping:  # that was the last one, at close
                    return
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


def _renew_params(
    lease_id: str,
    renewed_at: float,
    expires_at: float,
    pid: int | None,
    execution_state: str | None,
    last_activity: float | None,
) -> dict[str, Any]:
    """A heartbeat's bind parameters for ``_RENEW``."""
    return {
        "b_id": lease_id,
        "b_renewed_at": renewed_at,
        "b_expires_at": expires_at,
        "b_pid": pid,
        "b_execution_state": execution_state,
        "b_last_activity": last_activity,
    }


def _request_row(req: Request) -> dict[str, Any]:
    return {
        "id": req.id,
        "user": req.user,
        "kernel_id": req.kernel_id,
        "fraction_ppm": req.fraction_ppm,
        "groups": json.dumps(sorted(req.groups)),
        "grp": req.group,
        "node": req.node,
        "gpu_uuids": None if req.gpu_uuids is None else json.dumps(list(req.gpu_uuids)),
        "priority": req.priority,
        "arrived_at": req.arrived_at,
        "last_polled_at": req.last_polled_at,
    }


def _queue_log_row(req: Request) -> dict[str, Any]:
    """The queue log's row of a request that joined the queue (it has not left yet)."""
    row = _request_row(req)
    logged = {k: row[k] for k in ("id", "user", "kernel_id", "fraction_ppm", "grp", "arrived_at")}
    return {**logged, "user_groups": row["groups"]}


def _lease_row(lease: Lease) -> dict[str, Any]:
    return {
        "id": lease.id,
        "user": lease.user,
        "kernel_id": lease.kernel_id,
        "gpu_uuid": lease.gpu_uuid,
        "fraction_ppm": lease.fraction_ppm,
        "memory_limit_mb": lease.memory_limit_mb,
        "state": lease.state,
        "grp": lease.group,
        "created_at": lease.created_at,
        "renewed_at": lease.renewed_at,
        "expires_at": lease.expires_at,
        "ended_at": lease.ended_at,
        "reason": lease.reason,
        "pid": lease.pid,
        "execution_state": lease.execution_state,
        "last_activity": lease.last_activity,
        "user_groups": json.dumps(list(lease.groups)),
    }


def _lease_from_row(row: Sequence[Any]) -> Lease:
    *fields, user_groups = row
    lease = Lease(*fields)
    if user_groups:  # NULL: granted before schema version 2
        lease.groups = tuple(json.loads(user_groups))
    return lease


def _request_from_row(row: Sequence[Any]) -> Request:
    (rid, user, kernel_id, ppm, arrived, polled, groups, grp, node, uuids, prio) = row
    return Request(
        id=rid,
        user=user,
        kernel_id=kernel_id,
        fraction_ppm=ppm,
        arrived_at=arrived,
        last_polled_at=polled,
        groups=frozenset(json.loads(groups)),
        group=grp,
        node=node,
        gpu_uuids=None if uuids is None else tuple(json.loads(uuids)),
        priority=prio,
    )


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class Fence:
    """Who may write: the leadership's ``holder`` and ``epoch`` (see :meth:`Store.set_fence`)."""

    holder: str
    epoch: int


#: ``on_refused(why, deposed)``: the fence refused a write; ``deposed`` when another
#: broker holds the leadership now (for good), else it merely expired (renewable)
FenceRefused = Callable[[str, bool], None]

#: PostgreSQL's SQLSTATE for a lock wait cut by ``lock_timeout``
_LOCK_NOT_AVAILABLE = "55P03"


class Store:
    """The lease database. Created by the broker at start; every method is one transaction.

    ``url`` is a SQLAlchemy URL (``sqlite:///gpu-lease.sqlite``,
    ``postgresql://user@host/db``). The engine is built here but nothing connects
    until :meth:`open`. Methods are synchronous and thread-safe (a connection pool).

    PostgreSQL connections are bounded by ``pg_timeout`` seconds: the connect timeout,
    ``statement_timeout``, ``idle_in_transaction_session_timeout`` (a paused broker's
    open transaction, and its locks, end after it), TCP keepalives that notice a dead
    server within about that time, and ``tcp_user_timeout`` (a write into a cut network
    fails after it). Settings given in the URL's query win. ``application_name`` names
    the sessions in ``pg_stat_activity``.
    """

    def __init__(
        self,
        url: str,
        *,
        sqlite_synchronous: str = DEFAULT_SQLITE_SYNCHRONOUS,
        sqlite_busy_timeout: float = DEFAULT_SQLITE_BUSY_TIMEOUT,
        pg_timeout: float = DEFAULT_PG_TIMEOUT,
        application_name: str = "gpu-lease",
        echo: bool = False,
        sqlite_checkpoint_interval: float = DEFAULT_SQLITE_CHECKPOINT_INTERVAL,
    ) -> None:
        sync = sqlite_synchronous.upper()
        if sync not in SQLITE_SYNCHRONOUS:
            raise StoreError(
                f"sqlite_synchronous must be one of {', '.join(SQLITE_SYNCHRONOUS)}, "
                f"not {sqlite_synchronous!r}; fix the broker's configuration."
            )
        if not 0 <= sqlite_busy_timeout < 86400:
            raise StoreError(
                f"sqlite_busy_timeout must be 0 or more seconds (below a day), not "
                f"{sqlite_busy_timeout!r}; fix the broker's configuration."
            )
        if not 0.1 <= pg_timeout < 86400:
            raise StoreError(
                f"pg_timeout must be at least 0.1 seconds (below a day), not {pg_timeout!r}; "
                "fix the broker's configuration."
            )
        try:
            self._url = sa.make_url(url)
        except SQLAlchemyError as exc:
            # not echoed: an unparseable URL may still hold a password
            raise StoreError(
                "The database URL cannot be parsed; give it as sqlite:///FILE or "
                "postgresql://USER@HOST/DB."
            ) from exc
        try:
            if self._url.drivername == "postgresql":
                # SQLAlchemy 2.1 defaults to psycopg 3; the project depends on psycopg2
                self._url = self._url.set(drivername="postgresql+psycopg2")
            self._is_sqlite = self._url.get_backend_name() == "sqlite"
            kwargs: dict[str, Any] = {"echo": echo}
            if self._is_sqlite:
                kwargs["connect_args"] = {"check_same_thread": False}
                if self._url.database in (None, "", ":memory:"):
                    kwargs["poolclass"] = StaticPool  # one shared in-memory database
            else:
                kwargs["pool_pre_ping"] = True
                # a group commit's UPDATEs and DELETEs of many rows: a few round trips, not
                # one per row (psycopg2's executemany loops; INSERTs are batched anyway)
                kwargs["executemany_mode"] = "values_plus_batch"
                kwargs["connect_args"] = self._pg_connect_args(pg_timeout, application_name)
            self._engine: Engine = sa.create_engine(self._url, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            raise StoreError(
                f"Cannot use the database URL {self.url_for_logs!r}: {exc}. "
                "Give it as sqlite:///FILE or postgresql://USER@HOST/DB."
            ) from exc
        self._dbapi_error: type[Exception] = getattr(
            self._engine.dialect.loaded_dbapi, "Error", SQLAlchemyError
        )
        self._opened = False
        self._fence: Fence | None = None
        self._on_refused: FenceRefused | None = None
        #: a SQLite file's background WAL checkpoints (while the store is open)
        self._checkpoints: tuple[str, float] | None = None
        self._checkpointer: _Checkpointer | None = None
        file = self._url.database if self._is_sqlite else None
        if file not in (None, "", ":memory:") and sqlite_checkpoint_interval > 0:
            self._checkpoints = (str(file), sqlite_checkpoint_interval)
        if self._is_sqlite:
            self._install_sqlite_hooks(sync, int(sqlite_busy_timeout * 1000))
        else:
            self._install_pg_hooks(pg_timeout)

    def _pg_connect_args(self, timeout: float, application_name: str) -> dict[str, Any]:
        """libpq connection parameters bounding every wait on the server (URL query wins)."""
        wanted: dict[str, Any] = {
            "connect_timeout": max(2, math.ceil(timeout)),  # libpq: whole seconds, >= 2
            "keepalives": 1,
            "keepalives_idle": max(1, int(timeout / 2)),
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": int(timeout * 1000),
            "application_name": application_name,
        }
        return {k: v for k, v in wanted.items() if k not in self._url.query}

    def _install_pg_hooks(self, timeout: float) -> None:
        ms = int(timeout * 1000)

        @event.listens_for(self._engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            autocommit = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"SET statement_timeout = {ms}")
                cur.execute(f"SET idle_in_transaction_session_timeout = {ms}")
            finally:
                cur.close()
                dbapi_conn.autocommit = autocommit

    def _install_sqlite_hooks(self, synchronous: str, busy_timeout_ms: int) -> None:
        # pysqlite's own transaction control neither emits BEGIN for reads nor lets us
        # choose BEGIN IMMEDIATE; take it over as SQLAlchemy's SQLite docs describe.
        @event.listens_for(self._engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute(f"PRAGMA synchronous = {synchronous}")
                if self._checkpointer is not None:  # its thread checkpoints, off the loop
                    cur.execute("PRAGMA wal_autocheckpoint = 0")
            finally:
                cur.close()

        @event.listens_for(self._engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # writes take the database write lock up front, so that the checks they
            # make before writing still hold when they write
            write = conn.get_execution_options().get("gpu_lease_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    # -- plumbing ---------------------------------------------------------------
    @property
    def url_for_logs(self) -> str:
        """The database URL with any password masked."""
        return self._url.render_as_string(hide_password=True)

    @contextmanager
    def _tx(self, what: str, *, write: bool = True, fenced: bool = True) -> Iterator[Connection]:
        """One transaction; foreign errors become :class:`StoreError` naming ``what``.

        A write transaction (unless ``fenced=False``) first passes the fence, if one is
        set: :class:`NotActive` when this broker may not write any more.
        """
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(gpu_lease_write=True)
                with conn.begin():
                    if write and fenced and self._fence is not None:
                        self._check_fence(conn, self._fence)
                    yield conn
        except (SQLAlchemyError, self._dbapi_error) as exc:
            raise StoreError(
                f"The lease database at {self.url_for_logs} failed while trying to {what} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "nothing was changed. Check that the database is reachable and writable, then retry."
            ) from exc

    def open(self) -> None:
        """Connect and bring the schema up to date. Called once at broker start; idempotent."""
        if self._opened:
            return
        self.upgrade()
        if self._checkpoints is not None:
            # connections made from now on leave checkpoints to it (upgrade's kept SQLite's)
            self._engine.dispose()
            self._checkpointer = _Checkpointer(*self._checkpoints)
            self._checkpointer.start()
        self._opened = True

    def close(self) -> None:
        """Close every pooled connection. Called at broker shutdown."""
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
        try:
            self._engine.dispose()
        except (SQLAlchemyError, self._dbapi_error) as exc:
            raise StoreError(f"Closing the lease database failed: {exc}") from exc
        self._opened = False

    # -- fenced leadership (PostgreSQL) -----------------------------------------------
    @property
    def supports_ha_lock(self) -> bool:
        """Whether leadership (``--ha-lock``) works here: PostgreSQL only."""
        return self._url.get_backend_name() == "postgresql"

    def _require_pg(self) -> None:
        if not self.supports_ha_lock:
            raise StoreError(
                "Broker leadership needs a PostgreSQL database (postgresql://USER@HOST/DB); "
                "with SQLite run one broker only."
            )

    def take_leadership(
        self, holder: str, ttl: float, *, lock_wait: float = 0.5
    ) -> tuple[int | None, str | None, float]:
        """Try once to become the active broker for ``ttl`` seconds (database clock).

        Called by a standby (``broker/leadership.py``) until it succeeds. The row is taken
        only when it is free or its leadership has expired; the epoch goes up by one.
        Returns ``(epoch or None, the holder now, seconds until its leadership expires)``.
        A takeover waits at most ``lock_wait`` s for write transactions in flight (their
        fence holds the row ``FOR SHARE``); then it is "not yet", not an error.
        """
        self._require_pg()
        try:
            with self._tx("take the broker leadership", fenced=False) as conn:
                conn.execute(sa.text(f"SET LOCAL lock_timeout = {max(1, int(lock_wait * 1000))}"))
                epoch = conn.execute(_TAKE_LEADERSHIP, {"holder": holder, "ttl": ttl}).scalar()
                now_holder, _, remaining = conn.execute(_LEADER).one()
        except StoreError as exc:
            if getattr(getattr(exc.__cause__, "orig", None), "pgcode", "") == _LOCK_NOT_AVAILABLE:
                return None, None, lock_wait  # a write in flight: try again soon
            raise
        return (None if epoch is None else int(epoch)), now_holder, max(0.0, float(remaining))

    def renew_leadership(self, holder: str, epoch: int, ttl: float) -> bool:
        """Extend this broker's leadership to ``ttl`` s from now (database clock).

        Called by the active broker every ``ttl / 3`` seconds. False when the row no
        longer names ``holder`` with ``epoch``: another broker took over (for good).
        Renewing after an expiry nobody used is allowed: no other broker has written.
        """
        self._require_pg()
        params = {"holder": holder, "epoch": epoch, "ttl": ttl}
        with self._tx("renew the broker leadership", fenced=False) as conn:
            return bool(conn.execute(_RENEW_LEADERSHIP, params).rowcount)

    def release_leadership(self, holder: str, epoch: int) -> None:
        """Give the leadership up now (clean shutdown): a standby takes it at once."""
        self._require_pg()
        params = {"holder": holder, "epoch": epoch}
        with self._tx("give up the broker leadership", fenced=False) as conn:
            conn.execute(_RELEASE_LEADERSHIP, params)

    def leadership(self) -> tuple[str | None, int, float]:
        """``(holder, epoch, seconds until it expires)`` as the database has it now."""
        self._require_pg()
        with self._tx("read the broker leadership", write=False) as conn:
            holder, epoch, remaining = conn.execute(_LEADER).one()
        return holder, int(epoch), float(remaining)

    def set_fence(self, fence: Fence | None, on_refused: FenceRefused | None = None) -> None:
        """From now on every write transaction checks ``fence`` first (``None``: stop).

        Called by the broker right after it took the leadership, before it loads or
        writes anything. ``on_refused(why, deposed)`` is told about every refusal.
        """
        if fence is not None:
            self._require_pg()
        self._fence, self._on_refused = fence, on_refused

    def _check_fence(self, conn: Connection, fence: Fence) -> None:
        row = conn.execute(_FENCE).first()
        if row is None or row[0] != fence.holder or int(row[1]) != fence.epoch:
            who = "nobody" if row is None or row[0] is None else "another broker"
            why = f"{who} holds the leadership now (this broker had epoch {fence.epoch})"
            deposed = True
        elif not row[2]:
            why = "its leadership expired before it could renew it"
            deposed = False
        else:
            return
        if self._on_refused is not None:
            self._on_refused(why, deposed)
        raise NotActive(
            f"This broker is not the active one now: {why}. Nothing was changed; "
            "retry, and the active broker will answer."
        )

    def upgrade(self, migrations: Sequence[Migration] | None = None) -> int:
        """Apply missing schema migrations in one transaction; returns the version now."""
        with self._tx("open it and bring its schema up to date") as conn:
            return upgrade_schema(conn, MIGRATIONS if migrations is None else migrations)

    # -- inventory ----------------------------------------------------------------
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

    # -- state at start -------------------------------------------------------------
    def load_active(self) -> tuple[list[Lease], list[Request]]:
        """Active leases and queued requests (in arrival order), read at broker start."""
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

    # -- leases ---------------------------------------------------------------------
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
        the same locks as :meth:`insert_leases`. All or nothing: on a refusal
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
        for ch in batch:
            for g in ch.granted:
                new[g.lease.id] = g.lease
                if g.request is not None:
                    served[g.request.id] = g.lease.created_at
            for lease, state, reason in ch.ended:
                if state == "active" or state not in LEASE_STATES:
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
        still = [x for x in new.values() if x.id not in ended]
        rows = [_lease_row(x) for x in still] + [
            {
                **_lease_row(x),
                **dict(zip(("state", "ended_at", "reason"), ended[x.id], strict=True)),
            }
            for x in new.values()
            if x.id in ended
        ]
        gone: dict[str, tuple[str, str | None]] = {}
        if not (new or ended or queued or left or renewed):
            return gone
        with self._tx(f"record {len(batch)} change(s)") as conn:
            old_ends = [
                {"b_id": lid, "b_state": st, "b_ended_at": at, "b_reason": why}
                for lid, (st, at, why) in ended.items()
                if lid not in new
            ]
            if old_ends:
                conn.execute(_END, old_ends)
            if still:
                # one-lease-per-kernel: the partial unique index (IntegrityError below)
                self._check_grants(conn, still, capacity_ppm, kernels=False)
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
            out = [{"b_id": rid} for rid in left if rid not in queued]
            if out:
                conn.execute(_DELETE_REQUEST, out)
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
        conn: Connection, new: list[Lease], capacity_ppm: int, *, kernels: bool = True
    ) -> None:
        """Capacity on each GPU of ``new`` (its rows locked) and, with ``kernels``, that no
        kernel of ``new`` holds another active lease (a query per lease, naming it)."""
        adding: dict[str, int] = {}
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
            if state == "active" or state not in LEASE_STATES:
                raise ValueError(f"a lease ends as released, expired or revoked, not {state!r}")
            params.append(
                {"b_id": lease_id, "b_state": state, "b_ended_at": ended_at, "b_reason": reason}
            )
        with self._tx("end leases") as conn:
            conn.execute(_END, params)

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

    # -- queue ----------------------------------------------------------------------
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
        stmt = sa.select(*_REQUEST_COLS).where(requests.c.id == request_id)
        with self._tx("read a queued request", write=False) as conn:
            row = conn.execute(stmt).first()
        return None if row is None else _request_from_row(row)

    # -- quotas ---------------------------------------------------------------------
    def load_quotas(self) -> QuotaBook:
        """Every quota: the default, per group and per user."""
        book = QuotaBook()
        stmt = sa.select(quotas.c.level, quotas.c.name, *_QUOTA_COLS)
        with self._tx("load the quotas", write=False) as conn:
            rows = conn.execute(stmt).all()
        for level, name, *values in rows:
            quota = Quota(*values)
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

    # -- accounting -----------------------------------------------------------------
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

        Read for :func:`provisioner.history.compute` (``GET /api/v1/history``); an active
        lease or a request still waiting counts as lasting up to ``until``. ``user``:
        only that user's.
        """
        stmt = _SELECT_LEASES.where(
            leases.c.created_at < until,
            sa.or_(leases.c.state == "active", leases.c.ended_at >= since),
        )
        qstmt = sa.select(*_QUEUE_LOG_COLS).where(
            queue_log.c.arrived_at < until,
            sa.or_(queue_log.c.left_at.is_(None), queue_log.c.left_at >= since),
        )
        if user is not None:
            stmt = stmt.where(leases.c.user == user)
            qstmt = qstmt.where(queue_log.c.user == user)
        with self._tx("read the history", write=False) as conn:
            held = [_lease_from_row(row) for row in conn.execute(stmt)]
            queued = [
                QueueRecord(rid, u, k, ppm, arrived, grp, tuple(json.loads(ug)), left, outcome)
                for (rid, u, k, ppm, arrived, grp, ug, left, outcome) in conn.execute(qstmt)
            ]
        return held, queued

    def counts(self) -> dict[str, int]:
        """Number of leases in each state (every state present, zero included)."""
        out: dict[str, int] = dict.fromkeys(LEASE_STATES, 0)
        with self._tx("count leases", write=False) as conn:
            for state, n in conn.execute(_COUNTS):
                out[state] = int(n)
        return out

    # -- nodes (registered by node agents) ------------------------------------------
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
        stmt = sa.select(
            nodes.c.name,
            nodes.c.gpus,
            nodes.c.agent_version,
            nodes.c.registered_at,
            nodes.c.drained,
            nodes.c.enforce,
        ).order_by(nodes.c.name)
        with self._tx("load the nodes", write=False) as conn:
            rows = list(conn.execute(stmt))
        return [
            Node(
                name=name,
                gpus=[
                    GPU(g["uuid"], name, g["name"], int(g["memory_mb"]), int(g["index"]))
                    for g in json.loads(gpus_json)
                ],
                agent_version=version,
                registered_at=float(registered),
                last_seen=seen_at,
                drained=bool(drained),
                enforce=enforce or "report",
            )
            for name, gpus_json, version, registered, drained, enforce in rows
        ]
