"""Request validation: raw HTTP bodies and query values -> plain, checked values.

Pure functions, no I/O: the handlers (``handlers.py``) call them on every request
that carries a body or a query value, before anything reaches ``BrokerService``.
Each rejection is an :class:`~provisioner.errors.InvalidRequest` (400) or
:class:`~provisioner.errors.BodyTooLarge` (413) whose message is a sentence that
says what to fix. Nothing here looks at the pool: whether a fraction can ever fit
(422) is the core's decision (``scheduling.check_can_ever_fit``).
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Any

from ...errors import BodyTooLarge, InvalidRequest
from ...json_checks import cgroup as parse_cgroup
from ...json_checks import check_fields as check_fields
from ...json_checks import is_number as _is_number
from ...json_checks import json_list as _list
from ...json_checks import json_object as _object
from ...json_checks import json_type as _json_type
from ...json_checks import number as _number
from ...json_checks import show as _show
from ...json_checks import text as _text
from ...json_checks import whole as _int
from ...model import GPU, QUOTA_FIELDS, Identity, Quota, validate_fraction
from ...node_report import FIELDS as NODE_REPORT_FIELDS
from ...node_report import (
    KernelLaunch,
    KernelReport,
    MPSReport,
    NodeParkReport,
    NodeProofs,
    NodeReport,
    parse_core,
)
from ...wire import (
    DEFAULT_ENFORCE_MODE,
    ENFORCE_MODES,
    KERNEL_SIGNALS,
    MAX_BUDGET_FRACTION_HOURS,
    MAX_EXECUTION_STATE_CHARS,
    MAX_GPU_INDEX,
    MAX_GPU_MEMORY_MB,
    MAX_GPU_UUIDS,
    MAX_ID_CHARS,
    MAX_KERNEL_PID,
    MAX_NODE_GPUS,
    MAX_PID_NS,
    MAX_QUOTA_FRACTION,
    MAX_QUOTA_LEASES,
    MAX_REASON_CHARS,
    MAX_TIME,
    MAX_UID,
    MAX_UUID_CHARS,
    MAX_VERSION_CHARS,
    MAX_WAIT,
    MAX_WINDOW_S,
    ORDERS_WAIT,
    PRIORITY_RANGE,
    PROOF_PATTERN,
    Renewal,
    fraction_to_ppm,
    ppm_to_fraction,
)
from ..rules.policy import Ask

#: kernel execution states as jupyter_client reports them (others are accepted too)
EXECUTION_STATES = ("starting", "idle", "busy", "restarting", "autorestarting", "dead", "unknown")
#: the default look-back of ``GET /api/v1/usage``
DEFAULT_USAGE_WINDOW_S = 7 * 86400

ACQUIRE_FIELDS = ("kernel_id", "fraction", "node", "gpu_uuids", "group", "wait", "mps_uid")
HEARTBEAT_FIELDS = Renewal.fields()
_PROOF = re.compile(PROOF_PATTERN)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_STATE_CHARS = re.compile(r"^[A-Za-z0-9_-]+$")


# -- the body ------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise InvalidRequest(
        f"The request body contains {name}, which is not valid JSON; send a finite number."
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest(
            f"The number {text[:40]} in the request body is too large; send a finite number."
        )
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidRequest(
                f"The request body names the field {key[:64]!r} twice; send each field once."
            )
        out[key] = value
    return out


def parse_json_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is ``{}``.

    Refuses bodies above ``max_bytes`` (413), bytes that are not UTF-8, malformed
    JSON, ``NaN``/``Infinity`` (which Python's json would accept), numbers too large
    for a float or an int, duplicate keys, and anything but an object (400).
    """
    if len(raw) > max_bytes:
        raise BodyTooLarge(
            f"The request body has {len(raw)} bytes, more than the broker accepts "
            f"({max_bytes} bytes); send a smaller JSON object.",
            max_bytes=max_bytes,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest("The request body is not UTF-8 text; send a JSON object.") from exc
    if not text.strip():
        return {}
    try:
        body = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
    except InvalidRequest:
        raise
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"The request body is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}); send a JSON object such as "
            '{"kernel_id": "...", "fraction": 0.02}.'
        ) from exc
    except (ValueError, RecursionError) as exc:
        # ints above sys.get_int_max_str_digits(), or absurd nesting
        raise InvalidRequest(
            "The request body contains a number that is too large or nesting that is too "
            "deep; send a plain JSON object with ordinary numbers."
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"The request body must be a JSON object, not a JSON {_json_type(body)}; "
            'send e.g. {"kernel_id": "...", "fraction": 0.02}.'
        )
    return body


# -- single values -------------------------------------------------------------


def _optional_text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    return None if value is None else _text(value, name)


def parse_fraction(value: Any, name: str = "fraction", *, upper: float = 1.0) -> int:
    """A JSON number in ``(0, upper]`` -> ppm: ``model.validate_fraction``'s rule, no strings."""
    if not _is_number(value):
        hint = " (without quotes)" if isinstance(value, str) else ""
        raise InvalidRequest(
            f"{name!r} must be a number such as 0.02{hint}, not a JSON {_json_type(value)}."
        )
    return fraction_to_ppm(validate_fraction(value, repr(name), upper=upper))


# -- acquire ---------------------------------------------------------------------


def parse_acquire(body: dict[str, Any], ident: Identity) -> tuple[Ask, float]:
    """``POST /api/v1/leases`` body -> (the ``Ask`` with the caller's verified identity, wait s).

    Fields: ``kernel_id`` (1..256 printable characters), ``fraction`` (a JSON number,
    ``0 < f <= 1``), optional ``node``, ``gpu_uuids`` (at most 64 strings),
    ``group``, ``wait`` (long-poll seconds, 0..300, default 0) and ``mps_uid`` (an
    ``enforcement=mps`` kernel's Unix uid, 0..2**32-2: a claim, see
    ``node_rules.mps_owners_of``).
    """
    check_fields(body, ACQUIRE_FIELDS, "acquire request")
    if "kernel_id" not in body:
        raise InvalidRequest("The acquire request needs a 'kernel_id' (the kernel's id, a string).")
    if "fraction" not in body:
        raise InvalidRequest(
            "The acquire request needs a 'fraction' (the share of one GPU, e.g. 0.02)."
        )
    kernel_id = _text(body["kernel_id"], "kernel_id")
    ppm = parse_fraction(body["fraction"])
    node = _optional_text(body, "node")
    group = _optional_text(body, "group")
    uuids: tuple[str, ...] | None = None
    raw_uuids = body.get("gpu_uuids")
    if raw_uuids is not None:
        if not isinstance(raw_uuids, list):
            raise InvalidRequest(
                f"'gpu_uuids' must be a list of GPU UUID strings, not a JSON {_json_type(raw_uuids)}."
            )
        if len(raw_uuids) > MAX_GPU_UUIDS:
            raise InvalidRequest(
                f"'gpu_uuids' lists {len(raw_uuids)} GPUs; send at most {MAX_GPU_UUIDS}."
            )
        uuids = tuple(dict.fromkeys(_text(u, "gpu_uuids item") for u in raw_uuids))
    wait = 0.0
    if body.get("wait") is not None:
        wait = _number(body["wait"], "wait", low=0.0, high=MAX_WAIT)
    mps_uid = None
    if body.get("mps_uid") is not None:
        mps_uid = _int(body["mps_uid"], "mps_uid", low=0, high=MAX_UID)
    ask = Ask(
        user=ident.user,
        kernel_id=kernel_id,
        fraction_ppm=ppm,
        groups=ident.groups,
        admin=ident.admin,
        node=node,
        gpu_uuids=uuids,
        group=group,
        mps_uid=mps_uid,
    )
    return ask, wait


# -- heartbeat -------------------------------------------------------------------


def parse_revoke(body: dict[str, Any]) -> str:
    """``POST /api/v1/leases/{id}/revoke`` body ``{"reason": TEXT}`` -> the reason."""
    check_fields(body, ("reason",), "revoke request")
    if body.get("reason") is None:
        raise InvalidRequest(
            'Say why the lease is revoked: send {"reason": "..."}; the student sees it.'
        )
    return _text(body["reason"], "reason", max_chars=MAX_REASON_CHARS).strip() or "revoked"


def parse_renewal(body: dict[str, Any]) -> Renewal:
    """``POST /api/v1/leases/{id}/renew`` body -> the :class:`~provisioner.wire.Renewal` that
    ``LeaseService.renew`` takes.

    ``pid`` (an int > 0), ``execution_state`` (a kernel state such as ``idle`` or
    ``busy``: letters, digits, ``_`` and ``-``, at most 32) and ``last_activity``
    (POSIX seconds), each optional.
    """
    check_fields(body, HEARTBEAT_FIELDS, "renew request")
    out: dict[str, Any] = {}
    if body.get("pid") is not None:
        out["pid"] = _int(body["pid"], "pid", low=1, high=MAX_KERNEL_PID)
    state = body.get("execution_state")
    if state is not None:
        text = _text(state, "execution_state", max_chars=MAX_EXECUTION_STATE_CHARS)
        if not _STATE_CHARS.match(text):
            raise InvalidRequest(
                f"'execution_state' must be a kernel state such as {', '.join(EXECUTION_STATES)}."
            )
        out["execution_state"] = text.lower()
    if body.get("last_activity") is not None:
        out["last_activity"] = _number(
            body["last_activity"], "last_activity", low=0.0, high=MAX_TIME
        )
    # pid namespaces and cgroups (claims the node agent checks): only when reported
    if body.get("pid_ns") is not None:
        out["pid_ns"] = _int(body["pid_ns"], "pid_ns", low=1, high=MAX_PID_NS)
    if body.get("cgroup") is not None:
        out["cgroup"] = parse_cgroup(body["cgroup"])
    if body.get("proof") is not None:  # the digest of the kernel's secret
        proof = _text(body["proof"], "proof", max_chars=64)
        if not _PROOF.match(proof):
            raise InvalidRequest(
                "'proof' must be the hex sha256 of the kernel's secret: 64 lowercase hex "
                "digits (the provisioner sends it; leave it out rather than guess)."
            )
        out["proof"] = proof
    return Renewal(**out)


# -- quotas ----------------------------------------------------------------------


def parse_duration(value: Any, name: str = "budget_window") -> int:
    """Seconds as a whole number (``604800``) or a string such as ``"7d"``, ``"12h"``, ``"30m"``."""
    if isinstance(value, str):
        if value.strip().isdigit():
            seconds = int(value.strip())
        else:
            m = _DURATION.match(value)
            if m is None:
                raise InvalidRequest(
                    f'{name!r} must be seconds or a duration such as "7d", "12h" or '
                    f'"30m", not {_show(value)}.'
                )
            seconds = int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))
    elif _is_number(value):
        seconds = _int(value, name, low=1, high=MAX_WINDOW_S)
    else:
        raise InvalidRequest(
            f'{name!r} must be seconds or a duration such as "7d", not a JSON {_json_type(value)}.'
        )
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise InvalidRequest(f"{name!r} must be between 1 second and 10 years.")
    return seconds


def parse_session_until(body: dict[str, Any]) -> float:
    """``PATCH /api/v1/sessions/{course}``: ``{"until": POSIX seconds}``."""
    check_fields(body, ("until",), "session's extension")
    until: Any = body.get("until")
    if not _is_number(until) or not math.isfinite(until) or not 0 < until <= MAX_TIME:
        raise InvalidRequest(
            "'until' must be the session's new end in POSIX seconds (a number), "
            "e.g. gpu-lease session extend ml101 --until 11:45."
        )
    return float(until)


def parse_session_start(body: dict[str, Any]) -> dict[str, Any]:
    """``POST /api/v1/sessions/{course}`` -> the keyword arguments of
    ``SessionService.start``: ``until``, and ``seats`` (+ ``kernel_fraction``) or ``share``."""
    check_fields(body, ("until", "seats", "kernel_fraction", "share", "tz"), "session's start")
    out: dict[str, Any] = {"until": parse_session_until({"until": body.get("until")})}
    seats = body.get("seats")
    if seats is not None:
        if not isinstance(seats, int) or isinstance(seats, bool) or not 0 < seats <= 100_000:
            raise InvalidRequest("'seats' must be a whole number of seats such as 40.")
        out["seats"] = seats
    for key in ("kernel_fraction", "share"):
        if body.get(key) is not None:
            out[key] = ppm_to_fraction(parse_fraction(body[key], key))
    tz = body.get("tz")
    if tz is not None:
        if not isinstance(tz, str) or len(tz) > 64:
            raise InvalidRequest("'tz' must be an IANA time zone name such as 'Europe/Paris'.")
        out["tz"] = tz
    return out


def parse_quota(body: dict[str, Any]) -> Quota:
    """``PUT /api/v1/quotas/...`` body -> ``Quota``; a missing or null field is "not set here".

    ``max_fraction`` (the most a user holds at once, summed over GPUs, >= 0),
    ``max_lease_fraction`` (one kernel, in (0, 1]), ``max_leases`` (an int >= 0),
    ``budget_fraction_hours`` (>= 0) per ``budget_window`` (seconds or ``"7d"``),
    ``priority`` (an int, -1000..1000; groups only).
    """
    check_fields(body, QUOTA_FIELDS, "quota")
    values: dict[str, Any] = {}
    if body.get("max_fraction") is not None:
        v = body["max_fraction"]
        if _is_number(v) and v == 0:
            values["max_fraction_ppm"] = 0
        else:
            values["max_fraction_ppm"] = parse_fraction(v, "max_fraction", upper=MAX_QUOTA_FRACTION)
    if body.get("max_lease_fraction") is not None:
        values["max_lease_fraction_ppm"] = parse_fraction(
            body["max_lease_fraction"], "max_lease_fraction"
        )
    if body.get("max_leases") is not None:
        values["max_leases"] = _int(body["max_leases"], "max_leases", low=0, high=MAX_QUOTA_LEASES)
    if body.get("budget_fraction_hours") is not None:
        values["budget_fraction_hours"] = _number(
            body["budget_fraction_hours"],
            "budget_fraction_hours",
            low=0.0,
            high=MAX_BUDGET_FRACTION_HOURS,
        )
    if body.get("budget_window") is not None:
        values["budget_window_s"] = parse_duration(body["budget_window"])
    if body.get("priority") is not None:
        values["priority"] = _int(
            body["priority"], "priority", low=PRIORITY_RANGE[0], high=PRIORITY_RANGE[1]
        )
    if "budget_fraction_hours" in values and "budget_window_s" not in values:
        values["budget_window_s"] = DEFAULT_USAGE_WINDOW_S
    return Quota(**values)


# -- query values ----------------------------------------------------------------


def parse_since(value: str | None, now: float) -> float:
    """``?since=``: ISO 8601 (``2024-09-01``, ``2024-09-01T08:00:00Z``), POSIX seconds, or a
    relative duration (``7d``, ``24h``, ``30m``: that long before ``now``). Default: 7 days ago.

    A date or time without a zone is UTC.
    """
    if value is None or not value.strip():
        return now - DEFAULT_USAGE_WINDOW_S
    text = value.strip()
    m = _DURATION.match(text)
    if m is not None:
        return now - float(m.group(1)) * _UNITS[m.group(2).lower()]
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidRequest("'since' must be a finite, non-negative number of POSIX seconds.")
        return seconds
    iso = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        when = datetime.fromisoformat(iso)
    except ValueError as exc:
        raise InvalidRequest(
            f"'since' must be an ISO 8601 date or time (2024-09-01T08:00:00Z), POSIX seconds, "
            f"or a duration such as 7d or 24h, not {_show(text)}."
        ) from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


#: ``GET /api/v1/history``: the default period, and the default step's bucket count
DEFAULT_HISTORY_WINDOW = "24h"
DEFAULT_HISTORY_POINTS = 120


def parse_step(value: str | None, span: float) -> int:
    """``?step=``: whole seconds or a duration (``5m``, ``1h``); default: ``span`` in about
    120 buckets (at least a minute)."""
    if value is None or not value.strip():
        return max(60, math.ceil(span / DEFAULT_HISTORY_POINTS))
    return parse_duration(value, "step")


def parse_path_arg(value: str) -> str:
    """A lease id, user or group name from the URL path: printable text, at most 255 characters.

    Called by the handlers for every path argument, so that no id or name the store
    cannot hold (a NUL, 300 characters) ever reaches it.
    """
    if not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InvalidRequest(
            "A lease id, user or group name in the URL must be printable text of 1 to "
            f"{MAX_ID_CHARS} characters; check the URL."
        )
    return value


def parse_query_text(value: str, name: str) -> str:
    """A query value: printable text (no NUL or other control characters)."""
    if not value.isprintable():
        raise InvalidRequest(
            f"The query value {name!r} contains control or other unprintable characters; "
            "send printable text only."
        )
    return value


def parse_flag(value: str | None, name: str) -> bool:
    """``?all=1`` style flags: 1/true/yes/on or 0/false/no/off (absent: false)."""
    if value is None:
        return False
    text = value.strip().lower()
    if text in ("", "1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidRequest(f"{name!r} must be 1 or 0 (true or false), not {_show(value)}.")


__all__ = [
    "check_fields",
    "parse_acquire",
    "parse_duration",
    "parse_flag",
    "parse_path_arg",
    "parse_orders_poll",
    "parse_query_text",
    "parse_fraction",
    "parse_renewal",
    "parse_json_body",
    "parse_quota",
    "parse_revoke",
    "parse_since",
]


# -- node agents -------------------------------------------------------------------

NODE_FIELDS = ("gpus", "agent_version", "enforce")
NODE_GPU_FIELDS = ("uuid", "name", "memory_mb", "index")


def parse_node_registration(body: dict[str, Any], node: str) -> tuple[list[GPU], str, str]:
    """``PUT /api/v1/nodes/{node}`` body -> the node's GPUs, the agent's version, its mode.

    ``gpus``: 0 to 64 ``{uuid, name, memory_mb, index}`` with distinct uuids and indexes;
    ``enforce`` (optional, default ``report``): off | report | revoke | kill.
    """
    check_fields(body, NODE_FIELDS, "node registration")
    version = _text(body.get("agent_version"), "agent_version", max_chars=MAX_VERSION_CHARS)
    enforce = body.get("enforce", DEFAULT_ENFORCE_MODE)
    if enforce not in ENFORCE_MODES:
        raise InvalidRequest(f"'enforce' must be one of {', '.join(ENFORCE_MODES)}.")
    out: list[GPU] = []
    for raw in _list(body, "gpus", MAX_NODE_GPUS):
        entry = _object(raw, "'gpus'")
        check_fields(entry, NODE_GPU_FIELDS, "GPU entry")
        out.append(
            GPU(
                uuid=_text(entry.get("uuid"), "uuid", max_chars=MAX_UUID_CHARS),
                node=node,
                name=_text(entry.get("name"), "name"),
                memory_mb=_int(entry.get("memory_mb"), "memory_mb", low=1, high=MAX_GPU_MEMORY_MB),
                index=_int(entry.get("index"), "index", low=0, high=MAX_GPU_INDEX),
            )
        )
    if len({g.uuid for g in out}) != len(out):
        raise InvalidRequest("Two GPU entries have the same uuid; list each GPU once.")
    if len({g.index for g in out}) != len(out):
        raise InvalidRequest("Two GPU entries have the same index; list each GPU once.")
    return out, version, str(enforce)


def parse_node_report(body: dict[str, Any]) -> NodeReport:
    """``POST /api/v1/nodes/{node}/heartbeat`` body -> the node's report: its usage and
    each node feature's part (:mod:`provisioner.node_report` holds every check)."""
    return NodeReport.from_json(body)


def parse_node_heartbeat(
    body: dict[str, Any],
) -> tuple[list[tuple[int, str, int]], float | None, dict[str, str] | None]:
    """A heartbeat's fields, ``usage`` and ``at`` checked, and its ``mps`` states (None:
    no ``--mps``): the report's core, as the fuzzers read it."""
    check_fields(body, NODE_REPORT_FIELDS, "node heartbeat")
    at, usage = parse_core(body)
    mps = MPSReport.from_json({"mps": body.get("mps")})
    return list(usage), at, mps.states if mps is not None else None


def parse_mps_uids(body: dict[str, Any]) -> dict[str, int | None]:
    """A heartbeat's ``mps_uid`` (``{}`` when absent), as :class:`MPSReport` reads it."""
    mps = MPSReport.from_json({"mps_uid": body.get("mps_uid")})
    return dict(mps.uids or {}) if mps is not None else {}


def parse_node_proofs(body: dict[str, Any]) -> NodeProofs | None:
    """A heartbeat's proven kernels and refused claims, as :class:`KernelReport` reads them."""
    kernels = KernelReport.from_json(body)
    return kernels.proofs if kernels is not None else None


def parse_node_parking(body: dict[str, Any]) -> NodeParkReport:
    """A heartbeat's parking fields, as :class:`NodeParkReport` reads them (all absent:
    the empty report)."""
    return NodeParkReport.from_json(body) or NodeParkReport()


def parse_orders_poll(after: str | None, timeout: str | None) -> tuple[str | None, float]:
    """``GET /api/v1/nodes/{node}/orders?after=CURSOR&timeout=S`` -> the cursor the agent
    last saw (None: none, answer at once) and the long-poll's seconds (0 to ``MAX_WAIT``,
    default ``ORDERS_WAIT``)."""
    if after is not None and (not after or len(after) > MAX_ID_CHARS):
        raise InvalidRequest(
            f"'after' must be the cursor of an earlier answer (1 to {MAX_ID_CHARS} "
            "characters), or left out."
        )
    if timeout is None:
        return after, ORDERS_WAIT
    try:
        seconds = float(timeout)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_WAIT:
        raise InvalidRequest(
            f"'timeout' must be a number of seconds from 0 to {MAX_WAIT:g}, not {_show(timeout)}."
        )
    return after, seconds


def parse_kernel_poll(after: str | None, timeout: str | None) -> tuple[str | None, float]:
    """``GET /api/v1/leases/{id}/kernel?after=CURSOR&timeout=S``: as the orders' long-poll
    (an unchanged ``after`` waits up to ``timeout`` s; left out: answer at once), but a
    timeout left out is 0."""
    after, seconds = parse_orders_poll(after, timeout)
    return after, (0.0 if timeout is None else seconds)


SIGNAL_FIELDS = ("signal",)


def parse_kernel_signal(body: dict[str, Any]) -> str:
    """``POST /api/v1/leases/{id}/kernel/signal`` body ``{"signal": "SIGINT"}`` -> its name."""
    check_fields(body, SIGNAL_FIELDS, "kernel signal")
    name = body.get("signal")
    if name not in KERNEL_SIGNALS:
        raise InvalidRequest(f"'signal' is one of {', '.join(KERNEL_SIGNALS)}, not {_show(name)}.")
    return str(name)


def parse_kernel_launch(body: dict[str, Any]) -> KernelLaunch:
    """``PUT /api/v1/leases/{id}/kernel`` body -> the launch (every check in
    :meth:`~provisioner.node_report.KernelLaunch.from_json`)."""
    return KernelLaunch.from_json(body)


RESUME_FIELDS = ("wait",)


def parse_resume(body: dict[str, Any]) -> float:
    """``POST /api/v1/leases/{id}/resume`` body ``{}`` or ``{"wait": seconds}`` -> the
    long-poll's seconds (0 to ``MAX_WAIT``, default 0)."""
    check_fields(body, RESUME_FIELDS, "resume request")
    if body.get("wait") is None:
        return 0.0
    return _number(body["wait"], "wait", low=0.0, high=MAX_WAIT)
