"""``--http-processes N``: HTTP served by front processes, every decision in the broker's.

Real brokers (``python -m provisioner.broker.app``) with real front processes, driven
over HTTP. The whole API is also tested this way: the broker's API test modules run
once more behind a front process (``conftest.py``'s ``FRONTS_MODULES``, ``[sqlite-fronts]``).
Here: the processes' life cycle, crashes of either side, the shutdown of long-polls,
and start-up errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from provisioner.devtools.testing import alive, children_of, wait_for

from .conftest import Broker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.broker_process]


def fronts_of(broker: Broker) -> list[int]:
    assert broker.proc is not None
    return [pid for pid in children_of(broker.proc.pid) if alive(pid)]


def acquire(
    broker: Broker, user: str, kernel: str, fraction: float, **more: object
) -> httpx.Response:
    return httpx.post(
        f"{broker.url}/api/v1/leases",
        json={"kernel_id": kernel, "fraction": fraction, **more},
        headers=broker.headers(user),
        timeout=30,
    )


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_fronts_answer_and_stop_with_the_broker(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    broker = Broker(tmp_path, db, ("--http-processes", "2"))
    with broker.running():
        fronts = fronts_of(broker)
        assert len(fronts) == 2, broker.log()

        # many connections at once (the kernel spreads them over both fronts)
        async def pairs() -> list[int]:
            async def one(i: int) -> int:
                async with broker.client("alice") as c:
                    r = await c.post("/leases", json={"kernel_id": f"k{i}", "fraction": 0.02})
                    assert r.status_code == 201, r.text
                    again = await c.post("/leases", json={"kernel_id": f"k{i}", "fraction": 0.02})
                    assert (again.status_code, again.json()["id"]) == (200, r.json()["id"])
                    gone = await c.delete(f"/leases/{r.json()['id']}")
                    return gone.status_code

            return await asyncio.gather(*(one(i) for i in range(20)))

        assert asyncio.run(pairs()) == [204] * 20
        assert broker.health()["active_leases"] == 0
        code, _ = broker.terminate()
        assert code == 0, broker.log()
        wait_for(lambda: not any(map(alive, fronts)), 10, "the fronts to exit with the broker")
        assert port_is_free(broker.port)
        assert "Shutting down" in broker.log()


def test_kill9_of_the_broker_process_loses_nothing(tmp_path: Path) -> None:
    """The fronts exit when their broker is gone (the port is free for its restart); a
    lease granted before is there after the restart, and acquiring it again repeats it."""
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    broker = Broker(tmp_path, db, ("--http-processes", "1"))
    with broker.running():
        lease = acquire(broker, "alice", "k1", 0.5)
        assert lease.status_code == 201, lease.text
        fronts = fronts_of(broker)
        broker.kill9()  # returns once the fronts are gone
        assert not any(map(alive, fronts))
        assert port_is_free(broker.port)
        broker.start()
        again = acquire(broker, "alice", "k1", 0.5)
        assert (again.status_code, again.json()["id"]) == (200, lease.json()["id"])
        assert broker.health()["active_leases"] == 1
        assert "The broker process is gone; this HTTP process exits" in broker.logs()[0].read_text()


def test_kill9_of_a_front_starts_another(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    broker = Broker(tmp_path, db, ("--http-processes", "1"))
    with broker.running():
        first = acquire(broker, "alice", "k1", 0.25)
        assert first.status_code == 201, first.text
        (front,) = fronts_of(broker)
        os.kill(front, signal.SIGKILL)
        wait_for(
            lambda: [p for p in fronts_of(broker) if p != front],
            15,
            "another HTTP process",
            detail=broker.log,
        )
        # the new front answers (the broker's memory is the same: a repeat, no second lease)
        again = wait_for(lambda: _answer(lambda: acquire(broker, "alice", "k1", 0.25)), 15)
        assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
        assert broker.health()["active_leases"] == 1
        assert "exited with status -9; starting another" in broker.log()


def _answer(call: Callable[[], httpx.Response]) -> httpx.Response | None:
    try:
        return call()
    except httpx.TransportError:
        return None


def test_a_waiting_long_poll_answers_503_when_the_broker_stops(tmp_path: Path) -> None:
    """Shutting down, the broker answers its long-polls first (through the front that
    holds the client's connection), then stops the fronts."""
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    broker = Broker(tmp_path, db, ("--http-processes", "1"))
    with broker.running():
        assert acquire(broker, "alice", "full", 1.0).status_code == 201

        async def wait_then_stop() -> httpx.Response:
            async with broker.client("bob") as c:
                poll = asyncio.create_task(
                    c.post("/leases", json={"kernel_id": "k2", "fraction": 0.5, "wait": 60})
                )
                await asyncio.to_thread(
                    wait_for,
                    lambda: (
                        httpx.get(
                            f"{broker.url}/api/v1/queue", headers=broker.headers("bob"), timeout=5
                        ).json()["length"]
                        == 1
                    ),
                    15,
                    "bob's request to wait in the queue",
                )
                code, _ = await asyncio.to_thread(broker.terminate)
                assert code == 0
                return await poll

        answer = asyncio.run(wait_then_stop())
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"] == "not_active"


def test_a_front_that_cannot_start_stops_the_broker(tmp_path: Path) -> None:
    """A front that exits right after each start (here: the tokens file was removed
    after the broker read it) stops the broker with a reason, not a loop of restarts."""
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    broker = Broker(tmp_path, db, ("--http-processes", "1"))
    with broker.running():
        broker.tokens_file.unlink()
        (front,) = fronts_of(broker)
        os.kill(front, signal.SIGKILL)
        assert broker.proc is not None
        code = broker.proc.wait(60)
        assert code == 1, broker.log()
        assert "Cannot serve: HTTP process 1 exited 3 times in a row" in broker.log()
        assert "tokens file" in broker.log()


@pytest.mark.parametrize("value", ["-1", "65", "two"])
def test_bad_http_processes_is_a_start_up_error(tmp_path: Path, value: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "provisioner.broker.app", "--http-processes", value, "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "http_processes" in proc.stderr or "http-processes" in proc.stderr, proc.stderr


@pytest.mark.parametrize("second", ["0", "2"])
def test_a_second_broker_on_the_port_is_refused(tmp_path: Path, second: str) -> None:
    """SO_REUSEPORT lets the fronts share a port; it must not let another broker in."""
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    first = Broker(tmp_path, db, ("--http-processes", "2"))
    with first.running():
        (tmp_path / "other").mkdir()
        other = Broker(
            tmp_path / "other",
            f"sqlite:///{tmp_path / 'c.sqlite'}",
            ("--http-processes", second),
        )
        other.port = first.port
        other.launch()
        assert other.proc is not None
        assert other.proc.wait(60) == 2, other.log()
        assert "Cannot listen on 127.0.0.1" in other.log()
        assert first.health()["status"] == "ok"


def test_the_paired_benchmark_compares_two_trees_under_the_same_load(tmp_path: Path) -> None:
    """``benchmarks/broker_paired.py`` (how a change's CPU per pair is judged on a noisy
    machine) runs: two brokers with a front each, both driven in the same window."""
    root = Path(__file__).resolve().parent.parent
    script = root / "benchmarks" / "broker_paired.py"
    cmd = [sys.executable, str(script), "--tree", str(root), "--tree", str(root)]
    p = subprocess.run(
        [*cmd, "--windows", "2", "--seconds", "0.5", "--clients", "4"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith(str(root)[-40:])]
    assert len(rows) == 2, p.stdout
    assert rows[0][1:] == [rows[0][1], "1.000", "1.000", "1.000"], p.stdout  # tree 0 ÷ itself
    assert 0.3 < float(rows[1][2]) < 3.0 and float(rows[1][1]) > 0, p.stdout
    assert "window  2:" in p.stdout and "HTTP" in p.stdout
    bad = subprocess.run([*cmd[:3], str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "give --tree at least twice" in bad.stderr


def test_the_throughput_benchmark_drives_a_broker_from_several_load_processes(
    tmp_path: Path,
) -> None:
    """``broker_throughput.py --load-processes 2`` (for machines where one load process
    cannot keep the fronts busy): both processes' pairs and CPU are counted, the
    no-op and a real broker alike, with no errors."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "bt.json"
    p = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "broker_throughput.py"),
            "--only",
            "throughput",
            "--dbs",
            "sqlite",
            "--clients",
            "5",
            "--duration",
            "0.6",
            "--warmup",
            "0.2",
            "--http-processes",
            "0",
            "--load-processes",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["db"]: r for r in json.loads(out.read_text())["throughput"]}
    assert set(rows) == {"no-op", "sqlite"}, rows
    for r in rows.values():
        assert r["load_processes"] == 2 and r["clients"] == 5, r
        assert r["errors"] == 0 and r["pairs"] > 0, r
        assert r["loadgen_cpu_us_per_pair"] > 0 and r["broker_cpu_us_per_pair"] > 0, r
        assert r["acquire_p50_ms"] <= r["acquire_p99_ms"], r


def test_the_startup_benchmark_keeps_the_environments_pythonpath(tmp_path: Path) -> None:
    """``broker_startup.py`` puts the tree first on ``PYTHONPATH`` and keeps what the
    environment had after it (dependencies installed with ``pip --target``): a
    ``sitecustomize`` found only there runs in every timed process."""
    root = Path(__file__).resolve().parent.parent
    deps = tmp_path / "deps"
    deps.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    (deps / "sitecustomize.py").write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(marks)!r}, str(os.getpid())).write_bytes(\n"
        "    pathlib.Path('/proc/self/cmdline').read_bytes().replace(b'\\0', b' ')\n"
        ")\n"
    )
    env = {**os.environ, "PYTHONPATH": str(deps)}
    p = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "broker_startup.py"), "--starts", "1"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "x the no-op app" in p.stdout, p.stdout
    started = [m.read_text() for m in marks.iterdir()]
    assert any("-m provisioner.broker.app" in c for c in started), started
    assert any("-m noop_broker" in c for c in started), started
