"""Shared fixtures: a REAL broker on a fresh database.

``broker`` runs the broker (``provisioner.broker.app``'s Application, as ``python -m``
runs it) on a free port with a static tokens file, on a thread of the test's process, or
as a subprocess for a test marked ``broker_process`` (kill -9, signals, exit codes), with
``--gpus 1x32768:V100`` (override with
``@pytest.mark.broker_args("--gpus", "2x32768:V100", ...)``), waits for
``/api/v1/health`` and yields a :class:`Broker`. It runs on SQLite, and in
:data:`POSTGRES_MODULES` once more on PostgreSQL (``postgres`` mark; a fresh schema of the
``test`` database per test, dropped afterwards; skipped if the server cannot be reached).
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import BrokerProcess
from provisioner.devtools.zygote import Zygote

from .conformance import Conformance, served_document

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("GPU_LEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")

#: name -> (groups, admin); each gets the token "tok-<name>-<random>"
USERS: dict[str, tuple[list[str], bool]] = {
    "alice": (["ml101"], False),
    "bob": ([], False),
    "carol": (["ml101"], False),
    "admin": ([], True),
    **{f"u{n:02d}": ([], False) for n in range(40)},
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "broker_args(*args): extra command-line options for the broker fixture"
    )
    config.addinivalue_line(
        "markers",
        "alone: the test disturbs what other tests share (it restarts the PostgreSQL "
        "server): never beside them on pytest-xdist workers (make unit runs it after them)",
    )
    config.addinivalue_line(
        "markers",
        "broker_process: the broker fixture runs as a subprocess (python -m "
        "provisioner.broker.app), for a test that kills, signals or times it; without the "
        "mark it runs on a thread of the test's process (devtools.testing.EmbeddedBroker)",
    )


# -- the fast tier: a test not marked ``slow`` starts no process -------------------------
#: every way a test could start a process: subprocess (also asyncio's subprocesses, and
#: so jupyter_client's kernels, playwright's browsers), fork, posix_spawn, os.system and
#: multiprocessing's spawn/forkserver (``_posixsubprocess.fork_exec``)
PROCESS_STARTERS = [
    (subprocess.Popen, "_execute_child"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
    (_posixsubprocess, "fork_exec"),
]


def _refuse_processes(nodeid: str, mp: pytest.MonkeyPatch) -> None:
    for owner, name in PROCESS_STARTERS:
        if hasattr(owner, name):

            def refuse(*args: Any, _name: str = name, **kwargs: Any) -> Any:
                raise AssertionError(
                    f"{nodeid} started a process ({_name}) but is not marked slow: "
                    "mark it @pytest.mark.slow (the fast tier, -m 'not slow', starts no "
                    "process; docs/developers.md, Tests)"
                )

            mp.setattr(owner, name, refuse)


#: fixtures of this file that start a process: a test that uses one is ``slow`` by itself
PROCESS_FIXTURES = {"broker", "chromium"}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # beside other tests on xdist workers, a test marked ``alone`` (it restarts the shared
    # PostgreSQL server) would break theirs: ``make unit WORKERS=N`` runs those afterwards
    if hasattr(config, "workerinput"):  # this process is a pytest-xdist worker
        alone = [item for item in items if item.get_closest_marker("alone") is not None]
        if alone:
            config.hook.pytest_deselected(items=alone)
            items[:] = [item for item in items if item.get_closest_marker("alone") is None]
    # the modules that run whole on one worker first: the longest units start earliest
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in SHARED_FIXTURE_MODULES)


# -- several workers (pytest-xdist): a module that shares a fixture runs on one ----------
def _modules_sharing_a_fixture() -> frozenset[str]:
    """The test modules (``tests/test_x.py``, as in node ids) whose tests share a fixture
    kept for the whole module: one of their own (``scope="module"``: a hub, a Slurm
    cluster, a clean install) or this file's ``chromium``."""
    found = set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        text = path.read_text()
        if 'scope="module"' in text or re.search(r"\bchromium\b", text):
            found.add(f"tests/{path.name}")
    return frozenset(found)


SHARED_FIXTURE_MODULES = _modules_sharing_a_fixture()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make unit``'s scheduler: a test goes to whichever worker is free, except that a
    module of :data:`SHARED_FIXTURE_MODULES` runs whole on one worker (one per module
    parameter, such as a hub's ``[fronts]``), so its fixture is made once.

    (xdist's own ``--dist loadgroup`` marks groups by editing node ids, which pytest 9's
    nodes no longer take: its groups are silently ignored.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return SharedFixtureScheduling(config, log)


def unit_of_work(nodeid: str) -> str:
    """What one worker runs together: a shared-fixture module's tests of one module-level
    parameter (``[fronts]``), or a single test."""
    path = nodeid.split("::", 1)[0]
    if path not in SHARED_FIXTURE_MODULES:
        return nodeid
    return path + ("[fronts]" if "fronts]" in nodeid else "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _process_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _process_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with _process_guard(item):
        return (yield)


#: what a failed hub test's report adds from the hub's log (servers' lines included)
HUB_LOG_LINES = 40
_TELLING = re.compile(r"^\[[WEC] |gpu_lease\.|Traceback|Error|\b([Kk]ernel|lease|GPU)\b")
#: an HTTP access line (``200 GET /user/...``), the proxy's routes, the demo's banner (it
#: prints the admin's token): not telling, or not for a report
_ROUTINE = re.compile(r"\] \d{3} (GET|POST|PUT|PATCH|DELETE) |\[ConfigProxy\]|TOKEN|password")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test that uses a hub (``tests.test_hub.Hub``) reports the hub log's telling
    lines (warnings, errors, the GPU lease lines of the hub, the broker and the servers):
    a failure seen once in CI then has its cause in the report, not only a timeout."""
    report = yield
    hub = getattr(item, "funcargs", {}).get("hub")
    log_path = getattr(hub, "log_path", None)
    if report.failed and isinstance(log_path, Path) and log_path.exists():
        lines = log_path.read_text(errors="replace").splitlines()
        telling = [x[:300] for x in lines if _TELLING.search(x) and not _ROUTINE.search(x)]
        telling = telling[-HUB_LOG_LINES:]
        report.sections.append((f"the hub's log ({log_path})", "\n".join(telling)))
    return report


@contextlib.contextmanager
def _process_guard(item: pytest.Item) -> Iterator[None]:
    """While a test not marked ``slow`` runs (its fixtures' setup and teardown included),
    starting a process fails it; in every run, so ``make test`` keeps the tier honest."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        _refuse_processes(item.nodeid, mp)
        yield


#: modules whose tests run a second time with the broker's HTTP served by a front process
#: (``--http-processes 1``): the broker's API, authorization, fuzzing, crash, failover and
#: hub tests. Not the kernel side's (``test_provisioner``: its calls, the acquire long-poll
#: included, are the API's, which ``test_broker_api`` runs behind a front, and a hub's
#: kernels run behind one in ``test_hub``'s ``[fronts]``), nor the browser's on a hub (the
#: page talks to the single-user server, not to the broker). A ``broker`` fixture's second variant is ``[sqlite-fronts]`` (the
#: SQL is the same behind a front process); a module's hub (``hub_http_processes``) runs
#: once more whole, its broker started by JupyterHub with ``--http-processes 1``.
FRONTS_MODULES = {
    "test_broker_api",
    "test_authz",
    "test_fuzz_bodies",
    "test_fuzz_openapi",
    "test_metrics",
    "test_cli_admin",
    "test_courses",
    "test_faults",
    "test_failover",
    "test_node_orders",
    "test_hub",
}
#: set (to a number) to serve every ``broker`` fixture's HTTP from that many front
#: processes, in every module (the fronts variants above run in every ``make test``)
HTTP_PROCESSES_ENV = "GPU_LEASE_TEST_HTTP_PROCESSES"
#: set to 1 to run each ``broker`` fixture's broker on a thread of the test's process
#: (``devtools.testing.EmbeddedBroker``) instead of a subprocess
EMBEDDED_BROKER_ENV = "GPU_LEASE_TEST_EMBEDDED_BROKER"


DATABASES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
#: modules whose ``broker_db_url`` (and so ``broker``) runs on PostgreSQL too: where the SQL
#: or the locking differs between the two databases (the store's writes and reads, the
#: queue's order, restarts and kill -9 recovery, failover's advisory locks, nodes, parking's
#: stored states, the MPS claims' window). Elsewhere (the kernel side, fuzzing, refusals,
#: authorization, the CLI) a test exercises the HTTP and the rules above the store, the same
#: code on either database: it runs on SQLite. Set ``GPU_LEASE_TEST_ALL_DATABASES=1`` to run
#: every module on both.
POSTGRES_MODULES = {
    "test_store",
    "test_broker_api",
    "test_failover",
    "test_faults",
    "test_nodes",
    "test_node_orders",
    "test_parking_broker",
    "test_mps_claims",
    "test_quota_effective",
}
ALL_DATABASES_ENV = "GPU_LEASE_TEST_ALL_DATABASES"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``broker_db_url``: SQLite, and PostgreSQL in :data:`POSTGRES_MODULES` (unless the
    test or its module chose); and
    the fronts variants of :data:`FRONTS_MODULES`: a broker's on SQLite (beside its SQLite
    and PostgreSQL runs), a module's hub whole."""
    names = metafunc.fixturenames
    module = metafunc.module.__name__.rpartition(".")[2]
    fronts = module in FRONTS_MODULES
    postgres = module in POSTGRES_MODULES or os.environ.get(ALL_DATABASES_ENV) == "1"
    if fronts and "hub_http_processes" in names:
        metafunc.parametrize(
            "hub_http_processes", [0, 1], ids=["", "fronts"], indirect=True, scope="module"
        )
    given = {
        n.strip()
        for m in metafunc.definition.iter_markers("parametrize")
        for n in (m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])
    }
    defs = metafunc._arg2fixturedefs.get("broker_db_url", ())
    chosen = "broker_db_url" in given or bool(defs and defs[-1].params)
    fronts = fronts and "broker_http_processes" in names
    if "broker_db_url" in names and not chosen:
        if fronts:
            metafunc.parametrize(
                ("broker_db_url", "broker_http_processes"),
                [
                    ("sqlite", 0),
                    *([pytest.param("postgresql", 0, marks=pytest.mark.postgres)] * postgres),
                    ("sqlite", 1),
                ],
                ids=["sqlite", *(["postgresql"] * postgres), "sqlite-fronts"],
                indirect=True,
            )
            return
        metafunc.parametrize("broker_db_url", DATABASES if postgres else ["sqlite"], indirect=True)
    if fronts:
        metafunc.parametrize("broker_http_processes", [0, 1], ids=["", "fronts"], indirect=True)


@pytest.fixture
def broker_http_processes(request: pytest.FixtureRequest) -> int:
    """How many front processes serve the ``broker`` fixture's HTTP (0: the broker itself)."""
    env = int(os.environ.get(HTTP_PROCESSES_ENV) or 0)
    return int(getattr(request, "param", 0)) or env


@pytest.fixture(scope="module")
def hub_http_processes(request: pytest.FixtureRequest) -> int:
    """How many front processes serve a module hub's broker (0: the broker itself)."""
    return int(getattr(request, "param", 0))


def hub_env(http_processes: int, **env: str) -> dict[str, str]:
    """A hub's ``GPU_LEASE_*`` knobs, with ``GPU_LEASE_HTTP_PROCESSES`` when fronts serve."""
    if http_processes:
        env["GPU_LEASE_HTTP_PROCESSES"] = str(http_processes)
    return env


class Broker(BrokerProcess):
    """A broker subprocess: ``url``, ``tokens`` (user -> token), ``proc``, ``db_url``.

    :class:`provisioner.devtools.testing.BrokerProcess` with this module's ``USERS`` and
    ``--gpus 1x32768:V100`` unless ``extra`` names ``--gpus``.
    """

    def __init__(
        self,
        tmp: Path,
        db_url: str,
        extra: tuple[str, ...] = (),
        env: Any = None,
        in_process: bool = False,
        forked: bool = True,
    ):
        super().__init__(tmp, db_url, USERS, extra=extra, env=env, in_process=in_process)
        #: forked from :func:`shared_zygote` (else ``python -m``) where nothing asks for a
        #: process of its own (:meth:`forkable`: a profile, another source tree, an
        #: environment)
        self.forked = forked
        #: every answer its clients got, checked against its document when it stops
        self.conformance = Conformance()

    def launch(self) -> None:
        if self.forked and self.forkable():
            self.zygote = shared_zygote()
        super().launch()

    def problems(self) -> list[str]:
        """Lines of every run's log that show a crash inside the broker."""
        bad = ("Traceback", "Unexpected error", "Task was destroyed", "Exception in callback")
        out = []
        for path in self.logs():
            if path.exists():
                out += [
                    x
                    for x in path.read_text(errors="replace").splitlines()
                    if any(b in x for b in bad)
                ]
        return out

    @contextlib.contextmanager
    def running(self, timeout: float = 20.0) -> Iterator[Broker]:
        """:meth:`BrokerProcess.running`; then a crash in its log, or an answer that its
        OpenAPI document refuses (:mod:`tests.conformance`), fails the test."""
        with super().running(timeout):
            document = served_document(self.url)
            yield self
        assert not self.problems(), "the broker logged errors:\n" + "\n".join(self.problems())
        checked, refused = self.conformance.problems(document)
        assert not refused, (
            f"{len(refused)} of {checked} answers do not match the broker's OpenAPI document:\n"
            + "\n".join(refused)
        )

    # -- helpers for tests ---------------------------------------------------------
    def headers(self, user: str | None) -> dict[str, str]:
        return {} if user is None else {"Authorization": f"token {self.tokens[user]}"}

    def client(self, user: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 30.0)
        kwargs.setdefault("event_hooks", self.conformance.hooks())
        return httpx.AsyncClient(
            base_url=f"{self.url}/api/v1", headers=self.headers(user), **kwargs
        )


@pytest.fixture
def broker_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database: an SQLite file, or a new PostgreSQL schema dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'b.sqlite'}"
        return
    with postgres_schema("gl_api") as url:
        yield url


@contextlib.contextmanager
def postgres_schema(prefix: str = "gl_test") -> Iterator[str]:
    """A database URL of a fresh PostgreSQL schema, dropped afterwards (skip if unreachable)."""
    psycopg2 = pytest.importorskip("psycopg2")
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        conn = psycopg2.connect(PG_URL, connect_timeout=5)
    except psycopg2.OperationalError as exc:
        pytest.skip(f"PostgreSQL at {PG_URL} is unreachable: {str(exc).splitlines()[0]}")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE SCHEMA "{schema}"')
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.close()


#: set to 0 to start every test broker with ``python -m`` instead of forking it from the
#: zygote
ZYGOTE_ENV = "GPU_LEASE_TEST_ZYGOTE"
_zygote: Zygote | None = None


def shared_zygote() -> Zygote | None:
    """This pytest process's broker zygote (:mod:`provisioner.devtools.zygote`), started at
    the first broker a test makes (a slow test's: it is a process) and stopped when the
    session ends: it has imported the broker and forks a real broker process for each
    start, without the 1.2 s of CPU its imports cost. None with ``GPU_LEASE_TEST_ZYGOTE=0``."""
    global _zygote
    if os.environ.get(ZYGOTE_ENV) == "0":
        return None
    if _zygote is None or not _zygote.alive():
        _zygote = Zygote(ROOT)
    return _zygote


def pytest_unconfigure(config: pytest.Config) -> None:
    if _zygote is not None:
        _zygote.close()


@pytest.fixture
def broker(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    broker_db_url: str,
    broker_http_processes: int,
) -> Iterator[Broker]:
    """A running broker process (see the module docstring), forked from the zygote
    (:func:`shared_zygote`); a test marked ``broker_process`` (it kills, signals or times the
    process) gets one started by ``python -m``. With ``GPU_LEASE_TEST_EMBEDDED_BROKER=1``,
    the broker runs on a thread of the test's process instead, unless the test is marked
    ``broker_process`` or front processes serve its HTTP."""
    marker = request.node.get_closest_marker("broker_args")
    extra = tuple(marker.args) if marker else ()
    if broker_http_processes and "--http-processes" not in extra:
        extra += ("--http-processes", str(broker_http_processes))
    # embedded only when asked (GPU_LEASE_TEST_EMBEDDED_BROKER=1): on a 2-core machine the
    # broker's thread and the test's client then share one interpreter lock, and a serial
    # run was slower than with a subprocess; front processes write their log to their
    # parent's stderr: a process's, not pytest's
    in_process = (
        os.environ.get(EMBEDDED_BROKER_ENV) == "1"
        and request.node.get_closest_marker("broker_process") is None
        and "--http-processes" not in extra
    )
    forked = request.node.get_closest_marker("broker_process") is None
    with Broker(
        tmp_path, broker_db_url, extra, in_process=in_process, forked=forked
    ).running() as b:
        yield b


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a browser test's screenshots go: ``docs/img/`` with
    ``GPU_LEASE_SCREENSHOTS=1`` (to retake the docs' images), else a temporary folder."""
    if os.environ.get("GPU_LEASE_SCREENSHOTS") == "1":
        out = ROOT / "docs" / "img"
        out.mkdir(parents=True, exist_ok=True)
        return out
    return tmp_path_factory.mktemp("shots")


# -- a real browser: Debian's chromium driven by Playwright (never `playwright install`) --
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One headless chromium per test module; skipped with the reason when absent."""
    if not os.path.exists(CHROMIUM):
        reason = f"{CHROMIUM} is missing"
        if shutil.which("apt-get"):
            reason += " (make install runs apt-get install -y chromium)"
        pytest.skip(reason)
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
