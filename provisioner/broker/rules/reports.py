"""What a node agent's heartbeat reports, once parsed: its proven kernels and refused
claims, and its parking fields (plain frozen values; the parsers live in
:mod:`provisioner.broker.web.validation`, the services read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProvenKernel:
    """A kernel a node agent proved to be its lease's (heartbeat ``kernels`` entry with
    ``lease_id``): its host pid, real uid, accepted cgroup, GPU processes outside it, and
    (an MPS lease's) GPU processes that are no client of their GPU's MPS server."""

    lease_id: str
    host_pid: int
    uid: int | None = None
    cgroup: str | None = None
    escaped: tuple[int, ...] = ()
    left_mps: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeProofs:
    """An agent's proven kernels and refused claims; a heartbeat without
    ``refused`` comes from an agent older than proofs (None from the parser)."""

    proven: dict[str, ProvenKernel]
    refused: dict[str, str]


@dataclass(frozen=True)
class ParkOutcome:
    """One outcome of a park or resume order, as a node heartbeat's ``parking`` reports it."""

    lease_id: str
    action: str  # park | resume (wire.PARK_ACTIONS)
    outcome: str  # done | failed | waiting (wire.PARK_OUTCOMES)
    message: str | None = None
    pids: tuple[int, ...] = ()
    mb: int | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class NodeParkReport:
    """A node heartbeat's parking fields: ``checkpoint`` and ``host_memory_available_mb``
    (None: absent, an agent older than parking) and the ``parking`` outcomes."""

    checkpoint: bool | None = None
    host_memory_available_mb: int | None = None
    outcomes: tuple[ParkOutcome, ...] = ()
