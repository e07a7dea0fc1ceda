"""Alembic's environment: runs the revisions on the broker's connection.

At broker start ``migrate.upgrade_schema`` passes its connection, already in the upgrade
transaction and holding the migration lock, as ``config.attributes["connection"]``.
From the ``alembic`` command line (``-c provisioner/broker/store/migrations/alembic.ini``,
to write a revision or compare a database with ``schema.py``) the database is
``$GPU_LEASE_DB_URL``.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import context

from provisioner.broker.store.migrate import VERSION_TABLE
from provisioner.broker.store.schema import metadata


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        # SQLite alters most columns only by copying the table: autogenerate says so
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = os.environ.get("GPU_LEASE_DB_URL")
    if not url:
        raise SystemExit("Set GPU_LEASE_DB_URL to the lease database's URL (sqlite:///FILE).")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


_main()
