"""Who a GPU process belongs to, across pid namespaces.

A provisioner reports its kernel's ``pid`` as *it* sees it, with ``pid_ns``: the inode of
the pid namespace that number lives in (:func:`own_pid_ns`; for a kernel the provisioner
launched that is ``/proc/<pid>/ns/pid``). Inside a container, or a server run under
``unshare --pid --fork``, that pid is not the host's. NVML reports host pids, so the node
agent (on the host) maps: for each GPU process it walks up its ancestors and reads each
one's innermost namespace pid (the last field of ``NSpid`` in ``/proc/<pid>/status``) and
namespace inode (``/proc/<pid>/ns/pid``); an ancestor whose ``(pid, pid_ns)`` is a lease's
is that lease's kernel. The agent then reports the usage under the kernel's *host* pid and
tells the broker which host pid each ``(pid, pid_ns)`` is (heartbeat ``kernels``), so the
broker's own matching stays by host pid and ``kill`` names host pids.

A kernel reported without ``pid_ns`` (an older provisioner) is matched by host pid, as
before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

#: a kernel as its provisioner reported it: ``(pid, pid_ns)``; ``pid_ns`` None: a host pid
KernelId = tuple[int, int | None]


def pid_ns_of(pid: int | str, proc: str = "/proc") -> int | None:
    """The inode of ``pid``'s pid namespace (None if it is gone or not ours to read)."""
    try:
        return os.stat(f"{proc}/{pid}/ns/pid").st_ino
    except OSError:
        return None


def own_pid_ns() -> int | None:
    """The pid namespace this process's pids are numbered in (what a provisioner reports
    as ``pid_ns``). ``/proc/self`` resolves to this process whatever namespace ``/proc``
    was mounted for, unlike ``/proc/<pid>`` with a pid of our own namespace."""
    return pid_ns_of("self")


def ns_pid_of(pid: int, proc: str = "/proc") -> int | None:
    """``pid``'s number in its own (innermost) pid namespace: the last field of ``NSpid``
    in ``/proc/<pid>/status`` (None if it is gone; ``pid`` itself on a kernel without
    ``NSpid``, older than Linux 4.1)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return pid


def parent_of(pid: int, proc: str = "/proc") -> int | None:
    """The parent pid of ``pid`` from ``/proc/PID/stat`` (None if it is gone or unreadable)."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class KernelFinder:
    """Finds the lease kernel a host pid is or descends from, for one sample.

    ``kernels``: the identities the broker named (heartbeat answer). Reads of ``/proc`` are
    cached for the finder's life (make one per sample).
    """

    kernels: set[KernelId]
    proc: str = "/proc"
    #: asked for a pid that descends from no kernel: the host pid of the kernel it belongs
    #: to otherwise (the agent's: a proven kernel's cgroup, see :func:`.proof.by_cgroup`)
    fallback: Callable[[int], int | None] | None = None
    #: host pid -> the kernel identity it matched (for the heartbeat's ``kernels``)
    found: dict[int, KernelId] = field(default_factory=dict)
    _idents: dict[int, KernelId | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._host = {pid for pid, ns in self.kernels if ns is None}
        self._namespaced = {k for k in self.kernels if k[1] is not None}

    def _ident(self, pid: int) -> KernelId | None:
        if pid not in self._idents:
            ns, inner = pid_ns_of(pid, self.proc), ns_pid_of(pid, self.proc)
            self._idents[pid] = (inner, ns) if ns is not None and inner is not None else None
        return self._idents[pid]

    def __call__(self, pid: int) -> int | None:
        """The host pid of the kernel ``pid`` is or descends from (else, with ``fallback``,
        whose cgroup it is in), else None."""
        root = self._walk(pid)
        if root is None and self.fallback is not None:
            root = self.fallback(pid)
            if root is not None:
                self.found.setdefault(root, (root, None))
        return root

    def _walk(self, pid: int) -> int | None:
        if not self.kernels:
            return None
        seen = 0
        current: int | None = pid
        while current is not None and current > 1 and seen < 64:
            if current in self._host:
                self.found[current] = (current, None)
                return current
            if self._namespaced:
                ident = self._ident(current)
                if ident is not None and ident in self._namespaced:
                    self.found[current] = ident
                    return current
            current = parent_of(current, self.proc)
            seen += 1
        return None

    def report(self) -> list[dict[str, int]]:
        """Heartbeat ``kernels``: which host pid each namespaced kernel found is."""
        return [
            {"pid": ident[0], "pid_ns": ident[1], "host_pid": host}
            for host, ident in sorted(self.found.items())
            if ident[1] is not None
        ]
