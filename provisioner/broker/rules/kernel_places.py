"""Where each lease's kernel lives on its node: pid namespace and cgroup (pure, no I/O).

Which process is a lease's kernel is the root agent's to check (``node/proof.py``);
the broker keeps what it is told. A provisioner's renewal reports the kernel's ``pid`` with
``pid_ns`` (the pid namespace that number lives in) and, where it made one, ``cgroup`` (the
kernel's cgroup v2 path). The broker keeps both here, in memory (a broker restart forgets
them until each kernel's next renewal, a third of the TTL later), and:

- names each lease's kernel to its node's agent in the heartbeat answer (``kernels``:
  ``{pid, pid_ns}``), and each kernel cgroup with the memory its lease holds (``limits``:
  ``{cgroup, gpu_uuid, memory_mb}``, cap + context) for a driver memory limit;
- matches the agent's usage, reported under *host* pids, to leases through the agent's map
  ``(pid, pid_ns) -> host_pid`` (:meth:`KernelPlaces.by_host_pid`). The mapping itself is
  the agent's (it alone reads the host's ``/proc``; see :mod:`provisioner.node.pidns`); the
  broker only matches exact identities, so two containers' kernels that are both pid 7
  never meet.
- says which leases a driver memory limit holds (the agent's ``driver_limits``).

All of that is a *claim* (the holder of a lease may say anything): a renewal also
carries ``proof``, the sha256 of the kernel's secret, kept here in memory only (never in
the database, a lease's answer or a log). Each ``kernels`` entry hands the agent the claim
with its lease, user, proof, GPU and memory; the agent acts only on the kernels it proves,
and says which (heartbeat ``kernels`` with ``lease_id``: host pid, real uid, the cgroup it
read itself, GPU processes outside it) and which it refused (``refused``). From an agent
that proves, only the proven kernels count: usage, kills, driver limits, the uid of each
lease's kernel (:meth:`KernelPlaces.proven_uids`). An older agent's map is believed as
before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...model import Lease
from ...node_report import NodeProofs, ProvenKernel


@dataclass(frozen=True)
class KernelPlace:
    pid_ns: int | None = None
    cgroup: str | None = None
    #: sha256 of the kernel's secret, as the renewals report it (memory only)
    proof: str | None = None


@dataclass
class KernelPlaces:
    #: lease id -> what its renewals last reported
    places: dict[str, KernelPlace] = field(default_factory=dict)
    #: node name -> the kernel cgroups whose driver memory limit its agent reports in force
    driver_limited: dict[str, set[str]] = field(default_factory=dict)
    #: lease id -> its kernel as an agent that proves claims last proved it
    proven: dict[str, ProvenKernel] = field(default_factory=dict)
    #: lease id -> why its node's agent refused the kernel its renewals claim
    refused: dict[str, str] = field(default_factory=dict)

    def renewed(
        self, lease_id: str, pid_ns: int | None, cgroup: str | None, proof: str | None = None
    ) -> None:
        """A renewal's report (fields it left out keep their last value)."""
        old = self.places.get(lease_id, KernelPlace())
        self.places[lease_id] = KernelPlace(
            pid_ns if pid_ns is not None else old.pid_ns,
            cgroup if cgroup is not None else old.cgroup,
            proof if proof is not None else old.proof,
        )

    def forget_ended(self, active: set[str]) -> None:
        """Drop the places (and proofs, refusals) of leases no longer active."""
        for table in (self.places, self.proven, self.refused):
            for lease_id in [x for x in table if x not in active]:
                del table[lease_id]

    def agent_said(self, leases: list[Lease], proofs: NodeProofs) -> list[tuple[str, str]]:
        """An agent that proves claims reported on ``leases`` (its node's): keep what it
        proved and refused. Returns the refusals new since its last word, ``(lease id,
        reason)``, to log and count once."""
        new = []
        for lease in leases:
            proven = proofs.proven.get(lease.id)
            if proven is not None:
                self.proven[lease.id] = proven
            else:
                self.proven.pop(lease.id, None)
            why = proofs.refused.get(lease.id)
            if why is None:
                self.refused.pop(lease.id, None)
            elif self.refused.get(lease.id) != why:
                self.refused[lease.id] = why
                new.append((lease.id, why))
        return new

    def proven_uids(self) -> dict[str, int]:
        """Lease id -> the real uid of its proven kernel (only proven kernels; the MPS
        owner of a GPU is taken from these, not from an acquire's ``mps_uid``)."""
        return {k: p.uid for k, p in self.proven.items() if p.uid is not None}

    def kernels(self, leases: list[Lease], context_overhead_mb: int = 0) -> list[dict[str, Any]]:
        """Heartbeat answer ``kernels``: each lease's kernel as its renewals claim it, with
        what the agent needs to prove it and act on it: ``lease_id``, ``user``,
        ``kernel_id``, ``proof``, ``gpu_uuid``, ``memory_mb`` (cap + context: its driver
        limit) and ``enforcement`` (``mps`` for an MPS kernel)."""
        out = []
        for lease in leases:
            if lease.pid:
                place = self.places.get(lease.id, KernelPlace())
                out.append(
                    {
                        "pid": lease.pid,
                        "pid_ns": place.pid_ns,
                        "lease_id": lease.id,
                        "user": lease.user,
                        "kernel_id": lease.kernel_id,
                        "proof": place.proof,
                        "gpu_uuid": lease.gpu_uuid,
                        "memory_mb": lease.memory_limit_mb + context_overhead_mb,
                        "enforcement": "mps" if lease.mps_uid is not None else "cooperative",
                    }
                )
        return sorted(out, key=lambda k: (k["pid"], k["pid_ns"] or 0, k["lease_id"]))

    @staticmethod
    def leases(leases: list[Lease], context_overhead_mb: int = 0) -> list[dict[str, Any]]:
        """Heartbeat answer ``leases``: every active lease of the node from its grant on,
        whether its kernel has reported a pid or not (the agent's MPS daemons bound each
        new client by them, so a lease must be named before its kernel starts)."""
        return sorted(
            (
                {
                    "lease_id": lease.id,
                    "user": lease.user,
                    "gpu_uuid": lease.gpu_uuid,
                    "memory_mb": lease.memory_limit_mb + context_overhead_mb,
                    "enforcement": "mps" if lease.mps_uid is not None else "cooperative",
                }
                for lease in leases
            ),
            key=lambda x: x["lease_id"],
        )

    def by_host_pid(
        self,
        leases: list[Lease],
        found: dict[tuple[int, int], int] | None,
        proofs: NodeProofs | None = None,
    ) -> dict[int, Lease]:
        """Host pid -> lease. From an agent that proves claims (``proofs``): its proven
        kernels only. Otherwise (an older agent) as claimed: a lease reported without
        ``pid_ns``, or a heartbeat without a map, matches by pid as reported."""
        out: dict[int, Lease] = {}
        if proofs is not None:
            for lease in leases:
                proven = proofs.proven.get(lease.id)
                if proven is not None:
                    out[proven.host_pid] = lease
            return out
        for lease in leases:
            if not lease.pid:
                continue
            ns = self.places.get(lease.id, KernelPlace()).pid_ns
            if ns is None or found is None:
                out[lease.pid] = lease
            elif (lease.pid, ns) in found:
                out[found[(lease.pid, ns)]] = lease
        return out

    def driver_limited_on(self, node: str, lease_id: str) -> bool:
        """Whether the agent of ``node`` reports a driver memory limit on this lease's
        cgroup: the proven kernel's (an agent that proves claims), else the claimed one."""
        proven = self.proven.get(lease_id)
        cgroup = proven.cgroup if proven is not None else None
        if proven is None and lease_id not in self.refused:
            cgroup = self.places.get(lease_id, KernelPlace()).cgroup
        return cgroup is not None and cgroup in self.driver_limited.get(node, set())
