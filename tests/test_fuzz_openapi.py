"""Fuzz REST API v1 from its own OpenAPI document (schemathesis) against a REAL broker.

The broker serves ``/api/v1/openapi.json``; schemathesis turns each operation into a
hypothesis strategy of requests, valid (``positive``) and schema-violating
(``negative``). An admin fuzzes first, then a student under a known quota. Every
answer must be a non-5xx that the document declares, with the declared content type
and body schema. Afterwards the pool is consistent (per GPU the allocated fraction is
at most 1 and equals the sum of its active leases), the student holds no more than the
quota allows, and neither the answers nor the broker's debug log contain a token.

Bounded and reproducible: ``derandomize=True`` (the same examples on every run, so CI
is stable), no example database, no shrinking, :data:`EXAMPLES` per operation and mode
(:data:`EXAMPLES_BEHIND_A_FRONT` in the ``[sqlite-fronts]`` variant).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import Broker  # noqa: E402
from .hostile import assert_capacity, secrets_of  # noqa: E402

pytestmark = pytest.mark.slow

#: examples per operation, per generation mode, per caller
EXAMPLES = 25
#: the same behind a front process (``[sqlite-fronts]``): the front relays each request to
#: the same validation and service (the decisions are :data:`EXAMPLES`' run's), so fewer
#: examples per operation show that every operation's answers pass through it intact
EXAMPLES_BEHIND_A_FRONT = 8
#: the student's quota while fuzzing (set by the admin between the two runs)
QUOTA = {"max_fraction": 0.3, "max_leases": 3, "max_lease_fraction": 0.25}
MAX_QUEUED = 10
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


def _short_polls(case: Any) -> Any:
    """Keep long-polls short: a fuzzed ``wait`` (``timeout``) of 300 s would only cost time.

    A valid ``mps_uid`` becomes this process's uid: one user runs as one Unix uid, while
    random uids would make the user's own MPS requests wait for each other (MPS serves one
    uid per GPU) and reserve GPUs, so that the lease an operation needs is not granted."""
    body = case.body
    wait = body.get("wait") if isinstance(body, dict) else None
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0.2:
        body["wait"] = 0.2
    query = case.query
    timeout = query.get("timeout") if isinstance(query, dict) else None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0.2:
        query["timeout"] = 0.2  # a node's orders long-poll, likewise
    uid = body.get("mps_uid") if isinstance(body, dict) else None
    if isinstance(uid, int) and not isinstance(uid, bool) and 0 <= uid < 2**32 - 1:
        body["mps_uid"] = os.getuid()
    return case


def fuzz(
    broker: Broker, schema: Any, user: str, seen: list[str], examples: int = EXAMPLES
) -> list[str]:
    """Every operation x both modes as ``user``; returns the failures (check messages).

    Operations on ``{lease_id}`` get a real lease of ``user`` (a made-up id only ever
    meets 404); half of the valid acquires leave out ``node``, ``gpu_uuids`` and
    ``group`` (made-up values of those are refused) so that leases are granted.
    """
    failures: list[str] = []
    with (
        httpx.Client(base_url=f"{broker.url}/api/v1", headers=broker.headers(user)) as c,
        requests.Session() as session,
    ):
        for result in schema.get_all_operations():
            operation = result.ok()
            kw: dict[str, Any] = {}
            if "{lease_id}" in operation.path:
                # requests the fuzz left waiting (large fractions) would reserve GPUs and
                # hold this one back: which are left depends on the generated examples
                for waiting in c.get("/queue").json()["queue"]:
                    c.delete(f"/leases/{waiting['id']}")
                # and the leases earlier operations were given, this setup's and those of
                # the acquires the fuzz made up (any kernel id): the quota counts them all
                for held in c.get("/leases").json()["leases"]:
                    c.delete(f"/leases/{held['id']}")
                r = c.post(
                    "/leases", json={"kernel_id": f"fuzz-{operation.label}", "fraction": 0.05}
                )
                assert r.status_code in (200, 201), r.text
                kw["path_parameters"] = {"lease_id": r.json()["id"]}
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                strategy = operation.as_strategy(generation_mode=mode, **kw)
                if operation.label == "POST /api/v1/leases" and mode == GenerationMode.POSITIVE:
                    strategy = strategy | strategy.map(_plain_acquire)
                strategy = strategy.map(_short_polls)
                where = f"{user} {operation.label} ({mode.value})"
                try:
                    _runner(
                        strategy,
                        session,
                        broker.url,
                        broker.headers(user),
                        where,
                        seen,
                        failures,
                        examples,
                    )()
                except BaseException as exc:
                    # an operation without parameters has no negative examples
                    if type(exc).__name__ != "Unsatisfiable":
                        raise
    return failures


def _plain_acquire(case: Any) -> Any:
    if isinstance(case.body, dict):
        for name in ("node", "gpu_uuids", "group"):
            case.body.pop(name, None)
    return case


def _runner(
    strategy: Any,
    session: Any,
    url: str,
    headers: dict[str, str],
    where: str,
    seen: list[str],
    failures: list[str],
    examples: int,
) -> Any:
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        response = case.call(base_url=url, session=session, headers=headers, timeout=20)
        seen.append(response.text)
        try:
            case.validate_response(response, checks=CHECKS)
        except BaseException as exc:  # schemathesis' FailureGroup
            failures.append(f"{where}: {exc}"[:3000])

    return run


@pytest.mark.timeout(360)  # 17 operations (the node routes added 4) on a loaded machine
@pytest.mark.broker_args(
    "--debug",
    "--gpus",
    "2x32768:V100",
    f"--GPULeaseBroker.max_queued_per_user={MAX_QUEUED}",
)
def test_fuzz_the_api_from_its_openapi_document(broker: Broker, broker_http_processes: int) -> None:
    schema = schemathesis.openapi.from_url(f"{broker.url}/api/v1/openapi.json")
    seen: list[str] = []
    examples = EXAMPLES_BEHIND_A_FRONT if broker_http_processes else EXAMPLES
    failures = fuzz(broker, schema, "admin", seen, examples)
    with httpx.Client(base_url=f"{broker.url}/api/v1", headers=broker.headers("admin")) as admin:
        # the admin's fuzzing may have filled the pool: start the student from an empty one
        for lease in admin.get("/leases", params={"all": "1"}).json()["leases"]:
            admin.delete(f"/leases/{lease['id']}")
        r = admin.put("/quotas/users/alice", json=QUOTA)
        assert r.status_code == 200, r.text
    failures += fuzz(broker, schema, "alice", seen, examples)
    assert not failures, "\n\n".join(failures[:10])

    pool = assert_capacity(broker)
    mine = [x for x in pool["leases"]["leases"] if x["user"] == "alice" and x["state"] == "active"]
    assert len(mine) <= QUOTA["max_leases"]
    assert sum(x["fraction"] for x in mine) <= QUOTA["max_fraction"] + 1e-9
    assert all(x["fraction"] <= QUOTA["max_lease_fraction"] + 1e-9 for x in mine)
    assert sum(q["user"] == "alice" for q in pool["queue"]["queue"]) <= MAX_QUEUED
    with httpx.Client(base_url=f"{broker.url}/api/v1", headers=broker.headers("alice")) as c:
        me = c.get("/quotas/me").json()
    assert me["leases"] == len(mine)
    assert abs(me["held_fraction"] - sum(x["fraction"] for x in mine)) < 1e-6

    # no token in any answer, nor in the broker's (debug) log
    broker.stop()
    log = broker.log_path.read_text(errors="replace")
    assert "/api/v1/leases" in log
    for token in secrets_of(broker):
        assert not any(token in text for text in seen), "an answer contains a token"
        assert token not in log, "the broker's log contains a token"


def test_the_fuzzing_is_deterministic() -> None:
    """The document loads cleanly and derandomize=True draws the same requests on every
    run, so a failure in CI reproduces on a laptop."""
    from provisioner.broker.web.routes import build_openapi

    schema = schemathesis.openapi.from_dict(build_openapi())
    assert not list(schema.iter_schema_warnings())
    operation = schema["/api/v1/leases"]["POST"]
    drawn: list[list[Any]] = [[], []]
    for n in range(2):
        strategy = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)

        @settings(max_examples=20, derandomize=True, database=None, deadline=None)
        @given(case=strategy)
        def draw(case: Any) -> None:
            drawn[n].append((case.body, case.headers))  # noqa: B023

        draw()
    assert drawn[0] == drawn[1] and len(drawn[0]) == 20
