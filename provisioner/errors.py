"""The exception tree of jupyter-gpu-lease.

Every error a student, instructor or admin can meet is one of these, and every
message is a sentence that says what to do next. Foreign exceptions (SQLAlchemy,
httpx, NVML, tornado) are translated into these once, at the edge that meets them
(``raise OurError(...) from exc``); nothing above that edge sees a foreign type.

::

    GPULeaseError                      base of everything below; has ``code`` and ``status``
    ├── InvalidRequest                 400  malformed JSON, wrong types, NaN, bad fraction, unknown fields
    ├── NotAuthenticated               401  missing, forged or expired token
    ├── Forbidden                      403  not yours / not an admin / not a member of the course
    │   └── QuotaExceeded              403  the request would exceed a quota
    ├── LeaseNotFound                  404  no such lease (or not visible to the caller)
    ├── Conflict                       409  the kernel already holds a lease of another fraction
    ├── LeaseGone                      410  the lease ended; ``state`` says how (released/expired/revoked)
    │   ├── LeaseRevoked               410  revoked (idle reclaim or an admin); ``reason`` says why
    │   └── LeaseExpired               410  not renewed within its TTL
    ├── BodyTooLarge                   413  request body above the broker's limit
    ├── CannotFit                      422  can never be placed (too large, or below the context overhead)
    ├── NoCapacity                     --   (client side) still queued when the caller stopped waiting
    ├── StoreError                     503  the database failed; nothing was changed
    └── BrokerUnavailable              503  (client side) the broker cannot be reached or answered 5xx

``code`` is the machine-readable ``error`` field of the REST API's error body;
``status`` is the HTTP status the broker answers with. Handlers are the only place
that turns these into HTTP responses; the client is the only place that turns HTTP
responses back into these.
"""

from __future__ import annotations

from typing import Any


class GPULeaseError(Exception):
    """Base class: ``message`` is a human sentence, ``code`` a stable identifier."""

    code = "error"
    status = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code, "message": self.message}
        body.update(self.details)
        return body


class InvalidRequest(GPULeaseError):
    code = "invalid_request"
    status = 400


class NotAuthenticated(GPULeaseError):
    code = "not_authenticated"
    status = 401


class Forbidden(GPULeaseError):
    code = "forbidden"
    status = 403


class QuotaExceeded(Forbidden):
    code = "quota_exceeded"


class LeaseNotFound(GPULeaseError):
    code = "not_found"
    status = 404


class Conflict(GPULeaseError):
    code = "conflict"
    status = 409


class LeaseGone(GPULeaseError):
    """The lease is no longer active. ``details['state']`` says how it ended."""

    code = "gone"
    status = 410


class LeaseRevoked(LeaseGone):
    code = "revoked"


class LeaseExpired(LeaseGone):
    code = "expired"


class BodyTooLarge(GPULeaseError):
    code = "body_too_large"
    status = 413


class CannotFit(GPULeaseError):
    code = "cannot_fit"
    status = 422


class NoCapacity(GPULeaseError):
    """Client side: the request was still queued when the caller stopped waiting."""

    code = "queued"
    status = 202


class StoreError(GPULeaseError):
    code = "store_unavailable"
    status = 503


class BrokerUnavailable(GPULeaseError):
    code = "broker_unavailable"
    status = 503


#: error code -> class, used by the client to translate an error body back
BY_CODE: dict[str, type[GPULeaseError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        NotAuthenticated,
        Forbidden,
        QuotaExceeded,
        LeaseNotFound,
        Conflict,
        LeaseGone,
        LeaseRevoked,
        LeaseExpired,
        BodyTooLarge,
        CannotFit,
        StoreError,
        BrokerUnavailable,
    )
}


def from_response(status: int, body: Any) -> GPULeaseError:
    """Rebuild an exception from a broker error body (``{"error", "message", ...}``)."""
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        code = body.get("error")
        cls = BY_CODE.get(code) if isinstance(code, str) else None
        details = {k: v for k, v in body.items() if k not in ("error", "message")}
        if cls is None:
            cls = _BY_STATUS.get(status, GPULeaseError)
        return cls(body["message"], **details)
    cls = _BY_STATUS.get(status, GPULeaseError)
    return cls(f"The GPU lease broker answered HTTP {status} without an explanation.")


_BY_STATUS: dict[int, type[GPULeaseError]] = {
    400: InvalidRequest,
    401: NotAuthenticated,
    403: Forbidden,
    404: LeaseNotFound,
    409: Conflict,
    410: LeaseGone,
    413: BodyTooLarge,
    422: CannotFit,
    502: BrokerUnavailable,
    503: BrokerUnavailable,
    504: BrokerUnavailable,
}
