"""provisioner.kernel.kernelspecs: builder tables, the ready specs, and an install/list/remove round-trip."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from provisioner.cli import fraction_arg
from provisioner.errors import InvalidRequest
from provisioner.kernel import kernelspecs as ks
from provisioner.model import validate_fraction

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def isolated_jupyter(tmp_path, monkeypatch):
    """Keep the user's and the system's Jupyter folders out of every test."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user-data"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter-path"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    # the user's folder before the environment's: kernelspecs that `make demo` installed
    # into the venv (sys.prefix) must not hide the ones a test installs for the user
    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "0")


def validate(value):
    """Text comes through the command line's edge (cli.fraction_arg), anything else from
    kernel.json straight to the rule (model.validate_fraction)."""
    if not isinstance(value, str):
        return validate_fraction(value)
    try:
        return fraction_arg(value)
    except argparse.ArgumentTypeError as exc:
        raise InvalidRequest(str(exc)) from exc


@pytest.mark.parametrize(
    "value, expected",
    [(0.02, 0.02), (1, 1.0), ("0.5", 0.5), (" 0.25 ", 0.25), ("1", 1.0), (1e-6, 1e-6)],
)
def test_valid_fractions(value, expected):
    assert validate(value) == expected


@pytest.mark.parametrize(
    "value, words",
    [
        (math.nan, "finite number"),
        ("nan", "finite number"),
        (math.inf, "finite number"),
        ("-inf", "finite number"),
        (0, "greater than 0 and at most 1"),
        (-0.1, "greater than 0 and at most 1"),
        (1.01, "greater than 0 and at most 1"),
        ("2", "greater than 0 and at most 1"),
        (1e-7, "below one millionth"),
        ("abc", "must be a number such as 0.02"),
        ("", "must be a number such as 0.02"),
        (None, "must be a number such as 0.02"),
        ([0.1], "must be a number such as 0.02"),
        (True, "must be a number such as 0.02, not True"),
    ],
)
def test_invalid_fractions(value, words):
    with pytest.raises(InvalidRequest, match=words):
        validate(value)


@pytest.mark.parametrize(
    "fraction, group, name, display",
    [
        (0.02, None, "python3-gpu-0.02", "Python 3 (GPU 0.02)"),
        (0.05, "ml101", "ml101-gpu-0.05", "Python 3 (GPU 0.05, ml101)"),
        (1, None, "python3-gpu-1", "Python 3 (GPU 1)"),
        (
            0.125,
            "Deep Learning/2025",
            "deep-learning-2025-gpu-0.125",
            "Python 3 (GPU 0.125, Deep Learning/2025)",
        ),
        (0.000001, None, "python3-gpu-0.000001", "Python 3 (GPU 0.000001)"),
    ],
)
def test_names(fraction, group, name, display):
    assert ks.default_name(fraction, group) == name
    assert ks.validate_name(name) == name
    assert ks.default_display_name(fraction, group) == display


def test_build_kernelspec_is_the_design_shape():
    assert ks.build_kernelspec(0.02) == {
        "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (GPU 0.02)",
        "language": "python",
        "metadata": {
            "kernel_provisioner": {
                "provisioner_name": "gpu-lease-provisioner",
                "config": {"fraction": 0.02},
            }
        },
    }


def test_build_kernelspec_with_every_option():
    spec = ks.build_kernelspec(
        0.05,
        display_name="ML 101 (GPU)",
        group="ml101",
        python="/opt/conda/envs/tf/bin/python",
        enforcement="mps",
        queue_timeout=300,
    )
    assert spec["argv"][0] == "/opt/conda/envs/tf/bin/python"
    assert spec["display_name"] == "ML 101 (GPU)"
    assert spec["metadata"]["kernel_provisioner"]["config"] == {
        "fraction": 0.05,
        "group": "ml101",
        "enforcement": "mps",
        "queue_timeout": 300,
    }
    text = ks.spec_json(spec).lower()
    for secret in ("http", "token", "url", "password"):
        assert secret not in text


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"enforcement": "strict"}, "Unknown enforcement"),
        ({"queue_timeout": -1}, "queue timeout"),
        ({"queue_timeout": math.nan}, "queue timeout"),
        ({"queue_timeout": "10"}, "queue timeout"),
        ({"group": ""}, "course group"),
        ({"python": ""}, "kernel's Python"),
    ],
)
def test_build_kernelspec_refuses(kwargs, words):
    with pytest.raises(InvalidRequest, match=words):
        ks.build_kernelspec(0.1, **kwargs)


@pytest.mark.parametrize("name", ["", "a b", "gpu/0.02", "ü", "x;rm"])
def test_invalid_names(name):
    with pytest.raises(InvalidRequest, match="only letters, digits"):
        ks.validate_name(name)


def test_ready_kernelspecs_match_the_builder():
    ready = ks.ready_kernelspecs()
    assert sorted(ready) == sorted(
        f"python3-gpu-{f}" for f in ("0.02", "0.05", "0.1", "0.25", "0.5", "1")
    )
    on_disk = {p.parent.name: p for p in (REPO / "kernelspecs").glob("*/kernel.json")}
    assert sorted(on_disk) == sorted(ready)
    for name, spec in ready.items():
        assert on_disk[name].read_text(encoding="utf-8") == ks.spec_json(spec), (
            f"kernelspecs/{name}/kernel.json drifted from build_kernelspec(); regenerate it"
        )


def test_gpu_config():
    assert ks.gpu_config(ks.build_kernelspec(0.1)) == {"fraction": 0.1}
    assert ks.gpu_config({"argv": ["python"], "metadata": {}}) is None
    assert (
        ks.gpu_config({"metadata": {"kernel_provisioner": {"provisioner_name": "other"}}}) is None
    )


def test_install_list_remove_round_trip(tmp_path):
    prefix = str(tmp_path / "prefix")
    path = ks.install(ks.build_kernelspec(0.02), "python3-gpu-0.02", prefix=prefix)
    assert Path(path) == tmp_path / "prefix" / "share" / "jupyter" / "kernels" / "python3-gpu-0.02"
    installed = json.loads((Path(path) / "kernel.json").read_text())
    assert installed == ks.build_kernelspec(0.02)
    assert (Path(path) / "logo-64x64.png").is_file()  # ipykernel's logo

    ks.install(ks.build_kernelspec(0.05, group="ml101"), "ml101-gpu-0.05", prefix=prefix)
    # reinstalling replaces
    ks.install(
        ks.build_kernelspec(0.05, group="ml101", display_name="ML"), "ml101-gpu-0.05", prefix=prefix
    )

    # a plain kernelspec in the same place is not listed and not removable here
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "kernel.json").write_text(
        json.dumps({"argv": ["python"], "display_name": "P", "language": "python"})
    )
    from jupyter_client.kernelspec import KernelSpecManager

    KernelSpecManager().install_kernel_spec(str(plain), "plain", prefix=prefix)

    listed = [s for s in ks.list_gpu_kernelspecs(prefix=prefix) if s["path"].startswith(prefix)]
    assert [(s["name"], s["fraction"], s["group"], s["display_name"]) for s in listed] == [
        ("ml101-gpu-0.05", 0.05, "ml101", "ML"),
        ("python3-gpu-0.02", 0.02, None, "Python 3 (GPU 0.02)"),
    ]
    with pytest.raises(InvalidRequest, match="not a GPU lease kernelspec"):
        ks.remove("plain", prefix=prefix)

    assert ks.remove("python3-gpu-0.02", prefix=prefix) == path
    assert not Path(path).exists()
    with pytest.raises(InvalidRequest, match="no kernelspec named 'python3-gpu-0.02'"):
        ks.remove("python3-gpu-0.02", prefix=prefix)
    assert [
        s["name"] for s in ks.list_gpu_kernelspecs(prefix=prefix) if s["path"].startswith(prefix)
    ] == ["ml101-gpu-0.05"]


def test_install_for_the_user(tmp_path):
    path = ks.install(ks.build_kernelspec(0.1), "python3-gpu-0.1", user=True)
    assert Path(path) == tmp_path / "user-data" / "kernels" / "python3-gpu-0.1"
    mine = [s["name"] for s in ks.list_gpu_kernelspecs() if s["path"].startswith(str(tmp_path))]
    assert mine == ["python3-gpu-0.1"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"user": True, "prefix": "/x"}, "Choose one place"),
        ({"sys_prefix": True, "user": True}, "Choose one place"),
    ],
)
def test_install_refuses(kwargs, words):
    with pytest.raises(InvalidRequest, match=words):
        ks.install(ks.build_kernelspec(0.1), "x", **kwargs)


def test_install_refuses_bad_name(tmp_path):
    with pytest.raises(InvalidRequest, match="only letters"):
        ks.install(ks.build_kernelspec(0.1), "bad name", prefix=str(tmp_path))
