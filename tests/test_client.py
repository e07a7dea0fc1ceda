"""Tests of provisioner.client.BrokerClient.

The broker's side of each HTTP exchange is played through httpx.MockTransport,
the client's injectable transport seam; the client itself is the real one. Real
broker round trips are covered by the integration tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from provisioner import errors
from provisioner.client import BrokerClient, GrantedLease, LeasedGPU, Renewal
from provisioner.node_report import DriverLimitsReport, MPSReport, NodeReport

URL = "http://broker.test:10101"
TOKEN = "s3cret-token-value"

LEASE = {
    "id": "L-abc",
    "user": "alice",
    "kernel_id": "k1",
    "fraction": 0.02,
    "gpu": {"uuid": "GPU-0", "node": "n1", "name": "V100", "memory_mb": 32768},
    "memory_limit_mb": 143,
    "state": "active",
}
#: LEASE as the client's lease calls return it
TYPED = GrantedLease(
    id="L-abc",
    user="alice",
    kernel_id="k1",
    fraction=0.02,
    gpu=LeasedGPU(uuid="GPU-0", node="n1", name="V100", memory_mb=32768),
    memory_limit_mb=143,
    state="active",
)

Handler = Callable[[httpx.Request], httpx.Response]


class Broker:
    """Plays the broker: answers requests from a script and records them."""

    def __init__(self, *answers: httpx.Response | Exception | Handler) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, httpx.Response):
            return answer
        return answer(request)

    @property
    def bodies(self) -> list[Any]:
        return [json.loads(r.content) if r.content else None for r in self.requests]


def client(broker: Broker, url: str = URL, token: str | None = TOKEN, **kw: Any) -> BrokerClient:
    kw.setdefault("backoff", 0.001)
    kw.setdefault("max_backoff", 0.002)
    return BrokerClient(url, token, transport=httpx.MockTransport(broker), **kw)


def error(status: int, code: str, message: str, **extra: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "message": message, **extra})


# -- acquire -------------------------------------------------------------------
async def test_acquire_201_returns_the_lease() -> None:
    broker = Broker(httpx.Response(201, json=LEASE))
    async with client(broker) as c:
        lease = await c.leases.acquire(
            "k1", 0.02, node="n1", gpu_uuids=["GPU-0"], group="ml101", wait=5
        )
    assert lease == TYPED
    (req,) = broker.requests
    assert req.method == "POST"
    assert str(req.url) == f"{URL}/api/v1/leases"
    assert req.headers["Content-Type"] == "application/json"
    assert broker.bodies == [
        {
            "kernel_id": "k1",
            "fraction": 0.02,
            "node": "n1",
            "gpu_uuids": ["GPU-0"],
            "group": "ml101",
            "wait": 5,
        }
    ]


async def test_acquire_200_existing_lease_and_optional_fields_left_out() -> None:
    broker = Broker(httpx.Response(200, json=LEASE))
    async with client(broker) as c:
        assert await c.leases.acquire("k1", 0.02) == TYPED
    assert broker.bodies == [{"kernel_id": "k1", "fraction": 0.02, "wait": 30.0}]


@pytest.mark.parametrize("async_callback", [False, True])
async def test_acquire_queued_twice_then_granted(async_callback: bool) -> None:
    broker = Broker(
        httpx.Response(202, json={"queued": True, "position": 3, "id": "R1"}),
        httpx.Response(202, json={"queued": True, "position": 2, "id": "R1"}),
        httpx.Response(201, json=LEASE),
    )
    seen: list[int] = []

    def sync_cb(body: dict[str, Any]) -> None:
        seen.append(body["position"])

    async def async_cb(body: dict[str, Any]) -> None:
        seen.append(body["position"])

    async with client(broker) as c:
        lease = await c.leases.acquire(
            "k1", 0.5, wait=1, on_queued=async_cb if async_callback else sync_cb
        )
    assert lease == TYPED
    assert seen == [3, 2]
    assert len(broker.requests) == 3
    assert broker.bodies[0] == broker.bodies[1] == broker.bodies[2]
    assert all(r.method == "POST" and r.url.path == "/api/v1/leases" for r in broker.requests)


async def test_acquire_queue_timeout_raises_no_capacity_and_cancels() -> None:
    queued = {
        "queued": True,
        "position": 4,
        "id": "R 7",
        "message": "Your request waits at position 4.",
        "reason": "The GPU you may use is full: GPU 0 (V100) is 100 percent allocated.",
    }
    broker = Broker(
        lambda r: httpx.Response(202, json=queued) if r.method == "POST" else httpx.Response(204)
    )
    positions: list[int] = []
    async with client(broker) as c:
        with pytest.raises(errors.NoCapacity) as info:
            await c.leases.acquire(
                "k1", 0.25, queue_timeout=0, on_queued=lambda b: positions.append(b["position"])
            )
    exc = info.value
    assert "position 4" in exc.message
    # the broker's reason is quoted; its message (which repeats the place) is not
    assert "GPU 0 (V100) is 100 percent allocated" in exc.message
    assert "waits at position 4" not in exc.message
    assert exc.details["position"] == 4
    assert exc.details["body"] == queued
    assert positions == [4]
    assert broker.bodies[0]["wait"] == 0
    assert [r.method for r in broker.requests] == ["POST", "DELETE"]
    assert broker.requests[1].url.raw_path == b"/api/v1/leases/R%207"


async def test_queue_timeout_after_several_polls_with_shrinking_wait() -> None:
    broker = Broker(lambda r: httpx.Response(202, json={"queued": True, "position": 1}))
    async with client(broker, backoff=0.01) as c:
        with pytest.raises(errors.NoCapacity, match="position 1"):
            await c.leases.acquire("k1", 0.25, wait=30, queue_timeout=0.05)
    waits = [b["wait"] for b in broker.bodies]
    assert len(waits) >= 2
    assert 0 < waits[0] <= 0.05
    assert waits == sorted(waits, reverse=True)
    # no request id in the 202 body: nothing to cancel
    assert {r.method for r in broker.requests} == {"POST"}


async def test_queue_timeout_cancel_failure_is_ignored() -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        if r.method == "POST":
            return httpx.Response(202, json={"queued": True, "position": 2, "id": "R1"})
        return httpx.Response(500, text="boom")

    async with client(Broker(answer)) as c:
        with pytest.raises(errors.NoCapacity, match="position 2"):
            await c.leases.acquire("k1", 0.25, queue_timeout=0)


@pytest.mark.parametrize(
    ("wait", "queue_timeout", "low", "high"),
    [(30, None, 30, 30), (1000, None, 300, 300), (30, 5, 4.5, 5), (float("inf"), None, 300, 300)],
)
async def test_long_poll_wait_and_read_timeout(
    wait: float, queue_timeout: float | None, low: float, high: float
) -> None:
    broker = Broker(httpx.Response(201, json=LEASE))
    async with client(broker, timeout=7) as c:
        await c.leases.acquire("k1", 0.1, wait=wait, queue_timeout=queue_timeout)
    sent = broker.bodies[0]["wait"]
    assert low <= sent <= high
    timeouts = broker.requests[0].extensions["timeout"]
    assert timeouts["read"] == pytest.approx(sent + 7)
    assert timeouts["connect"] == 7


async def test_nan_fraction_is_refused_before_sending() -> None:
    broker = Broker(httpx.Response(201, json=LEASE))
    async with client(broker) as c:
        with pytest.raises(errors.InvalidRequest, match="finite"):
            await c.leases.acquire("k1", float("nan"))
    assert broker.requests == []


# -- broker error bodies ---------------------------------------------------------
async def test_403_quota_body_becomes_quota_exceeded() -> None:
    msg = "This would hold 0.6 GPU; your quota is 0.5. Release a kernel first."
    broker = Broker(error(403, "quota_exceeded", msg, limit="max_fraction"))
    async with client(broker) as c:
        with pytest.raises(errors.QuotaExceeded) as info:
            await c.leases.acquire("k1", 0.6)
    assert info.value.message == msg
    assert info.value.details == {"limit": "max_fraction"}
    assert len(broker.requests) == 1  # not retried


async def test_410_renew_becomes_lease_revoked_with_reason() -> None:
    broker = Broker(
        error(
            410, "revoked", "Your kernel was idle and others wait.", state="revoked", reason="idle"
        )
    )
    async with client(broker) as c:
        with pytest.raises(errors.LeaseRevoked) as info:
            await c.leases.renew(
                "L-abc", Renewal(pid=42, execution_state="idle", last_activity=1700000000.5)
            )
    assert info.value.details["reason"] == "idle"
    (req,) = broker.requests
    assert (req.method, req.url.path) == ("POST", "/api/v1/leases/L-abc/renew")
    assert broker.bodies == [{"pid": 42, "execution_state": "idle", "last_activity": 1700000000.5}]


async def test_renew_sends_only_given_fields_and_returns_lease() -> None:
    broker = Broker(httpx.Response(200, json=LEASE))
    async with client(broker) as c:
        assert await c.leases.renew("L-abc") == TYPED
    assert broker.bodies == [{}]


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(204),
        error(404, "not_found", "No such lease."),
        error(410, "gone", "The lease has ended.", state="released"),
        error(410, "expired", "The lease expired.", state="expired"),
    ],
)
async def test_release_is_idempotent(answer: httpx.Response) -> None:
    broker = Broker(answer)
    async with client(broker) as c:
        await c.leases.release("L/1")
    (req,) = broker.requests
    assert req.method == "DELETE"
    assert req.url.raw_path == b"/api/v1/leases/L%2F1"


async def test_release_does_not_swallow_a_404_that_is_not_the_brokers() -> None:
    broker = Broker(httpx.Response(404, text="<html>404: Not Found</html>"))
    async with client(broker) as c:
        with pytest.raises(errors.BrokerUnavailable, match="GPU_LEASE_URL"):
            await c.leases.release("L-abc")


async def test_release_raises_other_errors() -> None:
    broker = Broker(error(403, "forbidden", "This lease is not yours."))
    async with client(broker) as c:
        with pytest.raises(errors.Forbidden, match="not yours"):
            await c.leases.release("L-abc")


# -- retries and outages -----------------------------------------------------------
async def test_connection_errors_then_success() -> None:
    broker = Broker(
        httpx.ConnectError("Connection refused"),
        httpx.ConnectError("Connection refused"),
        httpx.Response(200, json={"status": "ok"}),
    )
    async with client(broker) as c:
        assert await c.health() == {"status": "ok"}
    assert len(broker.requests) == 3


async def test_always_failing_raises_broker_unavailable_without_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    broker = Broker(httpx.ConnectError(f"Connection refused (sent {TOKEN})"))
    async with client(broker, retries=3) as c:
        with pytest.raises(errors.BrokerUnavailable) as info:
            await c.gpus()
    exc = info.value
    assert len(broker.requests) == 4
    assert URL in exc.message
    assert "Is the gpu-lease broker running?" in exc.message
    assert "GPU_LEASE_URL" in exc.message
    assert "4 attempts" in exc.message
    assert TOKEN not in str(exc) and TOKEN not in repr(exc.details)
    assert TOKEN not in caplog.text
    assert TOKEN not in repr(c)
    assert isinstance(exc.__cause__, httpx.ConnectError)
    assert any(r.name == "gpu_lease.client" for r in caplog.records)


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_gateway_errors_are_retried(status: int) -> None:
    broker = Broker(
        httpx.Response(status, text="Service Unavailable"), httpx.Response(200, json={"ok": 1})
    )
    async with client(broker) as c:
        assert await c.health() == {"ok": 1}
    assert len(broker.requests) == 2


async def test_persistent_503_keeps_the_brokers_message() -> None:
    broker = Broker(error(503, "store_unavailable", "The database is unreachable."))
    async with client(broker, retries=2) as c:
        with pytest.raises(errors.BrokerUnavailable) as info:
            await c.leases.listing()
    assert len(broker.requests) == 3
    assert "The database is unreachable." in info.value.message
    assert URL in info.value.message


async def test_read_timeout_retried_for_ordinary_calls() -> None:
    broker = Broker(httpx.ReadTimeout("timed out"), httpx.Response(200, json={"status": "ok"}))
    async with client(broker) as c:
        assert await c.health() == {"status": "ok"}
    assert len(broker.requests) == 2


async def test_read_timeout_of_a_long_poll_is_not_retried() -> None:
    broker = Broker(httpx.ReadTimeout("timed out"), httpx.Response(201, json=LEASE))
    async with client(broker) as c:
        with pytest.raises(errors.BrokerUnavailable, match="long-poll"):
            await c.leases.acquire("k1", 0.1, wait=2)
    assert len(broker.requests) == 1


async def test_connection_error_during_acquire_is_retried() -> None:
    broker = Broker(httpx.ConnectError("refused"), httpx.Response(201, json=LEASE))
    async with client(broker) as c:
        assert await c.leases.acquire("k1", 0.1) == TYPED
    assert broker.bodies[0] == broker.bodies[1]


async def test_non_json_500_is_a_clear_error_and_not_retried() -> None:
    broker = Broker(
        httpx.Response(500, text="Traceback: KeyError", headers={"Content-Type": "text/plain"})
    )
    async with client(broker) as c:
        with pytest.raises(errors.GPULeaseError) as info:
            await c.leases.queue()
    exc = info.value
    assert type(exc) is errors.GPULeaseError
    assert "HTTP 500" in exc.message and URL in exc.message
    assert "Traceback: KeyError" in exc.message
    assert "broker's log" in exc.message
    assert len(broker.requests) == 1


async def test_non_json_403_from_the_hub_names_the_scope() -> None:
    broker = Broker(httpx.Response(403, text="<html>Forbidden</html>"))
    async with client(broker) as c:
        with pytest.raises(errors.Forbidden, match="access:services!service=gpu-lease"):
            await c.health()


async def test_redirect_is_not_followed_and_explained() -> None:
    broker = Broker(httpx.Response(302, headers={"Location": "/hub/login"}))
    async with client(broker) as c:
        with pytest.raises(errors.GPULeaseError, match="/hub/login"):
            await c.health()
    assert len(broker.requests) == 1


async def test_2xx_that_is_not_json_is_not_the_broker() -> None:
    broker = Broker(httpx.Response(200, text="<html>JupyterHub</html>"))
    async with client(broker) as c:
        with pytest.raises(errors.BrokerUnavailable, match="not JSON"):
            await c.health()


async def test_json_error_without_message_uses_status() -> None:
    broker = Broker(httpx.Response(422, json={"detail": "?"}))
    async with client(broker) as c:
        with pytest.raises(errors.CannotFit, match="HTTP 422"):
            await c.leases.acquire("k1", 0.0001)


# -- headers and URLs ----------------------------------------------------------------
async def test_authorization_and_user_agent_headers() -> None:
    broker = Broker(httpx.Response(200, json={"status": "ok"}))
    async with client(broker, user_agent="ua/1") as c:
        await c.health()
    req = broker.requests[0]
    assert req.headers["Authorization"] == f"token {TOKEN}"
    assert req.headers["User-Agent"] == "ua/1"
    assert req.headers["Accept"] == "application/json"


async def test_no_authorization_header_without_token() -> None:
    broker = Broker(httpx.Response(200, json={"status": "ok"}))
    async with client(broker, token=None) as c:
        await c.health()
    assert "Authorization" not in broker.requests[0].headers
    assert broker.requests[0].headers["User-Agent"].startswith("jupyter-gpu-lease/")


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://127.0.0.1:10101", "http://127.0.0.1:10101/api/v1/health"),
        ("http://127.0.0.1:10101/", "http://127.0.0.1:10101/api/v1/health"),
        (
            "http://127.0.0.1:8000/services/gpu-lease",
            "http://127.0.0.1:8000/services/gpu-lease/api/v1/health",
        ),
        (
            "http://127.0.0.1:8000/services/gpu-lease/",
            "http://127.0.0.1:8000/services/gpu-lease/api/v1/health",
        ),
        (
            "https://hub.example.org/services/gpu-lease/api/v1/",
            "https://hub.example.org/services/gpu-lease/api/v1/health",
        ),
    ],
)
async def test_url_joining(base: str, expected: str) -> None:
    broker = Broker(httpx.Response(200, json={"status": "ok"}))
    async with client(broker, url=base) as c:
        await c.health()
    assert str(broker.requests[0].url) == expected


@pytest.mark.parametrize("bad", ["", "127.0.0.1:10101", "ftp://host/x", "http://"])
def test_bad_url_is_refused(bad: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="GPU_LEASE_URL"):
        BrokerClient(bad, TOKEN)


async def test_credentials_in_url_are_not_shown() -> None:
    broker = Broker(httpx.ConnectError("refused"))
    async with client(broker, url="http://bob:pw@broker.test:1", retries=0) as c:
        with pytest.raises(errors.BrokerUnavailable) as info:
            await c.health()
    assert "pw" not in info.value.message
    assert "http://broker.test:1" in info.value.message


# -- other endpoints -----------------------------------------------------------------
async def test_list_endpoints_and_query_parameters() -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        key = r.url.path.rsplit("/", 1)[1]
        item = {"id": r.url.path} if key == "leases" else {"path": r.url.path}
        return httpx.Response(200, json={key: [item]})

    broker = Broker(answer)
    async with client(broker) as c:
        assert await c.gpus() == [{"path": "/api/v1/gpus"}]
        assert await c.leases.listing() == [GrantedLease(id="/api/v1/leases")]
        await c.leases.listing(user="bob", all=True)
        assert await c.leases.queue() == [{"path": "/api/v1/queue"}]
    assert broker.requests[1].url.params == httpx.QueryParams()
    assert broker.requests[2].url.params == httpx.QueryParams({"user": "bob", "all": "1"})


async def test_get_lease() -> None:
    broker = Broker(httpx.Response(200, json=LEASE))
    async with client(broker) as c:
        assert await c.leases.get("L-abc") == TYPED
    assert broker.requests[0].url.path == "/api/v1/leases/L-abc"


@pytest.mark.parametrize(
    ("level", "name", "path"),
    [
        ("default", None, "/api/v1/quotas/default"),
        ("user", "alice", "/api/v1/quotas/users/alice"),
        ("group", "ml101", "/api/v1/quotas/groups/ml101"),
        ("users", "a@b.org", "/api/v1/quotas/users/a%40b.org"),
    ],
)
async def test_quota_paths(level: str, name: str | None, path: str) -> None:
    quota = {"max_fraction": 0.5}
    broker = Broker(
        lambda r: httpx.Response(204) if r.method == "DELETE" else httpx.Response(200, json=quota)
    )
    async with client(broker) as c:
        assert await c.quotas.get(level, name) == quota
        assert await c.quotas.put(level, name, quota) == quota
        await c.quotas.delete(level, name)
    assert [(r.method, r.url.raw_path.decode()) for r in broker.requests] == [
        ("GET", path),
        ("PUT", path),
        ("DELETE", path),
    ]
    assert broker.bodies[1] == quota


@pytest.mark.parametrize(
    ("level", "name"), [("course", "x"), ("user", None), ("group", ""), ("default", "x")]
)
async def test_bad_quota_level_or_name(level: str, name: str | None) -> None:
    broker = Broker(httpx.Response(200, json={}))
    async with client(broker) as c:
        with pytest.raises(errors.InvalidRequest):
            await c.quotas.get(level, name)
    assert broker.requests == []


async def test_list_quotas_and_usage() -> None:
    book: dict[str, Any] = {"default": {}, "groups": {}, "users": {}}
    broker = Broker(httpx.Response(200, json=book))
    async with client(broker) as c:
        assert await c.quotas.book() == book
        await c.quotas.usage()
        await c.quotas.usage(since=1700000000.0, by="group")
        await c.quotas.usage(since="7d")
    paths = [r.url.path for r in broker.requests]
    assert paths == ["/api/v1/quotas"] + ["/api/v1/usage"] * 3
    assert broker.requests[1].url.params == httpx.QueryParams({"by": "user"})
    assert broker.requests[2].url.params == httpx.QueryParams(
        {"by": "group", "since": "1700000000.0"}
    )
    assert broker.requests[3].url.params["since"] == "7d"


async def test_node_calls_paths_bodies_and_no_heartbeat_retry() -> None:
    """The agent's calls (``client.nodes``): each one's method, quoted path and body; a
    heartbeat is not retried (the broker's 503 becomes BrokerUnavailable after 1 attempt)."""
    gpus = [{"uuid": "GPU-0", "memory_mb": 1024}]

    def answer(r: httpx.Request) -> httpx.Response:
        if r.url.path.endswith("/heartbeat") and len(broker.requests) > 2:
            return error(503, "broker_unavailable", "standby")
        if r.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(200, json={"nodes": [{"name": "n/1"}], "name": "n/1"})

    broker = Broker(answer)
    async with client(broker) as c:
        assert (await c.nodes.register("n/1", gpus, "9.9", enforce="kill"))["name"] == "n/1"
        mps = MPSReport({"GPU-0": "running"})
        await c.nodes.heartbeat("n/1", NodeReport((), 5.0, (mps, DriverLimitsReport())))
        with pytest.raises(errors.BrokerUnavailable, match="1 attempt"):
            await c.nodes.heartbeat("n/1", NodeReport())
        await c.nodes.drain("n/1")
        assert await c.nodes.listing() == [{"name": "n/1"}]
    assert [(r.method, r.url.raw_path.decode()) for r in broker.requests] == [
        ("PUT", "/api/v1/nodes/n%2F1"),
        ("POST", "/api/v1/nodes/n%2F1/heartbeat"),
        ("POST", "/api/v1/nodes/n%2F1/heartbeat"),
        ("DELETE", "/api/v1/nodes/n%2F1"),
        ("GET", "/api/v1/nodes"),
    ]
    assert broker.bodies[0] == {"gpus": gpus, "agent_version": "9.9", "enforce": "kill"}
    assert broker.bodies[1] == {
        "usage": [],
        "at": 5.0,
        "mps": {"GPU-0": "running"},
        "driver_limits": [],
    }
    assert broker.bodies[2] == {"usage": []}


async def test_unexpected_list_shape_is_reported() -> None:
    broker = Broker(httpx.Response(200, json={"something": "else"}))
    async with client(broker) as c:
        with pytest.raises(errors.BrokerUnavailable, match="'leases' list"):
            await c.leases.listing()


# -- from_env --------------------------------------------------------------------------
async def test_from_env_reads_url_and_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_LEASE_URL", "http://127.0.0.1:8000/services/gpu-lease/")
    monkeypatch.setenv("GPU_LEASE_TOKEN", "lease-token")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "hub-token")
    broker = Broker(httpx.Response(200, json={"status": "ok"}))
    async with BrokerClient.from_env(transport=httpx.MockTransport(broker)) as c:
        assert c.url == "http://127.0.0.1:8000/services/gpu-lease"
        await c.health()
    assert broker.requests[0].headers["Authorization"] == "token lease-token"


async def test_from_env_falls_back_to_hub_token() -> None:
    env = {"GPU_LEASE_URL": URL, "GPU_LEASE_TOKEN": "", "JUPYTERHUB_API_TOKEN": "hub-token"}
    broker = Broker(httpx.Response(200, json={"status": "ok"}))
    async with BrokerClient.from_env(environ=env, transport=httpx.MockTransport(broker)) as c:
        await c.health()
    assert broker.requests[0].headers["Authorization"] == "token hub-token"


async def test_from_env_explicit_arguments_win() -> None:
    env = {"GPU_LEASE_URL": "http://other:1", "GPU_LEASE_TOKEN": "env-token"}
    broker = Broker(httpx.Response(200, json={"status": "ok"}))
    async with BrokerClient.from_env(
        url=URL, token="given", environ=env, transport=httpx.MockTransport(broker), retries=0
    ) as c:
        assert c.retries == 0
        await c.health()
    assert str(broker.requests[0].url).startswith(URL)
    assert broker.requests[0].headers["Authorization"] == "token given"


def test_from_env_without_url_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPU_LEASE_URL", raising=False)
    with pytest.raises(errors.InvalidRequest, match="set GPU_LEASE_URL"):
        BrokerClient.from_env()


# -- a real socket: a minimal HTTP/1.1 server ------------------------------------------------
class SocketServer:
    """Answers each request on 127.0.0.1 with ``answer(head, body)`` (raw response bytes),
    keeping connections alive; records every connection's writer."""

    def __init__(self, answer: Callable[[bytes, bytes], bytes]) -> None:
        self.answer = answer
        self.connections: list[asyncio.StreamWriter] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            writer.write(self.answer(head, body))
            await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def socket_server(answer: Callable[[bytes, bytes], bytes]) -> AsyncIterator[SocketServer]:
    server = SocketServer(answer)
    listening = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listening.close()
        await listening.wait_closed()  # before Python 3.12 this does not wait for handlers:
        for writer in server.connections:  # close the server's side of each connection here,
            writer.close()  # or a handler still pending when the loop ends leaves its socket
            with contextlib.suppress(ConnectionError):  # to the garbage collector
                await writer.wait_closed()  # (a ResourceWarning in a later test)


def http_answer(status: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# -- failover: Retry-After and a new connection per retry (a real socket) ---------------------
async def test_a_503_is_retried_after_its_retry_after_on_a_new_connection() -> None:
    """The first answer (a broker that is not the active one) is a kept-alive 503 with
    ``Retry-After: 0.3``; the client waits that long and retries on a NEW connection,
    which a load balancer may send to the active broker (or a name may resolve anew)."""
    answered = 0

    def answer(head: bytes, body: bytes) -> bytes:
        nonlocal answered
        answered += 1
        if answered == 1:
            refusal = json.dumps({"error": "not_active", "message": "Not the active broker."})
            return http_answer("503 Service Unavailable", refusal.encode(), "Retry-After: 0.3\r\n")
        return http_answer("200 OK", json.dumps({"status": "ok"}).encode())

    async with (
        socket_server(answer) as server,
        BrokerClient(f"http://127.0.0.1:{server.port}", TOKEN, backoff=0.001, max_backoff=5.0) as c,
    ):
        t0 = time.monotonic()
        assert (await c.health())["status"] == "ok"
        waited = time.monotonic() - t0
    connections = server.connections
    assert answered == 2
    assert len(connections) == 2, "the retry reused the connection of the failed answer"
    assert waited >= 0.3


class _ImportSpy:
    """A ``sys.meta_path`` finder that finds nothing and records what was looked up."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        self.names.append(name)


async def test_a_request_looks_up_no_module() -> None:
    """httpcore imports ``sniffio`` at every lock (four times a request); where sniffio
    is missing, each is a failed import that scans ``sys.path`` (0.5-0.8 ms of CPU a
    request). It is a dependency of ours: steady-state requests import nothing."""
    import sys

    lease = json.dumps(LEASE).encode()
    spy = _ImportSpy()
    async with socket_server(lambda head, body: http_answer("200 OK", lease)) as server:
        c = BrokerClient(f"http://127.0.0.1:{server.port}", TOKEN)
        try:
            await c.leases.acquire("k1", 0.02)  # the first request may import what it needs once
            sys.meta_path.insert(0, spy)
            try:
                for _ in range(3):
                    assert (await c.leases.acquire("k1", 0.02)).id == "L-abc"
            finally:
                sys.meta_path.remove(spy)
        finally:
            await c.aclose()
    assert spy.names == []
