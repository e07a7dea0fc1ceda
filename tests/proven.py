"""Honest kernels for the tests: the root agent acts only on a kernel whose
start environment carries its lease's secret, so a test's stand-in kernel is started as a
provisioner starts one, with ``GPU_LEASE_KERNEL_SECRET`` set, and its renewals claim it
with the secret's digest (``proof``), as ``kernel/lease_keeper.py`` does."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from provisioner.node.pidns import own_pid_ns
from provisioner.wire import KERNEL_SECRET_ENV, kernel_proof


def kernel_env(base: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """A kernel's environment (``base``, else this process's) with a fresh secret, and the
    renewals' ``proof`` of it."""
    secret = secrets.token_urlsafe(32)
    env = dict(os.environ if base is None else base)
    env[KERNEL_SECRET_ENV] = secret
    return env, kernel_proof(secret)


def claim(pid: int, proof: str | None, pid_ns: int | None = None, **more: Any) -> dict[str, Any]:
    """A renewal body claiming ``pid`` (numbered in ``pid_ns``, else this process's
    namespace) with ``proof``."""
    body: dict[str, Any] = {"pid": pid, "pid_ns": pid_ns or own_pid_ns(), **more}
    if proof is not None:
        body["proof"] = proof
    return body
