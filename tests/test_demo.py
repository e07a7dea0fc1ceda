"""``make demo``'s Ctrl-C: the real demo, ten servers, SIGINT, and nothing left behind.

The demo (``python -m provisioner.devtools.demo`` through ``devtools.demohub.DemoHub``) runs
with a ``TMPDIR`` and ``HOME`` of its own, empty at start. After Ctrl-C with ten servers
running (one of them with a GPU kernel): the demo exits within :data:`BOUND` seconds,
every process it started is gone, the hub's port is free, its TMPDIR and HOME are still
empty, and the runtime files (the servers' cookie secrets, the kernels' connection
files) are gone from the state directory. ``benchmarks/demo_stop.py`` measures the same
with 60 servers.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from provisioner.devtools.demo import MAX_RUNTIME_DIR, runtime_dir
from provisioner.devtools.demohub import DemoHub
from provisioner.devtools.testing import write_private

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(480)]

N = 10
#: seconds from SIGINT until every process is gone (60 servers: see benchmarks/README.md)
BOUND = 20.0


@pytest.fixture
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoHub]:
    # a short path, as a checkout's .demo/ is: the runtime files then stay in it
    hub = DemoHub(tmp_path_factory.mktemp("d"))
    try:
        hub.start()
        yield hub
    finally:
        hub.kill()


def test_ctrl_c_with_ten_servers_stops_everything_and_leaves_nothing(demo: DemoHub) -> None:
    users = [f"student{i:02d}" for i in range(1, N + 1)]
    demo.spawn(users)
    # one server runs a GPU kernel: its lease is released before the broker stops
    token = demo.info["admin_token"]
    r = httpx.post(
        f"{demo.url}/user/student01/api/kernels",
        json={"name": "python3-gpu-0.02"},
        headers={"Authorization": f"token {token}"},
        timeout=120,
    )
    assert r.status_code == 201, r.text
    runtime = Path(demo.info["runtime_dir"])
    # in the state directory where that is short enough for kernels' sockets (serial runs
    # here), else outside it (pytest-xdist's longer folders), and short in either case
    inside = len(str(demo.state / "rt")) <= MAX_RUNTIME_DIR
    assert runtime.is_relative_to(demo.state) is inside, runtime
    assert len(str(runtime)) <= MAX_RUNTIME_DIR
    assert any(runtime.rglob("jupyter_cookie_secret")) and any(runtime.rglob("kernel-*.json"))
    names = " ".join(" ".join(p.cmdline()) for p in demo.processes())
    assert names.count("jupyterhub.singleuser") == N and "ipykernel" in names

    stopped = demo.interrupt()
    print(
        f"Ctrl-C with {N} servers: demo exited in {stopped.exit_s:.1f} s, "
        f"all {stopped.processes} processes gone in {stopped.all_gone_s:.1f} s"
    )
    assert stopped.exit_code == 0, stopped.log_tail
    assert stopped.survivors == [], stopped.log_tail
    assert stopped.all_gone_s <= BOUND, stopped.log_tail
    assert stopped.port_free
    assert stopped.left_outside == []  # nothing in the system's temporary folder or HOME
    assert not runtime.exists()
    assert list((demo.state / "tmp").iterdir()) == []
    db = sqlite3.connect(demo.state / "gpu-lease.sqlite")
    try:
        active = db.execute("SELECT count(*) FROM leases WHERE state = 'active'").fetchone()
    finally:
        db.close()
    assert active == (0,)  # released by its kernel's shutdown while the broker still ran


@pytest.mark.parametrize(
    ("state", "inside"),
    [
        ("/work/wt/x/.demo", True),
        ("/tmp/pytest-of-someone/pytest-123/test_a_long_name0/.demo", False),
    ],
)
@pytest.mark.parametrize(
    "tmpdir", ["/tmp", "/tmp/pytest-of-root/pytest-68/popen-gw1/test_a_long_name0/systmp"]
)
def test_runtime_dir_stays_in_the_state_dir_when_short_enough(
    state: str, inside: bool, tmpdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", tmpdir)  # what TMPDIR sets
    where = runtime_dir(Path(state), 8000)
    assert where.is_relative_to(state) is inside
    assert len(str(where)) <= MAX_RUNTIME_DIR
    # a kernel's socket: <runtime>/<user id>/kernel-<uuid>-ipc-N within Linux's 107 bytes
    socket = f"{where}/1234/kernel-{'0' * 8}-{'0' * 4}-{'0' * 4}-{'0' * 4}-{'0' * 12}-ipc-5"
    assert len(socket) <= 107


@pytest.mark.slow
@pytest.mark.parametrize("ends", ["returns", "sys.exit(3)"])
def test_fastexit_runs_atexit_and_does_not_wait_for_a_thread_that_never_ends(
    tmp_path: Path, ends: str
) -> None:
    """``provisioner.devtools.fastexit`` (the demo's servers run under it): once the module
    is done, its ``atexit`` handlers run and the process ends with the module's status,
    even though a non-daemon thread still waits for ever (as an idle AnyIO worker thread
    of a stopped single-user server did, which JupyterHub then killed 60 s later)."""
    done = tmp_path / "atexit-ran"
    (tmp_path / "lingering.py").write_text(
        "import atexit, sys, threading\n"
        f"atexit.register(lambda: open({str(done)!r}, 'w').write('yes'))\n"
        "threading.Thread(target=threading.Event().wait, name='never ends').start()\n"
        + ("sys.exit(3)\n" if ends.startswith("sys.exit") else "")
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "provisioner.devtools.fastexit", "lingering"],
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{Path.cwd()}"},
        timeout=60,
    )
    assert proc.returncode == (3 if ends.startswith("sys.exit") else 0)
    assert done.read_text() == "yes"  # the module's atexit handler ran
    assert time.monotonic() - started < 30  # did not wait for the thread (it never ends)


def test_a_reader_waiting_for_demo_json_never_reads_it_half_written(tmp_path: Path) -> None:
    """Scripts and tests wait for ``demo.json`` to exist, then read it: the demo writes it
    whole (beside it, then renamed), so a file that exists parses; it was once read empty,
    between its creation and its text (a hub fixture's JSONDecodeError in a CI run)."""
    path = tmp_path / "demo.json"
    text = json.dumps({"url": "http://127.0.0.1:8000", "pad": "x" * 20000})
    done = threading.Event()

    def write() -> None:
        for n in range(600):
            write_private(path, text)
            if n % 2 == 0:
                path.unlink()  # and created anew (the last write stays)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    try:
        while True:
            finished = done.is_set()
            try:
                seen = path.read_text()
            except FileNotFoundError:
                continue
            reads += 1
            assert json.loads(seen)["url"] == "http://127.0.0.1:8000", seen[:100]
            if finished:
                break
    finally:
        writer.join()
    assert reads > 0
    write_private(path, text)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["demo.json"]  # no temporary file left
