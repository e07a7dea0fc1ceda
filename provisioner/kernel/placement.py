"""Where a kernel runs: its node and the GPUs its server may use, from the engine's environment.

The provisioner asks the broker for a lease there (``node``, ``gpu_uuids`` of the acquire),
so that where a kernel is, its lease is. :func:`discover` reads the server's environment
(pure: a mapping in, a :class:`Placement` out); for each of the two facts the first match
wins (for admins: docs/admins.md, "Spawners", docs/slurm.md, docs/kubernetes.md):

node
    ``GPU_LEASE_NODE`` (explicit; on Kubernetes the downward API sets it from
    ``spec.nodeName``, see ``deploy/kubernetes``), else ``SLURMD_NODENAME`` (a Slurm job),
    else none: any node of the pool.
GPUs
    ``GPU_LEASE_GPU_UUIDS`` (explicit, comma-separated UUIDs); in a Slurm job
    ``SLURM_STEP_GPUS``, ``SLURM_JOB_GPUS`` or ``CUDA_VISIBLE_DEVICES`` (indexes on the node,
    which the GRES plugin sets); in a Kubernetes pod (``KUBERNETES_SERVICE_HOST``)
    ``NVIDIA_VISIBLE_DEVICES`` (UUIDs or indexes from the NVIDIA device plugin; ``all``
    means the node's every GPU, ``none``/``void`` none); else any GPU of the node.

Indexes are turned into UUIDs against the broker's pool (:func:`resolve_indexes`): the GPUs
of that node with those indexes, as its agent registered them.

A deliberate departure from the external contract (docs/design.md, "Departures"): without any
of these variables the provisioner names no node, not the host name. A one-machine pool
declared with ``--gpus 1x32768:V100`` puts its GPUs on node ``local``, not the host name,
and an NVML pool on the broker's host name; a host-name default would refuse every kernel
of the first. Multi-node sites set ``GPU_LEASE_NODE`` or run under Slurm or Kubernetes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..wire import node_from_env


@dataclass(frozen=True)
class Placement:
    """The node and GPUs a kernel may have its lease on, and where each fact came from."""

    node: str | None = None
    gpu_uuids: tuple[str, ...] = ()
    #: device indexes on ``node`` (Slurm, or a device plugin that hands out indexes)
    gpu_indexes: tuple[int, ...] = ()
    #: what named the node: ``GPU_LEASE_NODE``, ``SLURMD_NODENAME`` or ``""`` (any node)
    node_from: str = ""
    #: what named the GPUs (an environment variable), or ``""`` (any GPU of the node)
    gpus_from: str = ""

    def describe(self) -> str:
        """One line for the log: ``node gpu-a (SLURMD_NODENAME), GPUs 0,1 (SLURM_JOB_GPUS)``."""
        where = f"node {self.node} ({self.node_from})" if self.node else "any node"
        listed = self.gpu_uuids or tuple(str(i) for i in self.gpu_indexes)
        gpus = f"GPUs {','.join(listed)} ({self.gpus_from})" if listed else "any GPU there"
        return f"{where}, {gpus}"


def parse_devices(value: str, name: str) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """A device list (``GPU-…`` UUIDs, MIG UUIDs or indexes, comma-separated) -> ``(uuids,
    indexes)``; None for ``all`` or an empty value (no restriction). ``none``/``void`` (a
    pod or job without GPUs) and malformed lists raise :class:`InvalidRequest`."""
    raw = [x.strip() for x in value.split(",") if x.strip()]
    if not raw or (len(raw) == 1 and raw[0].lower() == "all"):
        return None
    if len(raw) == 1 and raw[0].lower() in ("none", "void", "nodevfiles"):
        raise InvalidRequest(
            f"{name}={raw[0]}: this server was given no GPU, so no GPU kernel can start here; "
            "ask for a server with a GPU (a GPU profile, or a job with --gres=gpu)."
        )

    def is_index(x: str) -> bool:
        return x.isascii() and x.isdigit()

    uuids = tuple(x for x in raw if not is_index(x))
    indexes = tuple(int(x) for x in raw if is_index(x))
    if uuids and indexes:
        raise InvalidRequest(
            f"{name}={value!r} mixes device indexes and UUIDs; the GPU lease provisioner "
            "understands one or the other."
        )
    return uuids, indexes


def discover(env: Mapping[str, str]) -> Placement:
    """The kernel's :class:`Placement` from its server's environment ``env``."""
    named = node_from_env(env)
    node, node_from = named if named else (None, "")
    in_slurm = bool(env.get("SLURM_JOB_ID"))
    in_pod = bool(env.get("KUBERNETES_SERVICE_HOST"))
    sources = ["GPU_LEASE_GPU_UUIDS"]
    if in_slurm:
        sources += ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"]
    if in_pod:
        sources += ["NVIDIA_VISIBLE_DEVICES"]
    for var in sources:
        value = env.get(var, "")
        if not value.strip():
            continue
        devices = parse_devices(value, var)
        if devices is None:  # "all": every GPU of the node
            break
        uuids, indexes = devices
        if var == "GPU_LEASE_GPU_UUIDS" and indexes:
            raise InvalidRequest(
                f"GPU_LEASE_GPU_UUIDS={value!r} lists device indexes; it takes GPU UUIDs "
                "(GPU-…), as `nvidia-smi -L` prints them."
            )
        if indexes and node is None:
            raise InvalidRequest(
                f"{var}={value!r} names GPUs by index, but nothing names this server's node; "
                "set GPU_LEASE_NODE to the node's name as its agent registers it."
            )
        return Placement(node, uuids, indexes, node_from, var)
    return Placement(node, node_from=node_from)


def resolve_indexes(placement: Placement, pool: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The UUIDs of ``placement``'s GPU indexes on its node, from the broker's ``pool``
    (``GET /api/v1/gpus``). Raises :class:`InvalidRequest` when the pool has none of them."""
    wanted = set(placement.gpu_indexes)
    found = tuple(
        str(g["uuid"]) for g in pool if g.get("node") == placement.node and g.get("index") in wanted
    )
    if not found:
        raise InvalidRequest(
            f"This server may use GPU(s) {', '.join(map(str, sorted(wanted)))} of node "
            f"{placement.node!r} ({placement.gpus_from}), but the broker's pool has none of "
            "them; ask your administrator to run the node agent (gpu-lease agent) there."
        )
    return found


__all__ = ["Placement", "discover", "parse_devices", "resolve_indexes"]
