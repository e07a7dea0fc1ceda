"""Persistence: the only subpackage that speaks SQL (SQLAlchemy Core).

``store.Store`` is the facade the services use; ``engine`` holds connections and settings,
``schema`` the tables and row mapping, ``writes`` the checked lease writes, ``fencing`` the
leadership row's SQL, ``leadership`` the active/standby loop on PostgreSQL, and
``commit_thread`` the one database thread that group-commits for the event loop. It imports
nothing of the broker outside itself (``tests/test_layout.py`` checks it).
"""
