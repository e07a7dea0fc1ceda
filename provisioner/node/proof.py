"""Which claimed kernels are PROVEN to be their lease's: a renewal's pid is a claim, and
the root agent acts only on what it has checked itself.

A renewal's ``pid``, ``pid_ns`` and ``cgroup`` are what the lease's holder *says*; the root
agent acts on a kernel only once it has checked it itself:

1. the claim ``(pid, pid_ns)`` is resolved to a host pid (a host pid as is; a namespaced
   one through ``/proc/<pid>/ns/pid`` and the last field of ``NSpid``);
2. that process's ``/proc/<pid>/environ`` (the environment it was started with, readable
   by root only) holds :data:`~provisioner.wire.KERNEL_SECRET_ENV` ``=s`` with
   ``sha256(s)`` equal to the lease's ``proof`` (the broker hands the agent the digest its
   provisioner renews with; the secret itself never leaves the kernel's server). This holds
   where every student is the same uid in pid namespaces of their own (Kubernetes pods);
3. where the lease's user is a Unix account on this node (``--check-account auto``, the
   default; ``yes`` requires one; ``no`` skips it), the process's real uid is that account's.

A verdict is cached per ``(host pid, start time, proof, user)``: the start time (field 22
of ``/proc/<pid>/stat``) tells a reused pid from the process that was proven. The
kernel's cgroup is read from ``/proc/<proven pid>/cgroup``, never from the claim, and is
*accepted* for a driver memory limit and for counting its processes only where it is a
kernel cgroup (:func:`cgroup_accepted`). The functions read a ``proc`` root so tests can
give them a made-up tree.

A proven kernel whose lease is an MPS lease must use the GPU through MPS: a GPU process of
it that is no client of its GPU's MPS server (:func:`outside_mps`, in two consecutive
samples: :class:`MPSLeavers`) runs without any MPS memory limit, and is reported
(``left_mps``) so that the lease counts as over its cap, as one that left its cgroup does.

Who calls this: the node agent (:mod:`.agent`), once per heartbeat (:meth:`Prover.prove`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pwd
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from ..node_report import KernelReport, NodeProofs
from ..wire import KERNEL_SECRET_ENV, kernel_proof
from .cgroups import cgroup_of
from .feature import Beat, Claim, Proven
from .mps import uid_of
from .pidns import KernelFinder, KernelId, ns_pid_of, pid_ns_of

log = logging.getLogger("gpu_lease.agent")

#: ``--check-account``: compare the process's uid with the lease user's account where one
#: exists (``auto``), always (``yes``: no account refuses) or never (``no``)
CHECK_ACCOUNT = ("auto", "yes", "no")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_SECRET = KERNEL_SECRET_ENV.encode() + b"="


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot): with the pid, a process's
    identity (None if it is gone)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def secret_digest(pid: int, proc: str = "/proc") -> str | None:
    """The sha256 of the kernel secret in ``pid``'s start environment (None: none there,
    or the process is gone). The secret itself is never returned nor kept."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(_SECRET):
            return kernel_proof(entry[len(_SECRET) :].decode(errors="replace"))
    return None


def leaf_name(kernel_id: str) -> str:
    """The name of a kernel's cgroup as the provisioner makes it (:mod:`.cgroups`)."""
    return _SAFE.sub("-", f"kernel-{kernel_id}")


def cgroup_accepted(cgroup: str | None, kernel_id: str, parents: list[str]) -> bool:
    """Whether ``cgroup`` may carry this kernel's driver limit and count its processes.

    ``parents`` (the agent's ``kernel_cgroup_parents``): the cgroup must sit strictly under
    one of them. Without any: it must be the provisioner's default layout, a leaf named
    ``kernel-<kernel id>`` in a directory named ``gpu-lease``. Never ``/``.
    """
    if not cgroup or cgroup == "/" or ".." in cgroup.split("/"):
        return False
    if parents:
        return any(
            p.rstrip("/") and cgroup.startswith(p.rstrip("/") + "/") and cgroup != p.rstrip("/")
            for p in parents
        )
    path = PurePosixPath(cgroup)
    return bool(kernel_id) and path.name == leaf_name(kernel_id) and path.parent.name == "gpu-lease"


def within(cgroup: str | None, outer: str) -> bool:
    """``cgroup`` is ``outer`` or below it."""
    return cgroup is not None and (cgroup == outer or cgroup.startswith(outer.rstrip("/") + "/"))


def account_uid(user: str) -> int | None:
    """The uid of the Unix account ``user`` on this node (None: no such account)."""
    try:
        return pwd.getpwnam(user).pw_uid if user else None
    except KeyError:
        return None


@dataclass
class Prover:
    """The agent's checker: proves claims (see the module docstring), caching verdicts.

    ``check_account``: one of :data:`CHECK_ACCOUNT`; ``parents``: the accepted kernel
    cgroup parents (empty: the provisioner's default layout only).
    """

    check_account: str = "auto"
    parents: list[str] = field(default_factory=list)
    proc: str = "/proc"
    #: (host pid, start time, proof, user) -> None (proven) or why not
    verdicts: dict[tuple[int, int, str, str], str | None] = field(default_factory=dict)
    #: (pid, pid_ns) -> (host pid, start time) last resolved (a process never changes its
    #: pid namespace nor its number there: the start time alone tells it is still there)
    resolved: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    #: (host pid, start time) -> real uid, of proven processes
    uids: dict[tuple[int, int], int] = field(default_factory=dict)
    #: (lease id, reason) already logged
    said: set[tuple[str, str]] = field(default_factory=set)

    def prove(self, claims: list[Claim]) -> tuple[dict[str, Proven], dict[str, str]]:
        """Lease id -> its proven kernel; lease id -> why its claim was refused. A refusal
        is logged once per (lease, reason), without the proof."""
        proven: dict[str, Proven] = {}
        refused: dict[str, str] = {}
        by_host: dict[int, str] = {}
        scan: dict[tuple[int, int], int] | None = None
        for claim in sorted(claims, key=lambda c: c.lease_id):
            host, start = self._host(claim)
            if host is None and claim.pid_ns is not None:
                if scan is None:
                    scan = self._scan({(c.pid, c.pid_ns) for c in claims if c.pid_ns is not None})
                host = scan.get((claim.pid, claim.pid_ns))
                start = start_time(host, self.proc) if host is not None else None
            result = self._prove(claim, host, start)
            if isinstance(result, str):
                refused[claim.lease_id] = result
            elif result.host_pid in by_host:
                refused[claim.lease_id] = (
                    f"its kernel (host pid {result.host_pid}) is already lease "
                    f"{by_host[result.host_pid][:6]}…'s"
                )
            else:
                proven[claim.lease_id] = result
                by_host[result.host_pid] = claim.lease_id
        for lease_id, why in refused.items():
            if (lease_id, why) not in self.said:
                self.said.add((lease_id, why))
                log.warning("Not acting on the kernel lease %s… claims: %s", lease_id[:6], why)
        named = {c.lease_id for c in claims}
        self.said = {x for x in self.said if x[0] in named}
        if len(self.verdicts) > 16 * max(len(claims), 64):  # bounded: refusals pile up
            self.verdicts.clear()
            self.uids.clear()
            self.resolved.clear()
        return proven, refused

    # -- one claim -----------------------------------------------------------------------
    def _host(self, claim: Claim) -> tuple[int | None, int | None]:
        """The claim's host pid and its start time: a host pid as claimed; a namespaced one
        from the last resolution, if that process is still it (else None, None)."""
        if claim.pid_ns is None:
            return claim.pid, start_time(claim.pid, self.proc)
        known = self.resolved.get((claim.pid, claim.pid_ns))
        if known is None or start_time(known[0], self.proc) != known[1]:
            return None, None
        return known

    def _scan(self, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """One pass over ``/proc``: the host pid of each wanted ``(pid, pid_ns)``."""
        namespaces = {ns for _, ns in wanted}
        out: dict[tuple[int, int], int] = {}
        try:
            names = os.listdir(self.proc)
        except OSError:
            return out
        for name in names:
            if not name.isdigit():
                continue
            ns = pid_ns_of(name, self.proc)
            if ns not in namespaces:
                continue
            inner = ns_pid_of(int(name), self.proc)
            if inner is not None and ns is not None and (inner, ns) in wanted:
                out[(inner, ns)] = int(name)
        return out

    def _prove(self, claim: Claim, host: int | None, start: int | None) -> Proven | str:
        if not claim.proof:
            return (
                "its renewals carry no proof (a provisioner older than kernel proofs, or a "
                "claim made by hand): upgrade the provisioner"
            )
        if host is None or start is None or host <= 1:
            return f"no process {claim.pid} in pid namespace {claim.pid_ns}"
        if claim.pid_ns is not None:
            self.resolved[(claim.pid, claim.pid_ns)] = (host, start)
        key = (host, start, claim.proof, claim.user)
        if key not in self.verdicts:
            self.verdicts[key] = self._verdict(host, claim)
        why = self.verdicts[key]
        if why is not None:
            return why
        uid = self.uids.get((host, start))
        if uid is None:
            uid = uid_of(host, self.proc)
            if uid is None:
                return f"process {host} ended while it was checked"
            self.uids[(host, start)] = uid
        cgroup = cgroup_of(host, self.proc)  # read every beat: a process may move itself
        ok = cgroup_accepted(cgroup, claim.kernel_id, self.parents)
        return Proven(claim, host, uid, cgroup, ok)

    def _verdict(self, host: int, claim: Claim) -> str | None:
        """None when ``host`` is the claim's kernel, else why not."""
        digest = secret_digest(host, self.proc)
        if digest is None or not hmac.compare_digest(digest, str(claim.proof)):
            return f"process {host} does not carry this lease's kernel secret"
        if self.check_account == "no":
            return None
        expected = account_uid(claim.user)
        if expected is None:
            if self.check_account == "yes":
                return f"user {claim.user!r} has no Unix account on this node (--check-account yes)"
            return None
        uid = uid_of(host, self.proc)
        if uid != expected:
            return f"process {host} runs as uid {uid}, not as {claim.user!r} (uid {expected})"
        return None


def escapes(
    members: dict[int, list[int]], proven: dict[str, Proven], limited: set[str], proc: str = "/proc"
) -> dict[str, list[int]]:
    """Lease id -> its kernel's GPU processes (``members``: per kernel host pid) outside the
    kernel's cgroup while a driver limit holds on it (``limited``): they escape the limit."""
    out: dict[str, list[int]] = {}
    for lease_id, p in proven.items():
        if not p.cgroup_ok or p.cgroup not in limited:
            continue
        gone = [
            pid for pid in members.get(p.host_pid, []) if not within(cgroup_of(pid, proc), p.cgroup)
        ]
        if gone:
            out[lease_id] = sorted(gone)
    return out


def outside_mps(
    samples: list[tuple[int, str, int]],
    members: dict[int, list[int]],
    proven: dict[str, Proven],
    clients: dict[str, frozenset[int] | None],
) -> dict[str, list[tuple[int, str]]]:
    """Lease id -> its MPS kernel's GPU processes, with their GPU, that are no client of
    that GPU's MPS server in this sample: they run without MPS, so without its memory limit.

    Only a proven kernel whose lease is an MPS lease (``enforcement`` ``mps``) is judged,
    only on a GPU whose daemon runs under this agent and answered (``clients``: GPU uuid ->
    the pids of its server's clients, :meth:`~provisioner.node.mps.MPSSupervisor.clients`;
    None or absent: not judged there). ``samples``: ``(pid, gpu uuid, MiB)`` as NVML
    reports them; ``members``: each kernel host pid's GPU processes (:func:`.agent.attribute`).
    """
    lease_of = {
        pid: lease_id
        for lease_id, p in proven.items()
        if p.claim.enforcement == "mps"
        for pid in members.get(p.host_pid, [])
    }
    left: dict[str, set[tuple[int, str]]] = {}
    for pid, uuid, _ in samples:
        served = clients.get(uuid)
        if pid in lease_of and served is not None and pid not in served:
            left.setdefault(lease_of[pid], set()).add((pid, uuid))
    return {lease_id: sorted(found) for lease_id, found in left.items()}


@dataclass
class MPSLeavers:
    """The kernel processes outside MPS in two consecutive samples (:func:`outside_mps`).

    One sample is not enough: NVML is sampled before the daemons are asked for their
    clients, and a client that exits between the two (or whose server was just replaced
    for another uid) is in the sample but in no client list. A process outside MPS is so
    for its life (CUDA connects once, at its start), so the next sample finds it again,
    while one that is gone, or that the daemon did not answer for, is not judged again.
    Each is logged once (its pid, lease and GPU; never the proof).
    """

    #: (lease id, pid, gpu uuid) found outside MPS in the last sample
    last: set[tuple[str, int, str]] = field(default_factory=set)
    #: those already logged
    said: set[tuple[str, int, str]] = field(default_factory=set)

    def __call__(self, found: dict[str, list[tuple[int, str]]]) -> dict[str, list[int]]:
        """Lease id -> its pids outside MPS now and in the sample before."""
        now = {(lease, pid, uuid) for lease, left in found.items() for pid, uuid in left}
        both = now & self.last
        self.last = now
        for lease, pid, uuid in sorted(both - self.said):
            log.warning(
                "Kernel process %d of lease %s… runs on GPU %s outside MPS (it is no client "
                "of the GPU's MPS server, e.g. CUDA_MPS_PIPE_DIRECTORY was unset), so no MPS "
                "memory limit holds on it: the lease counts as over its cap",
                pid,
                lease[:6],
                uuid,
            )
        self.said = (self.said & now) | both
        out: dict[str, list[int]] = {}
        for lease, pid, _ in sorted(both):
            out.setdefault(lease, []).append(pid)
        return out


def by_cgroup(proven: dict[str, Proven], proc: str = "/proc") -> Any:
    """A lookup ``pid -> host pid`` of the proven kernel whose (accepted) cgroup ``pid``
    is in: a kernel's double-forked child still counts for it."""
    cgroups = sorted(
        ((p.cgroup, p.host_pid) for p in proven.values() if p.cgroup_ok and p.cgroup),
        key=lambda x: -len(x[0]),
    )

    def lookup(pid: int) -> int | None:
        if not cgroups:
            return None
        mine = cgroup_of(pid, proc)
        for cg, host in cgroups:
            if within(mine, cg):
                return host
        return None

    return lookup


# -- the feature: kernel proofs in each heartbeat ----------------------------------------

#: the heartbeat fields of proven claims; a broker older than them refuses them
PROOF_FIELDS = frozenset({"refused", "lease_id", "uid", "cgroup", "escaped"})
#: the kernels' field of processes outside MPS; a broker that proves claims but is older
#: than it refuses it, and is then told them as ``escaped`` (over the cap all the same)
LEFT_MPS_FIELD = "left_mps"


def kernels_named(beat: dict[str, Any]) -> set[KernelId]:
    """The kernels a heartbeat's answer names: ``kernels`` ``[{pid, pid_ns}]``, or from an
    older broker ``watch`` (host pids)."""
    if "kernels" in beat:
        return {
            (int(k["pid"]), int(k["pid_ns"]) if k.get("pid_ns") is not None else None)
            for k in beat["kernels"]
        }
    return {(int(p), None) for p in beat.get("watch", [])}


def claims_named(beat: dict[str, Any]) -> tuple[list[Claim], set[KernelId]]:
    """The kernels a heartbeat's answer names: the claims to prove (``kernels`` entries
    with ``lease_id`` and ``proof``), and the kernels of a broker older than proofs (see
    :func:`kernels_named`), believed as they are."""
    claims = [c for c in (Claim.parse(k) for k in beat.get("kernels") or []) if c is not None]
    if claims:
        return claims, set()
    return [], kernels_named(beat)


def proven_finder(proven: dict[str, Proven], legacy: set[KernelId]) -> KernelFinder:
    """The finder of one sample: a GPU process belongs to a proven kernel it descends from,
    or whose cgroup it is in (a double-forked child); ``legacy``: an older broker's kernels."""
    kernels = {(p.host_pid, None) for p in proven.values()} | legacy
    return KernelFinder(kernels, fallback=by_cgroup(proven) if proven else None)


class KernelProofs:
    """The kernel proofs (cgroups) as a node feature: every kernel the answer names is a
    claim, which :class:`Prover` checks; the heartbeat reports the proven kernels (host
    pid, uid, cgroup, GPU processes that left a driver-limited cgroup or MPS) and the
    refused claims. A broker older than proofs (it refuses those fields) gets the
    namespaced kernels found instead, and its kernels are believed as named; one older
    than ``left_mps`` is told those processes as ``escaped``. The agent's loop asks it
    which kernel each GPU process belongs to (:meth:`finder`)."""

    ready: asyncio.Event | None = None

    def __init__(self, prover: Prover | None = None) -> None:
        self.prover = prover or Prover()
        self.proof_wire = True
        self.left_mps_wire = True
        self.leavers = MPSLeavers()
        #: the kernels the last answer named: an older broker's, and the proven ones
        self.legacy: set[KernelId] = set()
        self.proven: dict[str, Proven] = {}
        self.refusals: dict[str, str] = {}

    def finder(self) -> KernelFinder:
        """Which kernel a GPU process belongs to, from the last answer's kernels."""
        return proven_finder(self.proven, self.legacy)

    async def observe(self, beat: Beat) -> None:
        pass

    def report(self, beat: Beat) -> KernelReport:
        if not self.proof_wire:
            found = beat.find.report()
            return KernelReport({(k["pid"], k["pid_ns"]): k["host_pid"] for k in found})
        left = escapes(beat.members, self.proven, beat.limited)
        off_mps = self.leavers(outside_mps(beat.raw, beat.members, self.proven, beat.mps_clients))
        if not self.left_mps_wire:  # a broker older than left_mps: over the cap all the same
            for lease, pids in off_mps.items():
                left[lease] = sorted(set(left.get(lease, [])) | set(pids))
            off_mps = {}
        proven = {
            lease: p.report(left.get(lease), off_mps.get(lease)) for lease, p in self.proven.items()
        }
        return KernelReport(None, NodeProofs(proven, dict(sorted(self.refusals.items()))))

    async def answer(self, beat: Beat, answer: dict[str, Any]) -> None:
        claims, self.legacy = claims_named(answer)
        self.proven, self.refusals = self.prover.prove(claims)
        beat.proven, beat.refusals, beat.claims = self.proven, self.refusals, bool(claims)

    def offered(self) -> frozenset[str]:
        if not self.proof_wire:
            return frozenset()
        return PROOF_FIELDS | {LEFT_MPS_FIELD} if self.left_mps_wire else PROOF_FIELDS

    def refused(self, fields: set[str], node: str) -> None:
        if not self.proof_wire:
            return
        if fields & PROOF_FIELDS:
            log.warning(
                "The broker is older than proven kernels (it refused %s): the kernels it "
                "names on node %s are believed as claimed, and no driver limit is set, "
                "until the broker is upgraded.",
                ", ".join(repr(x) for x in sorted(fields & PROOF_FIELDS)),
                node,
            )
            self.proof_wire = False
        elif LEFT_MPS_FIELD in fields and self.left_mps_wire:
            log.warning(
                "The broker is older than kernels outside MPS (it refused %r): they are "
                "reported to it as escaped from their cgroup, over their cap all the same, "
                "until the broker is upgraded.",
                LEFT_MPS_FIELD,
            )
            self.left_mps_wire = False


__all__ = [
    "CHECK_ACCOUNT",
    "Claim",
    "KernelProofs",
    "LEFT_MPS_FIELD",
    "PROOF_FIELDS",
    "MPSLeavers",
    "Proven",
    "Prover",
    "by_cgroup",
    "claims_named",
    "kernels_named",
    "proven_finder",
    "cgroup_accepted",
    "escapes",
    "leaf_name",
    "outside_mps",
    "secret_digest",
    "start_time",
]
