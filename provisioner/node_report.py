"""A node agent's heartbeat, typed: one set of values the agent builds, its client sends
(:meth:`NodeReport.to_json`), the broker's validation parses (:meth:`NodeReport.from_json`,
every check and its message here) and the broker's node service reads.

The report is the core (``usage``, ``at``) and one *part* per node feature: MPS daemons
(:class:`MPSReport`), proven kernels and refused claims (:class:`KernelReport`), driver
memory limits (:class:`DriverLimitsReport`) and parking (:class:`NodeParkReport`). Each part
names its fields (``FIELDS``), parses them (``from_json``: None when the body carries none
of them, an agent without the feature or older than it) and writes them (``to_json``:
only what it holds, so that a broker older than a feature never sees its fields). A new
feature adds its part here and to :data:`PARTS` (docs/developers.md, "Add a node feature").

The wire stays as it was: the same fields, the same values, the same refusals.
Pure, nothing happens at import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from . import wire
from .errors import InvalidRequest
from .json_checks import cgroup, check_fields, json_list, json_object, json_type, number, show
from .json_checks import text as _text
from .json_checks import whole as _int
from .wire import (
    MAX_GPU_MEMORY_MB,
    MAX_NODE_GPUS,
    MAX_PID,
    MAX_PID_NS,
    MAX_REASON_CHARS,
    MAX_REFUSAL_CHARS,
    MAX_TIME,
    MAX_UID,
    MAX_USAGE_SAMPLES,
    MAX_UUID_CHARS,
    MPS_STATES,
    PARK_ACTIONS,
    PARK_OUTCOMES,
    enum_schema,
)

#: the largest host memory (MiB) a heartbeat may report: 1 EiB
MAX_HOST_MEMORY_MB = 2**40
#: the longest a park or resume may have taken (s), as a heartbeat reports it
MAX_PARK_SECONDS = 86400.0
USAGE_FIELDS = ("pid", "gpu_uuid", "used_mb")
KERNEL_MAP_FIELDS = (
    "pid",
    "pid_ns",
    "host_pid",
    "lease_id",
    "uid",
    "cgroup",
    "escaped",
    "left_mps",
)
REFUSED_FIELDS = ("lease_id", "reason")
PARK_OUTCOME_FIELDS = ("lease_id", "action", "outcome", "message", "pids", "mb", "seconds")

#: one usage sample: ``(pid, gpu_uuid, used_mb)``
Usage = tuple[int, str, int]

# -- the OpenAPI schemas' building blocks (``broker/web/openapi.py`` serves each part's) ----


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` that also takes ``null`` (OAS 3.0)."""
    return {**schema, "nullable": True}


#: a Unix uid (``wire.MAX_UID``: uid_t is 32 bits; (uid_t)-1 means "none")
UID_SCHEMA: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": wire.MAX_UID}
PID_SCHEMA: dict[str, Any] = {"type": "integer", "minimum": 1, "maximum": wire.MAX_PID}
#: a pid namespace's inode number (a renewal's and a heartbeat's ``pid_ns``)
PID_NS_SCHEMA: dict[str, Any] = {"type": "integer", "minimum": 1, "maximum": wire.MAX_PID_NS}
#: a kernel's cgroup v2 path from the hierarchy's root
CGROUP_SCHEMA: dict[str, Any] = {
    "type": "string",
    "maxLength": wire.MAX_CGROUP_CHARS,
    "pattern": wire.CGROUP_PATTERN,
}
MPS_STATES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "maxProperties": wire.MAX_NODE_GPUS,
    "additionalProperties": enum_schema(wire.MPS_STATES),
    "description": "GPU uuid -> state of its MPS control daemon (agents with --mps).",
}
MPS_UIDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "maxProperties": wire.MAX_NODE_GPUS,
    "additionalProperties": nullable(UID_SCHEMA),
    "description": "GPU uuid -> the Unix uid its MPS server serves clients of now (null: no "
    "server, or one without clients; agents with --mps). MPS serves one uid per GPU at a "
    "time: the broker places an enforcement=mps kernel only where it serves the kernel's "
    "uid or none.",
}


class ReportPart:
    """One node feature's fields of a heartbeat (subclasses are frozen dataclasses)."""

    #: the body's fields this part reads and writes
    FIELDS: ClassVar[tuple[str, ...]] = ()
    #: the OpenAPI schema of each of its fields (``NodeHeartbeat``'s properties)
    SCHEMA: ClassVar[dict[str, Any]] = {}
    #: the OpenAPI schema of each field its feature adds to the answer (``NodeBeat``'s)
    ANSWER_SCHEMA: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ReportPart | None:
        """This part of a heartbeat body (None: none of its fields); raises InvalidRequest."""
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """This part's fields of a heartbeat body (only those it holds)."""
        raise NotImplementedError


P = TypeVar("P", bound=ReportPart)


# -- MPS ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MPSReport(ReportPart):
    """``mps``: GPU uuid -> ``running`` | ``down`` of the agent's MPS daemons (``--mps``);
    ``mps_uid``: GPU uuid -> the uid its MPS server serves clients of (None: none, or no
    client). Either is None when the agent does not send it."""

    FIELDS: ClassVar[tuple[str, ...]] = ("mps", "mps_uid")
    SCHEMA: ClassVar[dict[str, Any]] = {
        "mps": MPS_STATES_SCHEMA,
        "mps_uid": MPS_UIDS_SCHEMA,
    }
    ANSWER_SCHEMA: ClassVar[dict[str, Any]] = {
        "leases": {
            "type": "array",
            "description": "Every active lease of the node from its grant on, whether "
            "or not its kernel has reported a pid: what the agent's MPS daemons bound "
            "each new client by (the largest lease of the client's user on the GPU).",
            "items": {
                "type": "object",
                "required": ["lease_id", "user", "gpu_uuid", "memory_mb", "enforcement"],
                "properties": {
                    "lease_id": {"type": "string"},
                    "user": {"type": "string"},
                    "gpu_uuid": {"type": "string"},
                    "memory_mb": {"type": "integer", "minimum": 0},
                    "enforcement": enum_schema(wire.ENFORCEMENTS),
                },
            },
        },
    }

    states: dict[str, str] | None = None
    uids: dict[str, int | None] | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> MPSReport | None:
        states = cls._states(body.get("mps"))
        uids = cls._uids(body.get("mps_uid"))
        return None if states is None and uids is None else cls(states, uids)

    @staticmethod
    def _states(raw: Any) -> dict[str, str] | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise InvalidRequest(f"'mps' must be a JSON object, not a {json_type(raw)}.")
        if len(raw) > MAX_NODE_GPUS:
            raise InvalidRequest(f"'mps' has {len(raw)} entries; send at most {MAX_NODE_GPUS}.")
        states: dict[str, str] = {}
        for gpu_uuid, state in raw.items():
            _text(gpu_uuid, "mps key", max_chars=MAX_UUID_CHARS)
            if state not in MPS_STATES:
                raise InvalidRequest(
                    f"'mps' states are {' or '.join(MPS_STATES)}, not {json_type(state)} "
                    f"{str(state)[:40]!r}."
                )
            states[gpu_uuid] = state
        return states

    @staticmethod
    def _uids(raw: Any) -> dict[str, int | None] | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise InvalidRequest(f"'mps_uid' must be a JSON object, not a {json_type(raw)}.")
        if len(raw) > MAX_NODE_GPUS:
            raise InvalidRequest(f"'mps_uid' has {len(raw)} entries; send at most {MAX_NODE_GPUS}.")
        out: dict[str, int | None] = {}
        for gpu_uuid, uid in raw.items():
            _text(gpu_uuid, "mps_uid key", max_chars=MAX_UUID_CHARS)
            out[gpu_uuid] = None if uid is None else _int(uid, "mps_uid", low=0, high=MAX_UID)
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.states is not None:
            out["mps"] = self.states
        if self.uids is not None:
            out["mps_uid"] = self.uids
        return out


# -- kernels: pid namespaces, proofs (cgroups) ---------------------------------------------


@dataclass(frozen=True)
class ProvenKernel:
    """A kernel a node agent proved to be its lease's (heartbeat ``kernels`` entry with
    ``lease_id``): its host pid, real uid, accepted cgroup, GPU processes outside it, and
    (an MPS lease's) GPU processes that are no client of their GPU's MPS server; ``pid``
    and ``pid_ns``: the claim's kernel as its provisioner sees it."""

    lease_id: str
    host_pid: int
    uid: int | None = None
    cgroup: str | None = None
    escaped: tuple[int, ...] = ()
    left_mps: tuple[int, ...] = ()
    pid: int | None = None
    pid_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Its ``kernels`` entry (``left_mps`` only when some: a broker older than that
        field refuses it)."""
        entry: dict[str, Any] = {
            "pid": self.pid,
            "pid_ns": self.pid_ns,
            "host_pid": self.host_pid,
            "lease_id": self.lease_id,
            "uid": self.uid,
            "cgroup": self.cgroup,
            "escaped": sorted(self.escaped),
        }
        if self.left_mps:
            entry["left_mps"] = sorted(self.left_mps)
        return entry


@dataclass(frozen=True)
class NodeProofs:
    """An agent's proven kernels and refused claims; a heartbeat without ``refused``
    comes from an agent older than proofs (no :class:`NodeProofs` then)."""

    proven: dict[str, ProvenKernel]
    refused: dict[str, str]


def _pid_list(entry: dict[str, Any], name: str) -> tuple[int, ...]:
    """A ``kernels`` entry's list of pids ``name`` (absent or null: none)."""
    pids = entry.get(name) or []
    if not isinstance(pids, list) or len(pids) > MAX_USAGE_SAMPLES:
        raise InvalidRequest(f"{name!r} must be a JSON array of pids.")
    return tuple(_int(p, name, low=1, high=MAX_PID) for p in pids)


@dataclass(frozen=True)
class KernelReport(ReportPart):
    """``kernels`` and ``refused``. ``namespaced``: which host pid each namespaced kernel
    the agent found is, ``{(pid, pid_ns): host_pid}`` (entries without ``lease_id``; None:
    no ``kernels``); ``proofs``: the proven kernels (entries with ``lease_id``) and the
    refused claims, None from an agent older than proofs (no ``refused``)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("kernels", "refused")
    SCHEMA: ClassVar[dict[str, Any]] = {
        "kernels": {
            "type": "array",
            "maxItems": wire.MAX_USAGE_SAMPLES,
            "description": "Which host pid each lease kernel of another pid namespace "
            "is (found through /proc/<pid>/status NSpid); `usage` names host pids. An "
            "agent that proves claims (it sends `refused`) lists each proven kernel, "
            "with its lease, real uid, cgroup, its GPU processes that left it and those "
            "outside MPS.",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["pid", "pid_ns", "host_pid"],
                "properties": {
                    "pid": PID_SCHEMA,
                    "pid_ns": nullable(PID_NS_SCHEMA),
                    "host_pid": PID_SCHEMA,
                    "lease_id": {"type": "string", "maxLength": wire.MAX_ID_CHARS},
                    "uid": {**UID_SCHEMA, "description": "The proven process's real uid."},
                    "cgroup": nullable(
                        {
                            **CGROUP_SCHEMA,
                            "description": "The proven process's cgroup (from "
                            "/proc/<pid>/cgroup), where the agent accepts it as a "
                            "kernel cgroup; null otherwise.",
                        }
                    ),
                    "escaped": {
                        "type": "array",
                        "maxItems": wire.MAX_USAGE_SAMPLES,
                        "items": PID_SCHEMA,
                        "description": "The kernel's GPU processes outside its cgroup "
                        "while a driver limit holds on it: the lease counts as over "
                        "its cap.",
                    },
                    "left_mps": {
                        "type": "array",
                        "maxItems": wire.MAX_USAGE_SAMPLES,
                        "items": PID_SCHEMA,
                        "description": "An MPS lease's kernel processes that use a GPU "
                        "without being clients of its MPS server (in two consecutive "
                        "samples), so outside any MPS memory limit: the lease counts as "
                        "over its cap. Absent: none.",
                    },
                },
            },
        },
        "refused": {
            "type": "array",
            "maxItems": wire.MAX_USAGE_SAMPLES,
            "description": "The kernels the answer named that the agent did not prove "
            "to be their lease's (it does not act on them), with the reason. Sent, even "
            "empty, by every agent that proves claims.",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["lease_id", "reason"],
                "properties": {
                    "lease_id": {"type": "string", "maxLength": wire.MAX_ID_CHARS},
                    "reason": {"type": "string", "maxLength": wire.MAX_REFUSAL_CHARS},
                },
            },
        },
    }
    ANSWER_SCHEMA: ClassVar[dict[str, Any]] = {
        "kernels": {
            "type": "array",
            "description": "The node's lease kernels as their provisioners CLAIM them "
            "(`pid_ns` null means a host pid): the agent acts on one only once it has "
            "proven it (the kernel secret whose sha256 is `proof` in the process's "
            "environment; the user's account's uid where there is one).",
            "items": {
                "type": "object",
                "required": ["pid", "pid_ns"],
                "properties": {
                    "pid": {"type": "integer", "minimum": 1},
                    "pid_ns": nullable(PID_NS_SCHEMA),
                    "lease_id": {"type": "string"},
                    "user": {"type": "string"},
                    "kernel_id": {"type": "string"},
                    "proof": nullable({"type": "string", "pattern": wire.PROOF_PATTERN}),
                    "gpu_uuid": {"type": "string"},
                    "memory_mb": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "The lease's memory (cap + context): the driver "
                        "limit on the proven kernel's cgroup.",
                    },
                    "enforcement": enum_schema(wire.ENFORCEMENTS),
                },
            },
        },
    }

    namespaced: dict[tuple[int, int], int] | None = None
    proofs: NodeProofs | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KernelReport | None:
        namespaced = cls._namespaced(body)
        proofs = cls._proofs(body)
        return None if namespaced is None and proofs is None else cls(namespaced, proofs)

    @staticmethod
    def _namespaced(body: dict[str, Any]) -> dict[tuple[int, int], int] | None:
        if body.get("kernels") is None:
            return None
        kernels: dict[tuple[int, int], int] = {}
        for raw in json_list(body, "kernels", MAX_USAGE_SAMPLES):
            entry = json_object(raw, "'kernels'")
            check_fields(entry, KERNEL_MAP_FIELDS, "kernels entry")
            if entry.get("lease_id") is not None:
                continue  # a proven kernel: _proofs
            key = (
                _int(entry.get("pid"), "pid", low=1, high=MAX_PID),
                _int(entry.get("pid_ns"), "pid_ns", low=1, high=MAX_PID_NS),
            )
            if key in kernels:
                raise InvalidRequest("Two 'kernels' entries name the same pid and pid_ns.")
            kernels[key] = _int(entry.get("host_pid"), "host_pid", low=1, high=MAX_PID)
        return kernels

    @staticmethod
    def _proofs(body: dict[str, Any]) -> NodeProofs | None:
        if body.get("refused") is None:
            return None
        proven: dict[str, ProvenKernel] = {}
        for raw in body.get("kernels") or []:
            entry = json_object(raw, "'kernels'")
            if entry.get("lease_id") is None:
                continue
            lease_id = _text(entry["lease_id"], "lease_id")
            if lease_id in proven:
                raise InvalidRequest("Two 'kernels' entries name the same lease_id.")
            pid_ns = None
            if entry.get("pid_ns") is not None:
                pid_ns = _int(entry["pid_ns"], "pid_ns", low=1, high=MAX_PID_NS)
            pid = _int(entry.get("pid"), "pid", low=1, high=MAX_PID)
            escaped, left_mps = _pid_list(entry, "escaped"), _pid_list(entry, "left_mps")
            proven[lease_id] = ProvenKernel(
                lease_id,
                _int(entry.get("host_pid"), "host_pid", low=1, high=MAX_PID),
                _int(entry["uid"], "uid", low=0, high=MAX_UID)
                if entry.get("uid") is not None
                else None,
                cgroup(entry["cgroup"]) if entry.get("cgroup") is not None else None,
                escaped,
                left_mps,
                pid,
                pid_ns,
            )
        refused: dict[str, str] = {}
        for raw in json_list(body, "refused", MAX_USAGE_SAMPLES):
            entry = json_object(raw, "'refused'")
            check_fields(entry, REFUSED_FIELDS, "refused entry")
            lease_id = _text(entry.get("lease_id"), "lease_id")
            refused[lease_id] = _text(entry.get("reason"), "reason", max_chars=MAX_REFUSAL_CHARS)
        return NodeProofs(proven, refused)

    def to_json(self) -> dict[str, Any]:
        kernels: list[dict[str, Any]] = [
            {"pid": pid, "pid_ns": pid_ns, "host_pid": host}
            for (pid, pid_ns), host in (self.namespaced or {}).items()
        ]
        if self.proofs is not None:
            kernels += [p.to_json() for p in self.proofs.proven.values()]
        out: dict[str, Any] = {}
        if kernels:
            out["kernels"] = kernels
        if self.proofs is not None:
            out["refused"] = [{"lease_id": k, "reason": v} for k, v in self.proofs.refused.items()]
        return out


# -- driver memory limits -------------------------------------------------------------------


@dataclass(frozen=True)
class DriverLimitsReport(ReportPart):
    """``driver_limits``: the kernel cgroups whose driver memory limit is in force (sent,
    even empty, by an agent whose driver offers them)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("driver_limits",)
    SCHEMA: ClassVar[dict[str, Any]] = {
        "driver_limits": {
            "type": "array",
            "maxItems": wire.MAX_USAGE_SAMPLES,
            "items": CGROUP_SCHEMA,
            "description": "The kernel cgroups whose driver memory limit "
            "(nvmlDeviceSetMemoryLimits_v1) is in force.",
        },
    }
    ANSWER_SCHEMA: ClassVar[dict[str, Any]] = {
        "limits": {
            "type": "array",
            "description": "Deprecated, always empty since agents prove claims (an agent sets "
            "driver limits only on the cgroups of the kernels it proves): an older agent "
            "sets none.",
            "items": {
                "type": "object",
                "required": ["cgroup", "gpu_uuid", "memory_mb"],
                "properties": {
                    "cgroup": CGROUP_SCHEMA,
                    "gpu_uuid": {"type": "string"},
                    "memory_mb": {"type": "integer", "minimum": 0},
                },
            },
        },
    }

    cgroups: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> DriverLimitsReport | None:
        if body.get("driver_limits") is None:
            return None
        return cls(tuple(cgroup(x) for x in json_list(body, "driver_limits", MAX_USAGE_SAMPLES)))

    def to_json(self) -> dict[str, Any]:
        return {"driver_limits": list(self.cgroups)}


# -- parking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParkOutcome:
    """One outcome of a park or resume order, as a node heartbeat's ``parking`` reports it."""

    #: its OpenAPI schema (the component ``ParkOutcome``)
    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["lease_id", "action", "outcome"],
        "properties": {
            "lease_id": {"type": "string", "minLength": 1, "maxLength": wire.MAX_ID_CHARS},
            "action": enum_schema(wire.PARK_ACTIONS),
            "outcome": enum_schema(
                wire.PARK_OUTCOMES,
                description="done: parked (GPU memory in host RAM) or restored; failed: "
                "could not (the broker revokes the lease, with `message` in its reason); "
                "waiting (resume only): the GPU lacks free memory for the restore yet.",
            ),
            "message": {
                "type": "string",
                "minLength": 1,
                "maxLength": wire.MAX_REASON_CHARS,
                "description": "Why it failed or waits.",
            },
            "pids": {
                "type": "array",
                "maxItems": wire.MAX_USAGE_SAMPLES,
                "items": PID_SCHEMA,
                "description": "The host pids acted on.",
            },
            "mb": {
                "type": "integer",
                "minimum": 0,
                "maximum": wire.MAX_GPU_MEMORY_MB,
                "description": "GPU MiB moved.",
            },
            "seconds": {"type": "number", "minimum": 0, "description": "How long it took."},
        },
    }

    lease_id: str
    action: str  # park | resume (wire.PARK_ACTIONS)
    outcome: str  # done | failed | waiting (wire.PARK_OUTCOMES)
    message: str | None = None
    pids: tuple[int, ...] = ()
    mb: int | None = None
    seconds: float | None = None

    @classmethod
    def from_json(cls, raw: Any) -> ParkOutcome:
        entry = json_object(raw, "'parking'")
        check_fields(entry, PARK_OUTCOME_FIELDS, "parking outcome")
        action = entry.get("action")
        if action not in PARK_ACTIONS:
            raise InvalidRequest(
                f"A parking outcome's 'action' is {' or '.join(PARK_ACTIONS)}, not {show(action)}."
            )
        outcome = entry.get("outcome")
        if outcome not in PARK_OUTCOMES:
            raise InvalidRequest(
                f"A parking outcome's 'outcome' is {', '.join(PARK_OUTCOMES)}, not {show(outcome)}."
            )
        message = entry.get("message")
        if message is not None:
            message = _text(message, "message", max_chars=MAX_REASON_CHARS)
        pids = entry.get("pids")
        if pids is not None:
            pids = [
                _int(p, "pids", low=1, high=MAX_PID)
                for p in json_list(entry, "pids", MAX_USAGE_SAMPLES)
            ]
        mb = entry.get("mb")
        if mb is not None:
            mb = _int(mb, "mb", low=0, high=MAX_GPU_MEMORY_MB)
        seconds = entry.get("seconds")
        if seconds is not None:
            seconds = number(seconds, "seconds", low=0.0, high=MAX_PARK_SECONDS)
        return cls(
            lease_id=_text(entry.get("lease_id"), "lease_id"),
            action=str(action),
            outcome=str(outcome),
            message=message,
            pids=tuple(pids or ()),
            mb=mb,
            seconds=seconds,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lease_id": self.lease_id,
            "action": self.action,
            "outcome": self.outcome,
            "pids": list(self.pids),
        }
        if self.mb is not None:
            out["mb"] = self.mb
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(frozen=True)
class NodeParkReport(ReportPart):
    """``checkpoint`` (whether the node's driver can checkpoint kernels) and
    ``host_memory_available_mb`` (MemAvailable in MiB; either None: absent, an agent older
    than parking) and ``parking``, the outcomes of park/resume orders not yet delivered
    (at most one per lease and action)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("checkpoint", "host_memory_available_mb", "parking")
    SCHEMA: ClassVar[dict[str, Any]] = {
        "checkpoint": {
            "type": "boolean",
            "description": "The node's CUDA driver offers the checkpoint API: its "
            "kernels can be parked (absent: no).",
        },
        "host_memory_available_mb": {
            "type": "integer",
            "minimum": 0,
            "description": "MemAvailable of the node's host (/proc/meminfo), MiB.",
        },
        "parking": {
            "type": "array",
            "maxItems": wire.MAX_USAGE_SAMPLES,
            "items": {"$ref": "#/components/schemas/ParkOutcome"},
            "description": "Outcomes of the park and resume orders since the last "
            "heartbeat (resent until delivered); applied before the answer.",
        },
    }
    ANSWER_SCHEMA: ClassVar[dict[str, Any]] = {
        "orders": {
            "type": "array",
            "description": "Kernels to park (checkpoint their GPU memory into host RAM) "
            "or resume (restore it), repeated in every answer until an outcome in "
            "`parking` settles each.",
            "items": {
                "type": "object",
                "required": ["lease_id", "action", "pid", "pid_ns", "gpu_uuid", "memory_mb"],
                "properties": {
                    "lease_id": {"type": "string"},
                    "action": enum_schema(wire.PARK_ACTIONS),
                    "pid": nullable({"type": "integer", "minimum": 1}),
                    "pid_ns": nullable(PID_NS_SCHEMA),
                    "gpu_uuid": {"type": "string"},
                    "memory_mb": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "The memory the lease reserves on the GPU.",
                    },
                },
            },
        },
    }

    checkpoint: bool | None = None
    host_memory_available_mb: int | None = None
    outcomes: tuple[ParkOutcome, ...] = ()

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> NodeParkReport | None:
        if all(body.get(f) is None for f in cls.FIELDS):
            return None
        checkpoint = body.get("checkpoint")
        if checkpoint is not None and not isinstance(checkpoint, bool):
            raise InvalidRequest(
                f"'checkpoint' must be true or false, not a JSON {json_type(checkpoint)}."
            )
        host = body.get("host_memory_available_mb")
        if host is not None:
            host = _int(host, "host_memory_available_mb", low=0, high=MAX_HOST_MEMORY_MB)
        outcomes: list[ParkOutcome] = []
        if body.get("parking") is not None:
            outcomes = [
                ParkOutcome.from_json(raw) for raw in json_list(body, "parking", MAX_USAGE_SAMPLES)
            ]
        if len({(o.lease_id, o.action) for o in outcomes}) != len(outcomes):
            raise InvalidRequest(
                "Two parking outcomes name the same lease and action; send one of each."
            )
        return cls(checkpoint, host, tuple(outcomes))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        if self.host_memory_available_mb is not None:
            out["host_memory_available_mb"] = self.host_memory_available_mb
        if self.outcomes:
            out["parking"] = [o.to_json() for o in self.outcomes]
        return out


# -- remote kernels --------------------------------------------------------------------------

PORTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": list(wire.KERNEL_CHANNELS),
    "properties": {
        name: {"type": "integer", "minimum": 1, "maximum": 65535} for name in wire.KERNEL_CHANNELS
    },
    "description": "The kernel's ZMQ ports, as a connection file names them.",
}
REMOTE_KERNEL_FIELDS = (
    "lease_id",
    "generation",
    "state",
    "ip",
    "ports",
    "pid",
    "pid_ns",
    "cgroup",
    "cwd",
    "cwd_shared",
    "exit_code",
    "reason",
    "signaled",
)


def kernel_ports(raw: Any) -> dict[str, int]:
    """A kernel's ``ports`` object: one port (1-65535) for each of its five channels."""
    entry = json_object(raw, "'ports'")
    check_fields(entry, wire.KERNEL_CHANNELS, "kernel ports")
    missing = [c for c in wire.KERNEL_CHANNELS if c not in entry]
    if missing:
        raise InvalidRequest(f"A kernel's 'ports' lacks {', '.join(missing)}.")
    return {c: _int(entry[c], c, low=1, high=65535) for c in wire.KERNEL_CHANNELS}


@dataclass(frozen=True)
class RemoteKernelStatus:
    """One kernel the agent launched, as its heartbeat's ``remote_kernels`` reports it
    (and, kept by the broker, as ``GET /api/v1/leases/{id}/kernel`` answers it)."""

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["lease_id", "generation", "state"],
        "properties": {
            "lease_id": {"type": "string", "minLength": 1, "maxLength": wire.MAX_ID_CHARS},
            "generation": {"type": "integer", "minimum": 1, "maximum": wire.MAX_PID},
            "state": enum_schema(
                wire.REMOTE_KERNEL_STATES[1:],
                description="running: started, listening at `ip`/`ports`; exited: it ended "
                "(`exit_code`); failed: it never started (`reason`).",
            ),
            "ip": {"type": "string", "minLength": 1, "maxLength": 64},
            "ports": PORTS_SCHEMA,
            "pid": PID_SCHEMA,
            "pid_ns": PID_NS_SCHEMA,
            "cgroup": CGROUP_SCHEMA,
            "cwd": {"type": "string", "minLength": 1, "maxLength": wire.MAX_PATH_CHARS},
            "cwd_shared": {"type": "boolean"},
            "exit_code": {"type": "integer", "minimum": -255, "maximum": 255},
            "reason": {"type": "string", "minLength": 1, "maxLength": wire.MAX_REASON_CHARS},
            "signaled": {
                "type": "integer",
                "minimum": 0,
                "maximum": wire.MAX_PID,
                "description": "The last signal order (`seq`) sent to the kernel.",
            },
        },
    }

    lease_id: str
    generation: int
    state: str  # running | exited | failed
    ip: str | None = None
    ports: dict[str, int] | None = None
    pid: int | None = None
    pid_ns: int | None = None
    cgroup: str | None = None
    cwd: str | None = None
    cwd_shared: bool | None = None
    exit_code: int | None = None
    reason: str | None = None
    signaled: int = 0

    @classmethod
    def from_json(cls, raw: Any) -> RemoteKernelStatus:
        entry = json_object(raw, "'remote_kernels'")
        check_fields(entry, REMOTE_KERNEL_FIELDS, "remote kernel")
        state = entry.get("state")
        if state not in wire.REMOTE_KERNEL_STATES[1:]:
            raise InvalidRequest(
                f"A remote kernel's 'state' is {', '.join(wire.REMOTE_KERNEL_STATES[1:])}, "
                f"not {show(state)}."
            )
        if state == "running" and (entry.get("ip") is None or entry.get("ports") is None):
            raise InvalidRequest("A running remote kernel's report names its 'ip' and 'ports'.")
        cwd_shared = entry.get("cwd_shared")
        if cwd_shared is not None and not isinstance(cwd_shared, bool):
            raise InvalidRequest(
                f"'cwd_shared' must be true or false, not a JSON {json_type(cwd_shared)}."
            )

        def opt(name: str, parse: Any) -> Any:
            return None if entry.get(name) is None else parse(entry[name])

        return cls(
            lease_id=_text(entry.get("lease_id"), "lease_id"),
            generation=_int(entry.get("generation"), "generation", low=1, high=MAX_PID),
            state=str(state),
            ip=opt("ip", lambda v: _text(v, "ip", max_chars=64)),
            ports=opt("ports", kernel_ports),
            pid=opt("pid", lambda v: _int(v, "pid", low=1, high=MAX_PID)),
            pid_ns=opt("pid_ns", lambda v: _int(v, "pid_ns", low=1, high=MAX_PID_NS)),
            cgroup=opt("cgroup", cgroup),
            cwd=opt("cwd", lambda v: _text(v, "cwd", max_chars=wire.MAX_PATH_CHARS)),
            cwd_shared=cwd_shared,
            exit_code=opt("exit_code", lambda v: _int(v, "exit_code", low=-255, high=255)),
            reason=opt("reason", lambda v: _text(v, "reason", max_chars=MAX_REASON_CHARS)),
            signaled=_int(entry.get("signaled", 0), "signaled", low=0, high=MAX_PID),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lease_id": self.lease_id,
            "generation": self.generation,
            "state": self.state,
        }
        for name in REMOTE_KERNEL_FIELDS[3:]:
            value = getattr(self, name)
            if value is not None and not (name == "signaled" and value == 0):
                out[name] = dict(value) if name == "ports" else value
        return out


LAUNCH_FIELDS = ("kernel_id", "argv", "env", "cwd", "key", "signature_scheme")
ORDER_FIELDS = ("lease_id", "generation", "user", *LAUNCH_FIELDS)


@dataclass(frozen=True)
class KernelLaunch:
    """What a lease's holder asks its node to start (``PUT /api/v1/leases/{id}/kernel``):
    the kernel's argv (``{connection_file}`` where the node's connection file goes), the
    environment it gets on top of the account's login environment, the notebook's
    directory on the server, and the HMAC key with its scheme. Kept in the broker's memory
    only until the node's agent has it; never stored or logged."""

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["kernel_id", "argv", "key"],
        "properties": {
            "kernel_id": {"type": "string", "minLength": 1, "maxLength": wire.MAX_ID_CHARS},
            "argv": {
                "type": "array",
                "minItems": 1,
                "maxItems": wire.MAX_ARGV,
                "items": {"type": "string", "minLength": 1, "maxLength": wire.MAX_ARG_CHARS},
                "description": "The kernel's command line; `{connection_file}` stands for "
                "the connection file the node writes.",
            },
            "env": {
                "type": "object",
                "maxProperties": wire.MAX_ENV,
                "additionalProperties": {"type": "string", "maxLength": wire.MAX_ARG_CHARS},
                "description": "Variables on top of the account's login environment.",
            },
            "cwd": {
                "type": "string",
                "minLength": 1,
                "maxLength": wire.MAX_PATH_CHARS,
                "description": "The notebook's directory on the server; the node uses it "
                "where that path is shared (else a scratch directory).",
            },
            "key": {
                "type": "string",
                "minLength": 16,
                "maxLength": wire.MAX_KEY_CHARS,
                "pattern": "^[ -~]+$",
                "description": "The kernel's HMAC key (kept in memory until the node has "
                "it; never stored or logged).",
            },
            "signature_scheme": enum_schema(wire.SIGNATURE_SCHEMES),
        },
    }

    kernel_id: str
    argv: tuple[str, ...]
    env: dict[str, str]
    key: str
    cwd: str | None = None
    signature_scheme: str = "hmac-sha256"

    @classmethod
    def from_json(cls, body: Any) -> KernelLaunch:
        body = json_object(body, "the launch")
        check_fields(body, LAUNCH_FIELDS, "kernel launch")
        argv = [_arg(a, "argv", allow_empty=False) for a in json_list(body, "argv", wire.MAX_ARGV)]
        if not argv:
            raise InvalidRequest("'argv' must name the kernel's command.")
        raw_env = body.get("env")
        if raw_env is None:
            raw_env = {}
        if not isinstance(raw_env, dict):
            raise InvalidRequest(f"'env' must be an object, not a JSON {json_type(raw_env)}.")
        if len(raw_env) > wire.MAX_ENV:
            raise InvalidRequest(
                f"'env' has {len(raw_env)} variables; send at most {wire.MAX_ENV}."
            )
        env: dict[str, str] = {}
        for name, value in raw_env.items():
            if not _ENV_NAME.match(name):
                raise InvalidRequest(
                    f"'env' names {show(name)}, not a variable name (letters, digits, _)."
                )
            env[name] = _arg(value, f"env {name}", allow_empty=True)
        key = body.get("key")
        if not isinstance(key, str) or not 16 <= len(key) <= wire.MAX_KEY_CHARS:
            raise InvalidRequest(
                f"'key' must be the kernel's HMAC key, 16 to {wire.MAX_KEY_CHARS} characters."
            )
        if not key.isascii() or not key.isprintable():
            raise InvalidRequest("'key' must be printable ASCII.")
        scheme = body.get("signature_scheme", "hmac-sha256")
        if scheme not in wire.SIGNATURE_SCHEMES:
            raise InvalidRequest(
                f"'signature_scheme' is one of {', '.join(wire.SIGNATURE_SCHEMES)}, not "
                f"{show(scheme)}."
            )
        cwd = body.get("cwd")
        if cwd is not None:
            cwd = _text(cwd, "cwd", max_chars=wire.MAX_PATH_CHARS)
            if not cwd.startswith("/"):
                raise InvalidRequest(f"'cwd' must be an absolute path, not {show(cwd)}.")
        return cls(
            kernel_id=_text(body.get("kernel_id"), "kernel_id"),
            argv=tuple(argv),
            env=env,
            key=key,
            cwd=cwd,
            signature_scheme=str(scheme),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kernel_id": self.kernel_id,
            "argv": list(self.argv),
            "env": dict(self.env),
            "key": self.key,
            "signature_scheme": self.signature_scheme,
        }
        if self.cwd is not None:
            out["cwd"] = self.cwd
        return out

    def __repr__(self) -> str:  # never the key or the environment in a log line
        return f"KernelLaunch(kernel_id={self.kernel_id!r}, argv={list(self.argv)!r})"


@dataclass(frozen=True)
class LaunchOrder:
    """A heartbeat answer's ``launch`` entry: the launch, for whom and which generation."""

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["lease_id", "generation", "user", "kernel_id", "argv", "key"],
        "properties": {
            "lease_id": {"type": "string", "minLength": 1, "maxLength": wire.MAX_ID_CHARS},
            "generation": {"type": "integer", "minimum": 1},
            "user": {
                "type": "string",
                "minLength": 1,
                "maxLength": wire.MAX_ID_CHARS,
                "description": "The lease's holder: the Unix account the kernel runs as.",
            },
            **KernelLaunch.SCHEMA["properties"],
        },
    }

    lease_id: str
    generation: int
    user: str
    launch: KernelLaunch

    @classmethod
    def from_json(cls, raw: Any) -> LaunchOrder:
        entry = dict(json_object(raw, "'launch'"))
        check_fields(entry, ORDER_FIELDS, "launch order")
        lease_id = _text(entry.pop("lease_id", None), "lease_id")
        generation = _int(entry.pop("generation", None), "generation", low=1, high=MAX_PID)
        user = _text(entry.pop("user", None), "user")
        return cls(lease_id, generation, user, KernelLaunch.from_json(entry))

    def to_json(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "generation": self.generation,
            "user": self.user,
            **self.launch.to_json(),
        }


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")


def _arg(value: Any, name: str, *, allow_empty: bool) -> str:
    """An argv entry or an environment value: a string without NUL, of bounded length."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{name!r} must be a string, not a JSON {json_type(value)}.")
    if (not value and not allow_empty) or "\x00" in value or len(value) > wire.MAX_ARG_CHARS:
        raise InvalidRequest(
            f"{name!r} must be 1 to {wire.MAX_ARG_CHARS} characters without NUL."
            if not allow_empty
            else f"{name!r} must be at most {wire.MAX_ARG_CHARS} characters without NUL."
        )
    return value


@dataclass(frozen=True)
class RemoteKernelsReport(ReportPart):
    """``launches_kernels`` (the agent launches remote kernels: ``--launch-kernels``) and
    ``remote_kernels``, the state of every kernel it launched and has not forgotten (each
    beat, whole: the broker ends the kernels whose lease ended through the answer)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("launches_kernels", "remote_kernels")
    SCHEMA: ClassVar[dict[str, Any]] = {
        "launches_kernels": {
            "type": "boolean",
            "description": "The agent launches kernels for leases on its node "
            "(`gpu-lease agent --launch-kernels`).",
        },
        "remote_kernels": {
            "type": "array",
            "maxItems": wire.MAX_USAGE_SAMPLES,
            "items": {"$ref": "#/components/schemas/RemoteKernelStatus"},
            "description": "Every kernel the agent launched, and its state now.",
        },
    }
    ANSWER_SCHEMA: ClassVar[dict[str, Any]] = {
        "launch": {
            "type": "array",
            "description": "Kernels to launch (each lease's holder asked for it; repeated "
            "until the agent reports its generation).",
            "items": {"$ref": "#/components/schemas/LaunchOrder"},
        },
        "kernel_signals": {
            "type": "array",
            "description": "Signals to send to launched kernels (repeated until the "
            "agent's `signaled` reaches `seq`).",
            "items": {
                "type": "object",
                "required": ["lease_id", "generation", "seq", "signal"],
                "properties": {
                    "lease_id": {"type": "string"},
                    "generation": {"type": "integer"},
                    "seq": {"type": "integer"},
                    "signal": enum_schema(wire.KERNEL_SIGNALS),
                },
            },
        },
        "kernel_ends": {
            "type": "array",
            "description": "Launched kernels to end: their lease ended, or a newer "
            "generation replaces them.",
            "items": {
                "type": "object",
                "required": ["lease_id", "generation"],
                "properties": {
                    "lease_id": {"type": "string"},
                    "generation": {"type": "integer"},
                },
            },
        },
        "kernel_expiry": {
            "type": "object",
            "additionalProperties": {"type": "number"},
            "description": "Lease id -> when the lease of each launched kernel expires "
            "unless renewed: an agent that cannot reach the broker ends the kernel then.",
        },
    }

    launches_kernels: bool | None = None
    kernels: tuple[RemoteKernelStatus, ...] = ()

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RemoteKernelsReport | None:
        if all(body.get(f) is None for f in cls.FIELDS):
            return None
        flag = body.get("launches_kernels")
        if flag is not None and not isinstance(flag, bool):
            raise InvalidRequest(
                f"'launches_kernels' must be true or false, not a JSON {json_type(flag)}."
            )
        kernels: list[RemoteKernelStatus] = []
        if body.get("remote_kernels") is not None:
            kernels = [
                RemoteKernelStatus.from_json(raw)
                for raw in json_list(body, "remote_kernels", MAX_USAGE_SAMPLES)
            ]
        if len({k.lease_id for k in kernels}) != len(kernels):
            raise InvalidRequest("Two remote kernels name the same lease; report its latest.")
        return cls(flag, tuple(kernels))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.launches_kernels is not None:
            out["launches_kernels"] = self.launches_kernels
        if self.kernels or self.launches_kernels:
            out["remote_kernels"] = [k.to_json() for k in self.kernels]
        return out


# -- the report ------------------------------------------------------------------------------

#: every node feature's part, in the order the broker parses them
PARTS: tuple[type[ReportPart], ...] = (
    MPSReport,
    KernelReport,
    DriverLimitsReport,
    NodeParkReport,
    RemoteKernelsReport,
)
#: the fields agents have sent since before the report was typed, in the order the broker
#: has listed them in a refusal (``FIELDS``) and the order agents wrote them (``to_json``);
#: a new part's fields come after them, in the order of :data:`PARTS`
_LISTED = (
    "usage",
    "at",
    "mps",
    "mps_uid",
    "kernels",
    "driver_limits",
    "checkpoint",
    "host_memory_available_mb",
    "parking",
    "refused",
)
_WRITTEN = (
    "usage",
    "at",
    "mps",
    "mps_uid",
    "kernels",
    "driver_limits",
    "refused",
    "checkpoint",
    "host_memory_available_mb",
    "parking",
)


def _in_order(fields: Iterable[str], order: tuple[str, ...]) -> list[str]:
    """``fields`` sorted as ``order`` lists them, any other after them as they came."""
    fields = list(fields)
    return sorted(
        fields, key=lambda f: (order.index(f), 0) if f in order else (len(order), fields.index(f))
    )


#: the fields of a heartbeat: the core's and each part's
FIELDS: tuple[str, ...] = tuple(
    _in_order(("usage", "at", *(f for kind in PARTS for f in kind.FIELDS)), _LISTED)
)


@dataclass(frozen=True)
class NodeReport:
    """One heartbeat: the per-process ``usage`` samples, ``at`` (the agent's clock), and
    the parts of the node features that have something to say."""

    usage: tuple[Usage, ...] = ()
    at: float | None = None
    parts: tuple[ReportPart, ...] = field(default=())

    def part(self, kind: type[P]) -> P | None:
        """The part of ``kind``, None when the heartbeat carries none."""
        for p in self.parts:
            if isinstance(p, kind):
                return p
        return None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> NodeReport:
        """``POST /api/v1/nodes/{node}/heartbeat`` body -> the report; raises InvalidRequest.

        ``used_mb`` is a whole number of MiB, 0 to 16 TiB (the broker then checks it
        against the GPU's memory); one sample per ``(pid, gpu_uuid)``.
        """
        check_fields(body, FIELDS, "node heartbeat")
        at, usage = parse_core(body)
        parts = tuple(p for kind in PARTS if (p := kind.from_json(body)) is not None)
        return cls(usage, at, parts)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "usage": [{"pid": p, "gpu_uuid": u, "used_mb": m} for p, u, m in self.usage]
        }
        if self.at is not None:
            body["at"] = self.at
        for p in self.parts:
            body.update(p.to_json())
        return {name: body[name] for name in _in_order(body, _WRITTEN)}


def heartbeat_schema() -> dict[str, Any]:
    """The OpenAPI properties of every part's fields (a heartbeat's, beside the core's)."""
    return {name: schema for kind in PARTS for name, schema in kind.SCHEMA.items()}


def answer_schema() -> dict[str, Any]:
    """The OpenAPI properties of every feature's fields of the heartbeat's answer."""
    return {name: schema for kind in PARTS for name, schema in kind.ANSWER_SCHEMA.items()}


def parse_core(body: dict[str, Any]) -> tuple[float | None, tuple[Usage, ...]]:
    """A heartbeat's ``at`` and ``usage`` (the fields every agent sends)."""
    at = None
    if body.get("at") is not None:
        at = number(body["at"], "at", low=0.0, high=MAX_TIME)
    usage: list[Usage] = []
    for raw in json_list({"usage": body.get("usage", [])}, "usage", MAX_USAGE_SAMPLES):
        entry = json_object(raw, "'usage'")
        check_fields(entry, USAGE_FIELDS, "usage sample")
        usage.append(
            (
                _int(entry.get("pid"), "pid", low=1, high=MAX_PID),
                _text(entry.get("gpu_uuid"), "gpu_uuid", max_chars=MAX_UUID_CHARS),
                _int(entry.get("used_mb"), "used_mb", low=0, high=MAX_GPU_MEMORY_MB),
            )
        )
    if len({(p, u) for p, u, _ in usage}) != len(usage):
        raise InvalidRequest("Two usage samples name the same pid and GPU; send one of each.")
    return at, tuple(usage)


__all__ = [
    "FIELDS",
    "PARTS",
    "DriverLimitsReport",
    "KernelLaunch",
    "KernelReport",
    "LaunchOrder",
    "MPSReport",
    "NodeParkReport",
    "NodeProofs",
    "NodeReport",
    "ParkOutcome",
    "ProvenKernel",
    "RemoteKernelStatus",
    "RemoteKernelsReport",
    "ReportPart",
    "Usage",
    "kernel_ports",
    "answer_schema",
    "heartbeat_schema",
    "parse_core",
]
