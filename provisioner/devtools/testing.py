"""A real broker subprocess for tests and benchmarks.

``tests/conftest.py`` (the ``broker`` fixture) and ``benchmarks/`` (throughput, kernel
start) start, check and stop the broker the same way through :class:`BrokerProcess` (and load
``examples/`` scripts with :func:`load_example`; wait for a condition, never a fixed time,
with :func:`wait_for` and :func:`wait_for_async`):
``python -m provisioner.broker.app`` on a free port, with a static tokens file, waiting
for ``/api/v1/health``. Nothing in the broker or the provisioner imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import httpx

from .zygote import ForkedProcess, Zygote

ROOT = Path(__file__).resolve().parents[2]

#: the pool the broker declares when the caller's options name none
DEFAULT_GPUS = "1x32768:V100"


def write_private(path: Path, text: str) -> None:
    """Write ``path`` readable by its owner only (mode 0600 whatever the umask: tokens),
    whole: the text goes to a file beside it that then replaces it, so a reader that waits
    for the file (a script or test waiting for the demo's ``demo.json``) never reads it
    empty or half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # a file left with a wider mode: no longer
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed_out(
    what: object, timeout: float, last: object, detail: Callable[[], str] | None
) -> AssertionError:
    said = f" (last: {last!r})" if last not in (None, False, "", [], {}) else ""
    more = f"\n{detail()}" if detail is not None else ""
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}{said}{more}")


def wait_for(
    cond: Callable[[], Any],
    timeout: float = 15.0,
    what: str = "",
    interval: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Poll ``cond()`` until it returns something truthy and return that; AssertionError
    naming ``what`` (and ending in ``detail()``, a log say) after ``timeout`` seconds. The
    one way tests and benchmarks wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what or cond, timeout, value, detail)
        time.sleep(interval)


async def wait_for_async(
    cond: Callable[[], Any],
    timeout: float = 15.0,
    what: str = "",
    interval: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> Any:
    """:func:`wait_for` inside a running event loop; ``cond`` may return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what or cond, timeout, value, detail)
        await asyncio.sleep(interval)


class Polled(Protocol):
    """What :func:`wait_for_http` watches: a ``Popen``, a
    :class:`~provisioner.devtools.zygote.ForkedProcess` or an :class:`EmbeddedBroker`."""

    returncode: int | Any

    def poll(self) -> int | None: ...


def wait_for_http(
    url: str,
    proc: Polled | None = None,
    log: Callable[[], str] = lambda: "",
    timeout: float = 30.0,
    what: str = "the server",
    **request: Any,
) -> None:
    """Wait until ``GET url`` answers 200 (``request``: httpx.get's options, such as
    ``params`` or ``headers``). RuntimeError with ``log()`` as soon as ``proc`` exits, and
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url, timeout=2.0, **request).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} in {timeout:g} s:\n{log()}")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def execute(
    km: Any, code: str, *, ready_timeout: float = 30.0, timeout: float = 30.0
) -> tuple[str, dict[str, Any]]:
    """Run ``code`` in the kernel of ``km`` (a jupyter_client ``AsyncKernelManager``):
    its output (stdout, stderr, and ``ename: evalue`` of an error) and the execute
    reply's content, whatever its status."""
    kc = km.client()
    kc.start_channels()
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            content = msg["content"]
            out.append(f"{content.get('ename')}: {content.get('evalue')}")

    try:
        await kc.wait_for_ready(timeout=ready_timeout)
        reply = await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    finally:
        kc.stop_channels()
    return "".join(out), dict(reply["content"])


async def interrupt_a_sleeping_cell(
    km: Any, kc: Any, *, seconds: float = 60.0, settle: float = 0.5, timeout: float = 30.0
) -> tuple[dict[str, Any], float]:
    """Run a cell that sleeps for ``seconds`` in short steps on ``kc`` (a started client of
    ``km``'s kernel), interrupt the kernel ``settle`` seconds later as JupyterLab does
    (``km.interrupt_kernel()``, through the provisioner), and wait for the cell's reply:
    its content, and the seconds (``time.perf_counter``) from the interrupt to the reply."""
    steps = max(1, round(seconds / 0.1))
    msg_id = kc.execute(f"import time\nfor _ in range({steps}): time.sleep(0.1)")
    await asyncio.sleep(settle)
    t0 = time.perf_counter()
    await km.interrupt_kernel()
    while True:
        reply = await kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return dict(reply["content"]), time.perf_counter() - t0


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (registered as ``name``: dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (Linux ``/proc``), in seconds; 0.0 where unavailable."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux ``/proc``; a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children_of(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux ``/proc``), children of children too."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            found += [kid, *children_of(kid)]
    return found


def tree_cpu_seconds(pid: int | None) -> float:
    """``cpu_seconds`` of ``pid`` and of its live children (a broker's HTTP processes)."""
    if not pid:
        return 0.0
    return cpu_seconds(pid) + sum(cpu_seconds(kid) for kid in children_of(pid))


class EmbeddedBroker:
    """``python -m provisioner.broker.app ARGS`` run on a thread of this process instead:
    the same Application, options, store, service and HTTP server, minus the interpreter's
    start (about 0.7 s of CPU a start on this project's machines). What a process alone can
    show (kill -9, signals, exit codes, CPU) needs :class:`BrokerProcess`'s subprocess.

    It looks enough like the ``Popen`` it stands for (``poll``, ``wait``, ``returncode``)
    for :class:`BrokerProcess` to start, wait for and stop it the same way; its log (the
    broker's loggers, as the process writes them) goes to ``log_path``.
    """

    #: the loggers a broker writes to (its modules', its store's, tornado's)
    LOGGERS = ("gpu_lease.broker", "gpu_lease.store", "tornado")

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.returncode: int | None = None
        self.pid = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embedded-broker", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30.0)

    def _run(self) -> None:
        from provisioner.broker.app import LOG_DATEFMT, LOG_FORMAT, GPULeaseBroker

        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        saved = []
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            saved.append((logger, logger.level))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        try:
            app = GPULeaseBroker()
            app.initialize(self.argv)
            for logger, _ in saved:  # --log-level, as the process's _setup_logging sets it
                logger.setLevel(int(app.log_level))  # type: ignore[call-overload]
            app.log = logging.getLogger("gpu_lease.broker.app")
            self.returncode = asyncio.run(self._serve(app))
        except SystemExit as exc:  # a configuration error: Application.exit(2)
            self.returncode = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            logging.getLogger("gpu_lease.broker.app").exception("Unexpected error")
            self.returncode = 1
        finally:
            self._ready.set()
            for logger, level in saved:
                logger.removeHandler(handler)
                logger.setLevel(level)
            handler.close()

    async def _serve(self, app: Any) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        return int(await app.serve(self._stop))

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(["embedded broker", *self.argv], timeout or 0.0)
        return self.returncode

    def stop(self) -> None:
        """What SIGTERM does to the process: ``serve``'s stop event is set."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop has just closed
                self._loop.call_soon_threadsafe(self._stop.set)


class BrokerProcess:
    """``python -m provisioner.broker.app --auth static`` on a free port, in ``tmp``.

    ``users`` maps user name -> (groups, admin); each gets the token
    ``tok-<name>-<random>`` (``tokens``: name -> token) in ``tokens_file``. ``extra``
    are more command-line options (``--gpus`` there replaces ``gpus``; ``--base-url``
    moves ``url``). Every start logs to its own file, ``<name>-<n>.log`` (``log_path``
    is the current one). ``profile`` (a file) runs the broker under cProfile; the
    profile is written when it exits on SIGTERM. ``source`` is the source tree put first
    on ``PYTHONPATH`` (this checkout by default; another for A/B benchmarks). ``zygote``
    (:class:`~provisioner.devtools.zygote.Zygote`) forks the broker from a process that
    has imported it instead of starting ``python -m`` (not with a profile, another source
    or an environment of its own).
    """

    def __init__(
        self,
        tmp: Path,
        db_url: str,
        users: Mapping[str, tuple[Sequence[str], bool]],
        *,
        gpus: str = DEFAULT_GPUS,
        extra: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        profile: Path | None = None,
        name: str = "broker",
        source: Path = ROOT,
        in_process: bool = False,
        zygote: Zygote | None = None,
    ) -> None:
        self.tmp = tmp
        self.source = source
        self.db_url = db_url
        self.gpus = gpus
        self.extra = extra
        self.env = env
        self.profile = profile
        self.name = name
        self.port = free_port()
        self.base_url = "/"
        for i, arg in enumerate(extra):
            if arg == "--base-url":
                self.base_url = "/" + extra[i + 1].strip("/") + "/"
        self.url = f"http://127.0.0.1:{self.port}{self.base_url.rstrip('/')}"
        self.tokens = {user: f"tok-{user}-{uuid.uuid4().hex}" for user in users}
        self.tokens_file = tmp / f"{name}-tokens.json"
        write_private(
            self.tokens_file,
            json.dumps(
                {
                    self.tokens[user]: {"user": user, "groups": list(groups), "admin": admin}
                    for user, (groups, admin) in users.items()
                }
            ),
        )
        self.proc: subprocess.Popen[bytes] | ForkedProcess | EmbeddedBroker | None = None
        self.starts = 0
        #: run it as an :class:`EmbeddedBroker` (where the test needs no process; a
        #: profile, another source tree or an environment of its own need one)
        self.in_process = in_process and profile is None and source == ROOT and env is None
        #: fork it from ``zygote`` (:mod:`provisioner.devtools.zygote`: the broker already
        #: imported) instead of ``python -m``, under the same conditions (:meth:`forkable`)
        self.zygote = zygote

    # -- life cycle -------------------------------------------------------------------
    def command(self) -> list[str]:
        head = [sys.executable]
        if self.profile is not None:
            head += ["-m", "cProfile", "-o", str(self.profile)]
        args = [
            *head,
            "-m",
            "provisioner.broker.app",
            "--port",
            str(self.port),
            "--auth",
            "static",
            "--tokens-file",
            str(self.tokens_file),
            "--db-url",
            self.db_url,
        ]
        if "--gpus" not in self.extra:
            args += ["--gpus", self.gpus]
        return args + list(self.extra)

    @property
    def log_path(self) -> Path:
        return self.tmp / f"{self.name}-{self.starts}.log"

    def start(self, timeout: float = 20.0) -> None:
        """Start it and wait until ``/api/v1/health`` answers 200."""
        self.launch()
        assert self.proc is not None
        try:
            wait_for_http(
                f"{self.url}/api/v1/health", self.proc, self.log, timeout, what="the broker"
            )
        except RuntimeError:
            if isinstance(self.proc, EmbeddedBroker):
                self.stop()
            else:
                self.kill9()
            raise

    def launch(self) -> None:
        """Start the process without waiting for it to answer (a standby does not listen)."""
        assert self.proc is None or self.proc.poll() is not None
        self.starts += 1
        if self.in_process:
            embedded = EmbeddedBroker(self.command()[3:], self.log_path)
            self.proc = embedded
            embedded.start()
            return
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.source), env.get("PYTHONPATH")]))
        env.pop("JUPYTERHUB_API_TOKEN", None)
        if self.zygote is not None and self.forkable() and self.zygote.alive():
            self.proc = self.zygote.spawn(
                self.command()[3:], cwd=self.tmp, log_path=self.log_path, env=env
            )
            return
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp, env=env
            )

    def forkable(self) -> bool:
        """Whether a zygote's fork is this start: the zygote imported this checkout's
        broker, with the test's environment (checked at each start: a test may point
        ``source`` at an older tree after making the broker)."""
        return self.profile is None and self.source == ROOT and self.env is None

    def health(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/api/v1/health", timeout=10.0)
        if r.status_code != 200:
            raise RuntimeError(f"/api/v1/health answered {r.status_code}")
        return dict(r.json())

    def process_for(self, what: str) -> subprocess.Popen[bytes] | ForkedProcess:
        """The running broker's process, for ``what`` only a process can do."""
        if isinstance(self.proc, EmbeddedBroker):
            raise RuntimeError(
                f"{what} needs a broker process, and this broker runs in the test's process: "
                "mark the test @pytest.mark.broker_process (tests/conftest.py)"
            )
        assert self.proc is not None
        return self.proc

    def cpu(self) -> float:
        """CPU seconds the running broker has used (with its ``--http-processes``)."""
        if self.proc is None:
            return 0.0
        return tree_cpu_seconds(self.process_for("its CPU time").pid)

    def terminate(self, timeout: float = 5.0) -> tuple[int, float]:
        """SIGTERM; returns (exit code, seconds it took to exit)."""
        assert self.proc is not None
        t0 = time.monotonic()
        if isinstance(self.proc, EmbeddedBroker):
            self.proc.stop()
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                raise
            return int(code or 0), time.monotonic() - t0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return code, time.monotonic() - t0

    def kill9(self) -> None:
        """SIGKILL; returns once its HTTP processes (``--http-processes``), which exit
        when it is gone, are gone too (the port is free again)."""
        if self.proc is not None and self.proc.poll() is None:
            proc = self.process_for("kill -9")
            kids = children_of(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            wait_for(
                lambda: not any(map(alive, kids)),
                10.0,
                "the broker's HTTP processes to exit after it was killed",
            )

    def restart(self) -> None:
        """A clean restart (SIGTERM, then start again on the same port and database)."""
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
        self.start()

    @contextlib.contextmanager
    def running(self, timeout: float = 20.0) -> Iterator[BrokerProcess]:
        """Started for the ``with`` block, stopped (and surely gone) after it."""
        self.start(timeout=timeout)
        try:
            yield self
        finally:
            self.stop()
            self.kill9()

    def stop(self) -> None:
        """SIGTERM if running (SIGKILL if it does not exit in time)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30.0 if self.profile else 10.0)
            except subprocess.TimeoutExpired:
                pass

    def log(self, limit: int = 5000) -> str:
        """The end of the current start's log."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def logs(self) -> list[Path]:
        """Every start's log file, oldest first."""
        return [self.tmp / f"{self.name}-{n}.log" for n in range(1, self.starts + 1)]
