"""The ``gpu-lease`` command (also ``jupyter gpu-lease`` and ``python -m provisioner``).

::

    gpu-lease broker [broker options]            run the broker (provisioner.broker.app)
    gpu-lease agent --broker-url URL [...]       run a node agent (provisioner.node.agent)
    gpu-lease kernelspec install --fraction F    publish a GPU kernelspec
    gpu-lease kernelspec list | remove NAME...
    gpu-lease top [--watch N] | leases | quota ... | usage | revoke ID --reason TEXT
    gpu-lease session list | start|extend|end COURSE [--until 11:45] [--seats 40]
                                                 talk to the broker (GPU_LEASE_URL, GPU_LEASE_TOKEN)

:func:`main` parses the command line and calls one ``cmd_*`` function with the parsed
arguments; each returns the exit status. Errors from our exception tree are printed as
``error: <message>`` on stderr with exit status 1; usage errors (including an invalid
fraction) exit with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from . import __version__, tables
from .client import BrokerClient, broker_env
from .errors import Forbidden, GPULeaseError, InvalidRequest, LeaseNotFound, NotFound
from .kernel import kernelspecs as ks
from .model import QUOTA_FIELDS, validate_fraction
from .wire import ENFORCEMENTS

PROG = "gpu-lease"
#: what runs ``gpu-lease broker ARGS``: ``broker.app.main`` (its exit status, or None for 0)
BrokerMain = Callable[[list[str]], int | None]


# -- argument types (argparse turns ArgumentTypeError into a usage error) --------
def fraction_arg(text: str) -> float:
    """A GPU fraction in (0, 1] from the command line (``model.validate_fraction``'s rule)."""
    value: object
    try:
        value = float(text)
    except ValueError:
        value = text  # not a number: the rule refuses it with its usual sentence
    try:
        return validate_fraction(value)
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


def _positive_float(text: str) -> float:
    value = _non_negative(float)(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, not {text!r}")
    return float(value)


# -- kernelspec ------------------------------------------------------------------
def cmd_kernelspec_install(args: argparse.Namespace) -> int:
    """Publish a GPU kernelspec; refuse to overwrite one, or to publish one that never fits.

    Before writing, the fraction is checked against the broker's pool (``GET
    /api/v1/gpus``, with ``GPU_LEASE_URL`` and the token of the environment, as in a hub
    server's terminal): a kernel that could never be placed is refused (status 1).
    Without a broker URL, or when it cannot be asked, a warning on stderr says on which
    GPUs the fraction leaves the kernel no memory.
    """
    spec = ks.build_kernelspec(
        args.fraction,
        display_name=args.display_name,
        group=args.group,
        python=args.python,
        enforcement=args.enforcement,
        queue_timeout=args.queue_timeout,
        launcher=args.launcher,
    )
    name = args.name or ks.default_name(args.fraction, args.group)
    _check_fraction_fits(args)
    path = ks.install(
        spec,
        name,
        user=args.user,
        prefix=args.prefix,
        sys_prefix=args.sys_prefix,
        replace=args.replace,
    )
    print(f"Installed kernelspec {name} ({spec['display_name']}) in {path}")
    return 0


#: below this much GPU memory (MiB) a fraction that leaves no memory gets a warning
#: without a broker to ask: 32 GiB, a common teaching GPU (V100)
WARN_BELOW_MB = 32768


def _broker_gpus(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The broker's pool (``GET /api/v1/gpus``) at ``--url`` or ``GPU_LEASE_URL``."""

    async def pool() -> list[dict[str, Any]]:
        async with _client(args) as client:
            return await client.gpus()

    return asyncio.run(pool())


def _check_fraction_fits(args: argparse.Namespace) -> None:
    """Refuse (broker asked) or warn (no broker) when ``args.fraction`` can never fit."""
    fraction = args.fraction
    least_mb = ks.smallest_gpu_mb(fraction)
    unasked = ""
    if broker_env().url or getattr(args, "url", None):
        try:
            gpus = _broker_gpus(args)
        except GPULeaseError as exc:
            unasked = f" (the broker could not be asked: {exc.message.rstrip('.')})"
        else:
            problem = ks.fit_problem(fraction, gpus)
            if problem is not None:
                raise InvalidRequest(
                    f"Not installed: {problem}. The broker would refuse every start of this "
                    "kernel; choose a larger --fraction."
                )
            return
    if least_mb > WARN_BELOW_MB:
        print(
            f"warning: a GPU fraction of {ks.format_fraction(fraction)} leaves a kernel no GPU "
            f"memory on GPUs of less than {least_mb} MiB ({least_mb / 1024:.1f} GiB): the "
            f"broker needs more than {ks.DEFAULT_CONTEXT_OVERHEAD_MB} MiB per kernel for the "
            "CUDA context and refuses such starts. Set GPU_LEASE_URL (and GPU_LEASE_TOKEN) to "
            f"check it against the broker's pool{unasked}.",
            file=sys.stderr,
        )


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
def cmd_broker(argv: list[str], run: BrokerMain | None = None) -> int:
    """Run the broker (``run``, by default ``broker.app.main``) on ``argv``, untouched.

    The broker's own parser (traitlets) handles ``argv``; it is imported only here, so
    the other commands start without loading tornado, JupyterHub and SQLAlchemy.
    """
    if run is None:
        gc.disable()  # as broker.app.main does, already while the broker's modules load
        try:
            from .broker.app import main as broker_main
        finally:
            gc.enable()
        run = broker_main
    return int(run(argv) or 0)


# -- commands that talk to the broker --------------------------------------------------
#: a CLI call gives up quickly when the broker is down (the provisioner retries longer)
CLI_RETRIES = 1


def _client(args: argparse.Namespace) -> BrokerClient:
    """A client from ``--url`` or ``GPU_LEASE_URL`` and ``GPU_LEASE_TOKEN`` (read now)."""
    return BrokerClient.from_env(url=getattr(args, "url", None), retries=CLI_RETRIES)


def _run(work: Callable[[BrokerClient], Awaitable[str]], args: argparse.Namespace) -> int:
    """Open a client, await ``work`` and print the text it returns."""

    async def go() -> str:
        async with _client(args) as client:
            return await work(client)

    text = asyncio.run(go())
    if text:
        print(text.rstrip("\n"))
    return 0


async def _top_text(client: BrokerClient) -> str:
    gpus = await client.gpus()
    try:
        leases = await client.leases.listing(all=True)
    except Forbidden:  # a student sees the pool and their own leases
        leases = await client.leases.listing()
    queue = await client.leases.queue()
    try:
        sessions = (await client.sessions.listing())["sessions"]
    except NotFound:  # a broker older than class sessions
        sessions = []
    return tables.format_top(
        gpus, [x.to_json() for x in leases], queue, time.time(), sessions=sessions
    )


def cmd_top(args: argparse.Namespace) -> int:
    """Per GPU: allocated/total and each lease's user, kernel, fraction, memory, idle time."""
    if not args.watch:
        return _run(_top_text, args)

    async def watch() -> None:
        async with _client(args) as client:
            while True:
                text = await _top_text(client)
                clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                print(f"{clear}gpu-lease top  {stamp}  (every {args.watch:g} s, Ctrl-C stops)\n")
                print(text, flush=True)
                await asyncio.sleep(args.watch)

    try:
        asyncio.run(watch())
    except KeyboardInterrupt:
        pass
    return 0


def cmd_leases(args: argparse.Namespace) -> int:
    """List leases: the caller's own, ``--user NAME``'s or ``--all`` (admin)."""

    async def work(client: BrokerClient) -> str:
        leases = await client.leases.listing(all=args.all, user=args.user)
        if args.json:
            return json.dumps({"leases": [x.to_json() for x in leases]}, indent=1)
        if not leases and not args.all and args.user is None:
            try:  # an admin's own list is empty: say how to see everyone's
                others = await client.leases.listing(all=True)
            except Forbidden:
                others = []
            if others:
                n = len(others)
                return (
                    f"You hold no active leases; {n} other active lease{'' if n == 1 else 's'}: "
                    f"`{PROG} leases --all` lists them (`--user NAME` one user's)."
                )
        rows = [x.to_json() for x in leases]
        return tables.format_leases(rows, time.time(), await client.gpus())

    return _run(work, args)


def _quota_target(args: argparse.Namespace) -> tuple[str, str | None] | None:
    if args.default:
        return "default", None
    if args.user:
        return "user", args.user
    if args.group:
        return "group", args.group
    return None


def _quota_title(level: str, name: str | None) -> str:
    return "Default quota:" if level == "default" else f"Quota of {level} {name}:"


def quota_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The quota fields given on the command line, as the API names them."""
    fields = {
        "max_fraction": args.max_fraction,
        "max_leases": args.max_leases,
        "max_lease_fraction": args.max_lease_fraction,
        "budget_fraction_hours": args.budget_fraction_hours,
        "budget_window": args.budget_window,
        "priority": args.priority,
    }
    return {k: v for k, v in fields.items() if v is not None}


def cmd_quota(args: argparse.Namespace) -> int:
    """``args.action`` in set|show|list|remove; target ``args.user``/``args.group``/``args.default``."""
    target = _quota_target(args)
    changes = quota_changes(args)
    if changes and args.action != "set":
        raise InvalidRequest(
            f"Quota limits are given only with `{PROG} quota set`; "
            f"`quota {args.action}` takes a target only."
        )
    if args.action in ("set", "remove") and target is None:
        raise InvalidRequest(
            f"Say whose quota to {args.action}: --user NAME, --group NAME or --default."
        )
    if args.action == "list" and target is not None:
        raise InvalidRequest(
            f"`{PROG} quota list` shows every quota; use `quota show` with a target."
        )

    async def work(client: BrokerClient) -> str:
        if args.action == "list":
            return tables.format_quota_list(await client.quotas.book())
        if args.action == "show":
            if target is None:
                return tables.format_my_quota(await client.quotas.mine())
            level, name = target
            if level == "user" and name is not None:
                return tables.format_effective_quota(await client.quotas.effective(name))
            return tables.format_quota(
                _quota_title(level, name), await client.quotas.get(level, name)
            )
        assert target is not None
        level, name = target
        if args.action == "remove":
            await client.quotas.delete(level, name)
            return f"Removed the {'default quota' if level == 'default' else f'quota of {level} {name}'}."
        if not changes:
            raise InvalidRequest(
                "Give at least one limit to set: --max-fraction, --max-leases, "
                "--max-lease-fraction, --budget-fraction-hours with --budget-window, or --priority."
            )
        try:  # set changes only the limits given; the others keep their values
            current = await client.quotas.get(level, name)
        except LeaseNotFound:
            current = {}
        body = {k: current.get(k) for k in QUOTA_FIELDS}
        body.update(changes)
        stored = await client.quotas.put(level, name, body)
        return tables.format_quota(f"Set {_quota_title(level, name)[:-1].lower()}:", stored)

    return _run(work, args)


def local_zone() -> str:
    """This terminal's IANA time zone (``$TZ``, else ``/etc/localtime``'s link), else UTC."""
    name = os.environ.get("TZ", "").lstrip(":")
    if not name:
        try:
            target = os.path.realpath("/etc/localtime")
        except OSError:
            target = ""
        if "zoneinfo/" in target:
            name = target.split("zoneinfo/", 1)[1]
    try:
        ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        return "UTC"
    return name or "UTC"


def until_arg(text: str, now: float | None = None, zone: str | None = None) -> float:
    """``--until``: ``11:45`` (today, in this terminal's zone), or a length (``90m``,
    ``2h``) from now -> POSIX seconds."""
    now = time.time() if now is None else now
    tz = ZoneInfo(zone or local_zone())
    text = text.strip()
    if ":" in text:
        try:
            hour, minute = (int(x) for x in text.split(":"))
            when = dt.datetime.fromtimestamp(now, tz).replace(
                hour=hour, minute=minute, second=0, microsecond=0
            )
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a time such as 11:45 or a length such as 90m"
            ) from exc
        if when.timestamp() <= now:
            raise argparse.ArgumentTypeError(
                f"{text} has passed today; give a later time (or a length such as 90m)"
            )
        return when.timestamp()
    units = {"m": 60, "h": 3600}
    try:
        return now + float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError) as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time such as 11:45 or a length such as 90m or 2h"
        ) from exc


def cmd_session(args: argparse.Namespace) -> int:
    """``session list [COURSE]``; ``session start|extend|end COURSE`` (its instructors)."""
    if args.action != "list" and not args.course:
        raise InvalidRequest(f"Say which course: {PROG} session {args.action} COURSE.")
    if args.action in ("start", "extend") and args.until is None:
        raise InvalidRequest(
            f"Say until when: {PROG} session {args.action} {args.course} --until 11:45."
        )
    if args.action == "start" and (args.seats is None) == (args.share is None):
        raise InvalidRequest(
            "Say what to reserve: --seats N (each of the course's kernel fraction, or "
            "--kernel-fraction F) or --share F (a fraction of the pool)."
        )

    async def work(client: BrokerClient) -> str:
        calls = client.sessions
        if args.action == "list":
            listing = await calls.listing(args.course)
            if args.json:
                return json.dumps(listing, indent=2)
            return tables.format_sessions(listing["sessions"])
        if args.action == "start":
            body: dict[str, Any] = {"until": args.until, "tz": local_zone()}
            for key in ("seats", "kernel_fraction", "share"):
                if getattr(args, key) is not None:
                    body[key] = getattr(args, key)
            return tables.format_session("started", await calls.start(args.course, body))
        if args.action == "extend":
            return tables.format_session("extended", await calls.extend(args.course, args.until))
        return tables.format_session("ended", await calls.end(args.course))

    return _run(work, args)


def cmd_usage(args: argparse.Namespace) -> int:
    """Fraction-hours used ``--since`` a time, ``--by user|group``, optionally as ``--csv``."""

    async def work(client: BrokerClient) -> str:
        usage = await client.quotas.usage(since=args.since, by=args.by)
        if args.csv:
            return tables.usage_csv(usage, args.by)
        return tables.format_usage(usage, args.by)

    return _run(work, args)


def cmd_revoke(args: argparse.Namespace) -> int:
    """Admin: end someone's lease; its kernel shuts down and the student sees ``--reason``."""

    async def work(client: BrokerClient) -> str:
        lease_id = await _resolve_lease_id(client, args.lease_id)
        lease = await client.leases.revoke(lease_id, args.reason)
        return (
            f"Revoked lease {lease.id} of {lease.user} "
            f"(kernel {tables.short(lease.kernel_id)}, "
            f"{tables.fraction(lease.fraction)} of a GPU): {lease.reason}"
        )

    return _run(work, args)


async def _resolve_lease_id(client: BrokerClient, given: str) -> str:
    """A full lease id from what ``top``/``leases`` print: the id, or a unique prefix of one
    active lease's id. Anything else goes to the broker as typed (its answer says why not:
    unknown, already ended, not an admin)."""
    given = given.strip()
    try:
        active = await client.leases.listing(all=True)
    except Forbidden:
        return given
    ids = [x.id for x in active]
    if given in ids:
        return given
    matches = [i for i in ids if i.startswith(given)] if given else []
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        shown = ", ".join(tables.short(i, len(given) + 4) for i in matches[:5])
        raise InvalidRequest(
            f"{len(matches)} active leases have ids starting with {given!r} ({shown}"
            f"{', ...' if len(matches) > 5 else ''}); give more characters of the id."
        )
    return given


def cmd_doctor(args: argparse.Namespace) -> int:
    from .node import doctor

    if args.processes < 1:
        print("error: --processes must be at least 1", file=sys.stderr)
        return 2
    if args.cap_mb is not None and args.cap_mb < 1:
        print("error: --cap-mb must be at least 1", file=sys.stderr)
        return 2
    overhead, source = args.context_overhead_mb, "--context-overhead-mb"
    if overhead is None:
        overhead, source = _brokers_context_overhead(args)
    elif overhead < 0:
        print("error: --context-overhead-mb must not be negative", file=sys.stderr)
        return 2
    return doctor.main(
        as_json=args.json,
        processes=args.processes,
        cap_mb=args.cap_mb,
        context_overhead_mb=overhead,
        context_overhead_source=source,
    )


def _brokers_context_overhead(args: argparse.Namespace) -> tuple[int, str]:
    """The broker's ``context_overhead_mb`` (``GET /api/v1/gpus``) and where it came from,
    or the default when no broker is named or it cannot be asked."""
    default = ks.DEFAULT_CONTEXT_OVERHEAD_MB
    if not (broker_env().url or args.url):
        return default, "the broker's default; set GPU_LEASE_URL to compare with its setting"
    try:
        gpus = _broker_gpus(args)
    except GPULeaseError as exc:
        return default, f"the default: the broker could not be asked ({exc.message.rstrip('.')})"
    values = [
        g["context_overhead_mb"] for g in gpus if isinstance(g.get("context_overhead_mb"), int)
    ]
    if not values:
        return default, "the default: the broker's pool names no context_overhead_mb"
    return max(values), "the broker's setting"


# -- parser ----------------------------------------------------------------------
def cmd_agent(argv: list[str]) -> int:
    """Run a node agent (``agent.main``) on ``argv``, untouched (its parser is traitlets')."""
    from .node.agent import main as agent_main

    return int(agent_main(argv) or 0)


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

    agent = sub.add_parser(
        "agent",
        help="run a GPU node agent (options: gpu-lease agent --help)",
        add_help=False,
    )
    agent.set_defaults(func=None)

    doctor = sub.add_parser(
        "doctor",
        help="self-test of this GPU node: NVML, driver, MPS, frameworks "
        "(exit 0 all ran and passed, 1 a check failed, 3 some could not run here)",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.add_argument(
        "--processes",
        type=int,
        default=4,
        metavar="N",
        help="concurrent capped processes of the cap-escape check (default 4; needs a GPU)",
    )
    doctor.add_argument(
        "--cap-mb",
        type=int,
        default=None,
        metavar="MIB",
        help="each probe's memory cap (default 1024 MiB, or an eighth of a smaller GPU)",
    )
    doctor.add_argument(
        "--context-overhead-mb",
        type=int,
        default=None,
        metavar="MIB",
        help="the broker's context_overhead_mb: a CUDA context larger than this fails "
        "(default: asked of the broker at --url or $GPU_LEASE_URL, else 512)",
    )
    doctor.add_argument("--url", help="the broker's URL (default: $GPU_LEASE_URL)")
    doctor.set_defaults(func=cmd_doctor)

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
    inst.add_argument("--enforcement", choices=ENFORCEMENTS, help="cooperative (default) or mps")
    inst.add_argument(
        "--launcher",
        choices=("local", "node", "slurm"),
        help="where the kernel runs: local (default: beside the server), node (on the node "
        "its lease names, launched by that node's agent), slurm (a Slurm job there)",
    )
    inst.add_argument(
        "--queue-timeout",
        type=_non_negative(float),
        metavar="SECONDS",
        help="give up starting the kernel after waiting this long in the queue",
    )
    inst.add_argument(
        "--replace",
        action="store_true",
        help="overwrite a kernelspec of the same name in that place (refused without it)",
    )
    inst.add_argument(
        "--url",
        help="the broker whose pool the fraction is checked against (default: $GPU_LEASE_URL)",
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
    top.add_argument(
        "--watch",
        type=_positive_float,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C",
    )
    top.set_defaults(func=cmd_top)

    leases = sub.add_parser("leases", parents=[remote], help="list leases")
    leases.add_argument("--all", action="store_true", help="every user's leases (admin)")
    leases.add_argument("--user", metavar="NAME", help="this user's leases (admin)")
    leases.add_argument("--json", action="store_true", help="print the API's JSON")
    leases.set_defaults(func=cmd_leases)

    revoke = sub.add_parser(
        "revoke", parents=[remote], help="end someone's lease and stop its kernel (admin)"
    )
    revoke.add_argument(
        "lease_id",
        metavar="LEASE_ID",
        help="the lease id, or the start of it that `gpu-lease top` / `leases --all` print",
    )
    revoke.add_argument("--reason", required=True, metavar="TEXT", help="why; the student sees it")
    revoke.set_defaults(func=cmd_revoke)

    quota = sub.add_parser("quota", parents=[remote], help="set, show, list or remove quotas")
    quota.add_argument("action", choices=("set", "show", "list", "remove"))
    target = quota.add_mutually_exclusive_group()
    target.add_argument("--user", metavar="NAME", help="a user's quota")
    target.add_argument("--group", metavar="NAME", help="a group's (course's) quota")
    target.add_argument("--default", action="store_true", help="the default quota")
    quota.add_argument(
        "--max-fraction",
        type=_non_negative(float),
        metavar="F",
        help="sum of fractions held at once, over all GPUs (e.g. 0.5, or 2 for two GPUs)",
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

    session = sub.add_parser(
        "session",
        parents=[remote],
        help="class sessions: the timetable; start, extend or end one (its instructors)",
    )
    session.add_argument("action", choices=("list", "start", "extend", "end"))
    session.add_argument("course", nargs="?", help="the course (a group of the courses file)")
    session.add_argument(
        "--until",
        type=until_arg,
        metavar="TIME",
        help="when it ends: 11:45 (today, this terminal's time zone) or a length (90m, 2h)",
    )
    session.add_argument("--seats", type=int, help="seats to reserve, each of --kernel-fraction")
    session.add_argument(
        "--kernel-fraction",
        type=fraction_arg,
        metavar="F",
        help="a seat's GPU fraction (default: the course's max_lease_fraction)",
    )
    session.add_argument("--share", type=fraction_arg, metavar="F", help="a fraction of the pool")
    session.add_argument("--json", action="store_true", help="print the API's JSON (list)")
    session.set_defaults(func=cmd_session)

    usage = sub.add_parser("usage", parents=[remote], help="fraction-hours used")
    usage.add_argument(
        "--since",
        metavar="WHEN",
        help="ISO date/time (2024-09-01, UTC unless a zone is given), POSIX seconds, "
        "or a duration back from now such as 7d or 24h (default: 7d)",
    )
    usage.add_argument("--by", choices=("user", "group"), default="user")
    usage.add_argument("--csv", action="store_true", help="print CSV")
    usage.set_defaults(func=cmd_usage)
    return parser


def main(argv: Sequence[str] | None = None, *, run_broker: BrokerMain | None = None) -> int:
    """Entry point of the ``gpu-lease`` console script; returns the exit status.

    ``run_broker`` runs ``gpu-lease broker …`` instead of ``broker.app.main`` (tests
    pass a stand-in to see the arguments the broker gets).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(args_list)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "broker":
            return cmd_broker(rest, run_broker)
        if args.command == "agent":
            return cmd_agent(rest)
        if rest:
            try:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            except SystemExit as exc:
                return exc.code if isinstance(exc.code, int) else 2
        func: Callable[[argparse.Namespace], int] = args.func
        status = func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except GPULeaseError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of our output went away (``gpu-lease usage | head``): stop quietly.

    Python's own advice: point stdout at /dev/null so that the flush at exit does not
    raise again, and exit with status 1 (as with ``head``, the output was cut short).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (e.g. captured by a test)
        pass
    return 1
