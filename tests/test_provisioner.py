"""GPULeaseProvisioner with real processes: a broker subprocess, real ipykernel kernels
started through jupyter_client's kernel managers, and a real ``jupyter server``.

The kernelspecs live in a temporary ``JUPYTER_PATH``; the "server" environment (this
test process, or the ``jupyter server`` subprocess) has ``GPU_LEASE_URL`` and
``GPU_LEASE_TOKEN``. The broker runs with a short TTL so that renewals, outages and
expiry happen within seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from jupyter_client.ioloop import AsyncIOLoopKernelManager
from jupyter_client.manager import AsyncKernelManager, KernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from jupyter_core.utils import ensure_event_loop
from traitlets.config import Config

from provisioner.devtools.testing import (
    execute,
    free_port,
    stop_process,
    wait_for,
    wait_for_async,
    wait_for_http,
)
from provisioner.errors import BrokerUnavailable, InvalidRequest, NoCapacity
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json
from provisioner.kernel.provisioner import GPULeaseProvisioner

#: every broker here: TTL 6 s, reaper twice a second
BROKER = ("--ttl", "6", "--GPULeaseBroker.reap_interval=0.5")
HUB_TOKEN = "hub-token-the-kernel-already-had"
#: the ``broker`` fixture's object (tests/conftest.py); not imported, so that this module
#: works whether or not tests/ is a package
Broker = Any

pytestmark = [pytest.mark.broker_args(*BROKER)]


@pytest.fixture
def broker_db_url(tmp_path: Path) -> str:
    """SQLite only: the broker's own tests cover PostgreSQL."""
    return f"sqlite:///{tmp_path / 'b.sqlite'}"


class Specs:
    """GPU kernelspecs in a temporary JUPYTER_PATH."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(
        self, name: str, fraction: float, *, argv: list[str] | None = None, **config: Any
    ) -> str:
        spec = build_kernelspec(fraction)
        spec["metadata"]["kernel_provisioner"]["config"].update(
            {"renew_interval": 1.0, "long_poll": 1.0, **config}
        )
        if argv is not None:
            spec["argv"] = argv
        folder = self.root / "kernels" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.json").write_text(spec_json(spec))
        return name


@pytest.fixture
def specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Specs:
    root = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    s = Specs(root)
    s.add("gpu-0.02", 0.02)
    return s


@pytest.fixture
def server_env(broker: Broker, specs: Specs, monkeypatch: pytest.MonkeyPatch) -> Broker:
    """This process plays the Jupyter server: broker URL and alice's token in its environment."""
    monkeypatch.setenv("GPU_LEASE_URL", broker.url)
    monkeypatch.setenv("GPU_LEASE_TOKEN", broker.tokens["alice"])
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", HUB_TOKEN)
    for name in ("GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS"):
        monkeypatch.delenv(name, raising=False)
    return broker


# -- helpers ---------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def exists(path: Path) -> bool:
    return path.exists()


def file_mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def lease_state(broker: Broker, lease_id: str) -> str:
    r = httpx.get(f"{broker.url}/api/v1/leases/{lease_id}", headers=broker.headers("alice"))
    r.raise_for_status()
    return str(r.json()["state"])


def hold(broker: Broker, user: str, fraction: float) -> dict[str, Any]:
    """A lease taken directly from the broker (another user's kernel elsewhere)."""
    r = httpx.post(
        f"{broker.url}/api/v1/leases",
        json={"kernel_id": f"{user}-{uuid.uuid4()}", "fraction": fraction},
        headers=broker.headers(user),
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


def leases(broker: Broker, **params: str) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{broker.url}/api/v1/leases",
        params={"all": "1", **params},
        headers=broker.headers("admin"),
    )
    r.raise_for_status()
    return [x for x in r.json()["leases"] if x["state"] == "active"]


def lease_of(broker: Broker, kernel_id: str) -> dict[str, Any] | None:
    found = [x for x in leases(broker) if x["kernel_id"] == kernel_id]
    assert len(found) <= 1
    return found[0] if found else None


def gpus(broker: Broker) -> list[dict[str, Any]]:
    r = httpx.get(f"{broker.url}/api/v1/gpus", headers=broker.headers("alice"))
    r.raise_for_status()
    return list(r.json()["gpus"])


def queue(broker: Broker) -> list[dict[str, Any]]:
    r = httpx.get(f"{broker.url}/api/v1/queue", headers=broker.headers("admin"))
    r.raise_for_status()
    return list(r.json()["queue"])


async def start(
    name: str, tmp_path: Path, cls: type[AsyncKernelManager] = AsyncKernelManager, **kw: Any
) -> AsyncKernelManager:
    """A started kernel (its connection file under tmp_path, where the state file goes too)."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True)
    km = cls(kernel_name=name, connection_file=str(runtime / f"kernel-{uuid.uuid4()}.json"), **kw)
    await km.start_kernel()
    return km


@asynccontextmanager
async def kernel(
    name: str, tmp_path: Path, cls: type[AsyncKernelManager] = AsyncKernelManager, **kw: Any
) -> AsyncIterator[AsyncKernelManager]:
    km = await start(name, tmp_path, cls, **kw)
    try:
        yield km
    finally:
        if km.has_kernel:
            await km.shutdown_kernel(now=True)


async def run(km: AsyncKernelManager, code: str) -> str:
    """Execute ``code`` in the kernel; its stdout (the reply must be ``ok``)."""
    out, reply = await execute(km, code)
    assert reply["status"] == "ok", reply
    return out


ENV_CODE = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('GPU_LEASE', 'CUDA_', 'JUPYTERHUB_', 'XLA_'))}))"
)


async def kernel_env(km: AsyncKernelManager) -> dict[str, str]:
    return dict(json.loads((await run(km, ENV_CODE)).strip().splitlines()[-1]))


# -- configuration (no processes) ----------------------------------------------------------
def test_kernel_json_config_wins_and_env_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_LEASE_URL", "http://broker.example:10101")
    monkeypatch.setenv("GPU_LEASE_NODE", "gpu-a")
    monkeypatch.setenv("GPU_LEASE_GPU_UUIDS", "GPU-1, GPU-2,")
    specs = Specs(tmp_path / "jupyter")
    specs.add("gpu-0.05", 0.05, queue_timeout=12)
    monkeypatch.setenv("JUPYTER_PATH", str(specs.root))
    config = Config()
    config.GPULeaseProvisioner.fraction = 0.5
    config.GPULeaseProvisioner.queue_timeout = 99.0
    config.GPULeaseProvisioner.group = "ml101"
    km = AsyncKernelManager(kernel_name="gpu-0.05", config=config)
    prov = KernelProvisionerFactory.instance().create_provisioner_instance(
        "k1", km.kernel_spec, parent=km
    )
    assert isinstance(prov, GPULeaseProvisioner)
    assert prov.fraction == 0.05  # kernel.json wins
    assert prov.queue_timeout == 12
    assert prov.group == "ml101"  # from the server's config
    assert prov.broker_url == "http://broker.example:10101"
    # the node and GPUs come from the server's environment at each start (placement.py)
    ask = asyncio.run(prov._placed_ask())
    assert (ask.node, ask.gpu_uuids, ask.fraction) == ("gpu-a", ("GPU-1", "GPU-2"), 0.05)
    assert prov.enforcement == "cooperative"
    with pytest.raises(Exception, match="greater than 0 and at most 1"):
        GPULeaseProvisioner(kernel_id="k2", fraction=1.5)


# -- the kernel's life -------------------------------------------------------------------------
@pytest.mark.slow
async def test_start_env_renew_shutdown(
    server_env: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = server_env
    # jaxlib refuses its GPU backend when both names are set (seen on an H200): the kernel
    # gets the older one only, even when the server's environment carries the newer one
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    async with kernel("gpu-0.02", tmp_path) as km:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None and lease["user"] == "alice" and lease["fraction"] == 0.02
        env = await kernel_env(km)
        assert env["CUDA_VISIBLE_DEVICES"] == lease["gpu"]["uuid"]
        assert env["GPU_LEASE_ID"] == lease["id"]
        assert env["GPU_LEASE_FRACTION"] == "0.02"
        assert env["GPU_LEASE_MEMORY_MB"] == str(lease["memory_limit_mb"])
        assert "GPU_LEASE_TOKEN" not in env  # the server's broker credential stays out
        assert "XLA_CLIENT_MEM_FRACTION" not in env
        gpu_mb = lease["gpu"]["memory_mb"]
        assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * gpu_mb <= lease["memory_limit_mb"]
        assert env["JUPYTERHUB_API_TOKEN"] == HUB_TOKEN  # what the kernel already had
        state_file = Path(env["GPU_LEASE_STATE_FILE"])
        assert file_mode(state_file) == 0o600
        state = read_json(state_file)
        assert state["state"] == "active" and state["lease_id"] == lease["id"]
        # renewals every second, with the kernel's pid
        renewed = lease["renewed_at"]
        fresh = await wait_for_async(
            lambda: (x := lease_of(broker, km.kernel_id)) and x["renewed_at"] > renewed and x,
            what="a renewal",
        )
        assert fresh["pid"] == km.provisioner.pid
        info = await km.provisioner.get_provisioner_info()
        assert info["gpu_lease"]["lease_id"] == lease["id"]
        assert info["gpu_lease"]["fraction"] == 0.02
        # an IPython kernel: its %gpu cell hook asks for a parked lease back, busy or not
        assert info["gpu_lease"]["resume_when_busy"] is False
        assert km.provisioner.lease_keeper.park_watch.resume_when_busy is False
        await km.shutdown_kernel()
    assert lease_of(broker, km.kernel_id) is None
    assert not exists(state_file)  # removed at shutdown
    assert lease_state(broker, lease["id"]) == "released"


@pytest.mark.slow
async def test_restart_keeps_the_lease(server_env: Broker, tmp_path: Path) -> None:
    broker = server_env
    async with kernel("gpu-0.02", tmp_path) as km:
        before = lease_of(broker, km.kernel_id)
        assert before is not None
        pid = km.provisioner.pid
        await km.restart_kernel()
        assert km.provisioner.pid != pid
        after = lease_of(broker, km.kernel_id)
        assert after is not None and after["id"] == before["id"]
        assert (await kernel_env(km))["GPU_LEASE_ID"] == before["id"]
        assert len(leases(broker)) == 1
        await km.shutdown_kernel()
    assert leases(broker) == []


RESTARTER = {"KernelRestarter": {"time_to_dead": 0.3}}


@pytest.mark.slow
async def test_kill9_auto_restart_keeps_the_lease(server_env: Broker, tmp_path: Path) -> None:
    broker = server_env
    async with kernel(
        "gpu-0.02", tmp_path, AsyncIOLoopKernelManager, config=Config(RESTARTER)
    ) as km:
        before = lease_of(broker, km.kernel_id)
        assert before is not None
        pid = km.provisioner.pid
        os.kill(pid, signal.SIGKILL)
        await wait_for_async(
            lambda: km.provisioner.has_process and km.provisioner.pid != pid, what="auto-restart"
        )
        assert (await kernel_env(km))["GPU_LEASE_ID"] == before["id"]
        after = lease_of(broker, km.kernel_id)
        assert after is not None and after["id"] == before["id"]
        await km.shutdown_kernel()
    assert leases(broker) == []


@pytest.mark.slow
async def test_kill9_dead_kernel_releases(
    server_env: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The restarter gives up (restart_limit 0): jupyter_client calls only the "dead"
    callbacks, as jupyter_server's restarter does before it drops the kernel."""
    broker = server_env
    config = Config({"KernelRestarter": {"time_to_dead": 0.3, "restart_limit": 0}})
    caplog.set_level(logging.INFO)
    async with kernel("gpu-0.02", tmp_path, AsyncIOLoopKernelManager, config=config) as km:
        assert lease_of(broker, km.kernel_id) is not None
        os.kill(km.provisioner.pid, signal.SIGKILL)
        await wait_for_async(lambda: lease_of(broker, km.kernel_id) is None, what="release")
        assert "died and will not be restarted" in caplog.text
        km.stop_restarter()
        await km.cleanup_resources()  # what a careful owner does later: nothing left to release
    assert leases(broker) == []


@pytest.mark.slow
async def test_kill9_without_restarter_releases(server_env: Broker, tmp_path: Path) -> None:
    broker = server_env
    async with kernel("gpu-0.02", tmp_path) as km:
        assert lease_of(broker, km.kernel_id) is not None
        os.kill(km.provisioner.pid, signal.SIGKILL)
        await wait_for_async(lambda: lease_of(broker, km.kernel_id) is None, what="release")
        # the owner may still restart it: a fresh lease, released at shutdown
        await km.restart_kernel(now=True)
        assert lease_of(broker, km.kernel_id) is not None
        await km.shutdown_kernel()
    assert leases(broker) == []


@pytest.mark.slow
async def test_failed_launch_holds_nothing(
    server_env: Broker, specs: Specs, tmp_path: Path
) -> None:
    broker = server_env
    specs.add(
        "broken",
        0.02,
        argv=[
            str(tmp_path / "no-such-python"),
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
        ],
    )
    km = AsyncKernelManager(kernel_name="broken")
    with pytest.raises(FileNotFoundError):
        await km.start_kernel()
    assert leases(broker) == []
    assert queue(broker) == []


@pytest.mark.slow
async def test_a_kernel_without_the_gpu_extension_is_resumed_when_busy(
    server_env: Broker, specs: Specs, tmp_path: Path
) -> None:
    """A kernel that is not IPython's (R, Julia...; here a script that answers nothing) has no
    %gpu cell hook to ask for a parked lease back: pre_launch tells its keeper to resume it
    when the kernel is busy, and the saved provisioner info keeps that for a restarted
    server."""
    broker = server_env
    script = "import time; time.sleep(300)"
    specs.add("other", 0.02, argv=[sys.executable, "-c", script, "{connection_file}"])
    async with kernel("other", tmp_path) as km:
        assert km.provisioner.lease_keeper.park_watch.resume_when_busy is True
        assert lease_of(broker, km.kernel_id) is not None
        info = await km.provisioner.get_provisioner_info()
        assert info["gpu_lease"]["resume_when_busy"] is True
        await km.shutdown_kernel(now=True)
    # a restarted server takes the kernel back as pre_launch left it (the kernel is gone by
    # now, so its keeper then releases, finding the lease released already, and stops)
    again = KernelProvisionerFactory.instance().create_provisioner_instance(
        km.kernel_id, km.kernel_spec, parent=AsyncKernelManager(kernel_name="other")
    )
    assert isinstance(again, GPULeaseProvisioner)
    assert again.lease_keeper.park_watch.resume_when_busy is False  # until the saved info says
    await again.load_provisioner_info(info)
    assert again.lease_keeper.park_watch.resume_when_busy is True
    await wait_for_async(lambda: again.lease_keeper.renew_task is None, what="the keeper to end")
    assert leases(broker) == []


@pytest.mark.slow
async def test_mps_kernel_needs_its_gpus_daemon(
    server_env: Broker, specs: Specs, tmp_path: Path
) -> None:
    """Seen on an H200: a CUDA process pointed at a pipe directory where no MPS daemon listens
    runs without MPS, so without its limit. Such a kernel is not started, and holds nothing."""
    broker = server_env
    mps_dir = tmp_path / "mps"
    specs.add("gpu-mps", 0.02, enforcement="mps", mps_dir=str(mps_dir))
    km = AsyncKernelManager(kernel_name="gpu-mps")
    with pytest.raises(InvalidRequest) as refused:
        await km.start_kernel()
    text = " ".join(str(refused.value).split())
    assert "no MPS control daemon runs for GPU" in text
    assert "the kernel would run without its limit, so it was not started" in text
    assert "gpu-lease agent --mps" in text
    assert leases(broker) == []
    # each GPU's daemon there (its control pipe, as the real one makes it): the kernel starts
    for gpu in gpus(broker):
        pipe = mps_dir / gpu["uuid"] / "pipe"
        pipe.mkdir(parents=True)
        os.mkfifo(pipe / "control")
    async with kernel("gpu-mps", tmp_path) as km:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None
        env = await kernel_env(km)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(mps_dir / lease["gpu"]["uuid"] / "pipe")
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={lease['memory_limit_mb']}M"
        assert env["GPU_LEASE_ENFORCEMENT"] == "mps"
    assert leases(broker) == []


# -- a full pool --------------------------------------------------------------------------------
@pytest.mark.slow
async def test_full_pool_third_kernel_waits_then_starts(
    server_env: Broker, specs: Specs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker = server_env
    specs.add("gpu-0.5", 0.5)
    caplog.set_level(logging.INFO)
    async with kernel("gpu-0.5", tmp_path) as first, kernel("gpu-0.5", tmp_path):
        third = asyncio.ensure_future(start("gpu-0.5", tmp_path))
        try:
            await wait_for_async(lambda: len(queue(broker)) == 1, what="the third request to queue")
            await wait_for_async(lambda: "waits at position 1" in caplog.text, what="the log")
            assert not third.done()
            await first.shutdown_kernel()
            km = await asyncio.wait_for(third, 20)
        except BaseException:
            third.cancel()
            raise
        try:
            assert lease_of(broker, km.kernel_id) is not None
            assert len(leases(broker)) == 2
        finally:
            await km.shutdown_kernel(now=True)
    assert leases(broker) == []


@pytest.mark.slow
async def test_queue_timeout_says_where_it_waited(
    server_env: Broker, specs: Specs, tmp_path: Path
) -> None:
    broker = server_env
    specs.add("gpu-0.5-impatient", 0.5, queue_timeout=1.5, long_poll=0.5)
    hold(broker, "bob", 1.0)
    km = AsyncKernelManager(kernel_name="gpu-0.5-impatient")
    with pytest.raises(NoCapacity) as info:
        await km.start_kernel()
    message = str(info.value)
    assert "position 1" in message
    # the place is said once (the broker's message says it too), the GPU by its
    # index as `gpu-lease top` names it (not a UUID), and no advice to pick a smaller kernel
    # while nothing smaller could start either (the GPU is fully held)
    assert message.count("position") == 1, message
    assert "GPU 0 (V100) is 100 percent allocated" in message, message  # as the dialog shows it
    assert "smaller GPU fraction" not in message, message
    assert [x["user"] for x in leases(broker)] == ["bob"]
    assert queue(broker) == []  # the request was withdrawn


@pytest.mark.slow
async def test_broker_down_at_start(
    server_env: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_LEASE_URL", f"http://127.0.0.1:{free_port()}")
    km = AsyncKernelManager(kernel_name="gpu-0.02")
    with pytest.raises(BrokerUnavailable, match="Cannot reach the GPU lease broker"):
        await km.start_kernel()
    assert not km.has_kernel


@pytest.mark.slow
@pytest.mark.broker_process  # kill -9, then the same port and database
async def test_broker_outage_leaves_the_kernel_running(
    server_env: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker = server_env
    caplog.set_level(logging.INFO)
    async with kernel("gpu-0.02", tmp_path) as km:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None
        broker.kill9()
        await wait_for_async(lambda: "Could not renew GPU lease" in caplog.text, what="the warning")
        await asyncio.sleep(1.5)
        assert await km.is_alive()
        assert (await run(km, "print(6 * 7)")).strip() == "42"
        broker.start()  # same port, same database
        back = time.time()
        renewed = await wait_for_async(
            lambda: (x := lease_of(broker, km.kernel_id)) and x["renewed_at"] > back and x,
            what="renewals to resume",
        )
        assert renewed["id"] == lease["id"]
        await km.shutdown_kernel()
    assert leases(broker) == []


@pytest.mark.slow
@pytest.mark.broker_args(*BROKER, "--GPULeaseBroker.idle_reclaim_after=1")
async def test_revoked_lease_stops_the_kernel(
    server_env: Broker, specs: Specs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker = server_env
    specs.add("gpu-1", 1.0)
    caplog.set_level(logging.INFO)
    async with kernel("gpu-1", tmp_path) as km:
        state_file = Path((await kernel_env(km))["GPU_LEASE_STATE_FILE"])
        await asyncio.sleep(1.2)  # idle for longer than idle_reclaim_after
        async with broker.client("bob") as bob:
            r = await bob.post("/leases", json={"kernel_id": "bobs", "fraction": 0.5, "wait": 15})
        assert r.status_code == 201  # the idle kernel's lease was reclaimed for bob
        await wait_for_async(lambda: not km.has_kernel, what="the kernel to stop")
        state = read_json(state_file)
        assert state["state"] == "revoked"
        assert "idle" in state["reason"]
        assert "was revoked" in caplog.text and "Shutting the kernel down" in caplog.text
    assert [x["user"] for x in leases(broker)] == ["bob"]
    os.unlink(state_file)


@pytest.mark.slow
async def test_expired_lease_is_taken_back(server_env: Broker, tmp_path: Path) -> None:
    """The server was cut off beyond the TTL: the next renewal gets the share back."""
    broker = server_env
    async with kernel("gpu-0.02", tmp_path) as km:
        prov = km.provisioner
        assert isinstance(prov, GPULeaseProvisioner)
        old = lease_of(broker, km.kernel_id)
        assert old is not None
        task = prov.lease_keeper.renew_task
        assert task is not None
        task.cancel()  # the server stops renewing (suspended, cut off)
        await wait_for_async(
            lambda: lease_of(broker, km.kernel_id) is None, timeout=20, what="expiry"
        )
        assert await prov.lease_keeper.renew_once()
        new = lease_of(broker, km.kernel_id)
        assert new is not None and new["id"] != old["id"]
        assert new["gpu"]["uuid"] == old["gpu"]["uuid"]
        assert await km.is_alive()
        await km.shutdown_kernel()
    assert leases(broker) == []


# -- jupyter_client's blocking API ------------------------------------------------------------
# ``KernelManager`` (not Async) runs each call on an event loop it picks: this thread's own,
# or, when a loop is already running here, a runner thread's. A kernel's acquire, renewals
# and release may so run on different loops, in different threads.
def blocking(name: str, tmp_path: Path) -> KernelManager:
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True)
    return KernelManager(
        kernel_name=name, connection_file=str(runtime / f"kernel-{uuid.uuid4()}.json")
    )


def in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Each call at once in a thread of its own, where jupyter_client runs that thread's
    own loop, closed when the call returns (as a thread pool's owner would)."""

    def then_close(call: Callable[[], Any]) -> Any:
        try:
            return call()
        finally:
            ensure_event_loop().close()

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        running = [pool.submit(then_close, call) for call in calls]
        return [x.result(timeout=60) for x in running]


def under_running_loop(call: Callable[[], Any]) -> Any:
    """``call()`` from a coroutine, as in a notebook cell: jupyter_client runs a blocking
    call on a runner thread's loop then."""

    async def main() -> Any:
        return call()

    return asyncio.run(main())


def shut_down(*kms: KernelManager) -> None:
    for km in kms:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


@pytest.mark.slow
def test_blocking_manager_on_any_loop_releases(server_env: Broker, tmp_path: Path) -> None:
    broker = server_env
    km = blocking("gpu-0.02", tmp_path)
    km.start_kernel()  # this thread's loop
    try:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None and lease["user"] == "alice"
        in_threads(km.restart_kernel)  # another thread's loop: the same lease
        after = lease_of(broker, km.kernel_id)
        assert after is not None and after["id"] == lease["id"]
        under_running_loop(km.restart_kernel)  # a runner thread's loop: the same lease
        assert km.is_alive()
        after = lease_of(broker, km.kernel_id)
        assert after is not None and after["id"] == lease["id"]
        under_running_loop(km.shutdown_kernel)
        assert not km.has_kernel
    finally:
        shut_down(km)
    assert leases(broker) == []
    assert lease_state(broker, lease["id"]) == "released"


@pytest.mark.slow
def test_blocking_manager_renews_between_calls(server_env: Broker, tmp_path: Path) -> None:
    """Between blocking calls no loop of jupyter_client runs, yet the lease lives on."""
    broker = server_env
    km = blocking("gpu-0.02", tmp_path)
    km.start_kernel()
    try:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None
        ttl = lease["expires_at"] - lease["renewed_at"]
        renewed = wait_for(
            lambda: (
                (x := lease_of(broker, km.kernel_id))
                and x["renewed_at"] > lease["renewed_at"] + ttl
                and x
            ),
            timeout=ttl * 3,
            what="renewals past the first TTL",
        )
        assert renewed["id"] == lease["id"] and renewed["pid"] == km.provisioner.pid
        km.shutdown_kernel()
    finally:
        shut_down(km)
    assert leases(broker) == []


@pytest.mark.slow
def test_blocking_manager_started_in_a_thread_stopped_here(
    server_env: Broker, tmp_path: Path
) -> None:
    broker = server_env
    km = blocking("gpu-0.02", tmp_path)
    in_threads(km.start_kernel)
    try:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None
        km.restart_kernel()
        after = lease_of(broker, km.kernel_id)
        assert after is not None and after["id"] == lease["id"]
        km.shutdown_kernel()
    finally:
        shut_down(km)
    assert leases(broker) == []


@pytest.mark.slow
def test_two_blocking_managers_in_two_threads(server_env: Broker, tmp_path: Path) -> None:
    broker = server_env
    kms = [blocking("gpu-0.02", tmp_path) for _ in range(2)]
    in_threads(*(km.start_kernel for km in kms))
    try:
        held = {x["kernel_id"]: x["id"] for x in leases(broker)}
        assert set(held) == {km.kernel_id for km in kms}
        kms[0].restart_kernel()  # here, not in the thread that started it
        after = lease_of(broker, kms[0].kernel_id)
        assert after is not None and after["id"] == held[kms[0].kernel_id]
        in_threads(kms[1].shutdown_kernel)
        assert [x["kernel_id"] for x in leases(broker)] == [kms[0].kernel_id]
        under_running_loop(kms[0].shutdown_kernel)
    finally:
        shut_down(*kms)
    assert leases(broker) == []
    assert {lease_state(broker, x) for x in held.values()} == {"released"}


def kernel_in_a_child(name: str, runtime: str) -> tuple[str, str]:
    """In a forked child: a blocking kernel's start and shutdown; its (kernel id, lease id)."""
    km = KernelManager(kernel_name=name, connection_file=f"{runtime}/kernel-{uuid.uuid4()}.json")
    km.start_kernel()  # post_launch starts the renewals on the child's own background loop
    try:
        lease = km.provisioner.lease_keeper.lease  # type: ignore[union-attr]
        assert lease is not None
        return str(km.kernel_id), lease.id
    finally:
        km.shutdown_kernel(now=True)


@pytest.mark.slow
def test_blocking_manager_in_a_forked_child(server_env: Broker, tmp_path: Path) -> None:
    """A child forked while the renewal thread runs (``ProcessPoolExecutor``) has no such
    thread: it starts its own, and the parent's renewals go on undisturbed."""
    broker = server_env
    km = blocking("gpu-0.02", tmp_path)
    km.start_kernel()  # the background renewal loop runs in this process from now on
    try:
        lease = lease_of(broker, km.kernel_id)
        assert lease is not None
        fork = __import__("multiprocessing").get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=fork) as pool:
            started = time.monotonic()
            child_kernel, child_lease = pool.submit(
                kernel_in_a_child, "gpu-0.02", str(tmp_path / "runtime")
            ).result(timeout=60)
            assert time.monotonic() - started < 8  # not the 10 s timeout of a loop not there
        assert lease_state(broker, child_lease) == "released"
        assert lease_of(broker, child_kernel) is None
        renewed = wait_for(
            lambda: (x := lease_of(broker, km.kernel_id)) and x["renewed_at"] > started and x,
            timeout=10,
            what="the parent's renewals after the fork",
        )
        assert renewed["id"] == lease["id"]
        km.shutdown_kernel()
    finally:
        shut_down(km)
    assert leases(broker) == []


@pytest.mark.slow
def test_sync_mapping_kernel_manager_shuts_down_at_once(
    server_env: Broker, specs: Specs, tmp_path: Path
) -> None:
    """jupyter_server's synchronous ``MappingKernelManager`` inside the server's running
    loop: each blocking call of a kernel's manager runs on a runner loop (jupyter_core's
    ``run_sync``), and ``shutdown_all()`` (the server's exit, and jupyter_server's test
    fixtures) runs the kernels' shutdowns on a *nested* runner loop while the outer one,
    which started the kernels, waits for it. The release must not wait on that outer loop
    (it used to, for its whole 10 s timeout per kernel)."""
    from jupyter_server.services.kernels.kernelmanager import MappingKernelManager

    broker = server_env
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True)

    async def serve() -> tuple[list[str], dict[str, float]]:
        mkm = MappingKernelManager(root_dir=str(tmp_path), connection_dir=str(runtime))
        kernel_ids = [await mkm.start_kernel(kernel_name="gpu-0.02") for _ in range(3)]
        held = [lease_of(broker, x) for x in kernel_ids]
        assert all(held), held
        took = {}
        started = time.monotonic()
        await mkm.shutdown_kernel(kernel_ids[0])  # as DELETE /api/kernels/{id}
        took["shutdown_kernel"] = time.monotonic() - started
        started = time.monotonic()
        mkm.shutdown_all()  # blocking, in the running loop: the nested runner loop
        took["shutdown_all (two kernels)"] = time.monotonic() - started
        assert mkm.list_kernel_ids() == []
        return [x["id"] for x in held if x], took

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The synchronous MappingKernelManager", Warning)
        held, took = asyncio.run(serve())
    assert all(x < 5 for x in took.values()), took  # not a 10 s stall per kernel
    assert leases(broker) == []
    assert {lease_state(broker, x) for x in held} == {"released"}


@pytest.mark.slow
async def test_death_during_shutdown_releases_once(server_env: Broker, tmp_path: Path) -> None:
    """The restarter gives up and the owner shuts the kernel down at that very moment (as
    jupyter_client's own test_async_restarter_gives_up does): the shutdown waits for the
    release the death started, rather than closing the broker clients under it."""
    broker = server_env
    config = Config({"KernelRestarter": {"time_to_dead": 0.3, "restart_limit": 0}})
    km = await start("gpu-0.02", tmp_path, AsyncIOLoopKernelManager, config=config)
    died: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    km.add_restart_callback(lambda: died.done() or died.set_result(True), "dead")
    lease = lease_of(broker, km.kernel_id)
    assert lease is not None
    os.kill(km.provisioner.pid, signal.SIGKILL)  # type: ignore[union-attr]
    await asyncio.wait_for(died, 30)
    await km.shutdown_kernel(now=True)  # while the death's release is in flight
    # the death's release is over, not left to a loop that is about to close
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert [t.get_coro() for t in others if not t.done()] == []
    assert lease_state(broker, lease["id"]) == "released"
    assert leases(broker) == []


# -- through jupyter_server ------------------------------------------------------------------
@pytest.fixture
def jupyter_server(server_env: Broker, specs: Specs, tmp_path: Path) -> Iterator[str]:
    """A real ``jupyter server`` with the broker URL and token in its environment."""
    specs.add("gpu-0.01", 0.01)  # 327 MiB on a 32 GiB GPU: below the context overhead
    port = free_port()
    token = uuid.uuid4().hex
    root = tmp_path / "notebooks"
    root.mkdir()
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(
            f"{url}/api/status",
            proc,
            lambda: (tmp_path / "server.log").read_text()[-3000:],
            30,
            what="jupyter_server",
            params={"token": token},
        )
        yield f"{url}?{token}"
    finally:
        stop_process(proc)
        log.close()


@pytest.mark.slow
async def test_jupyter_server_sessions(server_env: Broker, jupyter_server: str) -> None:
    broker = server_env
    url, token = jupyter_server.split("?")
    headers = {"Authorization": f"token {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        r = await http.post(
            "/api/sessions",
            json={"path": "a.ipynb", "type": "notebook", "kernel": {"name": "gpu-0.02"}},
        )
        assert r.status_code == 201, r.text
        session = r.json()
        kernel_id = session["kernel"]["id"]
        lease = lease_of(broker, kernel_id)
        assert lease is not None and lease["user"] == "alice"

        r = await http.post(
            "/api/sessions",
            json={"path": "b.ipynb", "type": "notebook", "kernel": {"name": "gpu-0.01"}},
        )
        assert r.status_code == 500
        assert "The smallest fraction that works is" in r.json()["message"]

        r = await http.delete(f"/api/sessions/{session['id']}")
        assert r.status_code == 204
    await wait_for_async(lambda: lease_of(broker, kernel_id) is None, what="release")
    assert leases(broker) == []


@pytest.mark.parametrize(
    "message, lines",
    [
        ("One sentence.", ["One sentence."]),
        (
            "This kernel is reserved for course 'ml101', and you are not a member of it. "
            "Ask your instructor to add you to the course, or choose another kernel.",
            [
                "This kernel is reserved for course 'ml101', and you are not a member of it.",
                "Ask your instructor to add you to the course, or choose another kernel.",
            ],
        ),
        ("word " * 30 + "end. Next.", ["word " * 19 + "word", "word " * 10 + "end.", "Next."]),
        (
            "The smallest fraction that works is 0.015656.",
            ["The smallest fraction that works is 0.015656."],
        ),
    ],
)
def test_refusals_are_shown_one_sentence_per_line(message, lines):
    """JupyterLab's "Error Starting Kernel" shows the message unwrapped: keep lines short."""
    from provisioner.kernel.refusals import for_dialog

    shown = for_dialog(message)
    assert [line.rstrip() for line in shown.split("\n")] == [line.rstrip() for line in lines]
    assert all(len(line) <= 100 for line in shown.split("\n"))
