"""The client's typed answers (:mod:`provisioner.client.answers`): a broker lease object is
read once into a ``GrantedLease``; missing fields read as None, unknown ones are ignored,
a field of the wrong type is refused naming it; ``to_json`` gives the broker's object back.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from provisioner.broker.web.routes import build_openapi
from provisioner.client import (
    BrokerClient,
    GrantedLease,
    LeasedGPU,
    Renewal,
    ResumeAnswer,
    ResumePlace,
)
from provisioner.errors import InvalidRequest

#: a lease object as the broker answers it: every field of its ``Lease`` schema
FULL: dict[str, Any] = {
    "id": "L-abc",
    "user": "alice",
    "kernel_id": "k1",
    "fraction": 0.25,
    "gpu": {"uuid": "GPU-0", "node": "n1", "name": "V100", "memory_mb": 32768},
    "memory_limit_mb": 7680,
    "state": "parked",
    "group": "ml101",
    "groups": ["ml101", "cs50"],
    "created_at": 1.0,
    "renewed_at": 2.0,
    "expires_at": 92.0,
    "ended_at": None,
    "reason": None,
    "pid": 4242,
    "execution_state": "idle",
    "last_activity": 1.5,
    "used_mb": 3000,
    "enforcement": "driver+agent-kill",
    "mps": "running",
    "mps_uid": 1000,
    "mps_server_uid": 1000,
    "kernel_refused": None,
    "session": "GPU reserved for ml101 until 11:30",
    "parked_at": 50.0,
    "resume": {"position": 2, "eta_seconds": 40.0},
}


def test_every_field_of_the_documented_lease_is_typed() -> None:
    """The typed lease has exactly the fields of the ``Lease`` schema the broker serves (a
    field added to the broker's answer fails here until it is added to the client)."""
    documented = build_openapi()["components"]["schemas"]["Lease"]["properties"]
    assert {f.name for f in fields(GrantedLease)} == set(documented)
    assert set(FULL) == set(documented)


def test_a_full_lease_is_read_into_typed_fields() -> None:
    lease = GrantedLease.from_json(FULL)
    assert lease.gpu == LeasedGPU(uuid="GPU-0", node="n1", name="V100", memory_mb=32768)
    assert lease.groups == ("ml101", "cs50")
    assert lease.resume == ResumePlace(position=2, eta_seconds=40.0)
    assert (lease.enforcement, lease.mps, lease.mps_server_uid) == (
        "driver+agent-kill",
        "running",
        1000,
    )
    assert (lease.used_mb, lease.memory_limit_mb, lease.parked_at) == (3000, 7680, 50.0)
    assert lease.parked and lease.ttl == 90.0
    assert lease.to_json() == FULL


def test_only_the_id_is_required() -> None:
    lease = GrantedLease.from_json({"id": "L-1"})
    assert lease == GrantedLease(id="L-1")
    assert lease.state == "active" and lease.gpu == LeasedGPU() and lease.resume is None
    assert lease.used_mb is None and lease.enforcement is None and lease.groups == ()
    # null reads as missing: the broker sends null for what it does not know
    assert GrantedLease.from_json({**{k: None for k in FULL}, "id": "L-1"}) == lease
    assert "resume" not in lease.to_json() and lease.to_json()["gpu"] is None


@pytest.mark.parametrize("data", [{}, {"id": None}, {"id": ""}, {"user": "alice"}])
def test_a_lease_without_an_id_is_refused(data: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest, match="lease has no id") as info:
        GrantedLease.from_json(data)
    assert info.value.details["field"] == "lease.id"


def test_unknown_fields_of_a_newer_broker_are_ignored() -> None:
    newer = {**FULL, "carbon_g": 12.5, "gpu": {**FULL["gpu"], "mig": "1g.10gb"}, "x": [1]}
    assert GrantedLease.from_json(newer) == GrantedLease.from_json(FULL)
    # a state this client does not know is kept as sent, not refused
    assert GrantedLease.from_json({"id": "L", "state": "migrating"}).state == "migrating"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("id", 42, r"lease has id = an integer \(42\), not a string"),
        ("fraction", "0.5", r"lease has fraction = a string \('0.5'\), not a number"),
        ("fraction", True, r"fraction = a boolean \(True\), not a number"),
        ("fraction", math.inf, r"fraction = a number \(inf\), not a finite number"),
        ("memory_limit_mb", 1.5, r"memory_limit_mb = a number \(1.5\), not an integer"),
        ("memory_limit_mb", math.nan, r"memory_limit_mb = a number \(nan\), not an integer"),
        ("used_mb", [1], r"used_mb = a list \(\[1\]\), not an integer"),
        ("state", 1, r"state = an integer \(1\), not a string"),
        ("enforcement", {"a": 1}, r"enforcement = an object .*, not a string"),
        ("groups", "ml101", r"groups = a string \('ml101'\), not a list of strings"),
        ("groups", ["ml101", 7], r"groups = a list .*, not a list of strings"),
        ("gpu", "GPU-0", r"lease.gpu is a string \('GPU-0'\), not a JSON object"),
        ("gpu", {"uuid": 7}, r"lease.gpu has uuid = an integer \(7\), not a string"),
        ("gpu", {"memory_mb": "big"}, r"lease.gpu has memory_mb = a string"),
        ("resume", {"position": "2"}, r"lease.resume has position = a string"),
        ("resume", [2], r"lease.resume is a list \(\[2\]\), not a JSON object"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_by_name(field: str, value: Any, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as info:
        GrantedLease.from_json({**FULL, field: value})
    assert info.value.details["field"].split(".")[-1] in (field, "uuid", "memory_mb", "position")
    assert "compatible version" in info.value.message


@pytest.mark.parametrize("data", [None, [], "lease", 7])
def test_a_lease_that_is_no_object_is_refused(data: Any) -> None:
    with pytest.raises(InvalidRequest, match="not a JSON object"):
        GrantedLease.from_json(data)


def test_an_integral_float_is_an_integer() -> None:
    """JSON has one number type: 7680.0 is the integer 7680 (another broker may write it)."""
    lease = GrantedLease.from_json({"id": "L", "memory_limit_mb": 7680.0, "pid": 3})
    assert lease.memory_limit_mb == 7680 and isinstance(lease.memory_limit_mb, int)


_text = st.text(max_size=8)
_maybe_text = st.none() | _text
_maybe_int = st.none() | st.integers(-(2**40), 2**40)
_maybe_float = st.none() | st.floats(allow_nan=False, allow_infinity=False)


@given(
    st.builds(
        GrantedLease,
        id=st.text(min_size=1, max_size=8),
        user=_maybe_text,
        fraction=_maybe_float,
        gpu=st.builds(LeasedGPU, uuid=_maybe_text, memory_mb=_maybe_int),
        memory_limit_mb=_maybe_int,
        state=_text,
        groups=st.lists(_text, max_size=3).map(tuple),
        used_mb=_maybe_int,
        enforcement=_maybe_text,
        parked_at=_maybe_float,
        resume=st.none() | st.builds(ResumePlace, position=_maybe_int, eta_seconds=_maybe_float),
    )
)
def test_to_json_reads_back_the_same_lease(lease: GrantedLease) -> None:
    """``to_json`` is what the board shows and the provisioner saves: read back, it is the
    same lease."""
    assert GrantedLease.from_json(lease.to_json()) == lease


def test_a_resume_answer_is_typed() -> None:
    active = ResumeAnswer.from_json({**FULL, "state": "active"}, waiting=False)
    assert not active.waiting and active.lease is not None and active.lease.state == "active"
    body = {"lease": {**FULL, "state": "active"}, "state": "resuming", "position": 3}
    waiting = ResumeAnswer.from_json({**body, "eta_seconds": 12, "queue_length": 5}, waiting=True)
    assert waiting.waiting and waiting.lease is not None
    assert waiting.lease.state == "resuming"  # the body's state wins over its lease's
    assert (waiting.position, waiting.eta_seconds, waiting.queue_length) == (3, 12.0, 5)
    assert ResumeAnswer.from_json({"state": "parked"}, waiting=True).lease is None
    with pytest.raises(InvalidRequest, match="position = a string"):
        ResumeAnswer.from_json({**body, "position": "3"}, waiting=True)
    with pytest.raises(InvalidRequest, match="lease has no id"):
        ResumeAnswer.from_json({"state": "active"}, waiting=False)


@pytest.mark.slow
async def test_a_real_brokers_lease_is_read_whole(broker: Any) -> None:
    """Against a real broker: every field of its lease answer is typed (``to_json`` gives
    its JSON object back, key for key), through acquire, renew, get and the list."""
    async with broker.client("alice") as raw, BrokerClient(broker.url, broker.tokens["alice"]) as c:
        lease = await c.leases.acquire("k-answers", 0.25, group="ml101")
        assert lease.to_json() == (await raw.get(f"/leases/{lease.id}")).json()
        renewed = await c.leases.renew(lease.id, Renewal(pid=4242, execution_state="idle"))
        assert renewed.pid == 4242 and renewed.execution_state == "idle"
        assert renewed.enforcement == "cooperative" and renewed.used_mb is None
        got = await c.leases.get(lease.id)
        assert got.to_json() == (await raw.get(f"/leases/{lease.id}")).json()
        assert [x.id for x in await c.leases.listing()] == [lease.id]
        await c.leases.release(lease.id)
