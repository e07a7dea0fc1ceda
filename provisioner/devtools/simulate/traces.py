"""Traces: the sessions a workload asks for, the pool they ask it of, as JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...model import GPU, ClassSession
from ...wire import fraction_to_ppm, ppm_to_fraction

# -- traces -------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """One kernel's life as its user would live it, if it never had to wait."""

    id: str
    user: str
    arrival: float
    fraction: float
    duration: float
    busy: tuple[tuple[float, float], ...] = ()
    group: str | None = None
    crash: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "group": self.group,
            "arrival": round(self.arrival, 3),
            "fraction": self.fraction,
            "duration": round(self.duration, 3),
            "busy": [[round(a, 1), round(b, 1)] for a, b in self.busy],
            "crash": self.crash,
        }


@dataclass(frozen=True)
class PoolSpec:
    count: int
    memory_mb: int
    name: str = "GPU"


@dataclass
class Trace:
    """A workload: the pool, the horizon over which utilisation is measured, the sessions."""

    name: str
    horizon: float
    pool: list[PoolSpec]
    sessions: list[Session]
    description: str = ""
    seed: int | None = None
    #: the class sessions of its courses' timetable (each reserving seats × a fraction);
    #: a scheme with ``sessions=True`` gives them to the core
    class_sessions: list[ClassSession] = field(default_factory=list)

    def gpus(self) -> list[GPU]:
        out: list[GPU] = []
        for spec in self.pool:
            for _ in range(spec.count):
                i = len(out)
                out.append(GPU(f"GPU-sim-{i:04d}", "sim", spec.name, spec.memory_mb, i))
        return out

    def dump(self, path: str | Path) -> None:
        """Write as JSONL: a header line, then one session per line."""
        head = {
            "kind": "header",
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "horizon": self.horizon,
            "pool": [
                {"count": p.count, "memory_mb": p.memory_mb, "name": p.name} for p in self.pool
            ],
        }
        if self.class_sessions:
            head["class_sessions"] = [
                {
                    "course": c.course,
                    "start": c.start,
                    "end": c.end,
                    "share": ppm_to_fraction(c.share_ppm or 0),
                    "label": c.label,
                }
                for c in self.class_sessions
            ]
        with open(path, "w") as f:
            f.write(json.dumps(head) + "\n")
            for s in sorted(self.sessions, key=lambda s: (s.arrival, s.id)):
                f.write(json.dumps(s.to_json()) + "\n")


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :meth:`Trace.dump` (``benchmarks/traces/*.jsonl``)."""
    with open(path) as f:
        head = json.loads(f.readline())
        sessions = []
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            busy = tuple((float(a), float(b)) for a, b in d.get("busy", ()))
            sessions.append(
                Session(
                    d["id"], d["user"], float(d["arrival"]), float(d["fraction"]),
                    float(d["duration"]), busy, d.get("group"), bool(d.get("crash", False)),
                )
            )  # fmt: skip
    pool = [
        PoolSpec(int(p["count"]), int(p["memory_mb"]), p.get("name", "GPU")) for p in head["pool"]
    ]
    labs = [
        ClassSession(
            c["course"],
            float(c["start"]),
            float(c["end"]),
            share_ppm=fraction_to_ppm(float(c["share"])),
            label=c.get("label", ""),
        )
        for c in head.get("class_sessions", ())
    ]
    return Trace(
        head["name"],
        float(head["horizon"]),
        pool,
        sessions,
        head.get("description", ""),
        head.get("seed"),
        labs,
    )
