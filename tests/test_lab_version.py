"""The JupyterLab installed here is one the extension supports, and still has the private
``SessionContext._pendingKernelName`` the extension sets while a reloaded page waits for its
kernel's GPU (src/pending.ts). A JupyterLab upgrade that renames it fails here, in
``make test``, instead of silently in a student's browser. (test/unit/pending.spec.ts
checks the JupyterLab packages the extension is built against the same way.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PACKAGE = json.loads((ROOT / "package.json").read_text())


def supported(version: str, spec: str) -> bool:
    """``version`` ("4.6.6") within ``spec`` (">=4.2 <5", as package.json writes it)."""

    def parse(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3]) + (0,) * 3

    ok = True
    for op, bound in re.findall(r"(>=|<)\s*([\d.]+)", spec):
        here, there = parse(version)[:3], parse(bound)[:3]
        ok = ok and (here >= there if op == ">=" else here < there)
    return ok


def test_the_version_check_can_fail() -> None:
    spec = PACKAGE["supportedJupyterLab"]
    assert supported("4.6.6", spec) and supported("4.2.0", spec)
    assert not supported("4.1.9", spec) and not supported("5.0.0", spec)


def test_the_supported_versions_are_written_the_same_everywhere() -> None:
    spec = PACKAGE["supportedJupyterLab"]
    pending = (ROOT / "src" / "pending.ts").read_text()
    assert f"export const SUPPORTED_JUPYTERLAB = '{spec}';" in pending
    pyproject = (ROOT / "pyproject.toml").read_text()
    low, high = re.findall(r"[\d.]+", spec)
    assert f'"jupyterlab>={low},<{high}"' in pyproject


def test_the_installed_jupyterlab_is_supported_and_has_the_private_field() -> None:
    try:
        from jupyterlab import __version__
        from jupyterlab.commands import get_app_dir
    except ImportError:
        pytest.skip("JupyterLab is not installed in this Python")
    spec = PACKAGE["supportedJupyterLab"]
    assert supported(__version__, spec), (
        f"JupyterLab {__version__} is outside the versions the extension supports ({spec}): "
        "check src/pending.ts against it, then widen supportedJupyterLab in package.json, "
        "src/pending.ts and pyproject.toml"
    )
    bundles = list(Path(get_app_dir(), "static").glob("jlab_core*.js"))
    assert bundles, f"no jlab_core bundle in {get_app_dir()}/static"
    core = "".join(p.read_text(errors="replace") for p in bundles)
    missing = [
        what
        for what, pattern in [
            ("set empty on construction", r'this\._pendingKernelName=""'),
            ("read for the kernel's name", r"kernelspecs\[this\._pendingKernelName\]"),
            (
                "read for the kernel's status",
                r'this\._pendingKernelName===this\.noKernelName\?"unknown".{0,400}"initializing"',
            ),
        ]
        if not re.search(pattern, core)
    ]
    assert not missing, (
        f"JupyterLab {__version__}'s SessionContext no longer has _pendingKernelName as the "
        f"extension uses it ({', '.join(missing)}): a page reloaded while its kernel waits "
        "would show 'No Kernel' (src/pending.ts)"
    )
