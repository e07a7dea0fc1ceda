"""Every URL of the broker, once: the route table and the tornado application built from it.

Each :class:`Route` of :data:`TABLE` names a path template (relative to ``base_url``,
OpenAPI style: ``/api/v1/leases/{lease_id}``), the handler class that serves it,
whether it answers without a token (``public``), and the OpenAPI operation of each
method it documents. From the table come:

- :func:`url_specs` — tornado's URL patterns under a base URL (``{x}`` -> ``([^/]+)``,
  a trailing slash accepted unless ``exact``); :func:`make_app` adds the
  authenticator's own routes (the hub OAuth callback with ``--auth hub``) and the
  dashboard's ``{p}static/...`` files (tornado's static handler);
- :func:`openapi_paths` — the ``paths`` of the OpenAPI document, and :func:`build_openapi`,
  the document (``openapi.py``'s schemas, built from ``provisioner.wire``, with these
  paths), which the table hands to the handler of ``openapi.json``; a public operation
  gets ``security: []``;
- :data:`ROUTES` and :data:`PUBLIC_ROUTES` — the documented ``(METHOD, path)`` pairs,
  and those that need no token (the handler learns ``public`` from its route too).

Routes without operations (the dashboard ``GET {p}``, the JSON index
``GET {p}api/v1/``) are served but not part of the documented API.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tornado import web

from ...model import QUOTA_LEVEL_PLURALS
from ...wire import MAX_ID_CHARS, MAX_WAIT, ORDERS_WAIT
from ..services.broker_service import BrokerService
from .auth import Authenticator
from .handlers import (
    MAX_BODY_BYTES,
    DashboardHandler,
    GPUsHandler,
    HealthHandler,
    HistoryHandler,
    IndexHandler,
    KernelHandler,
    KernelSignalHandler,
    LeaseHandler,
    LeasesHandler,
    MetricsHandler,
    MyQuotaHandler,
    NodeHandler,
    NodeHeartbeatHandler,
    NodeOrdersHandler,
    NodesHandler,
    NotFoundHandler,
    OpenAPIHandler,
    QueueHandler,
    QuotaHandler,
    QuotasHandler,
    RenewHandler,
    ResumeHandler,
    RevokeHandler,
    SessionHandler,
    SessionsHandler,
    UsageHandler,
    normalize_base_url,
)
from .openapi import build_document, error_refs, json_response, schema_ref

Operation = dict[str, Any]


@dataclass(frozen=True)
class Route:
    """One URL: path template, handler, public or not, and its documented operations."""

    path: str
    handler: type[web.RequestHandler]
    #: answers without a token (the handler gets ``public=True``; OpenAPI ``security: []``)
    public: bool = False
    #: lower-case method -> OpenAPI operation object (none: served, not documented)
    operations: Mapping[str, Operation] = field(default_factory=dict)
    #: OpenAPI path-level parameters (e.g. ``lease_id``)
    parameters: tuple[dict[str, Any], ...] = ()
    #: more keyword arguments for the handler's ``initialize`` (e.g. a quota level)
    handler_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: no trailing slash accepted (``openapi.json`` names a file)
    exact: bool = False

    def pattern(self, base_url: str) -> str:
        """The tornado regex of this route under ``base_url`` (path arguments captured)."""
        base = normalize_base_url(base_url)
        parts = re.split(r"(\{[^}]+\})", (base + self.path.lstrip("/")))
        regex = "".join("([^/]+)" if p.startswith("{") else re.escape(p) for p in parts)
        if self.exact:
            return regex
        return regex.rstrip("/") + "/?"


def build_openapi(base_url: str = "/") -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of REST API v1 (``openapi.py``'s schemas, the paths of
    :data:`TABLE`), its server at ``base_url``: what ``GET /api/v1/openapi.json`` serves
    (the table hands this function to its handler). Returns a fresh dict each call."""
    return build_document(openapi_paths(), base_url)


def _body(schema: str, *, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema_ref(schema)}}}


_LEASE_ID = {
    "name": "lease_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The lease id.",
}


_NODE = {
    "name": "node",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The node's name (as its agent's --node gives it).",
}


def _name(description: str) -> dict[str, Any]:
    return {
        "name": "name",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": description,
    }


def _quota_operations(level: str, params: list[dict[str, Any]]) -> dict[str, Operation]:
    who = "admin (a user may read their own and their groups' quotas)"
    get_params, ok = params, json_response(schema_ref("QuotaRecord"), f"The {level} quota.")
    errs: tuple[str, ...] = ("400", "401", "403", "404")
    if level == "user":
        get_params = [
            *params,
            {
                "name": "effective",
                "in": "query",
                "schema": {"type": "string", "enum": ["1", "0", "true", "false"]},
                "description": "1: the user's effective quota as admission applies it, with "
                "the source of each value, even when no user quota is set (their groups "
                "from JupyterHub or the tokens file).",
            },
        ]
        ok = {
            "description": "The user's quota record, or with effective=1 the effective quota.",
            "content": {
                "application/json": {
                    "schema": {"anyOf": [schema_ref("QuotaRecord"), schema_ref("EffectiveQuota")]}
                }
            },
        }
        errs = (*errs, "503")
    return {
        "get": {
            "tags": ["quotas"],
            "summary": f"Read the {level} quota; {who}.",
            "operationId": f"get_{level}_quota",
            "parameters": get_params,
            "responses": {"200": ok, **error_refs(*errs)},
        },
        "put": {
            "tags": ["quotas"],
            "summary": f"Set the {level} quota (admin).",
            "operationId": f"put_{level}_quota",
            "parameters": params,
            "requestBody": _body("Quota"),
            "responses": {
                "200": json_response(schema_ref("Quota"), "The quota as stored."),
                **error_refs("400", "401", "403", "413", "503"),
            },
        },
        "delete": {
            "tags": ["quotas"],
            "summary": f"Remove the {level} quota (admin).",
            "operationId": f"delete_{level}_quota",
            "parameters": params,
            "responses": {
                "204": {"description": "Removed (or there was none)."},
                **error_refs("400", "401", "403", "503"),
            },
        },
    }


def _lease_response(description: str = "The lease.") -> dict[str, Any]:
    return json_response(schema_ref("Lease"), description)


# -- the table ------------------------------------------------------------------------------

#: every URL of the broker, in the order the OpenAPI document lists them
TABLE: tuple[Route, ...] = (
    Route("/", DashboardHandler, public=True),
    Route("/api/v1/", IndexHandler, public=True),
    Route(
        "/api/v1/health",
        HealthHandler,
        public=True,
        operations={
            "get": {
                "tags": ["broker"],
                "summary": "Status, version, GPU count and active leases (no token needed).",
                "operationId": "health",
                "responses": {"200": json_response(schema_ref("Health"), "The broker is up.")},
            }
        },
    ),
    Route(
        "/api/v1/openapi.json",
        OpenAPIHandler,
        public=True,
        exact=True,
        handler_kwargs={"document": build_openapi},
        operations={
            "get": {
                "tags": ["broker"],
                "summary": "This OpenAPI document (no token needed).",
                "operationId": "openapi",
                "responses": {"200": json_response({"type": "object"}, "OpenAPI 3.0 document.")},
            }
        },
    ),
    Route(
        "/metrics",
        MetricsHandler,  # public with --no-metrics-auth (the handler checks)
        operations={
            "get": {
                "tags": ["broker"],
                "summary": "Prometheus metrics (text exposition format): an admin's token or "
                "one with the metrics permission, unless the broker runs with --no-metrics-auth.",
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Metrics, all named gpu_lease_*.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **error_refs("401", "403"),
                },
            }
        },
    ),
    Route(
        "/api/v1/gpus",
        GPUsHandler,
        operations={
            "get": {
                "tags": ["gpus"],
                "summary": "The pool: every GPU with its allocation.",
                "operationId": "list_gpus",
                "responses": {
                    "200": json_response(schema_ref("GPUList"), "The GPUs."),
                    **error_refs("401"),
                },
            }
        },
    ),
    Route(
        "/api/v1/leases",
        LeasesHandler,
        operations={
            "get": {
                "tags": ["leases"],
                "summary": "The caller's leases; admins may ask for anyone's or all.",
                "operationId": "list_leases",
                "parameters": [
                    {
                        "name": "user",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "Only this user's leases (another user: admin only).",
                    },
                    {
                        "name": "all",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["0", "1"]},
                        "description": "1: every user's leases (admin only).",
                    },
                    {
                        "name": "history",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["0", "1"]},
                        "description": "1: include ended leases.",
                    },
                ],
                "responses": {
                    "200": json_response(schema_ref("LeaseList"), "The leases."),
                    **error_refs("400", "401", "403"),
                },
            },
            "post": {
                "tags": ["leases"],
                "summary": "Acquire a lease for a kernel (idempotent per user and kernel_id).",
                "description": "201: a new lease. 200: this kernel already holds it. 202: "
                "queued after waiting `wait` seconds; post the same body again to keep "
                "the place.",
                "operationId": "acquire",
                "requestBody": _body("AcquireRequest"),
                "responses": {
                    "200": _lease_response("The lease this kernel already holds."),
                    "201": {
                        **_lease_response("A new lease."),
                        "headers": {
                            "Location": {
                                "schema": {"type": "string"},
                                "description": "The lease's URL.",
                            }
                        },
                    },
                    "202": json_response(schema_ref("Queued"), "Waiting in the queue."),
                    **error_refs("400", "401", "403", "409", "413", "422", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/leases/{lease_id}",
        LeaseHandler,
        parameters=(_LEASE_ID,),
        operations={
            "get": {
                "tags": ["leases"],
                "summary": "One lease (owner or admin).",
                "operationId": "get_lease",
                "responses": {
                    "200": _lease_response(),
                    **error_refs("400", "401", "403", "404"),
                },
            },
            "delete": {
                "tags": ["leases"],
                "summary": "Release the lease (owner or admin); idempotent.",
                "operationId": "release",
                "responses": {
                    "204": {"description": "Released (or already ended)."},
                    **error_refs("400", "401", "403", "404", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/leases/{lease_id}/renew",
        RenewHandler,
        parameters=(_LEASE_ID,),
        operations={
            "post": {
                "tags": ["leases"],
                "summary": "Heartbeat: renew the lease's TTL and report the kernel's activity.",
                "operationId": "renew",
                "requestBody": _body("Heartbeat", required=False),
                "responses": {
                    "200": _lease_response("The renewed lease."),
                    **error_refs("400", "401", "403", "404", "410", "413", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/leases/{lease_id}/resume",
        ResumeHandler,
        parameters=(_LEASE_ID,),
        operations={
            "post": {
                "tags": ["leases"],
                "summary": "Resume a parked lease: get the kernel's GPU memory back on its GPU "
                "(owner or admin).",
                "description": "200: the lease is active (never parked, or resumed). 202: "
                "it is parking, parked (its resume request waits in the queue, at "
                "`position`) or resuming (the node's agent restores it); post again, or "
                "long-poll with `wait`. Another user's lease is 404 like an unknown id; "
                "an ended lease 410 with its reason.",
                "operationId": "resume",
                "requestBody": _body("Resume", required=False),
                "responses": {
                    "200": _lease_response("The lease, active again."),
                    "202": json_response(schema_ref("Resuming"), "Not active yet."),
                    **error_refs("400", "401", "403", "404", "410", "413", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/leases/{lease_id}/kernel",
        KernelHandler,
        parameters=(_LEASE_ID,),
        operations={
            "put": {
                "tags": ["leases"],
                "summary": "Launch the lease's kernel on the lease's node (its holder only).",
                "description": "The node's agent takes the launch from its next heartbeat "
                "(at once: its orders long-poll wakes) and starts the kernel as the holder's "
                "account; follow it with GET. Each launch is a new generation: the node "
                "ends an older one. The key and environment stay in the broker's memory "
                "until the node has them; they are never stored or logged. Another user's "
                "lease is 404 (an admin's 403: the kernel would run as another account); "
                "an ended lease 410; a parked lease, a node whose agent does not launch "
                "kernels, or a lost node 409.",
                "operationId": "launch_kernel",
                "requestBody": _body("KernelLaunch"),
                "responses": {
                    "202": json_response(schema_ref("RemoteKernel"), "Ordered: launching."),
                    **error_refs("400", "401", "403", "404", "409", "410", "413", "503"),
                },
            },
            "get": {
                "tags": ["leases"],
                "summary": "The lease's remote kernel: its state, address and ports (holder "
                "or admin); long-polls with `after`.",
                "operationId": "get_kernel",
                "parameters": [
                    {
                        "name": "after",
                        "in": "query",
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
                        "description": "The `cursor` of the last answer: wait until it changes.",
                    },
                    {
                        "name": "timeout",
                        "in": "query",
                        "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT},
                        "description": "Seconds to wait for a change at most (default 0).",
                    },
                ],
                "responses": {
                    "200": json_response(schema_ref("RemoteKernel"), "The kernel."),
                    **error_refs("400", "401", "403", "404", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/leases/{lease_id}/kernel/signal",
        KernelSignalHandler,
        parameters=(_LEASE_ID,),
        operations={
            "post": {
                "tags": ["leases"],
                "summary": "Have the node send a signal to the running remote kernel "
                "(holder or admin): SIGINT interrupts, SIGTERM/SIGKILL end it.",
                "operationId": "signal_kernel",
                "requestBody": _body("KernelSignal"),
                "responses": {
                    "202": json_response(schema_ref("RemoteKernel"), "Ordered."),
                    **error_refs("400", "401", "403", "404", "409", "410", "413", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/leases/{lease_id}/revoke",
        RevokeHandler,
        parameters=(_LEASE_ID,),
        operations={
            "post": {
                "tags": ["leases"],
                "summary": "End someone's lease (admin); its kernel is shut down and its "
                "owner sees the reason.",
                "operationId": "revoke",
                "requestBody": _body("Revoke"),
                "responses": {
                    "200": _lease_response("The revoked lease."),
                    **error_refs("400", "401", "403", "404", "410", "413", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/nodes",
        NodesHandler,
        operations={
            "get": {
                "tags": ["nodes"],
                "summary": "Registered GPU nodes and their state (admin: GPUs and usage too).",
                "operationId": "list_nodes",
                "responses": {
                    "200": json_response(schema_ref("NodeList"), "The nodes."),
                    **error_refs("401"),
                },
            }
        },
    ),
    Route(
        "/api/v1/nodes/{node}",
        NodeHandler,
        parameters=(_NODE,),
        operations={
            "put": {
                "tags": ["nodes"],
                "summary": "Register or refresh a node's GPUs (its agent's token, or an admin).",
                "operationId": "register_node",
                "requestBody": _body("NodeRegistration"),
                "responses": {
                    "200": json_response(schema_ref("Node"), "The node as registered."),
                    **error_refs("400", "401", "403", "413", "503"),
                },
            },
            "delete": {
                "tags": ["nodes"],
                "summary": "Drain the node: no new leases there, held ones stay (clean agent "
                "stop; an agent re-registering undrains it).",
                "operationId": "drain_node",
                "responses": {
                    "204": {"description": "Drained (or it already was)."},
                    **error_refs("400", "401", "403", "404", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/nodes/{node}/heartbeat",
        NodeHeartbeatHandler,
        parameters=(_NODE,),
        operations={
            "post": {
                "tags": ["nodes"],
                "summary": "The node's agent is alive; per-process GPU memory on its GPUs.",
                "operationId": "node_heartbeat",
                "requestBody": _body("NodeHeartbeat"),
                "responses": {
                    "200": json_response(schema_ref("NodeBeat"), "The node's state."),
                    **error_refs("400", "401", "403", "404", "413"),
                },
            },
        },
    ),
    Route(
        "/api/v1/nodes/{node}/orders",
        NodeOrdersHandler,
        parameters=(_NODE,),
        operations={
            "get": {
                "tags": ["nodes"],
                "summary": "Long-poll: the node's due orders (park, resume), answered as soon "
                "as they differ from those the agent last saw (its agent's token, or an admin).",
                "description": "Answers at once when the cursor of the node's due orders "
                "differs from `after` (or `after` is left out), else when they change, else "
                "after `timeout` seconds with the same cursor. Orders are state: the agent "
                "heartbeats at once when they changed and takes them from the heartbeat's "
                "answer, which repeats each until its outcome arrives.",
                "operationId": "node_orders",
                "parameters": [
                    {
                        "name": "after",
                        "in": "query",
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
                        "description": "The `cursor` of the last answer (opaque); left out: "
                        "answer at once.",
                    },
                    {
                        "name": "timeout",
                        "in": "query",
                        "schema": {
                            "type": "number",
                            "minimum": 0,
                            "maximum": MAX_WAIT,
                            "default": ORDERS_WAIT,
                        },
                        "description": "Seconds to wait for a change at most.",
                    },
                ],
                "responses": {
                    "200": json_response(schema_ref("NodeOrders"), "The node's due orders."),
                    **error_refs("400", "401", "403", "404", "503"),
                },
            },
        },
    ),
    Route(
        "/api/v1/queue",
        QueueHandler,
        operations={
            "get": {
                "tags": ["leases"],
                "summary": "Waiting requests with positions (own; admin: all).",
                "operationId": "list_queue",
                "responses": {
                    "200": json_response(schema_ref("QueueList"), "The queue."),
                    **error_refs("401"),
                },
            }
        },
    ),
    Route(
        "/api/v1/quotas",
        QuotasHandler,
        operations={
            "get": {
                "tags": ["quotas"],
                "summary": "Every quota (admin).",
                "operationId": "list_quotas",
                "responses": {
                    "200": json_response(
                        schema_ref("QuotaList"), "Default, group and user quotas."
                    ),
                    **error_refs("401", "403"),
                },
            }
        },
    ),
    Route(
        "/api/v1/quotas/me",
        MyQuotaHandler,
        operations={
            "get": {
                "tags": ["quotas"],
                "summary": "The caller's effective quota and what they hold now.",
                "operationId": "my_quota",
                "responses": {
                    "200": json_response(schema_ref("MyQuota"), "Your quota."),
                    **error_refs("401"),
                },
            }
        },
    ),
    Route(
        "/api/v1/quotas/default",
        QuotaHandler,
        handler_kwargs={"level": "default"},
        operations=_quota_operations("default", []),
    ),
    *(
        Route(
            f"/api/v1/quotas/{QUOTA_LEVEL_PLURALS[level]}/{{name}}",
            QuotaHandler,
            handler_kwargs={"level": level},
            operations=_quota_operations(level, [_name(description)]),
        )
        for level, description in (
            ("user", "The user name."),
            ("group", "The group (course) name."),
        )
    ),
    Route(
        "/api/v1/usage",
        UsageHandler,
        operations={
            "get": {
                "tags": ["usage"],
                "summary": "Fraction-hours used (admin: everyone; a user: their own and "
                "their groups').",
                "operationId": "usage",
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "Start of the period, POSIX seconds (e.g. 1735689600), "
                        "ISO 8601 or a duration (7d); default 7d. A user who is not an admin "
                        "may reach back 31 days, or the longest budget window if longer (403 "
                        "beyond).",
                    },
                    {
                        "name": "by",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["user", "group"], "default": "user"},
                        "description": "By group: a lease of a course kernel counts for its "
                        "course; any other lease for its user's groups when it was granted, "
                        "split equally; a user in no group under the empty name.",
                    },
                ],
                "responses": {
                    "200": json_response(schema_ref("Usage"), "Fraction-hours per name."),
                    **error_refs("400", "401", "403"),
                },
            }
        },
    ),
    Route(
        "/api/v1/sessions",
        SessionsHandler,
        operations={
            "get": {
                "tags": ["sessions"],
                "summary": "The class sessions from now to two days ahead: planned, in their "
                "lead time, under way; what each reserves, what its members use and what is "
                "lent back (anyone signed in).",
                "operationId": "list_sessions",
                "parameters": [
                    {
                        "name": "course",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "Only this course's sessions.",
                    }
                ],
                "responses": {
                    "200": json_response(schema_ref("SessionList"), "The timetable."),
                    **error_refs("400", "401", "503"),
                },
            }
        },
    ),
    Route(
        "/api/v1/sessions/{course}",
        SessionHandler,
        operations={
            method: {
                "tags": ["sessions"],
                "summary": summary + " (the course's instructors, or an admin).",
                "operationId": op,
                "parameters": [
                    {
                        "name": "course",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "The course (a group of the courses file).",
                    }
                ],
                **({"requestBody": _body(body)} if body else {}),
                "responses": {
                    status: json_response(schema_ref("ClassSession"), answer),
                    **error_refs(*errors),
                },
            }
            for method, op, summary, body, status, answer, errors in (
                (
                    "post",
                    "start_session",
                    "Start a class session now until `until`, reserving seats × a kernel "
                    "fraction or a share of the pool",
                    "SessionStart",
                    "201",
                    "The session started.",
                    ("400", "401", "403", "404", "409", "413", "503"),
                ),
                (
                    "patch",
                    "extend_session",
                    "Move the end of the course's session under way (planned or by hand)",
                    "SessionExtend",
                    "200",
                    "The session with its new end.",
                    ("400", "401", "403", "404", "409", "413", "503"),
                ),
                (
                    "delete",
                    "end_session",
                    "End the course's session under way now: its share returns to everyone",
                    "",
                    "200",
                    "The session as it ended.",
                    ("400", "401", "403", "404", "409", "503"),
                ),
            )
        },
    ),
    Route(
        "/api/v1/history",
        HistoryHandler,
        operations={
            "get": {
                "tags": ["usage"],
                "summary": "Allocation, queue length and waits over time, from the broker's "
                "records (admin: the pool; a user: their own leases and requests).",
                "operationId": "history",
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "schema": {"type": "string", "default": "24h"},
                        "description": "Start: POSIX seconds, ISO 8601, or a duration "
                        "before now (24h, 7d).",
                    },
                    {
                        "name": "step",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "Bucket size: seconds or a duration (5m, 1h); default: "
                        "the period in about 120 buckets, at least 60 s; at most 2000 buckets.",
                    },
                    {
                        "name": "group",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "Only this course's part (as usage by group counts "
                        "leases); empty: users in no course.",
                    },
                    {
                        "name": "user",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "Only this user's (admin; a user may name only themselves).",
                    },
                ],
                "responses": {
                    "200": json_response(schema_ref("History"), "Points in time order."),
                    **error_refs("400", "401", "403"),
                },
            }
        },
    ),
)

#: every documented (METHOD, path template) of REST API v1
ROUTES: tuple[tuple[str, str], ...] = tuple(
    (method.upper(), route.path) for route in TABLE for method in route.operations
)

#: the documented routes that answer without a token (everything else needs ``Authorization``)
PUBLIC_ROUTES: frozenset[tuple[str, str]] = frozenset(
    (method.upper(), route.path) for route in TABLE if route.public for method in route.operations
)


def openapi_paths() -> dict[str, Any]:
    """The ``paths`` object of the OpenAPI document (shared sub-objects; ``openapi.py`` copies)."""
    paths: dict[str, Any] = {}
    for route in TABLE:
        if not route.operations:
            continue
        item: dict[str, Any] = {}
        if route.parameters:
            item["parameters"] = list(route.parameters)
        for method, operation in route.operations.items():
            item[method] = (
                {"security": [], **operation} if route.public else _guarded(route, operation)
            )
        paths[route.path] = item
    return paths


def _guarded(route: Route, operation: Operation) -> Operation:
    """An operation that needs a token, with the refusals every such handler may answer
    (``handlers.api``): 401 without a valid token, and 403 for a node agent's token off
    the node routes (its handler's ``agent_allowed``)."""
    implied = ("401",) if getattr(route.handler, "agent_allowed", False) else ("401", "403")
    responses = dict(operation["responses"])
    for code, ref in error_refs(*implied).items():
        responses.setdefault(code, ref)
    return {**operation, "responses": responses}


HandlerWrap = Callable[[type[web.RequestHandler]], type[web.RequestHandler]]


#: what kernels call all the time (acquire, release, renew): matched first
HOT_PATHS = frozenset(
    {"/api/v1/leases", "/api/v1/leases/{lease_id}", "/api/v1/leases/{lease_id}/renew"}
)


def url_specs(base_url: str = "/", wrap: HandlerWrap | None = None) -> list[web.URLSpec]:
    """Tornado's URL patterns of :data:`TABLE` under ``base_url``.

    ``wrap`` (from the authenticator) may replace each handler class, e.g. by one that
    also accepts JupyterHub's OAuth login cookie. The routes every kernel calls
    (:data:`HOT_PATHS`) come first: tornado tries the patterns in order, and no two of
    them match the same path.
    """
    return [
        web.URLSpec(
            route.pattern(base_url),
            wrap(route.handler) if wrap is not None else route.handler,
            {"public": route.public, **route.handler_kwargs},
        )
        for route in sorted(TABLE, key=lambda r: r.path not in HOT_PATHS)
    ]


# -- the application ---------------------------------------------------------------------


_access = logging.getLogger("gpu_lease.broker.access")


def _log_request(handler: web.RequestHandler) -> None:
    status = handler.get_status()
    ms = 1000.0 * handler.request.request_time()
    level = logging.DEBUG if status < 400 else logging.INFO if status < 500 else logging.WARNING
    if _access.isEnabledFor(level):
        _access.log(
            level,
            "%d %s %s (%s) %.1fms",
            status,
            handler.request.method,
            handler.request.path,  # never the query string
            handler.request.remote_ip,
            ms,
        )


def make_app(
    service: BrokerService,
    authenticator: Authenticator,
    metrics: Any = None,
    base_url: str = "/",
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    metrics_require_auth: bool = True,
    **settings: Any,
) -> web.Application:
    """The tornado application of the broker (no server, no listening: ``app.py`` does that).

    Called by :meth:`GPULeaseBroker.serve <provisioner.broker.app.GPULeaseBroker>`;
    tests and benchmarks build it in-process around their own ``BrokerService``. An
    authenticator with browser login (``--auth hub`` as a hub service) adds its routes
    (the OAuth callback), wraps each handler, and gets a random ``cookie_secret``
    (logins last until the broker restarts; the hub then logs the browser in again
    without asking).
    """
    base = normalize_base_url(base_url)
    settings.setdefault("log_function", _log_request)
    login = authenticator.browser_login
    if login:
        settings.setdefault("cookie_secret", secrets.token_bytes(32))
    # the templates and static files live at the broker package's top (provisioner/broker/)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    settings.setdefault("template_path", os.path.join(here, "templates"))
    settings.setdefault("static_path", os.path.join(here, "static"))
    settings.setdefault("static_url_prefix", f"{base}static/")
    specs: list[Any] = url_specs(base, authenticator.wrap_handler if login else None)
    specs += authenticator.login_routes(base)
    return web.Application(
        specs,
        default_handler_class=NotFoundHandler,
        gpu_lease_service=service,
        gpu_lease_authenticator=authenticator,
        gpu_lease_metrics=metrics,
        gpu_lease_base_url=base,
        gpu_lease_max_body_bytes=max_body_bytes,
        gpu_lease_metrics_require_auth=metrics_require_auth,
        **settings,
    )


__all__ = [
    "PUBLIC_ROUTES",
    "ROUTES",
    "TABLE",
    "Route",
    "build_openapi",
    "make_app",
    "openapi_paths",
    "url_specs",
]
