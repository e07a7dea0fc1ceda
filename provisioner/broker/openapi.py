"""The OpenAPI 3.0.3 document of REST API v1, served at ``GET /api/v1/openapi.json``.

:func:`build_openapi` is a pure builder (no I/O): the schemas and error responses
live here, the paths and their operations come from the route table
(:data:`provisioner.broker.routes.TABLE`), which also gives tornado its URL patterns,
so the document and the served routes cannot drift apart. :data:`ROUTES` and
:data:`PUBLIC_ROUTES` (re-exported from there) list the documented
``(METHOD, path template)`` pairs and those that need no token. Paths are relative to
the server URL: behind JupyterHub the broker passes its ``JUPYTERHUB_SERVICE_PREFIX``
as ``base_url`` (e.g. ``/services/gpu-lease/``) and the paths stay ``/api/v1/...``.
"""

from __future__ import annotations

import copy
from typing import Any

from .._version import __version__
from .routes import PUBLIC_ROUTES, ROUTES, openapi_paths
from .routes import json_response as _json
from .routes import schema_ref as _ref

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


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


#: the broker counts fractions in millionths (ppm): 0.000001 is the smallest it accepts
_FRACTION = {"type": "number", "minimum": 0.000001, "maximum": 1}
_TIME = {"type": "number", "description": "POSIX time in seconds."}
_MPS_STATES: dict[str, Any] = {
    "type": "object",
    "maxProperties": 64,
    "additionalProperties": {"type": "string", "enum": ["running", "down"]},
    "description": "GPU uuid -> state of its MPS control daemon (agents with --mps).",
}

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
            "min_fraction": {
                "type": "number",
                "minimum": 0,
                "description": "The smallest fraction whose memory cap on this GPU is above "
                "0 (its share must exceed the CUDA context overhead).",
            },
            "context_overhead_mb": {
                "type": "integer",
                "minimum": 0,
                "description": "MiB every kernel's CUDA context takes outside its cap.",
            },
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
            "used_mb": _nullable(
                {
                    "type": "integer",
                    "description": "GPU memory the kernel's processes use, as its node agent "
                    "last reported (null: no agent reports this GPU).",
                }
            ),
            "enforcement": {
                "type": "string",
                "description": "The layer that holds the memory cap: 'cooperative' (framework "
                "caps only), or 'agent-off' / 'agent-report' / 'agent-revoke' / 'agent-kill', "
                "prefixed 'driver+' where the node's driver caps the kernel's cgroup "
                "(nvmlDeviceSetMemoryLimits_v1, R615+).",
            },
            "mps": _nullable(
                {
                    "type": "string",
                    "enum": ["running", "down"],
                    "description": "The MPS control daemon of the lease's GPU, as its node "
                    "agent (--mps) last reported it (null: no agent runs one). A kernel "
                    "with enforcement=mps is capped by the driver only while it runs.",
                }
            ),
            "execution_state": _nullable({"type": "string"}),
            "last_activity": _nullable(_TIME),
            "groups": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The user's groups (courses) when the lease was granted; "
                "usage by group counts a lease without `group` for these, split equally.",
            },
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
            "reason": {
                "type": "string",
                "description": "Why it waits: how full the GPUs it may use are (named as "
                "`gpu-lease top` names them), and how much is free when a smaller kernel "
                "could start sooner.",
            },
            "eta_seconds": {
                "type": "integer",
                "minimum": 0,
                "description": "Estimated seconds until the lease is granted, when the broker "
                "can estimate one: the future replayed from the hold times of recent leases "
                '(docs/developers.md, "Estimated waits"). Absent without enough history.',
            },
            "message": {
                "type": "string",
                "description": "The place in the queue and the reason, for the student.",
            },
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
            # node boundaries (issue 26): pid namespaces and the kernel's cgroup
            "pid_ns": {
                "type": "integer",
                "minimum": 1,
                "maximum": 18446744073709551615,
                "description": "The inode of the pid namespace `pid` is numbered in "
                "(/proc/<pid>/ns/pid); lets the node agent find a kernel that runs in a "
                "container or under `unshare --pid`.",
            },
            "cgroup": {
                "type": "string",
                "maxLength": 1024,
                "pattern": "^(/[A-Za-z0-9._@:+=,-]+)+$",
                "description": "The kernel's own cgroup v2, from the hierarchy's root: "
                "the node sets the driver's memory limit on it where the driver offers one.",
            },
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
            "groups": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The user's groups (courses), as on a lease.",
            },
            "priority": {"type": "integer"},
            "waiting_s": {"type": "number", "minimum": 0},
            "eta_seconds": {
                "type": "integer",
                "minimum": 0,
                "description": "Estimated seconds until the lease is granted, when the broker "
                "can estimate one: the future replayed from the hold times of recent leases "
                '(docs/developers.md, "Estimated waits"). Absent without enough history.',
            },
        },
    },
    "QueueList": {
        "type": "object",
        "required": ["queue"],
        "properties": {
            "queue": {"type": "array", "items": _ref("QueueEntry")},
            "length": {
                "type": "integer",
                "minimum": 0,
                "description": "How many requests wait in all (a student's list shows "
                "only their own).",
            },
        },
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
    "QuotaSources": {
        "type": "object",
        "description": "Per quota field, the level that set the effective value: "
        "`default` (also when unlimited), `group NAME` or `user`.",
        "additionalProperties": False,
        "properties": {k: {"type": "string"} for k in _QUOTA_PROPS},
    },
    "EffectiveQuota": {
        "type": "object",
        "description": "A user's effective quota as admission applies it, with the source of "
        "each value (GET /api/v1/quotas/users/{name}?effective=1).",
        "required": ["user", "groups", "effective", "sources"],
        "properties": {
            "user": {"type": "string"},
            "groups": {"type": "array", "items": {"type": "string"}},
            "groups_from": {
                "type": "string",
                "description": "Where the groups came from: JupyterHub, the tokens file, or "
                "the caller's own token.",
            },
            "effective": _ref("Quota"),
            "sources": _ref("QuotaSources"),
            "own": _nullable(_ref("Quota")),
            "held_fraction": {"type": "number", "minimum": 0},
            "leases": {"type": "integer", "minimum": 0},
        },
    },
    "MyQuota": {
        "type": "object",
        "required": ["user", "effective"],
        "properties": {
            "user": {"type": "string"},
            "effective": _ref("Quota"),
            "sources": _ref("QuotaSources"),
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
    "HistoryPoint": {
        "type": "object",
        "description": "One bucket [t, t + step). Fractions in GPUs (the sum of lease "
        "fractions), waits in seconds; means over the bucket (the last one: over the part "
        "that has passed).",
        "required": [
            "t",
            "allocated",
            "allocated_max",
            "queue",
            "queue_max",
            "grants",
            "waited",
            "wait_mean_s",
            "wait_max_s",
            "withdrawn",
        ],
        "properties": {
            "t": _TIME,
            "allocated": {"type": "number", "minimum": 0, "description": "Mean allocation."},
            "allocated_max": {"type": "number", "minimum": 0, "description": "Peak allocation."},
            "queue": {"type": "number", "minimum": 0, "description": "Mean queue length."},
            "queue_max": {"type": "integer", "minimum": 0, "description": "Peak queue length."},
            "grants": {"type": "integer", "minimum": 0, "description": "Leases granted."},
            "waited": {
                "type": "integer",
                "minimum": 0,
                "description": "Grants that had waited in the queue.",
            },
            "wait_mean_s": _nullable({"type": "number", "minimum": 0}),
            "wait_max_s": _nullable({"type": "number", "minimum": 0}),
            "withdrawn": {
                "type": "integer",
                "minimum": 0,
                "description": "Requests that left the queue without a lease.",
            },
        },
    },
    "History": {
        "type": "object",
        "required": ["since", "until", "step", "capacity", "points"],
        "properties": {
            "since": {**_TIME, "description": "The first bucket's start (a multiple of step)."},
            "until": _TIME,
            "step": {"type": "number", "minimum": 1},
            "user": _nullable({"type": "string"}),
            "group": _nullable({"type": "string"}),
            "capacity": {
                "type": "number",
                "minimum": 0,
                "description": "The pool's capacity now, in GPUs (for the plot's scale).",
            },
            "points": {"type": "array", "items": _ref("HistoryPoint")},
        },
    },
    "NodeGPU": {
        "type": "object",
        "additionalProperties": False,
        "required": ["uuid", "name", "memory_mb", "index"],
        "properties": {
            "uuid": {"type": "string", "minLength": 1, "maxLength": 128},
            "name": {"type": "string", "minLength": 1, "maxLength": 255, "example": "H100"},
            "memory_mb": {"type": "integer", "minimum": 1, "maximum": 16777216},
            "index": {"type": "integer", "minimum": 0, "maximum": 1023},
        },
    },
    "NodeRegistration": {
        "type": "object",
        "additionalProperties": False,
        "required": ["gpus", "agent_version"],
        "properties": {
            "gpus": {"type": "array", "maxItems": 64, "items": _ref("NodeGPU")},
            "agent_version": {"type": "string", "minLength": 1, "maxLength": 64},
            "enforce": {"type": "string", "enum": ["off", "report", "revoke", "kill"]},
        },
    },
    "UsageSample": {
        "type": "object",
        "additionalProperties": False,
        "required": ["pid", "gpu_uuid", "used_mb"],
        "properties": {
            "pid": {"type": "integer", "minimum": 1, "maximum": 2147483647},
            "gpu_uuid": {"type": "string", "minLength": 1, "maxLength": 128},
            "used_mb": {"type": "integer", "minimum": 0, "maximum": 16777216},
        },
    },
    "NodeHeartbeat": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "usage": {"type": "array", "maxItems": 4096, "items": _ref("UsageSample")},
            "at": {**_TIME, "minimum": 0, "maximum": 100000000000},
            "mps": _MPS_STATES,
            # node boundaries (issue 26)
            "kernels": {
                "type": "array",
                "maxItems": 4096,
                "description": "Which host pid each lease kernel of another pid namespace "
                "is (found through /proc/<pid>/status NSpid); `usage` names host pids.",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["pid", "pid_ns", "host_pid"],
                    "properties": {
                        "pid": {"type": "integer", "minimum": 1, "maximum": 2147483647},
                        "pid_ns": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": 18446744073709551615,
                        },
                        "host_pid": {"type": "integer", "minimum": 1, "maximum": 2147483647},
                    },
                },
            },
            "driver_limits": {
                "type": "array",
                "maxItems": 4096,
                "items": {"type": "string", "maxLength": 1024},
                "description": "The kernel cgroups whose driver memory limit "
                "(nvmlDeviceSetMemoryLimits_v1) is in force.",
            },
        },
    },
    "NodeBeat": {
        "type": "object",
        "required": ["node", "state"],
        "properties": {
            "node": {"type": "string"},
            "state": {"type": "string", "enum": ["up", "lost", "drained"]},
            "at": _TIME,
            "watch": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "Kernel pids of the node's leases: report their processes' "
                "memory (children included) under these pids.",
            },
            "kill": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "Kernel pids whose GPU processes to kill (--enforce kill).",
            },
            "kernels": {
                "type": "array",
                "description": "The node's lease kernels as their provisioners see them: "
                "`pid_ns` null means a host pid.",
                "items": {
                    "type": "object",
                    "properties": {
                        "pid": {"type": "integer"},
                        "pid_ns": _nullable({"type": "integer"}),
                    },
                },
            },
            "limits": {
                "type": "array",
                "description": "Kernel cgroups and the memory their lease holds (cap + "
                "context): the driver hard limit to set where the driver offers one.",
                "items": {
                    "type": "object",
                    "properties": {
                        "cgroup": {"type": "string"},
                        "gpu_uuid": {"type": "string"},
                        "memory_mb": {"type": "integer"},
                    },
                },
            },
        },
    },
    "Node": {
        "type": "object",
        "required": ["node", "state", "gpus", "last_seen"],
        "properties": {
            "node": {"type": "string"},
            "state": {"type": "string", "enum": ["up", "lost", "drained"]},
            "gpus": {
                "description": "A count (users), or the GPUs (admins and registrations).",
                "oneOf": [
                    {"type": "integer", "minimum": 0},
                    {"type": "array", "items": {"type": "object"}},
                ],
            },
            "last_seen": _TIME,
            "agent_version": {"type": "string"},
            "registered_at": _TIME,
            "enforce": {"type": "string"},
            "usage": {"type": "array", "items": _ref("UsageSample")},
            "unleased": {"type": "array", "items": _ref("UsageSample")},
            "mps": _MPS_STATES,
        },
    },
    "NodeList": {
        "type": "object",
        "required": ["nodes"],
        "properties": {"nodes": {"type": "array", "items": _ref("Node")}},
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
            {"name": "nodes"},
        ],
        "paths": openapi_paths(),
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
