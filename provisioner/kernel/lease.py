"""``GrantedLease``: a lease as the broker granted it, typed for the kernel side (pure, no I/O).

The broker answers an acquire or a renewal with a lease object (the ``Lease`` schema of
:mod:`provisioner.broker.web.openapi`). :meth:`GrantedLease.from_json` reads it once, where
the client's answer enters the kernel side (``LeaseKeeper``); from there on the keeper,
the state file and the environment builder (:func:`.env.lease_environment`) read typed
fields, never keys.

Reading is lenient about everything but the id: a field that is missing or of the wrong
type becomes ``None``, and the consumer that needs it says so in its own words (the
environment builder refuses a lease without a GPU UUID or a positive memory cap). The
object as the broker sent it stays in ``raw``: it is what the provisioner saves with the
kernel (``get_provisioner_info``), so a server that restarts resumes with the broker's
own words. (The broker's ``model.Lease`` is its stored row: it knows the GPU by UUID
only and the fraction in ppm; the kernel side needs the GPU's name and size as sent.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest

# a parked lease's wire states: the lease lives on, its GPU memory is being parked, is in
# host RAM, or is being restored. Never an end: the keeper keeps renewing, and a cell run in
# the kernel asks for the resume.
from ..wire import PARK_STATES as PARK_STATES


@dataclass(frozen=True)
class LeasedGPU:
    """The lease's GPU as the broker describes it (``gpu {uuid, node, name, memory_mb}``)."""

    uuid: str | None = None
    node: str | None = None
    name: str | None = None
    memory_mb: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> LeasedGPU:
        if not isinstance(data, Mapping):
            return cls()
        return cls(
            uuid=_text(data.get("uuid")),
            node=_text(data.get("node")),
            name=_text(data.get("name")),
            memory_mb=positive_int(data.get("memory_mb")),
        )

    def to_json(self) -> dict[str, Any] | None:
        """The fields the broker sent (None when it described no GPU)."""
        out = {k: v for k, v in vars(self).items() if v is not None}
        return out or None


@dataclass(frozen=True)
class GrantedLease:
    """One lease of this kernel, as the broker last described it."""

    id: str
    #: the leased fraction of the GPU, 0 < f <= 1
    fraction: float | None
    #: the framework memory cap (MiB): the reservation minus the CUDA context overhead
    memory_limit_mb: int | None
    gpu: LeasedGPU
    #: active | parking | parked | resuming (alive: see PARK_STATES) | revoked | released | expired
    state: str
    created_at: float | None = None
    renewed_at: float | None = None
    expires_at: float | None = None
    #: why the broker ended it (revoked, expired), if it did
    reason: str | None = None
    #: the broker's JSON object as received
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> GrantedLease:
        """Read a broker lease object; raises :class:`InvalidRequest` when it has no id."""
        body: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
        lease_id = _text(body.get("id"))
        if lease_id is None:
            raise InvalidRequest(
                "The broker's lease has no id; the kernel cannot be started with it."
            )
        return cls(
            id=lease_id,
            fraction=_number(body.get("fraction")),
            memory_limit_mb=positive_int(body.get("memory_limit_mb")),
            gpu=LeasedGPU.from_json(body.get("gpu")),
            state=_text(body.get("state")) or "active",
            created_at=_number(body.get("created_at")),
            renewed_at=_number(body.get("renewed_at")),
            expires_at=_number(body.get("expires_at")),
            reason=_text(body.get("reason")),
            raw=dict(body),
        )

    @property
    def parked(self) -> bool:
        """Its GPU memory is parked, being parked or being restored (``PARK_STATES``)."""
        return self.state in PARK_STATES

    @property
    def parked_at(self) -> float | None:
        """When the broker began parking it (``parked_at``; None unless parked)."""
        return _number(self.raw.get("parked_at"))

    @property
    def ttl(self) -> float | None:
        """Seconds from the last renewal (or the grant) to expiry, when the broker said both."""
        since = self.renewed_at if self.renewed_at is not None else self.created_at
        if self.expires_at is None or since is None or self.expires_at <= since:
            return None
        return self.expires_at - since

    @property
    def short_id(self) -> str:
        """The id shortened for logs, as the broker logs it."""
        return short_id(self.id)


def short_id(lease_id: Any) -> str:
    """A lease id shortened for logs (``?`` for none)."""
    return f"{str(lease_id)[:6]}…" if lease_id else "?"


def positive_int(value: Any) -> int | None:
    """``value`` as a positive int (floats rounded down), else None (bools, NaN, text...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return int(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


__all__ = ["PARK_STATES", "GrantedLease", "LeasedGPU", "positive_int", "short_id"]
