"""Table tests of provisioner.broker.web.validation (pure: no broker, no HTTP)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest

from provisioner.broker.web.validation import (
    parse_acquire,
    parse_duration,
    parse_flag,
    parse_json_body,
    parse_mps_uids,
    parse_quota,
    parse_renewal,
    parse_since,
)
from provisioner.errors import BodyTooLarge, InvalidRequest
from provisioner.model import Identity, Quota
from provisioner.wire import Renewal

ALICE = Identity("alice", frozenset({"ml101"}), admin=False)
NOW = 1_750_000_000.0


# -- parse_json_body ---------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"", {}),
        (b"  \n", {}),
        (b'{"a": 1}', {"a": 1}),
        ('{"k": "ядро"}'.encode(), {"k": "ядро"}),
        (b'{"f": 1e-9}', {"f": 1e-9}),
    ],
)
def test_json_body_ok(raw: bytes, expected: dict[str, Any]) -> None:
    assert parse_json_body(raw, 1024) == expected


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"{", "not valid JSON"),
        (b"{'a': 1}", "not valid JSON"),
        (b"[1, 2]", "JSON array"),
        (b'"text"', "JSON string"),
        (b"null", "JSON null"),
        (b"3", "JSON number"),
        (b'{"fraction": NaN}', "NaN"),
        (b'{"fraction": Infinity}', "Infinity"),
        (b'{"fraction": -Infinity}', "-Infinity"),
        (b'{"fraction": 1e999}', "finite"),
        (b'{"fraction": ' + b"9" * 5000 + b"}", "too large"),
        (b"[" * 100_000 + b"]" * 100_000, "deep"),
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"a": 1, "a": 2}', "twice"),
    ],
)
def test_json_body_refused(raw: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as info:
        parse_json_body(raw, 1_000_000)
    assert info.value.status == 400
    assert info.value.message.endswith(".")


def test_json_body_too_large() -> None:
    with pytest.raises(BodyTooLarge) as info:
        parse_json_body(b"{}" + b" " * 100, 64)
    assert info.value.status == 413
    assert "64 bytes" in info.value.message


# -- parse_acquire ------------------------------------------------------------------


def test_acquire_ok() -> None:
    ask, wait = parse_acquire(
        {
            "kernel_id": "k-1",
            "fraction": 0.02,
            "node": "gpu-a",
            "gpu_uuids": ["GPU-1", "GPU-2", "GPU-1"],
            "group": "ml101",
            "wait": 30,
        },
        ALICE,
    )
    assert ask.user == "alice" and ask.groups == {"ml101"} and not ask.admin
    assert ask.kernel_id == "k-1" and ask.fraction_ppm == 20_000
    assert ask.node == "gpu-a" and ask.group == "ml101"
    assert ask.gpu_uuids == ("GPU-1", "GPU-2")
    assert wait == 30.0


@pytest.mark.parametrize(
    "fraction, ppm",
    [(1, 1_000_000), (0.5, 500_000), (0.02, 20_000), (1e-6, 1), (0.3333333, 333_333)],
)
def test_acquire_fractions(fraction: float, ppm: int) -> None:
    ask, wait = parse_acquire({"kernel_id": "k", "fraction": fraction}, ALICE)
    assert ask.fraction_ppm == ppm and wait == 0.0


def test_acquire_unicode_kernel_id() -> None:
    ask, _ = parse_acquire({"kernel_id": "ядро-🚀", "fraction": 0.1}, ALICE)
    assert ask.kernel_id == "ядро-🚀"


def _acq(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"kernel_id": "k", "fraction": 0.02}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(
    "body, words",
    [
        (_acq(kernel_id=_DROP), "needs a 'kernel_id'"),
        (_acq(fraction=_DROP), "needs a 'fraction'"),
        (_acq(fraction="0.02"), "without quotes"),
        (_acq(fraction=True), "JSON boolean"),
        (_acq(fraction=None), "JSON null"),
        (_acq(fraction=[0.02]), "JSON array"),
        (_acq(fraction=-0.1), "greater than 0"),
        (_acq(fraction=0), "greater than 0"),
        (_acq(fraction=0.0), "greater than 0"),
        (_acq(fraction=1.5), "at most 1"),
        (_acq(fraction=10**400), "at most 1"),
        (_acq(fraction=-(10**400)), "greater than 0"),
        (_acq(fraction=1e-9), "smallest fraction"),
        (_acq(fraction=float("nan")), "finite"),
        (_acq(fraction=float("inf")), "finite"),
        (_acq(kernel_id=""), "must not be empty"),
        (_acq(kernel_id=12), "must be a string"),
        (_acq(kernel_id="k" * 10_000), "at most 255"),
        (_acq(kernel_id="a\nb"), "unprintable"),
        (_acq(kernel_id="a\x00b"), "unprintable"),
        (_acq(node=5), "'node' must be a string"),
        (_acq(group=""), "'group' must not be empty"),
        (_acq(gpu_uuids="GPU-1"), "list of GPU UUID"),
        (_acq(gpu_uuids=[1]), "must be a string"),
        (_acq(gpu_uuids=[f"GPU-{n}" for n in range(65)]), "at most 64"),
        (_acq(wait=-1), "between 0 and 300"),
        (_acq(wait=301), "between 0 and 300"),
        (_acq(wait="5"), "must be a number"),
        (_acq(wait=False), "must be a number"),
        (_acq(mps_uid=-1), "'mps_uid' must be"),
        (_acq(mps_uid=2**32 - 1), "'mps_uid' must be"),
        (_acq(mps_uid="1000"), "'mps_uid' must be"),
        (_acq(mps_uid=True), "'mps_uid' must be"),
        (_acq(user="bob"), "Unknown field"),
        (_acq(extra=1, more=2), "'extra', 'more'"),
    ],
)
def test_acquire_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(")) as info:
        parse_acquire(body, ALICE)
    assert info.value.status == 400
    assert info.value.message[0].isupper() or info.value.message[0] == "'"
    assert info.value.message.rstrip().endswith(".")


def test_unknown_fields_are_named() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_acquire(_acq(fractoin=0.1), ALICE)
    assert info.value.details["fields"] == ["fractoin"]
    assert "'fractoin'" in info.value.message and "kernel_id" in info.value.message


# -- parse_renewal ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, Renewal()),
        (
            {"pid": 1234, "execution_state": "Idle", "last_activity": NOW},
            Renewal(pid=1234, execution_state="idle", last_activity=NOW),
        ),
        ({"execution_state": "busy"}, Renewal(execution_state="busy")),
        (
            {"pid_ns": 4026531836, "cgroup": "/a/b", "proof": "ab" * 32},
            Renewal(pid_ns=4026531836, cgroup="/a/b", proof="ab" * 32),
        ),
    ],
)
def test_heartbeat_ok(body: dict[str, Any], expected: Renewal) -> None:
    assert parse_renewal(body) == expected
    assert parse_renewal(expected.to_json()) == expected  # the client's body, back


@pytest.mark.parametrize(
    "body, words",
    [
        ({"pid": 0}, "between 1"),
        ({"pid": -5}, "between 1"),
        ({"pid": True}, "whole number"),
        ({"pid": "12"}, "whole number"),
        ({"pid": 1.5}, "whole number"),
        ({"execution_state": "x" * 33}, "at most 32"),
        ({"execution_state": "not a state"}, "kernel state"),
        ({"execution_state": 3}, "must be a string"),
        ({"last_activity": "yesterday"}, "must be a number"),
        ({"last_activity": float("inf")}, "finite"),
        ({"kernel_id": "k"}, "Unknown field"),
    ],
)
def test_heartbeat_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_renewal(body)


# -- parse_quota ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, Quota()),
        ({"max_leases": 1}, Quota(max_leases=1)),
        ({"max_leases": 0}, Quota(max_leases=0)),
        ({"max_fraction": 0.5, "max_lease_fraction": 0.25}, Quota(500_000, None, 250_000)),
        ({"max_fraction": 2}, Quota(max_fraction_ppm=2_000_000)),
        ({"max_fraction": 0}, Quota(max_fraction_ppm=0)),
        ({"max_fraction": None, "priority": None}, Quota()),
        ({"priority": 5}, Quota(priority=5)),
        ({"priority": -3}, Quota(priority=-3)),
        (
            {"budget_fraction_hours": 10, "budget_window": "7d"},
            Quota(budget_fraction_hours=10.0, budget_window_s=7 * 86400),
        ),
        (
            {"budget_fraction_hours": 1.5, "budget_window": 3600},
            Quota(budget_fraction_hours=1.5, budget_window_s=3600),
        ),
        ({"budget_fraction_hours": 2}, Quota(budget_fraction_hours=2.0, budget_window_s=7 * 86400)),
    ],
)
def test_quota_ok(body: dict[str, Any], expected: Quota) -> None:
    assert parse_quota(body) == expected


@pytest.mark.parametrize(
    "body, words",
    [
        ({"max_leases": -1}, "between 0"),
        ({"max_leases": 1.5}, "whole number"),
        ({"max_leases": "3"}, "whole number"),
        ({"max_leases": True}, "whole number"),
        ({"max_lease_fraction": 0}, "greater than 0"),
        ({"max_lease_fraction": 1.5}, "at most 1"),
        ({"max_fraction": -0.5}, "greater than 0"),
        ({"max_fraction": "half"}, "must be a number"),
        ({"budget_fraction_hours": -1}, "between 0"),
        ({"budget_window": "7 days"}, "duration"),
        ({"budget_window": 0}, "between 1"),
        ({"budget_window": [7]}, "duration"),
        ({"priority": 10**6}, "between -1000 and 1000"),
        ({"max_gpus": 1}, "Unknown field"),
    ],
)
def test_quota_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_quota(body)


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("7d", 604800),
        ("12h", 43200),
        ("30m", 1800),
        ("45s", 45),
        ("2w", 1209600),
        ("1.5h", 5400),
        ("3600", 3600),
        (86400, 86400),
        (60.0, 60),
    ],
)
def test_duration(value: Any, seconds: int) -> None:
    assert parse_duration(value) == seconds


# -- parse_since / parse_flag -----------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, NOW - 7 * 86400),
        ("", NOW - 7 * 86400),
        ("7d", NOW - 7 * 86400),
        ("24h", NOW - 86400),
        ("30m", NOW - 1800),
        ("1700000000", 1_700_000_000.0),
        ("1700000000.5", 1_700_000_000.5),
        ("2024-09-01", datetime(2024, 9, 1, tzinfo=timezone.utc).timestamp()),
        ("2024-09-01T08:00:00Z", datetime(2024, 9, 1, 8, tzinfo=timezone.utc).timestamp()),
        (
            "2024-09-01T10:00:00+02:00",
            datetime(2024, 9, 1, 8, tzinfo=timezone.utc).timestamp(),
        ),
    ],
)
def test_since(value: str | None, expected: float) -> None:
    assert parse_since(value, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("value", ["last week", "nan", "inf", "-5", "2024-13-45", "7x"])
def test_since_refused(value: str) -> None:
    with pytest.raises(InvalidRequest, match="since"):
        parse_since(value, NOW)


@pytest.mark.parametrize(
    "value, expected",
    [(None, False), ("", True), ("1", True), ("true", True), ("0", False), ("no", False)],
)
def test_flag(value: str | None, expected: bool) -> None:
    assert parse_flag(value, "all") is expected


def test_flag_refused() -> None:
    with pytest.raises(InvalidRequest, match="'all'"):
        parse_flag("maybe", "all")


def test_messages_never_echo_huge_values() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_acquire(_acq(fraction=10**300), ALICE)
    assert len(info.value.message) < 300
    assert json.dumps(info.value.to_json())


# -- MPS uids -----------------------------------------------------------------


def test_acquire_carries_an_mps_kernels_uid_as_a_hint() -> None:
    ask, _ = parse_acquire(_acq(mps_uid=1001), ALICE)
    assert ask.mps_uid == 1001 and ask.user == ALICE.user
    assert parse_acquire(_acq(mps_uid=0), ALICE)[0].mps_uid == 0  # root is a uid too
    assert parse_acquire(_acq(), ALICE)[0].mps_uid is None
    assert parse_acquire(_acq(mps_uid=None), ALICE)[0].mps_uid is None


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, {}),
        ({"mps_uid": None}, {}),
        ({"mps_uid": {"GPU-1": 1000, "GPU-2": None}}, {"GPU-1": 1000, "GPU-2": None}),
    ],
)
def test_node_heartbeat_mps_uids(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert parse_mps_uids(body) == expected


@pytest.mark.parametrize(
    "body, words",
    [
        ({"mps_uid": [1000]}, "'mps_uid' must be a JSON object"),
        ({"mps_uid": {"GPU-1": -1}}, "'mps_uid' must be"),
        ({"mps_uid": {"GPU-1": "root"}}, "'mps_uid' must be"),
        ({"mps_uid": {"": 1}}, "must not be empty"),
        ({"mps_uid": {f"GPU-{n}": 1 for n in range(65)}}, "at most 64"),
    ],
)
def test_node_heartbeat_mps_uids_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_mps_uids(body)
