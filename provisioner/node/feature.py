"""The node features on the agent's side: what each shares in one heartbeat (:class:`Beat`)
and what each does (:class:`NodeFeature`).

A node feature (MPS daemons, driver memory limits, parking, kernel proofs) is one module of
``provisioner/node/`` with one class that :func:`~provisioner.node.agent.run_agent` calls at
each beat, in the order of the agent's list (``GPULeaseAgent.features``):

1. ``observe(beat)``: after the sample, before anything is reported (what the others
   read: the MPS servers' clients, the cgroups whose driver limit holds);
2. ``report(beat)``: its part of the heartbeat (:mod:`provisioner.node_report`), or None;
3. ``answer(beat, answer)``: its part of the broker's answer (the kernel proofs first:
   the others act on the kernels proven);
4. ``offered()`` and ``refused(fields)``: the fields it sends that a broker older than it
   refuses, and, when one does, it stops sending them (the beat is sent again at once).

``ready``: an event set when it has something to report a beat sooner (or None).
Also here: the claims the broker names and the kernels proven (:class:`Claim`,
:class:`Proven`), which every feature reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..node_report import ProvenKernel, ReportPart
from .pidns import KernelFinder

#: what one sample returns: ``(pid, gpu_uuid, used_mb)`` per process and GPU
Sample = list[tuple[int, str, int]]


@dataclass(frozen=True)
class Claim:
    """A kernel the broker names (heartbeat answer ``kernels``), as its renewals claim it."""

    lease_id: str
    pid: int
    pid_ns: int | None
    proof: str | None
    user: str = ""
    kernel_id: str = ""
    gpu_uuid: str = ""
    memory_mb: int = 0
    enforcement: str = "cooperative"

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Claim | None:
        """An answer's ``kernels`` entry; None for one of an older broker (no ``lease_id``)."""
        if not raw.get("lease_id"):
            return None
        ns = raw.get("pid_ns")
        return cls(
            lease_id=str(raw["lease_id"]),
            pid=int(raw["pid"]),
            pid_ns=int(ns) if ns is not None else None,
            proof=str(raw["proof"]) if raw.get("proof") else None,
            user=str(raw.get("user") or ""),
            kernel_id=str(raw.get("kernel_id") or ""),
            gpu_uuid=str(raw.get("gpu_uuid") or ""),
            memory_mb=int(raw.get("memory_mb") or 0),
            enforcement=str(raw.get("enforcement") or "cooperative"),
        )


@dataclass(frozen=True)
class Proven:
    """A claim the agent checked: its host pid, real uid and cgroup (``cgroup_ok``: the
    cgroup is a kernel cgroup, see :func:`~provisioner.node.proof.cgroup_accepted`)."""

    claim: Claim
    host_pid: int
    uid: int
    cgroup: str | None
    cgroup_ok: bool

    def report(
        self, escaped: list[int] | None = None, left_mps: list[int] | None = None
    ) -> ProvenKernel:
        """The heartbeat's ``kernels`` entry of this kernel (``left_mps`` goes on the wire
        only where some process of it runs outside MPS)."""
        return ProvenKernel(
            lease_id=self.claim.lease_id,
            host_pid=self.host_pid,
            uid=self.uid,
            cgroup=self.cgroup if self.cgroup_ok else None,
            escaped=tuple(sorted(escaped or [])),
            left_mps=tuple(sorted(left_mps or [])),
            pid=self.claim.pid,
            pid_ns=self.claim.pid_ns,
        )


@dataclass
class Beat:
    """One heartbeat as the node features see it."""

    #: the sample as NVML gave it
    raw: Sample
    #: kernel host pid -> its GPU processes' pids in the sample
    members: dict[int, list[int]]
    #: the finder of this sample (the namespaced kernels it found)
    find: KernelFinder
    #: set on ``observe``: GPU uuid -> its MPS server's client pids (None: unknown)
    mps_clients: dict[str, frozenset[int] | None] = field(default_factory=dict)
    #: set on ``observe``: the kernel cgroups whose driver memory limit is in force
    limited: set[str] = field(default_factory=set)
    #: set on ``answer`` by the kernel proofs: the claims proven and those refused (why)
    proven: dict[str, Proven] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    #: whether the answer named claims (False: a broker older than proofs)
    claims: bool = False


class NodeFeature(Protocol):
    """One node feature's side of each heartbeat (see the module's text)."""

    ready: asyncio.Event | None

    async def observe(self, beat: Beat) -> None: ...

    def report(self, beat: Beat) -> ReportPart | None: ...

    async def answer(self, beat: Beat, answer: dict[str, Any]) -> None: ...

    def offered(self) -> frozenset[str]: ...

    def refused(self, fields: set[str], node: str) -> None: ...


__all__ = ["Beat", "Claim", "NodeFeature", "Proven", "Sample"]
