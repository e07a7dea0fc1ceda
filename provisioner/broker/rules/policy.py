"""What the allocation core is given besides the pool's state: its knobs and an acquire.

:class:`Policy` holds the core's settings (the broker fills it from its traitlets config,
the simulator and the tests build ``Policy()``); :class:`Ask` is one validated acquire
with the identity the broker verified. Plain frozen data, imported by every module of the
core (``scheduling``, ``admission``, ``node_rules``, ``estimates``) and by their callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...wire import DEFAULT_CONTEXT_OVERHEAD_MB, PPM


@dataclass(frozen=True)
class Policy:
    """The knobs of the core. The broker fills these from its traitlets config."""

    ttl: float = 90.0
    context_overhead_mb: int = DEFAULT_CONTEXT_OVERHEAD_MB
    reserve_ppm: int = 0
    placement: str = "best-fit"  # or "spread"; "first-fit" is the simulator's baseline
    backfill: bool = True
    reservation: str = "fewest-leases"  # or "emptiest" (the simulator's comparison)
    starvation_after: float = 600.0
    idle_reclaim_after: float | None = None
    queue_poll_grace: float = 30.0
    max_queued_per_user: int = 10
    #: seconds a node agent may stay silent before its node is lost (nothing new placed there)
    node_grace: float = 30.0
    #: MiB a kernel may use above its lease's reservation before it counts as over it
    overuse_tolerance_mb: int = 256
    #: seconds a kernel must stay over its lease before an enforcing agent's node revokes it
    overuse_grace: float = 10.0
    #: seconds before a class session's start from which no non-member's new lease is
    #: placed in its reserved share (``rules/sessions.py``)
    session_lead: float = 600.0
    #: seconds into a class session after which its share's unused part is lent back to
    #: everyone until a member of the course asks (None: never lent)
    session_lend_after: float | None = 900.0
    #: seconds after a class session's start after which non-members' busy kernels in its
    #: share are freed too (None: never; idle ones are freed at the start)
    session_busy_grace: float | None = None

    @property
    def capacity_ppm(self) -> int:
        return PPM - self.reserve_ppm


@dataclass(frozen=True)
class Ask:
    """A validated acquire, with the identity the broker verified."""

    user: str
    kernel_id: str
    fraction_ppm: int
    groups: frozenset[str] = frozenset()
    admin: bool = False
    node: str | None = None
    gpu_uuids: tuple[str, ...] | None = None
    group: str | None = None
    #: an ``enforcement=mps`` kernel's Unix uid, as its provisioner reports it (None: not
    #: an MPS kernel); a placement hint (``node_rules.mps_blocked``), never an identity
    mps_uid: int | None = None
