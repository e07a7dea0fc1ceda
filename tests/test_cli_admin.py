"""``gpu-lease top|leases|quota|usage|revoke``: pure views as tables, the CLI against a real broker.

The views (:mod:`provisioner.tables`) are tested with dicts shaped like the API's
answers and a fixed ``now``; the commands run in-process (``main([...])``) against
the ``broker`` fixture's subprocess, with ``GPU_LEASE_URL``/``GPU_LEASE_TOKEN`` set.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from provisioner import tables
from provisioner.cli import main

from .conftest import Broker

NOW = 1_700_000_000.0
#: the CLI does not care which database the broker uses: SQLite only (test_broker_api covers both)
sqlite_only = pytest.mark.parametrize("broker_db_url", ["sqlite"], indirect=True)


# -- pure views -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, width, text",
    [
        (0.0, 10, "[..........]"),
        (0.5, 10, "[#####.....]"),
        (1.0, 4, "[####]"),
        (1.7, 4, "[####]"),
        (-1, 4, "[....]"),
        (0.02, 20, "[....................]"),
        (0.06, 20, "[#...................]"),
    ],
)
def test_bar(value: float, width: int, text: str) -> None:
    assert tables.bar(value, width) == text


@pytest.mark.parametrize(
    "fn, value, text",
    [
        (tables.percent, 0.5, "50%"),
        (tables.percent, 0.125, "12.5%"),
        (tables.percent, 1.0, "100%"),
        (tables.percent, 0.0001, "0.01%"),
        (tables.fraction, 0.02, "0.02"),
        (tables.fraction, 1.0, "1"),
        (tables.fraction, None, "-"),
        (tables.fraction, 0.0, "0"),
        (tables.duration, 0, "0s"),
        (tables.duration, 59.9, "59s"),
        (tables.duration, 307, "5m07s"),
        (tables.duration, 3 * 3600 + 300, "3h05m"),
        (tables.duration, 2 * 86400 + 4 * 3600, "2d04h"),
        (tables.duration, -5, "0s"),
        (tables.duration, None, "-"),
        (tables.window, 604800, "7d"),
        (tables.window, 5400, "90m"),
        (tables.window, 7200, "2h"),
        (tables.window, 61, "61s"),
        (tables.window, None, "-"),
    ],
)
def test_cells(fn: Any, value: Any, text: str) -> None:
    assert fn(value) == text


@pytest.mark.parametrize(
    "lease, text",
    [
        ({"execution_state": "busy", "last_activity": NOW - 100}, "busy"),
        ({"execution_state": "idle", "last_activity": NOW - 125}, "2m05s"),
        ({"execution_state": None, "last_activity": None}, "-"),
        ({}, "-"),
    ],
)
def test_idle(lease: dict[str, Any], text: str) -> None:
    assert tables.idle(lease, NOW) == text


def test_table_pads_columns_without_trailing_spaces() -> None:
    text = tables.table(("A", "LONG HEADER", "C"), [["xyz", "1", ""], ["q", "22", "end"]], "  ")
    assert text.splitlines() == [
        "  A    LONG HEADER  C",
        "  xyz  1",
        "  q    22           end",
    ]


GPU0 = {
    "uuid": "GPU-0",
    "node": "local",
    "name": "V100",
    "memory_mb": 32768,
    "index": 0,
    "allocated_fraction": 0.5,
    "allocated_mb": 16384,
    "leases": 2,
}
GPU1 = {**GPU0, "uuid": "GPU-1", "node": "gpu-b", "index": 1, "allocated_fraction": 0.0}
GPU1.update(allocated_mb=0, leases=0)


def lease(user: str, kernel: str, fraction: float, **kw: Any) -> dict[str, Any]:
    return {
        "id": f"lease-{user}-{kernel}",
        "user": user,
        "kernel_id": kernel,
        "fraction": fraction,
        "gpu": {"uuid": "GPU-0", "node": "local", "name": "V100", "memory_mb": 32768},
        "memory_limit_mb": int(32768 * fraction) - 512,
        "created_at": NOW - 3700,
        "execution_state": "idle",
        "last_activity": NOW - 42,
        **kw,
    }


def test_format_top() -> None:
    leases = [
        lease("alice", "0a1b2c3d-4e5f", 0.25, execution_state="busy"),
        lease(
            "bob",
            "99887766-5544",
            0.25,
            created_at=NOW - 30,
            used_mb=900,
            enforcement="agent-revoke",
            mps="running",
        ),
    ]
    queue = [
        {"position": 1, "user": "carol", "kernel_id": "feedface-0000", "fraction": 0.75,
         "group": "ml101", "waiting_s": 75.0},
    ]  # fmt: skip
    text = tables.format_top([GPU0, GPU1], leases, queue, NOW, width=10)
    assert text.splitlines() == [
        "GPU 0 V100  [#####.....] 50% allocated  16384/32768 MiB  2 leases",
        "  USER   KERNEL    FRACTION  MEMORY        ENFORCED          IDLE  AGE    LEASE",
        "  alice  0a1b2c3d  0.25      7680 MiB      cooperative       busy  1h01m  lease-alic",
        "  bob    99887766  0.25      900/7680 MiB  agent-revoke+mps  42s   30s    lease-bob-",
        "",
        "GPU 1 V100 (node gpu-b)  [..........] 0% allocated  0/32768 MiB  0 leases",
        "",
        "Queue: 1 waiting",
        "  POS  USER   KERNEL    FRACTION  GROUP  WAITING",
        "  1    carol  feedface  0.75      ml101  1m15s",
    ]


def test_format_top_says_whose_uid_a_gpus_mps_server_serves() -> None:
    """MPS serves one Unix user per GPU at a time: top names the uid it serves now."""
    text = tables.format_top([{**GPU0, "mps_uid": 1001}, {**GPU1, "mps_uid": None}], [], [], NOW)
    first, second = (line for line in text.splitlines() if line.startswith("GPU"))
    assert first.endswith("2 leases  MPS serves uid 1001"), first
    assert "MPS" not in second


def test_format_top_empty_pool_and_lost_gpu() -> None:
    assert tables.format_top([], [], [], NOW) == "No GPUs in the pool.\n\nQueue: empty"
    text = tables.format_top([], [lease("alice", "k", 0.5)], [], NOW)
    assert text.startswith("GPU GPU-0 (not in the pool)\n  USER")


def test_format_leases_names_gpus() -> None:
    assert tables.format_leases([], NOW) == "No active leases."
    text = tables.format_leases([lease("alice", "k1", 0.02)], NOW, [GPU0])
    assert text.splitlines()[1].split()[-3:] == ["GPU", "0", "V100"]
    assert tables.format_leases([lease("alice", "k1", 0.02)], NOW).endswith("V100")


def test_parked_leases_say_so_in_top_and_leases() -> None:
    """A parked lease shows its state, and its place while its resume waits."""
    leases = [
        lease("alice", "k1", 0.25, state="parked", parked_at=NOW - 60),
        lease("bob", "k2", 0.25, state="parked", resume={"position": 2, "eta_seconds": 40}),
        lease("carol", "k3", 0.25, state="resuming"),
        lease("dave", "k4", 0.25, state="active"),
    ]
    rows = tables.format_leases(leases, NOW).splitlines()[1:]
    assert [r.split("  ")[0] for r in rows] == ["alice", "bob", "carol", "dave"]
    assert "parked " in rows[0] and "parked, 2nd to resume" in rows[1]
    assert "resuming" in rows[2] and " 42s " in rows[3]
    top = tables.format_top([GPU0], leases, [], NOW)
    assert "parked, 2nd to resume" in top
    assert [tables.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"
    ]  # fmt: skip


def test_format_quotas() -> None:
    book = {
        "default": {"max_fraction": 1.0, "max_leases": None, "max_lease_fraction": None,
                    "budget_fraction_hours": None, "budget_window": None, "priority": None},
        "groups": {"ml101": {"max_fraction": 0.5, "budget_fraction_hours": 10.0,
                             "budget_window": 604800, "priority": 5}},
        "users": {"alice": {"max_leases": 2}},
    }  # fmt: skip
    lines = tables.format_quota_list(book).splitlines()
    assert lines[0].split()[:4] == ["LEVEL", "NAME", "MAX", "FRACTION"]
    assert lines[1].split() == ["default", "-", "1", "-", "-", "-", "-", "-"]
    assert lines[2].split() == ["group", "ml101", "0.5", "-", "-", "10", "7d", "5"]
    assert lines[3].split() == ["user", "alice", "-", "2", "-", "-", "-", "-"]
    me = {"user": "alice", "effective": book["groups"]["ml101"], "held_fraction": 0.25, "leases": 1}
    text = tables.format_my_quota(me)
    assert text.startswith("Effective quota of alice:\n  max fraction        0.5\n")
    assert text.endswith("holding now: 0.25 of a GPU in 1 lease(s)")
    rec = tables.format_quota(
        "Quota of user alice:", {"max_leases": 2, "effective": {"max_leases": 2}}
    )
    assert "effective (default -> groups -> user):" in rec


def test_usage_views() -> None:
    usage = {"bob": 0.5, "alice": 2.25, "carol": 0.5, "": 0.125}
    assert tables.usage_csv(usage, "group") == (
        "group,fraction_hours\nalice,2.250000\nbob,0.500000\ncarol,0.500000\n,0.125000\n"
    )
    assert tables.usage_csv({'a,"b"': 1}) == 'user,fraction_hours\n"a,""b""",1.000000\n'
    assert tables.format_usage(usage, "group").splitlines() == [
        "GROUP       FRACTION-HOURS",
        "alice       2.250",
        "bob         0.500",
        "carol       0.500",
        "(no group)  0.125",
        "TOTAL       3.375",
    ]
    assert tables.format_usage({}, "user") == "No GPU use recorded by any user in this period."


# -- the CLI against a real broker -----------------------------------------------------------
def run(
    broker: Broker,
    user: str | None,
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[int, str, str]:
    monkeypatch.setenv("GPU_LEASE_URL", broker.url)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    if user is None:
        monkeypatch.delenv("GPU_LEASE_TOKEN", raising=False)
    else:
        monkeypatch.setenv("GPU_LEASE_TOKEN", broker.tokens[user])
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def acquire(broker: Broker, user: str, kernel_id: str, fraction: float, wait: float = 0) -> Any:
    r = httpx.post(
        f"{broker.url}/api/v1/leases",
        json={"kernel_id": kernel_id, "fraction": fraction, "wait": wait},
        headers=broker.headers(user),
        timeout=10,
    )
    assert r.status_code in (201, 202), r.text
    return r.json()


@pytest.fixture
def cli(broker: Broker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    def call(user: str | None, *argv: str) -> tuple[int, str, str]:
        return run(broker, user, list(argv), capsys, monkeypatch)

    return call


@pytest.mark.slow
@sqlite_only
def test_top_admin_and_student(broker: Broker, cli: Any) -> None:
    acquire(broker, "alice", "aaaaaaaa-1111", 0.25)
    acquire(broker, "bob", "bbbbbbbb-2222", 0.25)
    acquire(broker, "carol", "cccccccc-3333", 0.75)  # does not fit: waits
    code, out, err = cli("admin", "top")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "GPU 0 V100  [##########..........] 50% allocated  16384/32768 MiB  2 leases"
    assert [x.split()[:4] for x in lines[2:4]] == [
        ["alice", "aaaaaaaa", "0.25", "7680"],
        ["bob", "bbbbbbbb", "0.25", "7680"],
    ]
    assert "Queue: 1 waiting" in lines
    assert lines[-1].split()[:5] == ["1", "carol", "cccccccc", "0.75", "-"]
    # a student sees the pool, their own leases and their own queue place
    code, out, _ = cli("alice", "top")
    assert code == 0 and "50% allocated" in out
    assert "alice" in out and "bob" not in out and "carol" not in out
    assert out.rstrip().endswith("Queue: empty")


@pytest.mark.slow
@sqlite_only
def test_leases(broker: Broker, cli: Any) -> None:
    mine = acquire(broker, "alice", "k-alice", 0.02)
    acquire(broker, "bob", "k-bob", 0.5)
    code, out, _ = cli("alice", "leases")
    assert code == 0 and "k-alice" in out and "bob" not in out and "GPU 0 V100" in out
    code, out, _ = cli("admin", "leases", "--all", "--json")
    assert code == 0
    import json

    assert sorted(x["user"] for x in json.loads(out)["leases"]) == ["alice", "bob"]
    code, out, _ = cli("admin", "leases", "--user", "alice")
    assert code == 0 and mine["id"][:10] in out and "bob" not in out
    code, out, err = cli("alice", "leases", "--all")
    assert (code, out) == (1, "")
    assert err.startswith("error: Only GPU lease admins may list other users' leases.")
    code, out, _ = cli("carol", "leases")
    assert (code, out.strip()) == (0, "No active leases.")


@pytest.mark.slow
@sqlite_only
def test_quota_set_show_list_remove(cli: Any) -> None:
    code, out, err = cli(
        "admin", "quota", "set", "--group", "ml101", "--max-fraction", "0.5",
        "--budget-fraction-hours", "10", "--budget-window", "7d", "--priority", "5",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.splitlines()[:2] == ["Set quota of group ml101:", "  max fraction        0.5"]
    # set changes only what it is given
    code, out, _ = cli("admin", "quota", "set", "--group", "ml101", "--max-leases", "3")
    assert code == 0 and "  priority            5" in out and "  max leases          3" in out
    code, out, _ = cli("admin", "quota", "set", "--user", "bob", "--max-lease-fraction", "0.1")
    assert code == 0
    code, out, _ = cli("admin", "quota", "list")
    rows = [x.split() for x in out.splitlines()]
    assert ["group", "ml101", "0.5", "3", "-", "10", "7d", "5"] in rows
    assert ["user", "bob", "-", "-", "0.1", "-", "-", "-"] in rows
    # alice (in ml101) sees her effective quota; bob his own record
    code, out, _ = cli("alice", "quota", "show")
    assert code == 0 and out.startswith("Effective quota of alice:\n  max fraction        0.5")
    code, out, _ = cli("bob", "quota", "show", "--user", "bob")
    assert code == 0 and out.startswith("Quota of user bob:") and "effective" in out
    code, out, err = cli("alice", "quota", "list")
    assert code == 1 and err.startswith("error: Only GPU lease admins")
    code, out, _ = cli("admin", "quota", "remove", "--user", "bob")
    assert (code, out.strip()) == (0, "Removed the quota of user bob.")
    # `quota show --user` of someone without a user quota failed ("No user quota
    # is set"); it shows the effective quota as the broker applies it, with its sources
    code, out, err = cli("admin", "quota", "show", "--user", "bob")
    assert (code, err) == (0, ""), err
    assert out.startswith("Quota of user bob: none set"), out
    assert "  max leases          -  default\n" in out, out
    code, out, _ = cli("admin", "quota", "set", "--default", "--max-leases", "4")
    assert code == 0 and out.startswith("Set default quota:")


@pytest.mark.slow
@sqlite_only
@pytest.mark.parametrize(
    "argv, message",
    [
        (["quota", "set", "--max-leases", "1"], "Say whose quota to set"),
        (["quota", "remove"], "Say whose quota to remove"),
        (["quota", "set", "--user", "bob"], "Give at least one limit to set"),
        (["quota", "show", "--max-leases", "2"], "Quota limits are given only with"),
    ],
)
def test_quota_usage_errors(cli: Any, argv: list[str], message: str) -> None:
    code, out, err = cli("admin", *argv)
    assert (code, out) == (1, "")
    assert err.startswith(f"error: {message}")


@pytest.mark.slow
@sqlite_only
def test_usage_and_csv(broker: Broker, cli: Any) -> None:
    lease = acquire(broker, "alice", "k1", 0.5)
    httpx.delete(f"{broker.url}/api/v1/leases/{lease['id']}", headers=broker.headers("alice"))
    code, out, _ = cli("admin", "usage", "--since", "1h")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["USER", "FRACTION-HOURS"]
    assert lines[1].split()[0] == "alice" and lines[-1].split()[0] == "TOTAL"
    code, out, _ = cli("admin", "usage", "--csv", "--since", "2020-01-01T00:00:00Z")
    assert code == 0 and out.splitlines()[0] == "user,fraction_hours"
    assert out.splitlines()[1].startswith("alice,")
    code, out, _ = cli("admin", "usage", "--by", "group", "--csv", "--since", "0")
    assert code == 0 and out.splitlines()[0] == "group,fraction_hours"
    code, out, err = cli("admin", "usage", "--since", "last tuesday")
    assert code == 1 and err.startswith("error: 'since' must be an ISO 8601 date")


@pytest.mark.slow
@sqlite_only
def test_revoke(broker: Broker, cli: Any) -> None:
    lease = acquire(broker, "alice", "k-revoke-me", 0.25)
    code, out, err = cli("alice", "revoke", lease["id"], "--reason", "mine")
    assert code == 1 and err.startswith("error: Only GPU lease admins")
    code, out, err = cli("admin", "revoke", lease["id"], "--reason", "exam starts at 9")
    assert (code, err) == (0, "")
    assert out.strip() == (
        f"Revoked lease {lease['id']} of alice (kernel k-revoke, 0.25 of a GPU): exam starts at 9"
    )
    r = httpx.post(
        f"{broker.url}/api/v1/leases/{lease['id']}/renew", json={}, headers=broker.headers("alice")
    )
    assert r.status_code == 410 and "exam starts at 9" in r.json()["message"]
    code, out, err = cli("admin", "revoke", lease["id"], "--reason", "again")
    assert code == 1 and err.startswith("error: ")
    code, out, err = cli("admin", "revoke", "no-such-lease", "--reason", "x")
    assert code == 1 and err.startswith("error: ")
    r = httpx.post(
        f"{broker.url}/api/v1/leases/{lease['id']}/revoke", json={}, headers=broker.headers("admin")
    )
    assert r.status_code == 400 and "reason" in r.json()["message"]


def test_lease_ids_never_begin_with_a_dash() -> None:
    """A lease id is a CLI argument (``revoke ID``); one in 64 random ids began with ``-``,
    which argparse read as an option (test_revoke failed in CI that way)."""
    from provisioner.broker.services.broker_service import new_id

    ids = [new_id() for _ in range(20_000)]  # about 310 would begin with "-" by chance
    assert len(set(ids)) == len(ids) and all(len(x) == 22 for x in ids)
    assert not [x for x in ids if x.startswith("-")]
    assert any(x.startswith("_") for x in ids)  # the other 63 first characters still occur


@pytest.mark.slow
@sqlite_only
def test_errors_without_url_or_token(
    broker: Broker, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = cli(None, "leases")
    assert code == 1 and err.startswith("error: This endpoint needs a token")
    monkeypatch.setenv("GPU_LEASE_URL", "")
    code = main(["top"])
    assert code == 1
    code = main(["top", "--url", broker.url.replace(str(broker.port), "1")])
    assert code == 1


def test_no_url_message(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPU_LEASE_URL", raising=False)
    assert main(["leases"]) == 1
    assert capsys.readouterr().err.startswith("error: No GPU lease broker URL is set")


# -- what top/leases print works in revoke; leases as admin; closed pipes ---------------
@pytest.mark.slow
@pytest.mark.parametrize("broker_db_url", ["sqlite"], indirect=True)
@pytest.mark.broker_args("--gpus", "2x81920:H100")
def test_revoke_takes_the_ids_top_and_leases_print(broker: Broker, cli: Any) -> None:
    # 65 leases: two ids share their first character (64 possible), so a 1-character
    # prefix is ambiguous for at least one of them
    leases = [acquire(broker, f"u{i % 40:02d}", f"k{i}", 0.02) for i in range(65)]
    code, out, _ = cli("admin", "leases", "--all")
    assert code == 0
    shown = [line.split()[8] for line in out.splitlines()[1:]]  # MEMORY is "1126 MiB"
    assert len(shown) == 65 and all(len(x) == 10 for x in shown)
    target = leases[0]
    assert target["id"][:10] in shown
    code, out, err = cli("admin", "revoke", target["id"][:10], "--reason", "maintenance at 18:00")
    assert (code, err) == (0, ""), err
    assert out.startswith(f"Revoked lease {target['id']} of u00"), out
    by_first: dict[str, list[str]] = {}
    for x in leases[1:]:
        by_first.setdefault(x["id"][0], []).append(x["id"])
    first, ids = next((k, v) for k, v in by_first.items() if len(v) > 1)
    code, out, err = cli("admin", "revoke", first, "--reason", "x")
    assert (code, out) == (1, "")
    assert err.startswith(f"error: {len(ids)} active leases have ids starting with {first!r}"), err
    assert "give more characters" in err
    # a full id still works; an unknown prefix gets the broker's sentence
    code, out, _ = cli("admin", "revoke", ids[0], "--reason", "x")
    assert code == 0 and ids[0] in out
    code, out, err = cli("admin", "revoke", "no-such-lease", "--reason", "x")
    assert code == 1 and "no-such-lease" in err


@pytest.mark.slow
@sqlite_only
def test_leases_tells_an_admin_how_to_see_everyones(broker: Broker, cli: Any) -> None:
    for i in range(3):
        acquire(broker, "alice", f"k{i}", 0.02)
    code, out, _ = cli("admin", "leases")
    assert code == 0
    assert out.strip() == (
        "You hold no active leases; 3 other active leases: `gpu-lease leases --all` lists "
        "them (`--user NAME` one user's)."
    )
    code, out, _ = cli("bob", "leases")  # not an admin: nothing to hint at
    assert (code, out.strip()) == (0, "No active leases.")


@pytest.mark.slow
@sqlite_only
@pytest.mark.parametrize("argv", [["usage", "--since", "1h"], ["leases", "--all"], ["top"]])
def test_a_closed_pipe_ends_quietly(broker: Broker, argv: list[str]) -> None:
    """`gpu-lease usage | head`: the reader is gone before we write; no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    lease = acquire(broker, "alice", "k-pipe", 0.25)
    httpx.delete(f"{broker.url}/api/v1/leases/{lease['id']}", headers=broker.headers("alice"))
    acquire(broker, "bob", "k-held", 0.25)
    read, write = os.pipe()
    os.close(read)  # like `head` having exited: every write gets EPIPE
    env = dict(os.environ, GPU_LEASE_URL=broker.url, GPU_LEASE_TOKEN=broker.tokens["admin"])
    script = Path(sys.executable).parent / "gpu-lease"
    try:
        done = subprocess.run(
            [str(script), *argv], stdout=write, stderr=subprocess.PIPE, env=env, timeout=60
        )
    finally:
        os.close(write)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err == "", err


@pytest.mark.slow
@sqlite_only
def test_quota_show_user_names_each_values_source(broker: Broker, cli: Any) -> None:
    """`quota set --user student05`, then "effective" must not ignore the course."""
    assert cli("admin", "quota", "set", "--default", "--max-leases", "1")[0] == 0
    assert cli("admin", "quota", "set", "--group", "ml101", "--max-leases", "2",
               "--max-fraction", "0.1", "--priority", "10")[0] == 0  # fmt: skip
    assert cli("admin", "quota", "set", "--user", "alice", "--max-lease-fraction", "0.05")[0] == 0
    code, out, err = cli("admin", "quota", "show", "--user", "alice")
    assert (code, err) == (0, ""), err
    lines = out.splitlines()
    assert lines[0] == "Quota of user alice:"
    assert (
        "effective (default -> groups -> user), as the broker applies it to alice in groups "
        "ml101 (from the tokens file):"
    ) in lines
    effective = {
        " ".join(x.split()[:-2]) if x.split()[-2] == "group" else " ".join(x.split()[:-1]): x
        for x in lines[lines.index("Quota of user alice:") + 8 :]
        if x.startswith("  ") and not x.startswith("  (")
    }
    assert effective["max fraction 0.1"].endswith("group ml101")
    assert effective["max leases 2"].endswith("group ml101")
    assert effective["max lease fraction 0.05"].endswith("user")
    assert effective["priority 10"].endswith("group ml101")
    assert effective["budget f-h -"].endswith("default")
    # and the broker enforces exactly that: two kernels (the course's), not one (the default)
    acquire(broker, "alice", "k1", 0.05)
    acquire(broker, "alice", "k2", 0.05)
    r = httpx.post(
        f"{broker.url}/api/v1/leases",
        json={"kernel_id": "k3", "fraction": 0.02, "wait": 0},
        headers=broker.headers("alice"),
    )
    assert r.status_code == 403 and r.json()["quota"] == "max_leases", r.text
    # a student may read their own; not someone else's
    code, out, _ = cli("alice", "quota", "show", "--user", "alice")
    assert code == 0 and "in groups ml101 (from your token):" in out
    code, _, err = cli("alice", "quota", "show", "--user", "bob")
    assert code == 1 and err == "error: You may read only your own quota.\n"


@pytest.mark.slow
@sqlite_only
def test_kernelspec_install_checks_the_fraction_with_the_broker(
    broker: Broker, cli: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With GPU_LEASE_URL set (as in a hub server's terminal) a kernel that never fits is refused."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user-data"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter-path"))
    prefix = str(tmp_path / "p")
    code, out, err = cli("alice", "kernelspec", "install", "--fraction", "0.01", "--prefix", prefix)
    assert (code, out) == (1, "")
    assert err == (
        "error: Not installed: a GPU fraction of 0.01 gives at most 327 MiB on the pool's "
        "largest GPU (V100, 32768 MiB), not more than the 512 MiB every CUDA process needs "
        "for its context; the smallest fraction that works there is 0.015656. The broker "
        "would refuse every start of this kernel; choose a larger --fraction.\n"
    )
    assert not (tmp_path / "p").exists()
    code, out, err = cli("alice", "kernelspec", "install", "--fraction", "0.02", "--prefix", prefix)
    assert (code, err) == (0, "") and out.startswith("Installed kernelspec python3-gpu-0.02")
    # a broker that cannot be asked: install, with the warning that says so
    code, out, err = cli(
        "alice", "kernelspec", "install", "--fraction", "0.01", "--prefix", prefix,
        "--url", "http://127.0.0.1:1",
    )  # fmt: skip
    assert code == 0 and "the broker could not be asked" in err
