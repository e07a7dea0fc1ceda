"""The core's rules about nodes: a node's state, the node that reports a GPU, the GPUs
closed to placement, over-use, and MPS's one Unix user per GPU.

Pure (``now`` passed in). The node service (``broker/services/nodes.py``) reads a node's state and
over-use from here; placement (``scheduling``) keeps lost or drained nodes' GPUs and GPUs
whose MPS server serves another user out of an ask's reach; a lease's usage
(``queries.py``) and the parking rule (``park_policy.py``) find its GPU's node here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ...model import Lease, Node, PoolState
from .policy import Policy


def node_state(node: Node, now: float, policy: Policy) -> str:
    """``drained`` (its agent stopped cleanly), ``lost`` (silent longer than the grace) or ``up``."""
    if node.drained:
        return "drained"
    if now - node.last_seen > policy.node_grace:
        return "lost"
    return "up"


def node_of(state: PoolState, nodes: Mapping[str, Node], gpu_uuid: str) -> Node | None:
    """The registered node (of ``nodes``, name -> Node) whose agent reports the GPU
    ``gpu_uuid`` of ``state`` (None: none)."""
    gpu = state.gpus.get(gpu_uuid)
    node = nodes.get(gpu.node) if gpu is not None else None
    return node if node is not None and any(g.uuid == gpu_uuid for g in node.gpus) else None


def closed_gpus(nodes: Iterable[Node], now: float, policy: Policy) -> set[str]:
    """The uuids of GPUs on nodes that are not up: nothing new is placed there."""
    return {g.uuid for n in nodes if node_state(n, now, policy) != "up" for g in n.gpus}


def over_lease(lease: Lease, used_mb: int, policy: Policy) -> bool:
    """True when a kernel uses more than its lease: cap + context overhead + tolerance."""
    allowed = lease.memory_limit_mb + policy.context_overhead_mb + policy.overuse_tolerance_mb
    return used_mb > allowed


def overuse_reason(used_mb: int, lease: Lease, policy: Policy) -> str:
    """What the student reads: ``used 2.1 GiB of a 655 MiB lease``."""
    held = lease.memory_limit_mb + policy.context_overhead_mb
    return (
        f"the kernel used {_mib(used_mb)} of GPU memory on a {_mib(held)} lease "
        f"({lease.memory_limit_mb} MiB cap + {policy.context_overhead_mb} MiB CUDA context) for "
        f"more than {policy.overuse_grace:g} s; start a kernel with a larger GPU fraction or "
        "use less memory"
    )


def _mib(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb} MiB"


# -- MPS: one Unix user per GPU at a time ---------------------------------------


def mps_claim_window(policy: Policy) -> float:
    """Seconds after its grant during which an MPS lease's *claimed* uid (the acquire's
    ``mps_uid``) keeps other users' MPS kernels off its GPU: TTL/3 + ``node_grace``.

    A granted kernel renews at once after its launch (the broker learns its pid), then
    every TTL/3; its node's agent names it, proves it and reports its server's uid within
    a heartbeat, and is lost after ``node_grace``. Past that, an honest kernel is known
    from those trusted sources, and a made-up claim holds nothing."""
    return policy.ttl / 3 + policy.node_grace


def mps_owners_of(
    reported: Mapping[str, int],
    leases: Iterable[Lease],
    proven: Mapping[str, int],
    now: float,
    window: float,
) -> dict[str, set[int]]:
    """GPU uuid -> the uids whose MPS clients use, or may use at any moment, its MPS server.

    From trusted sources only: ``reported`` (GPU uuid -> the uid its node agent reports the
    server serving) and, for each MPS lease (``mps_uid`` set), the uid the agent proved its
    kernel runs as (``proven``: lease id -> uid). A lease's own claim (its acquire's
    ``mps_uid``) stands in for a proof only within ``window`` seconds of its grant (a
    granted kernel may not have started or touched CUDA yet); a proof replaces it. So a
    student who claims a made-up uid keeps others' MPS kernels off a GPU for at most
    ``window`` after each of their grants there."""
    owners: dict[str, set[int]] = {u: {uid} for u, uid in reported.items()}
    for lease in leases:
        if lease.mps_uid is None:
            continue  # not an MPS kernel: it does not hold the server
        uid = proven.get(lease.id)
        if uid is None and now - lease.created_at <= window:
            uid = lease.mps_uid
        if uid is not None:
            owners.setdefault(lease.gpu_uuid, set()).add(uid)
    return owners


def mps_owners(state: PoolState, now: float, policy: Policy) -> dict[str, set[int]]:
    """:func:`mps_owners_of` the pool's state: its agents' reports (``state.mps_uid``),
    its proven kernels (``state.mps_proven``), its active leases."""
    return mps_owners_of(
        state.mps_uid, state.leases.values(), state.mps_proven, now, mps_claim_window(policy)
    )


def mps_blocked(owners: dict[str, set[int]], uid: int | None) -> set[str]:
    """The GPUs an MPS kernel of ``uid`` must not be placed on: their MPS server serves
    (or is about to serve) another uid, and a client of ``uid`` would hang there until
    that uid's clients are all gone. None for a kernel that does not use MPS."""
    if uid is None:
        return set()
    return {gpu for gpu, uids in owners.items() if uids - {uid}}
