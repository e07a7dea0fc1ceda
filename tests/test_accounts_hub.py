"""A hub with an account per student (``GPU_LEASE_SPAWNER=system-users``): who can read what.

One real JupyterHub (``python -m provisioner.devtools.demo`` as tests/test_hub.py starts
it: configurable-http-proxy, the broker as a hub-managed service, real servers and
ipykernel kernels) run as root with hub_config's system-users variant. The test makes
four Unix accounts (``useradd``, a random suffix, homes 0700, removed at the end): three
students, each with a server and a GPU kernel, and the broker's own account. Then it
checks, by uid in ``/proc`` and from inside student A's kernel, that every process runs
as its account and that A reads nothing of B's (home, runtime and temporary
directories, connection and state files, ``/proc/<B's kernel>/environ``) nor the hub's
or broker's secrets and databases; that A's token gets for B's lease exactly the
answer for a lease that does not exist; and that every file has the owner and mode
docs/reliability.md lists.

The students must be able to run the hub's Python: where they cannot run this one, the
hub runs on the virtual environment tests/accounts.py builds (``student_python``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pwd
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from provisioner.devtools.testing import load_example, write_private
from tests.accounts import (
    courses,
    ids,
    needs_root,
    passable_dir,
    status,
    student_python,
    useradd,
    userdel,
)
from tests.test_hub import Hub, running_hub

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(420)]

SPEC = "python3-gpu-0.02"


@dataclass
class Student:
    name: str
    account: pwd.struct_passwd
    kernel_id: str = ""
    kernel_pid: int = 0
    server_pid: int = 0
    lease_id: str = ""
    token: str = ""
    env: dict[str, str] = field(default_factory=dict)  # the kernel's environment

    @property
    def uid(self) -> int:
        return self.account.pw_uid


@dataclass
class Site:
    hub: Hub
    base: Path
    students: list[Student]
    broker: pwd.struct_passwd
    agent_tokens: Path
    agent_token: str

    @property
    def state(self) -> Path:
        return self.hub.state

    @property
    def runtime(self) -> Path:
        return Path(self.hub.info["runtime_dir"])


def _kernel(student: Student, server: psutil.Process) -> psutil.Process:
    for proc in server.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(student.kernel_id in arg for arg in proc.cmdline()):
                return proc
    raise AssertionError(f"no kernel process {student.kernel_id} below {student.name}'s server")


def _server(hub: Hub, user: str) -> psutil.Process:
    for proc in psutil.Process(hub.info["hub_pid"]).children():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("JUPYTERHUB_USER") == user:
                return proc
    raise AssertionError(f"no server process of {user}")


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    needs_root()
    suffix = secrets.token_hex(3)
    names = [f"gla{x}-{suffix}" for x in "abc"]
    broker_name = f"glbroker-{suffix}"
    made: list[str] = []
    with passable_dir("gpu-lease-accounts-") as base:
        try:
            students = []
            for name in names:
                students.append(Student(name, useradd(name)))
                made.append(name)
            broker = useradd(broker_name, system=True)
            made.append(broker_name)
            python = student_python(base, names[0])
            courses(base / "courses.toml", names)
            # the node agents' tokens file, as a site keeps it: the broker's account's alone
            agent_token = f"agent-{secrets.token_hex(16)}"
            agent_tokens = base / "agent-tokens.json"
            write_private(agent_tokens, json.dumps({agent_token: {"agent": True, "node": "n1"}}))
            os.chown(agent_tokens, broker.pw_uid, broker.pw_gid)
            env = {
                "GPU_LEASE_SPAWNER": "system-users",
                "GPU_LEASE_BROKER_USER": broker_name,
                "GPU_LEASE_COURSES": str(base / "courses.toml"),
                "GPU_LEASE_AGENT_TOKENS": str(agent_tokens),
            }
            write_private(base / "demo.log", "")  # it prints the operator token: root's alone
            with running_hub(base, env=env, python=python) as hub:
                s = Site(hub, base, students, broker, agent_tokens, agent_token)
                with concurrent.futures.ThreadPoolExecutor(3) as pool:
                    for done in [pool.submit(hub.spawn, x.name) for x in students]:
                        done.result()
                for x in students:
                    r = hub.start_kernel(x.name, SPEC)
                    assert r.status_code == 201, r.text
                    x.kernel_id = r.json()["id"]
                    x.token = hub.token(x.name)
                    (lease,) = hub.leases(x.name)
                    x.lease_id = lease["id"]
                    server = _server(hub, x.name)
                    x.server_pid = server.pid
                    kernel = _kernel(x, server)
                    x.kernel_pid = kernel.pid
                    x.env = kernel.environ()
                yield s
        finally:
            for name in made:
                userdel(name)


def run_code(site: Site, student: Student, code: str) -> str:
    import asyncio

    room = load_example("classroom").Classroom(site.hub.url, site.hub.admin)

    async def go() -> str:
        try:
            return str(await room.run_cell(student.name, student.token, student.kernel_id, code))
        finally:
            await room.aclose()

    return asyncio.run(go())


# -- tests ----------------------------------------------------------------------------------
def test_every_server_and_kernel_runs_as_its_account(site: Site) -> None:
    for x in site.students:
        assert ids(x.server_pid) == {x.uid}, x.name
        assert ids(x.kernel_pid) == {x.uid}, x.name
        # the site's usual umask for the student's files; the hub's own is 0077
        assert status(x.server_pid, "Umask") == ["0022"], x.name
        assert x.env["HOME"] == x.account.pw_dir
        assert "--allow-root" not in psutil.Process(x.server_pid).cmdline()
        out = run_code(site, x, "import os; print('uid', os.getuid(), os.geteuid())")
        assert out.split() == ["uid", str(x.uid), str(x.uid)], out
    brokers = [
        p
        for p in psutil.Process(site.hub.info["hub_pid"]).children()
        if "provisioner.broker.app" in p.cmdline()
    ]
    assert brokers and all(ids(p.pid) == {site.broker.pw_uid} for p in brokers)
    assert all(status(p.pid, "Umask") == ["0077"] for p in brokers)
    assert ids(site.hub.info["hub_pid"]) == {0}  # the hub: root, to become each student


PROBE = """
import json, os
found = {}
for label, path, how in json.loads(%r):
    try:
        os.listdir(path) if how == "list" else open(path, "rb").read(1)
        found[label] = "read"
    except Exception as exc:
        found[label] = type(exc).__name__
print("PROBE=" + json.dumps(found))
"""


def probe(site: Site, student: Student, targets: list[tuple[str, str, str]]) -> dict[str, str]:
    out = run_code(site, student, PROBE % json.dumps(targets))
    found = re.search(r"PROBE=(\{.*\})", out)
    assert found, out
    return dict(json.loads(found.group(1)))


def test_a_students_kernel_reads_nothing_of_anothers_nor_the_secrets(site: Site) -> None:
    a, b = site.students[:2]
    notes = Path(b.account.pw_dir) / "notes.txt"  # a file of b's, readable were home open
    notes.write_text("b's notes\n")
    notes.chmod(0o644)
    os.chown(notes, b.uid, b.account.pw_gid)
    b_runtime = site.runtime / str(b.uid)
    b_connection = b_runtime / f"kernel-{b.kernel_id}.json"
    b_state = Path(b.env["GPU_LEASE_STATE_FILE"])
    assert b_connection.exists() and b_state.exists() and b_state.parent == b_runtime
    state = site.state
    refused = [
        ("b's home", b.account.pw_dir, "list"),
        ("b's notes", str(notes), "read"),
        ("b's runtime dir", str(b_runtime), "list"),
        ("b's connection file", str(b_connection), "read"),
        ("b's %gpu state file", str(b_state), "read"),
        ("b's temporary dir", str(state / "tmp" / str(b.uid)), "list"),
        ("b's kernel's environ", f"/proc/{b.kernel_pid}/environ", "read"),
        ("b's server's environ", f"/proc/{b.server_pid}/environ", "read"),
    ]
    secret = [  # nobody's but root's or the broker's: refused to every student
        ("the state dir", str(state), "list"),
        ("the operator token", str(state / "admin-token"), "read"),
        ("the admin password", str(state / "admin-password"), "read"),
        ("the demo's info", str(state / "demo.json"), "read"),
        ("the hub's cookie secret", str(state / "jupyterhub_cookie_secret"), "read"),
        ("the hub's database", str(state / "jupyterhub.sqlite"), "read"),
        ("the broker's dir", str(state / "broker"), "list"),
        ("the broker's database", str(state / "broker" / "gpu-lease.sqlite"), "read"),
        ("the agents' tokens", str(site.agent_tokens), "read"),
        ("the demo's log", str(site.hub.log_path), "read"),
        ("the runtime root", str(site.runtime), "list"),
    ]
    refused += secret
    own = [  # controls: a's own files are readable, so the refusals above are real
        ("a's connection file", str(site.runtime / str(a.uid) / f"kernel-{a.kernel_id}.json")),
        ("a's %gpu state file", a.env["GPU_LEASE_STATE_FILE"]),
        ("a's kernel's environ", f"/proc/{a.kernel_pid}/environ"),
    ]
    found = probe(site, a, refused + [(label, path, "read") for label, path in own])
    assert {label: found[label] for label, _, _ in refused} == {
        label: "PermissionError" for label, _, _ in refused
    }, found
    assert {label: found[label] for label, _ in own} == {label: "read" for label, _ in own}
    for other in site.students[1:]:
        found = probe(site, other, secret)
        assert found == {label: "PermissionError" for label, _, _ in secret}, (other.name, found)


def test_a_token_gets_for_anothers_lease_what_it_gets_for_none(site: Site) -> None:
    a, b = site.students[:2]
    hub = site.hub
    ghost = "f" * len(b.lease_id)
    for method, path, body in (
        ("GET", "", None),
        ("POST", "/renew", {}),
        ("DELETE", "", None),
        ("POST", "/revoke", {"reason": "a's attempt"}),
    ):
        answers = []
        for lease_id in (b.lease_id, ghost):
            r = hub.req(method, f"{hub.broker}/api/v1/leases/{lease_id}{path}", a.token, json=body)
            answers.append((r.status_code, r.text.replace(lease_id, "LEASE")))
        assert answers[0] == answers[1], (method, path, answers)
        assert answers[0][0] in (403, 404), answers
    assert [x["id"] for x in hub.leases(b.name)] == [b.lease_id]  # b's lease untouched


def _owner_mode(path: Path) -> tuple[int, int]:
    """Owner and permission bits (jupyter_core adds the sticky bit to runtime dirs)."""
    st = path.lstat()
    return st.st_uid, stat.S_IMODE(st.st_mode) & 0o777


def test_files_have_the_owner_and_mode_reliability_md_lists(site: Site) -> None:
    state, broker = site.state, site.broker.pw_uid
    expected: dict[Path, tuple[int, int]] = {
        state: (0, 0o711),
        state / "admin-token": (0, 0o600),
        state / "admin-password": (0, 0o600),
        state / "demo.json": (0, 0o600),
        state / "jupyterhub.sqlite": (0, 0o600),
        state / "jupyterhub_cookie_secret": (0, 0o600),
        state / "broker": (broker, 0o700),
        state / "broker" / "gpu-lease.sqlite": (broker, 0o600),
        site.agent_tokens: (broker, 0o600),
        site.runtime: (0, 0o711),
        state / "tmp": (0, 0o711),
        state / "lab-settings": (0, 0o755),
    }
    for x in site.students:
        runtime = site.runtime / str(x.uid)
        expected[Path(x.account.pw_dir)] = (x.uid, 0o700)
        expected[runtime] = (x.uid, 0o700)
        expected[state / "tmp" / str(x.uid)] = (x.uid, 0o700)
        expected[runtime / f"kernel-{x.kernel_id}.json"] = (x.uid, 0o600)
        expected[Path(x.env["GPU_LEASE_STATE_FILE"])] = (x.uid, 0o600)
    actual = {path: _owner_mode(path) for path in expected}
    wrong = {
        str(p): (oct(actual[p][1]), actual[p][0]) for p in expected if actual[p] != expected[p]
    }
    assert not wrong, wrong
    for wal in (state / "broker").glob("gpu-lease.sqlite-*"):  # WAL and shm: the database's mode
        assert _owner_mode(wal) == (broker, 0o600), wal


def test_no_secret_reaches_a_kernel_a_connection_file_or_the_log(site: Site) -> None:
    a, b = site.students[:2]
    b_server_token = psutil.Process(b.server_pid).environ()["JUPYTERHUB_API_TOKEN"]
    secrets_ = [site.hub.admin, site.agent_token, b_server_token, b.token]
    for x in site.students:
        files = [site.runtime / str(x.uid) / f"kernel-{x.kernel_id}.json"]
        texts = [f.read_text() for f in files] + ["\0".join(f"{k}={v}" for k, v in x.env.items())]
        mine = {psutil.Process(x.server_pid).environ()["JUPYTERHUB_API_TOKEN"], x.token}
        leaked = [t[:6] for t in secrets_ if t not in mine and any(t in text for text in texts)]
        assert not leaked, (x.name, leaked)
    # the kernel holds its own user's token (the provisioner's GPU_LEASE_TOKEN is dropped)
    assert a.env.get("JUPYTERHUB_API_TOKEN") == psutil.Process(a.server_pid).environ().get(
        "JUPYTERHUB_API_TOKEN"
    )
    assert "GPU_LEASE_TOKEN" not in a.env
    # the log: the demo prints the operator token in its banner (by design); nowhere else
    log = site.hub.log_path.read_text(errors="replace")
    outside_banner = re.sub(r"=+ jupyter-gpu-lease demo =+.*?\n=+\n", "", log, flags=re.S)
    for token in (*secrets_, a.token):
        assert token not in outside_banner, token[:6]
