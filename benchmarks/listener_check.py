"""What the client's listener check (``provisioner/listeners.py``) costs per new connection.

With N other loopback connections open (2 N more lines in ``/proc/net/tcp``), time
:func:`check_connection` on a connection to this process's own listener: the sock_diag
lookup the client makes, and the ``/proc/net/tcp`` search it falls back to::

    .venv/bin/python benchmarks/listener_check.py            # N = 0, 500, 2500
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provisioner import listeners  # noqa: E402


def per_call_us(fn: Callable[[], object], k: int) -> float:
    t = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t) / k * 1e6


def _connect_and_close(srv: socket.socket, port: int) -> None:
    """The baseline: what a new loopback connection costs anyway (both ends)."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        srv.accept()[0].close()
        c.close()


def main() -> None:
    for n in (0, 500, 2500):
        with socket.create_server(("127.0.0.1", 0), backlog=4096) as srv:
            port = srv.getsockname()[1]
            keep: list[socket.socket] = []
            for _ in range(n):
                keep.append(socket.create_connection(("127.0.0.1", port)))
                keep.append(srv.accept()[0])
            conn = socket.create_connection(("127.0.0.1", port))
            keep += [conn, srv.accept()[0]]
            theirs, ours = conn.getpeername(), conn.getsockname()
            lines = sum(len(t.read_text().splitlines()) - 1 for t in listeners.TABLES)
            check = per_call_us(
                partial(listeners.check_connection, conn, listeners.Owners(), "x"), 200
            )
            table = per_call_us(partial(listeners._table_owner, theirs, ours), 20)
            connect = per_call_us(partial(_connect_and_close, srv, port), 200)
            print(
                f"{lines:6d} TCP sockets: loopback connect+accept+close (baseline) "
                f"{connect:5.0f} us; check {check:5.0f} us per new connection "
                f"({check / connect:.2f}x the baseline); /proc/net/tcp fallback "
                f"{table:7.0f} us ({table / connect:.0f}x)",
                flush=True,
            )
            for s in keep:
                s.close()


if __name__ == "__main__":
    main()
