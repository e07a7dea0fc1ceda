"""Broker processes forked from one that has already imported the broker (tests only).

A broker subprocess spends most of its start importing (tornado, SQLAlchemy, Alembic, our
modules): about 1.2 s of CPU on this project's 2-core machines, paid again by each of the
hundreds of brokers a ``make test`` starts. :class:`Zygote` starts one process,
``python -m provisioner.devtools.zygote SOCKET``, that imports
:mod:`provisioner.broker.app` once and then, for each start asked over its Unix socket,
forks: the child sets its argv, environment, working directory and output (the log file)
and runs ``provisioner.broker.app`` as ``__main__``, exactly as ``python -m
provisioner.broker.app`` would. The result is a real, separate broker process (its own pid,
memory, signals, exit status) that skipped the imports. Nothing has started a thread, a
loop, a database engine or a socket but the zygote's own listener before the fork.

A forked broker is the zygote's child, not the test's: :class:`ForkedProcess` is the
``Popen`` it stands for (``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``,
``terminate``, ``kill``); the zygote reaps its children and writes each exit status to a
file the test's side reads. ``tests/conftest.py``'s ``broker`` fixture uses one zygote per
pytest process; a test that kills, signals or times the broker (``broker_process``) still
gets a ``python -m`` subprocess of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: the module every forked child runs as ``__main__``
MODULE = "provisioner.broker.app"


class ForkedProcess:
    """A broker the zygote forked: the parts of ``subprocess.Popen`` tests use.

    Its exit status comes from the file the zygote writes when it reaps it (``returncode``
    as ``Popen`` says it: the exit code, or minus the signal that ended it)."""

    def __init__(self, pid: int, status_file: Path, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._status_file = status_file

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.returncode = int(self._status_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid the zygote has reaped (it may be reused)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test side: start the zygote once, then :meth:`spawn` brokers from it."""

    def __init__(self, source: Path, env: Mapping[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gl-zygote-"))
        self.socket_path = self.dir / "zygote.sock"
        environ = dict(os.environ if env is None else env)
        environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(source), environ.get("PYTHONPATH")])
        )
        environ.pop("JUPYTERHUB_API_TOKEN", None)
        self.log_path = self.dir / "zygote.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "provisioner.devtools.zygote", str(self.socket_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environ,
            )
        deadline = time.monotonic() + 60.0
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the broker zygote did not start:\n{self.log_path.read_text()[-3000:]}"
                )
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(
        self, argv: Sequence[str], *, cwd: Path, log_path: Path, env: Mapping[str, str]
    ) -> ForkedProcess:
        """Fork a broker running ``python -m provisioner.broker.app ARGV``."""
        ask = {"argv": list(argv), "cwd": str(cwd), "log": str(log_path), "env": dict(env)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30.0)
            s.connect(str(self.socket_path))
            s.sendall(json.dumps(ask).encode() + b"\n")
            answer = _read_line(s)
        pid = int(json.loads(answer)["pid"])
        return ForkedProcess(pid, self.dir / f"{pid}.status", [MODULE, *argv])

    def close(self) -> None:
        """Stop the zygote (its children, already stopped by their tests, are not touched)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            for path in self.dir.iterdir():
                path.unlink()
            self.dir.rmdir()


def _read_line(s: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError(f"the broker zygote hung up (it said {data!r})")
        data += chunk
    return data


# -- the zygote process -------------------------------------------------------------------
def _child(ask: dict[str, Any]) -> None:
    """In the forked child: become ``python -m provisioner.broker.app ARGV``; never returns."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        fd = os.open(ask["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(ask["cwd"])
        os.environ.clear()
        os.environ.update(ask["env"])
        import random
        import runpy

        random.seed()  # not the zygote's sequence, shared by every child
        sys.argv = [MODULE, *ask["argv"]]
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (printed, as the interpreter would)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(status_dir: Path) -> None:
    """Write the exit status of every child that has ended (``<pid>.status``)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = status_dir / f"{pid}.status.tmp"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.replace(status_dir / f"{pid}.status")


def serve(socket_path: Path) -> None:
    """The zygote: import the broker, then fork one for each request until SIGTERM."""
    import importlib

    importlib.import_module(MODULE)  # the point: every child starts with it imported
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the selector

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp_path = socket_path.with_name(socket_path.name + ".tmp")
    listener.bind(str(tmp_path))
    listener.listen(16)
    os.replace(tmp_path, socket_path)  # the test side waits for the name: ready
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    status_dir = socket_path.parent
    while not stop:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    wake_r.recv(4096)
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(30.0)
                ask = json.loads(_read_line(conn))
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    listener.close()
                    wake_r.close()
                    wake_w.close()
                    selector.close()
                    _child(ask)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(status_dir)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
