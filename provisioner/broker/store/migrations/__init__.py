"""Alembic's environment (``env.py``) and the schema's revisions (``versions/``)."""
