"""``gpu-lease quota show --user NAME`` says exactly what the broker enforces (hypothesis).

For random quota settings at the three levels (default, two courses, the user) and a
user in a random set of courses, the effective values the command prints are the ones a
real broker subprocess (static tokens) enforces: the user acquires kernels of 0.02 until
refused, and one kernel just above the per-kernel limit. The command's own parsing is
the printed text, as an admin reads it; the broker is asked only through its REST API.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provisioner.cli import main
from provisioner.devtools.testing import BrokerProcess

pytestmark = pytest.mark.slow

COURSES = ("cs50", "ml101")
#: one user per set of courses: the membership is drawn by picking the user
MEMBERS = {
    f"m-{'-'.join(combo) or 'none'}": list(combo)
    for n in range(len(COURSES) + 1)
    for combo in itertools.combinations(COURSES, n)
}
FIELDS = ("max_fraction", "max_leases", "max_lease_fraction")
LABELS = {"max_fraction": "max fraction", "max_leases": "max leases",
          "max_lease_fraction": "max lease fraction"}  # fmt: skip
STEP = 0.02  # each probing kernel; 0.02 of an 80 GiB GPU is well above the context overhead
MOST = 6  # kernels probed at most when nothing limits them


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    users: dict[str, tuple[list[str], bool]] = {n: (g, False) for n, g in MEMBERS.items()}
    users["admin"] = ([], True)
    b = BrokerProcess(tmp_path, f"sqlite:///{tmp_path / 'b.sqlite'}", users, gpus="1x81920:H100")
    with b.running():
        yield b


quota_value = {
    "max_fraction": st.one_of(st.none(), st.sampled_from([0.0, 0.02, 0.04, 0.06, 0.1, 1.0])),
    "max_leases": st.one_of(st.none(), st.integers(0, 4)),
    "max_lease_fraction": st.one_of(st.none(), st.sampled_from([0.01, 0.02, 0.05, 0.25])),
}
level = st.fixed_dictionaries({f: quota_value[f] for f in FIELDS})
settings_st = st.fixed_dictionaries(
    {
        "default": level,
        "groups": st.fixed_dictionaries({c: st.one_of(st.none(), level) for c in COURSES}),
        "user": st.one_of(st.none(), level),
        "who": st.sampled_from(sorted(MEMBERS)),
    }
)


def shown_effective(text: str) -> dict[str, tuple[float | None, str]]:
    """``quota show --user``'s effective block: field -> (value or None, source)."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("effective (default"))
    out: dict[str, tuple[float | None, str]] = {}
    for line in lines[start + 1 :]:
        for field, label in LABELS.items():
            if line.startswith(f"  {label.ljust(20)}"):
                rest = line[22:]
                value = rest.split()[0]
                out[field] = (None if value == "-" else float(value), rest[len(value) :].strip())
    return out


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=settings_st)
def test_quota_show_is_what_the_broker_enforces(
    broker: BrokerProcess,
    case: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = {"Authorization": f"token {broker.tokens['admin']}"}
    who = case["who"]
    mine = {"Authorization": f"token {broker.tokens[who]}"}
    with httpx.Client(base_url=f"{broker.url}/api/v1", timeout=30) as http:
        put = http.put("/quotas/default", json=case["default"], headers=admin)
        assert put.status_code == 200, put.text
        for course, quota in case["groups"].items():
            if quota is None:
                http.delete(f"/quotas/groups/{course}", headers=admin)
            else:
                assert http.put(f"/quotas/groups/{course}", json=quota, headers=admin).is_success
        if case["user"] is None:
            http.delete(f"/quotas/users/{who}", headers=admin)
        else:
            assert http.put(f"/quotas/users/{who}", json=case["user"], headers=admin).is_success

        monkeypatch.setenv("GPU_LEASE_URL", broker.url)
        monkeypatch.setenv("GPU_LEASE_TOKEN", broker.tokens["admin"])
        capsys.readouterr()
        assert main(["quota", "show", "--user", who]) == 0
        shown = shown_effective(capsys.readouterr().out)
        assert set(shown) == set(FIELDS), shown

        # each value's source holds that very value
        for field, (value, source) in shown.items():
            if source == "user":
                origin = case["user"]
            elif source.startswith("group "):
                origin = case["groups"][source.removeprefix("group ")]
                assert source.removeprefix("group ") in MEMBERS[who]
            else:
                assert source == "default", source
                origin = case["default"]
            assert origin is not None and origin[field] == value, (field, source, case)

        # what the broker enforces: kernels of STEP until refused ...
        limit_f, limit_n, per_kernel = (shown[f][0] for f in FIELDS)
        expect = MOST
        if limit_n is not None:
            expect = min(expect, int(limit_n))
        if limit_f is not None:
            expect = min(expect, int(round(limit_f / STEP, 6)))
        if per_kernel is not None and per_kernel < STEP:
            expect = 0
        granted: list[str] = []
        refused: dict[str, Any] | None = None
        for _ in range(MOST):
            r = http.post(
                "/leases",
                json={"kernel_id": str(uuid.uuid4()), "fraction": STEP, "wait": 0},
                headers=mine,
            )
            if r.status_code == 201:
                granted.append(r.json()["id"])
                continue
            assert r.status_code == 403, r.text
            refused = r.json()
            break
        try:
            assert len(granted) == expect, (shown, case, refused)
            if expect < MOST:
                assert refused is not None and refused["error"] == "quota_exceeded"
        finally:
            for lease_id in granted:
                http.delete(f"/leases/{lease_id}", headers=mine)

        # ... and one kernel just above the per-kernel limit is refused for that reason
        if per_kernel is not None and per_kernel < 1 and limit_n != 0 and limit_f != 0:
            above = round(per_kernel + 0.01, 6)
            r = http.post(
                "/leases",
                json={"kernel_id": str(uuid.uuid4()), "fraction": above, "wait": 0},
                headers=mine,
            )
            if r.status_code == 201:
                http.delete(f"/leases/{r.json()['id']}", headers=mine)
            assert r.status_code == 403 and r.json()["quota"] == "max_lease_fraction", r.text
