"""The ``gpu-lease`` command (also ``jupyter gpu-lease`` and ``python -m provisioner``).

::

    gpu-lease broker [broker options]            run the broker (provisioner.broker.app)
    gpu-lease kernelspec install --fraction F    publish a GPU kernelspec
    gpu-lease kernelspec list | remove NAME...
    gpu-lease top | leases | quota ... | usage   talk to the broker (GPU_LEASE_URL, GPU_LEASE_TOKEN)

:func:`main` parses the command line and calls one ``cmd_*`` function with the parsed
arguments; each returns the exit status. Errors from our exception tree are printed as
``error: <message>`` on stderr with exit status 1; usage errors (including an invalid
fraction) exit with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from . import kernelspecs as ks
from .errors import GPULeaseError, InvalidRequest

PROG = "gpu-lease"


# -- argument types (argparse turns ArgumentTypeError into a usage error) --------
def fraction_arg(text: str) -> float:
    """A GPU fraction in (0, 1]; the message says what is wrong."""
    try:
        return ks.validate_fraction(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _non_negative(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {kind.__name__} of 0 or more, not {text!r}"
            ) from None
        if value != value or value < 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"expected a finite {kind.__name__} of 0 or more, not {text!r}"
            )
        return value

    convert.__name__ = kind.__name__
    return convert


# -- kernelspec ------------------------------------------------------------------
def cmd_kernelspec_install(args: argparse.Namespace) -> int:
    spec = ks.build_kernelspec(
        args.fraction,
        display_name=args.display_name,
        group=args.group,
        python=args.python,
        enforcement=args.enforcement,
        queue_timeout=args.queue_timeout,
    )
    name = args.name or ks.default_name(args.fraction, args.group)
    path = ks.install(spec, name, user=args.user, prefix=args.prefix, sys_prefix=args.sys_prefix)
    print(f"Installed kernelspec {name} ({spec['display_name']}) in {path}")
    return 0


def cmd_kernelspec_list(args: argparse.Namespace) -> int:
    specs = ks.list_gpu_kernelspecs(prefix=args.prefix)
    if args.json:
        print(json.dumps({"kernelspecs": specs}, indent=1))
        return 0
    if not specs:
        print(
            "No GPU kernelspecs installed; add one with `gpu-lease kernelspec install --fraction F`."
        )
        return 0
    rows = [
        (
            s["name"],
            ks.format_fraction(float(s["fraction"])) if s["fraction"] is not None else "?",
            s["group"] or "-",
            s["display_name"] or "",
            s["path"] or "",
        )
        for s in specs
    ]
    header = ("NAME", "FRACTION", "GROUP", "DISPLAY NAME", "PATH")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
    for row in (header, *rows):
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True))
            + "  "
            + row[-1]
        )
    return 0


def cmd_kernelspec_remove(args: argparse.Namespace) -> int:
    for name in args.names:
        path = ks.remove(name, prefix=args.prefix)
        print(f"Removed kernelspec {name} from {path}")
    return 0


# -- broker --------------------------------------------------------------------
def cmd_broker(argv: list[str]) -> int:
    """Run the broker; its own parser (traitlets) handles ``argv``."""
    try:
        from .broker.app import main as broker_main
    except ModuleNotFoundError as exc:
        if exc.name not in ("provisioner.broker", "provisioner.broker.app"):
            raise
        raise GPULeaseError(
            "The broker is not part of this installation (provisioner.broker.app is missing); "
            "reinstall jupyter-gpu-lease."
        ) from exc
    status = broker_main(argv)
    return int(status or 0)


# -- commands that talk to the broker (filled in later) ------------------------------
def _not_yet(name: str) -> int:
    print(f"{PROG} {name}: not yet implemented", file=sys.stderr)
    return 2


def cmd_top(args: argparse.Namespace) -> int:
    """Per GPU: allocated/total and each lease's user, kernel, fraction, memory, idle time."""
    return _not_yet("top")


def cmd_leases(args: argparse.Namespace) -> int:
    """List leases: the caller's own, ``--user NAME``'s or ``--all`` (admin)."""
    return _not_yet("leases")


def cmd_quota(args: argparse.Namespace) -> int:
    """``args.action`` in set|show|list|remove; target ``args.user``/``args.group``/``args.default``."""
    return _not_yet("quota")


def cmd_usage(args: argparse.Namespace) -> int:
    """Fraction-hours used ``--since`` a time, ``--by user|group``, optionally as ``--csv``."""
    return _not_yet("usage")


# -- parser ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Fractional GPU leases for Jupyter kernels."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    broker = sub.add_parser(
        "broker",
        help="run the GPU lease broker (options: gpu-lease broker --help)",
        add_help=False,
    )
    broker.set_defaults(func=None)

    # kernelspec
    kspec = sub.add_parser("kernelspec", help="publish, list and remove GPU kernelspecs")
    ksub = kspec.add_subparsers(dest="action", metavar="ACTION", required=True)
    inst = ksub.add_parser("install", help="install a GPU kernelspec")
    inst.add_argument(
        "--fraction", required=True, type=fraction_arg, help="GPU fraction in (0, 1], e.g. 0.02"
    )
    inst.add_argument("--name", help="kernelspec name (default: python3-gpu-F or GROUP-gpu-F)")
    inst.add_argument(
        "--display-name", help='name shown in JupyterLab (default: "Python 3 (GPU F)")'
    )
    inst.add_argument("--group", help="course group: only its members (and admins) may use it")
    inst.add_argument(
        "--python",
        default="python",
        help="the kernel's Python (default: the server's); another environment needs ipykernel only",
    )
    inst.add_argument("--enforcement", choices=ks.ENFORCEMENTS, help="cooperative (default) or mps")
    inst.add_argument(
        "--queue-timeout",
        type=_non_negative(float),
        metavar="SECONDS",
        help="give up starting the kernel after waiting this long in the queue",
    )
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user")
    where.add_argument(
        "--sys-prefix",
        action="store_true",
        help=f"install into this Python's prefix ({sys.prefix})",
    )
    where.add_argument(
        "--prefix", metavar="PREFIX", help="install into PREFIX/share/jupyter/kernels"
    )
    inst.set_defaults(func=cmd_kernelspec_install)

    lst = ksub.add_parser("list", help="list installed GPU kernelspecs")
    lst.add_argument("--json", action="store_true", help="print JSON")
    lst.add_argument("--prefix", metavar="PREFIX", help="also search PREFIX/share/jupyter/kernels")
    lst.set_defaults(func=cmd_kernelspec_list)

    rm = ksub.add_parser("remove", help="remove GPU kernelspecs")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.add_argument("--prefix", metavar="PREFIX", help="also search PREFIX/share/jupyter/kernels")
    rm.set_defaults(func=cmd_kernelspec_remove)

    # commands that talk to the broker
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--url", help="the broker's URL (default: $GPU_LEASE_URL)")

    top = sub.add_parser("top", parents=[remote], help="GPUs, their leases and the queue")
    top.set_defaults(func=cmd_top)

    leases = sub.add_parser("leases", parents=[remote], help="list leases")
    leases.add_argument("--all", action="store_true", help="every user's leases (admin)")
    leases.add_argument("--user", metavar="NAME", help="this user's leases (admin)")
    leases.set_defaults(func=cmd_leases)

    quota = sub.add_parser("quota", parents=[remote], help="set, show, list or remove quotas")
    quota.add_argument("action", choices=("set", "show", "list", "remove"))
    target = quota.add_mutually_exclusive_group()
    target.add_argument("--user", metavar="NAME", help="a user's quota")
    target.add_argument("--group", metavar="NAME", help="a group's (course's) quota")
    target.add_argument("--default", action="store_true", help="the default quota")
    quota.add_argument(
        "--max-fraction", type=fraction_arg, metavar="F", help="sum of fractions held at once"
    )
    quota.add_argument(
        "--max-leases", type=_non_negative(int), metavar="N", help="leases held at once"
    )
    quota.add_argument(
        "--max-lease-fraction", type=fraction_arg, metavar="F", help="largest single lease"
    )
    quota.add_argument(
        "--budget-fraction-hours",
        type=_non_negative(float),
        metavar="H",
        help="fraction-hours per budget window",
    )
    quota.add_argument("--budget-window", metavar="DURATION", help="budget window, e.g. 7d or 24h")
    quota.add_argument("--priority", type=int, help="queue priority of a group (higher first)")
    quota.set_defaults(func=cmd_quota)

    usage = sub.add_parser("usage", parents=[remote], help="fraction-hours used")
    usage.add_argument("--since", metavar="WHEN", help="a date/time or a duration such as 7d")
    usage.add_argument("--by", choices=("user", "group"), default="user")
    usage.add_argument("--csv", action="store_true", help="print CSV")
    usage.set_defaults(func=cmd_usage)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpu-lease`` console script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(args_list)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "broker":
            return cmd_broker(rest)
        if rest:
            try:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            except SystemExit as exc:
                return exc.code if isinstance(exc.code, int) else 2
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except GPULeaseError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
