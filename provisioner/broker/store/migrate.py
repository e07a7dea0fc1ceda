"""The schema's upgrade at broker start: Alembic, run from code (no ``alembic.ini``).

The revisions ship in ``migrations/versions/``; ``migrations/env.py`` runs them on the
connection given here. :func:`upgrade_schema` runs in the caller's transaction (one
transaction for the whole upgrade: a failed revision changes nothing), after taking the
migration lock: SQLite's write lock (the store's ``BEGIN IMMEDIATE``) or, on PostgreSQL,
a transaction-scoped advisory lock, so that two brokers starting at once never both
migrate: the second waits, then finds the database at head.

Which databases reach head, and how:

* a fresh one (none of our tables): built at head from ``schema.py``'s tables, with the
  rows the old steps left (``legacy.seed_version_7``), and stamped :data:`HEAD`, as
  Alembic's cookbook does it ("building an up to date database from scratch"). Tests
  check that this and the revisions build the same database;
* one made before Alembic (its ``schema_version`` table says 1 to 7, no Alembic version
  table): the baseline revision applies the old steps it lacks (none for version 7: it
  is adopted as it is, with its data), then Alembic stamps the baseline;
* one at an older revision: the later revisions run in order.

Neither a fresh database nor one at :data:`HEAD` imports Alembic (a quarter of a second
or more of the broker's start). A database at a revision this code does not know was
upgraded by a newer jupyter-gpu-lease: it is refused, untouched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import StoreError
from . import schema
from .legacy import seed_version_7

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger("gpu_lease.store")

#: the directory of ``env.py`` and ``versions/``
MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
#: Alembic's table of the current revision; named for this project, so that it cannot be
#: mistaken for JupyterHub's ``alembic_version`` when both share a database schema
VERSION_TABLE = "gpu_lease_alembic_version"
#: the newest revision in ``migrations/versions/`` (a test checks that it is the one head)
HEAD = "v7_baseline"

_PG_UPGRADE_LOCK = 0x67_6C_5F_73_74_6F_72  # pg_advisory_xact_lock key ("gl_stor")


def alembic_config(
    connection: Connection | None = None, version_locations: Sequence[str | Path] = ()
) -> Config:
    """Alembic's configuration for the shipped revisions (and ``version_locations``
    besides them: tests add revisions of their own), running on ``connection``."""
    from alembic.config import Config

    cfg = Config()
    # set_main_option interpolates: a ``%`` in a path is written ``%%``
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    locations = [str(MIGRATIONS_DIR / "versions"), *(str(p) for p in version_locations)]
    cfg.set_main_option("version_locations", os.pathsep.join(locations).replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def _version_table() -> sa.Table:
    """Alembic's version table, as Alembic creates it (``DefaultImpl.version_table_impl``)."""
    return sa.Table(
        VERSION_TABLE,
        sa.MetaData(),
        sa.Column("version_num", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("version_num", name=f"{VERSION_TABLE}_pkc"),
    )


def stored_revision(conn: Connection) -> str | None:
    """The database's Alembic revision; ``None`` before Alembic (fresh, or versions 1-7)."""
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    found = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(found) > 1:
        raise StoreError(
            f"The lease database's {VERSION_TABLE} table names {len(found)} revisions "
            f"({', '.join(sorted(found))}); jupyter-gpu-lease's revisions have one head. "
            "Restore the database from a backup, or leave one row naming its revision."
        )
    return found[0] if found else None


def upgrade_schema(conn: Connection, version_locations: Sequence[str | Path] = ()) -> str:
    """Take the migration lock and bring the database to head, inside the caller's
    transaction. Returns the revision the database is at afterwards.

    Called from ``Database.upgrade`` at every broker start; safe to repeat, and safe when
    two processes start at once.
    """
    if conn.dialect.name == "postgresql":
        # a migration may take longer than the broker's statement timeout, and may wait
        # for another process's migration
        conn.execute(sa.text("SET LOCAL statement_timeout = 0"))
        conn.execute(sa.text("SET LOCAL lock_timeout = 0"))
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_UPGRADE_LOCK)))
    current = stored_revision(conn)
    if current == HEAD and not version_locations:
        return HEAD
    if current is None and not version_locations and _is_fresh(conn):
        _create_at_head(conn)
        return HEAD
    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError

    cfg = alembic_config(conn, version_locations)
    script = ScriptDirectory.from_config(cfg)
    heads = script.get_heads()
    if len(heads) != 1:
        raise StoreError(
            f"jupyter-gpu-lease's schema revisions have {len(heads)} heads "
            f"({', '.join(sorted(heads))}), not one; reinstall jupyter-gpu-lease."
        )
    if current is not None:
        try:
            script.get_revision(current)
        except (CommandError, RevisionError) as exc:
            raise StoreError(
                f"The lease database is at schema revision {current!r}, which this version "
                "of jupyter-gpu-lease does not know: a newer version upgraded it. Upgrade "
                "jupyter-gpu-lease on this host."
            ) from exc
    if current != heads[0]:
        log.info("Upgrading the lease database's schema from %s to %s", current, heads[0])
        command.upgrade(cfg, heads[0])
    return heads[0]


def _is_fresh(conn: Connection) -> bool:
    """None of the lease database's tables is there (other applications' may be)."""
    ours = {table.name for table in schema.metadata.sorted_tables} | {VERSION_TABLE}
    return ours.isdisjoint(sa.inspect(conn).get_table_names())


def _create_at_head(conn: Connection) -> None:
    """Build a fresh database at head: the tables, the old steps' rows, the stamp."""
    log.info("Creating the lease database's tables (schema revision %s)", HEAD)
    if conn.dialect.name == "postgresql":  # that dialect is loaded: the partial indexes
        schema.complete_metadata()
    schema.metadata.create_all(conn)
    seed_version_7(conn)
    version = _version_table()
    version.create(conn)
    conn.execute(version.insert().values(version_num=HEAD))


__all__ = ["HEAD", "MIGRATIONS_DIR", "VERSION_TABLE", "alembic_config", "upgrade_schema"]
