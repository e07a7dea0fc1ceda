"""The OpenAPI 3.0.3 document of REST API v1: its schemas, and the builder of the document.

Pure (no I/O) and below the route table: every schema here is built from the wire's
vocabulary (:mod:`provisioner.wire`: states, modes, limits, error statuses), so a
field's documented values are the values the broker sends and accepts; the paths come
from the route table, which passes them in: :func:`provisioner.broker.web.routes.build_openapi`
serves ``GET /api/v1/openapi.json`` (``build_document`` here assembles it). This module
imports nothing of the broker, so the table may import it (the schema building blocks
:func:`schema_ref`, :func:`json_response`, :func:`error_refs` live here).
"""

from __future__ import annotations

import copy
from typing import Any

from ... import wire
from ..._version import __version__
from ...node_report import (
    CGROUP_SCHEMA,
    MPS_STATES_SCHEMA,
    MPS_UIDS_SCHEMA,
    PID_NS_SCHEMA,
    PID_SCHEMA,
    UID_SCHEMA,
    KernelLaunch,
    LaunchOrder,
    ParkOutcome,
    RemoteKernelStatus,
    answer_schema,
    heartbeat_schema,
)
from ...wire import enum_schema


def schema_ref(name: str) -> dict[str, str]:
    """``{"$ref": "#/components/schemas/NAME"}``."""
    return {"$ref": f"#/components/schemas/{name}"}


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """An OpenAPI response (or request body content) of JSON with ``schema``."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def error_refs(*codes: str) -> dict[str, Any]:
    """Responses ``{"403": {"$ref": "#/components/responses/E403"}, ...}``."""
    unknown = [c for c in codes if int(c) not in wire.ERROR_TEXT]
    assert not unknown, f"no documented error response for {unknown} (wire.ERROR_TEXT)"
    return {code: {"$ref": f"#/components/responses/E{code}"} for code in codes}


_ref = schema_ref
_json = json_response


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


#: the broker counts fractions in millionths (ppm): 0.000001 is the smallest it accepts
_FRACTION = {"type": "number", "minimum": 1 / wire.PPM, "maximum": 1}
_TIME = {"type": "number", "description": "POSIX time in seconds."}
_MPS_STATES = MPS_STATES_SCHEMA
_MPS_UIDS = MPS_UIDS_SCHEMA
_UID = UID_SCHEMA
_PID = PID_SCHEMA
_PID_NS = PID_NS_SCHEMA
_CGROUP = CGROUP_SCHEMA

_QUOTA_PROPS: dict[str, Any] = {
    "max_fraction": _nullable(
        {
            "type": "number",
            "minimum": 0,
            "maximum": wire.MAX_QUOTA_FRACTION,
            "description": "Sum of GPU fractions held at once (may exceed 1: several GPUs); "
            "0, or at least 0.000001.",
        }
    ),
    "max_leases": _nullable(
        {
            "type": "integer",
            "minimum": 0,
            "maximum": wire.MAX_QUOTA_LEASES,
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
            "maximum": wire.MAX_BUDGET_FRACTION_HOURS,
            "description": "Fraction-hours that may be used per budget_window.",
        }
    ),
    "budget_window": {
        "description": "Budget window: seconds, or a duration such as '7d', '12h', '30m', "
        "from 1 second to 10 years. Answers always give seconds.",
        # OAS 3.0: ``nullable`` needs a ``type``, so each branch is nullable (anyOf, not oneOf)
        "anyOf": [
            {"type": "integer", "minimum": 1, "maximum": wire.MAX_WINDOW_S, "nullable": True},
            {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?\s*[smhdw]$", "nullable": True},
        ],
    },
    "priority": _nullable(
        {
            "type": "integer",
            "minimum": wire.PRIORITY_RANGE[0],
            "maximum": wire.PRIORITY_RANGE[1],
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
            "mps_uid": _nullable(
                {
                    **_UID,
                    "description": "The Unix uid this GPU's MPS server serves clients of, "
                    "as its node agent (--mps) last reported it (null: none). An "
                    "enforcement=mps kernel of another uid waits until those clients end.",
                }
            ),
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
                "maxLength": wire.MAX_ID_CHARS,
                "description": "The kernel's id: printable characters (no control characters).",
            },
            "fraction": {**_FRACTION, "example": 0.02},
            "node": {"type": "string", "description": "Place only on this node's GPUs."},
            "gpu_uuids": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": wire.MAX_GPU_UUIDS,
                "description": "Place only on these GPUs.",
            },
            "group": {"type": "string", "description": "Course (group) the kernelspec belongs to."},
            "wait": {
                "type": "number",
                "minimum": 0,
                "maximum": wire.MAX_WAIT,
                "default": 0,
                "description": "Seconds to hold the answer while queued (long-poll).",
            },
            "mps_uid": {
                **_UID,
                "description": "Sent by enforcement=mps kernels only: the Unix uid the kernel "
                "runs as (the provisioner's). MPS serves one uid per GPU at a time, so the "
                "broker places such a kernel only on a GPU whose MPS server serves this uid "
                "or none (else it waits, with a reason). A claim, never an identity: it "
                "steers the caller's own placement, and keeps other users' MPS kernels off "
                "the granted GPU only for TTL/3 + node_grace after the grant; after that a "
                "GPU's MPS owners are what its node agent reports and proves.",
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
            "state": enum_schema(wire.LEASE_STATES),
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
            "enforcement": enum_schema(
                wire.LEASE_ENFORCEMENTS,
                description="The layer that holds the memory cap: 'cooperative' (framework "
                "caps only: no agent on the lease's node), or 'agent-MODE' (the node "
                "agent's --enforce mode), prefixed 'driver+' where the node's driver caps the "
                "kernel's cgroup (nvmlDeviceSetMemoryLimits_v1, R615+).",
            ),
            "mps": enum_schema(
                wire.MPS_STATES,
                nullable=True,
                description="The MPS control daemon of the lease's GPU, as its node "
                "agent (--mps) last reported it (null: no agent runs one). A kernel "
                "with enforcement=mps is capped by the driver only while it runs.",
            ),
            "mps_uid": _nullable(
                {
                    **_UID,
                    "description": "The uid the kernel's provisioner reported for an "
                    "enforcement=mps kernel (null: not an MPS kernel, or reported to a broker "
                    "that restarted since: it is kept in memory only).",
                }
            ),
            "mps_server_uid": _nullable(
                {
                    **_UID,
                    "description": "The uid the MPS server of the lease's GPU serves clients "
                    "of now, as its node agent (--mps) last reported it (null: none).",
                }
            ),
            "kernel_refused": _nullable(
                {
                    "type": "string",
                    "description": "Why the lease's node agent does not act on the kernel "
                    "its renewals name (not proven to be the lease's: its usage is not "
                    "counted, nothing is killed, limited or parked for it); null: proven, "
                    "or no agent has said.",
                }
            ),
            "session": _nullable(
                {
                    "type": "string",
                    "description": "While a class session of one of the user's courses is "
                    "about to start or under way: 'GPU reserved for ml101 until 11:30'.",
                }
            ),
            "execution_state": _nullable({"type": "string"}),
            "last_activity": _nullable(_TIME),
            "parked_at": _nullable(
                {
                    **_TIME,
                    "description": "When the broker began to park the lease (states parking, "
                    "parked, resuming; null otherwise). A parked lease holds no GPU memory: "
                    "its kernel's is in its node's RAM until it resumes.",
                }
            ),
            "resume": {
                "type": "object",
                "description": "Only on a parked lease whose resume request waits: its place "
                "in the queue.",
                "required": ["position"],
                "properties": {
                    "position": _nullable({"type": "integer", "minimum": 1}),
                    "eta_seconds": _nullable({"type": "number", "minimum": 0}),
                },
            },
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
            "pid": {"type": "integer", "minimum": 1, "maximum": wire.MAX_KERNEL_PID},
            "execution_state": {
                "type": "string",
                "pattern": f"^[A-Za-z0-9_-]{{1,{wire.MAX_EXECUTION_STATE_CHARS}}}$",
                "example": "idle",
            },
            "last_activity": {**_TIME, "minimum": 0, "maximum": wire.MAX_TIME},
            # node boundaries: pid namespaces and the kernel's cgroup
            "pid_ns": {
                **_PID_NS,
                "description": "The inode of the pid namespace `pid` is numbered in "
                "(/proc/<pid>/ns/pid); lets the node agent find a kernel that runs in a "
                "container or under `unshare --pid`.",
            },
            "cgroup": {
                **_CGROUP,
                "description": "The kernel's own cgroup v2, from the hierarchy's root, as "
                "the provisioner sees it (informational: the node agent reads the cgroup of "
                "the proven kernel itself).",
            },
            # proof of the kernel's secret
            "proof": {
                "type": "string",
                "pattern": wire.PROOF_PATTERN,
                "description": "The hex sha256 of the kernel's secret (the kernel's "
                f"{wire.KERNEL_SECRET_ENV}): the node agent acts on the kernel only once it "
                "finds that secret in the process's environment. Kept in memory only.",
            },
        },
    },
    "Resume": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "wait": {
                "type": "number",
                "minimum": 0,
                "maximum": wire.MAX_WAIT,
                "default": 0,
                "description": "Seconds to hold the answer until the lease is active (long-poll).",
            },
        },
    },
    "Resuming": {
        "type": "object",
        "required": ["lease", "state", "position", "eta_seconds", "queue_length"],
        "properties": {
            "lease": _ref("Lease"),
            "state": enum_schema(wire.PARK_STATES),
            "position": _nullable(
                {
                    "type": "integer",
                    "minimum": 1,
                    "description": "The resume request's place in the queue (null: not "
                    "waiting: parking, or resuming).",
                }
            ),
            "eta_seconds": _nullable(
                {
                    "type": "number",
                    "minimum": 0,
                    "description": "Estimated seconds until the resume is granted, when the "
                    "broker can estimate one.",
                }
            ),
            "queue_length": {"type": "integer", "minimum": 0},
        },
    },
    "ParkOutcome": ParkOutcome.SCHEMA,
    "KernelLaunch": KernelLaunch.SCHEMA,
    "LaunchOrder": LaunchOrder.SCHEMA,
    "RemoteKernelStatus": RemoteKernelStatus.SCHEMA,
    "RemoteKernel": {
        "type": "object",
        "additionalProperties": False,
        "required": ["lease_id", "node", "generation", "state", "cursor"],
        "properties": {
            "lease_id": {"type": "string"},
            "node": {"type": "string", "description": "The node that runs (or will run) it."},
            "generation": {
                "type": "integer",
                "minimum": 1,
                "description": "1 for the first launch; each relaunch (a restart) adds one.",
            },
            "state": enum_schema(
                wire.REMOTE_KERNEL_STATES,
                description="launching: the node has not started it yet; running: it "
                "listens at `ip`/`ports`; exited: it ended (`exit_code`); failed: it never "
                "started (`reason`, the node's own words).",
            ),
            "cursor": {
                "type": "string",
                "description": "Send it back as `after` to wait for the next change.",
            },
            "kernel_id": {"type": "string"},
            **{
                name: schema
                for name, schema in RemoteKernelStatus.SCHEMA["properties"].items()
                if name not in ("lease_id", "generation", "state", "signaled")
            },
        },
    },
    "KernelSignal": {
        "type": "object",
        "additionalProperties": False,
        "required": ["signal"],
        "properties": {"signal": enum_schema(wire.KERNEL_SIGNALS)},
    },
    "Revoke": {
        "type": "object",
        "additionalProperties": False,
        "required": ["reason"],
        "properties": {
            "reason": {
                "type": "string",
                "minLength": 1,
                "maxLength": wire.MAX_REASON_CHARS,
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
            "session": {
                "type": "string",
                "description": "Why it waits when a class session of another course holds "
                "part of its GPUs: 'Part of the GPUs you may use is reserved for ml101's class "
                "session until 11:30.' Absent otherwise.",
            },
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
            "uuid": {"type": "string", "minLength": 1, "maxLength": wire.MAX_UUID_CHARS},
            "name": {
                "type": "string",
                "minLength": 1,
                "maxLength": wire.MAX_ID_CHARS,
                "example": "H100",
            },
            "memory_mb": {"type": "integer", "minimum": 1, "maximum": wire.MAX_GPU_MEMORY_MB},
            "index": {"type": "integer", "minimum": 0, "maximum": wire.MAX_GPU_INDEX},
        },
    },
    "NodeRegistration": {
        "type": "object",
        "additionalProperties": False,
        "required": ["gpus", "agent_version"],
        "properties": {
            "gpus": {"type": "array", "maxItems": wire.MAX_NODE_GPUS, "items": _ref("NodeGPU")},
            "agent_version": {
                "type": "string",
                "minLength": 1,
                "maxLength": wire.MAX_VERSION_CHARS,
            },
            "enforce": enum_schema(wire.ENFORCE_MODES, default=wire.DEFAULT_ENFORCE_MODE),
        },
    },
    "UsageSample": {
        "type": "object",
        "additionalProperties": False,
        "required": ["pid", "gpu_uuid", "used_mb"],
        "properties": {
            "pid": {"type": "integer", "minimum": 1, "maximum": wire.MAX_PID},
            "gpu_uuid": {"type": "string", "minLength": 1, "maxLength": wire.MAX_UUID_CHARS},
            "used_mb": {"type": "integer", "minimum": 0, "maximum": wire.MAX_GPU_MEMORY_MB},
        },
    },
    "NodeHeartbeat": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "usage": {
                "type": "array",
                "maxItems": wire.MAX_USAGE_SAMPLES,
                "items": _ref("UsageSample"),
            },
            "at": {**_TIME, "minimum": 0, "maximum": wire.MAX_TIME},
            # each node feature's fields (provisioner/node_report.py)
            **heartbeat_schema(),
        },
    },
    "NodeBeat": {
        "type": "object",
        "required": ["node", "state"],
        "properties": {
            "node": {"type": "string"},
            "state": enum_schema(wire.NODE_STATES),
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
            # each node feature's fields (provisioner/node_report.py)
            **answer_schema(),
        },
    },
    "NodeOrders": {
        "type": "object",
        "additionalProperties": False,
        "required": ["node", "cursor", "orders"],
        "properties": {
            "node": {"type": "string"},
            "cursor": {
                "type": "string",
                "description": "The due orders' cursor: send it back as `after`.",
            },
            # the heartbeat answer's ``orders``, the same entries
            "orders": answer_schema()["orders"],
            "remote_kernel_orders": {
                "type": "integer",
                "minimum": 1,
                "description": "How many remote-kernel orders (launch, signal, end) are "
                "due; the heartbeat's answer carries them. Absent: none.",
            },
        },
    },
    "Node": {
        "type": "object",
        "required": ["node", "state", "gpus", "last_seen"],
        "properties": {
            "node": {"type": "string"},
            "state": enum_schema(wire.NODE_STATES),
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
            "enforce": enum_schema(wire.ENFORCE_MODES),
            "usage": {"type": "array", "items": _ref("UsageSample")},
            "unleased": {"type": "array", "items": _ref("UsageSample")},
            "mps": _MPS_STATES,
            "mps_uid": _MPS_UIDS,
        },
    },
    "ClassSession": {
        "type": "object",
        "description": "A class session: a course's reserved GPU share on its timetable "
        "(the courses file) or started by hand (docs/instructors.md).",
        "required": ["course", "start", "end", "tz", "state", "share", "reserved", "used", "lent"],
        "additionalProperties": False,
        "properties": {
            "course": {"type": "string"},
            "start": _TIME,
            "end": _TIME,
            "tz": {"type": "string", "description": "The IANA zone its times are told in."},
            "label": {"type": "string", "description": "Its line of the timetable."},
            "source": {"type": "string", "enum": ["timetable", "by hand"]},
            "state": {
                "type": "string",
                "enum": ["planned", "lead", "on", "after"],
                "description": "planned (not yet in its lead time), lead (before the start: "
                "non-members are kept out of the share), on, after (past session_lend_after: "
                "an unused share is lent back until a member asks).",
            },
            "share": {"type": "string", "description": "What it reserves, in words."},
            "wanted": {"type": "number", "minimum": 0, "description": "GPUs it asks for."},
            "reserved": {
                "type": "number",
                "minimum": 0,
                "description": "GPUs reserved now (0 while planned; never beyond the pool).",
            },
            "used": {"type": "number", "minimum": 0, "description": "GPUs members use of it."},
            "lent": {"type": "number", "minimum": 0, "description": "GPUs lent back now."},
            "gpus": _nullable({"type": "array", "items": {"type": "string"}}),
            "nodes": _nullable({"type": "array", "items": {"type": "string"}}),
            "member": {
                "type": "boolean",
                "description": "In the list: whether the caller belongs to the course.",
            },
        },
    },
    "SessionList": {
        "type": "object",
        "required": ["sessions", "now"],
        "properties": {
            "sessions": {"type": "array", "items": _ref("ClassSession")},
            "now": _TIME,
        },
    },
    "SessionStart": {
        "type": "object",
        "description": "Start a session now until `until`, reserving `seats` × `kernel_fraction` "
        "(default: the course's max_lease_fraction) or `share` of the pool.",
        "required": ["until"],
        "additionalProperties": False,
        "properties": {
            "until": _TIME,
            "seats": {"type": "integer", "minimum": 1, "maximum": 100000},
            "kernel_fraction": {
                "type": "number",
                "minimum": 0,
                "exclusiveMinimum": True,
                "maximum": 1,
            },
            "share": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
            "tz": {"type": "string", "description": "IANA zone to tell its times in."},
        },
    },
    "SessionExtend": {
        "type": "object",
        "required": ["until"],
        "additionalProperties": False,
        "properties": {"until": _TIME},
    },
    "NodeList": {
        "type": "object",
        "required": ["nodes"],
        "properties": {"nodes": {"type": "array", "items": _ref("Node")}},
    },
}


def build_document(paths: dict[str, Any], base_url: str = "/") -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of REST API v1 with ``paths``, its server at ``base_url``.

    ``routes.build_openapi`` passes the route table's paths and the broker's base URL
    (the hub service prefix behind JupyterHub). Returns a fresh dict each call.
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
            {"name": "sessions"},
        ],
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "responses": {
                f"E{code}": _json(_ref("Error"), text) for code, text in wire.ERROR_TEXT.items()
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


__all__ = ["build_document", "documented_routes", "error_refs", "json_response", "schema_ref"]
