"""Where modules live: the runtime package never imports the developer tools, each
deployable (the broker, the node side, the kernel side, the lab side) imports only the
shared base and itself, and no module imports itself round a circle. And the repository
stands alone: nothing in it points a reader at a tracker or a document they do not have.

``provisioner/devtools/`` (demo, test harness, simulator) may import the runtime; no
module elsewhere under ``provisioner/`` may import ``devtools`` (docs/developers.md).
Which side may import which is the table ``MAY_IMPORT``. Imports inside functions count:
a lazy import hides a circle, it does not break it.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "provisioner"
RUNTIME = sorted(p for p in PACKAGE.rglob("*.py") if "devtools" not in p.relative_to(PACKAGE).parts)


def imported_modules(path: Path) -> list[str]:
    """Every module name an ``import`` or ``from … import`` in ``path`` names (dots kept)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def test_the_runtime_is_found() -> None:
    assert PACKAGE / "broker" / "app.py" in RUNTIME
    assert not any("devtools" in p.parts for p in RUNTIME)


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_runtime_never_imports_devtools(path: Path) -> None:
    bad = [n for n in imported_modules(path) if "devtools" in n.split(".")]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}: the runtime must not need a tool"


# -- the deployables: each imports only the shared base and itself ----------------------
#: the side of each module at the package's top; a module in one of ``FOLDERS`` belongs to
#: its folder's side. A new module at the top must be added here (the base stays thin).
TOP_LEVEL = {
    "__init__": "base",
    "_version": "base",
    "errors": "base",
    "model": "base",
    "wire": "base",
    "json_checks": "base",
    "node_report": "base",
    "inventory": "base",
    "listeners": "base",
    "__main__": "cli",
    "cli": "cli",
    "tables": "cli",
}
FOLDERS = {
    # the broker client: shared by every side that calls the broker
    "client": "base",
    "broker": "broker",
    "node": "node",
    "kernel": "kernel",
    "lab": "lab",
    "devtools": "tools",
}
SIDES = ("base", "broker", "node", "kernel", "lab", "cli", "tools")
#: which sides each side may import; what is left out is a wrong arrow
MAY_IMPORT = {
    "base": {"base"},
    "broker": {"base", "broker"},
    "kernel": {"base", "kernel"},
    # doctor runs its probe as a kernel is run (kernel/env.py, kernel/lease.py) and checks
    # the kernelspecs' context overhead: a GPU node runs kernels
    "node": {"base", "node", "kernel"},
    # the server extension reads the board its server's provisioners write (kernel/status.py)
    "lab": {"base", "lab", "kernel"},
    # the command line starts each deployable (gpu-lease broker | agent | doctor | kernelspec)
    "cli": {"base", "cli", "broker", "node", "kernel", "lab"},
    "tools": set(SIDES),
}
#: (module, imported module): single arrows across sides besides MAY_IMPORT, each for a
#: reason: the provisioner starts each kernel in a cgroup of its own on its node (through
#: kernel/cgroup_keeper.py) and names its kernel's pid namespace (node/cgroups.py,
#: node/pidns.py, where those exist)
ACROSS = {
    ("kernel/cgroup_keeper.py", "node.cgroups"),
    ("kernel/provisioner.py", "node.pidns"),
}
#: (module, imported module) arrows across sides still allowed: none
NOT_YET: set[tuple[str, str]] = set()
ALL_MODULES = sorted(PACKAGE.rglob("*.py"))


def dotted(path: Path) -> str:
    """``provisioner/kernel/env.py`` -> ``provisioner.kernel.env`` (a package: its folder)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULE_NAMES = {dotted(p) for p in ALL_MODULES}


def side(module: str) -> str:
    """The side of ``provisioner.X[.Y…]``."""
    parts = module.split(".")[1:]
    if not parts:
        return TOP_LEVEL["__init__"]
    if parts[0] in FOLDERS:
        return FOLDERS[parts[0]]
    return TOP_LEVEL[parts[0]]


def imports_of(path: Path) -> set[str]:
    """The modules of this package that ``path`` imports, at its top or inside a function."""
    package = dotted(path) if path.name == "__init__.py" else dotted(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "provisioner"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "provisioner":
                continue
            for alias in node.names:  # ``from . import x``: the module x if there is one
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in MODULE_NAMES else module)
    return found


# -- the broker's layers: each subpackage imports only the layers below it ---------------
#: the broker's subpackages; a module directly in provisioner/broker/ is the ``top`` layer,
#: which puts the layers together (app, options, startup)
BROKER_LAYERS = ("rules", "store", "services", "web", "fronts")
#: which broker layers each layer may import (besides the shared base)
LAYER_MAY_IMPORT = {
    # pure: no I/O, the clock passed in
    "rules": {"rules"},
    # SQL only: knows no rule, no service, no HTTP
    "store": {"store"},
    "services": {"services", "rules", "store"},
    # HTTP never touches the database but through a service
    "web": {"web", "services", "rules"},
    "fronts": {"fronts", "web", "services", "rules"},
    "top": {"top", *BROKER_LAYERS},
}
#: the shared base the pure rules may use: the data model, the wire format (with the node
#: agents' report) and the errors
RULES_BASE = {
    "provisioner",
    "provisioner._version",
    "provisioner.errors",
    "provisioner.model",
    "provisioner.node_report",
    "provisioner.wire",
}
BROKER_MODULES = sorted((PACKAGE / "broker").rglob("*.py"))


def broker_layer(module: str) -> str:
    """``provisioner.broker.web.handlers`` -> ``web``; ``provisioner.broker.app`` -> ``top``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in BROKER_LAYERS else "top"


def test_every_broker_module_is_in_a_layer() -> None:
    for layer in BROKER_LAYERS:
        assert (PACKAGE / "broker" / layer / "__init__.py").exists(), layer
    top = {p.stem for p in (PACKAGE / "broker").glob("*.py")}
    # a new module goes into a layer; the top puts them together and reads the site's
    # configuration (the options, the courses file)
    assert top == {"__init__", "app", "courses", "options", "startup", *BROKER_ALIASES}, top


#: old module paths that sites' configurations name (``authenticator_class``,
#: ``kernel_spec_manager_class``), kept as aliases of the moved module
ALIASES = {
    "provisioner.broker.auth": "provisioner.broker.web.auth",
    "provisioner.kernel.specs": "provisioner.kernel.offered",
}
BROKER_ALIASES = {
    old.rpartition(".")[2] for old in ALIASES if old.startswith("provisioner.broker.")
}


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_the_aliases_are_only_aliases(old: str) -> None:
    import importlib

    new = ALIASES[old]
    alias, real = importlib.import_module(old), importlib.import_module(new)
    names = set(real.__all__)
    assert names and all(getattr(alias, n) is getattr(real, n) for n in names)
    assert imports_of(PACKAGE.parent / (old.replace(".", "/") + ".py")) == {new}


@pytest.mark.parametrize("path", BROKER_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_broker_layer_imports_only_the_layers_below(path: Path) -> None:
    module = dotted(path)
    layer = broker_layer(module)
    wrong = sorted(
        m
        for m in imports_of(path)
        if m.startswith("provisioner.broker.") and broker_layer(m) not in LAYER_MAY_IMPORT[layer]
    )
    assert not wrong, f"{module} ({layer}) imports {wrong}: LAYER_MAY_IMPORT[{layer!r}]"


@pytest.mark.parametrize(
    "path",
    sorted((PACKAGE / "broker" / "rules").glob("*.py")),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_rules_use_only_the_standard_library_and_the_shared_base(path: Path) -> None:
    outside = sorted(
        m
        for m in imported_modules(path)
        if not m.startswith(".")
        and m.split(".")[0] not in sys.stdlib_module_names
        and m.split(".")[0] != "__future__"
        and not (
            m.split(".")[0] == "provisioner"
            and (m in RULES_BASE or m.startswith("provisioner.broker.rules"))
        )
    )
    base = sorted(
        m
        for m in imports_of(path)
        if not m.startswith("provisioner.broker.rules") and m not in RULES_BASE
    )
    assert not outside and not base, f"{path.name} imports {outside + base}: the rules are pure"


def test_the_layer_check_sees_a_wrong_arrow(tmp_path: Path) -> None:
    """The layer rule is read from real imports: a web module that imports the store fails."""
    assert broker_layer("provisioner.broker.web.handlers") == "web"
    assert broker_layer("provisioner.broker.app") == "top"
    assert "store" not in LAYER_MAY_IMPORT["web"]
    imported = imports_of(PACKAGE / "broker" / "services" / "service_core.py")
    assert any(broker_layer(m) == "store" for m in imported)
    assert any(broker_layer(m) == "rules" for m in imported)


def test_every_module_at_the_top_has_a_side() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top <= set(TOP_LEVEL), f"classify {sorted(top - set(TOP_LEVEL))} in TOP_LEVEL"
    assert set(TOP_LEVEL.values()) | set(FOLDERS.values()) <= set(SIDES)
    assert all(side(m) in SIDES for m in MODULE_NAMES)


def test_imports_of_sees_relative_and_late_imports() -> None:
    """The check below is only as good as this: both kinds of import are seen."""
    assert "provisioner.kernel.status" in imports_of(PACKAGE / "lab" / "board.py")
    assert "provisioner.broker.app" in imports_of(PACKAGE / "cli.py")  # inside a function
    assert "provisioner.errors" in imports_of(PACKAGE / "broker" / "web" / "handlers.py")


@pytest.mark.parametrize("path", ALL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_side_imports_only_the_base_and_itself(path: Path) -> None:
    own = side(dotted(path))
    name = str(path.relative_to(PACKAGE))
    wrong = sorted(
        f"{m} ({side(m)})"
        for m in imports_of(path)
        if side(m) not in MAY_IMPORT[own]
        and (name, m.removeprefix("provisioner.")) not in ACROSS
        and (name, m.rpartition(".")[2]) not in NOT_YET
    )
    assert not wrong, f"{name} ({own}) imports {wrong}: see MAY_IMPORT and docs/developers.md"


def _module_name(path: Path) -> str:
    """``provisioner/broker/web/handlers.py`` -> ``provisioner.broker.web.handlers``."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def our_imports(module: str) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its text: at its top, inside
    functions (a lazy import hides a cycle, it does not break it), under TYPE_CHECKING.

    ``from . import x`` and ``from .a import b`` count ``x`` and ``a.b`` when those are
    modules, else the module ``a``.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base)
                base_name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                base_name = node.module or ""
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                targets.append(sub if sub in MODULES else base_name)
        for target in targets:
            while target and target not in MODULES:  # provisioner.x.y where y is a name
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_import_graph_is_read() -> None:
    # the edges this test relies on, a function-level import among them
    assert "provisioner.broker.web.openapi" in our_imports("provisioner.broker.web.routes")
    assert "provisioner.wire" in our_imports("provisioner.model")
    assert "provisioner.errors" in our_imports("provisioner.wire")
    assert "provisioner.node.doctor" in our_imports("provisioner.cli")  # inside a function


def test_the_cycle_finder_finds_a_hidden_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    """No module of ``provisioner`` reaches itself through imports (function-level ones
    included): the floors of docs/developers.md stay a ladder, not a circle."""
    graph = {m: our_imports(m) for m in MODULES}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles among provisioner modules: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


#: the house's most lines for one class: a class that grows past it does two jobs
MOST_CLASS_LINES = 400


def long_classes(path: Path, most: int = MOST_CLASS_LINES) -> list[str]:
    """``Name (N lines)`` for each class in ``path`` longer than ``most`` lines."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{node.name} ({lines} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (lines := (node.end_lineno or node.lineno) - node.lineno + 1) > most
    ]


def test_the_class_length_check_counts_lines(tmp_path: Path) -> None:
    body = "\n".join(f"    x{n} = {n}" for n in range(5))
    source = tmp_path / "m.py"
    source.write_text(f"class Small:\n    pass\n\n\nclass Big:\n{body}\n")
    assert long_classes(source, most=5) == ["Big (6 lines)"]
    assert long_classes(source, most=6) == []


def test_no_class_over_the_house_limit() -> None:
    """No class of the package is over :data:`MOST_CLASS_LINES` lines (docs/developers.md):
    split it by job (as parking's ``ParkWatch``, ``ResumeService`` and ``ParkPolicy`` were)."""
    found = {
        str(p.relative_to(PACKAGE)): long
        for p in sorted(PACKAGE.rglob("*.py"))
        if (long := long_classes(p))
    }
    assert not found, f"classes over {MOST_CLASS_LINES} lines: {found}"


# -- the kernel side reads the typed lease, never the broker's JSON -------------------
KERNEL_SIDE = sorted((PACKAGE / "kernel").rglob("*.py"))


def raw_reads(path: Path) -> list[str]:
    """``line: text`` of each ``X.raw`` in ``path`` (an attribute named ``raw``, read or
    written): the broker's lease object as it came, which the kernel side must not read."""
    source = path.read_text()
    lines = source.splitlines()
    return [
        f"{node.lineno}: {lines[node.lineno - 1].strip()}"
        for node in ast.walk(ast.parse(source, str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "raw"
    ]


def test_the_raw_check_finds_a_raw_read(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f(lease):\n    x = lease.raw.get('mps')\n    return lease.rawish\n")
    assert raw_reads(source) == ["2: x = lease.raw.get('mps')"]


def test_the_kernel_side_never_reads_raw() -> None:
    """``provisioner/kernel/`` reads the client's typed lease (``GrantedLease``'s fields);
    a field it needs is added there (docs/developers.md, "Adding a lease field"), and a
    dict it writes comes from ``GrantedLease.to_json``."""
    assert KERNEL_SIDE, "no kernel-side module found"
    found = {str(p.relative_to(PACKAGE)): reads for p in KERNEL_SIDE if (reads := raw_reads(p))}
    assert not found, f"the kernel side reads .raw: {found}"


# -- the repository stands alone -----------------------------------------------------------
REPO = PACKAGE.parent
#: what a reader of a clone reads (CHANGELOG.md keeps its history as it was written)
STANDALONE = (
    "provisioner",
    "tests",
    "docs",
    "benchmarks",
    "examples",
    "hub_config",
    "deploy",
    "src",
    "test",
    "README.md",
)
#: folders that are built, installed or cached, not written
NOT_WRITTEN = {"node_modules", "__pycache__", "labextension"}
#: references that mean nothing to someone who clones the project: the contract document
#: that lived outside the repository (docs/design.md took its place) and our own issue
#: numbers (the word and a number, or "#" and a number); an upstream project's issue,
#: "owner/name#" and its number, may stay
OUR_REFERENCES = (
    re.compile(r"\bDESIG[N]\b"),
    re.compile(r"\b[Ii]ssues?\s+#?\d+"),
    re.compile(r"(?<![\w/&.-])#\d{1,5}\b"),
)


def our_references(text: str, *, css: bool = False) -> list[str]:
    """``line: reference`` for each reference in ``text`` that only our tracker could explain.

    ``css``: a style sheet, where ``#`` and digits are a colour, not an issue.
    """
    patterns = OUR_REFERENCES[:2] if css else OUR_REFERENCES
    return [
        f"{number}: {match.group(0)}"
        for number, line in enumerate(text.splitlines(), 1)
        for pattern in patterns
        for match in pattern.finditer(line)
    ]


def written_files() -> list[Path]:
    """Every file of :data:`STANDALONE` that people write (no build output, no cache)."""
    found: list[Path] = []
    for name in STANDALONE:
        top = REPO / name
        if top.is_file():
            found.append(top)
            continue
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in NOT_WRITTEN and not d.startswith(".")]
            found += [Path(folder, f) for f in files if not f.startswith(".")]
    return sorted(found)


def test_the_reference_check_tells_ours_from_upstreams() -> None:
    # the samples are put together here, so that this file holds none of them
    n, design = "28", "DESIG" + "N"
    assert our_references(f"Parking (issue {n}) changes idle reclaim.") == [f"1: issue {n}"]
    assert our_references(f"ok\nsee Issue #{n}, item 2") == [f"2: Issue #{n}", f"2: #{n}"]
    assert our_references(f"as {design}.md says, and {design}'s table") == [f"1: {design}"] * 2
    assert our_references(f"fixed (#{n})") == [f"1: #{n}"]
    assert our_references(f"issues {n} and 13") == [f"1: issues {n}"]
    assert our_references(f"its proxy on one (jupyterhub#{n}), jupyterhub/jupyterhub#{n}") == []
    assert our_references(f"pip's issue tracker; a design; # {n} comment; &#{n};") == []
    assert our_references(f"color: #{n}{n};", css=True) == []
    assert our_references(f"color: #{n}{n};") == [f"1: #{n}{n}"]


def test_the_repository_stands_alone() -> None:
    """No file a reader of a clone reads cites our issue numbers or the contract document
    that lived outside the repository: say what is meant ("parking", "kernel proofs"), and
    find the contract in docs/design.md."""
    files = written_files()
    assert REPO / "docs" / "design.md" in files and REPO / "provisioner" / "wire.py" in files
    found: dict[str, list[str]] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binaries
            continue
        if hits := our_references(text, css=path.suffix == ".css"):
            found[str(path.relative_to(REPO))] = hits
    assert not found, f"references only our tracker could explain: {found}"


# -- the front processes' channel carries exactly what the HTTP layer calls -------------
def service_calls(paths: list[Path]) -> set[tuple[str, str]]:
    """Every ``….service.PART.METHOD(…)`` the modules ``paths`` make (PART: a service)."""
    calls = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Attribute)
                and node.value.value.attr == "service"
            ):
                calls.add((node.value.attr, node.attr))
    return calls


def test_the_fronts_may_call_exactly_what_the_handlers_call() -> None:
    """``--http-processes`` serves HTTP in front processes that call the broker's services
    over a socket; only ``service_channel.METHODS`` may be called there. A handler that
    calls a method missing from it would answer 500 behind a front only: adding an
    endpoint adds its service method there (docs/developers.md, "Add an endpoint")."""
    from provisioner.broker.fronts.service_channel import METHODS

    called = service_calls(sorted((PACKAGE / "broker" / "web").glob("*.py")))
    allowed = {(part, method) for part, methods in METHODS.items() for method in methods}
    assert called, "no service call found: the check reads nothing"
    assert called - allowed == set(), "add these to service_channel.METHODS"
    assert allowed - called == set(), "no handler calls these: remove them from METHODS"
