"""Table tests for provisioner.kernel.env: a lease -> the kernel's environment and argv."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from provisioner.client import GrantedLease
from provisioner.errors import InvalidRequest
from provisioner.kernel.env import (
    EXTENSION,
    LAUNCHER,
    STARTUP_DIR,
    kernel_argv,
    lease_environment,
    xla_mem_fraction,
)

UUID = "GPU-0f6c3a2e-1b2c-4d5e-8f90-123456789abc"


def make_lease(**over):
    lease = {
        "id": "lease-abc",
        "user": "ada",
        "kernel_id": "k1",
        "fraction": 0.02,
        "gpu": {"uuid": UUID, "node": "gpu-a", "name": "NVIDIA H100", "memory_mb": 81920},
        "memory_limit_mb": 1126,  # 0.02 * 81920 = 1638 - 512 overhead
        "state": "active",
        "expires_at": 1000.0,
    }
    lease.update(over)
    return GrantedLease.from_json(lease)


def test_full_lease_environment():
    env = lease_environment(make_lease(), state_file="/run/k1.json")
    assert env == {
        "CUDA_VISIBLE_DEVICES": UUID,
        "GPU_LEASE_ID": "lease-abc",
        "GPU_LEASE_GPU_UUID": UUID,
        "GPU_LEASE_FRACTION": "0.02",
        "GPU_LEASE_MEMORY_MB": "1126",
        "GPU_LEASE_GPU_MEMORY_MB": "81920",
        "GPU_LEASE_GPU_NAME": "NVIDIA H100",
        "GPU_LEASE_ENFORCEMENT": "cooperative",
        "GPU_LEASE_STATE_FILE": "/run/k1.json",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.013745",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "CUPY_GPU_MEMORY_LIMIT": str(1126 * 1024 * 1024),
    }


@pytest.mark.parametrize(
    "over, present, absent",
    [
        # a lease whose GPU the broker could not describe: no device-relative fraction
        ({"gpu": {"uuid": UUID}}, {}, ("XLA_PYTHON_CLIENT_MEM_FRACTION", "GPU_LEASE_GPU_NAME")),
        ({"fraction": 1}, {"GPU_LEASE_FRACTION": "1"}, ()),
        ({"fraction": 0.125}, {"GPU_LEASE_FRACTION": "0.125"}, ()),
        ({"fraction": None}, {}, ("GPU_LEASE_FRACTION",)),
        ({"memory_limit_mb": 1126.0}, {"GPU_LEASE_MEMORY_MB": "1126"}, ()),
    ],
)
def test_lease_environment_table(over, present, absent):
    env = lease_environment(make_lease(**over))
    for key, value in present.items():
        assert env[key] == value
    for key in absent:
        assert key not in env
    assert "GPU_LEASE_STATE_FILE" not in env
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_mps_adds_pinned_limit_for_device_zero():
    env = lease_environment(make_lease(), enforcement="mps")
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1126M"
    assert env["GPU_LEASE_ENFORCEMENT"] == "mps"
    # the pipe of the GPU's own daemon, as the node agent (--mps) lays them out
    uuid = env["CUDA_VISIBLE_DEVICES"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"/run/gpu-lease/mps/{uuid}/pipe"
    moved = lease_environment(make_lease(), enforcement="mps", mps_dir="/srv/mps")
    assert moved["CUDA_MPS_PIPE_DIRECTORY"] == f"/srv/mps/{uuid}/pipe"
    plain = lease_environment(make_lease())
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in plain
    assert "CUDA_MPS_PIPE_DIRECTORY" not in plain


def test_server_environment_is_respected_not_clobbered():
    base = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    env = lease_environment(make_lease(), base_env=base)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env  # the user's choice stays
    # torch's allocator config is never touched (see env.py: older torch rejects unknown keys)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert "PYTORCH_CUDA_ALLOC_CONF" not in lease_environment(make_lease())


@pytest.mark.parametrize(
    "over, kwargs, words",
    [
        ({"id": None}, {}, "no id"),
        ({"id": ""}, {}, "no id"),
        ({"gpu": {}}, {}, "no GPU UUID"),
        ({"gpu": None}, {}, "no GPU UUID"),
        ({"memory_limit_mb": 0}, {}, "no positive memory limit"),
        ({"memory_limit_mb": -5}, {}, "no positive memory limit"),
        # of the wrong type: refused where the client reads the lease, naming the field
        ({"memory_limit_mb": math.nan}, {}, r"memory_limit_mb = a number \(nan\), not an integer"),
        ({"memory_limit_mb": True}, {}, r"memory_limit_mb = a boolean \(True\), not an integer"),
        ({"memory_limit_mb": "1126"}, {}, r"memory_limit_mb = a string \('1126'\), not an integer"),
        ({"gpu": {"uuid": ""}}, {}, "no GPU UUID"),
        ({}, {"enforcement": "strict"}, "Unknown GPU enforcement"),
    ],
)
def test_invalid_leases_are_refused(over, kwargs, words):
    with pytest.raises(InvalidRequest, match=words):
        lease_environment(make_lease(**over), **kwargs)


@pytest.mark.parametrize(
    "cap, total, expected",
    [
        (1126, 81920, "0.013745"),
        (1, 3, "0.333333"),
        (2, 3, "0.666666"),  # rounded down, never above the cap ("%.6f" alone gives 0.666667)
        (5, 5, "1.000000"),
        (9, 5, "1.000000"),
        (1, 1_000_000_000, "0.000000"),
    ],
)
def test_xla_mem_fraction(cap, total, expected):
    assert xla_mem_fraction(cap, total) == expected


@given(st.integers(1, 200_000), st.integers(1, 200_000))
def test_xla_fraction_never_exceeds_the_cap(cap, total):
    value = float(xla_mem_fraction(cap, total))
    assert 0 <= value <= 1
    assert value * total <= min(cap, total) + 1e-9


L = str(LAUNCHER)
EXT = f"--ext={EXTENSION}"
CONN = "{connection_file}"


@pytest.mark.parametrize(
    "argv, expected, extension",
    [
        (
            ["python", "-m", "ipykernel_launcher", "-f", CONN],
            ["python", L, "-m", "ipykernel_launcher", "-f", CONN, EXT],
            True,
        ),
        (  # ipykernel's own kernel.json on Python 3.11+
            ["/opt/py/bin/python", "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", CONN],
            [
                "/opt/py/bin/python",
                "-Xfrozen_modules=off",
                L,
                "-m",
                "ipykernel_launcher",
                "-f",
                CONN,
                EXT,
            ],
            True,
        ),
        (
            ["python", "-X", "frozen_modules=off", "-W", "ignore", "-m", "ipykernel", "-f", CONN],
            [
                "python",
                "-X",
                "frozen_modules=off",
                "-W",
                "ignore",
                L,
                "-m",
                "ipykernel",
                "-f",
                CONN,
                EXT,
            ],
            True,
        ),
        (
            ["python", "-mipykernel_launcher", "-f", CONN],
            ["python", L, "-m", "ipykernel_launcher", "-f", CONN, EXT],
            True,
        ),
        (  # another Python kernel: caps yes, IPython's --ext no
            ["python", "-m", "my_kernel", "--conn", CONN],
            ["python", L, "-m", "my_kernel", "--conn", CONN],
            False,
        ),
    ],
)
def test_kernel_argv_rewrites_module_form(argv, expected, extension):
    result = kernel_argv(argv)
    assert result.wrapped
    assert result.argv == expected
    assert result.extension is extension
    assert kernel_argv(result.argv).argv == expected  # idempotent


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["python"],
        ["python", "-m"],
        ["python", "kernel.py", "-f", CONN],
        ["python", "-c", "import ipykernel", "-f", CONN],
        ["R", "--slave", "-e", "IRkernel::main()", "--args", CONN],
        ["julia", "-i", "--startup-file=yes", "kernel.jl", CONN],
    ],
)
def test_kernel_argv_leaves_other_shapes_alone(argv):
    result = kernel_argv(argv)
    assert not result.wrapped and not result.extension
    assert result.argv == argv
    assert "not of the form 'python -m MODULE" in result.reason


def test_startup_folder_holds_only_our_modules():
    names = {p.name for p in STARTUP_DIR.iterdir() if p.name != "__pycache__"}
    assert names == {"gpu_lease_launcher.py", "gpu_lease_caps.py", "gpu_lease_magic.py"}
    assert LAUNCHER.is_file()
