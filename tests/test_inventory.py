"""The GPU inventory: static ``--gpus`` declarations (table tests) and NVML discovery.

NVML is the one thing here we cannot have on a machine without NVIDIA GPUs, so the
discovery tests pass a small stand-in for the ``pynvml`` module; one test runs the
real NVML of this machine.
"""

from __future__ import annotations

import re
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from provisioner import inventory
from provisioner.errors import GPULeaseError, InventoryError, NoGPUFound
from provisioner.inventory import (
    declared_uuid,
    discover_nvml,
    load_gpus,
    parse_gpu_spec,
    process_memory_mb,
)

NVIDIA_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def summary(spec: str) -> list[tuple[str, int, str, int]]:
    return [(g.node, g.index, g.name, g.memory_mb) for g in parse_gpu_spec(spec)]


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("1x32768:V100", [("local", 0, "V100", 32768)]),
        ("1x32768", [("local", 0, "GPU", 32768)]),
        (
            "2x81920:H100,1x16384:T4",
            [("local", 0, "H100", 81920), ("local", 1, "H100", 81920), ("local", 2, "T4", 16384)],
        ),
        (
            "gpu-a/2x81920:H100,gpu-b/1x16384:T4",
            [("gpu-a", 0, "H100", 81920), ("gpu-a", 1, "H100", 81920), ("gpu-b", 0, "T4", 16384)],
        ),
        # indices count up per node across entries on that node
        (
            "a/1x100:X, b/1x200:Y ,a/1x300:Z",
            [("a", 0, "X", 100), ("b", 0, "Y", 200), ("a", 1, "Z", 300)],
        ),
        ("1X1024:NVIDIA A100-SXM4-80GB", [("local", 0, "NVIDIA A100-SXM4-80GB", 1024)]),
        ("node1.example.org/1x8", [("node1.example.org", 0, "GPU", 8)]),
    ],
)
def test_parse_valid(spec: str, expected: list[tuple[str, int, str, int]]) -> None:
    assert summary(spec) == expected


@pytest.mark.parametrize(
    "spec, says",
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("0x32768:V100", "COUNT must be at least 1, not 0"),
        ("-1x32768", "COUNT '-1' is not a whole positive number"),
        ("1.5x32768", "COUNT '1.5' is not a whole positive number"),
        ("x32768", "COUNT '' is not a whole positive number"),
        ("1x0:V100", "MEMORY must be at least 1, not 0"),
        ("1x-5", "MEMORY '-5' is not a whole positive number"),
        ("1x32G", "MEMORY '32G' is not a whole positive number"),
        ("1x34359738368", "give MiB, not bytes"),
        ("V100", "does not have the form"),
        ("garbage!", "does not have the form"),
        ("a/b/1x10", "does not have the form"),
        ("1x100,,1x100", "an entry is empty"),
        ("1x100,", "an entry is empty"),
        ("1x100:", "NAME ''"),
        ("1x100:bad\tname", "NAME"),
        ("1x100:" + "n" * 65, "NAME"),
        ("-bad/1x100", "node '-bad' is not a host name"),
        ("20000x100", "more than 10000 GPUs"),
        ("5000x1,5000x1,1x1", "more than 10000 GPUs"),
        ("99999999999999999999x1", "more than 10000 GPUs"),
    ],
)
def test_parse_invalid(spec: str, says: str) -> None:
    with pytest.raises(InventoryError) as info:
        parse_gpu_spec(spec)
    message = info.value.message
    assert says in message
    # every message shows a declaration that works
    assert "--gpus 1x32768:V100" in message
    assert isinstance(info.value, GPULeaseError)


def test_limit_is_inclusive() -> None:
    assert len(parse_gpu_spec(f"{inventory.MAX_GPUS}x1")) == inventory.MAX_GPUS


def test_declared_uuids_are_stable_unique_and_nvidia_shaped() -> None:
    spec = "gpu-a/2x81920:H100,gpu-b/4x16384:T4,1x32768:V100"
    first = parse_gpu_spec(spec)
    again = parse_gpu_spec(spec)
    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert len({g.uuid for g in first}) == len(first) == 7
    assert all(NVIDIA_UUID.match(g.uuid) for g in first)
    # a known value: changing the namespace would orphan every persisted lease
    assert first[0].uuid == declared_uuid("gpu-a", 0, "H100", 81920)
    assert declared_uuid("local", 0, "V100", 32768) == parse_gpu_spec("1x32768:V100")[0].uuid
    # another name, memory, node or index is another GPU
    assert parse_gpu_spec("1x32768:V100")[0].uuid != parse_gpu_spec("1x32769:V100")[0].uuid
    assert parse_gpu_spec("1x32768:V100")[0].uuid != parse_gpu_spec("1x32768:A100")[0].uuid
    assert parse_gpu_spec("a/1x1")[0].uuid != parse_gpu_spec("b/1x1")[0].uuid


def test_declared_uuid_value_is_pinned() -> None:
    assert declared_uuid("local", 0, "V100", 32768) == "GPU-" + str(
        __import__("uuid").uuid5(inventory.GPU_UUID_NAMESPACE, "local/0/V100/32768")
    )
    assert str(inventory.GPU_UUID_NAMESPACE) == "5b0f6c1e-7d1c-4c55-9a43-6a1f0e3d2b7a"


# -- NVML, with a stand-in for the pynvml module ------------------------------------------


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNVML:
    """What discover_nvml and process_memory_mb use of pynvml, over a list of devices."""

    NVMLError = FakeNVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = 12

    def __init__(
        self,
        devices: list[dict[str, Any]],
        *,
        init_error: int | None = None,
        fail_on: str | None = None,
    ) -> None:
        self.devices = devices
        self.init_error = init_error
        self.fail_on = fail_on
        self.inits = 0
        self.shutdowns = 0

    def _maybe_fail(self, what: str) -> None:
        if self.fail_on == what:
            raise FakeNVMLError(999)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._maybe_fail("count")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict[str, Any]:
        return self.devices[i]

    def nvmlDeviceGetUUID(self, h: dict[str, Any]) -> Any:
        return h["uuid"]

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> Any:
        self._maybe_fail("name")
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=h["bytes"], free=h["bytes"], used=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[SimpleNamespace]:
        self._maybe_fail("procs")
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in h.get("procs", [])]


GIB = 1024**3
TWO = [
    {"uuid": "GPU-aaaaaaaa-1111-2222-3333-444444444444", "name": "NVIDIA H100", "bytes": 80 * GIB},
    {
        "uuid": b"GPU-bbbbbbbb-1111-2222-3333-444444444444",
        "name": b"Tesla T4",
        "bytes": 15 * GIB + 123,
    },
]


def test_discover_reads_every_device() -> None:
    nvml = FakeNVML(TWO)
    gpus = discover_nvml("gpu-node-7", nvml=nvml)
    assert [(g.uuid, g.node, g.name, g.memory_mb, g.index) for g in gpus] == [
        ("GPU-aaaaaaaa-1111-2222-3333-444444444444", "gpu-node-7", "NVIDIA H100", 81920, 0),
        # bytes from older nvidia-ml-py releases; memory rounded down to MiB
        ("GPU-bbbbbbbb-1111-2222-3333-444444444444", "gpu-node-7", "Tesla T4", 15360, 1),
    ]
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_discover_defaults_node_to_hostname() -> None:
    gpus = discover_nvml(nvml=FakeNVML(TWO[:1]))
    assert gpus[0].node == socket.gethostname()


@pytest.mark.parametrize(
    "nvml, reason",
    [
        (FakeNVML([], init_error=12), "libnvidia-ml.so: not found"),
        (FakeNVML([], init_error=9), "NVML error 9"),
        (FakeNVML([]), "the driver reports 0 GPUs"),
        (FakeNVML(TWO, fail_on="name"), "NVML error 999"),
        (FakeNVML(TWO, fail_on="count"), "NVML error 999"),
    ],
)
def test_discover_failures_name_gpus_option(nvml: FakeNVML, reason: str) -> None:
    with pytest.raises(NoGPUFound) as info:
        discover_nvml(nvml=nvml)
    assert info.value.message == (
        f"No NVIDIA GPU was found with NVML ({reason}). On a machine without NVIDIA GPUs, "
        "declare the pool by hand: --gpus 1x32768:V100"
    )
    assert isinstance(info.value, InventoryError)
    if nvml.inits:  # shut down whenever it was initialised
        assert nvml.shutdowns == 1
    else:
        assert nvml.shutdowns == 0


def test_discover_without_pynvml() -> None:
    missing = "pynvml_is_not_installed_here"  # imported for real: ModuleNotFoundError
    with pytest.raises(NoGPUFound, match=r"nvidia-ml-py is not installed.*--gpus 1x32768:V100"):
        discover_nvml(nvml=missing)
    with pytest.raises(NoGPUFound, match=r"nvidia-ml-py is not installed"):
        load_gpus("nvml", nvml=missing)
    assert process_memory_mb(1, nvml=missing) is None


def test_discover_with_real_nvml_of_this_machine() -> None:
    """The real pynvml: without an NVIDIA GPU (the usual test machine) it says what to do."""
    try:
        gpus = discover_nvml()
    except NoGPUFound as exc:
        assert "No NVIDIA GPU was found with NVML (" in exc.message
        assert exc.message.endswith(
            "On a machine without NVIDIA GPUs, declare the pool by hand: --gpus 1x32768:V100"
        )
    else:  # a machine with NVIDIA GPUs
        assert gpus and all(g.uuid.startswith(("GPU-", "MIG-")) and g.memory_mb > 0 for g in gpus)
        assert [g.index for g in gpus] == list(range(len(gpus)))


@pytest.mark.parametrize("spec", ["nvml", "NVML", " nvml "])
def test_load_gpus_nvml(spec: str) -> None:
    gpus = load_gpus(spec, nvml=FakeNVML(TWO))
    assert [g.memory_mb for g in gpus] == [81920, 15360]


def test_load_gpus_static() -> None:
    assert load_gpus("gpu-a/1x40960:A100") == parse_gpu_spec("gpu-a/1x40960:A100")
    with pytest.raises(InventoryError, match="does not have the form"):
        load_gpus("nvml2")


# -- process memory -------------------------------------------------------------------------


def test_process_memory_sums_over_gpus() -> None:
    devices = [
        {**TWO[0], "procs": [(4242, 600 * 1024**2), (7, GIB)]},
        {**TWO[1], "procs": [(4242, 100 * 1024**2)]},
    ]
    nvml = FakeNVML(devices)
    assert process_memory_mb(4242, nvml=nvml) == 700
    assert process_memory_mb(7, nvml=nvml) == 1024
    assert process_memory_mb(99, nvml=nvml) == 0
    assert nvml.inits == nvml.shutdowns == 3


def test_process_memory_unknown_when_driver_does_not_say() -> None:
    nvml = FakeNVML([{**TWO[0], "procs": [(4242, None)]}])
    assert process_memory_mb(4242, nvml=nvml) is None


@pytest.mark.parametrize("nvml", [FakeNVML(TWO, init_error=12), FakeNVML(TWO, fail_on="procs")])
def test_process_memory_none_when_nvml_fails(nvml: FakeNVML) -> None:
    assert process_memory_mb(1, nvml=nvml) is None


def test_process_memory_with_real_nvml_of_this_machine() -> None:
    import os

    # this test process holds no GPU memory: 0 with a GPU, None without NVML
    assert process_memory_mb(os.getpid()) in (0, None)
