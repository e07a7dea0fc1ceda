"""The conformance check of ``tests/conformance.py``: it passes what a real broker answers,
and it refuses the same answers against a document that has drifted from the broker.

Every test with the ``broker`` fixture runs the check at its teardown; this file shows
the check can fail: a drift once found in the document (a lease's ``mps`` declared as
``enum: [running, down]`` without ``null``, while every lease answers ``"mps": null``)
and a lease state missing from the document are each refused, answer by answer.
"""

from __future__ import annotations

import copy
from typing import Any

from provisioner import wire

from .conformance import served_document
from .conftest import Broker

#: the lease answers the test below gets: acquire, GET one, the list, renew, release
LEASE_ANSWERS = 4


async def lease_round(broker: Broker) -> None:
    async with broker.client("alice") as c:
        r = await c.post("/leases", json={"kernel_id": "k-conf", "fraction": 0.1})
        assert r.status_code == 201, r.text
        lease = r.json()
        assert lease["mps"] is None and lease["enforcement"] == wire.COOPERATIVE
        assert (await c.get(f"/leases/{lease['id']}")).status_code == 200
        assert (await c.get("/leases")).json()["leases"][0]["id"] == lease["id"]
        assert (await c.post(f"/leases/{lease['id']}/renew", json={})).status_code == 200
        assert (await c.delete(f"/leases/{lease['id']}")).status_code in (200, 204)
        # an undocumented URL is not checked (the document does not describe it)
        assert (await c.get("/nope")).status_code == 404


def lease_schema(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["components"]["schemas"]["Lease"]["properties"])


async def test_the_served_document_passes_every_answer(broker: Broker) -> None:
    await lease_round(broker)
    checked, refused = broker.conformance.problems(served_document(broker.url))
    assert refused == []
    # the 404 of an unknown URL is not counted; the release is
    assert checked == LEASE_ANSWERS + 1 == len(broker.conformance.answers) - 1


async def test_a_drifted_document_is_refused(broker: Broker) -> None:
    await lease_round(broker)
    served = served_document(broker.url)

    # the document as it once was: mps nullable, but null not among its values
    drifted = copy.deepcopy(served)
    mps = drifted["components"]["schemas"]["Lease"]["properties"]["mps"]
    assert None in mps["enum"] and mps["nullable"] is True
    mps["enum"] = [v for v in mps["enum"] if v is not None]
    checked, refused = broker.conformance.problems(drifted)
    assert checked == LEASE_ANSWERS + 1
    assert len(refused) == LEASE_ANSWERS, refused
    assert all("mps" in line and "None is not one of" in line for line in refused), refused

    # a lease state the broker sends but the document does not list
    drifted = copy.deepcopy(served)
    state = drifted["components"]["schemas"]["Lease"]["properties"]["state"]
    assert state["enum"] == list(wire.LEASE_STATES)
    state["enum"] = [s for s in state["enum"] if s != "active"]
    _, refused = broker.conformance.problems(drifted)
    assert len(refused) == LEASE_ANSWERS, refused
    assert all("'active' is not one of" in line for line in refused), refused

    # a field the broker does not send, declared required
    drifted = copy.deepcopy(served)
    drifted["components"]["schemas"]["Lease"]["required"].append("gone_field")
    _, refused = broker.conformance.problems(drifted)
    assert len(refused) == LEASE_ANSWERS and all("gone_field" in line for line in refused)
