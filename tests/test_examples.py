"""Every notebook in examples/ runs top to bottom (nbclient) on its GPU kernel.

The ready kernelspecs (``python3-gpu-0.02`` …, as shipped in kernelspecs/) are installed
in a temporary JUPYTER_PATH; the provisioner talks to a real broker subprocess (the
``broker`` fixture) with the token of a user in this process's environment, as a Jupyter
server would. A notebook runs on the kernel its metadata names (default: GPU 0.02).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
from nbclient import NotebookClient

from provisioner.kernelspecs import ready_kernelspecs, spec_json

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))

pytestmark = [pytest.mark.broker_args("--ttl", "6", "--GPULeaseBroker.reap_interval=0.5")]


@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    """SQLite only: the broker's own tests cover PostgreSQL."""
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


def install_ready_kernelspecs(root: Path) -> None:
    for name, spec in ready_kernelspecs().items():
        folder = root / "kernels" / name
        folder.mkdir(parents=True)
        (folder / "kernel.json").write_text(spec_json(spec))


def active_leases(broker: Any) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{broker.url}/api/v1/leases", params={"all": "1"}, headers=broker.headers("admin")
    )
    r.raise_for_status()
    return [x for x in r.json()["leases"] if x["state"] == "active"]


def outputs_text(nb: Any) -> str:
    return "".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
async def test_example_notebook_runs(
    path: Path, broker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_ready_kernelspecs(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("GPU_LEASE_URL", broker.url)
    monkeypatch.setenv("GPU_LEASE_TOKEN", broker.tokens["alice"])
    nb = nbformat.read(path, as_version=4)
    kernel_name = nb.metadata.get("kernelspec", {}).get("name", "python3-gpu-0.02")
    seen: list[list[dict[str, Any]]] = []

    async def on_cell_execute(cell: Any, cell_index: int) -> None:
        if not seen:
            seen.append(active_leases(broker))

    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=60,
        resources={"metadata": {"path": str(tmp_path)}},
        on_cell_execute=on_cell_execute,
    )
    await client.async_execute()
    # the kernel held a lease while it ran, and gave it back when it stopped
    assert seen and [x["user"] for x in seen[0]] == ["alice"]
    assert active_leases(broker) == []
    text = outputs_text(nb)
    if path.name == "gpu_hello.ipynb":
        lease = seen[0][0]
        assert f"CUDA_VISIBLE_DEVICES = {lease['gpu']['uuid']}" in text
        assert f"GPU_LEASE_ID = {lease['id']}" in text
        assert "GPU_LEASE_FRACTION = 0.02" in text
        assert "GPU_LEASE_TOKEN" not in text
        assert "memory cap:" in text  # %gpu
        assert "smallest eigenvalue" in text
