"""The files that run inside the kernel: launcher, cap appliers, %gpu — as real processes.

The launcher is run as a real subprocess with a lease environment made by
``lease_environment``. Real TensorFlow and PyTorch are used when installed (CPU builds
here: they must report "no GPU" and not fail); CUDA builds cannot run on a machine
without a GPU, so small stand-in packages named ``torch`` / ``tensorflow`` written to a
temporary folder exercise the GPU branches of the appliers. The last test starts a real
ipykernel through jupyter_client with the rewritten argv and runs ``%gpu`` in it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from provisioner.client import GrantedLease
from provisioner.kernel.env import LAUNCHER, STARTUP_DIR, kernel_argv, lease_environment
from provisioner.kernel.kernelspecs import build_kernelspec

UUID = "GPU-0f6c3a2e-1b2c-4d5e-8f90-123456789abc"
LEASE = GrantedLease.from_json(
    {
        "id": "lease-abc",
        "fraction": 0.02,
        "gpu": {"uuid": UUID, "node": "gpu-a", "name": "NVIDIA H100", "memory_mb": 81920},
        "memory_limit_mb": 1126,
        "state": "active",
    }
)
FRAMEWORKS = ("tensorflow", "torch", "jax", "cupy")


def lease_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_LEASE_", "XLA_", "CUPY_"))}
    env.update(lease_environment(LEASE))
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(extra)
    return env


def run_launcher(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *args],
        cwd=cwd,
        env=env if env is not None else lease_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


PROBE = """
import json, sys
{imports}
import gpu_lease_caps
out = {{
    "name": __name__,
    "argv": sys.argv[1:],
    "path0": sys.path[0],
    "startup_on_path": any(p.rstrip("/") == {startup!r} for p in sys.path),
    "frameworks": [m for m in {frameworks!r} if m in sys.modules],
    "report": gpu_lease_caps.REPORT,
    "loaders": {{m: type(sys.modules[m].__loader__).__name__ for m in {frameworks!r} if m in sys.modules}},
    "spec_loaders": {{m: type(sys.modules[m].__spec__.loader).__name__ for m in {frameworks!r} if m in sys.modules}},
}}
{extra}
print("RESULT" + json.dumps(out))
"""


def probe(tmp_path: Path, imports: str = "", extra: str = "", args=(), env=None, timeout=60):
    source = PROBE.format(
        imports=imports,
        extra=textwrap.dedent(extra),
        startup=str(STARTUP_DIR),
        frameworks=FRAMEWORKS,
    )
    (tmp_path / "lease_probe.py").write_text(source, encoding="utf-8")
    proc = run_launcher(tmp_path, "-m", "lease_probe", *args, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :]), proc.stderr


# -- the launcher itself ------------------------------------------------------------
@pytest.mark.slow
def test_module_runs_as_main_with_args_and_no_shadowing(tmp_path):
    out, _ = probe(tmp_path, args=("-f", "/tmp/conn.json", "--ext=x"))
    assert out["name"] == "__main__"
    assert out["argv"] == ["-f", "/tmp/conn.json", "--ext=x"]
    # sys.path[0] is what `python -m` puts there (the working directory), never our folder
    assert out["path0"] == str(tmp_path)
    assert out["startup_on_path"] is False
    assert out["frameworks"] == [] and out["report"] == {}


@pytest.mark.slow
def test_same_modules_as_plain_python_m(tmp_path):
    """Importing json (or anything without a framework) costs nothing: no extra module."""
    write(tmp_path / "modlist.py", "import json, sys\nprint(json.dumps(sorted(sys.modules)))\n")
    plain = subprocess.run(
        [sys.executable, "-m", "modlist"], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    wrapped = run_launcher(tmp_path, "-m", "modlist")
    assert wrapped.returncode == 0, wrapped.stderr
    extra = set(json.loads(wrapped.stdout)) - set(json.loads(plain.stdout))
    assert extra == set()
    assert not set(FRAMEWORKS) & set(json.loads(wrapped.stdout))


@pytest.mark.slow
def test_only_our_names_are_served_from_the_startup_folder(tmp_path):
    out, _ = probe(
        tmp_path,
        imports="import importlib.util",
        extra=(
            'out["launcher_spec"] = importlib.util.find_spec("gpu_lease_launcher") is not None\n'
            'out["magic_spec"] = importlib.util.find_spec("gpu_lease_magic") is not None'
        ),
    )
    assert out["launcher_spec"] is False
    assert out["magic_spec"] is True


@pytest.mark.slow
def test_exit_status_and_usage(tmp_path):
    write(tmp_path / "exits.py", "import sys\nsys.exit(3)\n")
    assert run_launcher(tmp_path, "-m", "exits").returncode == 3
    bad = run_launcher(tmp_path, "-c", "print(1)")
    assert bad.returncode == 2 and "usage: gpu_lease_launcher.py -m MODULE" in bad.stderr


# -- cap appliers on stand-in frameworks ------------------------------------------
FAKE_TORCH = """
    from types import SimpleNamespace
    version = SimpleNamespace(cuda="12.4", hip=None)

    class _Cuda:
        queued = []
        initialized = False
        fraction = None

        def _lazy_call(self, fn):
            if self.initialized:
                fn()
            else:
                self.queued.append(fn)

        def is_initialized(self):
            return self.initialized

        def get_device_properties(self, i):
            return SimpleNamespace(total_memory=81920 * 1024 * 1024)

        def set_per_process_memory_fraction(self, fraction, device=None):
            assert isinstance(fraction, float)
            self.fraction = (fraction, device)

        def init(self):  # what torch.cuda._lazy_init does with the queue
            self.initialized = True
            for fn in self.queued:
                fn()

    cuda = _Cuda()
"""

FAKE_TF = """
    from types import SimpleNamespace
    calls = []
    initialised = False

    def list_physical_devices(kind):
        return ["PhysicalDevice(GPU:0)"]

    def set_logical_device_configuration(dev, confs):
        if initialised:
            raise RuntimeError("Virtual devices cannot be modified after being initialized")
        calls.append((dev, confs[0].memory_limit))

    config = SimpleNamespace(
        list_physical_devices=list_physical_devices,
        set_logical_device_configuration=set_logical_device_configuration,
        LogicalDeviceConfiguration=lambda memory_limit: SimpleNamespace(memory_limit=memory_limit),
    )
"""


@pytest.mark.slow
def test_caps_on_standin_frameworks(tmp_path):
    write(tmp_path / "torch" / "__init__.py", FAKE_TORCH)
    write(tmp_path / "tensorflow" / "__init__.py", FAKE_TF)
    write(tmp_path / "jax" / "__init__.py", "")
    write(tmp_path / "cupy" / "__init__.py", "")
    out, stderr = probe(
        tmp_path,
        imports="import torch, tensorflow, jax, cupy",
        extra=(
            """
            out["queued_report"] = gpu_lease_caps.REPORT["torch"]
            torch.cuda.init()
            out["torch_fraction"] = torch.cuda.fraction
            out["tf_calls"] = tensorflow.calls
            import torch as again  # a second import applies nothing twice
            out["queued_after"] = len(torch.cuda.queued)
            """
        ),
    )
    assert stderr == ""
    assert sorted(out["frameworks"]) == sorted(FRAMEWORKS)
    # the hook hands the framework its own loader back
    assert set(out["loaders"].values()) == {"SourceFileLoader"}
    assert set(out["spec_loaders"].values()) == {"SourceFileLoader"}
    assert (
        out["queued_report"]
        == "per_process_memory_fraction for 1126 MiB queued until CUDA initialises"
    )
    fraction, device = out["torch_fraction"]
    assert device == 0 and fraction == pytest.approx(1126 / 81920)
    assert out["queued_after"] == 1
    report = out["report"]
    assert (
        report["torch"] == "per_process_memory_fraction=0.013745 (1126 MiB of 81920 MiB) on GPU 0"
    )
    assert report["tensorflow"] == "memory_limit=1126 MiB on 1 GPU"
    assert out["tf_calls"] == [["PhysicalDevice(GPU:0)", 1126]]
    assert report["jax"] == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.013745 (1126 MiB; environment)"
    assert report["cupy"] == f"CUPY_GPU_MEMORY_LIMIT={1126 * 1024 * 1024} (1126 MiB; environment)"


@pytest.mark.slow
def test_cap_failures_never_reach_user_code(tmp_path):
    # a "tensorflow" already initialised, a "torch" whose cap raises inside the lazy call
    write(
        tmp_path / "tensorflow" / "__init__.py",
        FAKE_TF.replace("initialised = False", "initialised = True"),
    )
    write(
        tmp_path / "torch" / "__init__.py",
        FAKE_TORCH.replace(
            "return SimpleNamespace(total_memory",
            "raise OSError('no device'); return SimpleNamespace(total_memory",
        ),
    )
    write(tmp_path / "cupy" / "__init__.py", "raise ImportError('cupy is broken')\n")
    out, stderr = probe(
        tmp_path,
        imports="import tensorflow, torch",
        extra=(
            """
            torch.cuda.init()
            try:
                import cupy
            except ImportError as exc:
                out["cupy_error"] = str(exc)
            """
        ),
    )
    report = out["report"]
    assert report["tensorflow"].startswith("not applied: the GPU was already initialised")
    assert report["torch"] == "error: OSError: no device"
    assert "cupy" not in report and out["cupy_error"] == "cupy is broken"
    assert "gpu-lease warning: TensorFlow's GPU was initialised before the cap" in stderr
    assert "gpu-lease warning: could not cap torch's GPU memory to 1126 MiB: no device" in stderr


@pytest.mark.slow
def test_jax_with_both_fraction_names_is_warned(tmp_path):
    """jaxlib 0.11 refuses its GPU backend when XLA_CLIENT_MEM_FRACTION is set beside
    XLA_PYTHON_CLIENT_MEM_FRACTION (seen on an H200), so JAX would run on the CPU."""
    write(tmp_path / "jax" / "__init__.py", "")
    out, stderr = probe(
        tmp_path, imports="import jax", env=lease_env(XLA_CLIENT_MEM_FRACTION="0.5")
    )
    assert out["report"]["jax"].endswith(
        "; XLA_CLIENT_MEM_FRACTION is set too: jaxlib refuses the GPU"
    )
    assert "XLA_CLIENT_MEM_FRACTION is set together with XLA_PYTHON_CLIENT_MEM_FRACTION" in stderr
    # the kernel's own environment never has both (the provisioner removes the newer name)
    assert "XLA_CLIENT_MEM_FRACTION" not in lease_env()


@pytest.mark.slow
def test_no_lease_means_nothing_to_cap(tmp_path):
    write(tmp_path / "jax" / "__init__.py", "")
    env = {k: v for k, v in lease_env().items() if not k.startswith("GPU_LEASE_")}
    out, _ = probe(tmp_path, imports="import jax", env=env)
    assert out["report"] == {
        "jax": "no GPU lease in this kernel (GPU_LEASE_MEMORY_MB unset); nothing to cap"
    }


# -- real frameworks (CPU builds) --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.tensorflow
def test_real_tensorflow_under_the_launcher(tmp_path):
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed")
    out, _ = probe(
        tmp_path,
        imports="import tensorflow as tf",
        extra='out["sum"] = float(tf.reduce_sum(tf.constant([1.0, 2.0])))',
        timeout=110,
    )
    assert out["sum"] == 3.0
    assert out["report"]["tensorflow"] == "no GPU visible; nothing to cap"


@pytest.mark.slow
def test_real_torch_under_the_launcher(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    out, _ = probe(
        tmp_path,
        imports="import torch",
        extra='out["cuda"] = torch.version.cuda; out["sum"] = float(torch.tensor([1.0, 2.0]).sum())',
        timeout=110,
    )
    assert out["sum"] == 3.0
    if out["cuda"] is None:
        assert out["report"]["torch"] == "torch built without CUDA (CPU build); nothing to cap"
    else:
        assert not out["report"]["torch"].startswith("error")


# -- %gpu, loaded from the startup folder without the launcher ---------------------------
def load_startup(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", STARTUP_DIR / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def magic(monkeypatch):
    for key in list(os.environ):
        if key.startswith("GPU_LEASE_"):
            monkeypatch.delenv(key)
    return load_startup("gpu_lease_magic")


def test_magic_without_a_lease(magic, capsys):
    assert magic.lease_info() == {"lease": None, "message": "This kernel has no GPU lease."}
    magic.gpu("")
    assert capsys.readouterr().out.strip() == "This kernel has no GPU lease."


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "state unknown (the state file has not been written)"),
        ("{not json", "state unknown (cannot read"),
        ("[1, 2]", "state unknown (the state file holds no JSON object)"),
    ],
)
def test_magic_state_file_problems(magic, monkeypatch, tmp_path, content, words):
    path = tmp_path / "state.json"
    if content is not None:
        path.write_text(content)
    for key, value in lease_environment(LEASE, state_file=str(path)).items():
        monkeypatch.setenv(key, value)
    info = magic.lease_info()
    assert info["state"] is None and info["state_note"].startswith(words)
    assert words in magic.format_info(info)


def test_magic_text_and_json(magic, monkeypatch, tmp_path, capsys):
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"state": "active", "expires_at": 1090.4, "reason": None}))
    for key, value in lease_environment(LEASE, state_file=str(state)).items():
        monkeypatch.setenv(key, value)
    info = magic.gpu("--json")
    assert info["lease"] == "lease-abc" and info["state"] == "active"
    assert info["gpu"] == {"uuid": UUID, "name": "NVIDIA H100", "memory_mb": 81920}
    assert info["memory_limit_mb"] == 1126 and info["fraction"] == "0.02"
    # no NVML on a machine without a GPU driver: the reason is given instead of a number
    assert info["process_memory_mb"] is None and info["process_memory_note"]
    text = magic.format_info({**info, "caps": {"torch": "memory capped"}}, now=1000.0)
    assert "GPU:        NVIDIA H100 (" + UUID + ", 81920 MiB)" in text
    assert "state:      active, expires in 90 s unless renewed" in text
    assert "torch:      memory capped" in text and "jax:        not imported yet" in text
    assert magic.gpu("") is None
    assert "GPU lease lease-abc" in capsys.readouterr().out
    magic.gpu("--bogus")
    assert "usage: %gpu [--json]" in capsys.readouterr().out


# -- a real ipykernel started with the rewritten argv --------------------------------
async def _run(client, code: str, timeout: float = 60) -> tuple[str, dict]:
    msg_id = client.execute(code)
    text, result = [], {}
    deadline = time.monotonic() + timeout
    while True:
        msg = await client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content["text"])
        elif kind == "execute_result":
            result = content["data"]
        elif kind == "error":
            text.append("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(text), result


@pytest.mark.slow
async def test_real_ipykernel_with_gpu_magic(tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = build_kernelspec(0.02)
    rewritten = kernel_argv([sys.executable, *spec["argv"][1:]])
    assert rewritten.wrapped and rewritten.extension
    kdir = tmp_path / "kernels" / "gpu-test"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(
        json.dumps({"argv": rewritten.argv, "display_name": "GPU test", "language": "python"})
    )
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"state": "active", "expires_at": time.time() + 60}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_LEASE_")}
    env.update(lease_environment(LEASE, state_file=str(state)))
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")

    km = AsyncKernelManager(
        kernel_name="gpu-test",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
    )
    await km.start_kernel(env=env, cwd=str(tmp_path))
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        out, _ = await _run(client, "%gpu")
        assert "GPU lease lease-abc" in out, out
        assert f"NVIDIA H100 ({UUID}, 81920 MiB)" in out
        assert "fraction:   0.02" in out and "memory cap: 1126 MiB (cooperative)" in out
        assert "state:      active, expires in" in out
        assert "jax:        not imported yet" in out
        out, _ = await _run(client, "import os; print(os.environ['GPU_LEASE_ID'])")
        assert out.strip() == "lease-abc"
        out, result = await _run(client, "%gpu --json")
        assert "'lease': 'lease-abc'" in result["text/plain"], (out, result)
        out, _ = await _run(
            client, f"import sys; print({str(STARTUP_DIR)!r} in sys.path, __name__)"
        )
        assert out.split() == ["False", "__main__"]
    finally:
        client.stop_channels()
        await km.shutdown_kernel(now=True)


@pytest.mark.parametrize(
    "enforcement, state, first, more",
    [
        ("cooperative", {}, "framework caps (cooperative: code can lift them)", []),
        (
            "mps",
            {"mps": "running", "node_enforcement": "agent-revoke", "used_mb": 900},
            "MPS (the driver refuses allocations past the cap)",
            ["node agent (revoke: revokes the lease", "in use:     900 MiB"],
        ),
        (
            "mps",
            {"mps": "down", "node_enforcement": "agent-report"},
            "framework caps",
            ["the GPU's MPS daemon is down: not enforced", "node agent (report:"],
        ),
        ("mps", {}, "framework caps", ["no node agent reports an MPS daemon on this GPU"]),
        (
            "cooperative",
            {"node_enforcement": "driver+agent-revoke"},
            "the driver's memory limit on this kernel's cgroup (hard)",
            ["framework caps", "node agent (revoke: revokes the lease"],
        ),
    ],
)
def test_magic_says_which_layers_hold_the_cap(
    magic, monkeypatch, tmp_path, enforcement, state, first, more
):
    """%gpu names each enforcement layer that holds for this kernel, from what
    the broker said at the last renewal (the state file)."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"state": "active", "expires_at": 1090.4, **state}))
    env = lease_environment(LEASE, enforcement=enforcement, state_file=str(path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    info = magic.lease_info()
    assert info["enforced_by"][0].startswith(first)
    text = magic.format_info(info, now=1000.0)
    assert f"  held by:    {info['enforced_by'][0]}" in text
    for words in more:
        assert words in text, text
    if "used_mb" not in state:
        assert "in use:" not in text


@pytest.mark.parametrize(
    "enforcement, state, words",
    [
        ("mps", {"mps": "running"}, "serves no one yet (it starts for your user"),
        ("mps", {"mps": "running", "mps_server_uid": os.getuid()}, "serves your user (uid "),
        (
            "mps",
            {"mps": "running", "mps_server_uid": os.getuid() + 1},
            f"serves another user (uid {os.getuid() + 1}): MPS serves one user per GPU at a "
            "time, so this kernel's CUDA calls wait",
        ),
        ("mps", {}, None),  # no agent reports an MPS daemon: the layers say so
        ("cooperative", {"mps": "running", "mps_server_uid": 7}, None),  # not an MPS kernel
    ],
)
def test_magic_says_whom_the_gpus_mps_server_serves(
    magic, monkeypatch, tmp_path, enforcement, state, words
):
    """%gpu in an MPS kernel says whose uid the GPU's MPS server serves (the
    broker's lease answer, through the state file)."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"state": "active", "expires_at": 1090.4, **state}))
    env = lease_environment(LEASE, enforcement=enforcement, state_file=str(path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    text = magic.format_info(magic.lease_info(), now=1000.0)
    if words is None:
        assert "MPS server:" not in text, text
    else:
        assert f"  MPS server: {words}" in text, text


def test_magic_shows_a_members_class_session(magic, monkeypatch, tmp_path):
    state = tmp_path / "state.json"
    note = "GPU reserved for ml101 until 11:30"
    state.write_text(json.dumps({"state": "active", "expires_at": 1090.4, "session": note}))
    for key, value in lease_environment(LEASE, state_file=str(state)).items():
        monkeypatch.setenv(key, value)
    info = magic.lease_info()
    assert info["session"] == note
    assert f"class:      {note}" in magic.format_info(info, now=1000.0)
