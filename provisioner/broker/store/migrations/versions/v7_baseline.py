"""Baseline: schema version 7, the last one before Alembic.

Revision ID: v7_baseline
Revises: (none)

Runs the frozen steps of ``legacy.py`` that the database lacks: a fresh database gets all
seven, one made by a version before Alembic only those after its ``schema_version`` (none
for version 7: it is adopted with its data as it is).
"""

from __future__ import annotations

from alembic import op

from provisioner.broker.store.legacy import upgrade_legacy

revision = "v7_baseline"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    upgrade_legacy(op.get_bind())


def downgrade() -> None:
    raise NotImplementedError("The schema cannot go below version 7; restore a backup.")
