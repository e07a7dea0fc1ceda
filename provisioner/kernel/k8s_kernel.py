"""On Kubernetes: the remote kernel as a pod pinned to its lease's node (pure; no client).

Two manifests per kernel, built from the :class:`~.remote.LaunchJob`:

- :func:`kernel_secret`: a ``Secret`` holding the kernel's connection file (its HMAC key, the
  fixed ports, ``ip: 0.0.0.0``: the pod has an address of its own). The key is only here.
- :func:`kernel_pod`: the ``Pod``. It mounts that Secret read-only and names it by name
  only, so the key is never in the pod's spec (nor in ``kubectl get pod -o yaml``, events or
  the audit log of pod writes). ipykernel binds the file's ports as they are and leaves a
  file that already says what it bound alone, so a read-only mount serves.

The pod is pinned to the lease's node with a *required node affinity* on the node's
``metadata.name`` (``matchFields``), not ``spec.nodeName``: a pod with ``nodeName`` skips
the scheduler, so it is not checked against the node's free CPU and memory, its taints or
the scheduler's preemption, and on a full node it fails (``OutOfcpu``) instead of pending
with a reason; the DaemonSet controller pins its pods the same way for the same reasons.

It runs as the student's uid and gid (``runAsNonRoot``, no privilege escalation, every
capability dropped, the runtime's seccomp profile, no service-account token), sees its GPU
through ``NVIDIA_VISIBLE_DEVICES=<the lease's GPU UUID>`` with the NVIDIA runtime class and
asks for **no** ``nvidia.com/gpu`` (as the servers in docs/kubernetes.md: the device plugin
hands out whole GPUs; the broker divides them), gets the lease's environment, declares its
five ports, never restarts (``restartPolicy: Never``: jupyter_client restarts a kernel, not
the kubelet) and carries labels that tie it to its kernel and lease.

Nothing here talks to a cluster; docs/kubernetes.md says what a server needs to create these
(a Role for pods and secrets in its namespace) and the NetworkPolicy that lets only the
servers reach the kernels' ports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequest
from .remote import CHANNELS, CONNECTION_FILE, LaunchJob

#: the ports a kernel pod listens on (its own address, so every pod may use the same)
DEFAULT_PORTS: Mapping[str, int] = {
    "shell_port": 52700,
    "iopub_port": 52701,
    "stdin_port": 52702,
    "control_port": 52703,
    "hb_port": 52704,
}
#: where the Secret's connection file is mounted in the pod
SECRET_DIR = "/var/run/gpu-lease"
CONNECTION_KEY = "kernel.json"
#: the labels on every kernel pod and its Secret
APP_LABEL = "gpu-lease-kernel"
KERNEL_LABEL = "gpu-lease.jupyter.org/kernel-id"
LEASE_LABEL = "gpu-lease.jupyter.org/lease-id"
USER_ANNOTATION = "gpu-lease.jupyter.org/user"
NODE_ANNOTATION = "gpu-lease.jupyter.org/node"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _label(value: str, what: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise InvalidRequest(f"The {what} {value!r} cannot be a Kubernetes label value.")
    return value


def object_name(job: LaunchJob) -> str:
    """The pod's and the Secret's name: ``kernel-<kernel id>`` (a DNS label)."""
    name = f"kernel-{job.kernel_id.lower()}"
    if len(name) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise InvalidRequest(f"Kernel id {job.kernel_id!r} cannot name a pod; use a UUID.")
    return name


def labels(job: LaunchJob) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP_LABEL,
        "app.kubernetes.io/component": "kernel",
        KERNEL_LABEL: _label(job.kernel_id, "kernel id"),
        LEASE_LABEL: _label(job.lease.id, "lease id"),
    }


def connection_file(job: LaunchJob, ports: Mapping[str, int] = DEFAULT_PORTS) -> dict[str, Any]:
    """The kernel's connection file as the pod reads it (with the key)."""
    return {
        "ip": "0.0.0.0",
        "transport": "tcp",
        "key": job.key,
        "signature_scheme": job.signature_scheme,
        "kernel_name": "",
        **{name: int(ports[name]) for name in CHANNELS},
    }


def kernel_secret(
    job: LaunchJob, *, namespace: str, ports: Mapping[str, int] = DEFAULT_PORTS
) -> dict[str, Any]:
    """The Secret that holds the kernel's connection file (the only place of its key)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": object_name(job), "namespace": namespace, "labels": labels(job)},
        "type": "Opaque",
        "immutable": True,
        "stringData": {CONNECTION_KEY: json.dumps(connection_file(job, ports))},
    }


def kernel_pod(
    job: LaunchJob,
    *,
    image: str,
    namespace: str,
    uid: int,
    gid: int,
    ports: Mapping[str, int] = DEFAULT_PORTS,
    runtime_class: str | None = "nvidia",
    cpu: str = "1",
    memory: str = "4Gi",
    tolerations: Sequence[Mapping[str, Any]] = (),
    service_account: str | None = None,
    working_dir: str | None = None,
) -> dict[str, Any]:
    """The kernel's pod, pinned to the lease's node (see the module docstring)."""
    node = job.lease.gpu.node
    gpu = job.lease.gpu.uuid
    if not node or not gpu:
        raise InvalidRequest(
            f"Lease {job.lease.id} names no node or GPU; a kernel pod runs on its lease's node."
        )
    if uid <= 0 or gid <= 0:
        raise InvalidRequest(
            f"A kernel pod runs as the student's own uid and gid, not {uid}:{gid} (root)."
        )
    name = object_name(job)
    mounted = f"{SECRET_DIR}/{CONNECTION_KEY}"
    argv = [mounted if a == CONNECTION_FILE else a for a in job.argv]
    env = {
        **dict(job.env),
        "NVIDIA_VISIBLE_DEVICES": gpu,
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }
    container: dict[str, Any] = {
        "name": "kernel",
        "image": image,
        "command": argv,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [
            {"name": channel.removesuffix("_port"), "containerPort": int(ports[channel])}
            for channel in CHANNELS
        ],
        "resources": {
            "requests": {"cpu": cpu, "memory": memory},
            "limits": {"memory": memory},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "connection", "mountPath": SECRET_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if working_dir:
        container["workingDir"] = working_dir
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "fsGroup": gid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {
                "name": "connection",
                # group-readable through fsGroup: the student's uid reads it, nobody else
                "secret": {"secretName": name, "defaultMode": 0o440},
            },
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if service_account:
        spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels(job),
            "annotations": {
                USER_ANNOTATION: job.lease.user or "",
                NODE_ANNOTATION: node,
            },
        },
        "spec": spec,
    }


__all__ = [
    "DEFAULT_PORTS",
    "connection_file",
    "kernel_pod",
    "kernel_secret",
    "labels",
    "object_name",
]
