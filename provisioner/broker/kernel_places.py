"""Where each lease's kernel lives on its node: pid namespace and cgroup (pure, no I/O).

DESIGN "Accounts and boundaries". A provisioner's renewal reports the kernel's ``pid`` with
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model import Lease


@dataclass(frozen=True)
class KernelPlace:
    pid_ns: int | None = None
    cgroup: str | None = None


@dataclass
class KernelPlaces:
    #: lease id -> what its renewals last reported
    places: dict[str, KernelPlace] = field(default_factory=dict)
    #: node name -> the kernel cgroups whose driver memory limit its agent reports in force
    driver_limited: dict[str, set[str]] = field(default_factory=dict)

    def renewed(self, lease_id: str, pid_ns: int | None, cgroup: str | None) -> None:
        """A renewal's report (fields it left out keep their last value)."""
        old = self.places.get(lease_id, KernelPlace())
        self.places[lease_id] = KernelPlace(
            pid_ns if pid_ns is not None else old.pid_ns,
            cgroup if cgroup is not None else old.cgroup,
        )

    def forget_ended(self, active: set[str]) -> None:
        """Drop the places of leases no longer active."""
        for lease_id in [x for x in self.places if x not in active]:
            del self.places[lease_id]

    def kernels(self, leases: list[Lease]) -> list[dict[str, Any]]:
        """Heartbeat answer ``kernels``: each lease's kernel as its provisioner sees it."""
        out = []
        for lease in leases:
            if lease.pid:
                ns = self.places.get(lease.id, KernelPlace()).pid_ns
                out.append({"pid": lease.pid, "pid_ns": ns})
        return sorted(out, key=lambda k: (k["pid"], k["pid_ns"] or 0))

    def limits(self, leases: list[Lease], context_overhead_mb: int) -> list[dict[str, Any]]:
        """Heartbeat answer ``limits``: each kernel cgroup and its lease's memory (cap +
        context: what the lease reserves on the GPU)."""
        out = []
        for lease in leases:
            cgroup = self.places.get(lease.id, KernelPlace()).cgroup
            if cgroup:
                memory = lease.memory_limit_mb + context_overhead_mb
                out.append({"cgroup": cgroup, "gpu_uuid": lease.gpu_uuid, "memory_mb": memory})
        return sorted(out, key=lambda x: str(x["cgroup"]))

    def by_host_pid(
        self, leases: list[Lease], found: dict[tuple[int, int], int] | None
    ) -> dict[int, Lease]:
        """Host pid -> lease. A lease reported without ``pid_ns``, or a heartbeat without a
        map (an older agent), matches by pid as reported."""
        out: dict[int, Lease] = {}
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
        """Whether the agent of ``node`` reports a driver memory limit on this lease's cgroup."""
        cgroup = self.places.get(lease_id, KernelPlace()).cgroup
        return cgroup is not None and cgroup in self.driver_limited.get(node, set())
