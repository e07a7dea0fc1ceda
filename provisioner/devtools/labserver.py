"""A real Jupyter server subprocess with GPU kernelspecs, for tests and benchmarks.

``tests/test_lab_server.py`` and ``benchmarks/lab_polling.py`` start ``python -m
jupyter_server`` the way JupyterHub's spawner does (its own runtime and config folders,
``GPU_LEASE_URL``/``GPU_LEASE_TOKEN`` in its environment, the GPU kernelspecs on
``JUPYTER_PATH``), with the server extension ``provisioner.lab`` enabled in its config
(so it runs whether or not this package was installed with its ``jupyter-config`` files)
and the demo's kernel manager. Nothing in the runtime imports this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from .testing import ROOT, free_port, stop_process, wait_for_http


def install_kernelspecs(prefix: Path, fractions: Sequence[float]) -> list[str]:
    """``gpu-lease kernelspec install --fraction F --prefix prefix`` for each F; their names."""
    names = []
    for fraction in fractions:
        name = f"gpu-{fraction:g}".replace(".", "_")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "provisioner",
                "kernelspec",
                "install",
                "--fraction",
                str(fraction),
                "--name",
                name,
                "--prefix",
                str(prefix),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHONPATH": _pythonpath(os.environ)},
        )
        names.append(name)
    return names


class JupyterServerProcess:
    """``python -m jupyter_server`` on a free port, files under ``tmp/<name>``."""

    def __init__(
        self,
        tmp: Path,
        broker_url: str,
        broker_token: str,
        *,
        kernels_prefix: Path,
        name: str = "server",
        config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.dir = tmp / name
        self.root = self.dir / "root"
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = uuid.uuid4().hex
        self.log_path = self.dir / "server.log"
        settings: dict[str, Any] = {
            "ServerApp": {
                "jpserver_extensions": {"provisioner.lab": True},
                "kernel_manager_class": "provisioner.kernel.server.GPULeaseKernelManager",
                "root_dir": str(self.root),
                "open_browser": False,
                "ip": "127.0.0.1",
                "port": self.port,
                "port_retries": 0,
                "allow_root": True,
            },
            "IdentityProvider": {"token": self.token},
        }
        for section, values in (config or {}).items():
            settings.setdefault(section, {}).update(values)
        (self.dir / "config").mkdir(exist_ok=True)
        (self.dir / "config" / "jupyter_server_config.json").write_text(json.dumps(settings))
        base = dict(os.environ if env is None else env)
        for var in ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_SERVICE_PREFIX", "JUPYTERHUB_API_URL"):
            base.pop(var, None)
        self.env = {
            **base,
            "PYTHONPATH": _pythonpath(base),
            "GPU_LEASE_URL": broker_url,
            "GPU_LEASE_TOKEN": broker_token,
            "JUPYTER_CONFIG_DIR": str(self.dir / "config"),
            "JUPYTER_RUNTIME_DIR": str(self.dir / "runtime"),
            "JUPYTER_DATA_DIR": str(self.dir / "data"),
            "JUPYTER_PATH": str(kernels_prefix / "share" / "jupyter"),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"token {self.token}"}, timeout=60.0
        )

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter_server"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env=self.env,
            )
        try:
            wait_for_http(
                f"{self.url}/api/status",
                self.proc,
                self.log,
                timeout,
                what="the Jupyter server",
                headers=self.http.headers,
            )
        except RuntimeError:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (jupyter_server shuts every kernel down, releasing leases), then SIGKILL."""
        if self.proc is not None:
            stop_process(self.proc, timeout)
        self.http.close()

    def log(self, limit: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    # -- the REST API ---------------------------------------------------------------------
    def gpu_kernels(self) -> list[dict[str, Any]]:
        """``GET /gpu-lease/api/kernels`` (the server extension), as the browser asks."""
        r = self.http.get("/gpu-lease/api/kernels")
        r.raise_for_status()
        return list(r.json()["kernels"])

    def session_body(self, path: str, kernel_name: str) -> dict[str, Any]:
        """The body JupyterLab posts to ``/api/sessions`` for a notebook at ``path``."""
        return {
            "path": path,
            "name": path.rsplit("/", 1)[-1],
            "type": "notebook",
            "kernel": {"name": kernel_name},
        }


def _pythonpath(env: Mapping[str, str]) -> str:
    return os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))


__all__ = ["JupyterServerProcess", "install_kernelspecs"]
