"""The exception tree of jupyter-gpu-lease.

Every error a student, instructor or admin can meet is one of these, and every
message is a sentence that says what to do next. Foreign exceptions (SQLAlchemy,
httpx, NVML, tornado) are translated into these once, at the edge that meets them
(``raise OurError(...) from exc``); nothing above that edge sees a foreign type.

::

    GPULeaseError                      base of everything below; has ``code`` and ``status``
    ├── InvalidRequest                 400  malformed JSON, wrong types, NaN, bad fraction, unknown fields
    │   └── UnknownGPU                 400  the request names GPU UUIDs the pool does not have
    ├── NotAuthenticated               401  missing, forged or expired token
    ├── Forbidden                      403  not an admin / not a member of the course / quota
    │   └── QuotaExceeded              403  the request would exceed a quota
    ├── NotFound                       404  nothing of that name (or not visible to the caller)
    │   ├── LeaseNotFound              404  no such lease or queued request (the client's for any 404)
    │   ├── QuotaNotFound              404  no quota is set for that user, group or default
    │   ├── UserNotFound               404  JupyterHub has no user of that name
    │   └── NodeNotFound               404  no node of that name registered (an agent registers first)
    ├── MethodNotAllowed               405  the URL exists but does not take this method
    ├── Conflict                       409  the kernel already holds a lease of another fraction
    │   ├── CapacityConflict           409  (store) the database refused a grant: over capacity
    │   │   └── DuplicateLease         409  (store) the database refused a grant: the kernel holds one
    │   └── DuplicateRequest           409  (store) the kernel already waits in the queue
    ├── LeaseGone                      410  the lease ended; ``state`` says how (released/expired/revoked)
    │   ├── LeaseRevoked               410  revoked (idle reclaim or an admin); ``reason`` says why
    │   └── LeaseExpired               410  not renewed within its TTL
    ├── BodyTooLarge                   413  request body above the broker's limit
    ├── CannotFit                      422  can never be placed (too large, or below the context overhead)
    ├── NoCapacity                     --   (client side) still queued when the caller stopped waiting
    ├── KernelLaunchFailed             --   (client side) a remote kernel did not start; the node's reason
    ├── StoreError                     503  the database failed; nothing was changed
    ├── NotActive                      503  this broker may not answer now: standing by, deposed, shutting down
    ├── BrokerUnavailable              503  (client side) the broker cannot be reached or answered 5xx
    ├── AuthUnavailable                503  JupyterHub's API could not be asked who a token belongs to
    ├── TokensFileError                500  (start-up) the static tokens file is missing or malformed
    ├── CoursesFileError               500  (start-up) the courses file is missing or malformed
    └── InventoryError                 500  (start-up) a bad ``--gpus`` declaration or an NVML failure
        └── NoGPUFound                 500  (start-up) NVML found no NVIDIA GPU

``code`` is the machine-readable ``error`` field of the REST API's error body;
``status`` is the HTTP status the broker answers with; a 503's ``retry_after`` is the
``Retry-After`` (seconds) it carries. Handlers are the only place
that turns these into HTTP responses; the client (``client.py``) is the only place
that turns HTTP responses back into these.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthUnavailable",
    "BodyTooLarge",
    "BrokerUnavailable",
    "CannotFit",
    "CapacityConflict",
    "Conflict",
    "CoursesFileError",
    "DuplicateLease",
    "DuplicateRequest",
    "Forbidden",
    "GPULeaseError",
    "InvalidRequest",
    "InventoryError",
    "KernelLaunchFailed",
    "LeaseExpired",
    "LeaseGone",
    "LeaseNotFound",
    "LeaseRevoked",
    "MethodNotAllowed",
    "NoCapacity",
    "NoGPUFound",
    "NodeNotFound",
    "NotFound",
    "NotActive",
    "NotAuthenticated",
    "QuotaExceeded",
    "QuotaNotFound",
    "StoreError",
    "TokensFileError",
    "UserNotFound",
    "UnknownGPU",
]


class GPULeaseError(Exception):
    """Base class: ``message`` is a human sentence, ``code`` a stable identifier."""

    code = "error"
    status = 500
    #: seconds a client should wait before it retries (the ``Retry-After`` of a 503)
    retry_after = 5

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code, "message": self.message}
        body.update(self.details)
        return body


class InvalidRequest(GPULeaseError):
    """400: the input is malformed or out of range; the message says what to send instead."""

    code = "invalid_request"
    status = 400


class UnknownGPU(InvalidRequest):
    """400: the request names GPU UUIDs that are not in the broker's pool."""


class NotAuthenticated(GPULeaseError):
    """401: the token is missing, unknown or expired."""

    code = "not_authenticated"
    status = 401


class Forbidden(GPULeaseError):
    """403: not an admin, or not a member of the kernel's course (another user's lease is a
    404, as one that does not exist)."""

    code = "forbidden"
    status = 403


class QuotaExceeded(Forbidden):
    """403: the request would exceed a quota; ``quota`` names which, ``limit`` its value."""

    code = "quota_exceeded"


class NotFound(GPULeaseError):
    """404: nothing of that name (or not visible to the caller)."""

    code = "not_found"
    status = 404


class LeaseNotFound(NotFound):
    """404: no such lease or queued request (or not visible to the caller). The client
    raises it for every 404 answer: the error body's code does not say what was missing."""


class QuotaNotFound(NotFound):
    """404: no quota is set for that user, group or default."""


class UserNotFound(NotFound):
    """404: JupyterHub has no user of that name."""


class NodeNotFound(NotFound):
    """404: no node of that name is registered (its agent must ``PUT`` it first)."""


class MethodNotAllowed(GPULeaseError):
    """405: the URL exists but does not take this method (tornado's answer, as JSON)."""

    code = "method_not_allowed"
    status = 405


class Conflict(GPULeaseError):
    """409: the kernel already holds a lease of another fraction."""

    code = "conflict"
    status = 409


class CapacityConflict(Conflict):
    """409: the database refused a grant that would overfill a GPU; nothing was written."""

    code = "capacity_conflict"


class DuplicateLease(CapacityConflict):
    """409: the database refused a grant because the kernel already holds an active lease."""

    code = "duplicate_lease"


class DuplicateRequest(Conflict):
    """409: the kernel already waits in the queue; nothing was written."""

    code = "duplicate_request"


class LeaseGone(GPULeaseError):
    """410: the lease is no longer active; ``details['state']`` says how it ended."""

    code = "gone"
    status = 410


class LeaseRevoked(LeaseGone):
    """410: revoked by idle reclaim or an admin; ``details['reason']`` says why."""

    code = "revoked"


class LeaseExpired(LeaseGone):
    """410: not renewed within its TTL."""

    code = "expired"


class BodyTooLarge(GPULeaseError):
    """413: the request body is above the broker's limit."""

    code = "body_too_large"
    status = 413


class CannotFit(GPULeaseError):
    """422: the request can never be placed (too large, or below the context overhead)."""

    code = "cannot_fit"
    status = 422


class NoCapacity(GPULeaseError):
    """Client side: the request was still queued when the caller stopped waiting."""

    code = "queued"
    status = 202


class KernelLaunchFailed(GPULeaseError):
    """Client side: a remote kernel (on its lease's node) did not start; the message is
    the node's (or the scheduler's) reason, never a bare timeout."""

    code = "kernel_launch_failed"
    status = 502


class StoreError(GPULeaseError):
    """503: the database failed or cannot be used; nothing was changed."""

    code = "store_unavailable"
    status = 503


class NotActive(GPULeaseError):
    """503: this broker may not answer with state now (its leadership lapsed or moved to
    another broker, or it is shutting down); nothing was changed. Retry soon: the active
    broker answers."""

    code = "not_active"
    status = 503
    retry_after = 1


class BrokerUnavailable(GPULeaseError):
    """Client side: the broker cannot be reached, or answered 502/503/504."""

    code = "broker_unavailable"
    status = 503


class AuthUnavailable(GPULeaseError):
    """503: the identity provider (JupyterHub's API) could not be asked; retry later."""

    code = "auth_unavailable"
    status = 503


class TokensFileError(GPULeaseError):
    """The static tokens file is missing or malformed (a start-up error)."""

    code = "invalid_tokens_file"
    status = 500


class CoursesFileError(GPULeaseError):
    """The courses file is missing or malformed (a start-up error)."""

    code = "invalid_courses_file"
    status = 500


class InventoryError(GPULeaseError):
    """The GPU inventory cannot be built: a bad ``--gpus`` declaration or an NVML failure."""

    code = "inventory_error"
    status = 500


class NoGPUFound(InventoryError):
    """``--gpus nvml`` found no NVIDIA GPU (no driver, no library, NVML error, zero GPUs)."""

    code = "no_gpu_found"
