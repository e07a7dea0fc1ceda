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
        lease("bob", "99887766-5544", 0.25, created_at=NOW - 30),
    ]
    queue = [
        {"position": 1, "user": "carol", "kernel_id": "feedface-0000", "fraction": 0.75,
         "group": "ml101", "waiting_s": 75.0},
    ]  # fmt: skip
    text = tables.format_top([GPU0, GPU1], leases, queue, NOW, width=10)
    assert text.splitlines() == [
        "GPU 0 V100  [#####.....] 50% allocated  16384/32768 MiB  2 leases",
        "  USER   KERNEL    FRACTION  MEMORY    IDLE  AGE    LEASE",
        "  alice  0a1b2c3d  0.25      7680 MiB  busy  1h01m  lease-alic",
        "  bob    99887766  0.25      7680 MiB  42s   30s    lease-bob-",
        "",
        "GPU 1 V100 (node gpu-b)  [..........] 0% allocated  0/32768 MiB  0 leases",
        "",
        "Queue: 1 waiting",
        "  POS  USER   KERNEL    FRACTION  GROUP  WAITING",
        "  1    carol  feedface  0.75      ml101  1m15s",
    ]


def test_format_top_empty_pool_and_lost_gpu() -> None:
    assert tables.format_top([], [], [], NOW) == "No GPUs in the pool.\n\nQueue: empty"
    text = tables.format_top([], [lease("alice", "k", 0.5)], [], NOW)
    assert text.startswith("GPU GPU-0 (not in the pool)\n  USER")


def test_format_leases_names_gpus() -> None:
    assert tables.format_leases([], NOW) == "No active leases."
    text = tables.format_leases([lease("alice", "k1", 0.02)], NOW, [GPU0])
    assert text.splitlines()[1].split()[-3:] == ["GPU", "0", "V100"]
    assert tables.format_leases([lease("alice", "k1", 0.02)], NOW).endswith("V100")


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
    code, out, err = cli("admin", "quota", "show", "--user", "bob")
    assert code == 1 and err == "error: No user quota is set for 'bob'.\n"
    code, out, _ = cli("admin", "quota", "set", "--default", "--max-leases", "4")
    assert code == 0 and out.startswith("Set default quota:")


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
