"""Publish, list and remove GPU kernelspecs ("Python 3 (GPU 0.02)").

Pure builders (:func:`build_kernelspec`, :func:`default_name`, :func:`validate_name`)
next to a thin I/O layer over jupyter_client's ``KernelSpecManager`` (:func:`install`,
:func:`list_gpu_kernelspecs`, :func:`remove`). Called by ``gpu-lease kernelspec …``
(``cli.py``); the ready specs in the repository's ``kernelspecs/`` folder are this
module's output too (a test keeps them equal).

A kernelspec carries only what selects a lease — fraction, course group, enforcement,
queue timeout — never a broker URL or a token: those come from the server's
environment (``GPU_LEASE_URL``, ``GPU_LEASE_TOKEN`` / ``JUPYTERHUB_API_TOKEN``), so the
same spec works for every user and no secret lands in a world-readable file.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import InvalidRequest
from ..model import memory_cap_mb, min_memory_mb_for, min_ppm_for, reserved_mb, validate_fraction
from ..wire import DEFAULT_CONTEXT_OVERHEAD_MB, ENFORCEMENTS, fraction_to_ppm, ppm_to_fraction

PROVISIONER_NAME = "gpu-lease-provisioner"
READY_FRACTIONS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

_KERNEL_NAME = re.compile(r"^[a-z0-9._\-]+$", re.IGNORECASE)


# -- pure builders ------------------------------------------------------------
def format_fraction(fraction: float) -> str:
    """0.02 -> "0.02", 1.0 -> "1" (at most 6 decimals, never an exponent)."""
    return f"{fraction:.6f}".rstrip("0").rstrip(".") or "0"


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9._\-]+", "-", text.lower()).strip("-.")
    return slug or "group"


def default_name(fraction: float, group: str | None = None) -> str:
    """The kernelspec name: ``python3-gpu-0.02``, or ``ml101-gpu-0.05`` for a course group."""
    prefix = _slug(group) if group else "python3"
    return f"{prefix}-gpu-{format_fraction(validate_fraction(fraction))}"


def default_display_name(fraction: float, group: str | None = None) -> str:
    """``Python 3 (GPU 0.02)``, or ``Python 3 (GPU 0.05, ml101)`` for a course group."""
    text = f"GPU {format_fraction(validate_fraction(fraction))}"
    if group:
        text += f", {group}"
    return f"Python 3 ({text})"


def validate_name(name: str) -> str:
    """A kernelspec name jupyter_client accepts (letters, digits, ``.``, ``_``, ``-``)."""
    if not isinstance(name, str) or not _KERNEL_NAME.match(name):
        raise InvalidRequest(
            f"Kernelspec names may contain only letters, digits, '.', '_' and '-', not {name!r}."
        )
    return name


#: the provisioner's ``launcher`` values (``kernel/remote.py`` LAUNCHERS)
LAUNCHERS = ("local", "node", "slurm")


def build_kernelspec(
    fraction: float,
    *,
    display_name: str | None = None,
    group: str | None = None,
    python: str = "python",
    language: str = "python",
    enforcement: str | None = None,
    queue_timeout: float | None = None,
    launcher: str | None = None,
) -> dict[str, Any]:
    """The kernel.json dict of a GPU kernelspec (as kernelspecs/ ships them; no URL, no secret).

    ``launcher``: where the kernel runs (``local``, the default, beside the server;
    ``node``: on the node its lease names, launched by that node's agent; ``slurm``: a
    Slurm job there); the kernel's argv must then be valid on the GPU nodes too.

    ``python`` is the kernel's interpreter: "python" means the server's own (jupyter_client
    substitutes ``sys.executable``); a path selects another environment, which needs
    ipykernel but not this package. Optional settings appear in ``config`` only when given.
    """
    frac = validate_fraction(fraction)
    config: dict[str, Any] = {"fraction": frac}
    if group is not None:
        if not isinstance(group, str) or not group.strip():
            raise InvalidRequest("The course group must be a non-empty name.")
        config["group"] = group
    if enforcement is not None:
        if enforcement not in ENFORCEMENTS:
            raise InvalidRequest(
                f"Unknown enforcement {enforcement!r}; use one of: {', '.join(ENFORCEMENTS)}."
            )
        config["enforcement"] = enforcement
    if queue_timeout is not None:
        if (
            isinstance(queue_timeout, bool)
            or not isinstance(queue_timeout, (int, float))
            or not math.isfinite(queue_timeout)
            or queue_timeout < 0
        ):
            raise InvalidRequest(
                f"The queue timeout must be a number of seconds, 0 or more, not {queue_timeout!r}."
            )
        config["queue_timeout"] = queue_timeout
    if launcher is not None:
        if launcher not in LAUNCHERS:
            raise InvalidRequest(
                f"Unknown launcher {launcher!r}; use one of: {', '.join(LAUNCHERS)}."
            )
        config["launcher"] = launcher
    if not python:
        raise InvalidRequest("The kernel's Python must be a command or a path.")
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name or default_display_name(frac, group),
        "language": language,
        "metadata": {
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": config}
        },
    }


def ready_kernelspecs() -> dict[str, dict[str, Any]]:
    """The specs shipped in the repository's ``kernelspecs/`` folder: name -> kernel.json dict."""
    return {default_name(f): build_kernelspec(f) for f in READY_FRACTIONS}


def spec_json(spec: dict[str, Any]) -> str:
    """kernel.json text as written to disk (stable: the ready specs are compared to it)."""
    return json.dumps(spec, indent=1) + "\n"


def gpu_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The provisioner ``config`` of a kernelspec dict if it uses our provisioner, else None."""
    metadata = spec.get("metadata")
    prov = metadata.get("kernel_provisioner") if isinstance(metadata, dict) else None
    if not isinstance(prov, dict) or prov.get("provisioner_name") != PROVISIONER_NAME:
        return None
    config = prov.get("config")
    return config if isinstance(config, dict) else {}


def smallest_gpu_mb(fraction: float, context_overhead_mb: int = DEFAULT_CONTEXT_OVERHEAD_MB) -> int:
    """The least GPU memory (MiB) on which ``fraction`` leaves the kernel a cap of 1 MiB or more.

    The broker reserves ``floor(f·M)`` and caps the kernel at that minus the context
    overhead (``model.memory_cap_mb``).
    """
    return min_memory_mb_for(fraction_to_ppm(validate_fraction(fraction)), context_overhead_mb)


def fit_problem(fraction: float, gpus: list[dict[str, Any]]) -> str | None:
    """Why a kernel of ``fraction`` can never be placed on the broker's pool, else None.

    The broker's own rule (``scheduling.check_can_ever_fit``) over ``gpus``, the list of
    ``GET /api/v1/gpus`` (``memory_mb``, ``name``, ``capacity_fraction`` and
    ``context_overhead_mb``; a broker that sends neither of the last two is assumed to
    use the defaults). Pure: the CLI fetches the pool.
    """
    ppm = fraction_to_ppm(validate_fraction(fraction))
    if not gpus:
        return "the broker's pool has no GPU"

    def overhead(g: dict[str, Any]) -> int:
        value = g.get("context_overhead_mb")
        return value if isinstance(value, int) else DEFAULT_CONTEXT_OVERHEAD_MB

    capacity = max(float(g.get("capacity_fraction") or 1.0) for g in gpus)
    if ppm > fraction_to_ppm(capacity):
        return (
            f"a GPU fraction of {format_fraction(fraction)} is above the "
            f"{format_fraction(capacity)} of a GPU the broker leases at most"
        )
    if any(memory_cap_mb(ppm, int(g.get("memory_mb") or 0), overhead(g)) > 0 for g in gpus):
        return None
    biggest = max(gpus, key=lambda g: int(g.get("memory_mb") or 0))
    memory = int(biggest.get("memory_mb") or 0)
    least = ppm_to_fraction(min_ppm_for(memory, overhead(biggest))) if memory else None
    return (
        f"a GPU fraction of {format_fraction(fraction)} gives at most "
        f"{reserved_mb(ppm, memory)} MiB on the pool's largest GPU "
        f"({biggest.get('name') or 'GPU'}, {memory} MiB), not more than the "
        f"{overhead(biggest)} MiB every CUDA process needs for its context"
        + (f"; the smallest fraction that works there is {format_fraction(least)}" if least else "")
    )


# -- thin I/O -----------------------------------------------------------------
def _manager(prefix: str | None = None) -> Any:
    from jupyter_client.kernelspec import KernelSpecManager

    manager = KernelSpecManager()
    if prefix:
        kernels = os.path.join(os.path.abspath(prefix), "share", "jupyter", "kernels")
        if kernels not in manager.kernel_dirs:
            manager.kernel_dirs = [kernels, *manager.kernel_dirs]
    return manager


def _python_logos() -> list[Path]:
    try:
        from ipykernel.kernelspec import RESOURCES
    except Exception:
        return []
    return sorted(p for p in Path(RESOURCES).glob("logo-*") if p.is_file())


def destination(
    name: str, *, user: bool = False, prefix: str | None = None, sys_prefix: bool = False
) -> Path:
    """The folder :func:`install` writes kernelspec ``name`` to (as ``jupyter kernelspec
    install`` chooses it): the user's Jupyter data dir, ``PREFIX/share/jupyter/kernels``,
    this Python's prefix, else the first system-wide Jupyter path."""
    from jupyter_core.paths import SYSTEM_JUPYTER_PATH, jupyter_data_dir

    if sys_prefix:
        prefix = sys.prefix
    if user:
        root = Path(jupyter_data_dir())
    elif prefix:
        root = Path(os.path.abspath(prefix)) / "share" / "jupyter"
    else:
        root = Path(SYSTEM_JUPYTER_PATH[0])
    return root / "kernels" / name.lower()


def install(
    spec: dict[str, Any],
    name: str,
    *,
    user: bool = False,
    prefix: str | None = None,
    sys_prefix: bool = False,
    replace: bool = True,
) -> str:
    """Install ``spec`` as kernelspec ``name``; returns the folder it was installed in.

    Where: ``user`` (the user's Jupyter data dir), ``prefix`` (``PREFIX/share/jupyter/
    kernels``), ``sys_prefix`` (this Python's prefix), else system-wide, as
    ``jupyter kernelspec install`` (:func:`destination`). An existing spec of that name
    there is replaced, unless ``replace`` is False (``gpu-lease kernelspec install``
    without ``--replace``): then :class:`InvalidRequest` says what is there. Python
    kernelspecs get ipykernel's logos when ipykernel is installed here.
    """
    validate_name(name)
    if sum(bool(x) for x in (user, prefix, sys_prefix)) > 1:
        raise InvalidRequest("Choose one place to install: --user, --sys-prefix or --prefix.")
    if sys_prefix:
        prefix = sys.prefix
    target = destination(name, user=user, prefix=prefix)
    if not replace and target.exists():
        old = _read_spec(str(target)) or {}
        shown = f" ({old['display_name']})" if isinstance(old.get("display_name"), str) else ""
        raise InvalidRequest(
            f"A kernelspec named {name!r}{shown} is already installed in {target}; students "
            "with a notebook on it would get the new settings. Add --replace to overwrite it, "
            "or choose another --name."
        )
    with tempfile.TemporaryDirectory(prefix="gpu-lease-kernelspec-") as tmp:
        source = Path(tmp) / name
        source.mkdir()
        (source / "kernel.json").write_text(spec_json(spec), encoding="utf-8")
        if spec.get("language") == "python":
            for logo in _python_logos():
                shutil.copyfile(logo, source / logo.name)
        try:
            return str(_manager().install_kernel_spec(str(source), name, user=user, prefix=prefix))
        except PermissionError as exc:
            raise InvalidRequest(
                f"No permission to install the kernelspec in {exc.filename or 'that place'}; "
                "use --user, --sys-prefix or --prefix, or run as an administrator."
            ) from exc


def _read_spec(resource_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(resource_dir, "kernel.json"), encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def list_gpu_kernelspecs(*, prefix: str | None = None) -> list[dict[str, Any]]:
    """Installed kernelspecs that use our provisioner: name, fraction, group, display_name, path.

    Searches Jupyter's kernel folders (and ``PREFIX/share/jupyter/kernels`` if given).
    Reads each kernel.json itself: ``KernelSpecManager.get_all_specs`` hides specs whose
    provisioner is not installed in *this* environment, which are the ones to show.
    """
    found = []
    for name, resource_dir in sorted(_manager(prefix).find_kernel_specs().items()):
        spec = _read_spec(resource_dir)
        config = gpu_config(spec) if spec else None
        if config is None or spec is None:
            continue
        found.append(
            {
                "name": name,
                "fraction": config.get("fraction"),
                "group": config.get("group"),
                "display_name": spec.get("display_name"),
                "path": resource_dir,
            }
        )
    return found


def remove(name: str, *, prefix: str | None = None) -> str:
    """Remove the GPU kernelspec ``name``; returns the folder removed.

    Refuses kernelspecs that do not use our provisioner (``jupyter kernelspec remove``
    is the tool for those).
    """
    manager = _manager(prefix)
    resource_dir = manager.find_kernel_specs().get(name)
    if resource_dir is None:
        raise InvalidRequest(
            f"There is no kernelspec named {name!r}; `gpu-lease kernelspec list` shows them."
        )
    spec = _read_spec(resource_dir)
    if spec is None or gpu_config(spec) is None:
        raise InvalidRequest(
            f"The kernelspec {name!r} is not a GPU lease kernelspec; remove it with "
            "`jupyter kernelspec remove` if you mean to."
        )
    try:
        return str(manager.remove_kernel_spec(name))
    except PermissionError as exc:
        raise InvalidRequest(
            f"No permission to remove {exc.filename or name}; run as an administrator."
        ) from exc
