"""The OpenAPI 3.0.3 document of REST API v1, served at ``GET /api/v1/openapi.json``.

:func:`build_openapi` is a pure builder (no I/O); :data:`ROUTES` lists every
``(METHOD, path template)`` the document describes, so a test can check that the
handlers register exactly these. Paths are relative to the server URL: behind
JupyterHub the broker passes its ``JUPYTERHUB_SERVICE_PREFIX`` as ``base_url``
(e.g. ``/services/gpu-lease/``) and the paths stay ``/api/v1/...``.
"""

from __future__ import annotations

import copy
from typing import Any

from .._version import __version__

#: every (method, path template) of REST API v1 that the document describes
ROUTES: tuple[tuple[str, str], ...] = (
    ("GET", "/api/v1/health"),
    ("GET", "/api/v1/openapi.json"),
    ("GET", "/metrics"),
    ("GET", "/api/v1/gpus"),
    ("GET", "/api/v1/leases"),
    ("POST", "/api/v1/leases"),
    ("GET", "/api/v1/leases/{lease_id}"),
    ("DELETE", "/api/v1/leases/{lease_id}"),
    ("POST", "/api/v1/leases/{lease_id}/renew"),
    ("POST", "/api/v1/leases/{lease_id}/revoke"),
    ("GET", "/api/v1/queue"),
    ("GET", "/api/v1/quotas"),
    ("GET", "/api/v1/quotas/me"),
    ("GET", "/api/v1/quotas/default"),
    ("PUT", "/api/v1/quotas/default"),
    ("DELETE", "/api/v1/quotas/default"),
    ("GET", "/api/v1/quotas/users/{name}"),
    ("PUT", "/api/v1/quotas/users/{name}"),
    ("DELETE", "/api/v1/quotas/users/{name}"),
    ("GET", "/api/v1/quotas/groups/{name}"),
    ("PUT", "/api/v1/quotas/groups/{name}"),
    ("DELETE", "/api/v1/quotas/groups/{name}"),
    ("GET", "/api/v1/usage"),
)

#: routes that answer without a token (everything else needs ``Authorization``)
PUBLIC_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {("GET", "/api/v1/health"), ("GET", "/api/v1/openapi.json"), ("GET", "/metrics")}
)

_ERROR_TEXT = {
    "400": "Invalid input (malformed JSON, wrong types, unknown fields, bad fraction, "
    "an unprintable or over-long id or name in the URL or query).",
    "401": "Missing or invalid token.",
    "403": "Not allowed: quota exceeded, not a member of the course, not yours, or not an admin.",
    "404": "No such lease or record (or not visible to the caller).",
    "409": "Conflict: this kernel already holds a lease of another fraction.",
    "410": "The lease has ended (revoked or expired); the body's reason says why.",
    "413": "Request body too large.",
    "422": "Can never fit: above the largest GPU, or below the CUDA context overhead.",
    "503": "The broker's database is unavailable; nothing was changed.",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: {"$ref": f"#/components/responses/E{code}"} for code in codes}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


#: the broker counts fractions in millionths (ppm): 0.000001 is the smallest it accepts
_FRACTION = {"type": "number", "minimum": 0.000001, "maximum": 1}
_TIME = {"type": "number", "description": "POSIX time in seconds."}

_QUOTA_PROPS: dict[str, Any] = {
    "max_fraction": _nullable(
        {
            "type": "number",
            "minimum": 0,
            "maximum": 1000000,
            "description": "Sum of GPU fractions held at once (may exceed 1: several GPUs); "
            "0, or at least 0.000001.",
        }
    ),
    "max_leases": _nullable(
        {
            "type": "integer",
            "minimum": 0,
            "maximum": 1000000,
            "description": "Active leases at once.",
        }
    ),
    "max_lease_fraction": _nullable(
        {**_FRACTION, "description": "The largest fraction one lease may ask for."}
    ),
    "budget_fraction_hours": _nullable(
        {
            "type": "number",
            "minimum": 0,
            "maximum": 1000000000,
            "description": "Fraction-hours that may be used per budget_window.",
        }
    ),
    "budget_window": {
        "description": "Budget window: seconds, or a duration such as '7d', '12h', '30m', "
        "from 1 second to 10 years. Answers always give seconds.",
        # OAS 3.0: ``nullable`` needs a ``type``, so each branch is nullable (anyOf, not oneOf)
        "anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 316224000, "nullable": True},
            {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?\s*[smhdw]$", "nullable": True},
        ],
    },
    "priority": _nullable(
        {
            "type": "integer",
            "minimum": -1000,
            "maximum": 1000,
            "description": "Group queue priority: higher is served first (groups only).",
        }
    ),
}

_GPU_REF_PROPS: dict[str, Any] = {
    "uuid": {"type": "string", "example": "GPU-5f1d8a0e-2c1b-5e3a-9b57-0d8a4b2c6e11"},
    "node": {"type": "string"},
    "name": {"type": "string", "example": "V100"},
    "memory_mb": {"type": "integer", "minimum": 1},
}

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error", "message"],
        "properties": {
            "error": {
                "type": "string",
                "description": "Machine-readable code.",
                "example": "quota_exceeded",
            },
            "message": {"type": "string", "description": "A sentence that says what to do."},
        },
        "additionalProperties": True,
    },
    "Health": {
        "type": "object",
        "required": ["status", "version"],
        "properties": {
            "status": {"type": "string", "example": "ok"},
            "version": {"type": "string"},
            "gpus": {"type": "integer", "minimum": 0},
            "active_leases": {"type": "integer", "minimum": 0},
            "queued": {"type": "integer", "minimum": 0},
            "uptime_s": {"type": "number"},
        },
    },
    "GPURef": {
        "type": "object",
        "required": ["uuid"],
        "properties": _GPU_REF_PROPS,
    },
    "GPU": {
        "type": "object",
        "required": ["uuid", "node", "name", "memory_mb", "allocated_fraction", "leases"],
        "properties": {
            **_GPU_REF_PROPS,
            "index": {"type": "integer", "minimum": 0},
            "allocated_fraction": {"type": "number", "minimum": 0, "maximum": 1},
            "allocated_mb": {"type": "integer", "minimum": 0},
            "capacity_fraction": {"type": "number", "minimum": 0, "maximum": 1},
            "leases": {"type": "integer", "minimum": 0},
        },
    },
    "GPUList": {
        "type": "object",
        "required": ["gpus"],
        "properties": {"gpus": {"type": "array", "items": _ref("GPU")}},
    },
    "AcquireRequest": {
        "type": "object",
        "required": ["kernel_id", "fraction"],
        "additionalProperties": False,
        "properties": {
            "kernel_id": {
                "type": "string",
                "minLength": 1,
                "maxLength": 255,
                "description": "The kernel's id: printable characters (no control characters).",
            },
            "fraction": {**_FRACTION, "example": 0.02},
            "node": {"type": "string", "description": "Place only on this node's GPUs."},
            "gpu_uuids": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": 64,
                "description": "Place only on these GPUs.",
            },
            "group": {"type": "string", "description": "Course (group) the kernelspec belongs to."},
            "wait": {
                "type": "number",
                "minimum": 0,
                "maximum": 300,
                "default": 0,
                "description": "Seconds to hold the answer while queued (long-poll).",
            },
        },
    },
    "Lease": {
        "type": "object",
        "required": ["id", "user", "kernel_id", "fraction", "gpu", "memory_limit_mb", "state"],
        "properties": {
            "id": {"type": "string", "description": "Unguessable lease id."},
            "user": {"type": "string"},
            "kernel_id": {"type": "string"},
            "fraction": {**_FRACTION},
            "gpu": _ref("GPURef"),
            "memory_limit_mb": {
                "type": "integer",
                "description": "The kernel's framework memory cap (MiB): the reserved "
                "fraction of the GPU's memory minus the CUDA context overhead.",
            },
            "state": {"type": "string", "enum": ["active", "revoked", "released", "expired"]},
            "group": _nullable({"type": "string"}),
            "created_at": _TIME,
            "renewed_at": _TIME,
            "expires_at": _TIME,
            "ended_at": _nullable(_TIME),
            "reason": _nullable({"type": "string"}),
            "pid": _nullable({"type": "integer"}),
            "execution_state": _nullable({"type": "string"}),
            "last_activity": _nullable(_TIME),
        },
    },
    "LeaseList": {
        "type": "object",
        "required": ["leases"],
        "properties": {"leases": {"type": "array", "items": _ref("Lease")}},
    },
    "Queued": {
        "type": "object",
        "required": ["queued", "id", "position"],
        "properties": {
            "queued": {"type": "boolean", "enum": [True]},
            "id": {
                "type": "string",
                "description": "The queued request's id; its lease gets the same id when "
                "granted. DELETE /api/v1/leases/{id} withdraws the request, or releases the "
                "lease if it was granted meanwhile.",
            },
            "position": {"type": "integer", "minimum": 1},
            "kernel_id": {"type": "string"},
            "fraction": {**_FRACTION},
            "queue_length": {"type": "integer", "minimum": 1},
            "message": {"type": "string", "description": "Why it waits, for the student."},
        },
    },
    "Heartbeat": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "pid": {"type": "integer", "minimum": 1, "maximum": 4294967296},
            "execution_state": {
                "type": "string",
                "pattern": "^[A-Za-z0-9_-]{1,32}$",
                "example": "idle",
            },
            "last_activity": {**_TIME, "minimum": 0, "maximum": 100000000000},
        },
    },
    "Revoke": {
        "type": "object",
        "additionalProperties": False,
        "required": ["reason"],
        "properties": {
            "reason": {
                "type": "string",
                "minLength": 1,
                "maxLength": 500,
                "description": "Why, for the student (shown when their kernel stops).",
            }
        },
    },
    "QueueEntry": {
        "type": "object",
        "required": ["position", "user", "kernel_id", "fraction"],
        "properties": {
            "id": _nullable({"type": "string"}),
            "position": {"type": "integer", "minimum": 1},
            "user": {"type": "string"},
            "kernel_id": {"type": "string"},
            "fraction": {**_FRACTION},
            "group": _nullable({"type": "string"}),
            "priority": {"type": "integer"},
            "waiting_s": {"type": "number", "minimum": 0},
        },
    },
    "QueueList": {
        "type": "object",
        "required": ["queue"],
        "properties": {"queue": {"type": "array", "items": _ref("QueueEntry")}},
    },
    "Quota": {
        "type": "object",
        "additionalProperties": False,
        "description": "Limits at one level; null means unlimited (default) or inherited "
        "(group, user).",
        "properties": _QUOTA_PROPS,
    },
    "QuotaRecord": {
        "type": "object",
        "description": "A stored quota; a user's record also carries the effective quota.",
        "properties": {**_QUOTA_PROPS, "effective": _ref("Quota")},
    },
    "MyQuota": {
        "type": "object",
        "required": ["user", "effective"],
        "properties": {
            "user": {"type": "string"},
            "effective": _ref("Quota"),
            "held_fraction": {"type": "number", "minimum": 0},
            "leases": {"type": "integer", "minimum": 0},
            "groups": {"type": "array", "items": {"type": "string"}},
            "admin": {"type": "boolean", "description": "Whether the caller is a GPU lease admin."},
        },
    },
    "QuotaList": {
        "type": "object",
        "required": ["default", "groups", "users"],
        "properties": {
            "default": _ref("Quota"),
            "groups": {"type": "object", "additionalProperties": _ref("Quota")},
            "users": {"type": "object", "additionalProperties": _ref("Quota")},
        },
    },
    "Usage": {
        "type": "object",
        "description": "Fraction-hours used since `since`, per user or group name.",
        "additionalProperties": {"type": "number", "minimum": 0},
        "example": {"alice": 1.25, "bob": 0.5},
    },
}

_LEASE_ID = {
    "name": "lease_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The lease id.",
}
_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}


def _quota_ops(level: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    who = "admin (a user may read their own and their groups' quotas)"
    return {
        "get": {
            "tags": ["quotas"],
            "summary": f"Read the {level} quota; {who}.",
            "operationId": f"get_{level}_quota",
            "parameters": params,
            "responses": {
                "200": _json(_ref("QuotaRecord"), f"The {level} quota."),
                **_errors("400", "401", "403", "404"),
            },
        },
        "put": {
            "tags": ["quotas"],
            "summary": f"Set the {level} quota (admin).",
            "operationId": f"put_{level}_quota",
            "parameters": params,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("Quota")}},
            },
            "responses": {
                "200": _json(_ref("Quota"), "The quota as stored."),
                **_errors("400", "401", "403", "413", "503"),
            },
        },
        "delete": {
            "tags": ["quotas"],
            "summary": f"Remove the {level} quota (admin).",
            "operationId": f"delete_{level}_quota",
            "parameters": params,
            "responses": {
                "204": {"description": "Removed (or there was none)."},
                **_errors("400", "401", "403", "503"),
            },
        },
    }


def _paths() -> dict[str, Any]:
    open_: dict[str, Any] = {"security": []}
    lease_resp = _json(_ref("Lease"), "The lease.")
    return {
        "/api/v1/health": {
            "get": {
                **open_,
                "tags": ["broker"],
                "summary": "Status, version, GPU count and active leases (no token needed).",
                "operationId": "health",
                "responses": {"200": _json(_ref("Health"), "The broker is up.")},
            }
        },
        "/api/v1/openapi.json": {
            "get": {
                **open_,
                "tags": ["broker"],
                "summary": "This OpenAPI document (no token needed).",
                "operationId": "openapi",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3.0 document.")},
            }
        },
        "/metrics": {
            "get": {
                **open_,
                "tags": ["broker"],
                "summary": "Prometheus metrics (text exposition format).",
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Metrics, all named gpu_lease_*.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors("401", "403"),
                },
            }
        },
        "/api/v1/gpus": {
            "get": {
                "tags": ["gpus"],
                "summary": "The pool: every GPU with its allocation.",
                "operationId": "list_gpus",
                "responses": {"200": _json(_ref("GPUList"), "The GPUs."), **_errors("401")},
            }
        },
        "/api/v1/leases": {
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
                    "200": _json(_ref("LeaseList"), "The leases."),
                    **_errors("400", "401", "403"),
                },
            },
            "post": {
                "tags": ["leases"],
                "summary": "Acquire a lease for a kernel (idempotent per user and kernel_id).",
                "description": "201: a new lease. 200: this kernel already holds it. 202: "
                "queued after waiting `wait` seconds; post the same body again to keep "
                "the place.",
                "operationId": "acquire",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("AcquireRequest")}},
                },
                "responses": {
                    "200": _json(_ref("Lease"), "The lease this kernel already holds."),
                    "201": {
                        **_json(_ref("Lease"), "A new lease."),
                        "headers": {
                            "Location": {
                                "schema": {"type": "string"},
                                "description": "The lease's URL.",
                            }
                        },
                    },
                    "202": _json(_ref("Queued"), "Waiting in the queue."),
                    **_errors("400", "401", "403", "409", "413", "422", "503"),
                },
            },
        },
        "/api/v1/leases/{lease_id}": {
            "parameters": [_LEASE_ID],
            "get": {
                "tags": ["leases"],
                "summary": "One lease (owner or admin).",
                "operationId": "get_lease",
                "responses": {"200": lease_resp, **_errors("400", "401", "403", "404")},
            },
            "delete": {
                "tags": ["leases"],
                "summary": "Release the lease (owner or admin); idempotent.",
                "operationId": "release",
                "responses": {
                    "204": {"description": "Released (or already ended)."},
                    **_errors("400", "401", "403", "404", "503"),
                },
            },
        },
        "/api/v1/leases/{lease_id}/renew": {
            "parameters": [_LEASE_ID],
            "post": {
                "tags": ["leases"],
                "summary": "Heartbeat: renew the lease's TTL and report the kernel's activity.",
                "operationId": "renew",
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _ref("Heartbeat")}},
                },
                "responses": {
                    "200": _json(_ref("Lease"), "The renewed lease."),
                    **_errors("400", "401", "403", "404", "410", "413", "503"),
                },
            },
        },
        "/api/v1/leases/{lease_id}/revoke": {
            "parameters": [_LEASE_ID],
            "post": {
                "tags": ["leases"],
                "summary": "End someone's lease (admin); its kernel is shut down and its "
                "owner sees the reason.",
                "operationId": "revoke",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("Revoke")}},
                },
                "responses": {
                    "200": _json(_ref("Lease"), "The revoked lease."),
                    **_errors("400", "401", "403", "404", "410", "413", "503"),
                },
            },
        },
        "/api/v1/queue": {
            "get": {
                "tags": ["leases"],
                "summary": "Waiting requests with positions (own; admin: all).",
                "operationId": "list_queue",
                "responses": {"200": _json(_ref("QueueList"), "The queue."), **_errors("401")},
            }
        },
        "/api/v1/quotas": {
            "get": {
                "tags": ["quotas"],
                "summary": "Every quota (admin).",
                "operationId": "list_quotas",
                "responses": {
                    "200": _json(_ref("QuotaList"), "Default, group and user quotas."),
                    **_errors("401", "403"),
                },
            }
        },
        "/api/v1/quotas/me": {
            "get": {
                "tags": ["quotas"],
                "summary": "The caller's effective quota and what they hold now.",
                "operationId": "my_quota",
                "responses": {"200": _json(_ref("MyQuota"), "Your quota."), **_errors("401")},
            }
        },
        "/api/v1/quotas/default": _quota_ops("default", []),
        "/api/v1/quotas/users/{name}": _quota_ops(
            "user", [{**_NAME, "description": "The user name."}]
        ),
        "/api/v1/quotas/groups/{name}": _quota_ops(
            "group", [{**_NAME, "description": "The group (course) name."}]
        ),
        "/api/v1/usage": {
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
                        "description": "Start of the period, POSIX seconds (e.g. 1735689600).",
                    },
                    {
                        "name": "by",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["user", "group"], "default": "user"},
                    },
                ],
                "responses": {
                    "200": _json(_ref("Usage"), "Fraction-hours per name."),
                    **_errors("400", "401", "403"),
                },
            }
        },
    }


def build_openapi(base_url: str = "/") -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of REST API v1, its server at ``base_url``.

    Called by the handler of ``GET /api/v1/openapi.json`` with the broker's base
    URL (the hub service prefix behind JupyterHub). Returns a fresh dict each call.
    """
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "jupyter-gpu-lease broker",
            "version": __version__,
            "description": "Fractional GPU leases for Jupyter kernels. Every endpoint but "
            "health, metrics and this document needs `Authorization: token <TOKEN>` "
            '(or `Bearer <TOKEN>`). Errors are `{"error": CODE, "message": ...}`.',
            "license": {"name": "BSD-3-Clause"},
        },
        "servers": [{"url": base_url or "/"}],
        "security": [{"token": []}],
        "tags": [
            {"name": "broker"},
            {"name": "gpus"},
            {"name": "leases"},
            {"name": "quotas"},
            {"name": "usage"},
        ],
        "paths": _paths(),
        "components": {
            "schemas": _SCHEMAS,
            "responses": {
                f"E{code}": _json(_ref("Error"), text) for code, text in _ERROR_TEXT.items()
            },
            "securitySchemes": {
                "token": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Authorization",
                    "description": "`token <TOKEN>` or `Bearer <TOKEN>`: a JupyterHub API "
                    "token (--auth hub) or one from the tokens file (--auth static).",
                }
            },
        },
    }
    return copy.deepcopy(doc)


def documented_routes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    """``(METHOD, path)`` pairs of a document's operations (for tests and the dashboard)."""
    methods = {"get", "put", "post", "delete", "patch", "head", "options"}
    return {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if method in methods
    }


__all__ = ["PUBLIC_ROUTES", "ROUTES", "build_openapi", "documented_routes"]
