"""An acquire's ``mps_uid`` is a claim, and a made-up one blocks nobody
for longer than the claim window, against a REAL broker subprocess (``conftest.broker``).

The attack as a student mounts it with nothing but their own token: s001 (``alice``) takes
0.02 on each GPU with ``"mps_uid": 4242`` (no such account runs anything) and keeps
renewing; s002 (``bob``) then asks for an ``enforcement=mps`` kernel. Before the claim window the
broker believed the claim for as long as the leases lived: s002 waited ("The MPS servers of
GPU 0 (V100) and GPU 1 (V100) are serving another user's kernels") with the pool nearly
empty. Now a GPU's MPS owners are the uid its agent reports its server serving and the
uids of proven kernels; a lease's own claim counts for others only during
``node_rules.mps_claim_window`` after its grant (TTL/3 + node_grace: 2 + 3 s here), so an
honest kernel that has not touched CUDA yet is not joined by another user's, and a lying
one delays s002 by at most that window.

The pure rule is tabled in ``tests/test_scheduling.py`` (``mps_owners``).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from .conftest import Broker

pytestmark = pytest.mark.slow

FAKE_UID, S002_UID = 4242, 1001
#: --ttl 6 and node_grace 3: the claim window is 6/3 + 3 = 5 s
WINDOW = 5.0
REASON = "are serving another user's kernels"


@pytest.mark.broker_args(
    "--gpus",
    "2x32768:V100",
    "--ttl",
    "6",
    "--GPULeaseBroker.node_grace=3",
    "--GPULeaseBroker.reap_interval=0.2",
)
async def test_a_made_up_mps_uid_on_every_gpu_blocks_another_student_only_for_the_window(
    broker: Broker,
) -> None:
    async with broker.client("alice") as s001, broker.client("bob") as s002:
        gpus = [g["uuid"] for g in (await s002.get("/gpus")).json()["gpus"]]
        assert len(gpus) == 2
        leases = []
        for i, gpu in enumerate(gpus):
            r = await s001.post(
                "/leases",
                json={
                    "kernel_id": f"squat-{i}",
                    "fraction": 0.02,
                    "gpu_uuids": [gpu],
                    "mps_uid": FAKE_UID,
                },
            )
            assert r.status_code == 201, r.text
            leases.append(r.json()["id"])
        granted_at = time.monotonic()

        async def keep_renewing() -> None:
            while True:
                for lease_id in leases:
                    r = await s001.post(f"/leases/{lease_id}/renew", json={})
                    assert r.status_code == 200, r.text
                await asyncio.sleep(1.0)

        renewer = asyncio.ensure_future(keep_renewing())
        try:
            # within the window the claim holds (an honest kernel may not have touched CUDA
            # yet): s002's MPS kernel waits, with the reason, never naming who
            ask = {"kernel_id": "victim", "fraction": 0.25, "mps_uid": S002_UID}
            first = await s002.post("/leases", json=ask)
            assert first.status_code == 202, first.text
            reason = first.json()["reason"]
            assert reason.startswith(f"The MPS servers of GPU 0 (V100) and GPU 1 (V100) {REASON}")
            assert str(FAKE_UID) not in reason and "alice" not in reason
            # past the window the made-up uid holds nothing: s002 is granted
            deadline = granted_at + WINDOW + 10.0
            answer = first
            while answer.status_code == 202 and time.monotonic() < deadline:
                answer = await s002.post("/leases", json={**ask, "wait": 2})
            assert answer.status_code in (200, 201), (
                f"s002 still waits {time.monotonic() - granted_at:.0f} s after s001's made-up "
                f"MPS uid was granted: {answer.text}"
            )
            waited = time.monotonic() - granted_at
            assert waited >= WINDOW - 0.5, f"granted after {waited:.1f} s, inside the window"
            assert answer.json()["mps_uid"] == S002_UID
            # s001 is not punished: its leases still stand, only its claim stopped counting
            for lease_id in leases:
                r = await s001.get(f"/leases/{lease_id}")
                assert r.status_code == 200 and r.json()["state"] == "active", r.text
        finally:
            renewer.cancel()
            try:
                await renewer
            except asyncio.CancelledError:
                pass
