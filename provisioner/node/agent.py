"""``gpu-lease agent``: the broker's presence on a GPU node.

One agent runs on each GPU node (a systemd unit or a container; see docs/admins.md).
It registers the node's GPUs with the broker (``PUT /api/v1/nodes/{node}``), then every
``interval`` seconds samples the GPU memory each process uses (NVML's
``nvmlDeviceGetComputeRunningProcesses``) and heartbeats it
(``POST /api/v1/nodes/{node}/heartbeat``). A node whose agent is silent longer than the
broker's ``node_grace`` is *lost*: nothing new is placed there until the agent comes
back. A clean stop (SIGTERM, SIGINT) *drains* the node (``DELETE``): held leases stay,
nothing new lands there; the agent's next start registers it again.

Like jupyterhub-idle-culler, :class:`GPULeaseAgent` only turns traits into arguments:
the loop is the plain async function :func:`run_agent`, called with a
:class:`~provisioner.client.BrokerClient`, the node's GPUs and a sampler.

The token is read from ``GPU_LEASE_AGENT_TOKEN`` (never a config value, so that it is not
written into config files): a token the broker's tokens file marks
``{"agent": true, "node": "NODE"}``, which may call only the node routes of that node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from traitlets import Bool, CaselessStrEnum, Float, Int, List, Unicode, default
from traitlets.config import Application

from .. import inventory
from .._version import __version__
from ..client import BrokerClient
from ..errors import BrokerUnavailable, GPULeaseError, InvalidRequest, LeaseNotFound, StoreError
from ..model import GPU
from ..node_report import NodeReport, Usage
from ..wire import (
    DEFAULT_ENFORCE_MODE,
    DEFAULT_MPS_DIR,
    ENFORCE_MODES,
    MAX_WAIT,
    NODE_NAME_VARS,
    ORDERS_WAIT,
    this_node,
)
from . import driver_limits
from .feature import Beat, NodeFeature, Sample
from .launcher import KernelLauncher, LaunchSettings, address_towards
from .mps import MPS_CONTROL, MPSFeature, MPSSupervisor
from .orders import OrderWatch
from .parking import DEFAULT_HOST_RESERVE_MB, Parker, Parking
from .pidns import KernelFinder
from .proof import CHECK_ACCOUNT, KernelProofs, Prover

log = logging.getLogger("gpu_lease.agent")

#: seconds between two registration attempts while the broker cannot be reached
REGISTER_RETRY = 2.0


def gpu_records(gpus: list[GPU]) -> list[dict[str, Any]]:
    """The ``gpus`` of a registration body."""
    return [
        {"uuid": g.uuid, "name": g.name, "memory_mb": g.memory_mb, "index": g.index} for g in gpus
    ]


def node_gpus(spec: str, node: str, nvml: Any = inventory.NVML_MODULE) -> list[GPU]:
    """The node's GPUs: ``nvml`` discovers them; a declaration ``2x16384:T4`` declares them.

    Declared GPUs get stable UUIDs derived from ``node`` (two nodes declaring the same
    shapes get different GPUs). Raises :class:`~provisioner.errors.InventoryError`.
    """
    if spec.strip().lower() == "nvml":
        return inventory.discover_nvml(node, nvml=nvml)
    return [
        GPU(
            inventory.declared_uuid(node, g.index, g.name, g.memory_mb),
            node,
            g.name,
            g.memory_mb,
            g.index,
        )
        for g in inventory.parse_gpu_spec(spec)
    ]


def attribute(
    samples: Sample, find: Callable[[int], int | None]
) -> tuple[Sample, dict[int, list[int]]]:
    """Report each GPU process under its kernel's host pid (children count for their kernel,
    kernels in another pid namespace too: see :mod:`provisioner.node.pidns`).

    Returns the samples as reported and, per kernel host pid, its GPU processes' pids (what
    ``--enforce kill`` kills).
    """
    out: Sample = []
    members: dict[int, list[int]] = {}
    for pid, uuid, used in samples:
        root = find(pid)
        if root is None:
            out.append((pid, uuid, used))
        else:
            out.append((root, uuid, used))
            members.setdefault(root, []).append(pid)
    return out, members


def kill_processes(pids: list[int], why: str = "of a revoked lease") -> None:
    """SIGKILL each pid (``--enforce kill``, ``--kill-unleased-after``); one already gone
    is fine."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("Killed GPU process %d %s", pid, why)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.error("Not allowed to kill GPU process %d: run the agent as root", pid)


class UnleasedReaper:
    """``--kill-unleased-after SECONDS``: the GPU processes that have belonged to no lease's
    kernel (nor descended from one) in every sample for at least that long.

    A kernel's pid (and pid namespace) reaches the broker with the renewal right after its
    launch, and again every third of the TTL (a restarted broker learns a kernel's pid
    namespace then): ``after`` should exceed a third of the TTL plus a few heartbeats.
    The agent's own pid and pid 1 are never returned.
    """

    def __init__(self, after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after = after
        self.clock = clock
        #: pid -> when it was first seen unleased (in consecutive samples)
        self.first_seen: dict[int, float] = {}

    def __call__(self, samples: Sample, find: KernelFinder) -> list[int]:
        now = self.clock()
        spared = {os.getpid(), 1}
        unleased = {pid for pid, _, _ in samples if pid not in spared and find(pid) is None}
        self.first_seen = {pid: self.first_seen.get(pid, now) for pid in unleased}
        due = sorted(pid for pid, t in self.first_seen.items() if now - t >= self.after)
        for pid in due:
            del self.first_seen[pid]
        return due


def merge_samples(samples: Sample) -> tuple[Usage, ...]:
    """Heartbeat ``usage``: one sample per (pid, GPU), memory summed (MIG lists a pid twice)."""
    total: dict[tuple[int, str], int] = {}
    for pid, uuid, used in samples:
        total[(pid, uuid)] = total.get((pid, uuid), 0) + used
    return tuple((p, u, m) for (p, u), m in sorted(total.items()))


class NVMLSampler:
    """Per-process GPU memory from NVML, kept initialized while the agent runs."""

    def __init__(self, nvml: Any = inventory.NVML_MODULE) -> None:
        self.nvml: Any = inventory._nvml_module(nvml)
        self.nvml.nvmlInit()

    def __call__(self) -> Sample:
        return inventory.running_processes(self.nvml)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - a failing shutdown at exit changes nothing
            pass


def no_samples() -> Sample:
    """The sampler of a node declared with ``--gpus SPEC``: NVML cannot say anything."""
    return []


async def _register(
    client: BrokerClient, node: str, gpus: list[GPU], stop: asyncio.Event, enforce: str
) -> bool:
    """Register until it works (the broker may start after the agent); False if stopped."""
    while not stop.is_set():
        try:
            answer = await client.nodes.register(node, gpu_records(gpus), __version__, enforce)
        except (BrokerUnavailable, StoreError) as exc:
            log.warning("Cannot register node %s yet: %s", node, exc.message)
        else:
            log.info("Registered node %s with %d GPU(s): %s", node, len(gpus), answer.get("state"))
            return True
        try:
            await asyncio.wait_for(stop.wait(), REGISTER_RETRY)
        except asyncio.TimeoutError:
            pass
    return False


async def run_agent(
    client: BrokerClient,
    node: str,
    gpus: list[GPU],
    sample: Callable[[], Sample],
    interval: float,
    stop: asyncio.Event,
    enforce: str = "report",
    kill_unleased_after: float = 0.0,
    kernels: KernelProofs | None = None,
    features: Sequence[NodeFeature] = (),
    orders: OrderWatch | None = None,
) -> None:
    """Register ``node``, heartbeat ``sample()`` every ``interval`` s until ``stop``, then drain.

    Called by :meth:`GPULeaseAgent.serve`. A broker that forgot the node (404) gets it
    registered again; a broker that cannot be reached is tried again at the next beat.
    A refusal (a token of another node, a GPU another node has) raises. Each heartbeat's
    answer names the kernels of the node's leases: ``kernels``
    (:class:`~provisioner.node.proof.KernelProofs`) proves each claim, and only proven
    kernels count: the next sample reports their descendants' memory under the kernel's
    host pid; with ``enforce="kill"`` the GPU processes of the kernels the broker names in
    ``kill`` are killed at once; with ``kill_unleased_after`` > 0, GPU processes that
    belonged to no lease that long too.

    The node features (``features``: MPS daemons, driver memory limits, parking; see
    :mod:`provisioner.node.feature`) each add their part to every heartbeat and read
    theirs of its answer, after the kernel proofs. A broker older than a feature refuses
    its fields: the feature stops sending them and the beat goes again at once. The next
    beat comes after ``interval`` s, or sooner when a feature has something ready, or when
    ``orders`` (:class:`~provisioner.node.orders.OrderWatch`, the long-poll it keeps open
    from the registration on) says the node's orders changed: the next beat takes them.
    """
    if not await _register(client, node, gpus, stop, enforce):
        return
    kernels = kernels or KernelProofs()
    every: list[NodeFeature] = [kernels, *features]
    readies = [f.ready for f in every if f.ready is not None]
    watching: asyncio.Future[None] | None = None
    if orders is not None:
        readies.append(orders.due)
        watching = asyncio.ensure_future(orders.run(stop))
    try:
        reaper = UnleasedReaper(kill_unleased_after) if kill_unleased_after > 0 else None
        while not stop.is_set():
            if orders is not None:  # this beat takes the orders changed until now
                orders.due.clear()
            members: dict[int, list[int]] = {}
            raw: Sample = []
            find = kernels.finder()
            usage: tuple[Usage, ...] = ()
            try:
                raw = sample()
                samples, members = attribute(raw, find)
                usage = merge_samples(samples)
            except GPULeaseError as exc:
                log.warning("%s", exc.message)
            beat = Beat(raw, members, find)
            for feature in every:
                await feature.observe(beat)
            parts = tuple(p for f in every if (p := f.report(beat)) is not None)
            try:
                answer = await client.nodes.heartbeat(node, NodeReport(usage, time.time(), parts))
                for feature in every:
                    await feature.answer(beat, answer)
                if enforce == "kill":
                    for root in answer.get("kill", []):
                        kill_processes(members.get(int(root), []))
                if reaper is not None:  # judged against the kernels the broker names now
                    unleased = reaper(raw, kernels.finder())
                    kill_processes(unleased, "that belongs to no GPU lease")
            except LeaseNotFound:
                log.warning("The broker does not know node %s (any more); registering again", node)
                if not await _register(client, node, gpus, stop, enforce):
                    return
            except (BrokerUnavailable, StoreError) as exc:
                log.warning("Heartbeat of node %s failed: %s", node, exc.message)
            except InvalidRequest as exc:
                refused = set(exc.details.get("fields") or [])
                offered = frozenset().union(*(f.offered() for f in every))
                if not refused or not refused <= offered:
                    raise
                for feature in every:  # a broker older than these features
                    feature.refused(refused, node)
                continue  # the same beat again at once, without them
            await _pause(stop, readies, interval)
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
    try:
        await client.nodes.drain(node)
        log.info("Drained node %s (held leases stay; nothing new is placed there)", node)
    except GPULeaseError as exc:
        log.warning("Could not drain node %s on the way out: %s", node, exc.message)


async def _pause(stop: asyncio.Event, readies: list[asyncio.Event], interval: float) -> None:
    """Until the next beat: ``interval`` s, less when stopping or when a feature has
    something ready (a park/resume outcome: the broker frees or re-grants the memory a
    beat sooner) or the node's orders changed."""
    waits = [asyncio.ensure_future(stop.wait())]
    waits += [asyncio.ensure_future(ready.wait()) for ready in readies]
    try:
        await asyncio.wait(waits, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class GPULeaseAgent(Application):
    """``gpu-lease agent``: register this node's GPUs with the broker and heartbeat."""

    name = "gpu-lease-agent"
    version = __version__
    description = "Register this node's GPUs with the gpu-lease broker and heartbeat their usage."

    aliases = {
        "broker-url": "GPULeaseAgent.broker_url",
        "node": "GPULeaseAgent.node",
        "gpus": "GPULeaseAgent.gpus",
        "enforce": "GPULeaseAgent.enforce",
        "interval": "GPULeaseAgent.interval",
        "orders-wait": "GPULeaseAgent.orders_wait",
        "kill-unleased-after": "GPULeaseAgent.kill_unleased_after",
        "mps-dir": "GPULeaseAgent.mps_dir",
        "mps-control": "GPULeaseAgent.mps_control",
        "park-host-reserve-mb": "GPULeaseAgent.park_host_reserve_mb",
        "check-account": "GPULeaseAgent.check_account",
        "kernel-cgroup-parents": "GPULeaseAgent.kernel_cgroup_parents",
        "kernel-ip": "GPULeaseAgent.kernel_ip",
        "kernel-dir": "GPULeaseAgent.kernel_dir",
        "scratch-dir": "GPULeaseAgent.scratch_dir",
        "shared-dirs": "GPULeaseAgent.shared_dirs",
        "launch-cgroup-parent": "GPULeaseAgent.launch_cgroup_parent",
        "log-level": "Application.log_level",
    }

    flags = {
        **Application.flags,
        "mps": (
            {"GPULeaseAgent": {"mps": True}},
            "Run and supervise an MPS control daemon per GPU (for enforcement=mps kernels).",
        ),
        "park": (
            {"GPULeaseAgent": {"park": True}},
            "Park idle kernels when the broker asks and the driver can (the default).",
        ),
        "no-park": (
            {"GPULeaseAgent": {"park": False}},
            "Never park kernels here: the broker reclaims idle ones instead.",
        ),
        "launch-kernels": (
            {"GPULeaseAgent": {"launch_kernels": True}},
            "Launch remote kernels for this node's leases (their holders ask the broker).",
        ),
    }

    broker_url = Unicode(
        help="The broker's base URL, e.g. http://broker.example.org:10101 (default: "
        "$GPU_LEASE_URL).",
    ).tag(config=True)

    @default("broker_url")
    def _default_url(self) -> str:
        return os.environ.get("GPU_LEASE_URL", "")

    node = Unicode(
        help="This node's name as the broker and provisioners know it (GPU_LEASE_NODE, Slurm "
        f"or Kubernetes node name). Default: ${', else $'.join(NODE_NAME_VARS)}, else the "
        "host name.",
    ).tag(config=True)

    @default("node")
    def _default_node(self) -> str:
        return this_node()

    gpus = Unicode(
        "nvml",
        help="'nvml' (default: discover this node's GPUs with NVML, and sample per-process "
        "memory) or a declaration COUNTxMEMORY_MiB[:NAME] for a node without NVML "
        "(no per-process usage then).",
    ).tag(config=True)

    enforce = CaselessStrEnum(
        ENFORCE_MODES,
        default_value=DEFAULT_ENFORCE_MODE,
        help="What to do with a kernel that uses more GPU memory than its lease: 'off' "
        "(usage is reported, over-use is not flagged), 'report' (default: over-use is "
        "flagged in top, /metrics and the broker's log; nothing is stopped), 'revoke' (the "
        "broker revokes its lease and its provisioner stops the kernel), 'kill' (revoke "
        "and kill its GPU processes at once). See docs/admins.md for what each guarantees.",
    ).tag(config=True)

    interval = Float(
        5.0,
        help="Seconds between heartbeats (each carries one sample). Keep it well below the "
        "broker's node_grace (default 30 s). Default: 5.",
    ).tag(config=True)

    kill_unleased_after = Float(
        0.0,
        help="SIGKILL GPU processes that belong to no lease's kernel for this many seconds "
        "(0, the default: never; they are reported as unleased). Set it above a third of "
        "the lease TTL plus a few heartbeats (the TTL is the safe choice): kernels report "
        "their pid right after launch, then every TTL/3. Only for nodes where every GPU "
        "user goes through a lease (not shared with batch jobs); recommended on a hub "
        "with a Unix account per student.",
    ).tag(config=True)

    mps = Bool(
        False,
        help="Run one MPS control daemon per GPU (nvidia-cuda-mps-control -f), restart it "
        "when it exits and report its state, so that kernels with enforcement=mps are "
        "capped by the driver. Default: False.",
    ).tag(config=True)

    mps_dir = Unicode(
        DEFAULT_MPS_DIR,
        help="Where each GPU's MPS pipe and log directories go (<dir>/<uuid>/pipe); the "
        f"provisioners' mps_dir must be the same. Default: {DEFAULT_MPS_DIR}.",
    ).tag(config=True)

    mps_control = Unicode(
        MPS_CONTROL, help=f"The MPS control program. Default: {MPS_CONTROL} (on PATH)."
    ).tag(config=True)

    orders_wait = Float(
        ORDERS_WAIT,
        min=0.0,
        max=MAX_WAIT,
        help="Keep a long-poll open for this node's orders (park, resume), this many "
        "seconds at a time, so that an order reaches the node at once instead of with the "
        "next heartbeat. 0: no long-poll (orders come with the heartbeats only, e.g. behind "
        "a proxy that cuts requests held open). A broker without the long-poll is detected "
        f"and asked again every 10 minutes. At most {MAX_WAIT:g}. Default: {ORDERS_WAIT:g}.",
    ).tag(config=True)

    park = Bool(
        True,
        help="Park idle kernels when the broker asks (their GPU memory checkpointed into "
        "host RAM through the driver's checkpoint API, restored when they run again) "
        "where the driver offers it (570 or later, x86-64). False: the broker reclaims "
        "idle kernels here instead. Default: True.",
    ).tag(config=True)

    park_host_reserve_mb = Int(
        DEFAULT_HOST_RESERVE_MB,
        min=0,
        help="Host memory (MiB) parking leaves to everything else: a kernel is parked only "
        "when MemAvailable less this holds its GPU memory. The broker's "
        f"park_host_reserve_mb should match. Default: {DEFAULT_HOST_RESERVE_MB}.",
    ).tag(config=True)

    check_account = CaselessStrEnum(
        CHECK_ACCOUNT,
        default_value="auto",
        help="Whether a kernel a lease claims must run as the lease user's Unix account, "
        "besides carrying the lease's kernel secret: 'auto' (default: where the user has "
        "an account on this node), 'yes' (always: a user without an account is refused), "
        "'no' (never: the secret alone, e.g. every server is uid 1000 in its own pod).",
    ).tag(config=True)

    kernel_cgroup_parents = List(
        Unicode(),
        help="cgroup v2 paths (from the hierarchy's root) under which a proven kernel's own "
        "cgroup may sit to get a driver memory limit and count its processes, e.g. "
        "/user.slice/gpu-kernels. Default: none, which accepts only the provisioner's own "
        "layout: a leaf named kernel-<kernel id> in a directory named gpu-lease.",
    ).tag(config=True)

    launch_kernels = Bool(
        False,
        help="Launch the kernels that this node's leases' holders ask for through the "
        "broker (remote kernels: provisioners with launcher='node'), each as its student's "
        "Unix account (the same name on every node), in a cgroup of its own. The node "
        "opens no listener: launches come in the answers to its heartbeats. Default: False.",
    ).tag(config=True)

    kernel_ip = Unicode(
        "",
        help="The address remote kernels listen on: this node's cluster address, which the "
        "students' servers reach (allow the ephemeral port range from them in the "
        "firewall). Default: the address this node reaches the broker from.",
    ).tag(config=True)

    kernel_dir = Unicode(
        "/var/lib/gpu-lease/kernels",
        help="Where each remote kernel's private folder goes (its connection file with its "
        "key, its output, the agent's record that finds it again after a restart).",
    ).tag(config=True)

    scratch_dir = Unicode(
        "/var/tmp/gpu-lease",
        help="Where a remote kernel works when its notebook's folder is not shared with this "
        "node: <dir>/<user>/<kernel id>, the student's own.",
    ).tag(config=True)

    shared_dirs = List(
        Unicode(),
        help="Folders every node and every student server see at the same path (a shared "
        "home: /home); a remote kernel whose notebook lies below one works in the "
        "notebook's folder. Default: none (scratch folders).",
    ).tag(config=True)

    launch_cgroup_parent = Unicode(
        "",
        help="Where each remote kernel's cgroup (v2) is made, from the hierarchy's root. "
        "Default: the agent's own cgroup + /gpu-lease.",
    ).tag(config=True)

    nvml_module = Unicode(
        inventory.NVML_MODULE,
        help="The NVML binding's module name (nvidia-ml-py installs 'pynvml').",
    ).tag(config=True)

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    def start(self) -> None:
        """Run until SIGTERM/SIGINT (exit 0 after draining); exit 2 on a configuration error."""
        logging.basicConfig(
            level=int(self.log_level),  # type: ignore[call-overload]
            format="[%(levelname)1.1s %(asctime)s %(name)s] %(message)s",
            stream=sys.stderr,
        )
        if int(self.log_level) > logging.DEBUG:  # type: ignore[call-overload]
            # httpx logs every request at INFO: a heartbeat line every few seconds, all day
            # (seen on the H200 run); the agent logs what matters itself
            logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            status = asyncio.run(self.serve())
        except KeyboardInterrupt:
            status = 0
        if status:
            self.exit(status)

    def features(
        self,
        mps: MPSSupervisor | None,
        limits: driver_limits.DriverLimits | None,
        parker: Parker,
        launcher: KernelLauncher | None = None,
    ) -> list[NodeFeature]:
        """This agent's node features, in the order each heartbeat calls them (after the
        kernel proofs): the one list a new node feature joins (docs/developers.md)."""
        features: list[NodeFeature] = [Parking(parker)]
        if launcher is not None:  # --launch-kernels
            features.append(launcher)
        if limits is not None:  # the driver offers per-cgroup memory limits
            features.append(driver_limits.DriverLimitsFeature(limits))
        if mps is not None:  # --mps
            features.append(MPSFeature(mps))
        return features

    async def serve(self) -> int:
        token = os.environ.get("GPU_LEASE_AGENT_TOKEN", "")
        if not self.broker_url:
            log.critical("No broker URL: pass --broker-url URL (or set GPU_LEASE_URL).")
            return 2
        if not token:
            log.critical(
                "No agent token: set GPU_LEASE_AGENT_TOKEN to a token the broker's tokens file "
                'lists as {"agent": true, "node": "%s"}.',
                self.node,
            )
            return 2
        if 0 < self.kill_unleased_after < 3 * self.interval:
            log.critical(
                "--kill-unleased-after %g is too short: give it at least 3 heartbeats "
                "(%g s), and more than a third of the lease TTL.",
                self.kill_unleased_after,
                3 * self.interval,
            )
            return 2
        try:
            gpus = node_gpus(self.gpus, self.node, self.nvml_module)
        except GPULeaseError as exc:
            log.critical("%s", exc.message)
            return 2
        sampler: Callable[[], Sample] = no_samples
        nvml_sampler: NVMLSampler | None = None
        if self.gpus.strip().lower() == "nvml":
            nvml_sampler = NVMLSampler(self.nvml_module)
            sampler = nvml_sampler
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        client = BrokerClient(self.broker_url, token, retries=1, timeout=10.0)
        # the orders long-poll holds a connection of its own (a retry of another call
        # drops the client's connections)
        orders_client = BrokerClient(self.broker_url, token, retries=0, timeout=10.0)
        orders = (
            OrderWatch(orders_client, self.node, self.orders_wait) if self.orders_wait else None
        )
        mps = (
            MPSSupervisor([g.uuid for g in gpus], self.mps_dir, self.mps_control)
            if self.mps
            else None
        )
        # the daemons stop after the agent's last beat, not with the signal: a beat still
        # under way sets their limits, and a limit set after `quit` would start a daemon
        # anew (and leave it running)
        daemons_stop = asyncio.Event()
        daemons = asyncio.ensure_future(mps.run(daemons_stop)) if mps is not None else None
        parker = _parker(nvml_sampler, gpus, self.park, self.park_host_reserve_mb)
        launcher = self._launcher()
        try:
            await run_agent(
                client,
                self.node,
                gpus,
                sampler,
                self.interval,
                stop,
                self.enforce,
                self.kill_unleased_after,
                KernelProofs(Prover(self.check_account, list(self.kernel_cgroup_parents))),
                self.features(mps, _driver_limits(nvml_sampler, gpus), parker, launcher),
                orders,
            )
        except GPULeaseError as exc:
            log.critical("The broker refused node %s: %s", self.node, exc.message)
            return 1
        finally:
            await parker.close()  # an order in progress ends first: nothing left LOCKED
            if launcher is not None:  # its kernels run on; the next start finds them
                await launcher.close()
            if daemons is not None:  # the daemons stop with the agent (``quit``)
                daemons_stop.set()
                await daemons
            await client.aclose()
            await orders_client.aclose()
            if nvml_sampler is not None:
                nvml_sampler.close()
        return 0

    def _launcher(self) -> KernelLauncher | None:
        """``--launch-kernels``: the remote kernels' launcher, with this agent's options."""
        if not self.launch_kernels:
            return None
        ip = self.kernel_ip or address_towards(self.broker_url)
        log.info("Launching remote kernels on %s (kernels listen on %s)", self.node, ip)
        return KernelLauncher(
            LaunchSettings(
                node=self.node,
                ip=ip,
                kernel_dir=self.kernel_dir,
                scratch_dir=self.scratch_dir,
                shared_dirs=tuple(self.shared_dirs),
                cgroup_parent=self.launch_cgroup_parent,
            )
        )


def _driver_limits(
    sampler: NVMLSampler | None, gpus: list[GPU]
) -> driver_limits.DriverLimits | None:
    """Per-cgroup driver memory limits where this node's NVML offers them (logged either way)."""
    if sampler is None:
        return None
    nvml = sampler.nvml
    ok, why = driver_limits.offered(nvml)
    log.info("Driver memory limits per kernel: %s", why)
    if not ok:
        return None
    handles = {g.uuid: nvml.nvmlDeviceGetHandleByIndex(g.index) for g in gpus}
    return driver_limits.DriverLimits(nvml, handles, {g.uuid: g.memory_mb for g in gpus})


def _parker(sampler: NVMLSampler | None, gpus: list[GPU], enabled: bool, reserve_mb: int) -> Parker:
    """The agent's :class:`~provisioner.node.parking.Parker`: with the driver's checkpoint
    handle where this node can park; without one (orders then fail, ``checkpoint: false``)
    where it cannot, or where NVML is not sampled (``--gpus SPEC``: the kernels' GPU
    processes would be unknown, and a park would move nothing while freeing the memory)."""
    if sampler is None:
        why = (
            "the agent does not sample NVML here (--gpus SPEC), so it cannot find the "
            "kernels' GPU processes"
        )
        log.info("Parking idle kernels: no; %s", why)
        return Parker(None, why, no_samples, lambda uuid: None, host_reserve_mb=reserve_mb)
    free_mb = nvml_free_mb(sampler.nvml, gpus)
    return Parker.open(sampler, free_mb, enabled=enabled, host_reserve_mb=reserve_mb)


def nvml_free_mb(nvml: Any, gpus: list[GPU]) -> Callable[[str], int | None]:
    """A GPU uuid's free memory in MiB from NVML (None: not one of ``gpus``, or NVML
    failed): what the parker checks before it restores a kernel."""
    errors = inventory._error_types(nvml)
    index = {g.uuid: g.index for g in gpus}

    def free_mb(uuid: str) -> int | None:
        if uuid not in index:
            return None
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index[uuid]))
        except errors:
            return None
        return int(info.free) // (1024 * 1024)

    return free_mb


def main(argv: list[str] | None = None) -> int:
    """``gpu-lease agent [options]``; returns 0 (errors exit with their status)."""
    GPULeaseAgent.launch_instance(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
