"""The engines' remote kernels without the engines: the Slurm job's command line, address
and exit code rules (``kernel/slurm_kernel.py``, ``kernel/slurm_job.py``), and the
Kubernetes kernel pod and Secret (``kernel/k8s_kernel.py``), validated against the
Kubernetes API schemas as strictly as ``deploy/kubernetes`` (tests/test_kubernetes.py).
No cluster exists here. The real Slurm path is tests/test_slurm_kernel.py.

Two tests start an ipykernel (marked slow): the behaviour both engines lean on, that
ipykernel writes the ports it bound into a connection file that said 0 (Slurm), and leaves
alone one that already says what it bound (the pod's read-only Secret).
"""

from __future__ import annotations

import copy
import json
import os
import pwd
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import KernelConnectionInfo

from provisioner.client.answers import GrantedLease
from provisioner.devtools.testing import free_port, wait_for, write_private
from provisioner.errors import InvalidRequest
from provisioner.kernel import k8s_kernel
from provisioner.kernel.env import lease_environment
from provisioner.kernel.remote import CONNECTION_FILE, LaunchJob, remote_environment
from provisioner.kernel.slurm_job import (
    LaunchError,
    kernel_environment,
    read_ports,
    resolve_bind,
)
from provisioner.kernel.slurm_kernel import (
    SlurmSettings,
    command_env,
    exchange_directory,
    exit_code_of,
    sbatch_argv,
    shard_count,
    submit_prefix,
)

K8S = "1.30"
KEY = "3b4f9e0c-key-that-must-stay-secret"
UUID = "GPU-8a1b2c3d-0000-4000-8000-0123456789ab"


def job(**lease: Any) -> LaunchJob:
    granted = GrantedLease.from_json(
        {
            "id": "lease-1234abcd",
            "user": "ada",
            "kernel_id": "0f5c8f7e-1d2a-4b3c-9d8e-7f6a5b4c3d2e",
            "fraction": 0.25,
            "gpu": {"uuid": UUID, "node": "gpu07", "name": "T4", "memory_mb": 16384},
            "memory_limit_mb": 3584,
            **lease,
        }
    )
    return LaunchJob(
        kernel_id=str(granted.kernel_id),
        lease=granted,
        argv=("python3", "-m", "ipykernel_launcher", "-f", CONNECTION_FILE),
        env=remote_environment({"LANG": "C.UTF-8"}, {}, lease_environment(granted)),
        cwd="/home/ada/course",
        key=KEY,
    )


# -- Slurm ----------------------------------------------------------------------------


def test_the_sbatch_line_pins_the_node_exports_nothing_and_holds_no_key(tmp_path: Path) -> None:
    settings = SlurmSettings(python="/opt/env/bin/python", partition="gpu", sbatch_args=("-t1",))
    argv = sbatch_argv(
        settings, kernel_id=job().kernel_id, node="gpu07", fraction=0.25, directory=tmp_path
    )
    assert argv[0] == "sbatch" and "--parsable" in argv
    assert "--nodelist=gpu07" in argv and "--export=NONE" in argv
    assert "--partition=gpu" in argv and "-t1" in argv
    assert f"--error={tmp_path / 'slurm.err'}" in argv
    assert not any(a.startswith("--gres") for a in argv)  # shards off by default
    assert argv[-1] == f"--wrap=exec /opt/env/bin/python -m provisioner.kernel.slurm_job {tmp_path}"
    assert KEY not in " ".join(argv)


@pytest.mark.parametrize(
    ("fraction", "per_gpu", "shards"),
    [(0.25, 0, 0), (0.25, 8, 2), (0.3, 8, 3), (0.01, 8, 1), (1.0, 8, 8), (None, 8, 0)],
)
def test_the_shard_gres_follows_the_leases_share(
    fraction: float | None, per_gpu: int, shards: int
) -> None:
    assert shard_count(fraction, per_gpu) == shards
    argv = sbatch_argv(
        SlurmSettings(shards_per_gpu=per_gpu),
        kernel_id="k",
        node="n",
        fraction=fraction,
        directory=Path("/x"),
    )
    assert (f"--gres=shard:{shards}" in argv) == bool(shards)


def test_the_kernel_binds_to_the_address_the_setting_names() -> None:
    nodes = {"lo": ["127.0.0.1", "::1"], "eth0": ["fe80::1", "10.1.2.3"], "ib0": ["10.9.0.7"]}
    assert resolve_bind("127.0.0.1", nodes) == "127.0.0.1"
    assert resolve_bind("eth0", nodes) == "10.1.2.3"  # its first IPv4
    assert resolve_bind("ib*", nodes) == "10.9.0.7"
    assert resolve_bind("10.9.*", nodes) == "10.9.0.7"
    with pytest.raises(LaunchError, match="'192.168.*'.*set it to an interface"):
        resolve_bind("192.168.*", nodes)


def test_the_job_gives_the_kernel_only_the_accounts_basics_the_job_and_the_lease() -> None:
    account = pwd.getpwuid(os.getuid())
    own = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "gpu07", "JUPYTERHUB_API_TOKEN": "t", "X": "1"}
    env = kernel_environment(job().env, own, account, "/opt/env/bin:/usr/bin")
    assert env["SLURM_JOB_ID"] == "42" and env["SLURMD_NODENAME"] == "gpu07"
    assert env["CUDA_VISIBLE_DEVICES"] == UUID and env["LANG"] == "C.UTF-8"
    assert env["HOME"] == account.pw_dir and env["PATH"] == "/opt/env/bin:/usr/bin"
    assert "JUPYTERHUB_API_TOKEN" not in env and "X" not in env


def test_slurms_commands_are_not_steered_by_the_servers_own_job() -> None:
    server = {"SLURM_CONF": "/etc/slurm.conf", "SLURM_MEM_PER_NODE": "4000", "SBATCH_X": "1"}
    env = command_env(SlurmSettings(slurm_env={"A": "b"}), {**server, "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin", "A": "b"}


def test_who_submits_and_where_the_exchange_directory_is() -> None:
    me = pwd.getpwuid(os.getuid())
    assert submit_prefix(None) == [] and submit_prefix(me.pw_name) == []
    assert submit_prefix("ada") == ["sudo", "-E", "-u", "ada"]
    where = exchange_directory(SlurmSettings(), me, "abc-1")
    assert where == Path(me.pw_dir) / ".gpu-lease" / "slurm-kernels" / "abc-1"
    for bad in ("../etc", ".x", "a/b", ""):
        with pytest.raises(InvalidRequest):
            exchange_directory(SlurmSettings(), me, bad)


@pytest.mark.parametrize(
    ("state", "code", "expected"),
    [
        ("COMPLETED", "0:0", 0),
        ("FAILED", "3:0", 3),
        ("FAILED", "0:9", -9),
        ("CANCELLED", "0:15", -15),
        ("CANCELLED by 0", "0:0", -9),
        ("FAILED", "0:0", 1),
        ("", "", 1),
    ],
)
def test_a_finished_jobs_exit_code(state: str, code: str, expected: int) -> None:
    assert exit_code_of(state, code) == expected


# -- ipykernel's connection file, which both engines lean on -----------------------------


def _ipykernel(connection: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", str(connection)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_ipykernel_writes_the_ports_it_bound_into_a_file_that_said_0(tmp_path: Path) -> None:
    connection = tmp_path / "kernel.json"
    info = k8s_kernel.connection_file(job(), dict.fromkeys(k8s_kernel.DEFAULT_PORTS, 0))
    write_private(connection, json.dumps({**info, "ip": "127.0.0.1"}))
    proc = _ipykernel(connection)
    try:
        wait_for(lambda: read_ports(connection) is not None, 30, "the ports")
        ports = read_ports(connection)
        assert ports is not None and len(set(ports.values())) == 5
        assert json.loads(connection.read_text())["key"] == KEY
    finally:
        _stop(proc)


@pytest.mark.slow
def test_ipykernel_leaves_a_file_that_says_its_ports_alone(tmp_path: Path) -> None:
    """The pod's connection file is a read-only Secret: ipykernel must not write it."""
    connection = tmp_path / "kernel.json"
    ports = {name: free_port() for name in k8s_kernel.DEFAULT_PORTS}
    write_private(connection, json.dumps(k8s_kernel.connection_file(job(), ports)))
    before = connection.stat().st_mtime_ns, connection.read_bytes()
    proc = _ipykernel(connection)
    kc = BlockingKernelClient()
    kc.load_connection_info(cast(KernelConnectionInfo, {**json.loads(connection.read_text())}))
    kc.start_channels()
    try:
        # it answers once initialize() is done, which is where it would have written
        kc.wait_for_ready(timeout=30)
        assert (connection.stat().st_mtime_ns, connection.read_bytes()) == before
    finally:
        kc.stop_channels()
        kc.context.destroy(linger=0)  # not left to the garbage collector (its warning)
        _stop(proc)


# -- Kubernetes ------------------------------------------------------------------------


def validator() -> Any:
    """``kubernetes_validate`` (make install installs it), asked for by the tests that
    validate: the others need nothing but this package."""
    return pytest.importorskip("kubernetes_validate")


def pod() -> dict[str, Any]:
    return k8s_kernel.kernel_pod(
        job(),
        image="registry.example.org/course/notebook:2025",
        namespace="jhub",
        uid=1001,
        gid=100,
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )


def test_the_kernel_pod_and_its_secret_validate_strictly() -> None:
    kubernetes_validate = validator()
    kubernetes_validate.validate(pod(), K8S, strict=True)
    kubernetes_validate.validate(
        k8s_kernel.kernel_secret(job(), namespace="jhub"), K8S, strict=True
    )


@pytest.mark.parametrize(
    "spoil",
    [
        lambda p: p["spec"]["securityContext"].update(runAsNonroot=True),  # misspelt
        lambda p: p["spec"]["containers"][0]["ports"][0].update(containerPort="52700"),
        lambda p: p["spec"].update(restartPolicy=None, nodename="gpu07"),
    ],
)
def test_the_pods_validation_is_not_a_rubber_stamp(spoil: Any) -> None:
    kubernetes_validate = validator()
    spoilt = copy.deepcopy(pod())
    spoil(spoilt)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(spoilt, K8S, strict=True)


def test_the_kernel_pod_runs_as_the_student_on_the_leases_node_with_its_gpu() -> None:
    p = pod()
    spec = p["spec"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == {
        "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu07"]}]
    }
    assert "nodeName" not in spec  # through the scheduler: see k8s_kernel's docstring
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert (
        spec["securityContext"]["runAsUser"] == 1001 and spec["securityContext"]["fsGroup"] == 100
    )
    (c,) = spec["containers"]
    assert c["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1001,
        "runAsGroup": 100,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == UUID == env["CUDA_VISIBLE_DEVICES"]
    assert env["GPU_LEASE_MEMORY_MB"] == "3584"
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])  # the device plugin's unit
    assert spec["runtimeClassName"] == "nvidia"
    assert {x["name"]: x["containerPort"] for x in c["ports"]} == {
        "shell": 52700, "iopub": 52701, "stdin": 52702, "control": 52703, "hb": 52704,
    }  # fmt: skip
    assert c["command"][-1] == "/var/run/gpu-lease/kernel.json"
    labels = p["metadata"]["labels"]
    assert labels[k8s_kernel.KERNEL_LABEL] == job().kernel_id
    assert labels[k8s_kernel.LEASE_LABEL] == "lease-1234abcd"


def test_the_key_is_in_the_secret_never_in_the_pod() -> None:
    p, secret = pod(), k8s_kernel.kernel_secret(job(), namespace="jhub")
    assert KEY not in json.dumps(p)
    assert json.loads(secret["stringData"]["kernel.json"])["key"] == KEY
    (volume,) = [v for v in p["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"] == p["metadata"]["name"]


def test_a_pod_is_refused_as_root_or_without_a_node() -> None:
    with pytest.raises(InvalidRequest, match="not 0:0"):
        k8s_kernel.kernel_pod(job(), image="i", namespace="n", uid=0, gid=0)
    with pytest.raises(InvalidRequest, match="names no node"):
        k8s_kernel.kernel_pod(job(gpu={"uuid": UUID}), image="i", namespace="n", uid=1000, gid=100)


def test_the_servers_rights_and_the_kernels_network_policy_validate_and_fit_the_pod() -> None:
    kubernetes_validate = validator()
    path = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "kernels.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S, strict=True)
    kinds = {d["kind"]: d for d in docs}
    assert list(kinds) == ["Namespace", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"]
    assert kinds["Namespace"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
        "restricted"
    )
    rights = {r["resources"][0]: set(r["verbs"]) for r in kinds["Role"]["rules"]}
    assert rights["pods"] >= {"create", "delete", "get"} and "get" not in rights["secrets"]
    policy = kinds["NetworkPolicy"]["spec"]
    p = pod()
    selected = policy["podSelector"]["matchLabels"].items()
    assert selected <= p["metadata"]["labels"].items()
    (rule,) = policy["ingress"]
    (port,) = rule["ports"]
    declared = [x["containerPort"] for x in p["spec"]["containers"][0]["ports"]]
    assert [port["port"], port["endPort"]] == [min(declared), max(declared)]
