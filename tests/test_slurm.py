"""The Slurm variant for real: a Slurm cluster on this machine (``slurmctld`` and
two ``slurmd -N node1|node2``, Debian's slurm-wlm), JupyterHub with batchspawner's
SlurmSpawner (``hub_config`` with ``GPU_LEASE_SPAWNER=slurm``), the broker as hub service
with the pool the node agents register, and one agent per node with a declared T4.

The hub runs as root and submits each job as its student's own Unix account (batchspawner's
``sudo -E -u USER sbatch``; Debian's sudo), as an HPC site does: the test makes three
accounts (``useradd``, a random suffix, homes 0700; removed at the end after their jobs
and processes are gone) and checks by uid in ``/proc`` that each job's processes, its
server and its kernels are the student's, in runtime and temporary directories of the
student's alone (0700); a hub user with no account gets no job, and a message saying
what to do. Where students cannot run this Python, everything runs on the
environment tests/accounts.py builds.

Students' servers run as Slurm jobs on both nodes; every lease is on a GPU of its kernel's
node; a request bound to a full node says the other has room; node2's slurmd, jobs and
agent killed -> node2 lost and its lease ends within 2 x TTL, node1 unaffected; Ctrl-C of
the hub and the cluster's stop leave no process and no lease.
"""

from __future__ import annotations

import concurrent.futures
import pwd
import secrets
import signal
import stat
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

from .accounts import courses, ids, needs_root, passable_dir, student_python, useradd, userdel
from .test_hub import TTL, Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(600)]

NODE_GRACE = 3.0


class Site:
    def __init__(
        self, hub: Hub, cluster: SlurmCluster, tmp: Path, students: list[str], python: str
    ) -> None:
        self.hub, self.cluster, self.tmp = hub, cluster, tmp
        self.students = students  # Unix accounts, made by the test
        self.python = python  # the hub's, and the jobs'
        self.ghost = ""  # a hub user with no Unix account
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

    def job_processes(self, user: str) -> dict[str, list[psutil.Process]]:
        """node -> the processes of ``user``'s Slurm job there (its environment names the
        user: the batch script, srun, the server, its kernels)."""
        found: dict[str, list[psutil.Process]] = {}
        for node in self.cluster.nodes:
            for p in self.cluster.jobs_on(node):
                try:
                    if p.environ().get("JUPYTERHUB_USER") == user:
                        found.setdefault(node, []).append(p)
                except psutil.Error:
                    continue
        return found

    def node_of(self, user: str) -> str:
        """The node whose Slurm job runs ``user``'s server (from the job's processes)."""
        nodes = list(self.job_processes(user))
        assert nodes, f"no Slurm job runs {user}'s server"
        return nodes[0]

    def lease_node(self, user: str, kernel_id: str) -> str:
        (lease,) = [x for x in self.hub.leases(user) if x["kernel_id"] == kernel_id]
        return self.gpu_nodes()[lease["gpu"]["uuid"]]


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    why = slurmcluster.available()
    if why:
        pytest.skip(why)
    needs_root("sudo")  # the hub submits as each student: sudo -E -u STUDENT sbatch
    suffix = secrets.token_hex(3)
    students = [f"gls{n}-{suffix}" for n in (1, 2, 3)]
    ghost = f"glsx-{suffix}"  # in the course, with no Unix account
    made: list[str] = []
    with passable_dir("gpu-lease-slurm-") as tmp:
        cluster = SlurmCluster(tmp / "slurm")
        try:
            for name in students:
                useradd(name)
                made.append(name)
            python = student_python(tmp, students[0])
            courses(tmp / "courses.toml", [*students, ghost])
            cluster.start()
            tokens = agent_tokens(tmp / "agents.json", cluster.nodes)
            env = {
                **cluster.hub_env(tmp / "agents.json"),
                "GPU_LEASE_NODE_GRACE": str(NODE_GRACE),
                "GPU_LEASE_COURSES": str(tmp / "courses.toml"),
            }
            with running_hub(tmp, env=env, gpus="agents", python=python) as hub:
                s = Site(hub, cluster, tmp, students, python)
                s.ghost = ghost
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
                    for user in students:  # the course's 0.05 a kernel: these may take 0.5
                        r = hub.req(
                            "PUT",
                            f"{hub.broker}/api/v1/quotas/users/{user}",
                            json={
                                "max_lease_fraction": 0.5,
                                "max_leases": 4,
                                "max_fraction": 1.0,
                            },
                        )
                        assert r.status_code == 200, r.text
                    yield s
                finally:
                    for agent in s.agents.values():
                        if agent.poll() is None:
                            agent.send_signal(signal.SIGTERM)
                            agent.wait(20)
        finally:
            cluster.stop()  # every job cancelled, what is left of them killed
            for name in made:
                userdel(name)


def _owner_mode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_uid, stat.S_IMODE(st.st_mode) & 0o777  # jupyter_core adds the sticky bit


def assert_runs_as_its_student(site: Site, user: str, kernel_id: str) -> None:
    """Every process of ``user``'s job, its server and the kernel ``kernel_id`` run as the
    student's account; its runtime and temporary directories are the account's, 0700."""
    account = pwd.getpwnam(user)
    (procs,) = site.job_processes(user).values()
    assert {p.pid: ids(p.pid) for p in procs} == {p.pid: {account.pw_uid} for p in procs}
    (kernel,) = [p for p in procs if any(kernel_id in a for a in p.cmdline())]
    server = kernel.parent()  # batchspawner-singleuser, running jupyterhub-singleuser
    assert server is not None and server in procs, [p.cmdline() for p in procs]
    assert "batchspawner-singleuser" in " ".join(server.cmdline()), server.cmdline()
    assert ids(server.pid) == ids(kernel.pid) == {account.pw_uid}
    env = kernel.environ()
    assert env["USER"] == user and env["HOME"] == account.pw_dir
    for var in ("JUPYTER_RUNTIME_DIR", "TMPDIR"):
        folder = Path(env[var])
        assert folder.name == str(account.pw_uid), (var, folder)
        assert _owner_mode(folder) == (account.pw_uid, 0o700), (var, folder)
    connection = Path(env["JUPYTER_RUNTIME_DIR"]) / f"kernel-{kernel_id}.json"
    assert _owner_mode(connection) == (account.pw_uid, 0o600)
    # the hub's sudo resets PATH to its secure_path: the job script sets the hub's back
    # (gpu-lease and the environment's commands first, as for a server the hub starts)
    assert env["PATH"].split(":")[0] == str(Path(site.python).parent), env["PATH"]


def test_servers_are_slurm_jobs_and_kernels_lease_on_their_node(site: Site) -> None:
    hub = site.hub
    students = site.students
    with concurrent.futures.ThreadPoolExecutor(len(students)) as pool:
        for done in [pool.submit(hub.spawn, user) for user in students]:
            done.result()
    where = {user: site.node_of(user) for user in students}
    # two CPUs a node, one a job: three servers need both nodes
    assert set(where.values()) == {"node1", "node2"}, where
    alone = next(u for u in students if list(where.values()).count(where[u]) == 1)
    pair = [u for u in students if u != alone]
    full_node, other_node = where[pair[0]], where[alone]
    # the student alone on a node leases half its T4 first; best fit without a node would
    # then put the next 0.5 there too: each lease must land on its own server's node
    kernels = {}
    for user in (alone, *pair):
        r = hub.start_kernel(user, "python3-gpu-0.5")
        assert r.status_code == 201, (user, r.text, hub.log())
        kernels[user] = r.json()["id"]
        assert site.lease_node(user, kernels[user]) == where[user], (user, where)
        assert_runs_as_its_student(site, user, kernels[user])
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


def test_a_user_without_an_account_gets_no_job_and_is_told_why(site: Site) -> None:
    hub, user = site.hub, site.ghost
    r = hub.req("POST", f"{hub.url}/hub/api/users/{user}/server", hub.token(user))

    def settled() -> bool:
        model = hub.req("GET", f"{hub.url}/hub/api/users/{user}").json()
        return not model.get("pending")

    wait_for(settled, 60, f"{user}'s spawn to end", 0.3, hub.log)
    model = hub.req("GET", f"{hub.url}/hub/api/users/{user}").json()
    assert not model.get("servers"), model
    said = f"{user} has no Unix account on the hub's host"
    assert said in r.text or said in hub.log(), (r.status_code, r.text, hub.log())
    assert "GPU_LEASE_SLURM_SUBMIT_AS_HUB=1" in hub.log()
    assert not site.job_processes(user)
    queued = site.cluster.queued_users()
    assert queued and user not in queued, queued  # no job was submitted for it


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
