"""Remote kernels across machines: network namespaces as the machines (``tests/netns.py``).

The *head* namespace has the broker and the student's server (this test's kernel manager,
or a server process the test kills); each GPU node is a namespace of its own with its
agent (``--launch-kernels``, stand-in NVML) and its own address, joined to the head by a
link of its own. Kernels listen on their node's address; the server reaches them over
that link only. Students are real Unix accounts (``useradd``).

Each test breaks one thing on purpose: the placement (the lease on whichever node has
room), the link between server and node (cut: the node ends the kernel at its lease's
expiry), the server (``kill -9``: its lease expires, the node ends its kernel), and an
agent that reports another node's lease (403).
"""

from __future__ import annotations

import json
import pwd
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from jupyter_client.manager import AsyncKernelManager

from provisioner.devtools.testing import execute, wait_for, wait_for_async

from .netns import Cluster, needs_netns
from .test_remote_kernels import (
    TTL,
    Site,
    accounts,
    alive,
    interrupt_a_sleeping_cell,
    pids_of,
    probe,
)

__all__ = ["accounts"]  # the module's fixture, shared

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODES = ("n1", "n2")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    needs_netns()
    made = Cluster(list(NODES)).up()
    try:
        yield made
    finally:
        made.down()


@pytest.fixture
def site(
    tmp_path: Path,
    accounts: tuple[list[str], str, Path],
    cluster: Cluster,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Site]:
    """The broker in the head (on every link), an agent in each node; the test's thread
    stays in the head for the whole test."""
    names, python, base = accounts
    node_root = base / f"nodes-{uuid.uuid4().hex[:6]}"
    node_root.mkdir(mode=0o711)
    s = Site(tmp_path, names, python, node_root, NODES, ("--ip", "0.0.0.0", "--gpus", "agents"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    with cluster.inside("head"), s.broker.running(timeout=60):
        monkeypatch.setenv("GPU_LEASE_URL", s.broker.url)
        monkeypatch.setenv("GPU_LEASE_TOKEN", s.broker.tokens[names[0]])
        try:
            for node in NODES:
                head_ip, node_ip = cluster.link[node]
                with cluster.inside(node):
                    s.start_agent(node, url=f"http://{head_ip}:{s.broker.port}", ip=node_ip)
            for node in NODES:
                s.wait_registered(node)
            yield s
        finally:
            for node in NODES:
                s.kill_agent(node)
            s.kill_students()


async def start(site: Site, name: str, **config: object) -> AsyncKernelManager:
    km = AsyncKernelManager(kernel_name=site.spec(name, **{"node": None, **config}))
    await km.start_kernel()
    return km


def node_of(cluster: Cluster, ip: str) -> str:
    return next(n for n, (_, node_ip) in cluster.link.items() if node_ip == ip)


async def test_a_kernel_on_another_node_runs_interrupts_restarts_and_ends(
    site: Site, cluster: Cluster
) -> None:
    """The lease lands on a node (no node asked); the server in the head talks to the
    kernel at that node's address; interrupt, restart (same lease) and shutdown (released,
    the process gone) work across the link."""
    km = await start(site, "remote-any")
    try:
        node = node_of(cluster, km.ip)
        assert km.ip == cluster.link[node][1] and node in NODES
        facts = await probe(km)
        assert facts["node"] == node and facts["cuda"] == site.gpus[node]
        assert facts["uid"] == pwd.getpwnam(site.students[0]).pw_uid
        lease_id = km.provisioner.lease_keeper.lease.id  # type: ignore[union-attr]
        reply, _ = await interrupt_a_sleeping_cell(km)
        assert reply["ename"] == "KeyboardInterrupt", reply
        await km.restart_kernel(now=True)
        assert km.provisioner.lease_keeper.lease.id == lease_id  # type: ignore[union-attr]
        pid = (await probe(km))["pid"]
    finally:
        await km.shutdown_kernel()
    await wait_for_async(lambda: not alive(pid), timeout=15)
    with site.api("admin") as c:
        assert c.get(f"/leases/{lease_id}").json()["state"] == "released"


async def test_a_cut_link_ends_the_kernel_at_its_leases_expiry(
    site: Site, cluster: Cluster
) -> None:
    """The link between the head and the kernel's node goes down: the node can reach
    neither the broker nor the server; its agent ends the kernel once the lease's last
    known expiry has passed. Once the link is back nothing is left: no process of the
    student's, no active lease after the server shuts the kernel down."""
    km = await start(site, "remote-n1", node="n1")
    pid = (await probe(km))["pid"]
    cluster.cut("n1")
    t0 = time.monotonic()
    try:
        await wait_for_async(lambda: not alive(pid), timeout=TTL + 20)
        ended_after = time.monotonic() - t0
        assert ended_after <= TTL + 15, ended_after
    finally:
        cluster.cut("n1", up=True)
    await km.shutdown_kernel(now=True)
    site.wait_registered("n1")
    with site.api("admin") as c:
        await wait_for_async(
            lambda: not [
                x for x in c.get("/leases", params={"all": "1"}).json()["leases"]
                if x["state"] == "active"
            ],
            timeout=TTL + 10,
        )  # fmt: skip
    assert "its lease expired" in site.agent_log("n1").read_text()


SERVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from jupyter_client.manager import AsyncKernelManager

    async def main():
        km = AsyncKernelManager(kernel_name=sys.argv[1])
        await km.start_kernel()
        lease = km.provisioner.lease_keeper.lease
        kc = km.client(); kc.start_channels(); await kc.wait_for_ready(timeout=60)
        pids = []
        await kc.execute_interactive(
            "import os; print(os.getpid())", timeout=60,
            output_hook=lambda m: pids.extend(m["content"].get("text", "").split()),
        )
        print(json.dumps({"lease": lease.id, "pid": int(next(p for p in pids if p.isdigit()))}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def test_a_killed_server_leaves_no_kernel_past_its_lease(
    site: Site, cluster: Cluster, tmp_path: Path
) -> None:
    """kill -9 of the student's server: nobody renews the lease, it expires, and the node
    ends the kernel within a TTL and a few heartbeats."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    name = site.spec("remote-n2", node="n2")
    err = tmp_path / "server.log"
    with open(err, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, str(script), name], stdout=subprocess.PIPE, stderr=log
        )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line, err.read_text()
        started = json.loads(line)
        lease_id = started["lease"]
        kernels = pids_of(pwd.getpwnam(site.students[0]).pw_uid)
        assert started["pid"] in kernels
        server.kill()
        server.wait()
        t0 = time.monotonic()
        wait_for(lambda: not any(alive(p) for p in kernels), timeout=2 * TTL + 20)
        assert time.monotonic() - t0 <= 2 * TTL + 10
        with site.api("admin") as c:
            assert c.get(f"/leases/{lease_id}").json()["state"] == "expired"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        assert server.stdout is not None
        server.stdout.close()


async def test_an_agent_cannot_report_another_nodes_kernel(site: Site, cluster: Cluster) -> None:
    """n2's agent token reports a kernel of n1's lease: 403, logged, nothing changes."""
    km = await start(site, "remote-n1b", node="n1")
    try:
        lease_id = km.provisioner.lease_keeper.lease.id  # type: ignore[union-attr]
        token = site.agent_tokens["n2"]
        body = {
            "usage": [],
            "launches_kernels": True,
            "remote_kernels": [
                {"lease_id": lease_id, "generation": 9, "state": "exited", "exit_code": 0}
            ],
        }
        async with httpx.AsyncClient(headers={"Authorization": f"token {token}"}) as agent:
            r = await agent.post(f"{site.broker.url}/api/v1/nodes/n2/heartbeat", json=body)
        assert r.status_code == 403, r.text
        with site.api("admin") as c:
            kernel = c.get(f"/leases/{lease_id}/kernel").json()
        assert kernel["state"] == "running" and kernel["generation"] == 1
        out, reply = await execute(km, "print(6 * 7)")
        assert reply["status"] == "ok" and "42" in out
    finally:
        await km.shutdown_kernel(now=True)
    log = "\n".join(p.read_text(errors="replace") for p in site.broker.logs())
    assert "not on it: refused" in log
