"""Hostile request bodies against a REAL broker subprocess (``conftest.broker``).

Hypothesis draws arbitrary JSON documents (recursive: objects, arrays, huge ints,
floats with NaN and Infinity written as the literals Python's json would accept,
unicode with lone surrogates, deep nesting) and posts them to acquire, renew and
quota PUT. Every answer is 2xx or 4xx with a JSON error sentence, never 5xx, and a
refusal changes nothing (GPUs, leases, queue and quotas as the admin sees them).
Then tables: number spellings, unicode kernel ids and user names, the body size
limit (413) and the per-user queue bound.

``derandomize=True`` and no example database: the same examples on every run.
SQLite only (``test_broker_api`` runs the API on PostgreSQL too).
"""

from __future__ import annotations

import json
import math
import socket
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from .conftest import Broker
from .hostile import add_tokens, assert_capacity, postgres_schema, secrets_of, state

pytestmark = pytest.mark.slow

BODY_LIMIT = 4096
MAX_QUEUED = 3
BROKER = (
    "--gpus",
    "2x32768:V100",
    f"--GPULeaseBroker.max_body_bytes={BODY_LIMIT}",
    f"--GPULeaseBroker.max_queued_per_user={MAX_QUEUED}",
)
FUZZ = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture
def broker_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """SQLite, or PostgreSQL for a test parametrized with ``BOTH_DATABASES``."""
    if getattr(request, "param", "sqlite") == "sqlite":
        yield f"sqlite:///{tmp_path / 'b.sqlite'}"
        return
    with postgres_schema() as url:
        yield url


BOTH_DATABASES = pytest.mark.parametrize(
    "broker_db_url",
    ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)


# -- JSON documents, including what json.dumps would never write -------------------------


class Raw(str):
    """JSON text written as is: literals such as NaN, 1e400 or a 5000-digit int."""


RAW_NUMBERS = [
    Raw(x)
    for x in (
        "NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "-1e400",
        "-0",
        "0.02e0",
        "2E-2",
        "1e-9",
        "5e-324",
        "1" + "0" * 400,
        "1" + "0" * 3000,
        "0." + "0" * 3000 + "1",
    )
]
#: text with everything hypothesis can draw, lone surrogates included
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=10**40)
    | st.floats()
    | TEXT
    | st.sampled_from(RAW_NUMBERS)
)
JSON = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
    max_leaves=12,
)


def _is_long_wait(value: Any) -> bool:
    """A ``wait`` that could hold the answer for a while (a queued long-poll)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not (isinstance(value, float) and math.isnan(value)) and 0.05 < value <= 300


def dump(value: Any) -> str:
    """JSON text of ``value``; floats nan/inf as the literals NaN/Infinity, Raw as is."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


ACQUIRE = JSON | st.fixed_dictionaries(
    {},
    optional={
        "kernel_id": TEXT | JSON,
        "fraction": st.floats(0, 1) | st.sampled_from(RAW_NUMBERS) | JSON,
        "node": TEXT | JSON,
        "gpu_uuids": st.lists(TEXT, max_size=3) | JSON,
        "group": st.sampled_from(["ml101", "cs50"]) | JSON,
        "wait": JSON.filter(lambda v: not _is_long_wait(v)),
        "user": st.just("admin"),
    },
)
HEARTBEAT = JSON | st.fixed_dictionaries(
    {},
    optional={"pid": JSON, "execution_state": TEXT | JSON, "last_activity": JSON},
)
QUOTA = JSON | st.fixed_dictionaries(
    {},
    optional={
        name: JSON | st.floats(0, 2) | st.sampled_from(RAW_NUMBERS)
        for name in (
            "max_fraction",
            "max_leases",
            "max_lease_fraction",
            "budget_fraction_hours",
            "budget_window",
            "priority",
        )
    },
)


# -- the invariant: 2xx/4xx only, and a 4xx changes nothing ----------------------------


class Target:
    """Posts bodies to one endpoint and checks the answer and the state around it."""

    def __init__(self, broker: Broker, user: str) -> None:
        self.broker = broker
        self.client = httpx.Client(
            base_url=f"{broker.url}/api/v1", headers=broker.headers(user), timeout=30
        )
        self.admin = httpx.Client(
            base_url=f"{broker.url}/api/v1", headers=broker.headers("admin"), timeout=30
        )
        self.before = state(broker)
        self.answers: list[str] = []
        self.statuses: dict[int, int] = {}

    def send(self, method: str, path: str, body: Any) -> httpx.Response:
        text = dump(body).encode("utf-8", "surrogatepass")
        r = self.client.request(
            method, path, content=text, headers={"Content-Type": "application/json"}
        )
        self.answers.append(r.text)
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text, text[:300])
        assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, r.status_code
        if r.status_code >= 400:
            err = r.json()
            assert set(err) >= {"error", "message"}, err
            assert err["message"].rstrip().endswith("."), err
            assert len(err["message"]) < 800, err
            assert state(self.broker) == self.before, ("a refusal changed the state", text[:300])
        return r

    def reset(self, refresh: bool = True) -> None:
        """End every lease and queued request (after an answer that changed the state)."""
        for lease in self.admin.get("/leases", params={"all": "1"}).json()["leases"]:
            self.admin.delete(f"/leases/{lease['id']}")
        for req in self.admin.get("/queue").json()["queue"]:
            self.admin.delete(f"/leases/{req['id']}")
        if refresh:
            self.before = state(self.broker)

    def close(self) -> None:
        self.client.close()
        self.admin.close()
        assert_capacity(self.broker)
        leaked = [t for t in secrets_of(self.broker) if any(t in a for a in self.answers)]
        assert not leaked, "an answer contains a token"


@pytest.mark.broker_args(*BROKER)
def test_acquire_with_hostile_bodies(broker: Broker) -> None:
    target = Target(broker, "alice")

    @FUZZ
    @given(body=ACQUIRE)
    @example(body={"kernel_id": "k", "fraction": Raw("0.02e0")})
    @example(body={"kernel_id": "k", "fraction": Raw("[" * 1900 + "]" * 1900)})
    @example(body={"kernel_id": "\ud800", "fraction": 0.02})
    @example(body={"kernel_id": "k", "fraction": 0.5, "wait": Raw("1e400")})
    def check(body: Any) -> None:
        r = target.send("POST", "/leases", body)
        if r.status_code < 300:
            target.reset()

    check()
    target.close()
    assert target.statuses.get(201, 0) >= 1, target.statuses


@pytest.mark.broker_args(*BROKER)
def test_renew_with_hostile_bodies(broker: Broker) -> None:
    target = Target(broker, "alice")
    lease = target.client.post("/leases", json={"kernel_id": "k", "fraction": 0.1}).json()
    target.before = state(broker)

    @FUZZ
    @given(body=HEARTBEAT, lease_id=st.sampled_from([lease["id"]]) | TEXT)
    @example(body={"pid": Raw("1" + "0" * 3000)}, lease_id=lease["id"])
    @example(body={"execution_state": "idle\r\nX-Injected: 1"}, lease_id=lease["id"])
    def check(body: Any, lease_id: str) -> None:
        quoted = urllib.parse.quote(lease_id.encode("utf-8", "surrogatepass"), safe="")
        r = target.send("POST", f"/leases/{quoted or 'x'}/renew", body)
        if r.status_code < 300:
            target.before = state(broker)  # a renewal moves expires_at: that is its job

    check()
    target.close()
    assert target.statuses.get(200, 0) >= 1, target.statuses


@pytest.mark.broker_args(*BROKER)
def test_quota_put_with_hostile_bodies(broker: Broker) -> None:
    target = Target(broker, "admin")

    @FUZZ
    @given(body=QUOTA, level=st.sampled_from(["default", "groups/ml101", "users/alice"]))
    @example(body={"budget_window": "9" * 40 + "d"}, level="default")
    @example(body={"max_fraction": Raw("0.02e0")}, level="users/alice")
    def check(body: Any, level: str) -> None:
        r = target.send("PUT", f"/quotas/{level}", body)
        if r.status_code < 300:
            assert target.admin.delete(f"/quotas/{level}").status_code == 204
            target.before = state(broker)

    check()
    target.close()
    assert target.statuses.get(200, 0) >= 1, target.statuses


# -- tables ------------------------------------------------------------------------------

#: (body text, status, words in the message or the fraction granted)
NUMBERS: list[tuple[str, int, Any]] = [
    ('{"kernel_id": "%s", "fraction": 0.02e0}', 201, 0.02),
    ('{"kernel_id": "%s", "fraction": 2E-2}', 201, 0.02),
    ('{"kernel_id": "%s", "fraction": 0.0200000000000000000001}', 201, 0.02),
    ('{"kernel_id": "%s", "fraction": 1}', 201, 1.0),
    ('{"kernel_id": "%s", "fraction": "0.02e0"}', 400, "without quotes"),
    ('{"kernel_id": "%s", "fraction": "0.02"}', 400, "without quotes"),
    ('{"kernel_id": "%s", "fraction": "NaN"}', 400, "without quotes"),
    ('{"kernel_id": "%s", "fraction": NaN}', 400, "NaN"),
    ('{"kernel_id": "%s", "fraction": -Infinity}', 400, "Infinity"),
    ('{"kernel_id": "%s", "fraction": 1e-9}', 400, "smallest fraction"),
    ('{"kernel_id": "%s", "fraction": 5e-324}', 400, "smallest fraction"),
    ('{"kernel_id": "%s", "fraction": -0}', 400, "greater than 0"),
    ('{"kernel_id": "%s", "fraction": 0.000001}', 422, "smallest fraction"),
    ('{"kernel_id": "%s", "fraction": 1.0000001}', 400, "at most 1"),
    ('{"kernel_id": "%s", "fraction": 1' + "0" * 4000 + "}", 400, "at most 1"),
    ('{"kernel_id": "%s", "fraction": 1' + "0" * 4400 + "}", 413, "bytes"),
    ('{"kernel_id": "%s", "fraction": 0.02, "wait": 1e999}', 400, "finite"),
    ('{"kernel_id": "%s", "fraction": 0.02, "wait": -1}', 400, "between 0 and 300"),
]

#: kernel ids: accepted (and given back unchanged) or refused with a sentence
KERNEL_IDS: list[tuple[str, int]] = [
    ("核-🙂-ß-Ω≈ç√", 201),
    ("x" * 255, 201),
    ("x" * 256, 400),  # the store holds 255
    ("🙂" * 255, 201),  # 255 characters, 1020 bytes
    ("🙂" * 256, 400),
    ("a b", 201),
    ("../../etc/passwd", 201),  # an id, not a path: stored and shown as is
    ("<script>alert(1)</script>", 201),
    ("a\u202eb", 400),  # right-to-left override
    ("a\u200db", 400),  # zero-width joiner
    ("a\x00b", 400),
    ("a\nb", 400),
    ("\ud800", 400),  # a lone surrogate
    ("", 400),
    (" ", 201),
]


@pytest.mark.broker_args(*BROKER)
def test_number_spellings_and_kernel_ids(broker: Broker) -> None:
    target = Target(broker, "alice")
    failures = []
    for text, status, expect in NUMBERS:
        body = Raw(text % f"k-{uuid.uuid4()}")
        r = target.send("POST", "/leases", body)
        if r.status_code != status:
            failures.append(f"{text[:60]}: {r.status_code} {r.text[:200]}")
        elif status < 300:
            assert r.json()["fraction"] == expect
            target.reset()
        elif expect not in r.json()["message"]:
            failures.append(f"{text[:60]}: {r.json()['message']!r} lacks {expect!r}")
    for kernel_id, status in KERNEL_IDS:
        r = target.send("POST", "/leases", {"kernel_id": kernel_id, "fraction": 0.02})
        if r.status_code != status:
            failures.append(f"kernel_id {kernel_id[:20]!r}: {r.status_code} {r.text[:200]}")
        elif status < 300:
            lease = r.json()
            assert lease["kernel_id"] == kernel_id
            again = target.client.get(f"/leases/{lease['id']}").json()
            assert again["kernel_id"] == kernel_id
            target.reset()
    assert not failures, "\n".join(failures)
    target.close()


@pytest.mark.broker_args(*BROKER)
def test_unicode_user_names(broker: Broker) -> None:
    """Users named in any script (and with a slash) get leases, quotas and usage; the
    name travels through the tokens file, the database and URL paths unchanged."""
    names = ["zoë", "学生", "🙂", "Ω≈ç√", "a/b", "x%2Fy", "o'brien", "a b"]
    add_tokens(broker, {n: {"user": n, "groups": ["ml101"]} for n in names})
    with httpx.Client(
        base_url=f"{broker.url}/api/v1", headers=broker.headers("admin"), timeout=30
    ) as admin:
        for name in names:
            path = "/quotas/users/" + urllib.parse.quote(name, safe="")
            r = admin.put(path, json={"max_leases": 2, "max_fraction": 0.1})
            assert r.status_code == 200, (name, r.text)
            with httpx.Client(
                base_url=f"{broker.url}/api/v1", headers=broker.headers(name), timeout=30
            ) as c:
                me = c.get("/quotas/me").json()
                assert me["user"] == name and me["effective"]["max_leases"] == 2, me
                own = c.get(path)
                assert own.status_code == 200, (name, own.text)
                lease = c.post("/leases", json={"kernel_id": "k", "fraction": 0.05})
                assert lease.status_code == 201 and lease.json()["user"] == name, lease.text
                over = c.post("/leases", json={"kernel_id": "k2", "fraction": 0.06})
                assert over.status_code == 403, over.text  # max_fraction 0.1
                assert c.get("/usage").json().keys() == {name}
            listed = admin.get("/leases", params={"user": name}).json()["leases"]
            assert [x["user"] for x in listed] == [name]
        everyone = {x["user"] for x in admin.get("/leases", params={"all": "1"}).json()["leases"]}
        assert everyone == set(names)
        quotas = admin.get("/quotas").json()["users"]
        assert set(names) <= set(quotas)
    assert_capacity(broker)


@BOTH_DATABASES
@pytest.mark.broker_args(*BROKER)
def test_ids_and_names_the_store_cannot_hold_are_refused(broker: Broker) -> None:
    """A NUL or 256 characters in an id or name is a 400, never a 500 or a 503 (PostgreSQL
    refuses NUL in text and 256 characters in the store's 255-character columns)."""
    target = Target(broker, "admin")
    nul = "a%00b"
    for method, path, body in (
        ("GET", f"/leases/{nul}", None),
        ("DELETE", f"/leases/{nul}", None),
        ("POST", f"/leases/{nul}/renew", {}),
        ("POST", f"/leases/{nul}/revoke", {"reason": "x"}),
        ("GET", f"/quotas/users/{nul}", None),
        ("PUT", f"/quotas/users/{nul}", {"max_leases": 1}),
        ("DELETE", f"/quotas/groups/{nul}", None),
        ("PUT", "/quotas/groups/" + "g" * 256, {"max_leases": 1}),
        ("GET", "/leases/" + "i" * 256, None),
        ("GET", "/leases?history=1&user=a%00", None),
        ("GET", "/usage?by=user%00", None),
        ("POST", "/leases", {"kernel_id": "k" * 256, "fraction": 0.02}),
        ("POST", "/leases", {"kernel_id": "k", "fraction": 0.02, "group": "g" * 256}),
        ("POST", "/leases", {"kernel_id": "k", "fraction": 0.02, "node": "n" * 256}),
    ):
        r = target.send(method, path, body)
        assert r.status_code == 400, (method, path, r.status_code, r.text)
    # the longest that fits is accepted, in any script
    for kernel_id in ("k" * 255, "核" * 255):
        r = target.send("POST", "/leases", {"kernel_id": kernel_id, "fraction": 0.02})
        assert r.status_code == 201 and r.json()["kernel_id"] == kernel_id, r.text
        target.reset()
    r = target.send("PUT", "/quotas/users/" + "u" * 255, {"max_leases": 1})
    assert r.status_code == 200, r.text
    assert target.admin.get("/quotas/users/" + "u" * 255).json()["max_leases"] == 1
    target.close()


# -- bounds --------------------------------------------------------------------------------


@pytest.mark.broker_args(*BROKER)
def test_body_size_is_bounded(broker: Broker) -> None:
    target = Target(broker, "alice")
    head = '{"kernel_id": "big", "fraction": 0.02}'
    exact = head + " " * (BODY_LIMIT - len(head))
    assert len(exact.encode()) == BODY_LIMIT
    r = target.send("POST", "/leases", Raw(exact))
    assert r.status_code == 201, r.text
    target.reset()
    r = target.send("POST", "/leases", Raw(exact + " "))
    assert r.status_code == 413 and r.json()["error"] == "body_too_large", r.text
    # chunked, without a Content-Length: counted as it arrives
    chunks = [b" " * 1000] * 10 + [head.encode()]
    r = target.client.post("/leases", content=iter(chunks))
    assert r.status_code == 413, r.text
    # a declared length beyond what the broker ever reads: refused before the body
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        s.sendall(
            b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: token {broker.tokens['alice']}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
        )
        answer = s.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "connection: close" in answer.lower() and "body_too_large" in answer
    assert state(broker) == target.before
    target.close()


@pytest.mark.broker_args(*BROKER)
def test_queue_length_per_user_is_bounded(broker: Broker) -> None:
    target = Target(broker, "alice")
    with httpx.Client(
        base_url=f"{broker.url}/api/v1", headers=broker.headers("admin"), timeout=30
    ) as admin:
        for n in range(2):  # fill both GPUs
            assert (
                admin.post("/leases", json={"kernel_id": f"f{n}", "fraction": 1}).status_code == 201
            )
    target.before = state(broker)
    ids = []
    for n in range(MAX_QUEUED):
        r = target.client.post("/leases", json={"kernel_id": f"q{n}", "fraction": 0.5})
        assert r.status_code == 202 and r.json()["position"] == n + 1, r.text
        ids.append(r.json()["id"])
    target.before = state(broker)
    # asking again for a queued kernel keeps its place and is not a new request
    again = target.client.post("/leases", json={"kernel_id": "q0", "fraction": 0.5})
    assert again.status_code == 202 and again.json()["id"] == ids[0]
    for n in range(MAX_QUEUED, MAX_QUEUED + 5):
        r = target.send("POST", "/leases", {"kernel_id": f"q{n}", "fraction": 0.5})
        assert r.status_code == 403 and r.json()["error"] == "quota_exceeded", r.text
        assert f"{MAX_QUEUED} GPU kernels waiting" in r.json()["message"]
    mine = [q for q in state(broker)["queue"]["queue"] if q["user"] == "alice"]
    assert len(mine) == MAX_QUEUED
    # the bound is per user: bob still gets a place; cancelling one frees one of alice's
    with httpx.Client(
        base_url=f"{broker.url}/api/v1", headers=broker.headers("bob"), timeout=30
    ) as bob:
        assert bob.post("/leases", json={"kernel_id": "b", "fraction": 0.5}).status_code == 202
    assert target.client.delete(f"/leases/{ids[0]}").status_code == 204
    r = target.client.post("/leases", json={"kernel_id": "q-last", "fraction": 0.5})
    assert r.status_code == 202, r.text
    target.close()
