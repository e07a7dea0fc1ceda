"""The schema steps from before Alembic: versions 1 to 7, frozen (never edit).

Databases made by jupyter-gpu-lease before Alembic carry their version in the
``schema_version`` table (one row per step, 7 at the end). The Alembic baseline revision
(``migrations/versions/v7_baseline.py``) runs :func:`upgrade_legacy`: it applies the steps
a database lacks, so that a fresh database, a version 1-6 database and a version 7 one all
reach version 7 the way the old code built it (tables, column order, indexes, the
``schema_version`` rows), and Alembic then stamps the baseline on it. Every table here
is defined again as that step created it, independent of ``schema.py``'s current tables,
which later revisions change.

The ``schema_version`` rows (1 to 7) stay: a broker of a version before Alembic reads
them, and finds a database it knows rather than one it would try to build again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection

from ...errors import StoreError


def _define_schema_version(md: sa.MetaData) -> sa.Table:
    return sa.Table(
        "schema_version",
        md,
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
    """The tables and indexes exactly as schema version 1 created them."""
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


_OUTCOME_IN = "outcome IS NULL OR outcome IN ('granted', 'cancelled', 'dropped')"


def _define_v3_queue_log(md: sa.MetaData) -> sa.Table:
    """The queue's history as schema version 3 created it, with its index."""
    queue_log = sa.Table(
        "queue_log",
        md,
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
    sa.Index("ix_queue_log_arrived", queue_log.c.arrived_at)
    return queue_log


def _define_v4_nodes(md: sa.MetaData) -> sa.Table:
    """The nodes node agents registered, as schema version 4 created them."""
    return sa.Table(
        "nodes",
        md,
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("gpus", sa.Text, nullable=False),
        sa.Column("agent_version", sa.String(64), nullable=False),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("drained", sa.Boolean, nullable=False),
    )


def _define_v6_leadership(md: sa.MetaData) -> sa.Table:
    """The leadership table as schema version 6 created it."""
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
    md = sa.MetaData()
    queue_log = _define_v3_queue_log(md)
    queue_log.create(conn)  # with its index
    conn.execute(sa.text("CREATE INDEX ix_leases_ended ON leases (ended_at)"))
    # the requests waiting now arrived before the log existed: log them too
    conn.execute(
        sa.text(
            'INSERT INTO queue_log (id, "user", kernel_id, fraction_ppm, grp, arrived_at, '
            'user_groups) SELECT id, "user", kernel_id, fraction_ppm, grp, arrived_at, groups '
            "FROM requests"
        )
    )


def _v4_nodes(conn: Connection) -> None:
    md = sa.MetaData()
    md.create_all(conn, tables=[_define_v4_nodes(md)], checkfirst=True)


def _v5_node_enforce(conn: Connection) -> None:
    conn.execute(sa.text("ALTER TABLE nodes ADD COLUMN enforce VARCHAR(8)"))


def _v6_leadership(conn: Connection) -> None:
    table = _define_v6_leadership(sa.MetaData())
    table.create(conn, checkfirst=True)
    conn.execute(table.insert().values(id=1, holder=None, epoch=0, expires_at=0.0))


def _v7_parking(conn: Connection) -> None:
    # ADD COLUMN only: no constraint is rebuilt (SQLite could not without copying tables)
    conn.execute(sa.text("ALTER TABLE leases ADD COLUMN park_state VARCHAR(16)"))
    conn.execute(sa.text("ALTER TABLE leases ADD COLUMN parked_at DOUBLE PRECISION"))
    conn.execute(sa.text("ALTER TABLE requests ADD COLUMN resume_of VARCHAR(64)"))


#: The steps before Alembic, in order (frozen: schema changes are Alembic revisions now)
LEGACY_MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", _v1_initial),
    Migration(2, "leases record their user's groups", _v2_lease_groups),
    Migration(3, "the queue's history", _v3_queue_log),
    Migration(4, "nodes registered by node agents", _v4_nodes),
    Migration(5, "nodes record their agent's enforcement mode", _v5_node_enforce),
    Migration(6, "fenced leadership of active/standby brokers", _v6_leadership),
    Migration(7, "parked leases and resume requests", _v7_parking),
)


def seed_version_7(conn: Connection, *, now: float | None = None) -> None:
    """The rows the steps above leave in a database they built, for one built at head
    from the current tables instead (``migrate.upgrade_schema``): the ``schema_version``
    rows 1 to 7 and the free leadership row (step 6)."""
    stamp = time.time() if now is None else now
    conn.execute(
        _define_schema_version(sa.MetaData()).insert(),
        [
            {"version": m.version, "description": m.description, "applied_at": stamp}
            for m in LEGACY_MIGRATIONS
        ],
    )
    leadership = _define_v6_leadership(sa.MetaData())
    conn.execute(leadership.insert().values(id=1, holder=None, epoch=0, expires_at=0.0))


def upgrade_legacy(
    conn: Connection,
    migrations: Sequence[Migration] = LEGACY_MIGRATIONS,
    *,
    now: float | None = None,
) -> int:
    """Apply the steps the database lacks, inside the caller's transaction (which holds
    the migration lock: see ``migrate.upgrade_schema``). Returns the version afterwards.

    ``migrations`` shorter than all of them builds an old database (tests do).
    """
    table = _define_schema_version(sa.MetaData())
    table.create(conn, checkfirst=True)
    current = conn.execute(sa.select(sa.func.max(table.c.version))).scalar() or 0
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
            table.insert().values(
                version=migration.version, description=migration.description, applied_at=stamp
            )
        )
        current = migration.version
    return current


__all__ = ["LEGACY_MIGRATIONS", "Migration", "seed_version_7", "upgrade_legacy"]
