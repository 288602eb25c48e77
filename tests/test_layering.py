"""The package's layers (docs/architecture.md, ARCHITECTURE.md's table): every
``sao.*`` import, at module level or inside a function, goes from a folder to
one that :data:`ALLOWED` lists for it, and no modules import each other in a
circle. Parsed with :mod:`ast`, so nothing is imported."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SAO = Path(__file__).resolve().parents[1] / "sao"

ALLOWED: dict[str, dict[str, str]] = {
    # layer: {layer it may import: why, "" where ARCHITECTURE.md's table has the edge}
    "cli": {
        "app": "",
        "experiments": "",
        "distributed": "",
        "runtime": "",
        "rundir": "",
        "train": "",
        "rollout": "",
        "rollout.remote": "",
        "envs": "",
        "models": "",
        "config": "",
    },
    "experiments": {
        "app": "the warm starts' cache paths, built once before the arms' subprocesses",
        "runtime": "--jobs N: the runs' memory protocol and their processes' resident memory",
        "rundir": "",
        "envs": "style_shift's default schedule names the report's phases",
        "config": "",
        "sao": "the package's __version__ and place, for the report's code versions",
    },
    "app": {
        "distributed": "",
        "runtime": "",
        "agents": "",
        "rundir": "",
        "train": "",
        "rollout": "",
        "rollout.embedded": "",
        "rollout.remote": "",
        "envs": "",
        "envs.sandbox": "",
        "models": "",
        "config": "",
        "types": "",
    },
    "distributed": {
        "runtime": "",
        "train": "",
        "rollout": "",
        "rollout.remote": "",
        "envs": "the rollout workers' tasks",
        "config": "",
        "types": "",
    },
    "runtime": {
        "rundir": "",
        "train": "",
        "rollout": "",
        "rollout.remote": "the loop stops when the router has no live engine (NoLiveEngineError)",
        "envs": "",
        "models": "the local trainer's export is written atomically (models.cache)",
        "types": "",
    },
    "agents": {
        "rollout": "your agent's endpoint speaks to an Engine; its calls resume like episodes",
        "rollout.remote": "the endpoint listens on a free port, as the launcher's servers do",
        "envs": "an agent task has the envs' splits",
        "types": "",
    },
    "rundir": {
        "models": "",
        "config": "checkpoints save and reload the run's config; the card prints it",
        "types": "",
    },
    "train": {"algo": "", "models": "", "types": ""},
    "rollout.remote": {
        "rollout": "",
        "rollout.embedded": "",
        "models": "",
        "types": "",
        "sao": "the launcher finds the package's directory",
    },
    "rollout.embedded": {"rollout": "", "types": ""},
    "rollout": {"models": "", "types": ""},
    "envs": {"envs.sandbox": "", "types": ""},
    "envs.sandbox": {},
    "models": {"algo": "the shared tensor checks (algo._checks)", "types": ""},
    "config": {"algo": ""},
    "algo": {},
    "types": {},
    "sao": {},
}
"""Layer -> the layers its modules may import (a layer's own modules always may).
A layer is a folder (or file) under ``sao/``; a sub-folder named here is a
layer of its own (``rollout.remote``), others belong to their parent."""


@dataclass(frozen=True)
class Edge:
    """One ``sao.*`` import: ``source`` (a module) imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    module_level: bool
    file: str
    """The source's file, relative to the repository (``sao/rundir/ledger.py``)."""


def module_name(path: Path) -> str:
    """``sao/rollout/remote/router.py`` -> ``sao.rollout.remote.router``."""
    parts = list(path.relative_to(SAO.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """The longest :data:`ALLOWED` key that ``module`` lies in (``sao``: the root)."""
    rest = module.removeprefix("sao").removeprefix(".")
    found = [k for k in ALLOWED if rest == k or rest.startswith(k + ".")]
    return max(found, key=len) if found else ("sao" if not rest else rest.split(".")[0])


def imports(path: Path, modules: set[str], source: str | None = None) -> list[Edge]:
    """The ``sao.*`` imports of one file (read as module ``source``, default its
    own name), each resolved to the module it loads (``from sao.x import name``
    is ``sao.x.name`` when that is a module)."""
    source = source or module_name(path)
    file = str(Path(*source.split(".")).with_suffix(".py"))
    if path.name == "__init__.py":
        file = str(Path(*source.split(".")) / "__init__.py")
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nested = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != source:
                out.append(Edge(source, name, node.lineno, id(node) not in nested, file))
    return out


def all_edges() -> list[Edge]:
    files = sorted(SAO.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return [e for p in files for e in imports(p, modules)]


def bad_edges(edges: list[Edge]) -> list[str]:
    """``file:line: a -> b (layer x -> layer y)`` for each import outside :data:`ALLOWED`."""
    bad = []
    for e in edges:
        src, dst = layer(e.source), layer(e.target)
        if src != dst and dst not in ALLOWED.get(src, {}):
            bad.append(f"{e.file}:{e.line}: {e.source} -> {e.target} ({src} -> {dst})")
    return bad


def find_cycle(edges: list[Edge]) -> list[str] | None:
    """A circle of module-level imports (those under ``if TYPE_CHECKING:`` too;
    not those inside functions), ``a -> b -> ... -> a``, or None; found by
    depth-first search."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        if e.module_level:
            graph.setdefault(e.source, []).append(e.target)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(set(graph.get(m, []))):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_every_folder_is_a_layer() -> None:
    unknown = sorted({layer(module_name(p)) for p in SAO.rglob("*.py")} - set(ALLOWED))
    assert not unknown, f"add these folders to ALLOWED (and docs/architecture.md): {unknown}"


def test_imports_go_down_the_layers() -> None:
    bad = bad_edges(all_edges())
    assert not bad, "imports outside the layers table (ALLOWED):\n" + "\n".join(bad)


def test_no_import_circles() -> None:
    cycle = find_cycle(all_edges())
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle or [])


def test_an_upward_import_and_a_circle_are_caught(tmp_path: Path) -> None:
    """The checks fail where they should: rundir importing runtime (inside a
    function too), and two modules importing each other at module level."""
    modules = {"sao.rundir.ledger", "sao.rundir.metrics", "sao.runtime.orchestrator"}
    ledger, metrics = tmp_path / "ledger.py", tmp_path / "metrics.py"
    ledger.write_text(
        "from sao.rundir import metrics\n"
        "def f():\n"
        "    from sao.runtime.orchestrator import StepFn\n"
    )
    metrics.write_text("from .ledger import Ledger\n")
    edges = imports(ledger, modules, "sao.rundir.ledger")
    assert bad_edges(edges) == [
        "sao/rundir/ledger.py:3: sao.rundir.ledger -> sao.runtime.orchestrator (rundir -> runtime)"
    ]
    assert find_cycle(edges) is None  # a function-level import is no circle
    edges += imports(metrics, modules, "sao.rundir.metrics")
    assert find_cycle(edges) == ["sao.rundir.ledger", "sao.rundir.metrics", "sao.rundir.ledger"]


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in SAO.glob("*/__init__.py")))
def test_every_folder_says_what_it_holds(folder: str) -> None:
    doc = ast.get_docstring(ast.parse((SAO / folder / "__init__.py").read_text()))
    assert doc and "import" in doc, f"sao/{folder}/__init__.py: say what it holds and imports"
