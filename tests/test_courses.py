"""The courses file (hub_config/courses.toml): parsing, the hub's view, the broker applying it.

Parsing is table-tested without processes; the broker tests start a real broker with
``--quotas-file`` (the ``broker`` fixture) and restart it to show the precedence rule:
every start re-applies the entries the file names, API changes to other names persist.
The server-side kernel manager that forgets refused starts is tested here too, with a
real ``GPULeaseKernelManager`` and a kernelspec that cannot start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from provisioner.broker.courses import check_sessions, load_courses, parse_courses
from provisioner.errors import CoursesFileError
from provisioner.model import GPU, Quota

from .conftest import Broker

ROOT = Path(__file__).resolve().parent.parent
COURSES = ROOT / "hub_config" / "courses.toml"


def test_the_shipped_file() -> None:
    courses = load_courses(str(COURSES))
    assert courses.admins == ["admin"]
    ml101 = courses.courses["ml101"]
    assert len(ml101.members) == 60 and ml101.instructors == ["instructor"]
    assert "instructor" in ml101.everyone
    groups = courses.hub_groups()
    assert set(groups) == {"ml101"} and len(groups["ml101"]["users"]) == 61
    levels = [(level, name) for level, name, _ in courses.quota_entries()]
    assert levels == [("default", ""), ("group", "ml101"), ("user", "instructor")]
    assert courses.instructors() == ["instructor"]
    assert {"admin", "instructor", "student60"} <= set(courses.users())


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        ({}, []),
        ({"quota": {"default": {"max_leases": 1}}}, [("default", "", Quota(max_leases=1))]),
        (
            {"courses": {"cv": {"members": ["a"], "quota": {"max_fraction": 0.5, "priority": 3}}}},
            [("group", "cv", Quota(max_fraction_ppm=500_000, priority=3))],
        ),
        (
            {"quota": {"users": {"bob": {"budget_fraction_hours": 2, "budget_window": "7d"}}}},
            [("user", "bob", Quota(budget_fraction_hours=2.0, budget_window_s=7 * 86400))],
        ),
    ],
)
def test_quota_entries(data: dict[str, Any], expect: list[Any]) -> None:
    assert parse_courses(data).quota_entries() == expect


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"teachers": []}, "unknown key(s) 'teachers'"),
        ({"courses": {"ml101": {"members": "alice"}}}, "'members' of [courses.ml101]"),
        ({"courses": {"ml101": {"members": ["no spaces"]}}}, "not a valid user name"),
        ({"courses": {"ml101": {"quota": {"max_leases": -1}}}}, "the quota of [courses.ml101]"),
        ({"quota": {"default": {"max_fraction": "lots"}}}, "[quota.default]"),
        ({"quota": {"users": {"bob": {"color": 1}}}}, "[quota.users.bob]"),
        ({"courses": {"bad name": {}}}, "not a valid group name"),
    ],
)
def test_errors_name_the_table(data: dict[str, Any], words: str) -> None:
    with pytest.raises(CoursesFileError) as info:
        parse_courses(data, "courses.toml")
    assert words in info.value.message and "courses.toml" in info.value.message


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(CoursesFileError, match="does not exist"):
        load_courses(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("admins = [\n")
    with pytest.raises(CoursesFileError, match="not valid TOML"):
        load_courses(str(bad))


@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


@pytest.mark.slow
@pytest.mark.broker_args("--quotas-file", str(COURSES))
async def test_broker_applies_the_file_at_every_start(broker: Broker) -> None:
    async with broker.client("admin") as c:
        r = await c.get("/quotas")
        assert r.status_code == 200, r.text
        quotas = r.json()
        assert quotas["default"]["max_leases"] == 1
        assert quotas["groups"]["ml101"]["max_leases"] == 2
        assert quotas["users"]["instructor"]["max_lease_fraction"] == 0.25
        for path in ("users/instructor", "users/alice", "groups/ml101"):
            r = await c.put(f"/quotas/{path}", json={"max_leases": 7})
            assert r.status_code == 200, r.text
    async with broker.client("alice") as c:  # alice is in ml101 in the tokens file
        me = (await c.get("/quotas/me")).json()
        assert me["effective"]["max_leases"] == 7  # her own API-set override
    broker.restart()
    async with broker.client("admin") as c:
        quotas = (await c.get("/quotas")).json()
    assert quotas["users"]["instructor"]["max_leases"] == 4  # named in the file: re-applied
    assert quotas["groups"]["ml101"]["max_leases"] == 2  # named in the file: re-applied
    assert quotas["users"]["alice"]["max_leases"] == 7  # not in the file: kept


@pytest.mark.slow
def test_broker_refuses_a_broken_file(tmp_path: Path, broker_db_url: str) -> None:
    bad = tmp_path / "courses.toml"
    bad.write_text('[quota.default]\nmax_leases = "many"\n')
    b = Broker(tmp_path, broker_db_url, ("--quotas-file", str(bad)))
    with pytest.raises(RuntimeError, match="exited with 2") as info:
        b.start()
    assert "[quota.default]" in str(info.value) and "max_leases" in str(info.value)


async def test_kernel_manager_forgets_refused_starts(tmp_path: Path) -> None:
    from provisioner.kernel.server import GPULeaseKernelManager

    spec = tmp_path / "kernels" / "refused"
    spec.mkdir(parents=True)
    # a kernel whose start fails before any process exists, as a broker refusal does
    argv = [str(tmp_path / "no-such-python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "refused", "language": "python"})
    )
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    km = GPULeaseKernelManager(kernel_spec_manager=ksm, root_dir=str(tmp_path))
    with pytest.raises(Exception):  # noqa: B017 - whatever the launcher raised
        await km.start_kernel(kernel_name="refused")
    assert km._pending_kernels == {}
    await km.shutdown_all()  # the stock manager raises 404 here: "Kernel does not exist"


@pytest.mark.slow
def test_server_introduces_its_token_to_the_broker_at_start(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from provisioner.kernel.server import introduce

    caplog.set_level("DEBUG", logger="provisioner.kernel.server")
    monkeypatch.delenv("GPU_LEASE_URL", raising=False)
    assert introduce() is None  # no broker configured: nothing to do
    monkeypatch.setenv("GPU_LEASE_URL", broker.url)
    monkeypatch.delenv("GPU_LEASE_TOKEN", raising=False)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", broker.tokens["alice"])  # a server's own token
    thread = introduce()
    assert thread is not None
    thread.join(15)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "forged")
    thread = introduce()
    assert thread is not None
    thread.join(15)
    answers = [r.getMessage() for r in caplog.records if r.name == "provisioner.kernel.server"]
    assert answers == [
        f"GPU lease broker at {broker.url} knows this server's token",
        f"GPU lease broker at {broker.url} did not take the introduction: not_authenticated",
    ]


def test_refusals_reach_jupyter_server_as_http_errors() -> None:
    from tornado.web import HTTPError

    from provisioner.errors import Forbidden, QuotaExceeded
    from provisioner.kernel.refusals import for_jupyter_server

    exc = for_jupyter_server(QuotaExceeded("You run 2 GPU kernels (2).", quota="max_leases"))
    assert isinstance(exc, QuotaExceeded) and isinstance(exc, Forbidden)
    assert isinstance(exc, HTTPError) and exc.status_code == 403
    assert str(exc) == exc.message == "You run 2 GPU kernels (2)."
    assert exc.details == {"quota": "max_leases"}


def test_hub_config_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """jupyterhub_config.py runs (no hub) and wires what the docs promise."""
    from traitlets.config import Config

    monkeypatch.setenv("GPU_LEASE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("GPU_LEASE_GPUS", "1x32768:V100")
    path = ROOT / "hub_config" / "jupyterhub_config.py"

    def load() -> Config:
        cfg = Config()
        ns: dict[str, Any] = {"get_config": lambda: cfg, "__file__": str(path)}
        exec(compile(path.read_text(), str(path), "exec"), ns)
        return cfg

    # kernels' Unix sockets under a long runtime directory: refused at the start, by name
    long_root = f"/tmp/{'x' * 60}"
    monkeypatch.setenv("GPU_LEASE_RUNTIME_DIR", long_root)
    with pytest.raises(SystemExit, match=f"runtime directory {long_root} is 65 bytes"):
        load()
    monkeypatch.setenv("GPU_LEASE_KERNEL_TRANSPORT", "tcp")
    load()  # TCP kernels have no socket paths
    monkeypatch.delenv("GPU_LEASE_KERNEL_TRANSPORT")
    monkeypatch.setenv("GPU_LEASE_RUNTIME_DIR", "/tmp/gpu-lease-rt-test")
    cfg = load()
    services = {s["name"]: s for s in cfg.JupyterHub.services}
    cmd = services["gpu-lease"]["command"]
    assert cmd[:3] == [sys.executable, "-m", "provisioner.broker.app"] and "hub" in cmd
    assert "access:services!service=gpu-lease" in cfg.Spawner.server_token_scopes
    assert cfg.Spawner.environment["GPU_LEASE_URL"].endswith("/services/gpu-lease")
    assert "custom:gpu-lease:admin" in cfg.JupyterHub.custom_scopes
    assert set(cfg.JupyterHub.load_groups) == {"ml101"}
    assert (tmp_path / "admin-token").stat().st_mode & 0o077 == 0


def test_kernel_manager_pays_the_provisioners_one_time_costs_at_server_start(
    tmp_path: Path,
) -> None:
    """Creating the server's kernel manager imports the provisioner and builds the SSL
    context, so a student's first GPU kernel start does not pay for them."""
    import sys

    from provisioner.client.http import _ssl_context
    from provisioner.kernel.server import GPULeaseKernelManager

    _ssl_context.cache_clear()
    GPULeaseKernelManager(root_dir=str(tmp_path))
    assert "provisioner.kernel.provisioner" in sys.modules
    assert _ssl_context.cache_info().currsize == 1


# -- class sessions ------------------------------------------------------------------


def _lab(**session: Any) -> dict[str, Any]:
    base = {"days": ["tue"], "start": "10:00", "end": "11:30", "seats": 40}
    return {
        "courses": {
            "ml101": {"quota": {"max_lease_fraction": 0.02}, "sessions": [{**base, **session}]}
        }
    }


def test_sessions_are_read_with_their_share() -> None:
    (plan,) = parse_courses(_lab(tz="Europe/Paris")).session_plans()
    assert (plan.days, plan.tz, plan.share_ppm, plan.label) == (
        (1,),
        "Europe/Paris",
        800_000,
        "Tue 10:00-11:30",
    )
    exam_table = {
        "date": "2026-12-15",
        "start": "09:00",
        "end": "12:00",
        "share": 0.5,
        "nodes": ["gpu-a"],
    }
    (exam,) = parse_courses({"courses": {"ml101": {"sessions": [exam_table]}}}).session_plans()
    assert (exam.pool_fraction, exam.nodes, exam.label) == (
        0.5,
        ("gpu-a",),
        "2026-12-15 09:00-12:00",
    )


@pytest.mark.parametrize(
    ("session", "says"),
    [
        ({"tz": "Mars/Olympus"}, "'Mars/Olympus' is not an IANA time zone"),
        ({"start": "25:00"}, 'must be a time such as "10:00"'),
        ({"days": ["someday"]}, "a list of week days"),
        ({"date": "2026-12-15"}, "needs either 'days'"),
        ({"share": 0.5}, "needs either 'share'"),
        ({"seats": 0}, "'seats' of session 1 of [courses.ml101]"),
        ({"share": 1.5, "seats": None}, "'share'"),
        ({"room": 12}, "unknown key(s) 'room'"),
    ],
)
def test_bad_sessions_are_refused_with_a_sentence(session: dict[str, Any], says: str) -> None:
    data = _lab(**session)
    table = data["courses"]["ml101"]["sessions"][0]
    for key in [k for k, v in table.items() if v is None]:
        del table[key]
    with pytest.raises(CoursesFileError) as caught:
        parse_courses(data)
    assert says in caught.value.message


def test_seats_without_a_kernel_fraction_name_what_to_add() -> None:
    data = _lab()
    del data["courses"]["ml101"]["quota"]
    with pytest.raises(CoursesFileError, match="add kernel_fraction = 0.02"):
        parse_courses(data)


def test_overbooked_sessions_are_refused_naming_which_and_by_how_much() -> None:
    data = _lab(tz="Europe/Paris")
    data["courses"]["ds200"] = {
        "sessions": [
            {"days": ["tue"], "start": "11:00", "end": "12:00", "tz": "Europe/Paris", "share": 0.5}
        ]
    }
    courses = parse_courses(data)
    gpus = [GPU("g0", "a", "V100", 32768, 0)]
    with pytest.raises(CoursesFileError) as caught:
        check_sessions(courses, gpus)
    assert (
        "ml101 (Tue 10:00-11:30) and ds200 (Tue 11:00-12:00) reserve 1.3 GPU at once but their "
        "GPUs have 1: 0.3 GPU too much." in caught.value.message
    )
    check_sessions(courses, gpus * 1 + [GPU("g1", "a", "V100", 32768, 1)])  # two GPUs: fits
    # without a declared pool, shares of the pool are summed; seats cannot be checked
    check_sessions(courses, None)


def test_the_shipped_file_plans_no_session_but_shows_how() -> None:
    text = COURSES.read_text()
    assert "# [[courses.ml101.sessions]]" in text
    assert load_courses(str(COURSES)).session_plans() == []


@pytest.mark.slow  # two tiny processes stand in for the attempts' servers
async def test_a_retried_server_start_keeps_its_api_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hub_config's spawner starts a server again on another port when the first exits
    before it listens. Stopping the exited attempt polls it, and JupyterHub's
    ``LocalProcessSpawner.poll`` clears a gone process's state, the API token included:
    the retry must start with the token again, else its server answers every student's
    token 401. JupyterHub's start and stop are stood in for here (no processes): the first
    start exits at once, and the stop clears the state as that poll does."""
    from types import SimpleNamespace

    from jupyterhub.spawner import LocalProcessSpawner

    monkeypatch.setenv("GPU_LEASE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("GPU_LEASE_GPUS", "1x32768:V100")
    monkeypatch.setenv("GPU_LEASE_RUNTIME_DIR", "/tmp/gpu-lease-rt-test")
    path = ROOT / "hub_config" / "jupyterhub_config.py"
    ns: dict[str, Any] = {"get_config": lambda: __import__("traitlets").config.Config()}
    ns["__file__"] = str(path)
    exec(compile(path.read_text(), str(path), "exec"), ns)
    seen: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []

    async def start(self: Any) -> str:
        seen.append(self.api_token)
        proc = subprocess.Popen(["true"] if len(seen) == 1 else ["sleep", "60"])  # noqa: ASYNC220
        if len(seen) == 1:
            proc.wait()  # the first attempt's server exits before it listens
        procs.append(proc)
        self.proc, self.pid = proc, proc.pid
        return "http://127.0.0.1:1"

    async def stop(self: Any, now: bool = False) -> None:
        self.clear_state()  # what LocalProcessSpawner.poll does for a process that is gone

    monkeypatch.setattr(LocalProcessSpawner, "start", start)
    monkeypatch.setattr(LocalProcessSpawner, "stop", stop)
    ns["_listens_on"] = lambda pid, port: True
    spawner = ns["GracefulSpawner"](api_token="the-servers-token")
    spawner.user = SimpleNamespace(name="student17")
    try:
        assert await spawner.start() == "http://127.0.0.1:1"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert seen == ["the-servers-token", "the-servers-token"]
