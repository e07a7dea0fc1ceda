"""The OpenAPI document of REST API v1: valid OpenAPI 3.0.3, complete, and in step with ROUTES.

Bodies are checked against the document's own schemas with jsonschema (the OAS 3.0
dialect from openapi-schema-validator, installed with openapi-spec-validator).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate

from provisioner._version import __version__
from provisioner.broker.web.openapi import documented_routes
from provisioner.broker.web.routes import PUBLIC_ROUTES, ROUTES, build_openapi
from provisioner.broker.web.validation import parse_node_heartbeat, parse_node_parking, parse_resume
from provisioner.errors import InvalidRequest
from provisioner.inventory import parse_gpu_spec
from provisioner.model import Lease, Quota
from provisioner.wire import PARK_STATES


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_openapi()


def schema_validator(doc: dict[str, Any], name: str) -> OAS30Validator:
    """A validator for ``#/components/schemas/NAME`` that resolves refs inside the document."""
    return OAS30Validator({**doc["components"]["schemas"][name], "components": doc["components"]})


@pytest.mark.parametrize("base_url", ["/", "/services/gpu-lease/", "https://hub.example.org/x/"])
def test_valid_openapi_3_0_3(base_url: str) -> None:
    doc = build_openapi(base_url)
    validate(doc)
    assert doc["openapi"] == "3.0.3"
    assert doc["servers"] == [{"url": base_url}]
    assert doc["info"]["version"] == __version__
    # paths are relative to the server URL
    assert all(path.startswith(("/api/v1/", "/metrics")) for path in doc["paths"])
    json.dumps(doc)  # serialisable as the handler sends it


def test_documented_routes_are_exactly_routes(doc: dict[str, Any]) -> None:
    assert len(set(ROUTES)) == len(ROUTES)
    assert documented_routes(doc) == set(ROUTES)


def test_every_design_endpoint_is_documented() -> None:
    design = {
        ("GET", "/api/v1/health"),
        ("GET", "/api/v1/openapi.json"),
        ("GET", "/metrics"),
        ("GET", "/api/v1/gpus"),
        ("POST", "/api/v1/leases"),
        ("GET", "/api/v1/leases"),
        ("GET", "/api/v1/leases/{lease_id}"),
        ("POST", "/api/v1/leases/{lease_id}/renew"),
        ("POST", "/api/v1/leases/{lease_id}/resume"),
        ("DELETE", "/api/v1/leases/{lease_id}"),
        ("GET", "/api/v1/queue"),
        ("GET", "/api/v1/usage"),
    } | {
        (m, p)
        for m in ("GET", "PUT", "DELETE")
        for p in (
            "/api/v1/quotas/default",
            "/api/v1/quotas/users/{name}",
            "/api/v1/quotas/groups/{name}",
        )
    }
    assert design <= set(ROUTES)


def test_security_everywhere_but_public(doc: dict[str, Any]) -> None:
    scheme = doc["components"]["securitySchemes"]["token"]
    assert (scheme["type"], scheme["in"], scheme["name"]) == ("apiKey", "header", "Authorization")
    assert "token <TOKEN>" in scheme["description"]
    assert doc["security"] == [{"token": []}]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            public = (method.upper(), path) in PUBLIC_ROUTES
            assert (op.get("security") == []) is public, (method, path)
            if not public:
                assert "401" in op["responses"], (method, path)
    assert ("GET", "/api/v1/health") in PUBLIC_ROUTES
    assert ("GET", "/metrics") not in PUBLIC_ROUTES  # unless --no-metrics-auth


def test_acquire_operation(doc: dict[str, Any]) -> None:
    op = doc["paths"]["/api/v1/leases"]["post"]
    assert set(op["responses"]) == {
        "200", "201", "202", "400", "401", "403", "409", "413", "422", "503"
    }  # fmt: skip
    body = doc["components"]["schemas"]["AcquireRequest"]
    assert body["additionalProperties"] is False
    assert body["required"] == ["kernel_id", "fraction"]
    params = {p["name"] for p in doc["paths"]["/api/v1/leases"]["get"]["parameters"]}
    assert params == {"user", "all", "history"}
    assert doc["paths"]["/api/v1/leases/{lease_id}"]["delete"]["responses"]["204"]
    assert "410" in doc["paths"]["/api/v1/leases/{lease_id}/renew"]["post"]["responses"]


@pytest.mark.parametrize(
    "body, ok",
    [
        ({"kernel_id": "k", "fraction": 0.02}, True),
        (
            {
                "kernel_id": "k",
                "fraction": 1,
                "node": "gpu-a",
                "gpu_uuids": ["GPU-1"],
                "group": "ml101",
                "wait": 300,
            },
            True,
        ),
        ({"kernel_id": "k", "fraction": 0}, False),
        ({"kernel_id": "k", "fraction": 1.01}, False),
        ({"kernel_id": "", "fraction": 0.5}, False),
        ({"kernel_id": "k" * 257, "fraction": 0.5}, False),
        ({"kernel_id": "k", "fraction": 0.5, "wait": 301}, False),
        ({"kernel_id": "k", "fraction": 0.5, "wait": -1}, False),
        ({"kernel_id": "k", "fraction": 0.5, "gpu_uuids": ["x"] * 65}, False),
        ({"kernel_id": "k", "fraction": 0.5, "user": "mallory"}, False),
        ({"fraction": 0.5}, False),
        ({"kernel_id": "k", "fraction": "0.5"}, False),
    ],
)
def test_acquire_request_schema(doc: dict[str, Any], body: dict[str, Any], ok: bool) -> None:
    assert schema_validator(doc, "AcquireRequest").is_valid(body) is ok


@pytest.mark.parametrize(
    "body, ok",
    [
        ({}, True),
        ({"pid": 1234, "execution_state": "idle", "last_activity": 1700000000.5}, True),
        ({"pid": 0}, False),
        ({"pid": 1.5}, False),
        ({"fraction": 1}, False),
    ],
)
def test_heartbeat_schema(doc: dict[str, Any], body: dict[str, Any], ok: bool) -> None:
    assert schema_validator(doc, "Heartbeat").is_valid(body) is ok


@pytest.mark.parametrize(
    "body, ok",
    [
        ({}, True),
        ({"usage": [], "checkpoint": True, "host_memory_available_mb": 64000}, True),
        (
            {
                "parking": [
                    {"lease_id": "L", "action": "park", "outcome": "done", "pids": [7], "mb": 9},
                    {"lease_id": "M", "action": "resume", "outcome": "waiting", "message": "GPU"},
                ]
            },
            True,
        ),
        ({"checkpoint": "yes"}, False),
        ({"host_memory_available_mb": -1}, False),
        ({"parking": [{"lease_id": "L", "action": "sleep", "outcome": "done"}]}, False),
        ({"parking": [{"lease_id": "L", "action": "park", "outcome": "maybe"}]}, False),
        ({"parking": [{"lease_id": "L", "action": "park"}]}, False),
        ({"parking": [{"lease_id": "L", "action": "park", "outcome": "done", "x": 1}]}, False),
    ],
)
def test_node_heartbeat_parking_schema(doc: dict[str, Any], body: dict[str, Any], ok: bool) -> None:
    """The parking fields of a node heartbeat as ``validation`` takes them."""
    assert schema_validator(doc, "NodeHeartbeat").is_valid(body) is ok
    try:
        parse_node_parking(body)
        parse_node_heartbeat(body)
    except InvalidRequest:
        assert not ok
    else:
        assert ok


@pytest.mark.parametrize(
    "body, ok",
    [({}, True), ({"wait": 0}, True), ({"wait": 30.5}, True), ({"wait": -1}, False)]
    + [({"wait": 301}, False), ({"wait": "5"}, False), ({"later": 1}, False)],
)
def test_resume_schema(doc: dict[str, Any], body: dict[str, Any], ok: bool) -> None:
    assert schema_validator(doc, "Resume").is_valid(body) is ok
    try:
        parse_resume(body)
    except InvalidRequest:
        assert not ok
    else:
        assert ok


def test_lease_states_and_resume_answers(doc: dict[str, Any]) -> None:
    """Every wire state (parked ones included) is documented, and a 202 of resume validates."""
    lease_states = doc["components"]["schemas"]["Lease"]["properties"]["state"]["enum"]
    assert set(PARK_STATES) <= set(lease_states)
    gpu = parse_gpu_spec("1x32768:V100")[0]
    lease = Lease(
        id="abc",
        user="alice",
        kernel_id="k1",
        gpu_uuid=gpu.uuid,
        fraction_ppm=500_000,
        memory_limit_mb=15872,
        state="active",
        created_at=1.0,
        renewed_at=1.0,
        expires_at=91.0,
        park="parked",
        parked_at=50.0,
    )
    body = {**lease.to_json(gpu), "resume": {"position": 2, "eta_seconds": None}}
    assert body["state"] == "parked"
    schema_validator(doc, "Lease").validate(body)
    answer = {"lease": body, "state": "parked", "position": 2, "eta_seconds": 40, "queue_length": 3}
    schema_validator(doc, "Resuming").validate(answer)
    assert not schema_validator(doc, "Resuming").is_valid({**answer, "state": "active"})
    order = {
        "lease_id": "abc",
        "action": "park",
        "pid": 42,
        "pid_ns": None,
        "gpu_uuid": gpu.uuid,
        "memory_mb": 16384,
    }
    beat = {"node": "n", "state": "up", "orders": [order]}
    schema_validator(doc, "NodeBeat").validate(beat)
    assert not schema_validator(doc, "NodeBeat").is_valid({**beat, "orders": [{"action": "x"}]})


@pytest.mark.parametrize(
    "body, ok",
    [
        ({}, True),
        ({"max_fraction": 0.5, "max_leases": 2, "budget_window": "7d"}, True),
        ({"max_fraction": None, "budget_window": None, "priority": None}, True),
        ({"budget_window": 604800, "budget_fraction_hours": 10, "priority": -1}, True),
        ({"max_lease_fraction": 0}, False),
        ({"budget_window": "soon"}, False),
        ({"max_leases": -1}, False),
        ({"max_gpus": 1}, False),
    ],
)
def test_quota_schema(doc: dict[str, Any], body: dict[str, Any], ok: bool) -> None:
    assert schema_validator(doc, "Quota").is_valid(body) is ok


def test_model_json_matches_schemas(doc: dict[str, Any]) -> None:
    """What model.py serialises is what the document promises."""
    gpu = parse_gpu_spec("1x32768:V100")[0]
    lease = Lease(
        id="abc",
        user="alice",
        kernel_id="k1",
        gpu_uuid=gpu.uuid,
        fraction_ppm=20_000,
        memory_limit_mb=143,
        state="active",
        created_at=1.0,
        renewed_at=1.0,
        expires_at=91.0,
    )
    schema_validator(doc, "Lease").validate(lease.to_json(gpu))
    schema_validator(doc, "Lease").validate(lease.to_json(None))
    schema_validator(doc, "LeaseList").validate({"leases": [lease.to_json(gpu)]})
    quota = Quota(max_fraction_ppm=500_000, max_leases=3, budget_window_s=604800)
    schema_validator(doc, "Quota").validate(quota.to_json())
    schema_validator(doc, "Quota").validate(Quota().to_json())
    schema_validator(doc, "QuotaRecord").validate({**quota.to_json(), "effective": quota.to_json()})
    row = {
        **gpu.to_json(),
        "index": 0,
        "allocated_fraction": 0.06,
        "allocated_mb": 1966,
        "capacity_fraction": 1.0,
        "leases": 3,
    }
    schema_validator(doc, "GPUList").validate({"gpus": [row]})
    schema_validator(doc, "Error").validate({"error": "quota_exceeded", "message": "Ask."})
    schema_validator(doc, "Queued").validate(
        {"queued": True, "id": "r1", "position": 2, "kernel_id": "k", "fraction": 0.5}
    )


def test_fresh_document_each_call() -> None:
    a = build_openapi()
    a["components"]["schemas"]["Lease"]["properties"].clear()
    assert build_openapi()["components"]["schemas"]["Lease"]["properties"]


@pytest.mark.parametrize("base_url", ["/", "/services/gpu-lease/"])
def test_each_path_matches_exactly_one_route_whatever_their_order(base_url: str) -> None:
    """``url_specs`` puts the routes kernels call first (tornado takes the first pattern
    that matches): that is safe only while no path matches two patterns."""
    import re

    from provisioner.broker.web.routes import HOT_PATHS, TABLE, url_specs

    specs = url_specs(base_url)
    assert [s.regex.pattern for s in specs[: len(HOT_PATHS)]] == [
        r.pattern(base_url) + "$" for r in TABLE if r.path in HOT_PATHS
    ]
    for route in TABLE:
        for value in ("me", "default", "users", "renew", "abc-123"):
            path = re.sub(r"\{[^}]+\}", value, base_url.rstrip("/") + route.path)
            for candidate in {path, path.rstrip("/") + "/"}:
                matching = [s for s in specs if s.regex.match(candidate)]
                assert len(matching) <= 1, (candidate, [s.regex.pattern for s in matching])
        sample = re.sub(r"\{[^}]+\}", "abc-123", base_url.rstrip("/") + route.path)
        assert [s.handler_class for s in specs if s.regex.match(sample)] == [route.handler]
