"""Authorization and secrets, against a REAL broker subprocess (``conftest.broker``).

- The matrix: every route of the OpenAPI document (``routes.ROUTES``) x every kind
  of caller, with the status each must get, as one table (:data:`EXPECTED`).
- Lease ids are unguessable: 1000 ids from real acquires.
- No secret in kernel.json, in the broker's log (debug level), in error bodies, or in
  the kernel's environment (a real kernel through ``GPULeaseProvisioner``).

SQLite only: who may do what does not depend on the database (``test_broker_api``
runs the API on PostgreSQL too).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.broker.web.routes import PUBLIC_ROUTES, ROUTES
from provisioner.kernel import kernelspecs as ks

from .conftest import Broker
from .hostile import FORGED, add_tokens, assert_capacity, secrets_of

pytestmark = pytest.mark.slow

#: the callers of the matrix. alice owns the lease under test and is in course ml101;
#: carol is in ml101 too; bob and u00 are in no course; admin is a GPU lease admin.
CALLERS = (
    "anonymous",
    "forged",
    "expired",
    "student",
    "other_student",
    "course_member",
    "non_member",
    "instructor",
    "admin",
)
#: caller -> the token label of ``broker.tokens`` (None: no Authorization header)
LABEL = {
    "anonymous": None,
    "forged": "forged",
    "expired": "expired",
    "student": "alice",
    "other_student": "bob",
    "course_member": "carol",
    "non_member": "u00",
    "instructor": "instructor",
    "admin": "admin",
}

PUBLIC = (200,) * 9
USERS_200 = (401, 401, 401, 200, 200, 200, 200, 200, 200)
ADMIN_ONLY = (401, 401, 401, 403, 403, 403, 403, 403, 200)
OWNER = (401, 401, 401, 200, 403, 403, 403, 403, 200)
#: another user's lease is answered as one that does not exist (no oracle)
LEASE_OWNER = (401, 401, 401, 200, 404, 404, 404, 404, 200)

#: (method, path template) -> statuses in the order of CALLERS.
#: "instructor" is a member of ml101 without admin rights: quotas need a GPU lease admin;
#: the one instructor's right is over the course's class sessions (the courses file names
#: the course's instructors: :data:`COURSES`).
EXPECTED: dict[tuple[str, str], tuple[int, ...]] = {
    ("GET", "/api/v1/health"): PUBLIC,
    ("GET", "/api/v1/openapi.json"): PUBLIC,
    # it names users and lease ids: an admin's token, or a metrics token
    ("GET", "/metrics"): ADMIN_ONLY,
    ("GET", "/api/v1/gpus"): USERS_200,
    ("GET", "/api/v1/leases"): USERS_200,
    # a course (ml101) kernel: members and admins only
    ("POST", "/api/v1/leases"): (401, 401, 401, 201, 403, 201, 403, 201, 201),
    ("GET", "/api/v1/leases/{lease_id}"): LEASE_OWNER,
    ("DELETE", "/api/v1/leases/{lease_id}"): tuple(204 if s == 200 else s for s in LEASE_OWNER),
    ("POST", "/api/v1/leases/{lease_id}/renew"): LEASE_OWNER,
    ("POST", "/api/v1/leases/{lease_id}/revoke"): ADMIN_ONLY,
    # resuming a lease that is not parked: 200 at once for its owner (and an admin)
    ("POST", "/api/v1/leases/{lease_id}/resume"): LEASE_OWNER,
    # remote kernels, on the matrix's lease (on the broker's declared GPU, which no node
    # agent launches for): its holder learns why (409), an admin may not launch as them
    # (403), anyone else gets the unknown id's 404; no kernel was launched to read or signal
    ("PUT", "/api/v1/leases/{lease_id}/kernel"): (401, 401, 401, 409, 404, 404, 404, 404, 403),
    ("GET", "/api/v1/leases/{lease_id}/kernel"): (401, 401, 401, 404, 404, 404, 404, 404, 404),
    ("POST", "/api/v1/leases/{lease_id}/kernel/signal"): (401, 401, 401) + (404,) * 6,
    ("GET", "/api/v1/queue"): USERS_200,
    ("GET", "/api/v1/quotas"): ADMIN_ONLY,
    ("GET", "/api/v1/quotas/me"): USERS_200,
    ("GET", "/api/v1/quotas/default"): USERS_200,
    ("PUT", "/api/v1/quotas/default"): ADMIN_ONLY,
    ("DELETE", "/api/v1/quotas/default"): tuple(204 if s == 200 else s for s in ADMIN_ONLY),
    # the user quota of alice: she may read it, nobody but an admin may change it
    ("GET", "/api/v1/quotas/users/{name}"): OWNER,
    ("PUT", "/api/v1/quotas/users/{name}"): ADMIN_ONLY,
    ("DELETE", "/api/v1/quotas/users/{name}"): tuple(204 if s == 200 else s for s in ADMIN_ONLY),
    # the group quota of ml101: its members may read it
    ("GET", "/api/v1/quotas/groups/{name}"): (401, 401, 401, 200, 403, 200, 403, 200, 200),
    ("PUT", "/api/v1/quotas/groups/{name}"): ADMIN_ONLY,
    ("DELETE", "/api/v1/quotas/groups/{name}"): tuple(204 if s == 200 else s for s in ADMIN_ONLY),
    ("GET", "/api/v1/usage"): USERS_200,
    ("GET", "/api/v1/history"): USERS_200,
    # nodes: anyone may read the summary; only an admin (or the node's own agent token)
    # registers, heartbeats or drains a node
    ("GET", "/api/v1/nodes"): USERS_200,
    ("PUT", "/api/v1/nodes/{node}"): ADMIN_ONLY,
    ("POST", "/api/v1/nodes/{node}/heartbeat"): ADMIN_ONLY,
    # the orders long-poll (no cursor: answered at once)
    ("GET", "/api/v1/nodes/{node}/orders"): ADMIN_ONLY,
    ("DELETE", "/api/v1/nodes/{node}"): tuple(204 if s == 200 else s for s in ADMIN_ONLY),
    # class sessions: anyone reads the timetable; ml101's instructor (ingrid, in the courses
    # file) and admins start, extend and end its sessions, its members do not
    ("GET", "/api/v1/sessions"): USERS_200,
    ("POST", "/api/v1/sessions/{course}"): (401, 401, 401, 403, 403, 403, 403, 201, 201),
    ("PATCH", "/api/v1/sessions/{course}"): (401, 401, 401, 403, 403, 403, 403, 200, 200),
    ("DELETE", "/api/v1/sessions/{course}"): (401, 401, 401, 403, 403, 403, 403, 200, 200),
}
#: the courses file of the matrix (ml101's instructor)
COURSES = Path(__file__).resolve().parent / "authz_courses.toml"
SESSION = "/api/v1/sessions/ml101"

#: the node the matrix registers (as an admin) before each cell
NODE = "authz-node"
NODE_BODY = {
    "gpus": [{"uuid": "GPU-authz-0", "name": "T4", "memory_mb": 16384, "index": 0}],
    "agent_version": "authz-test",
}

BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/api/v1/leases"): "acquire",
    ("POST", "/api/v1/leases/{lease_id}/renew"): {"execution_state": "idle"},
    ("POST", "/api/v1/leases/{lease_id}/revoke"): {"reason": "authorization test"},
    ("POST", "/api/v1/leases/{lease_id}/resume"): {},
    ("PUT", "/api/v1/leases/{lease_id}/kernel"): {
        "kernel_id": "authz-kernel",
        "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "key": "k" * 32,
    },
    ("POST", "/api/v1/leases/{lease_id}/kernel/signal"): {"signal": "SIGINT"},
    ("PUT", "/api/v1/quotas/default"): {"max_leases": 100},
    ("PUT", "/api/v1/quotas/users/{name}"): {"max_leases": 100},
    ("PUT", "/api/v1/quotas/groups/{name}"): {"max_leases": 100},
    ("PUT", "/api/v1/nodes/{node}"): NODE_BODY,
    ("POST", "/api/v1/nodes/{node}/heartbeat"): {"usage": []},
    ("POST", "/api/v1/sessions/{course}"): "session",
    ("PATCH", "/api/v1/sessions/{course}"): "later",
}


@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


def matrix_tokens(broker: Broker) -> None:
    """The callers that ``conftest.USERS`` lacks: an expired token of alice, an instructor."""
    add_tokens(
        broker,
        {
            "expired": {"user": "alice", "groups": ["ml101"], "expires_at": "2020-01-01T00:00:00Z"},
            "instructor": {"user": "ingrid", "groups": ["ml101"]},
        },
    )
    broker.tokens["forged"] = FORGED


def test_the_table_covers_every_route() -> None:
    assert set(EXPECTED) == set(ROUTES)
    for route, statuses in EXPECTED.items():
        assert len(statuses) == len(CALLERS), route
        if route in PUBLIC_ROUTES:
            assert statuses == PUBLIC, route


@pytest.mark.broker_args("--gpus", "2x32768:V100", "--quotas-file", str(COURSES))
def test_authorization_matrix(broker: Broker) -> None:
    matrix_tokens(broker)
    got: dict[tuple[str, str], tuple[int, ...]] = {}
    errors_seen: list[str] = []
    with httpx.Client(
        base_url=broker.url, timeout=30, event_hooks=broker.conformance.sync_hooks()
    ) as c:

        def as_(label: str | None, method: str, path: str, body: Any = None) -> httpx.Response:
            return c.request(method, path, headers=broker.headers(label), json=body)

        for method, template in ROUTES:
            row = []
            for caller in CALLERS:
                # fresh state for each cell: alice's lease and the quotas under test
                lease = as_("alice", "POST", "/api/v1/leases", _acquire_body(0.02))
                assert lease.status_code == 201, lease.text
                for path in ("/api/v1/quotas/users/alice", "/api/v1/quotas/groups/ml101"):
                    assert as_("admin", "PUT", path, {"max_leases": 100}).status_code == 200
                node = as_("admin", "PUT", f"/api/v1/nodes/{NODE}", NODE_BODY)
                assert node.status_code == 200, node.text
                if template == "/api/v1/sessions/{course}" and method != "POST":
                    r = as_("admin", "POST", SESSION, _session_body())  # one to extend or end
                    assert r.status_code == 201, r.text
                path = template.format(
                    lease_id=lease.json()["id"], name="_", node=NODE, course="ml101"
                )
                path = path.replace("/users/_", "/users/alice").replace(
                    "/groups/_", "/groups/ml101"
                )
                body = BODIES.get((method, template))
                if body == "acquire":
                    body = _acquire_body(0.02, group="ml101")
                elif body == "session":
                    body = _session_body()
                elif body == "later":
                    body = {"until": time.time() + 7200}
                r = as_(LABEL[caller], method, path, body)
                row.append(r.status_code)
                if r.status_code >= 400:
                    errors_seen.append(r.text)
                    _check_error(r, caller)
                # undo: every lease ends, so each cell starts from the same pool
                for x in as_("admin", "GET", "/api/v1/leases?all=1").json()["leases"]:
                    as_("admin", "DELETE", f"/api/v1/leases/{x['id']}")
                assert as_("admin", "DELETE", SESSION).status_code in (200, 409)
            got[(method, template)] = tuple(row)
    assert_capacity(broker)
    mismatches = [
        f"{m} {p}: "
        + ", ".join(
            f"{c}={g} (want {w})"
            for c, g, w in zip(CALLERS, got[(m, p)], want, strict=True)
            if g != w
        )
        for (m, p), want in EXPECTED.items()
        if got[(m, p)] != want
    ]
    assert not mismatches, "\n".join(mismatches)
    leaked = [t for t in secrets_of(broker) if any(t in text for text in errors_seen)]
    assert not leaked, "an error body contains a token"


def _acquire_body(fraction: float, **extra: Any) -> dict[str, Any]:
    return {"kernel_id": f"k-{uuid.uuid4()}", "fraction": fraction, **extra}


def _session_body() -> dict[str, Any]:
    return {"until": time.time() + 3600, "seats": 1, "kernel_fraction": 0.02}


def _check_error(r: httpx.Response, caller: str) -> None:
    body = r.json()
    assert set(body) >= {"error", "message"}, body
    assert body["message"].rstrip().endswith("."), body
    if r.status_code == 401:
        assert r.headers.get("www-authenticate", "").startswith("Bearer"), r.headers
        if caller == "expired":
            assert "expired" in body["message"], body
        else:
            assert "expired" not in body["message"], body
    if r.status_code == 403:
        assert body["error"] == "forbidden", body


# -- expiry of static tokens ----------------------------------------------------------------


def test_static_token_expiry_is_checked_on_every_request(broker: Broker) -> None:
    """expires_at in the tokens file: valid before, 401 with a sentence after; no restart."""
    add_tokens(
        broker,
        {
            "soon": {"user": "alice", "expires_at": time.time() + 1.5},
            "iso": {"user": "bob", "expires_at": "2999-12-31"},
        },
    )
    with httpx.Client(
        base_url=f"{broker.url}/api/v1", timeout=10, event_hooks=broker.conformance.sync_hooks()
    ) as c:
        assert c.get("/gpus", headers=broker.headers("soon")).status_code == 200
        assert c.get("/gpus", headers=broker.headers("iso")).status_code == 200
        time.sleep(1.6)
        r = c.get("/gpus", headers=broker.headers("soon"))
        assert r.status_code == 401
        assert r.json()["error"] == "not_authenticated"
        assert "expired at" in r.json()["message"] and "administrator" in r.json()["message"]
        assert broker.tokens["soon"] not in r.text
        assert c.get("/gpus", headers=broker.headers("iso")).status_code == 200


# -- lease ids ----------------------------------------------------------------------------


@pytest.mark.broker_args(
    "--GPULeaseBroker.context_overhead_mb=0", "--GPULeaseBroker.sqlite_synchronous=OFF"
)
def test_lease_ids_are_unguessable(broker: Broker) -> None:
    """1000 real acquires: 1000 distinct 128-bit random ids, no order, no structure."""
    ids: list[str] = []
    with httpx.Client(
        base_url=f"{broker.url}/api/v1",
        headers=broker.headers("alice"),
        timeout=30,
        event_hooks=broker.conformance.sync_hooks(),
    ) as c:
        for n in range(1000):
            r = c.post("/leases", json={"kernel_id": f"k{n}", "fraction": 0.0005})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
    assert len(set(ids)) == 1000
    raw = []
    for x in ids:
        assert len(x) == 22 and set(x) <= set(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        ), x
        assert "alice" not in x
        raw.append(int.from_bytes(base64.urlsafe_b64decode(x + "=="), "big"))
    # every one of the 128 bits is a fair coin (1000 draws: sd 0.016; allow 6 sd)
    for bit in range(128):
        ones = sum((v >> bit) & 1 for v in raw) / len(raw)
        assert 0.40 < ones < 0.60, (bit, ones)
    # no order: consecutive ids go up about as often as down (sd 16 of 999 pairs)
    ups = sum(b > a for a, b in zip(raw, raw[1:], strict=False))
    assert 380 < ups < 620, ups
    # no fixed step between consecutive ids
    assert len({b - a for a, b in zip(raw, raw[1:], strict=False)}) == 999


# -- secrets ------------------------------------------------------------------------------


def test_no_secret_in_kernelspecs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ready kernelspecs and installed ones carry no URL, token or environment."""
    secret = f"tok-{uuid.uuid4().hex}"
    monkeypatch.setenv("GPU_LEASE_TOKEN", secret)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", secret + "hub")
    monkeypatch.setenv("GPU_LEASE_URL", "http://broker.example:10101")
    texts = {
        p.parent.name: p.read_text(encoding="utf-8")
        for p in (Path(__file__).parent.parent / "kernelspecs").glob("*/kernel.json")
    }
    assert len(texts) == 6
    for fraction in (0.02, 0.5, 1):
        for group in (None, "ml101"):
            spec = ks.build_kernelspec(fraction, group=group, enforcement="mps")
            folder = ks.install(spec, f"t-{fraction}-{group}", prefix=str(tmp_path))
            texts[folder] = (Path(folder) / "kernel.json").read_text(encoding="utf-8")
    for name, text in texts.items():
        spec = json.loads(text)
        assert "env" not in spec, name
        lowered = text.lower()
        for word in ("token", "http", "url", "password", "secret", secret, "broker.example"):
            assert word.lower() not in lowered, (name, word)


@pytest.mark.broker_args("--debug", "--gpus", "1x32768:V100")
def test_no_token_in_the_debug_log_or_in_errors(broker: Broker) -> None:
    """Authenticated calls, forged and malformed tokens, errors of every kind: the broker's
    debug log and every answer body contain no token."""
    add_tokens(broker, {"expired": {"user": "alice", "expires_at": 1.0}})
    tokens = secrets_of(broker)
    real = broker.tokens["alice"]
    bodies: list[str] = []
    headers_variants = [
        {"Authorization": f"token {real}"},
        {"Authorization": f"Bearer {real}"},
        {"Authorization": f"token {real}x"},  # forged: the real one plus a character
        {"Authorization": f"token {real[:-1]}"},
        {"Authorization": f"Basic {real}"},
        {"Authorization": f"token {real} {real}"},
        {"Authorization": f"token {real * 200}"},  # too long
        {"Authorization": f"token {broker.tokens['expired']}"},
        {"Authorization": f"token {FORGED}"},
        {"Authorization": f"token {broker.tokens['admin']}"},
    ]
    with httpx.Client(
        base_url=f"{broker.url}/api/v1", timeout=10, event_hooks=broker.conformance.sync_hooks()
    ) as c:
        for h in headers_variants:
            for method, path, body in (
                ("GET", "/gpus", None),
                ("POST", "/leases", {"kernel_id": "k1", "fraction": 0.02}),
                ("POST", "/leases", {"kernel_id": "k1", "fraction": "0.02"}),
                ("POST", "/leases", {"kernel_id": "k2", "fraction": 0.001}),
                ("GET", "/leases/no-such-lease", None),
                ("POST", "/leases/no-such-lease/renew", {"pid": -1}),
                ("PUT", "/quotas/users/bob", {"max_leases": "x"}),
                ("GET", "/nowhere", None),
                ("PATCH", "/gpus", None),
            ):
                r = c.request(method, path, headers=h, json=body)
                assert r.status_code < 500, (method, path, r.text)
                bodies.append(r.text)
        # a token in the query string is not how to authenticate; it is not logged either
        r = c.get("/gpus", params={"token": real})
        assert r.status_code == 401
        bodies.append(r.text)
    broker.stop()
    log = "\n".join(
        (broker.tmp / f"broker-{n}.log").read_text(errors="replace")
        for n in range(1, broker.starts + 1)
    )
    assert "DEBUG" in log or "[D " in log, "the broker did not log at debug level"
    assert "/api/v1/gpus" in log  # requests were logged
    for token in tokens:
        assert token not in log, "a token is in the broker's log"
        assert not any(token in b for b in bodies), "a token is in an answer"


# -- the kernel's environment -------------------------------------------------------------


@pytest.mark.broker_args("--ttl", "6", "--GPULeaseBroker.reap_interval=0.5")
async def test_no_token_in_the_kernel_environment(
    broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel started by GPULeaseProvisioner with GPU_LEASE_TOKEN set and no
    JUPYTERHUB_API_TOKEN: the token's value is nowhere in the kernel's environment, its
    command line, its connection file or the lease state file.

    (``test_provisioner.test_start_env_renew_shutdown`` checks the variable's name with a
    hub token present; this checks the value, everywhere.)
    """
    from .test_provisioner import Specs, kernel, run

    token = broker.tokens["alice"]
    root = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("GPU_LEASE_URL", broker.url)
    monkeypatch.setenv("GPU_LEASE_TOKEN", token)
    for name in ("JUPYTERHUB_API_TOKEN", "GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS"):
        monkeypatch.delenv(name, raising=False)
    Specs(root).add("gpu-0.02", 0.02)
    code = (
        "import json, os, sys; print(json.dumps({'env': dict(os.environ), "
        "'argv': sys.argv, 'orig_argv': getattr(sys, 'orig_argv', [])}))"
    )
    async with kernel("gpu-0.02", tmp_path) as km:
        dump = json.loads((await run(km, code)).strip().splitlines()[-1])
        env = dump["env"]
        assert env.get("GPU_LEASE_ID"), "the kernel got no lease"
        assert "GPU_LEASE_TOKEN" not in env
        assert not any(token in k or token in v for k, v in env.items())
        assert token not in json.dumps(dump)
        files = [
            km.connection_file,
            env["GPU_LEASE_STATE_FILE"],
            f"/proc/{km.provisioner.pid}/environ",  # type: ignore[union-attr]
            f"/proc/{km.provisioner.pid}/cmdline",  # type: ignore[union-attr]
        ]
        for path in files:
            assert not _file_contains(path, token), path


def _file_contains(path: str, text: str) -> bool:
    with open(path, "rb") as f:
        return text.encode() in f.read()
