"""Every refusal is readable whole in JupyterLab's "Error Starting Kernel", at 1280 and 1920 px.

One hub for the module (``tests.test_hub.Hub``, hub_config with the launcher *marking* the
kernels a user can never start, so that guest01 can click them) and Debian's chromium
driven by Playwright. guest01 (in no course; the default quota: one kernel of at most
0.05) clicks five launcher cards, one per kind of refusal:

==================  ================================================================
quota               holds a GPU kernel already; starts "Python 3 (GPU 0.02)"
course              "Python 3 (GPU 0.05, ml101)", a course guest01 is not in
can never fit       "Python 3 (GPU 0.01)": 327 MiB of the V100, below the 512 MiB context
queue timeout       the V100 is held whole by another user; a 0.05 kernel waiting 3 s
no MPS daemon       "MPS GPU 0.02" (enforcement=mps): granted, then refused before launch
==================  ================================================================

For each, at 1280 and at 1920 px wide: the dialog's text box lies inside the dialog, the
text is not clipped (no horizontal overflow), and it is the whole of the sentence the
server's REST API gives for the same start (whitespace aside), without tornado's "%%".
Screenshots go to ``tmp_path`` (and to ``$GPU_LEASE_SCREENSHOT_DIR`` when set: the
docs' pictures are made this way).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from provisioner.kernel import kernelspecs as ks

from .test_browser_hub import (
    KERNEL_MS,
    held_lease,
    launcher_card,
    marked_hub,
    open_lab,
)
from .test_hub import Hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(600)]

WIDTHS = (1280, 1920)
USER = "guest01"
FILLER = "student59"  # holds the whole V100 for the queue timeout


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with marked_hub(tmp_path_factory) as h:
        prefix = str(h.tmp / "prefix")  # the servers' JUPYTER_PATH: new specs show at once
        ks.install(ks.build_kernelspec(0.01), "python3-gpu-0.01", prefix=prefix)
        ks.install(
            ks.build_kernelspec(0.05, display_name="Quick GPU 0.05", queue_timeout=3),
            "quick-gpu-0.05",
            prefix=prefix,
        )
        # no MPS daemon runs for the V100 under this directory: refused after the grant
        mps = ks.build_kernelspec(0.02, display_name="MPS GPU 0.02", enforcement="mps")
        mps["metadata"]["kernel_provisioner"]["config"]["mps_dir"] = str(h.tmp / "no-mps")
        ks.install(mps, "mps-gpu-0.02", prefix=prefix)
        yield h


GEOMETRY = """() => {
  const box = e => { const r = e.getBoundingClientRect();
                     return {left: r.left, top: r.top, right: r.right, bottom: r.bottom}; };
  const dialog = document.querySelector('.jp-Dialog-content');
  const pre = document.querySelector('.jp-Dialog-body pre');
  return {dialog: box(dialog), text: box(pre), text_scroll: pre.scrollWidth,
          text_client: pre.clientWidth, window: window.innerWidth, message: pre.innerText};
}"""


def settled(page: Any) -> None:
    """Two animation frames: the layout after a resize has been computed and painted."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def words(text: str) -> str:
    return " ".join(text.split())


def refused(hub: Hub, spec: str) -> str:
    """The sentence the server's REST API answers for the same start (what the dialog shows)."""
    r = hub.start_kernel(USER, spec)
    assert r.status_code >= 400, r.text
    return str(r.json()["message"])


def dialog_for(page: Any, lab: str, case: str, card_label: str) -> Any:
    """Open a fresh workspace, click the card, wait for "Error Starting Kernel"."""
    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    page.goto(f"{lab}/workspaces/{case}?reset")
    card = launcher_card(page, card_label)
    card.first.wait_for(timeout=KERNEL_MS)
    card.first.click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=KERNEL_MS)
    assert "Error Starting Kernel" in dialog.locator(".jp-Dialog-header").inner_text()
    return dialog


def check_fits(page: Any, expected: str, case: str, shots: list[Path]) -> None:
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        settled(page)
        g = page.evaluate(GEOMETRY)
        d, t = g["dialog"], g["text"]
        assert g["window"] == width
        where = f"{case} at {width} px: {g}"
        assert d["left"] >= 0 and d["right"] <= width, where
        assert d["left"] <= t["left"] and t["right"] <= d["right"], where
        assert d["top"] <= t["top"] and t["bottom"] <= d["bottom"], where
        assert g["text_scroll"] <= g["text_client"], where  # nothing cut off on the right
        assert words(g["message"]) == words(expected), where
        assert "%%" not in g["message"], where
        if width == 1280:
            for shot in shots:
                page.screenshot(path=str(shot))
    page.click(".jp-Dialog .jp-mod-accept")


def test_each_refusal_is_readable_whole(chromium: Any, hub: Hub, tmp_path: Path) -> None:
    context, page = open_lab(chromium, hub, USER)
    lab = f"{hub.url}/user/{USER}/lab"
    out_dir = os.environ.get("GPU_LEASE_SCREENSHOT_DIR")

    def shots(name: str) -> list[Path]:
        paths = [tmp_path / f"{name}-1280.png"]
        if out_dir:
            paths.append(Path(out_dir) / f"refusal-{name}-1280.png")
        return paths

    try:
        # 1. quota: guest01 already holds the one kernel the default quota allows
        with held_lease(hub, USER, 0.02):
            expected = refused(hub, "python3-gpu-0.02")
            assert "You already hold or wait for 1 GPU kernel" in expected, expected
            dialog_for(page, lab, "quota", "Python 3 (GPU 0.02)")
            check_fits(page, expected, "quota", shots("quota"))
        # 2. a course guest01 is not in
        expected = refused(hub, "ml101-gpu-0.05")
        assert "reserved for course 'ml101'" in expected, expected
        dialog_for(page, lab, "course", "Python 3 (GPU 0.05, ml101)")
        check_fits(page, expected, "course", shots("course"))
        # 3. can never fit: 0.01 of a 32 GiB V100 is below the CUDA context
        expected = refused(hub, "python3-gpu-0.01")
        assert "smallest fraction that works is 0.015656" in " ".join(expected.split())
        dialog_for(page, lab, "never-fits", "Python 3 (GPU 0.01)")
        check_fits(page, expected, "never-fits", shots("never-fits"))
        # 4. queue timeout: another user holds the whole V100
        r = hub.req(
            "PUT",
            f"{hub.broker}/api/v1/quotas/users/{FILLER}",
            json={"max_fraction": 1, "max_leases": 1, "max_lease_fraction": 1},
        )
        assert r.status_code == 200, r.text
        with ExitStack() as stack:
            stack.enter_context(held_lease(hub, FILLER, 1.0))
            expected = refused(hub, "quick-gpu-0.05")
            assert "No GPU became free" in expected and "position 1" in expected, expected
            dialog_for(page, lab, "queue-timeout", "Quick GPU 0.05")
            check_fits(page, expected, "queue-timeout", shots("queue-timeout"))
        # 5. enforcement=mps on a node where no MPS daemon runs: the lease is given back
        expected = refused(hub, "mps-gpu-0.02")
        assert "no MPS control daemon runs for GPU" in expected, expected
        dialog_for(page, lab, "no-mps", "MPS GPU 0.02")
        check_fits(page, expected, "no-mps", shots("no-mps"))
        assert hub.leases(USER) == []
    finally:
        context.close()
