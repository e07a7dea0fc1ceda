"""The launcher offers each user only the GPU kernels the broker would let them start.

Table tests of the pure rule (:func:`provisioner.kernel.offered.never_startable`,
:func:`~provisioner.kernel.offered.offered`), then real ``jupyter server`` processes (one
per user, each with that user's broker token, as a hub spawns them) in front of a real
broker subprocess: ``GET /api/kernelspecs`` -- what JupyterLab's launcher shows -- lists
what the user's course and quota allow, an admin sees every kernel, and a start forced by
name is still refused by the broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from provisioner.devtools.testing import free_port, stop_process, wait_for_http
from provisioner.kernel import kernelspecs as ks
from provisioner.kernel.offered import never_startable, offered

from .conftest import ROOT, Broker

ME = {
    "user": "alice",
    "groups": ["ml101"],
    "admin": False,
    "effective": {"max_fraction": 0.2, "max_leases": 2, "max_lease_fraction": 0.1},
}


@pytest.mark.parametrize(
    "spec, me, why",
    [
        (ks.build_kernelspec(0.05), ME, None),
        (ks.build_kernelspec(0.1), ME, None),
        (ks.build_kernelspec(0.25), ME, "above your per-kernel limit"),
        (ks.build_kernelspec(0.05, group="ml101"), ME, None),
        (ks.build_kernelspec(0.05, group="cs50"), ME, "for course cs50 only"),
        (ks.build_kernelspec(0.05, group="cs50"), {**ME, "admin": True}, None),
        (ks.build_kernelspec(0.1), {**ME, "effective": {"max_fraction": 0.05}},
         "above your GPU limit"),
        (ks.build_kernelspec(0.02), {**ME, "effective": {"max_leases": 0}},
         "your quota allows no GPU kernels"),
        (ks.build_kernelspec(0.02), {**ME, "effective": {"budget_fraction_hours": 0}},
         "your quota allows no GPU time"),
        # held kernels end, budgets renew: what cannot start *now* stays offered
        (ks.build_kernelspec(0.02), {**ME, "effective": {"max_leases": 1}}, None),
        ({"argv": ["python"], "display_name": "Python 3", "language": "python"}, ME, None),
        (ks.build_kernelspec(0.02), {"user": "x"}, None),  # no effective quota: offer it
    ],
)  # fmt: skip
def test_never_startable(spec: dict[str, Any], me: dict[str, Any], why: str | None) -> None:
    assert never_startable(spec, me) == why


def test_offered_hides_for_students_and_marks_for_admins() -> None:
    specs = {
        name: {"resource_dir": f"/k/{name}", "spec": spec}
        for name, spec in {
            "python3": {"argv": ["python"], "display_name": "Python 3", "language": "python"},
            "g-0.05": ks.build_kernelspec(0.05),
            "g-1": ks.build_kernelspec(1.0),
            "cs50": ks.build_kernelspec(0.05, group="cs50"),
        }.items()
    }
    assert sorted(offered(specs, ME)) == ["g-0.05", "python3"]
    marked = offered(specs, ME, "mark")
    assert marked["g-1"]["spec"]["display_name"] == (
        "Python 3 (GPU 1) (not for you: above your per-kernel limit)"
    )
    assert marked["cs50"]["spec"]["display_name"].endswith("(not for you: for course cs50 only)")
    assert specs["g-1"]["spec"]["display_name"] == "Python 3 (GPU 1)"  # the input is kept
    admin = offered(specs, {**ME, "admin": True})
    assert sorted(admin) == sorted(specs)
    assert admin["g-1"]["spec"]["display_name"].endswith(
        "(not for you: above your per-kernel limit)"
    )
    assert admin["cs50"]["spec"]["display_name"] == "Python 3 (GPU 0.05, cs50)"


# -- real servers in front of a real broker ---------------------------------------------------
KERNELS = {
    "python3-gpu-0.02": (0.02, None),
    "python3-gpu-0.05": (0.05, None),
    "python3-gpu-0.1": (0.1, None),
    "python3-gpu-0.25": (0.25, None),
    "python3-gpu-1": (1.0, None),
    "ml101-gpu-0.05": (0.05, "ml101"),
    "cs50-gpu-0.02": (0.02, "cs50"),
}


class Server:
    """``jupyter server`` as a hub would start it for ``user`` (their token, GPU_LEASE_URL)."""

    def __init__(self, tmp: Path, broker: Broker, user: str, prefix: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = f"server-{user}"
        root = tmp / user
        root.mkdir()
        env = dict(os.environ)
        env.update(
            GPU_LEASE_URL=broker.url,
            GPU_LEASE_TOKEN=broker.tokens[user],
            JUPYTER_PATH=str(prefix / "share" / "jupyter"),
            JUPYTER_DATA_DIR=str(root / "data"),
            JUPYTER_RUNTIME_DIR=str(root / "runtime"),
            JUPYTER_CONFIG_DIR=str(root / "config"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        env.pop("JUPYTERHUB_API_TOKEN", None)
        self.log = root / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "jupyter_server", "--no-browser",
                    f"--port={self.port}", "--ServerApp.port_retries=0",
                    f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
                    "--ServerApp.kernel_spec_manager_class="
                    "provisioner.kernel.offered.GPULeaseKernelSpecManager",
                    "--allow-root", *args,
                ],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
            )  # fmt: skip

    def wait(self, timeout: float = 120) -> None:
        wait_for_http(
            f"{self.url}/api/status",
            self.proc,
            lambda: self.log.read_text()[-3000:],
            timeout,
            headers=self.headers,
        )

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.headers, timeout=60)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def offered(self) -> dict[str, str]:
        r = self.get("/api/kernelspecs")
        assert r.status_code == 200, r.text
        return {name: s["spec"]["display_name"] for name, s in r.json()["kernelspecs"].items()}

    def stop(self) -> None:
        stop_process(self.proc, 30)


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    where = tmp_path / "prefix"
    for name, (fraction, group) in KERNELS.items():
        ks.install(ks.build_kernelspec(fraction, group=group), name, prefix=str(where))
    return where


@pytest.fixture
def servers(broker: Broker, prefix: Path, tmp_path: Path) -> Iterator[dict[str, Server]]:
    admin = {"Authorization": f"token {broker.tokens['admin']}"}
    quotas = {
        "default": {"max_leases": 1, "max_fraction": 0.05, "max_lease_fraction": 0.05},
        "groups/ml101": {"max_leases": 2, "max_fraction": 0.2, "max_lease_fraction": 0.1},
    }
    for path, quota in quotas.items():
        r = httpx.put(f"{broker.url}/api/v1/quotas/{path}", json=quota, headers=admin)
        assert r.status_code == 200, r.text
    out = {
        "alice": Server(tmp_path, broker, "alice", prefix,
                        "--GPULeaseKernelSpecManager.quota_cache_seconds=0"),
        "bob": Server(tmp_path, broker, "bob", prefix),
        "admin": Server(tmp_path, broker, "admin", prefix),
    }  # fmt: skip
    try:
        for server in out.values():
            server.wait()
        yield out
    finally:
        for server in out.values():
            server.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("broker_db_url", ["sqlite"], indirect=True)
def test_each_user_is_offered_what_they_may_start(
    broker: Broker, servers: dict[str, Server]
) -> None:
    gpu = {name for name in KERNELS}
    # alice (ml101: up to 0.1 per kernel): the course's kernel, not cs50's, nothing above 0.1
    alice = servers["alice"].offered()
    assert set(alice) & gpu == {"python3-gpu-0.02", "python3-gpu-0.05", "python3-gpu-0.1",
                                "ml101-gpu-0.05"}, alice  # fmt: skip
    assert "python3" in alice  # a kernel without a GPU is always offered
    # bob (no course, the default quota: up to 0.05)
    bob = servers["bob"].offered()
    assert set(bob) & gpu == {"python3-gpu-0.02", "python3-gpu-0.05"}, bob
    # the admin sees every kernel; those their own quota rules out are marked
    admin = servers["admin"].offered()
    assert set(admin) & gpu == gpu, admin
    assert admin["python3-gpu-1"] == "Python 3 (GPU 1) (not for you: above your per-kernel limit)"
    assert admin["cs50-gpu-0.02"] == "Python 3 (GPU 0.02, cs50)"

    # a start forced by name (an old notebook's kernel) is still the broker's to refuse
    r = httpx.post(
        f"{servers['alice'].url}/api/kernels",
        json={"name": "python3-gpu-0.25"},
        headers=servers["alice"].headers,
        timeout=60,
    )
    assert r.status_code == 403, r.text
    assert "0.25 is above your per-kernel limit of 0.1" in " ".join(r.json()["message"].split())
    r = httpx.post(
        f"{servers['bob'].url}/api/kernels",
        json={"name": "ml101-gpu-0.05"},
        headers=servers["bob"].headers,
        timeout=60,
    )
    assert r.status_code == 403 and "reserved for course 'ml101'" in r.json()["message"], r.text
    leases = httpx.get(
        f"{broker.url}/api/v1/leases",
        params={"all": "1"},
        headers={"Authorization": f"token {broker.tokens['admin']}"},
    ).json()["leases"]
    assert leases == []

    # a quota change shows at the next listing once the cache has expired (0 s for alice)
    r = httpx.put(
        f"{broker.url}/api/v1/quotas/users/alice",
        json={"max_lease_fraction": 0.25, "max_fraction": 0.5},
        headers={"Authorization": f"token {broker.tokens['admin']}"},
    )
    assert r.status_code == 200, r.text
    assert "python3-gpu-0.25" in servers["alice"].offered()
