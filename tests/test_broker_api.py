"""REST API v1 of a REAL broker subprocess, over HTTP (see ``conftest.broker``).

Every test runs on SQLite and on PostgreSQL (``postgres`` mark). Nothing of ours is
mocked: the GPU pool is a static declaration (a real feature of the broker).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from provisioner.devtools.testing import free_port

from .conftest import Broker

pytestmark = pytest.mark.slow

V100_MB = 32768


async def acquire(c: httpx.AsyncClient, kernel_id: str, fraction: Any, **kw: Any) -> httpx.Response:
    return await c.post("/leases", json={"kernel_id": kernel_id, "fraction": fraction, **kw})


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) >= {"error", "message"}, body
    assert isinstance(body["message"], str) and body["message"].rstrip().endswith("."), body
    assert "Traceback" not in r.text and "<html" not in r.text.lower()
    if code is not None:
        assert body["error"] == code, body
    return body


async def snapshot(b: Broker) -> tuple[Any, Any, Any]:
    """GPUs, every active lease and the queue, as the admin sees them."""
    async with b.client("admin") as c:
        gpus = (await c.get("/gpus")).json()
        leases = (await c.get("/leases", params={"all": "1"})).json()
        queue = (await c.get("/queue")).json()
    return gpus, leases, queue


def db_query(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    url = sa.make_url(db_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg2")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


# -- basics ---------------------------------------------------------------------------


async def test_health_gpus_and_public_endpoints(broker: Broker) -> None:
    async with broker.client() as anon:
        r = await anon.get("/health")
        assert r.status_code == 200
        assert r.headers["cache-control"] == "no-store"
        health = r.json()
        assert health["status"] == "ok" and health["gpus"] == 1 and health["active_leases"] == 0
        assert (await anon.get("/openapi.json")).json()["openapi"].startswith("3.")
        assert_error(await anon.get("/gpus"), 401, "not_authenticated")
        assert_error(await anon.get("/nope"), 404, "not_found")
    async with httpx.AsyncClient(event_hooks=broker.conformance.hooks()) as raw:
        # /metrics names users and lease ids: an admin's token (or a metrics token) only
        assert_error(await raw.get(f"{broker.url}/metrics"), 401, "not_authenticated")
        refused = await raw.get(f"{broker.url}/metrics", headers=broker.headers("alice"))
        assert_error(refused, 403, "forbidden")
        assert "read:metrics" in refused.json()["message"]
        metrics = await raw.get(f"{broker.url}/metrics", headers=broker.headers("admin"))
        assert metrics.status_code == 200 and "gpu_lease_" in metrics.text
        index = await raw.get(f"{broker.url}/")
        assert index.json()["api"] == "/api/v1/"
    async with broker.client("alice") as c:
        gpus = (await c.get("/gpus")).json()["gpus"]
        assert len(gpus) == 1
        gpu = gpus[0]
        assert gpu["name"] == "V100" and gpu["memory_mb"] == V100_MB
        assert gpu["allocated_fraction"] == 0 and gpu["leases"] == 0
        assert set(gpu) >= {"uuid", "node", "name", "memory_mb", "allocated_fraction", "leases"}
        body = assert_error(await c.patch("/gpus"), 405, "method_not_allowed")
        assert "PATCH" in body["message"]


async def test_every_documented_route_is_served(broker: Broker) -> None:
    from provisioner.broker.web.routes import PUBLIC_ROUTES, ROUTES

    async with httpx.AsyncClient(
        base_url=broker.url, headers=broker.headers("admin"), event_hooks=broker.conformance.hooks()
    ) as c:
        for method, template in ROUTES:
            path = template.replace("{lease_id}", "no-such-lease").replace("{name}", "alice")
            body = {} if method in ("POST", "PUT") else None
            r = await c.request(method, path, json=body)
            assert r.status_code != 405, (method, path, r.text)
            assert "no such endpoint" not in r.text, (method, path)
            assert r.status_code < 500, (method, path, r.text)
    async with httpx.AsyncClient(
        base_url=broker.url, event_hooks=broker.conformance.hooks()
    ) as anon:
        for method, path in PUBLIC_ROUTES:
            assert (await anon.request(method, path)).status_code == 200, path


async def test_acquire_then_repeat_returns_same_lease(broker: Broker) -> None:
    async with broker.client("alice") as c:
        r1 = await acquire(c, "k1", 0.02)
        assert r1.status_code == 201, r1.text
        lease = r1.json()
        assert r1.headers["location"].endswith(f"/api/v1/leases/{lease['id']}")
        assert lease["user"] == "alice" and lease["kernel_id"] == "k1"
        assert lease["fraction"] == 0.02 and lease["state"] == "active"
        assert lease["gpu"]["name"] == "V100" and lease["gpu"]["memory_mb"] == V100_MB
        assert lease["memory_limit_mb"] == V100_MB * 2 // 100 - 512
        assert lease["expires_at"] > lease["created_at"]
        r2 = await acquire(c, "k1", 0.02)
        assert r2.status_code == 200 and r2.json()["id"] == lease["id"]
        # another fraction for the same kernel is a conflict, not a second lease
        assert_error(await acquire(c, "k1", 0.05), 409, "conflict")
        assert (await c.get(f"/leases/{lease['id']}")).json()["id"] == lease["id"]
        listed = (await c.get("/leases")).json()["leases"]
        assert [x["id"] for x in listed] == [lease["id"]]
        # unicode kernel ids are fine
        r3 = await acquire(c, "ядро-🚀", 0.02)
        assert r3.status_code == 201 and r3.json()["kernel_id"] == "ядро-🚀"
    gpus, _, _ = await snapshot(broker)
    assert gpus["gpus"][0]["allocated_fraction"] == pytest.approx(0.04)
    assert gpus["gpus"][0]["leases"] == 2


async def test_a_queued_answer_never_puts_you_behind_the_queues_end(broker: Broker) -> None:
    """``position`` and ``queue_length`` of a 202 describe the same instant, also while
    other students join and leave the queue (position <= length, always)."""
    async with broker.client("alice") as alice:
        assert (await acquire(alice, "all", 1.0)).status_code == 201
    users = [f"u{n:02d}" for n in range(30)]

    async def join_and_leave(user: str) -> list[tuple[int, int]]:
        seen = []
        async with broker.client(user) as c:
            for round_ in range(4):
                r = await acquire(c, f"{user}-{round_}", 0.5)
                assert r.status_code == 202, r.text
                body = r.json()
                seen.append((body["position"], body["queue_length"]))
                assert f"position {body['position']} of {body['queue_length']}" in body["message"]
                assert (await c.delete(f"/leases/{body['id']}")).status_code == 204
        return seen

    answers = [
        x for per_user in await asyncio.gather(*map(join_and_leave, users)) for x in per_user
    ]
    assert len(answers) == 4 * len(users)
    behind = [(p, n) for p, n in answers if not 1 <= p <= n]
    assert not behind, f"positions behind the queue's end: {behind[:5]}"
    assert max(n for _, n in answers) > 1, "the students never queued together"


async def test_fifty_students_fill_a_v100_then_the_queue_long_polls(broker: Broker) -> None:
    async with broker.client("alice") as alice, broker.client("bob") as bob:
        answers = await asyncio.gather(*(acquire(alice, f"k{n}", 0.02) for n in range(50)))
        assert [r.status_code for r in answers] == [201] * 50
        ids = {r.json()["id"] for r in answers}
        assert len(ids) == 50
        gpus = (await alice.get("/gpus")).json()["gpus"]
        assert gpus[0]["allocated_fraction"] == 1.0 and gpus[0]["leases"] == 50

        r = await acquire(bob, "b1", 0.02)
        assert r.status_code == 202, r.text
        queued = r.json()
        assert queued["queued"] is True and queued["position"] == 1
        assert queued["kernel_id"] == "b1" and queued["fraction"] == 0.02
        assert queued["queue_length"] == 1 and queued["id"]
        assert "position 1" in queued["message"] and queued["message"].endswith(".")
        assert int(r.headers["retry-after"]) > 0
        # the same request again keeps the same place
        again = await acquire(bob, "b1", 0.02)
        assert again.status_code == 202 and again.json()["id"] == queued["id"]

        poll = asyncio.ensure_future(acquire(bob, "b1", 0.02, wait=20))
        await asyncio.sleep(0.3)
        assert not poll.done()
        freed = answers[7].json()["id"]
        assert (await alice.delete(f"/leases/{freed}")).status_code == 204
        granted = await asyncio.wait_for(poll, 10)
        assert granted.status_code == 201, granted.text
        assert granted.json()["user"] == "bob"
        assert (await bob.get("/queue")).json()["queue"] == []
    gpus, leases, _ = await snapshot(broker)
    assert gpus["gpus"][0]["allocated_fraction"] == 1.0
    assert len(leases["leases"]) == 50


async def test_renew_and_idempotent_release(broker: Broker) -> None:
    async with broker.client("alice") as c:
        lease = (await acquire(c, "k1", 0.1)).json()
        await asyncio.sleep(0.05)
        r = await c.post(
            f"/leases/{lease['id']}/renew",
            json={"pid": 4242, "execution_state": "busy", "last_activity": time.time()},
        )
        assert r.status_code == 200, r.text
        renewed = r.json()
        assert renewed["id"] == lease["id"] and renewed["pid"] == 4242
        assert renewed["execution_state"] == "busy"
        assert renewed["expires_at"] > lease["expires_at"]
        # an empty body is a plain heartbeat
        assert (await c.post(f"/leases/{lease['id']}/renew")).status_code == 200
        assert_error(await c.post(f"/leases/{lease['id']}/renew", json={"pid": -1}), 400)

        assert (await c.delete(f"/leases/{lease['id']}")).status_code == 204
        assert (await c.delete(f"/leases/{lease['id']}")).status_code == 204
        body = assert_error(await c.post(f"/leases/{lease['id']}/renew", json={}), 410)
        assert body["state"] == "released"
        ended = (await c.get(f"/leases/{lease['id']}")).json()
        assert ended["state"] == "released" and ended["ended_at"] is not None
        assert_error(await c.get("/leases/no-such-lease"), 404, "not_found")
        assert_error(await c.delete("/leases/no-such-lease"), 404, "not_found")
    gpus, leases, _ = await snapshot(broker)
    assert gpus["gpus"][0]["allocated_fraction"] == 0 and leases["leases"] == []


async def test_another_users_lease_is_answered_as_none(broker: Broker) -> None:
    """bob gets for alice's lease exactly what he gets for an id nobody has (no oracle)."""
    async with broker.client("alice") as alice, broker.client("bob") as bob:
        lease = (await acquire(alice, "k1", 0.1)).json()
        before = await snapshot(broker)
        ghost = "0" * len(lease["id"])
        for method, path, body in (
            ("GET", "", None),
            ("DELETE", "", None),
            ("POST", "/renew", {}),
            ("POST", "/revoke", {"reason": "x"}),
        ):
            answers = []
            for lease_id in (lease["id"], ghost):
                r = await bob.request(method, f"/leases/{lease_id}{path}", json=body)
                answers.append((r.status_code, r.text.replace(lease_id, "ID")))
            assert answers[0] == answers[1], (method, path, answers)
            assert answers[0][0] == (403 if path == "/revoke" else 404), answers
        assert_error(await bob.get("/leases", params={"all": "1"}), 403, "forbidden")
        assert_error(await bob.get("/leases", params={"user": "alice"}), 403, "forbidden")
        assert (await bob.get("/leases")).json()["leases"] == []
        assert await snapshot(broker) == before
        after = (await alice.get(f"/leases/{lease['id']}")).json()
        assert after["state"] == "active" and after["renewed_at"] == lease["renewed_at"]
    async with broker.client("admin") as admin:
        assert (await admin.get(f"/leases/{lease['id']}")).status_code == 200
        mine = (await admin.get("/leases", params={"user": "alice"})).json()["leases"]
        assert [x["id"] for x in mine] == [lease["id"]]


async def test_missing_or_forged_token_is_401(broker: Broker) -> None:
    real = broker.tokens["alice"]
    cases = [
        {},
        {"Authorization": "token forged-token-123"},
        {"Authorization": f"token {real}x"},
        {"Authorization": f"Basic {real}"},
        {"Authorization": "token"},
        {"Authorization": f"token {real} extra"},
    ]
    async with httpx.AsyncClient(
        base_url=f"{broker.url}/api/v1", event_hooks=broker.conformance.hooks()
    ) as c:
        for headers in cases:
            for method, path in [("GET", "/gpus"), ("POST", "/leases"), ("GET", "/usage")]:
                r = await c.request(
                    method, path, headers=headers, json={"kernel_id": "k", "fraction": 0.1}
                )
                assert_error(r, 401, "not_authenticated")
                assert "www-authenticate" in r.headers
                assert real not in r.text and "forged" not in r.text
        ok = await c.get("/gpus", headers={"Authorization": f"Bearer {real}"})
        assert ok.status_code == 200
    assert real not in broker.log()
    _, leases, _ = await snapshot(broker)
    assert leases["leases"] == []


# -- bad input -----------------------------------------------------------------------

BAD_INPUT: list[tuple[str, bytes, int, str]] = [
    ("malformed JSON", b'{"kernel_id": "k", "fraction": 0.02', 400, "not valid JSON"),
    ("not an object", b"[0.02]", 400, "JSON object"),
    ("empty body", b"", 400, "kernel_id"),
    ("not UTF-8", b'{"kernel_id": "\xff", "fraction": 0.02}', 400, "UTF-8"),
    ("fraction as a string", b'{"kernel_id": "k", "fraction": "0.02"}', 400, "without quotes"),
    ("fraction true", b'{"kernel_id": "k", "fraction": true}', 400, "number"),
    ("fraction null", b'{"kernel_id": "k", "fraction": null}', 400, "number"),
    ("NaN", b'{"kernel_id": "k", "fraction": NaN}', 400, "NaN"),
    ("Infinity", b'{"kernel_id": "k", "fraction": Infinity}', 400, "Infinity"),
    ("1e999", b'{"kernel_id": "k", "fraction": 1e999}', 400, "finite"),
    ("negative", b'{"kernel_id": "k", "fraction": -0.1}', 400, "greater than 0"),
    ("zero", b'{"kernel_id": "k", "fraction": 0}', 400, "greater than 0"),
    ("above one", b'{"kernel_id": "k", "fraction": 1.5}', 400, "at most 1"),
    ("tiny", b'{"kernel_id": "k", "fraction": 1e-9}', 400, "smallest fraction"),
    ("huge int", b'{"kernel_id": "k", "fraction": 1' + b"0" * 400 + b"}", 400, "at most 1"),
    ("huger int", b'{"kernel_id": "k", "fraction": 1' + b"0" * 5000 + b"}", 400, "too large"),
    ("kernel_id a number", b'{"kernel_id": 7, "fraction": 0.02}', 400, "string"),
    (
        "kernel_id 10k chars",
        b'{"kernel_id": "' + b"k" * 10_000 + b'", "fraction": 0.02}',
        400,
        "at most 255",
    ),
    ("kernel_id control char", b'{"kernel_id": "a\\nb", "fraction": 0.02}', 400, "unprintable"),
    (
        "kernel_id bidi override",
        '{"kernel_id": "a\u202eb", "fraction": 0.02}'.encode(),
        400,
        "unprintable",
    ),
    ("unknown field", b'{"kernel_id": "k", "fraction": 0.02, "user": "bob"}', 400, "'user'"),
    ("duplicate field", b'{"kernel_id": "k", "fraction": 0.02, "fraction": 1}', 400, "twice"),
    (
        "gpu_uuids not a list",
        b'{"kernel_id": "k", "fraction": 0.02, "gpu_uuids": "GPU-1"}',
        400,
        "list",
    ),
    (
        "unknown GPU uuid",
        b'{"kernel_id": "k", "fraction": 0.02, "gpu_uuids": ["GPU-nope"]}',
        400,
        "Unknown GPU",
    ),
    (
        "wait too long",
        b'{"kernel_id": "k", "fraction": 0.02, "wait": 301}',
        400,
        "between 0 and 300",
    ),
    ("wait a string", b'{"kernel_id": "k", "fraction": 0.02, "wait": "5"}', 400, "number"),
    (
        "2 MB body",
        b'{"kernel_id": "k", "fraction": 0.02, "pad": "' + b"x" * 2_000_000 + b'"}',
        413,
        "bytes",
    ),
    (
        "fraction 0.01 below the context overhead",
        b'{"kernel_id": "k", "fraction": 0.01}',
        422,
        "smallest fraction",
    ),
    ("unknown node", b'{"kernel_id": "k", "fraction": 0.02, "node": "elsewhere"}', 422, "node"),
]


async def test_bad_input_is_refused_and_changes_nothing(broker: Broker) -> None:
    async with broker.client("alice") as c:
        held = (await acquire(c, "held", 0.1)).json()
        before = await snapshot(broker)
        failures = []
        for name, raw, status, words in BAD_INPUT:
            r = await c.post("/leases", content=raw, headers={"Content-Type": "application/json"})
            try:
                body = assert_error(r, status)
                assert words in body["message"], body["message"]
                assert len(body["message"]) < 600
            except AssertionError as exc:
                failures.append(f"{name}: {exc}")
        assert not failures, "\n".join(failures)
        # bad heartbeats and quotas change nothing either
        renew = f"/leases/{held['id']}/renew"
        for raw in (b"{", b'{"pid": "x"}', b'{"pid": 0}', b'{"execution_state": 5}', b'{"x": 1}'):
            assert_error(await c.post(renew, content=raw), 400)
        assert_error(await c.get("/usage", params={"since": "last tuesday"}), 400)
        assert_error(await c.get("/usage", params={"by": "color"}), 400)
        assert_error(await c.get("/leases", params={"all": "maybe"}), 400)
    async with broker.client("admin") as admin:
        for raw in (b'{"max_leases": -1}', b'{"max_leases": "2"}', b'{"max_gpus": 1}', b"[]"):
            assert_error(await admin.put("/quotas/default", content=raw), 400)
    assert await snapshot(broker) == before


async def test_too_small_fraction_names_the_smallest_that_works(broker: Broker) -> None:
    async with broker.client("alice") as c:
        body = assert_error(await acquire(c, "k", 0.01), 422, "cannot_fit")
    smallest = body["min_fraction"]
    assert f"{smallest:g}" in body["message"]
    # the named fraction really works, and one ppm less would not
    assert (smallest * V100_MB) - 512 >= 1
    async with broker.client("alice") as c:
        assert (await acquire(c, "k", smallest)).status_code == 201


# -- courses, quotas, usage -----------------------------------------------------------


async def test_course_kernels_are_for_members(broker: Broker) -> None:
    async with broker.client("bob") as bob, broker.client("alice") as alice:
        body = assert_error(await acquire(bob, "k", 0.05, group="ml101"), 403, "forbidden")
        assert "ml101" in body["message"]
        r = await acquire(alice, "k", 0.05, group="ml101")
        assert r.status_code == 201 and r.json()["group"] == "ml101"
    async with broker.client("admin") as admin:
        assert (await acquire(admin, "k", 0.05, group="ml101")).status_code == 201
    _, leases, _ = await snapshot(broker)
    assert sorted(x["user"] for x in leases["leases"]) == ["admin", "alice"]


async def test_quotas(broker: Broker) -> None:
    async with broker.client("admin") as admin, broker.client("alice") as alice:
        r = await admin.put("/quotas/default", json={"max_leases": 1})
        assert r.status_code == 200 and r.json()["max_leases"] == 1
        assert (await acquire(alice, "k1", 0.05)).status_code == 201
        body = assert_error(await acquire(alice, "k2", 0.05), 403, "quota_exceeded")
        assert body["quota"] == "max_leases"

        # students may not set quotas, nor list everyone's
        assert_error(await alice.put("/quotas/default", json={"max_leases": 9}), 403, "forbidden")
        assert_error(await alice.put("/quotas/users/alice", json={"max_leases": 9}), 403)
        assert_error(await alice.delete("/quotas/default"), 403)
        assert_error(await alice.get("/quotas"), 403)
        assert_error(await alice.get("/quotas/users/bob"), 403)
        me = (await alice.get("/quotas/me")).json()
        assert me["user"] == "alice" and me["effective"]["max_leases"] == 1 and me["leases"] == 1
        assert (await alice.get("/quotas/default")).json()["max_leases"] == 1

        # a user override wins over the default
        r = await admin.put("/quotas/users/alice", json={"max_leases": 3, "budget_window": "7d"})
        assert r.status_code == 200 and r.json()["budget_window"] == 7 * 86400
        assert (await acquire(alice, "k2", 0.05)).status_code == 201
        own = (await alice.get("/quotas/users/alice")).json()
        assert own["max_leases"] == 3 and own["effective"]["max_leases"] == 3
        everyone = (await admin.get("/quotas")).json()
        assert (
            everyone["default"]["max_leases"] == 1 and everyone["users"]["alice"]["max_leases"] == 3
        )

        r = await admin.put("/quotas/groups/ml101", json={"max_lease_fraction": 0.1, "priority": 2})
        assert r.status_code == 200 and r.json()["priority"] == 2
        assert (await alice.get("/quotas/groups/ml101")).json()["max_lease_fraction"] == 0.1
        async with broker.client("bob") as bob:
            assert_error(await bob.get("/quotas/groups/ml101"), 403)
        assert_error(await acquire(alice, "k3", 0.2), 403, "quota_exceeded")

        assert (await admin.delete("/quotas/users/alice")).status_code == 204
        assert_error(await admin.get("/quotas/users/alice"), 404, "not_found")
        assert (await admin.delete("/quotas/default")).status_code == 204
        assert (await admin.get("/quotas/default")).json()["max_leases"] is None
    # quotas live in the database: a restart keeps them
    async with broker.client("admin") as admin:
        await admin.put("/quotas/default", json={"max_leases": 7})
    broker.restart()
    async with broker.client("admin") as admin:
        assert (await admin.get("/quotas/default")).json()["max_leases"] == 7
        assert (await admin.get("/quotas/groups/ml101")).json()["priority"] == 2


async def test_usage_counts_fraction_hours(broker: Broker) -> None:
    async with broker.client("alice") as alice:
        lease = (await acquire(alice, "k1", 0.5, group="ml101")).json()
        await asyncio.sleep(1.0)
        assert (await alice.delete(f"/leases/{lease['id']}")).status_code == 204
        mine = (await alice.get("/usage")).json()
        assert set(mine) == {"alice"} and mine["alice"] > 0
        assert mine["alice"] == pytest.approx(0.5 / 3600, rel=0.5)
        yesterday = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 86400))
        for since in ("24h", yesterday, str(int(time.time()) - 60)):
            r = await alice.get("/usage", params={"since": since})
            assert r.status_code == 200 and r.json()["alice"] > 0, since
        assert_error(await alice.get("/usage", params={"since": str(time.time() + 3600)}), 400)
    async with broker.client("bob") as bob:
        assert (await bob.get("/usage")).json() == {"bob": 0.0}
    async with broker.client("admin") as admin:
        by_user = (await admin.get("/usage")).json()
        assert by_user["alice"] > 0 and "bob" not in by_user
        by_group = (await admin.get("/usage", params={"by": "group"})).json()
        assert by_group["ml101"] > 0


async def test_usage_by_group_counts_generic_kernels_for_the_course(broker: Broker) -> None:
    """alice (ml101) and bob (no course) on generic kernels: alice's use is ml101's."""
    held = {}
    for user in ("alice", "bob"):
        async with broker.client(user) as c:
            r = await acquire(c, "generic", 0.25)
            assert r.status_code == 201, r.text
            held[user] = r.json()
    assert held["alice"]["group"] is None and held["alice"]["groups"] == ["ml101"]
    assert held["bob"]["groups"] == []
    await asyncio.sleep(0.5)
    for user in ("alice", "bob"):
        async with broker.client(user) as c:
            assert (await c.delete(f"/leases/{held[user]['id']}")).status_code == 204
    async with broker.client("admin") as admin:
        by_group = (await admin.get("/usage", params={"by": "group", "since": "1h"})).json()
        assert set(by_group) == {"ml101", ""} and by_group["ml101"] > 0
        # the same leases, the same use: counted by course or by user
        by_user = (await admin.get("/usage", params={"since": "1h"})).json()
        assert by_group["ml101"] == pytest.approx(by_user["alice"])
        assert by_group[""] == pytest.approx(by_user["bob"])
    async with broker.client("alice") as alice:  # a student sees her courses' use only
        assert set((await alice.get("/usage", params={"by": "group"})).json()) == {"ml101"}


async def test_a_student_asks_usage_of_31_days_at_most(broker: Broker) -> None:
    """``usage?by=group&since=0`` from any student scanned every lease ever recorded on the
    store's one writer thread: a student reaches back 31 days, or the
    longest budget window; an admin as far as they like."""
    async with broker.client("alice") as alice:
        for since in ("0", "32d", "2020-01-01"):
            r = await alice.get("/usage", params={"by": "group", "since": since})
            assert_error(r, 403, "forbidden")
            assert "reaches back 31 days at most" in r.json()["message"], r.json()
            assert "since=31d" in r.json()["message"]
        for since in ("31d", "7d"):
            r = await alice.get("/usage", params={"by": "group", "since": since})
            assert r.status_code == 200, r.text
        assert_error(await alice.get("/usage", params={"since": "0"}), 403, "forbidden")
    async with broker.client("admin") as admin:
        assert (await admin.get("/usage", params={"by": "group", "since": "0"})).status_code == 200
        r = await admin.put(
            "/quotas/groups/ml101", json={"budget_fraction_hours": 10, "budget_window": "60d"}
        )
        assert r.status_code == 200, r.text
    async with broker.client("alice") as alice:  # a 60-day budget: its window is readable
        assert (await alice.get("/usage", params={"since": "60d"})).status_code == 200
        r = await alice.get("/usage", params={"since": "61d"})
        assert_error(r, 403, "forbidden")
        assert "60 days at most" in r.json()["message"]


async def test_history_of_allocation_queue_and_waits(broker: Broker) -> None:
    """Fill the V100, queue two, withdraw one, release: the history shows it all."""
    from openapi_schema_validator import OAS30Validator

    from provisioner.broker.web.routes import build_openapi

    doc = build_openapi()
    schema = OAS30Validator(
        {**doc["components"]["schemas"]["History"], "components": doc["components"]}
    )
    async with broker.client("alice") as alice, broker.client("bob") as bob:
        full = (await acquire(alice, "big", 1.0)).json()
        assert (await acquire(bob, "waits", 0.5)).status_code == 202
        async with broker.client("carol") as carol:
            gives_up = (await acquire(carol, "gives-up", 0.5)).json()
            assert gives_up["queued"] is True
            await asyncio.sleep(0.3)
            assert (await carol.delete(f"/leases/{gives_up['id']}")).status_code == 204
        await asyncio.sleep(0.3)
        assert (await alice.delete(f"/leases/{full['id']}")).status_code == 204
        # bob's request was granted from the queue by that release
        (granted,) = (await bob.get("/leases")).json()["leases"]
        assert granted["fraction"] == 0.5

        async with broker.client("admin") as admin:
            r = await admin.get("/history", params={"since": "1h", "step": "60"})
            assert r.status_code == 200, r.text
            body = r.json()
            schema.validate(body)
            assert body["step"] == 60 and body["capacity"] == 1.0 and body["user"] is None
            points = body["points"]
            assert len(points) in (60, 61) and points[0]["t"] % 60 == 0
            assert [p["t"] for p in points] == sorted(p["t"] for p in points)
            assert max(p["allocated_max"] for p in points) == 1.0
            assert max(p["queue_max"] for p in points) == 2
            assert sum(p["grants"] for p in points) == 2
            assert sum(p["waited"] for p in points) == 1
            assert sum(p["withdrawn"] for p in points) == 1
            waits = [p["wait_max_s"] for p in points if p["wait_max_s"] is not None]
            assert len(waits) == 1 and 0.3 <= waits[0] < 60
            # the per-course view: alice and carol are in ml101, bob in none
            ml101 = (await admin.get("/history", params={"since": "1h", "group": "ml101"})).json()
            assert max(p["allocated_max"] for p in ml101["points"]) == 1.0
            assert sum(p["grants"] for p in ml101["points"]) == 1
            assert sum(p["withdrawn"] for p in ml101["points"]) == 1
            assert sum(p["waited"] for p in ml101["points"]) == 0
            nobody = (await admin.get("/history", params={"since": "1h", "group": ""})).json()
            assert sum(p["waited"] for p in nobody["points"]) == 1  # bob's
            one = (await admin.get("/history", params={"user": "carol", "since": "1h"})).json()
            assert one["user"] == "carol" and sum(p["grants"] for p in one["points"]) == 0
            # the default: the last 24 hours in about 120 buckets
            default = (await admin.get("/history")).json()
            assert default["step"] == 720 and len(default["points"]) in (120, 121)
            for params in (
                {"step": "0"},
                {"step": "soon"},
                {"since": "0", "step": "1"},  # too many points
                {"since": str(time.time() + 3600)},
                {"since": "last tuesday"},
            ):
                assert_error(await admin.get("/history", params=params), 400)
        # a student sees only their own
        mine = (await bob.get("/history", params={"since": "1h"})).json()
        assert mine["user"] == "bob"
        assert sum(p["grants"] for p in mine["points"]) == 1
        assert max(p["queue_max"] for p in mine["points"]) == 1
        assert_error(await bob.get("/history", params={"user": "alice"}), 403)
        assert (await bob.get("/history", params={"user": "bob"})).status_code == 200


@pytest.mark.broker_process  # SIGTERM while a long-poll waits
async def test_queue_positions(broker: Broker) -> None:
    async with broker.client("alice") as alice:
        assert (await acquire(alice, "big", 1)).status_code == 201
    users = ["bob", "carol", "u00"]
    for n, user in enumerate(users, start=1):
        async with broker.client(user) as c:
            r = await acquire(c, "k", 0.5)
            assert r.status_code == 202 and r.json()["position"] == n
    async with broker.client("admin") as admin:
        queue = (await admin.get("/queue")).json()["queue"]
    assert [(q["position"], q["user"]) for q in queue] == [(1, "bob"), (2, "carol"), (3, "u00")]
    for n, user in enumerate(users, start=1):
        async with broker.client(user) as c:
            mine = (await c.get("/queue")).json()["queue"]
            assert [(q["position"], q["user"]) for q in mine] == [(n, user)]
    # a client that hangs up its long-poll keeps its place (until it stops polling)
    async with broker.client("carol", timeout=0.3) as carol:
        with pytest.raises(httpx.ReadTimeout):
            await acquire(carol, "k", 0.5, wait=30)
    async with broker.client("carol") as carol:
        r = await acquire(carol, "k", 0.5)
        assert r.status_code == 202 and r.json()["position"] == 2
        # cancelling a queued request: DELETE its id
        assert (await carol.delete(f"/leases/{r.json()['id']}")).status_code == 204
    async with broker.client("u00") as c:
        assert (await acquire(c, "k", 0.5)).json()["position"] == 2
        # SIGTERM while a long-poll waits: the broker still exits at once, with 0, and
        # the long-poll gets a 503 that clients retry (it used to be cut without an answer)
        poll = asyncio.ensure_future(acquire(c, "k", 0.5, wait=60))
        await asyncio.sleep(0.3)
        code, seconds = broker.terminate()
        assert code == 0 and seconds < 2.0, (code, seconds)
        answer = await poll
        assert answer.status_code == 503 and answer.json()["error"] == "not_active"


async def test_withdrawing_a_request_granted_meanwhile_releases_its_lease(broker: Broker) -> None:
    """A client gives up waiting and withdraws its request by the id the 202 carried, but
    the broker granted it in between: the DELETE releases that lease (it keeps the
    request's id) instead of missing it and leaving an unrenewed lease until it expires."""
    async with broker.client("alice") as alice, broker.client("bob") as bob:
        held = (await acquire(alice, "big", 1)).json()["id"]
        queued = await acquire(bob, "k", 1)
        assert queued.status_code == 202
        request_id = queued.json()["id"]
        assert (await alice.delete(f"/leases/{held}")).status_code == 204  # bob is granted now
        lease = (await bob.get(f"/leases/{request_id}")).json()
        assert lease["state"] == "active" and lease["user"] == "bob", lease
        assert (await bob.delete(f"/leases/{request_id}")).status_code == 204
        assert (await bob.get(f"/leases/{request_id}")).json()["state"] == "released"
        gpus = (await bob.get("/gpus")).json()["gpus"]
        assert [g["allocated_fraction"] for g in gpus] == [0.0]


# -- restarts and crashes ----------------------------------------------------------------


async def test_restart_keeps_leases_and_queue(broker: Broker) -> None:
    async with broker.client("alice") as alice, broker.client("bob") as bob:
        lease = (await acquire(alice, "k1", 0.75)).json()
        queued = (await acquire(bob, "k1", 0.5)).json()
        assert queued["queued"]
    broker.restart()
    async with broker.client("alice") as alice, broker.client("bob") as bob:
        again = (await alice.get(f"/leases/{lease['id']}")).json()
        assert again["id"] == lease["id"] and again["state"] == "active"
        assert again["expires_at"] >= lease["expires_at"]
        repeat = await acquire(alice, "k1", 0.75)
        assert repeat.status_code == 200 and repeat.json()["id"] == lease["id"]
        still = await acquire(bob, "k1", 0.5)
        assert still.status_code == 202 and still.json()["id"] == queued["id"]
        gpus = (await alice.get("/gpus")).json()["gpus"]
        assert gpus[0]["allocated_fraction"] == 0.75 and gpus[0]["leases"] == 1


FRACTIONS = (0.05, 0.1, 0.2, 0.25)


@pytest.mark.broker_args("--gpus", "2x32768:V100")
@pytest.mark.broker_process
async def test_kill9_mid_load_then_every_client_has_one_lease_or_one_place(broker: Broker) -> None:
    clients = [f"u{n:02d}" for n in range(32)]
    want = {user: FRACTIONS[n % len(FRACTIONS)] for n, user in enumerate(clients)}
    seen: dict[str, set[str]] = {user: set() for user in clients}  # lease ids answered
    limits = httpx.Limits(max_connections=64)
    answered = 0
    enough = asyncio.Event()

    async def hammer(user: str, rounds: int) -> None:
        async with broker.client(user, timeout=5.0, limits=limits) as c:
            for _ in range(rounds):
                try:
                    r = await acquire(c, f"kernel-of-{user}", want[user])
                except httpx.TransportError:
                    await asyncio.sleep(0.02)
                    continue
                if r.status_code in (200, 201):
                    seen[user].add(r.json()["id"])
                nonlocal answered
                answered += 1
                if answered >= 48:
                    enough.set()

    load = asyncio.gather(*(hammer(user, 40) for user in clients))
    await asyncio.wait_for(enough.wait(), 30)
    broker.kill9()  # with most clients' requests in flight
    assert answered < 32 * 40
    await load
    broker.start()

    final: dict[str, dict[str, Any]] = {}

    async def settle(user: str) -> None:
        async with broker.client(user, timeout=10.0) as c:
            for _ in range(50):
                try:
                    r = await acquire(c, f"kernel-of-{user}", want[user])
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
                    continue
                assert r.status_code in (200, 201, 202), r.text
                final[user] = {"status": r.status_code, **r.json()}
                return

    await asyncio.gather(*(settle(user) for user in clients))
    assert set(final) == set(clients)
    lease_ids = [a["id"] for a in final.values() if a["status"] in (200, 201)]
    queued = [u for u, a in final.items() if a["status"] == 202]
    assert len(lease_ids) == len(set(lease_ids)), "a lease id was handed out twice"
    assert lease_ids, "nobody got a lease"
    assert queued, "2 GPUs cannot hold 4.8 GPUs' worth of fractions"
    for user, answer in final.items():
        if answer["status"] != 202:
            assert answer["user"] == user
            # what a client was told before the crash still holds after it
            assert seen[user] <= {answer["id"]}, (user, seen[user], answer["id"])
        else:
            assert not seen[user], f"{user} was granted a lease that the crash lost"

    gpus, leases, queue = await snapshot(broker)
    for gpu in gpus["gpus"]:
        assert gpu["allocated_fraction"] <= 1.0
    assert sorted(x["id"] for x in leases["leases"]) == sorted(lease_ids)
    assert sorted(q["user"] for q in queue["queue"]) == sorted(queued)
    assert sum(g["allocated_fraction"] for g in gpus["gpus"]) == pytest.approx(
        sum(want[u] for u, a in final.items() if a["status"] != 202)
    )

    per_gpu = db_query(
        broker.db_url,
        "SELECT gpu_uuid, SUM(fraction_ppm), COUNT(*) FROM leases WHERE state = 'active' "
        "GROUP BY gpu_uuid",
    )
    assert all(total <= 1_000_000 for _, total, _ in per_gpu), per_gpu
    assert sum(n for _, _, n in per_gpu) == len(lease_ids)
    doubled = db_query(
        broker.db_url,
        "SELECT \"user\", kernel_id, COUNT(*) FROM leases WHERE state = 'active' "
        'GROUP BY "user", kernel_id HAVING COUNT(*) > 1',
    )
    assert doubled == []
    in_queue = db_query(broker.db_url, 'SELECT "user" FROM requests')
    assert sorted(u for (u,) in in_queue) == sorted(queued)

    code, seconds = broker.terminate()
    assert code == 0 and seconds < 2.0, (code, seconds, broker.log())


@pytest.mark.broker_args("--base-url", "/services/gpu-lease/", "--no-metrics-auth")
async def test_served_under_the_hub_service_prefix(broker: Broker) -> None:
    root = f"http://127.0.0.1:{broker.port}"
    async with httpx.AsyncClient(base_url=root, event_hooks=broker.conformance.hooks()) as c:
        assert (await c.get("/services/gpu-lease/api/v1/health")).status_code == 200
        assert_error(await c.get("/api/v1/health"), 404)
        for path in ("/services/gpu-lease/", "/services/gpu-lease"):
            index = await c.get(path)
            assert index.status_code == 200
            assert index.json()["api"] == "/services/gpu-lease/api/v1/"
        doc = (await c.get("/services/gpu-lease/api/v1/openapi.json")).json()
        assert doc["servers"][0]["url"] == "/services/gpu-lease/"
        # --no-metrics-auth: a scrape-only network's broker answers /metrics to anyone
        metrics = await c.get("/services/gpu-lease/metrics")
        assert metrics.status_code == 200 and "gpu_lease_" in metrics.text
    async with broker.client("alice") as alice:
        r = await acquire(alice, "k", 0.05)
        assert r.status_code == 201
        assert r.headers["location"] == f"/services/gpu-lease/api/v1/leases/{r.json()['id']}"


# -- start-up errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gpus", "lots of them"], "--gpus"),
        (["--auth", "static"], "--tokens-file"),
        (["--auth", "static", "--tokens-file", "{tmp}/missing.json"], "does not exist"),
        (["--auth", "static", "--tokens-file", "{tmp}/bad.json"], "at least 8 characters"),
        (["--config", "{tmp}/nope.py"], "does not exist"),
    ],
)
def test_startup_errors_exit_2_with_a_clear_message(
    args: list[str], words: str, tmp_path: Path
) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"short": {"user": "x"}}))
    cmd = [sys.executable, "-m", "provisioner.broker.app", "--port", str(free_port())]
    cmd += ["--db-url", f"sqlite:///{tmp_path}/b.sqlite"]
    if "--gpus" not in args:
        cmd += ["--gpus", "1x16384:T4"]
    cmd += [a.replace("{tmp}", str(tmp_path)) for a in args]
    env = {k: v for k, v in os.environ.items() if k != "JUPYTERHUB_API_TOKEN"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert words in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "short" not in p.stderr


def test_config_file_is_loaded_and_the_command_line_wins(tmp_path: Path) -> None:
    from provisioner.broker.app import GPULeaseBroker

    (tmp_path / "broker_config.py").write_text(
        "c.GPULeaseBroker.port = 12345\n"
        "c.GPULeaseBroker.ttl = 30.0\n"
        "c.GPULeaseBroker.gpus = '2x81920:H100'\n"
    )
    app = GPULeaseBroker()
    app.initialize(["--config", str(tmp_path / "broker_config.py"), "--port", "999"])
    assert app.port == 999 and app.ttl == 30.0 and app.gpus == "2x81920:H100"
    assert app.policy().ttl == 30.0


def test_generate_config_lists_every_option_with_its_default(capsys: Any) -> None:
    from provisioner.broker.app import GPULeaseBroker

    app = GPULeaseBroker()
    app.initialize(["--generate-config"])
    app.start()
    out = capsys.readouterr().out
    for name in ("ttl", "tokens_file", "authenticator_class", "reap_interval", "max_body_bytes"):
        assert f"# c.GPULeaseBroker.{name} = " in out, name
    assert "# c.GPULeaseBroker.ttl = 90.0" in out and "Default: 90." in out
    compile(out, "broker_config.py", "exec")  # a valid config file


def test_main_turns_the_collector_back_on_when_it_returns_early(capsys: Any) -> None:
    """main() runs start-up with the garbage collector off (serve() turns it on once the
    broker listens); a start that never gets there must not leave it off."""
    import gc

    from provisioner.broker.app import GPULeaseBroker, main

    assert gc.isenabled()
    try:
        assert main(["--generate-config"]) == 0
        assert gc.isenabled() and "c.GPULeaseBroker.ttl" in capsys.readouterr().out
        GPULeaseBroker.clear_instance()
        with pytest.raises(SystemExit) as exc:
            main(["--config", "/nonexistent/broker_config.py"])
        assert exc.value.code == 2 and gc.isenabled()
    finally:
        GPULeaseBroker.clear_instance()
        gc.enable()


def test_a_standby_collects_garbage_while_it_waits(tmp_path: Path) -> None:
    """``--ha-lock``: the collector is on before the broker stands by (which may last
    hours), not only once it listens."""
    import gc

    from provisioner.broker.app import GPULeaseBroker

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"a-long-token": {"user": "alice"}}))
    app = GPULeaseBroker()
    app.initialize(
        [
            "--ha-lock",
            "--auth=static",
            f"--tokens-file={tokens}",
            "--gpus=1x32768:V100",
            f"--db-url=sqlite:///{tmp_path / 'b.sqlite'}",
        ]
    )
    gc.disable()
    try:
        assert asyncio.run(app.serve()) == 2  # SQLite: refused at once, after the collector
        assert gc.isenabled()
    finally:
        gc.enable()


def test_authenticator_by_auth_name_or_by_class(tmp_path: Path) -> None:
    from provisioner.broker.app import GPULeaseBroker
    from provisioner.broker.web.auth import StaticTokens

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"a-long-token": {"user": "alice"}}))
    by_name = GPULeaseBroker()
    by_name.initialize(["--auth", "static", "--tokens-file", str(tokens)])
    assert isinstance(by_name.make_authenticator(), StaticTokens)
    by_class = GPULeaseBroker()
    by_class.initialize(
        [
            "--auth=hub",  # the class, when given, wins over the short name
            "--GPULeaseBroker.authenticator_class=provisioner.broker.web.auth.StaticTokens",
            f"--tokens-file={tokens}",
        ]
    )
    auth = by_class.make_authenticator()
    assert isinstance(auth, StaticTokens) and auth.parent is by_class


def test_static_tokens_broker_never_imports_jupyterhub(tmp_path: Path) -> None:
    """JupyterHub costs about a second of start-up; only --auth hub needs it."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"a-long-token": {"user": "alice"}}))
    code = (
        "import sys\n"
        "from provisioner.broker.app import GPULeaseBroker\n"
        "app = GPULeaseBroker()\n"
        "app.initialize(sys.argv[1:])\n"
        "app.make_web_app(None, app.make_authenticator(), None)\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'jupyterhub'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JUPYTERHUB_API_TOKEN"}
    p = subprocess.run(
        [sys.executable, "-c", code, "--auth", "static", "--tokens-file", str(tokens)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
