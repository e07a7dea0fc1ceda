"""deploy/kubernetes without a cluster: the manifests validate against the
Kubernetes API schemas (``kubernetes-validate``, strict: no unknown fields), and KubeSpawner's
own ``get_pod_manifest()`` with the z2jh fragment's profile yields a pod whose environment
carries what the provisioner needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from provisioner.kernel.placement import Placement, discover

kubernetes_validate = pytest.importorskip("kubernetes_validate")
kubespawner = pytest.importorskip("kubespawner")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
#: the Kubernetes version the manifests are written for (and validated against)
K8S = "1.30"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize("name", ["broker.yaml", "agent.yaml"])
def test_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    kinds = []
    for doc in docs(name):
        kubernetes_validate.validate(doc, K8S, strict=True)
        kinds.append(doc["kind"])
    assert kinds == (
        ["PersistentVolumeClaim", "Deployment", "Service"]
        if name == "broker.yaml"
        else ["DaemonSet"]
    )


def test_validation_is_not_a_rubber_stamp() -> None:
    (daemonset,) = docs("agent.yaml")
    daemonset["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: hostPID
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, K8S, strict=True)


def test_broker_agent_and_fragment_agree() -> None:
    """The names that tie the three files together are the same in each."""
    pvc, deployment, service = docs("broker.yaml")
    (daemonset,) = docs("agent.yaml")
    (z2jh,) = docs("z2jh-config.yaml")
    broker = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in broker["env"]}
    assert env["JUPYTERHUB_SERVICE_NAME"]["value"] == "gpu-lease"
    assert "--base-url=/services/gpu-lease/" in broker["command"]
    assert env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hub",
        "key": "hub.services.gpu-lease.apiToken",  # where z2jh keeps a service's token
    }
    port = service["spec"]["ports"][0]["port"]
    assert (
        z2jh["hub"]["services"]["gpu-lease"]["url"]
        == f"http://{service['metadata']['name']}:{port}"
    )
    agent = daemonset["spec"]["template"]["spec"]["containers"][0]
    agent_env = {e["name"]: e for e in agent["env"]}
    assert (
        agent_env["GPU_LEASE_URL"]["value"] == f"http://gpu-lease-broker:{port}/services/gpu-lease"
    )
    assert agent_env["GPU_LEASE_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the agents' tokens: the broker mounts agents.json, each agent its node's own key
    secret = "gpu-lease-agent-tokens"
    assert {
        v["secret"]["secretName"]
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    } == {secret}
    assert daemonset["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == secret
    assert (
        pvc["metadata"]["name"]
        == deployment["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"][
            "claimName"
        ]
    )


KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: none, user: {token: "not-a-real-token"}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""


async def test_kubespawner_pod_for_the_gpu_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """z2jh turns singleuser.extraEnv into KubeSpawner.environment and profileList into
    KubeSpawner.profile_list; the pod KubeSpawner makes for "Shared GPUs" runs on a GPU
    node, sees its GPUs and tells the provisioner its node and the broker's URL."""
    from kubernetes_asyncio.client import ApiClient
    from kubernetes_asyncio.config import kube_config
    from traitlets.config import Config

    # KubeSpawner loads a client configuration when it is made (no API call is made
    # here): a kubeconfig for a cluster that does not exist, as on a laptop
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))

    (z2jh,) = docs("z2jh-config.yaml")
    single = z2jh["singleuser"]
    config = Config()
    config.KubeSpawner.environment = single["extraEnv"]
    config.KubeSpawner.profile_list = single["profileList"]
    spawner = kubespawner.KubeSpawner(_mock=True, config=config)
    cpu = kubespawner.KubeSpawner(_mock=True, config=config)
    try:
        spawner.user_options = {"profile": "shared-gpus"}
        await spawner.load_user_options()
        cpu.user_options = {"profile": "cpu-only"}
        await cpu.load_user_options()
        async with ApiClient() as api:
            manifest = api.sanitize_for_serialization(await spawner.get_pod_manifest())
            plain = api.sanitize_for_serialization(await cpu.get_pod_manifest())
    finally:  # KubeSpawner's shared API client (made for a cluster we never call)
        await spawner.api.api_client.close()
    kubernetes_validate.validate(manifest, K8S, strict=True)
    spec = manifest["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["GPU_LEASE_URL"]["value"] == "http://proxy-public/services/gpu-lease"
    assert env["GPU_LEASE_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "nvidia.com/gpu" not in str(spec["containers"][0].get("resources"))  # shared
    # what the provisioner then reads in that pod on node gke-gpu-7f3a
    seen = {n: e.get("value", "") for n, e in env.items()}
    seen.update(GPU_LEASE_NODE="gke-gpu-7f3a", KUBERNETES_SERVICE_HOST="10.96.0.1")
    assert discover(seen) == Placement("gke-gpu-7f3a", node_from="GPU_LEASE_NODE")
    # the CPU profile: no GPU node, no runtime class
    kubernetes_validate.validate(plain, K8S, strict=True)
    assert "runtimeClassName" not in plain["spec"] and "nodeSelector" not in plain["spec"]
