"""The Slurm variant for real (issue 15): a Slurm cluster on this machine (``slurmctld`` and
two ``slurmd -N node1|node2``, Debian's slurm-wlm), JupyterHub with batchspawner's
SlurmSpawner (``hub_config`` with ``GPU_LEASE_SPAWNER=slurm``), the broker as hub service
with the pool the node agents register, and one agent per node with a declared T4.

Students' servers run as Slurm jobs on both nodes; every lease is on a GPU of its kernel's
node; a request bound to a full node says the other has room; node2's slurmd, jobs and
agent killed -> node2 lost and its lease ends within 2 x TTL, node1 unaffected; Ctrl-C of
the hub and the cluster's stop leave no process and no lease.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from provisioner.devtools import slurmcluster
from provisioner.devtools.slurmcluster import SlurmCluster, agent_tokens, start_agent
from provisioner.devtools.testing import wait_for

from .test_hub import TTL, Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(600)]

NODE_GRACE = 3.0
STUDENTS = ("student01", "student02", "student03")


class Site:
    def __init__(self, hub: Hub, cluster: SlurmCluster, tmp: Path) -> None:
        self.hub, self.cluster, self.tmp = hub, cluster, tmp
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def start_agent(self, node: str, token: str) -> None:
        log = self.tmp / f"agent-{node}.log"
        self.agents[node] = start_agent(self.hub.broker, node, token, "1x16384:T4", log)

    def nodes(self) -> dict[str, dict[str, Any]]:
        r = self.hub.req("GET", f"{self.hub.broker}/api/v1/nodes")
        assert r.status_code == 200, r.text
        return {n["node"]: n for n in r.json()["nodes"]}

    def gpu_nodes(self) -> dict[str, str]:
        """GPU uuid -> its node, from the broker's pool."""
        r = self.hub.req("GET", f"{self.hub.broker}/api/v1/gpus")
        return {g["uuid"]: g["node"] for g in r.json()["gpus"]}

    def node_of(self, user: str) -> str:
        """The node whose Slurm job runs ``user``'s server (from the job's processes)."""
        for node in self.cluster.nodes:
            for p in self.cluster.jobs_on(node):
                try:
                    if p.environ().get("JUPYTERHUB_USER") == user:
                        return node
                except psutil.Error:
                    continue
        raise AssertionError(f"no Slurm job runs {user}'s server")

    def lease_node(self, user: str, kernel_id: str) -> str:
        (lease,) = [x for x in self.hub.leases(user) if x["kernel_id"] == kernel_id]
        return self.gpu_nodes()[lease["gpu"]["uuid"]]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    why = slurmcluster.available()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    tmp = tmp_path_factory.mktemp("site")
    tokens = agent_tokens(tmp / "agents.json", cluster.nodes)
    env = {**cluster.hub_env(tmp / "agents.json"), "GPU_LEASE_NODE_GRACE": str(NODE_GRACE)}
    try:
        with running_hub(tmp, env=env, gpus="agents") as hub:
            s = Site(hub, cluster, tmp)
            try:
                for node, token in tokens.items():
                    s.start_agent(node, token)
                wait_for(
                    lambda: (
                        {n: x["state"] for n, x in s.nodes().items()}
                        == dict.fromkeys(cluster.nodes, "up")
                    ),
                    30,
                    "both nodes registered",
                )
                for user in STUDENTS:  # ml101's 0.05 a kernel: these students may take 0.5
                    r = hub.req(
                        "PUT",
                        f"{hub.broker}/api/v1/quotas/users/{user}",
                        json={"max_lease_fraction": 0.5, "max_leases": 4, "max_fraction": 1.0},
                    )
                    assert r.status_code == 200, r.text
                yield s
            finally:
                for agent in s.agents.values():
                    if agent.poll() is None:
                        agent.send_signal(signal.SIGTERM)
                        agent.wait(20)
    finally:
        cluster.stop()


def test_servers_are_slurm_jobs_and_kernels_lease_on_their_node(site: Site) -> None:
    hub = site.hub
    with concurrent.futures.ThreadPoolExecutor(len(STUDENTS)) as pool:
        for done in [pool.submit(hub.spawn, user) for user in STUDENTS]:
            done.result()
    where = {user: site.node_of(user) for user in STUDENTS}
    # two CPUs a node, one a job: three servers need both nodes
    assert set(where.values()) == {"node1", "node2"}, where
    alone = next(u for u in STUDENTS if list(where.values()).count(where[u]) == 1)
    pair = [u for u in STUDENTS if u != alone]
    full_node, other_node = where[pair[0]], where[alone]
    # the student alone on a node leases half its T4 first; best fit without a node would
    # then put the next 0.5 there too: each lease must land on its own server's node
    kernels = {}
    for user in (alone, *pair):
        r = hub.start_kernel(user, "python3-gpu-0.5")
        assert r.status_code == 201, (user, r.text, hub.log())
        kernels[user] = r.json()["id"]
        assert site.lease_node(user, kernels[user]) == where[user], (user, where)
    # full_node is full, other_node has room: a request bound to full_node says so
    token = hub.token(pair[0])
    r = hub.req(
        "POST",
        f"{hub.broker}/api/v1/leases",
        token,
        json={"kernel_id": "one-more", "fraction": 0.5, "node": full_node},
    )
    assert r.status_code == 202, r.text
    reason = r.json()["reason"]
    assert f"Node {other_node} has room, but your server runs on node {full_node}" in reason
    assert (
        hub.req("DELETE", f"{hub.broker}/api/v1/leases/{r.json()['id']}", token).status_code == 204
    )

    # node of the lone student dies with its jobs and its agent
    site.cluster.kill_node(other_node)
    site.agents[other_node].kill()
    site.agents[other_node].wait()
    t0 = time.monotonic()
    wait_for(lambda: site.nodes()[other_node]["state"] == "lost", 4 * NODE_GRACE, "node lost")
    wait_for(lambda: not hub.leases(alone), 3 * TTL, f"{alone}'s lease to end", 0.2, hub.log)
    took = time.monotonic() - t0
    assert took <= 2 * TTL, f"the lease outlived its node by {took:.1f} s"
    # full_node is unaffected: a kernel ends and a new one starts there
    user = pair[0]
    r = hub.req("DELETE", f"{hub.url}/user/{user}/api/kernels/{kernels[user]}", hub.token(user))
    assert r.status_code == 204, r.text
    wait_for(lambda: len(hub.leases(user)) == 0, 30, "the release")
    r = hub.start_kernel(user, "python3-gpu-0.5")
    assert r.status_code == 201, r.text
    assert site.lease_node(user, r.json()["id"]) == full_node


def test_everything_stops_with_no_process_left(site: Site) -> None:
    hub, cluster = site.hub, site.cluster
    for agent in site.agents.values():
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(20) == 0
    procs = psutil.Process(hub.proc.pid).children(recursive=True)
    assert hub.stop(signal.SIGINT) == 0, hub.log()
    wait_for(
        lambda: not any(cluster.jobs_on(n) for n in cluster.nodes),
        60,
        "every job's processes to end",
    )
    cluster.stop()
    left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], left
    assert hub.active_in_database() == []
