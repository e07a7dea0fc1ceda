"""Class sessions on a REAL broker: an instructor starts one, the reaper frees the share
from a non-member's idle kernel (revoked, its reason naming the course and the end; parked
where the node parks), the member who waited is granted at once; refusals for whoever is
not the course's instructor; extend, end; the timetable's reload keeps the last good file.

The tokens file (``tests/conftest.py``'s ``USERS``) puts alice and carol in ml101; the
courses file here makes carol its instructor. No clock is moved: sessions start now (by
hand), and the reaper runs every 0.2 s.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import wait_for

from .conftest import Broker
from .test_nodes import NodeBroker, gpus_of, register
from .test_parking_broker import beat, lease_of, metric

pytestmark = pytest.mark.slow

COURSES = """
[courses.ml101]
instructors = ["carol"]
members = ["alice"]
quota = { max_lease_fraction = 0.25, max_leases = 2 }
"""
FAST = ("--GPULeaseBroker.reap_interval=0.2",)


def courses_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "courses.toml"
    path.write_text(COURSES + extra)
    return path


@pytest.fixture
def sb(tmp_path: Path, broker_db_url: str) -> Iterator[Broker]:
    """A broker with one 32 GiB GPU, the courses file above and a fast reaper."""
    extra = ("--quotas-file", str(courses_file(tmp_path)), *FAST)
    with Broker(tmp_path, broker_db_url, extra).running() as b:
        yield b


def clock(when: float) -> str:
    return f"{dt.datetime.fromtimestamp(when, dt.UTC):%H:%M}"


async def test_a_session_start_frees_a_non_members_idle_kernel_and_grants_the_member(
    sb: Broker,
) -> None:
    async with (
        sb.client("bob") as bob,
        sb.client("alice") as alice,
        sb.client("carol") as carol,
        sb.client("u00") as u00,
        sb.client("admin") as admin,
    ):
        r = await bob.post("/leases", json={"kernel_id": "k1", "fraction": 1.0})
        assert r.status_code == 201, r.text
        bob_lease = r.json()["id"]
        r = await bob.post(f"/leases/{bob_lease}/renew", json={"execution_state": "idle"})
        assert r.status_code == 200, r.text
        r = await alice.post("/leases", json={"kernel_id": "k1", "fraction": 0.25})
        assert r.status_code == 202, r.text  # the GPU is bob's: alice waits

        until = time.time() + 1800
        start = {"until": until, "seats": 2}
        # who may not: a member who does not teach, a non-member; a course that is not there
        r = await alice.post("/sessions/ml101", json=start)
        assert r.status_code == 403, r.text
        assert r.json()["message"] == (
            "Only the instructors of ml101 (or a GPU lease admin) may start, extend or end "
            "its class sessions; ask carol."
        )
        assert (await bob.post("/sessions/ml101", json=start)).status_code == 403
        r = await carol.post("/sessions/cs999", json=start)
        assert r.status_code == 404 and "no course 'cs999'" in r.json()["message"]
        r = await carol.post("/sessions/ml101", json={"until": until})
        assert r.status_code == 400 and "'seats'" in r.json()["message"]

        r = await carol.post("/sessions/ml101", json={"until": until, "seats": 5})
        assert r.status_code == 409 and r.json()["message"] == (
            "ml101 (by hand) reserves 1.25 GPU at once but its GPUs have 1: 0.25 GPU too much. "
            "Ask for fewer seats or a smaller share."
        )
        started_at = time.monotonic()
        r = await carol.post("/sessions/ml101", json=start)
        assert r.status_code == 201, r.text
        session = r.json()
        assert (session["state"], session["source"], session["wanted"]) == ("on", "by hand", 0.5)

        # the next reaper pass revokes bob's idle kernel; alice's poll is granted
        r = await alice.post("/leases", json={"kernel_id": "k1", "fraction": 0.25, "wait": 10})
        assert r.status_code in (200, 201) and r.json()["state"] == "active", r.text
        waited = time.monotonic() - started_at
        assert waited < 5, f"alice was granted {waited:.1f} s after the start"
        # a member's lease says so (the JupyterLab board and %gpu read it)
        assert r.json()["session"] == f"GPU reserved for ml101 until {clock(until)}"
        gone = (await bob.get(f"/leases/{bob_lease}")).json()
        assert gone["state"] == "revoked"
        assert gone["reason"] == (
            f"the GPU was reserved for ml101's class session until {clock(until)}"
        )

        # a non-member fits beside the share; the next one is told why it waits
        r = await u00.post("/leases", json={"kernel_id": "k1", "fraction": 0.5})
        assert r.status_code == 201, r.text
        assert r.json()["session"] is None  # not a member
        r = await bob.post("/leases", json={"kernel_id": "k2", "fraction": 0.25})
        assert r.status_code == 202, r.text
        assert r.json()["reason"].startswith(
            f"Part of the GPUs you may use is reserved for ml101's class session until "
            f"{clock(until)}."
        )
        (entry,) = (await bob.get("/queue")).json()["queue"]  # what JupyterLab's board reads
        assert entry["session"] == (
            f"Part of the GPUs you may use is reserved for ml101's class session until "
            f"{clock(until)}."
        )
        listed = (await bob.get("/sessions")).json()["sessions"]
        assert [(s["course"], s["reserved"], s["used"], s["lent"]) for s in listed] == [
            ("ml101", 0.5, 0.25, 0.0)
        ]

        # the metrics while it runs: reserved, used, lent; promtool's lint where it is
        text = (await admin.get(f"{sb.url}/metrics")).text
        assert 'gpu_lease_session_reserved_fraction{course="ml101"} 0.5' in text
        assert 'gpu_lease_session_used_fraction{course="ml101"} 0.25' in text
        assert 'gpu_lease_session_lent_fraction{course="ml101"} 0.0' in text
        if shutil.which("promtool"):
            lint = ["promtool", "check", "metrics"]
            done = await asyncio.to_thread(
                subprocess.run, lint, input=text, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stdout + done.stderr

        # a second start is refused; extend moves the end; end returns the share
        assert (await carol.post("/sessions/ml101", json=start)).status_code == 409
        r = await carol.patch("/sessions/ml101", json={"until": until + 600})
        assert r.status_code == 200 and r.json()["end"] == until + 600
        assert (await bob.patch("/sessions/ml101", json={"until": until})).status_code == 403
        r = await carol.delete("/sessions/ml101")
        assert r.status_code == 200, r.text
        r = await bob.post("/leases", json={"kernel_id": "k2", "fraction": 0.25, "wait": 10})
        assert r.status_code in (200, 201), r.text  # the share is everyone's again
        assert (await bob.get("/sessions")).json()["sessions"] == []
        assert (await carol.delete("/sessions/ml101")).status_code == 409
        text = (await admin.get(f"{sb.url}/metrics")).text
    assert 'gpu_lease_session_freed_kernels_total{course="ml101"} 1.0' in text


def test_a_bad_timetable_is_refused_at_start_and_a_running_broker_keeps_the_last_good(
    tmp_path: Path, broker_db_url: str
) -> None:
    today = dt.datetime.now(dt.UTC)
    lab = (
        '\n[[courses.ml101.sessions]]\ndays = ["{day}"]\nstart = "{start}"\nend = "{end}"\n'
        "seats = {seats}\n"
    )
    soon = (today + dt.timedelta(minutes=2)).strftime("%H:%M")
    later = (today + dt.timedelta(minutes=40)).strftime("%H:%M")
    day = today.strftime("%a").lower()
    bad = tmp_path / "bad.toml"
    bad.write_text(COURSES + lab.format(day=day, start=soon, end=later, seats=5))
    b = Broker(tmp_path, broker_db_url, ("--quotas-file", str(bad)))
    with pytest.raises(RuntimeError, match="exited with 2") as info:
        b.start()
    assert "reserves 1.25 GPU at once but its GPUs have 1: 0.25 GPU too much" in str(info.value)

    path = courses_file(tmp_path, lab.format(day=day, start=soon, end=later, seats=2))
    broker = Broker(tmp_path, broker_db_url, ("--quotas-file", str(path), *FAST))
    with (
        broker.running() as sb,
        httpx.Client(base_url=f"{sb.url}/api/v1", headers=sb.headers("bob")) as bob,
    ):

        def planned() -> list[tuple[str, str, float]]:
            got = bob.get("/sessions").json()["sessions"]
            return [(s["state"], s["label"], s["wanted"]) for s in got]

        label = f"{day.capitalize()} {soon}-{later}"
        assert planned() == [("lead", label, 0.5)]  # 2 min ahead: in its lead time
        path.write_text(COURSES + lab.format(day=day, start=soon, end=later, seats=9))
        wait_for(
            lambda: "Kept the last good courses file" in sb.log(limit=10**7),
            10,
            what="the reload's refusal",
        )
        assert planned() == [("lead", label, 0.5)]
        path.write_text(COURSES)
        wait_for(lambda: planned() == [], 10, what="the reload of a good file")


@pytest.fixture
def nb(tmp_path: Path, broker_db_url: str) -> Iterator[NodeBroker]:
    """A broker whose pool is one agent's node that parks kernels."""
    extra = ("--gpus", "agents", "--quotas-file", str(courses_file(tmp_path)), *FAST)
    b = NodeBroker(tmp_path, broker_db_url, extra)
    with b.running(timeout=60):
        yield b


def test_a_session_start_parks_a_non_members_idle_kernel_where_the_node_parks(
    nb: NodeBroker,
) -> None:
    with nb.http("agent:gpu-a") as agent, nb.http("bob") as bob, nb.http("carol") as carol:
        assert register(agent, "gpu-a", gpus_of("gpu-a", 1, 16384)).status_code == 200
        beat(agent, checkpoint=True, host_memory_available_mb=100_000)
        r = bob.post("/leases", json={"kernel_id": "k1", "fraction": 1.0})
        assert r.status_code == 201, r.text
        lease = r.json()["id"]
        r = bob.post(f"/leases/{lease}/renew", json={"pid": 4242, "execution_state": "idle"})
        assert r.status_code == 200, r.text
        r = carol.post("/sessions/ml101", json={"until": time.time() + 3600, "share": 0.5})
        assert r.status_code == 201, r.text
        wait_for(
            lambda: lease_of(bob, lease)["state"] == "parking",
            10,
            what="bob's idle kernel to be parked for ml101's session",
            detail=nb.log,
        )
        orders = beat(agent, checkpoint=True, host_memory_available_mb=100_000)["orders"]
        assert [(o["lease_id"], o["action"]) for o in orders] == [(lease, "park")]
        with nb.http("carol") as member:  # carol is in ml101 (she teaches it)
            r = member.post("/leases", json={"kernel_id": "k1", "fraction": 0.25})
            assert r.status_code == 202, r.text  # until the checkpoint is done
            done = {"lease_id": lease, "action": "park", "outcome": "done", "mb": 900}
            beat(agent, checkpoint=True, host_memory_available_mb=100_000, parking=[done])
            r = member.post("/leases", json={"kernel_id": "k1", "fraction": 0.25, "wait": 10})
            assert r.status_code in (200, 201), r.text
        assert lease_of(bob, lease)["state"] == "parked"
    assert metric(nb, 'gpu_lease_session_freed_kernels_total{course="ml101"}') == 1.0


# -- gpu-lease session ----------------------------------------------------------------------


def test_the_cli_runs_a_session_for_its_instructor_and_refuses_anyone_else(
    sb: Broker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from .test_cli_admin import run

    def cli(user: str, *argv: str) -> tuple[int, str, str]:
        return run(sb, user, list(argv), capsys, monkeypatch)

    monkeypatch.setenv("TZ", "UTC")
    code, out, err = cli("bob", "session", "start", "ml101", "--until", "90m", "--seats", "2")
    assert (code, out) == (1, "")
    assert err == (
        "error: Only the instructors of ml101 (or a GPU lease admin) may start, extend or "
        "end its class sessions; ask carol.\n"
    )
    code, _, err = cli("alice", "session", "end", "ml101")
    assert code == 1 and "Only the instructors of ml101" in err
    code, _, err = cli("carol", "session", "start", "ml101", "--until", "90m")
    assert code == 1 and "Say what to reserve: --seats N" in err
    code, out, err = cli("carol", "session", "start", "ml101", "--until", "90m", "--seats", "2")
    assert (code, err) == (0, "")
    assert out.startswith("Started ml101's class session until ")
    assert out.rstrip().endswith("(UTC): 0.5 GPU reserved for its members, 0.5 GPU now.")
    code, out, _ = cli("bob", "session", "list")
    assert code == 0 and out.splitlines()[0] == "Class sessions:"
    row = out.splitlines()[2].split()
    assert row[:2] == ["ml101", "by"] and row[-6:] == ["on", "0.5", "GPU", "0.5", "0", "0"]
    code, out, _ = cli("admin", "top")
    assert code == 0 and "Class sessions:" in out and "ml101" in out
    code, out, _ = cli("carol", "session", "extend", "ml101", "--until", "2h")
    assert code == 0 and out.startswith("Extended ml101's class session until ")
    code, out, _ = cli("carol", "session", "end", "ml101")
    assert (code, out) == (0, "Ended ml101's class session; its GPU share is everyone's again.\n")
    code, _, err = cli("carol", "session", "end", "ml101")
    assert code == 1 and "ml101 has no class session now" in err


# -- the dashboard ----------------------------------------------------------------------------


def test_the_dashboard_shows_the_timetable_and_the_share(
    chromium: Any, sb: Broker, tmp_path: Path
) -> None:
    from .test_dashboard import open_dashboard

    with httpx.Client(base_url=f"{sb.url}/api/v1", headers=sb.headers("carol")) as carol:
        r = carol.post("/sessions/ml101", json={"until": time.time() + 3600, "seats": 2})
        assert r.status_code == 201, r.text
        r = carol.post("/leases", json={"kernel_id": "k1", "fraction": 0.25})
        assert r.status_code == 201, r.text
    context, page, problems = open_dashboard(chromium, sb, "admin")
    page.wait_for_selector("#sessions table")
    text = page.inner_text("#sessions")
    assert "ml101" in text and "under way" in text and "by hand" in text
    assert "0.50 GPU" in text and "0.25 GPU" in text  # reserved; used by members
    page.screenshot(path=str(tmp_path / "sessions.png"), full_page=True)
    assert problems == []
    context.close()


# -- what a member and a non-member see in JupyterLab (the server extension) -------------------


@pytest.mark.timeout(240)
def test_a_members_and_a_non_members_outlook_name_the_session(sb: Broker, tmp_path: Path) -> None:
    """``GET .../kernelspecs/{name}/outlook`` (the banner of a notebook opened without
    starting its GPU kernel) on alice's server (ml101) and bob's, while ml101's session
    is under way."""
    from provisioner.devtools.labserver import JupyterServerProcess, install_kernelspecs

    until = time.time() + 1800
    with httpx.Client(base_url=f"{sb.url}/api/v1", headers=sb.headers("carol")) as carol:
        r = carol.post("/sessions/ml101", json={"until": until, "seats": 2})
        assert r.status_code == 201, r.text
    (spec,) = install_kernelspecs(tmp_path / "prefix", [0.25])
    said = {}
    for user in ("alice", "bob"):
        server = JupyterServerProcess(
            tmp_path / user, sb.url, sb.tokens[user], kernels_prefix=tmp_path / "prefix"
        )
        try:
            server.start()
            r = server.http.get(f"/gpu-lease/api/kernelspecs/{spec}/outlook")
            assert r.status_code == 200, r.text
            said[user] = r.json()["session"]
        finally:
            server.stop()
    assert said == {
        "alice": f"GPU reserved for ml101 until {clock(until)}",
        "bob": f"Part of the GPUs is reserved for ml101's class session until {clock(until)}",
    }
