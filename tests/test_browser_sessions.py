"""What a member and a non-member see of a class session in JupyterLab, in a real browser
behind a real JupyterHub (the demo, 1x32768:V100; ``tests.test_hub.Hub``).

The course's instructor starts a session of ml101 by hand (5 seats at its 0.05: a quarter of
the V100). student01 (ml101) opens a GPU notebook: the status bar says the lease and "GPU
reserved for ml101 until HH:MM". The admin then holds the rest of the pool beside the
share; guest01 (in no course) opens one: it waits, and the status bar's tooltip says first
that part of the GPUs is reserved for ml101's class session until HH:MM.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from provisioner.devtools.testing import wait_for

from .test_browser_hub import KERNEL_MS
from .test_browser_lab import (
    STATUS,
    _extension_installed,
    holding,
    open_gpu_notebook,
    open_lab,
    wait_status,
)
from .test_hub import Hub, running_hub

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    if not _extension_installed():
        pytest.skip("the JupyterLab extension is not installed here (make install builds it)")
    with running_hub(tmp_path_factory.mktemp("hub")) as h:
        yield h


def test_a_member_and_a_non_member_see_the_class_session(
    chromium: Any, hub: Hub, tmp_path: Path
) -> None:
    until = time.time() + 3600
    r = hub.req(
        "POST",
        f"{hub.broker}/api/v1/sessions/ml101",
        hub.token("instructor"),
        json={"until": until, "seats": 5, "tz": "UTC"},
    )
    assert r.status_code == 201, r.text
    clock = f"{dt.datetime.fromtimestamp(until, dt.UTC):%H:%M}"

    context, page = open_lab(chromium, hub, "student01")
    open_gpu_notebook(page)
    text = wait_status(page, "GPU reserved for ml101", timeout=KERNEL_MS / 1000)
    assert text == f"GPU 0.02 · V100 · cap 143 MiB · GPU reserved for ml101 until {clock}"
    assert f"GPU reserved for ml101 until {clock}" in page.locator(STATUS).get_attribute("title")
    page.locator(".jp-StatusBar-Widget").screenshot(path=str(tmp_path / "member.png"))
    context.close()

    # the admin holds everything beside ml101's share: a non-member's kernel waits
    free = round(0.75 - sum(x["fraction"] for x in hub.leases() if "ml101" not in x["groups"]), 6)
    with holding(hub, "admin", free):
        context, page = open_lab(chromium, hub, "guest01")
        open_gpu_notebook(page)
        wait_status(page, r"^GPU queue: ")
        # the broker's why comes with its answer to the request (the status bar may show the
        # place first, from the server's own record of the waiting kernel)
        why = f"Part of the GPUs you may use is reserved for ml101's class session until {clock}."

        def tooltip() -> str:
            return str(page.locator(STATUS).get_attribute("title") or "")

        wait_for(
            lambda: tooltip().startswith(why),
            60,
            f"the status bar's tooltip to start with {why!r}",
            0.25,
            lambda: f"the tooltip: {tooltip()!r}",
        )
        page.locator(".jp-StatusBar-Widget").screenshot(path=str(tmp_path / "non-member.png"))
        context.close()
