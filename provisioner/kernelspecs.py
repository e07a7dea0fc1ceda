"""Publish, list and remove GPU kernelspecs ("Python 3 (GPU 0.02)").

Pure builders (:func:`build_kernelspec`, :func:`default_name`, :func:`validate_fraction`)
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

from .errors import InvalidRequest
from .model import fraction_to_ppm

PROVISIONER_NAME = "gpu-lease-provisioner"
ENFORCEMENTS = ("cooperative", "mps")
READY_FRACTIONS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

_KERNEL_NAME = re.compile(r"^[a-z0-9._\-]+$", re.IGNORECASE)


# -- pure builders ------------------------------------------------------------
def validate_fraction(value: Any) -> float:
    """``value`` as a GPU fraction in (0, 1], or :class:`InvalidRequest` saying what is wrong.

    Accepts numbers and numeric strings (from the command line); refuses booleans,
    NaN, infinities, 0, negatives, values above 1 and values below one part per million.
    """
    number: float
    if isinstance(value, bool):
        raise InvalidRequest(f"The GPU fraction must be a number, not {value!r}.")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise InvalidRequest(
                f"The GPU fraction must be a number such as 0.02 or 0.25, not {value!r}."
            ) from None
    else:
        raise InvalidRequest(
            f"The GPU fraction must be a number such as 0.02 or 0.25, not {type(value).__name__}."
        )
    if not math.isfinite(number):
        raise InvalidRequest(
            f"The GPU fraction must be a finite number above 0 and at most 1, not {value!r}."
        )
    if number <= 0 or number > 1:
        raise InvalidRequest(
            f"The GPU fraction must be above 0 and at most 1 (1 is a whole GPU), not {value!r}."
        )
    if fraction_to_ppm(number) < 1:
        raise InvalidRequest(
            f"The GPU fraction {value!r} is below one millionth of a GPU; use at least 0.000001."
        )
    return number


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


def build_kernelspec(
    fraction: Any,
    *,
    display_name: str | None = None,
    group: str | None = None,
    python: str = "python",
    language: str = "python",
    enforcement: str | None = None,
    queue_timeout: float | None = None,
) -> dict[str, Any]:
    """The kernel.json dict of a GPU kernelspec (the DESIGN shape; no URL, no secret).

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


def install(
    spec: dict[str, Any],
    name: str,
    *,
    user: bool = False,
    prefix: str | None = None,
    sys_prefix: bool = False,
) -> str:
    """Install ``spec`` as kernelspec ``name``; returns the folder it was installed in.

    Where: ``user`` (the user's Jupyter data dir), ``prefix`` (``PREFIX/share/jupyter/
    kernels``), ``sys_prefix`` (this Python's prefix), else system-wide, as
    ``jupyter kernelspec install``. An existing spec of that name is replaced. Python
    kernelspecs get ipykernel's logos when ipykernel is installed here.
    """
    validate_name(name)
    if sum(bool(x) for x in (user, prefix, sys_prefix)) > 1:
        raise InvalidRequest("Choose one place to install: --user, --sys-prefix or --prefix.")
    if sys_prefix:
        prefix = sys.prefix
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
