"""Every notebook in examples/ runs top to bottom (nbclient) on its GPU kernel.

The ready kernelspecs (``python3-gpu-0.02`` …, as shipped in kernelspecs/) are installed
in a temporary JUPYTER_PATH; the provisioner talks to a real broker subprocess (the
``broker`` fixture) with the token of a user in this process's environment, as a Jupyter
server would. A notebook runs on the kernel its metadata names (default: GPU 0.02).

Each example also runs in a *clean install*: a fresh ``python -m venv`` holding this
package (built from the checkout as a wheel, not editable) and only its own dependencies,
so an example cannot lean on a package that reaches the test environment some other way
(numpy came in through tensorflow and torch). There nbclient, the provisioner and the
kernel all run on the venv's Python.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
from nbclient import NotebookClient

from provisioner.kernel.kernelspecs import ready_kernelspecs, spec_json

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
SCRIPTS = sorted(EXAMPLES.glob("*.py"))

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


# -- in a clean install ------------------------------------------------------------------------
#: runs in the clean venv: execute a notebook with nbclient (a dependency of jupyter_server's)
RUN_NOTEBOOK = """
import sys
import nbformat
from nbclient import NotebookClient

source, target, cwd = sys.argv[1:]
nb = nbformat.read(source, as_version=4)
name = nb.metadata.get("kernelspec", {}).get("name", "python3-gpu-0.02")
NotebookClient(nb, kernel_name=name, timeout=60, resources={"metadata": {"path": cwd}}).execute()
nbformat.write(nb, target)
"""


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without what points Python at the checkout or our venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
        and not k.startswith(("JUPYTER", "GPU_LEASE_"))
    }
    env.update(extra)
    return env


def check(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path) -> str:
    """Run ``cmd`` (in ``cwd``: never the checkout, which ``python -c`` would import from)."""
    done = subprocess.run(
        cmd, env=env, timeout=timeout, capture_output=True, text=True, check=False, cwd=cwd
    )
    assert done.returncode == 0, f"{cmd[:4]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def clean_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` of a fresh venv (no system site-packages) where ``pip install`` put this
    package, built from a copy of the checkout, and nothing but its own dependencies."""
    root = tmp_path_factory.mktemp("clean-install")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "provisioner", src / "provisioner", ignore=shutil.ignore_patterns("__pycache__")
    )
    venv = root / "venv"
    env = clean_environ()
    check([sys.executable, "-m", "venv", str(venv)], env, 120, root)
    python = str(venv / "bin" / "python")
    check([python, "-m", "pip", "install", "-q", "--no-compile", str(src)], env, 840, root)
    where = check([python, "-c", "import provisioner; print(provisioner.__file__)"], env, 60, root)
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout
    return venv / "bin"


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one builds the venv
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_example_notebook_runs_in_a_clean_install(
    path: Path, clean_install: Path, broker: Any, tmp_path: Path
) -> None:
    jupyter = tmp_path / "jupyter"
    shutil.copytree(ROOT / "kernelspecs", jupyter / "kernels")  # the shipped kernelspecs
    env = clean_environ(
        PATH=f"{clean_install}{os.pathsep}{os.environ.get('PATH', '')}",
        JUPYTER_PATH=str(jupyter),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        GPU_LEASE_URL=broker.url,
        GPU_LEASE_TOKEN=broker.tokens["alice"],
    )
    executed = tmp_path / path.name
    python = str(clean_install / "python")
    check([python, "-c", RUN_NOTEBOOK, str(path), str(executed), str(tmp_path)], env, 300, tmp_path)
    nb = nbformat.read(executed, as_version=4)
    assert all(
        out.output_type != "error" for c in nb.cells if c.cell_type == "code" for out in c.outputs
    )
    # the kernel held a lease of alice's while it ran, and gave it back when it stopped
    r = httpx.get(
        f"{broker.url}/api/v1/leases",
        params={"all": "1", "history": "1"},
        headers=broker.headers("admin"),
    )
    r.raise_for_status()
    held = [(x["user"], x["state"]) for x in r.json()["leases"]]
    assert held == [("alice", "released")], held
    text = outputs_text(nb)
    if path.name == "gpu_hello.ipynb":
        lease_id = r.json()["leases"][0]["id"]
        assert f"GPU_LEASE_ID = {lease_id}" in text
        assert "memory cap:" in text  # %gpu
        assert "smallest eigenvalue" in text


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one builds the venv
@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_example_script_starts_in_a_clean_install(
    path: Path, clean_install: Path, tmp_path: Path
) -> None:
    """Scripts need a running hub; ``--help`` shows that everything they import is there."""
    python = str(clean_install / "python")
    out = check([python, str(path), "--help"], clean_environ(), 60, tmp_path)
    assert "usage:" in out


# -- examples/classroom.py: the operator token never on the command line --------
def test_classroom_reads_its_token_from_the_environment_or_a_private_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from provisioner.devtools.testing import load_example

    room = load_example("classroom")
    secret = tmp_path / "op.token"
    secret.write_text("op-token-from-file\n")
    secret.chmod(0o600)
    demo = {"admin_token": "demo-token"}
    assert (
        room.operator_token(str(secret), {"GPU_LEASE_TOKEN": "env"}, demo) == "op-token-from-file"
    )
    assert room.operator_token(None, {"GPU_LEASE_TOKEN": "env"}, demo) == "env"
    assert room.operator_token(None, {}, demo) == "demo-token"
    secret.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others .*chmod 600"):
        room.operator_token(str(secret), {}, demo)
    # --token is refused with the advice, before anything is called
    with pytest.raises(SystemExit):
        room.main(["--token", "op-token-on-argv"])
    err = capsys.readouterr().err
    assert "every account's ps sees it" in err and "GPU_LEASE_TOKEN" in err
