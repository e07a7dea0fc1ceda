"""Text views of the broker's answers for ``gpu-lease top|leases|quota|usage``: pure functions.

The CLI (:mod:`provisioner.cli`) fetches JSON through :class:`~provisioner.client.BrokerClient`
and hands it, with ``now`` (POSIX seconds), to these functions, which return the text
to print. Nothing here does I/O or reads the clock, so tests call them with plain
dicts shaped like the REST API's answers (docs/developers.md, "REST API").
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .model import QUOTA_LEVEL_PLURALS
from .wire import COOPERATIVE, PARK_STATES

#: quota fields in the order the CLI shows them, with their column titles
QUOTA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("max_fraction", "MAX FRACTION"),
    ("max_leases", "MAX LEASES"),
    ("max_lease_fraction", "MAX LEASE FRACTION"),
    ("budget_fraction_hours", "BUDGET F-H"),
    ("budget_window", "WINDOW"),
    ("priority", "PRIORITY"),
)


# -- cells ---------------------------------------------------------------------------
def fraction(value: float | None) -> str:
    """0.02 -> ``0.02``, 1.0 -> ``1``, None -> ``-`` (at most 4 decimals, never an exponent)."""
    if value is None:
        return "-"
    return f"{value:.4f}".rstrip("0").rstrip(".") or "0"


def percent(value: float) -> str:
    """0.5 -> ``50%``, 0.125 -> ``12.5%``, 0.0001 -> ``0.01%``."""
    text = f"{value * 100:.2f}".rstrip("0").rstrip(".")
    return f"{text}%"


def duration(seconds: float | None) -> str:
    """A compact duration: ``42s``, ``5m07s``, ``3h05m``, ``2d04h``; None -> ``-``."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def window(seconds: int | None) -> str:
    """A budget window in the unit an admin would type: 604800 -> ``7d``, 5400 -> ``90m``."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{int(value)} MiB"


def bar(value: float, width: int = 20) -> str:
    """An ASCII allocation bar: ``bar(0.5, 10)`` -> ``[#####.....]`` (clamped to 0..1)."""
    value = min(1.0, max(0.0, value))
    filled = int(round(value * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def short(text: str | None, n: int = 8) -> str:
    """The first ``n`` characters of an id (kernel ids are UUIDs)."""
    return "-" if not text else text[:n]


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, ..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def idle(lease: Mapping[str, Any], now: float) -> str:
    """``busy`` while the kernel executes, else the time since its last activity; a lease
    being parked, parked or resuming says so instead (parked ones with their resume
    request's place in the queue while it waits: ``parked, 2nd to resume``)."""
    state = lease.get("state")
    if state in PARK_STATES:
        place = (lease.get("resume") or {}).get("position")
        return f"{state}, {ordinal(int(place))} to resume" if place else str(state)
    if lease.get("execution_state") == "busy":
        return "busy"
    last = lease.get("last_activity")
    return "-" if last is None else duration(now - float(last))


def table(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "") -> str:
    """Columns padded to their widest cell, two spaces apart; no trailing spaces."""
    grid = [list(header), *(list(r) for r in rows)]
    widths = [max(len(row[i]) for row in grid) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in grid]
    return "\n".join(indent + line.rstrip() for line in lines)


# -- views ------------------------------------------------------------------------------
LEASE_HEADER = ("USER", "KERNEL", "FRACTION", "MEMORY", "ENFORCED", "IDLE", "AGE", "LEASE")


def memory(lease: Mapping[str, Any]) -> str:
    """The lease's cap, or ``used/cap MiB`` where a node agent reports what the kernel uses."""
    used = lease.get("used_mb")
    cap = lease.get("memory_limit_mb")
    if used is None or cap is None:
        return mib(cap)
    return f"{int(used)}/{int(cap)} MiB"


def enforced(lease: Mapping[str, Any]) -> str:
    """The layers beyond the kernel's own framework caps that hold its memory cap, as the
    broker knows them: ``cooperative`` (none), ``agent-revoke`` (the node agent's mode),
    ``+mps`` / ``+mps down`` (the GPU's MPS daemon, for kernels with enforcement=mps);
    ``, kernel unproven`` where the node agent refused the kernel the renewals claim (its
    usage is not counted: ``kernel_refused`` says why)."""
    out = str(lease.get("enforcement") or COOPERATIVE)
    mps = lease.get("mps")
    if mps == "running":
        out += "+mps"
    elif mps == "down":
        out += "+mps down"
    if lease.get("kernel_refused"):
        out += ", kernel unproven"
    return out


def lease_row(lease: Mapping[str, Any], now: float) -> list[str]:
    return [
        str(lease.get("user", "?")),
        short(lease.get("kernel_id")),
        fraction(lease.get("fraction")),
        memory(lease),
        enforced(lease),
        idle(lease, now),
        duration(now - float(lease["created_at"])) if lease.get("created_at") else "-",
        short(lease.get("id"), 10),
    ]


def gpu_title(gpu: Mapping[str, Any]) -> str:
    """``GPU 0 V100 (node gpu-a)``; the node is left out when it is the default one."""
    index = gpu.get("index")
    name = f"GPU {index}" if index is not None else f"GPU {short(gpu.get('uuid'), 12)}"
    if gpu.get("name"):
        name += f" {gpu['name']}"
    if gpu.get("node") and gpu.get("node") not in ("", "local", "localhost"):
        name += f" (node {gpu['node']})"
    return name


def format_top(
    gpus: Sequence[Mapping[str, Any]],
    leases: Sequence[Mapping[str, Any]],
    queue: Sequence[Mapping[str, Any]],
    now: float,
    *,
    width: int = 20,
    sessions: Sequence[Mapping[str, Any]] = (),
) -> str:
    """``gpu-lease top``: each GPU with its bar and leases, then the queue, then the class
    sessions (timetable, reserved share, its use) if any. A GPU whose MPS
    server serves clients says whose uid (MPS serves one uid per GPU at a time: an
    enforcement=mps kernel of another uid waits for that GPU)."""
    by_gpu: dict[str, list[Mapping[str, Any]]] = {}
    for lease in leases:
        by_gpu.setdefault(str((lease.get("gpu") or {}).get("uuid")), []).append(lease)
    out: list[str] = []
    for gpu in gpus:
        alloc = float(gpu.get("allocated_fraction") or 0.0)
        total_mb = int(gpu.get("memory_mb") or 0)
        used_mb = int(gpu.get("allocated_mb", alloc * total_mb))
        count = int(gpu.get("leases", 0))
        mps_uid = gpu.get("mps_uid")
        out.append(
            f"{gpu_title(gpu)}  {bar(alloc, width)} {percent(alloc)} allocated  "
            f"{used_mb}/{total_mb} MiB  {count} lease{'' if count == 1 else 's'}"
            + ("" if mps_uid is None else f"  MPS serves uid {mps_uid}")
        )
        mine = sorted(by_gpu.pop(str(gpu.get("uuid")), []), key=lambda x: x.get("created_at", 0))
        if mine:
            out.append(table(LEASE_HEADER, (lease_row(x, now) for x in mine), indent="  "))
        out.append("")
    for uuid, rest in by_gpu.items():  # leases on a GPU the pool no longer lists
        out.append(f"GPU {short(uuid, 12)} (not in the pool)")
        out.append(table(LEASE_HEADER, (lease_row(x, now) for x in rest), indent="  "))
        out.append("")
    if not gpus and not by_gpu:
        out += ["No GPUs in the pool.", ""]
    out.append(format_queue(queue))
    if sessions:
        out += ["", format_sessions(sessions)]
    return "\n".join(out)


SESSION_HEADER = ("COURSE", "WHEN", "STATE", "SHARE", "RESERVED", "USED", "LENT")


def clock(when: float, tz: str) -> str:
    """``11:30`` in zone ``tz`` (UTC when the name is unknown here)."""
    try:
        zone: dt.tzinfo = ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        zone = dt.UTC
    return f"{dt.datetime.fromtimestamp(when, zone):%H:%M}"


def session_when(s: Mapping[str, Any]) -> str:
    tz = str(s.get("tz") or "UTC")
    start, end = float(s.get("start", 0)), float(s.get("end", 0))
    if s.get("source") == "by hand":
        return f"by hand {clock(start, tz)}-{clock(end, tz)} {tz}"
    label = str(s.get("label") or "")
    moved = f" (until {clock(end, tz)})" if label and not label.endswith(clock(end, tz)) else ""
    return f"{label}{moved} {tz}".strip()


def format_sessions(sessions: Sequence[Mapping[str, Any]]) -> str:
    """``gpu-lease session list`` and ``top``'s timetable: each session, its state, what it
    reserves, what its members use and what is lent back."""
    if not sessions:
        return "Class sessions: none in the next two days"
    rows = [
        [
            str(s.get("course", "?")),
            session_when(s),
            str(s.get("state", "?")),
            str(s.get("share", "-")),
            fraction(s.get("reserved")),
            fraction(s.get("used")),
            fraction(s.get("lent")),
        ]
        for s in sessions
    ]
    return "Class sessions:\n" + table(SESSION_HEADER, rows, "  ")


def format_session(verb: str, s: Mapping[str, Any]) -> str:
    """What ``session start|extend|end`` prints: one sentence."""
    tz = str(s.get("tz") or "UTC")
    until = clock(float(s.get("end", 0)), tz)
    if verb == "ended":
        return f"Ended {s.get('course')}'s class session; its GPU share is everyone's again."
    return (
        f"{verb.capitalize()} {s.get('course')}'s class session until {until} ({tz}): "
        f"{s.get('share')} reserved for its members, {fraction(s.get('reserved'))} GPU now."
    )


def format_queue(queue: Sequence[Mapping[str, Any]]) -> str:
    if not queue:
        return "Queue: empty"
    rows = [
        [
            str(q.get("position", "?")),
            str(q.get("user", "?")),
            short(q.get("kernel_id")),
            fraction(q.get("fraction")),
            str(q.get("group") or "-"),
            duration(q.get("waiting_s")),
        ]
        for q in queue
    ]
    head = f"Queue: {len(queue)} waiting"
    return (
        head + "\n" + table(("POS", "USER", "KERNEL", "FRACTION", "GROUP", "WAITING"), rows, "  ")
    )


def format_leases(
    leases: Sequence[Mapping[str, Any]],
    now: float,
    gpus: Sequence[Mapping[str, Any]] = (),
) -> str:
    """``gpu-lease leases``: one row per lease with its GPU (``GPU 0`` when ``gpus`` lists it)."""
    if not leases:
        return "No active leases."
    names = {str(g.get("uuid")): gpu_title(g) for g in gpus}
    header = (*LEASE_HEADER, "GPU")
    rows = [[*lease_row(x, now), _lease_gpu(x, names)] for x in leases]
    return table(header, rows)


def _lease_gpu(lease: Mapping[str, Any], names: Mapping[str, str]) -> str:
    gpu = lease.get("gpu") or {}
    return names.get(str(gpu.get("uuid"))) or str(gpu.get("name") or short(gpu.get("uuid"), 12))


def quota_cells(quota: Mapping[str, Any] | None) -> list[str]:
    q = quota or {}
    return [
        fraction(q.get("max_fraction")),
        "-" if q.get("max_leases") is None else str(q["max_leases"]),
        fraction(q.get("max_lease_fraction")),
        "-" if q.get("budget_fraction_hours") is None else fraction(q["budget_fraction_hours"]),
        window(q.get("budget_window")),
        "-" if q.get("priority") is None else str(q["priority"]),
    ]


def format_quota_list(book: Mapping[str, Any]) -> str:
    """``gpu-lease quota list``: the default, then groups, then users ("-": not set)."""
    rows = [["default", "-", *quota_cells(book.get("default"))]]
    for level, key in QUOTA_LEVEL_PLURALS.items():
        for name, quota in sorted((book.get(key) or {}).items()):
            rows.append([level, name, *quota_cells(quota)])
    header = ("LEVEL", "NAME", *(title for _, title in QUOTA_COLUMNS))
    return table(header, rows) + "\n(-: unlimited at the default level, inherited elsewhere)"


def format_quota(title: str, quota: Mapping[str, Any]) -> str:
    """One quota record as ``field: value`` lines; an ``effective`` quota follows if present."""
    lines = [title]
    for (_key, label), cell in zip(QUOTA_COLUMNS, quota_cells(quota), strict=True):
        lines.append(f"  {label.lower():<20}{cell}")
    if isinstance(quota.get("effective"), Mapping):
        lines.append("effective (default -> groups -> user):")
        for (_key, label), cell in zip(QUOTA_COLUMNS, quota_cells(quota["effective"]), strict=True):
            lines.append(f"  {label.lower():<20}{cell}")
    return "\n".join(lines)


def format_effective_quota(body: Mapping[str, Any]) -> str:
    """``gpu-lease quota show --user NAME``: the user's own record, then the effective quota
    exactly as the broker's admission applies it, each value with its source.

    ``body`` is ``GET /api/v1/quotas/users/{name}?effective=1``'s answer.
    """
    user = str(body.get("user", "?"))
    own = body.get("own")
    if isinstance(own, Mapping):
        lines = [format_quota(f"Quota of user {user}:", own)]
    else:
        lines = [f"Quota of user {user}: none set (`gpu-lease quota set --user {user}` sets one)"]
    groups = [str(g) for g in body.get("groups") or []]
    where = body.get("groups_from")
    in_groups = f"groups {', '.join(groups)}" if groups else "no group"
    lines.append(
        f"effective (default -> groups -> user), as the broker applies it to {user} in "
        f"{in_groups}" + (f" (from {where}):" if where else ":")
    )
    sources = body.get("sources") or {}
    cells = quota_cells(body.get("effective"))
    width = max(len(c) for c in cells)
    for (key, label), cell in zip(QUOTA_COLUMNS, cells, strict=True):
        lines.append(f"  {label.lower():<20}{cell:<{width}}  {sources.get(key, '?')}")
    lines.append(
        "  (-: unlimited; a user value wins, else the most generous group's, else the default)"
    )
    held = fraction(body.get("held_fraction") or 0.0)
    lines.append(f"holding now: {held} of a GPU in {body.get('leases', 0)} lease(s)")
    return "\n".join(lines)


def format_my_quota(me: Mapping[str, Any]) -> str:
    """``gpu-lease quota show`` (no target): the caller's effective quota and holdings."""
    text = format_quota(f"Effective quota of {me.get('user', '?')}:", me.get("effective") or {})
    held = fraction(me.get("held_fraction") or 0.0)
    return f"{text}\nholding now: {held} of a GPU in {me.get('leases', 0)} lease(s)"


def usage_rows(usage: Mapping[str, Any]) -> list[tuple[str, float]]:
    """Largest first, then by name."""
    return sorted(
        ((str(k), float(v)) for k, v in usage.items() if isinstance(v, (int, float))),
        key=lambda kv: (-kv[1], kv[0]),
    )


def format_usage(usage: Mapping[str, Any], by: str = "user") -> str:
    rows = usage_rows(usage)
    if not rows:
        return f"No GPU use recorded by any {by} in this period."
    total = sum(v for _, v in rows)
    body = [[name or f"(no {by})", f"{v:.3f}"] for name, v in rows]
    return table((by.upper(), "FRACTION-HOURS"), [*body, ["TOTAL", f"{total:.3f}"]])


def usage_csv(usage: Mapping[str, Any], by: str = "user") -> str:
    """``by,fraction_hours`` rows, RFC 4180 quoting, ``\\n`` line ends, 6 decimals."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([by, "fraction_hours"])
    for name, v in usage_rows(usage):
        writer.writerow([name, f"{v:.6f}"])
    return buf.getvalue()


__all__ = [
    "bar",
    "duration",
    "format_effective_quota",
    "format_leases",
    "format_my_quota",
    "format_queue",
    "format_quota",
    "format_quota_list",
    "format_top",
    "format_usage",
    "fraction",
    "idle",
    "percent",
    "table",
    "usage_csv",
    "window",
]
