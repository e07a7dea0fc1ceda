"""The broker's answers, typed once where they enter: ``GrantedLease`` and the resume answer.

The client's lease calls (:mod:`.leases`: acquire, renew, resume, revoke, get, the list)
return a :class:`GrantedLease`, read from the broker's lease object (the ``Lease`` schema of
the OpenAPI document the broker serves) by :meth:`GrantedLease.from_json`; from there on
the kernel side, the CLI and the tools read typed fields, never keys. Where a dict must be
written (the JupyterLab status board, the saved provisioner info, ``gpu-lease leases
--json``) :meth:`GrantedLease.to_json` makes it, with the broker's field names, so that
``from_json(lease.to_json()) == lease``.

The fields are declared once, in the dataclass: each field's type names its reader
(:data:`_READERS`, :data:`_NESTED`), so adding a field of the broker's lease is one line
here (see docs/developers.md, "Adding a lease field"). Reading is:

- strict about types: a field that is present with the wrong type (a string for a number,
  a bool for an integer, NaN) raises :class:`~provisioner.errors.InvalidRequest` naming the
  field, what it holds and what was expected;
- lenient about absence: only ``id`` is required; a field missing or ``null`` reads as
  ``None`` (an older broker, a saved lease), and the consumer that needs it says so in its
  own words (the environment builder refuses a lease without a GPU UUID or a positive
  memory cap);
- blind to fields it does not know: a newer broker may add some.

Pure: no I/O; imports nothing of ours but :mod:`provisioner.errors` and
:mod:`provisioner.wire`. (The broker's ``model.Lease`` is its stored row: it knows the GPU
by UUID only and the fraction in ppm; this is the lease as the API describes it.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .. import errors
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
    def from_json(cls, data: Any, where: str = "gpu") -> LeasedGPU:
        """Read a ``GPURef`` object (``None``: a GPU the broker did not describe)."""
        return cls(**_read_fields(cls, data, where, required=()))

    def to_json(self) -> dict[str, Any] | None:
        """The fields the broker sent (None when it described no GPU)."""
        out = {k: v for k, v in vars(self).items() if v is not None}
        return out or None


@dataclass(frozen=True)
class ResumePlace:
    """A parked lease's waiting resume request: its place in the queue (``resume``)."""

    position: int | None = None
    eta_seconds: float | None = None

    @classmethod
    def from_json(cls, data: Any, where: str = "resume") -> ResumePlace:
        return cls(**_read_fields(cls, data, where, required=()))

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "eta_seconds": self.eta_seconds}


@dataclass(frozen=True)
class GrantedLease:
    """One lease as the broker last described it: every field of its ``Lease`` schema."""

    id: str
    user: str | None = None
    kernel_id: str | None = None
    #: the leased fraction of the GPU, 0 < f <= 1
    fraction: float | None = None
    gpu: LeasedGPU = LeasedGPU()
    #: the framework memory cap (MiB): the reservation minus the CUDA context overhead
    memory_limit_mb: int | None = None
    #: active | parking | parked | resuming (alive: see PARK_STATES) | revoked | released |
    #: expired (a state this client does not know is kept as sent)
    state: str = "active"
    #: the course (group) the kernelspec belongs to
    group: str | None = None
    #: the user's groups when the lease was granted
    groups: tuple[str, ...] = ()
    created_at: float | None = None
    renewed_at: float | None = None
    expires_at: float | None = None
    ended_at: float | None = None
    #: why the broker ended it (revoked, expired), if it did
    reason: str | None = None
    #: the kernel's pid as its last renewal reported it
    pid: int | None = None
    execution_state: str | None = None
    last_activity: float | None = None
    #: GPU memory the kernel's processes use, as its node agent last reported (None: no agent)
    used_mb: int | None = None
    #: the layer that holds the cap: ``cooperative``, ``agent-MODE``, ``driver+agent-MODE``
    enforcement: str | None = None
    #: the GPU's MPS control daemon (``running`` | ``down``; None: no agent runs one)
    mps: str | None = None
    #: the uid the kernel's provisioner reported for an enforcement=mps kernel
    mps_uid: int | None = None
    #: the uid the GPU's MPS server serves clients of now (None: none)
    mps_server_uid: int | None = None
    #: why the node's agent does not act on the kernel the renewals name (None: proven)
    kernel_refused: str | None = None
    #: while a class session of the user's course is held: "GPU reserved for ml101 until 11:30"
    session: str | None = None
    #: when the broker began parking it (None unless parked)
    parked_at: float | None = None
    #: a parked lease whose resume request waits: its place in the queue
    resume: ResumePlace | None = None

    @classmethod
    def from_json(cls, data: Any) -> GrantedLease:
        """Read a broker lease object; raises :class:`InvalidRequest` when it is not one
        (not an object, no id, a field of the wrong type)."""
        return cls(**_read_fields(cls, data, "lease", required=("id",)))

    def to_json(self) -> dict[str, Any]:
        """The lease as the broker's JSON object (every field; ``resume`` only when set)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (LeasedGPU, ResumePlace)):
                value = value.to_json()
            elif isinstance(value, tuple):
                value = list(value)
            if value is None and f.name == "resume":
                continue
            out[f.name] = value
        return out

    def with_state(self, state: str) -> GrantedLease:
        """This lease in another ``state`` (a resume's 202 names the lease's park state)."""
        return replace(self, state=state)

    @property
    def parked(self) -> bool:
        """Its GPU memory is parked, being parked or being restored (``PARK_STATES``)."""
        return self.state in PARK_STATES

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


@dataclass(frozen=True)
class NodeKernelAnswer:
    """The broker's answer about a lease's remote kernel (``/leases/{id}/kernel``)."""

    lease_id: str
    node: str
    generation: int
    #: launching | running | exited | failed
    state: str
    cursor: str
    ip: str | None = None
    ports: dict[str, int] | None = None
    pid: int | None = None
    pid_ns: int | None = None
    cgroup: str | None = None
    cwd: str | None = None
    cwd_shared: bool | None = None
    exit_code: int | None = None
    reason: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> NodeKernelAnswer:
        if not isinstance(data, dict) or not isinstance(data.get("state"), str):
            raise errors.BrokerUnavailable(
                "The broker's answer about a remote kernel is not what this client reads; "
                "is the broker as recent as the provisioner?"
            )
        ports = data.get("ports")

        def num(name: str) -> int | None:
            v = data.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def txt(name: str) -> str | None:
            v = data.get(name)
            return v if isinstance(v, str) else None

        return cls(
            lease_id=str(data.get("lease_id") or ""),
            node=str(data.get("node") or ""),
            generation=int(data.get("generation") or 0),
            state=str(data["state"]),
            cursor=str(data.get("cursor") or ""),
            ip=txt("ip"),
            ports={str(k): int(v) for k, v in ports.items()} if isinstance(ports, dict) else None,
            pid=num("pid"),
            pid_ns=num("pid_ns"),
            cgroup=txt("cgroup"),
            cwd=txt("cwd"),
            cwd_shared=data.get("cwd_shared") if isinstance(data.get("cwd_shared"), bool) else None,
            exit_code=num("exit_code"),
            reason=txt("reason"),
        )


@dataclass(frozen=True)
class ResumeAnswer:
    """The broker's answer to ``POST /leases/{id}/resume``: the active lease (200), or where
    the resume stands (202: the lease, its park ``state``, the place in the queue)."""

    #: the lease, in the answer's ``state`` (None: a 202 body that described none)
    lease: GrantedLease | None
    #: False once the lease is active again (200)
    waiting: bool
    position: int | None = None
    eta_seconds: float | None = None
    queue_length: int | None = None

    @classmethod
    def from_json(cls, data: Any, *, waiting: bool) -> ResumeAnswer:
        """Read a 200 answer (a lease) or, with ``waiting``, a 202 body ``{lease, state,
        position, eta_seconds, queue_length}``."""
        if not waiting:
            return cls(lease=GrantedLease.from_json(data), waiting=False)
        body = _Waiting(**_read_fields(_Waiting, data, "resume answer", required=()))
        lease = body.lease
        if lease is not None and body.state is not None:
            lease = lease.with_state(body.state)
        return cls(
            lease=lease,
            waiting=True,
            position=body.position,
            eta_seconds=body.eta_seconds,
            queue_length=body.queue_length,
        )


@dataclass(frozen=True)
class _Waiting:
    """The fields of a resume's 202 body (read by :meth:`ResumeAnswer.from_json`)."""

    lease: GrantedLease | None = None
    state: str | None = None
    position: int | None = None
    eta_seconds: float | None = None
    queue_length: int | None = None


def short_id(lease_id: Any) -> str:
    """A lease id shortened for logs (``?`` for none)."""
    return f"{str(lease_id)[:6]}…" if lease_id else "?"


# -- reading -----------------------------------------------------------------------------
class _Wrong(Exception):
    """A value of the wrong type: what was expected."""


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise _Wrong("a string")
    return value


def _integer(value: Any) -> int:
    # JSON has one number type: 1126.0 is an integer; 1126.5, NaN and true are not
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Wrong("an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise _Wrong("an integer")
        return int(value)
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Wrong("a number")
    if not math.isfinite(value):
        raise _Wrong("a finite number")
    return float(value)


def _texts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise _Wrong("a list of strings")
    return tuple(value)


#: each field type the answers use -> its reader; a nested object's reader is also given
#: where the object sits (``lease.gpu``), for its errors
_READERS: dict[str, Callable[[Any], Any]] = {
    "str": _text,
    "str | None": _text,
    "int | None": _integer,
    "float | None": _number,
    "tuple[str, ...]": _texts,
}
_NESTED: dict[str, Callable[[Any, str], Any]] = {
    "LeasedGPU": LeasedGPU.from_json,
    "ResumePlace | None": ResumePlace.from_json,
    "GrantedLease | None": lambda value, where: GrantedLease.from_json(value),
}
#: what a field missing from the answer becomes, where not None (the dataclass's default)
_MISSING: dict[str, Any] = {"LeasedGPU": LeasedGPU()}


def _at(read: Callable[[Any, str], Any], where: str) -> Callable[[Any], Any]:
    """``read`` of a nested object that sits at ``where``."""
    return lambda value: read(value, where)


@functools.cache
def _plan(cls: type, where: str) -> tuple[tuple[str, Callable[[Any], Any], Any], ...]:
    """``(name, reader, value when missing)`` of each field of dataclass ``cls``, read at
    ``where`` (worked out once per class: a lease is read at every renewal)."""
    plan = []
    for f in fields(cls):
        kind = str(f.type)
        reader: Callable[[Any], Any]
        if kind in _NESTED:
            reader = _at(_NESTED[kind], f"{where}.{f.name}")
        elif kind in _READERS:
            reader = _READERS[kind]
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no reader for {kind!r}")
        plan.append((f.name, reader, _MISSING.get(kind)))
    return tuple(plan)


def _read_fields(cls: type, data: Any, where: str, required: tuple[str, ...]) -> dict[str, Any]:
    """The constructor arguments of dataclass ``cls`` read from the JSON object ``data``.

    A field missing or ``null`` keeps its default (``None``; an empty ``LeasedGPU``); one
    in ``required`` must be a non-empty value. Unknown keys are ignored.
    """
    if data is None and not required:
        data = {}
    if not isinstance(data, Mapping):
        raise InvalidRequest(
            f"The GPU lease broker's {where} is {_shown(data)}, not a JSON object; "
            "is the broker a compatible version?",
            field=where,
        )
    out: dict[str, Any] = {}
    for name, reader, missing in _plan(cls, where):
        value = data.get(name)
        if value is None or (value == "" and name in required):
            if name in required:
                raise InvalidRequest(
                    f"The GPU lease broker's {where} has no {name}; "
                    "the kernel cannot be started with it.",
                    field=f"{where}.{name}",
                )
            if missing is not None:
                out[name] = missing
            continue
        try:
            out[name] = reader(value)
        except _Wrong as wrong:
            raise InvalidRequest(
                f"The GPU lease broker's {where} has {name} = {_shown(value)}, not "
                f"{wrong}; is the broker a compatible version?",
                field=f"{where}.{name}",
            ) from None
    return out


def _shown(value: Any) -> str:
    """``value`` for a message: its JSON kind and a short form."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), "a list" if isinstance(value, list) else "an object"
    )
    text = repr(value)
    return f"{kind} ({text[:40] + '…' if len(text) > 40 else text})"


# every field of the answers has a reader: a field of a new type fails at import
for _cls, _where in ((LeasedGPU, "lease.gpu"), (ResumePlace, "lease.resume")):
    _plan(_cls, _where)
_plan(GrantedLease, "lease")
_plan(_Waiting, "resume answer")

__all__ = [
    "PARK_STATES",
    "GrantedLease",
    "LeasedGPU",
    "NodeKernelAnswer",
    "ResumeAnswer",
    "ResumePlace",
    "short_id",
]
