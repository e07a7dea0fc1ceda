"""The wire's vocabulary: every value and limit the REST API's two ends must agree on, once.

Lease, node and MPS states, enforcement modes, the request limits, the fraction's
ppm conversion, the HTTP status of each error and the default CUDA context overhead.
The broker (``broker/web/validation.py``, ``broker/web/handlers.py``), the OpenAPI document
(``broker/web/openapi.py`` builds each field's schema from these tuples with
:func:`enum_schema`), the client, the node agent and the kernel side (``kernel/status.py``)
import them from here, so a field's documented values and the values it carries cannot
drift apart (``tests/test_conformance.py`` checks every answer of the API tests against
the served document).

To add a value (a lease state, an enforcement mode) add it to its tuple here; the
validators, the document and the tables that iterate them follow. Floor 1: imports
nothing of ours but :mod:`provisioner.errors`; pure, nothing happens at import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

from . import errors

# -- fractions: integer parts per million on the wire's inside ---------------------------

#: the broker counts GPU fractions in millionths: 0.000001 is the smallest it knows
PPM = 1_000_000


def fraction_to_ppm(fraction: float) -> int:
    """0.02 -> 20000. The caller has validated the fraction (``model.validate_fraction``)."""
    return int(round(fraction * PPM))


def ppm_to_fraction(ppm: float) -> float:
    """20000 -> 0.02 (a float for JSON; exact arithmetic stays in ppm; a mean may be a float)."""
    return ppm / PPM


# -- states --------------------------------------------------------------------------

#: a lease that still holds its GPU share
LiveLeaseState = Literal["active"]
#: the ways a lease ends (its hold time then feeds the estimated waits)
EndedLeaseState = Literal["revoked", "released", "expired"]
#: a lease's ``state`` in memory and in the database: live, then one of the ways it ends
LeaseState = Literal[LiveLeaseState, EndedLeaseState]
#: a live lease whose kernel's GPU memory is being parked in host RAM (it still holds
#: its share), is parked (it holds none), or is being restored (it holds its share
#: again); in memory ``Lease.park`` with ``state`` "active" (see ``model.Lease.wire_state``)
ParkState = Literal["parking", "parked", "resuming"]
PARK_STATES: tuple[ParkState, ...] = get_args(ParkState)
#: a lease's ``state`` on the wire (``Lease.wire_state``): live, parked or on the way, ended
WireLeaseState = Literal[LiveLeaseState, ParkState, EndedLeaseState]
LEASE_STATES: tuple[str, ...] = get_args(WireLeaseState)
LIVE_LEASE_STATES: tuple[LeaseState, ...] = get_args(LiveLeaseState)
ENDED_LEASE_STATES: tuple[LeaseState, ...] = get_args(EndedLeaseState)
#: what the broker orders a node agent to do with a lease's kernel (heartbeat ``orders``)
PARK_ACTIONS: tuple[str, ...] = ("park", "resume")
#: how an order went, as the agent reports it (heartbeat ``parking``); ``waiting``: a
#: resume found too little free GPU memory and is repeated
PARK_OUTCOMES: tuple[str, ...] = ("done", "failed", "waiting")
#: a GPU kernel's lease as the JupyterLab extension shows it: waiting in the queue first
KERNEL_LEASE_STATES: tuple[str, ...] = ("waiting", *LEASE_STATES)

#: what ``GET /api/v1/nodes`` says of a node: its agent heartbeats, is silent longer than
#: the grace, or was stopped cleanly (no new leases there; held ones stay)
NODE_STATES: tuple[str, ...] = ("up", "lost", "drained")
#: a GPU's MPS control daemon as its node agent (``--mps``) reports it
MPS_STATES: tuple[str, ...] = ("running", "down")

# -- enforcement -----------------------------------------------------------------------

#: only the frameworks' own caps hold a kernel's memory cap (a kernel's default
#: enforcement; a lease's without an agent on its node)
COOPERATIVE = "cooperative"
#: how a kernel's GPU memory cap is held: by the frameworks' own caps, or also by MPS
#: (the kernelspec's and the provisioner's ``enforcement``)
ENFORCEMENTS: tuple[str, ...] = (COOPERATIVE, "mps")
#: what a node agent does with over-use (``gpu-lease-agent --enforce``, a registration's
#: ``enforce``)
ENFORCE_MODES: tuple[str, ...] = ("off", "report", "revoke", "kill")
#: the agent's mode when a registration names none
DEFAULT_ENFORCE_MODE = "report"


#: the driver holds the kernel's memory cap too: a per-cgroup hard limit (NVML
#: ``nvmlDeviceSetMemoryLimits_v1``, driver R615+) on the kernel's cgroup, set by its agent
DRIVER_LAYER = "driver"


def lease_enforcement(enforce_mode: str | None, driver: bool = False) -> str:
    """A lease's ``enforcement`` field: ``cooperative`` without an agent on its node,
    else ``agent-MODE`` (the agent's ``--enforce`` mode); ``driver+agent-MODE`` where the
    agent reports a driver memory limit in force on the kernel's cgroup (``driver``)."""
    if enforce_mode is None:
        return COOPERATIVE
    layer = f"agent-{enforce_mode}"
    return f"{DRIVER_LAYER}+{layer}" if driver else layer


#: every value of a lease's ``enforcement`` field
LEASE_ENFORCEMENTS: tuple[str, ...] = (
    lease_enforcement(None),
    *(lease_enforcement(m) for m in ENFORCE_MODES),
    *(lease_enforcement(m, driver=True) for m in ENFORCE_MODES),
)

# -- limits ------------------------------------------------------------------------------

#: the longest long-poll (s) an acquire may ask for (``wait``), and a node's orders
#: long-poll (``timeout``)
MAX_WAIT = 300.0
#: a node's orders long-poll (s) when its ``timeout`` is not given, and the agent's default
ORDERS_WAIT = 30.0
#: the longest kernel id, node, group, user or lease id: the store's columns hold 255
MAX_ID_CHARS = 255
#: the most GPU uuids one acquire may name
MAX_GPU_UUIDS = 64
#: the most GPUs one node may register (and MPS states one heartbeat may carry)
MAX_NODE_GPUS = 64
#: the most per-process samples one heartbeat may carry
MAX_USAGE_SAMPLES = 4096
#: the largest GPU memory (MiB) a node may declare: 16 TiB
MAX_GPU_MEMORY_MB = 16 * 1024 * 1024
#: the largest pid accepted (Linux: at most 2**22; leave room for other systems)
MAX_PID = 2**31 - 1
MAX_UUID_CHARS = 128
MAX_VERSION_CHARS = 64
#: the largest Unix uid (an acquire's ``mps_uid``, a heartbeat's ``mps_uid`` values):
#: uid_t is 32 bits, and (uid_t)-1 means "none"
MAX_UID = 2**32 - 2
#: the largest GPU index a node may register
MAX_GPU_INDEX = 1023
#: the largest kernel pid a lease's renewal may report
MAX_KERNEL_PID = 2**32
#: a pid namespace's inode number (``/proc/<pid>/ns/pid``; a renewal's ``pid_ns``)
MAX_PID_NS = 2**64 - 1
#: the longest kernel cgroup v2 path (from the v2 hierarchy's root; a renewal's ``cgroup``)
MAX_CGROUP_CHARS = 1024
#: a kernel cgroup v2 path: names of letters, digits and ``._@:+=,-`` between slashes
CGROUP_PATTERN = r"^(/[A-Za-z0-9._@:+=,-]+)+$"
#: the environment variable that carries a lease's kernel secret (proof that a process
#: is its kernel): the provisioner sets it in the kernel's environment, children inherit it,
#: and the root agent reads it in ``/proc/<pid>/environ``; only its digest goes on the wire
KERNEL_SECRET_ENV = "GPU_LEASE_KERNEL_SECRET"
#: a renewal's ``proof``: the hex sha256 of the kernel's secret (64 lowercase hex digits)
PROOF_PATTERN = r"^[0-9a-f]{64}$"
#: the longest reason the agent gives for a claim it refused
MAX_REFUSAL_CHARS = 300
#: the longest ``execution_state`` a renewal may report
MAX_EXECUTION_STATE_CHARS = 32
#: the longest reason an admin may give a revocation
MAX_REASON_CHARS = 500
#: the latest POSIX time a heartbeat's ``at`` or a renewal's ``last_activity`` may carry
MAX_TIME = 100_000_000_000

# -- remote kernels (a kernel launched on its lease's node by the node's agent) ------------
#: a remote kernel's states: ``launching`` (ordered, the agent has not answered),
#: ``running`` (the agent started it: its address and ports are known), ``exited`` (it
#: ended; ``exit_code`` says how) and ``failed`` (it never started; ``reason`` says why)
REMOTE_KERNEL_STATES: tuple[str, ...] = ("launching", "running", "exited", "failed")
#: the states a remote kernel does not leave (a new launch starts a new generation)
REMOTE_KERNEL_ENDED: tuple[str, ...] = ("exited", "failed")
#: the signals a provisioner may have the node send to its kernel (jupyter_client's
#: interrupt, terminate and kill, and the ones users send with ``signal_kernel``)
KERNEL_SIGNALS: tuple[str, ...] = (
    "SIGINT",
    "SIGTERM",
    "SIGKILL",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGCONT",
    "SIGSTOP",
)
#: a kernel's ZMQ ports, as its connection file names them
KERNEL_CHANNELS: tuple[str, ...] = (
    "shell_port",
    "iopub_port",
    "stdin_port",
    "control_port",
    "hb_port",
)
#: the HMAC schemes a launch may name (jupyter_client's ``Session.signature_scheme``)
SIGNATURE_SCHEMES: tuple[str, ...] = ("hmac-sha256", "hmac-sha512", "hmac-md5", "hmac-sha1")
#: a launch's limits: argv entries, environment variables, characters of each
MAX_ARGV = 256
MAX_ENV = 512
MAX_ARG_CHARS = 8192
MAX_PATH_CHARS = 4096
#: the longest HMAC key a launch may carry
MAX_KEY_CHARS = 512
#: the longest budget window (s): ten years
MAX_WINDOW_S = 10 * 366 * 86400
#: a quota's bounds: ``max_fraction`` (summed over GPUs), ``max_leases``,
#: ``budget_fraction_hours`` and a group's ``priority`` (from lowest to highest)
MAX_QUOTA_FRACTION = 1_000_000
MAX_QUOTA_LEASES = 1_000_000
MAX_BUDGET_FRACTION_HOURS = 1_000_000_000
PRIORITY_RANGE = (-1000, 1000)

#: MiB every CUDA process takes outside any framework cap (the broker's default
#: ``context_overhead_mb``; ``GET /api/v1/gpus`` tells each GPU's)
DEFAULT_CONTEXT_OVERHEAD_MB = 512

# -- errors: HTTP status <-> error ----------------------------------------------------------

#: HTTP status -> the exception an answer of that status means when its body names no
#: ``error`` code the client knows (each of our exceptions carries its own ``code`` and
#: ``status``; this is the reverse, for the status alone)
ERROR_BY_STATUS: dict[int, type[errors.GPULeaseError]] = {
    400: errors.InvalidRequest,
    401: errors.NotAuthenticated,
    403: errors.Forbidden,
    404: errors.LeaseNotFound,
    405: errors.MethodNotAllowed,
    409: errors.Conflict,
    410: errors.LeaseGone,
    413: errors.BodyTooLarge,
    422: errors.CannotFit,
    502: errors.BrokerUnavailable,
    503: errors.BrokerUnavailable,
    504: errors.BrokerUnavailable,
}

#: the error answers the broker documents (OpenAPI ``components/responses/E<status>``)
ERROR_TEXT: dict[int, str] = {
    400: "Invalid input (malformed JSON, wrong types, unknown fields, bad fraction, "
    "an unprintable or over-long id or name in the URL or query).",
    401: "Missing or invalid token.",
    403: "Not allowed: quota exceeded, not a member of the course, or not an admin.",
    404: "No such lease or record, or another user's (answered alike: no oracle).",
    409: "Conflict: this kernel already holds a lease of another fraction.",
    410: "The lease has ended (revoked or expired); the body's reason says why.",
    413: "Request body too large.",
    422: "Can never fit: above the largest GPU, or below the CUDA context overhead.",
    503: "The broker's database is unavailable; nothing was changed.",
}


def error_code(status: int) -> str:
    """The ``error`` code of an answer that has only its HTTP status (tornado's own 404,
    405, 413, ...): that of :data:`ERROR_BY_STATUS`, else ``http_error``."""
    cls = ERROR_BY_STATUS.get(status)
    return cls.code if cls is not None else "http_error"


# -- browsers ------------------------------------------------------------------------------
#: headers of every broker answer: no page of another origin may frame the dashboard (a page a
#: student serves could otherwise drive an instructor's logged-in dashboard)
NO_FRAMES = {"Content-Security-Policy": "frame-ancestors 'none'", "X-Frame-Options": "DENY"}


# -- courses and nodes -----------------------------------------------------------------


def may_use_course(group: str | None, groups: Iterable[str], admin: bool) -> bool:
    """Whether a caller in ``groups`` may use a kernel of course ``group``: a kernel of no
    course, a member of the course, or an admin (the broker refuses the rest; the
    launcher hides their kernelspecs)."""
    return not group or admin or group in set(groups)


#: where a node's name comes from, first set wins: ours, then Slurm's (``slurmd``'s node)
NODE_NAME_VARS: tuple[str, ...] = ("GPU_LEASE_NODE", "SLURMD_NODENAME")


def node_from_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(name, variable)`` of the node named by ``env`` (:data:`NODE_NAME_VARS`), else None."""
    for var in NODE_NAME_VARS:
        name = env.get(var, "").strip()
        if name:
            return name, var
    return None


def this_node(env: Mapping[str, str] | None = None) -> str:
    """This machine's node name as the broker, its agent and its kernels know it: named by
    the environment (:func:`node_from_env`), else the host name."""
    named = node_from_env(os.environ if env is None else env)
    return named[0] if named else socket.gethostname()


# -- schemas (the OpenAPI document builds each field from the tuples above) --------------


def enum_schema(values: Iterable[str], *, nullable: bool = False, **more: Any) -> dict[str, Any]:
    """The OpenAPI 3.0 schema of a string field that takes one of ``values``.

    ``nullable``: the field may also be ``null`` (OAS 3.0.3: ``null`` must be listed in
    ``enum`` too, or validators refuse it).
    """
    listed: list[str | None] = list(values)
    schema: dict[str, Any] = {"type": "string", "enum": listed, **more}
    if nullable:
        schema["enum"] = [*listed, None]
        schema["nullable"] = True
    return schema


#: where the agent puts each GPU's MPS pipe and log directories (and provisioners look)
DEFAULT_MPS_DIR = "/run/gpu-lease/mps"


def kernel_proof(secret: str) -> str:
    """A renewal's ``proof`` of the kernel secret ``secret``: its hex sha256."""
    return hashlib.sha256(secret.encode()).hexdigest()


def pipe_directory(mps_dir: str, gpu_uuid: str) -> str:
    """The ``CUDA_MPS_PIPE_DIRECTORY`` of ``gpu_uuid``'s daemon."""
    return os.path.join(mps_dir, gpu_uuid, "pipe")


def mps_covered_file(mps_dir: str, gpu_uuid: str) -> str:
    """Where the node agent lists the leases whose memory the MPS limits in force on
    ``gpu_uuid`` cover (one :func:`lease_digest` a line; written by root, read by the
    provisioners before they start an MPS kernel)."""
    return os.path.join(mps_dir, gpu_uuid, "covered")


def lease_digest(lease_id: str) -> str:
    """A lease id as a file others can read names it: its sha256, hex (no lease id is
    confirmed to anyone but its holder and the admins)."""
    return hashlib.sha256(lease_id.encode()).hexdigest()


__all__ = [
    "CGROUP_PATTERN",
    "COOPERATIVE",
    "DEFAULT_CONTEXT_OVERHEAD_MB",
    "DEFAULT_ENFORCE_MODE",
    "DRIVER_LAYER",
    "ENDED_LEASE_STATES",
    "ENFORCEMENTS",
    "ENFORCE_MODES",
    "ERROR_BY_STATUS",
    "ERROR_TEXT",
    "KERNEL_CHANNELS",
    "KERNEL_LEASE_STATES",
    "KERNEL_SIGNALS",
    "KERNEL_SECRET_ENV",
    "LEASE_ENFORCEMENTS",
    "LEASE_STATES",
    "LIVE_LEASE_STATES",
    "MAX_ARGV",
    "MAX_ARG_CHARS",
    "MAX_BUDGET_FRACTION_HOURS",
    "MAX_ENV",
    "MAX_KEY_CHARS",
    "MAX_PATH_CHARS",
    "MAX_CGROUP_CHARS",
    "MAX_EXECUTION_STATE_CHARS",
    "MAX_GPU_INDEX",
    "MAX_GPU_MEMORY_MB",
    "MAX_GPU_UUIDS",
    "MAX_ID_CHARS",
    "MAX_KERNEL_PID",
    "MAX_NODE_GPUS",
    "MAX_PID",
    "MAX_PID_NS",
    "MAX_QUOTA_FRACTION",
    "MAX_REFUSAL_CHARS",
    "MAX_QUOTA_LEASES",
    "MAX_REASON_CHARS",
    "MAX_TIME",
    "MAX_UID",
    "MAX_USAGE_SAMPLES",
    "MAX_UUID_CHARS",
    "MAX_VERSION_CHARS",
    "MAX_WAIT",
    "ORDERS_WAIT",
    "MAX_WINDOW_S",
    "MPS_STATES",
    "NODE_NAME_VARS",
    "NODE_STATES",
    "PARK_ACTIONS",
    "PARK_OUTCOMES",
    "PARK_STATES",
    "PPM",
    "PROOF_PATTERN",
    "REMOTE_KERNEL_ENDED",
    "REMOTE_KERNEL_STATES",
    "SIGNATURE_SCHEMES",
    "PRIORITY_RANGE",
    "EndedLeaseState",
    "LeaseState",
    "LiveLeaseState",
    "ParkState",
    "WireLeaseState",
    "enum_schema",
    "error_code",
    "fraction_to_ppm",
    "kernel_proof",
    "lease_enforcement",
    "may_use_course",
    "node_from_env",
    "ppm_to_fraction",
    "this_node",
    "DEFAULT_MPS_DIR",
    "lease_digest",
    "mps_covered_file",
    "pipe_directory",
]


# -- a renewal's claims ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Renewal:
    """What a kernel's holder says when it renews (``POST /api/v1/leases/{id}/renew``'s
    body), typed once for both ends: the client sends :meth:`to_json`, the broker's
    ``web/validation.parse_renewal`` checks a body into one, ``LeaseService.renew`` takes it.

    ``pid`` (the kernel's, numbered in the pid namespace ``pid_ns``, an inode), ``cgroup``
    (the kernel's cgroup v2 path) and ``proof`` (the hex sha256 of the kernel's secret) are
    claims the node agent proves before anything counts them; ``execution_state`` and
    ``last_activity`` (POSIX seconds) feed the idle rule. Every field is optional."""

    pid: int | None = None
    execution_state: str | None = None
    last_activity: float | None = None
    pid_ns: int | None = None
    cgroup: str | None = None
    proof: str | None = None

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The body's field names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_json(self) -> dict[str, Any]:
        """The request body: only the fields given."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
