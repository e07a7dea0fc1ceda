"""The gpu-lease command: kernelspec install/list/remove, errors, and the stubs' flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from provisioner.cli import build_parser, main
from provisioner.kernel import kernelspecs as ks


@pytest.fixture(autouse=True)
def isolated_jupyter(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user-data"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter-path"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")


def mine(listing: dict, root: Path) -> list[dict]:
    return [s for s in listing["kernelspecs"] if s["path"].startswith(str(root))]


def test_install_list_remove(tmp_path, capsys):
    prefix = str(tmp_path / "p")
    assert main(["kernelspec", "install", "--fraction", "0.02", "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Installed kernelspec python3-gpu-0.02 (Python 3 (GPU 0.02)) in ")
    kernel_json = tmp_path / "p/share/jupyter/kernels/python3-gpu-0.02/kernel.json"
    assert json.loads(kernel_json.read_text()) == ks.build_kernelspec(0.02)

    argv = ["kernelspec", "install", "--fraction", "0.05", "--group", "ml101", "--prefix", prefix]
    argv += ["--display-name", "ML 101", "--python", "/opt/tf/bin/python", "--enforcement", "mps"]
    argv += ["--queue-timeout", "120", "--name", "ml101-tf"]
    assert main(argv) == 0
    spec = json.loads((tmp_path / "p/share/jupyter/kernels/ml101-tf/kernel.json").read_text())
    assert spec == ks.build_kernelspec(
        0.05,
        group="ml101",
        display_name="ML 101",
        python="/opt/tf/bin/python",
        enforcement="mps",
        queue_timeout=120.0,
    )
    capsys.readouterr()

    assert main(["kernelspec", "list", "--json", "--prefix", prefix]) == 0
    listed = mine(json.loads(capsys.readouterr().out), tmp_path)
    assert [(s["name"], s["fraction"], s["group"]) for s in listed] == [
        ("ml101-tf", 0.05, "ml101"),
        ("python3-gpu-0.02", 0.02, None),
    ]
    assert main(["kernelspec", "list", "--prefix", prefix]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["NAME", "FRACTION", "GROUP"]
    assert any(line.startswith("python3-gpu-0.02") and " 0.02 " in line for line in table)

    assert main(["kernelspec", "remove", "python3-gpu-0.02", "ml101-tf", "--prefix", prefix]) == 0
    assert capsys.readouterr().out.count("Removed kernelspec") == 2
    assert main(["kernelspec", "list", "--json", "--prefix", prefix]) == 0
    assert mine(json.loads(capsys.readouterr().out), tmp_path) == []


def test_user_install(tmp_path, capsys):
    assert main(["kernelspec", "install", "--fraction", "1", "--user"]) == 0
    assert (tmp_path / "user-data/kernels/python3-gpu-1/kernel.json").is_file()


@pytest.mark.parametrize(
    "fraction, words",
    [
        ("nan", "must be a finite number such as 0.02, not nan"),
        ("inf", "must be a finite number"),
        ("0", "must be greater than 0 and at most 1"),
        ("1.5", "must be greater than 0 and at most 1"),
        ("-0.1", "must be greater than 0 and at most 1"),
        ("lots", "must be a number such as 0.02"),
    ],
)
def test_invalid_fraction_is_refused(tmp_path, capsys, fraction, words):
    code = main(["kernelspec", "install", "--fraction", fraction, "--prefix", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "argument --fraction: The GPU fraction " in err and words in err
    assert not (tmp_path / "share").exists()


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["kernelspec", "remove", "nope"], 1, "error: There is no kernelspec named 'nope'"),
        (
            ["kernelspec", "install", "--fraction", "0.1", "--name", "a b"],
            1,
            "error: Kernelspec names may contain",
        ),
        (["kernelspec", "install"], 2, "the following arguments are required: --fraction"),
        (
            ["kernelspec", "install", "--fraction", "0.1", "--user", "--sys-prefix"],
            2,
            "not allowed with",
        ),
        (["kernelspec", "install", "--fraction", "0.1", "--queue-timeout", "-3"], 2, "0 or more"),
        (["kernelspec", "install", "--fraction", "0.1", "--enforcement", "x"], 2, "invalid choice"),
        (["kernelspec", "list", "--bogus"], 2, "unrecognized arguments: --bogus"),
        ([], 2, "required: COMMAND"),
    ],
)
def test_errors(capsys, argv, code, words):
    assert main(argv) == code
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["top"], {"command": "top", "url": None}),
        (["leases", "--all"], {"all": True, "user": None}),
        (
            ["leases", "--user", "ada", "--url", "http://b:10101"],
            {"user": "ada", "url": "http://b:10101"},
        ),
        (
            [
                "quota",
                "set",
                "--group",
                "ml101",
                "--max-fraction",
                "0.5",
                "--max-leases",
                "3",
                "--max-lease-fraction",
                "0.25",
                "--budget-fraction-hours",
                "10",
                "--budget-window",
                "7d",
                "--priority",
                "5",
            ],
            {
                "action": "set",
                "group": "ml101",
                "user": None,
                "default": False,
                "max_fraction": 0.5,
                "max_leases": 3,
                "max_lease_fraction": 0.25,
                "budget_fraction_hours": 10.0,
                "budget_window": "7d",
                "priority": 5,
            },
        ),
        (["quota", "show", "--default"], {"action": "show", "default": True}),
        (["quota", "list"], {"action": "list"}),
        (["quota", "remove", "--user", "ada"], {"action": "remove", "user": "ada"}),
        (
            ["usage", "--since", "7d", "--by", "group", "--csv"],
            {"since": "7d", "by": "group", "csv": True},
        ),
        (["usage"], {"by": "user", "csv": False, "since": None}),
    ],
)
def test_broker_command_flags(argv, expected):
    """The admin commands' flags parse as documented (their behaviour: test_cli_admin.py)."""
    args = build_parser().parse_args(argv)
    for key, value in expected.items():
        assert getattr(args, key) == value


@pytest.mark.parametrize(
    "argv, words",
    [
        (["quota", "set", "--user", "a", "--group", "b"], "not allowed with"),
        (["quota", "set", "--max-fraction", "nan"], "expected a finite float of 0 or more"),
        (["quota", "grant"], "invalid choice"),
        (["usage", "--by", "course"], "invalid choice"),
    ],
)
def test_broker_command_usage_errors(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_broker_gets_its_arguments_untouched():
    seen: list[list[str]] = []
    argv = ["--ip", "127.0.0.1", "--port", "10101", "--gpus", "1x32768:V100", "--help"]
    assert main(["broker", *argv], run_broker=lambda a: seen.append(a) or 0) == 0
    assert seen == [argv]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("gpu-lease ")


@pytest.mark.slow
def test_console_script_and_python_m(tmp_path):
    script = shutil.which("gpu-lease", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the package is not installed (pip install -e .): no gpu-lease script")
    env = {
        **os.environ,
        "JUPYTER_DATA_DIR": str(tmp_path / "user-data"),
        "JUPYTER_PATH": str(tmp_path / "jp"),
    }
    prefix = str(tmp_path / "p")
    run = subprocess.run(
        [
            script,
            "kernelspec",
            "install",
            "--fraction",
            "0.25",
            "--group",
            "ml101",
            "--prefix",
            prefix,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "Installed kernelspec ml101-gpu-0.25" in run.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "provisioner", "kernelspec", "list", "--json", "--prefix", prefix],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert [s["name"] for s in mine(json.loads(listed.stdout), tmp_path)] == ["ml101-gpu-0.25"]
    bad = subprocess.run(
        [script, "kernelspec", "install", "--fraction", "nan"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "The GPU fraction must be a finite number" in bad.stderr


# -- no silent overwrite, no kernel that can never fit ---------------------------------
def test_install_refuses_to_overwrite_without_replace(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GPU_LEASE_URL", raising=False)
    prefix = str(tmp_path / "p")
    argv = [
        "kernelspec",
        "install",
        "--fraction",
        "0.05",
        "--name",
        "ml101-gpu",
        "--prefix",
        prefix,
    ]
    assert main([*argv, "--display-name", "First"]) == 0
    kernel_json = tmp_path / "p/share/jupyter/kernels/ml101-gpu/kernel.json"
    capsys.readouterr()
    assert main([*argv, "--display-name", "Second"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: A kernelspec named 'ml101-gpu' (First) is already installed in ")
    assert "Add --replace to overwrite it" in err
    assert json.loads(kernel_json.read_text())["display_name"] == "First"
    assert main([*argv, "--display-name", "Second", "--replace"]) == 0
    assert json.loads(kernel_json.read_text())["display_name"] == "Second"


@pytest.mark.parametrize(
    "fraction, warned",
    [("0.01", "less than 51300 MiB (50.1 GiB)"), ("0.015", "less than 34200 MiB"), ("0.02", None)],
)
def test_install_warns_about_a_fraction_that_may_never_fit(
    tmp_path, capsys, monkeypatch, fraction, warned
):
    """Without a broker to ask, a warning says below which GPU size the kernel gets nothing."""
    monkeypatch.delenv("GPU_LEASE_URL", raising=False)
    prefix = str(tmp_path / "p")
    assert main(["kernelspec", "install", "--fraction", fraction, "--prefix", prefix]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Installed kernelspec")
    if warned is None:
        assert err == ""
    else:
        assert err.startswith(f"warning: a GPU fraction of {fraction} leaves a kernel no GPU ")
        assert warned in err and "512 MiB" in err and "GPU_LEASE_URL" in err
