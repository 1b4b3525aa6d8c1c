"""The import graph of our packages (docs/architecture.md): no circles, nothing imported from a
higher layer (cost_models <- planner <- runtime <- benchmarks), and the runtime takes from the
planner only the plan vocabulary, the tracer, the models, `planner.orphans` (the
parent-death signal both use) and `planner.native_output` (a file descriptor silenced around a
native call), two modules importing nothing of ours. Every import counts, those
inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("cost_models", "planner", "runtime", "benchmarks")
RUNTIME_MAY_USE = (
    "planner.vocab",
    "planner.tracing",
    "planner.models",
    "planner.orphans",
    "planner.native_output",
)


def _modules() -> dict[str, Path]:
    out = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def _graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = _ours(name, modules)
                if target and target != mod:
                    g.add_edge(mod, target)
    return g


def _layer(mod: str) -> int:
    return LAYERS.index(mod.split(".")[0])


def test_no_import_circles() -> None:
    circles = [
        sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1
    ]
    assert circles == []


def test_imports_go_down_the_layers() -> None:
    up = [(a, b) for a, b in _graph().edges if _layer(a) < _layer(b)]
    assert up == []


def test_the_runtime_reads_only_the_plan_vocabulary_tracer_and_models() -> None:
    g = _graph()
    used = sorted(
        (a, b)
        for a, b in g.edges
        if a.startswith("runtime") and b.startswith("planner")
    )
    assert used, "the runtime reads plans"
    assert [(a, b) for a, b in used if not b.startswith(RUNTIME_MAY_USE)] == []


def test_the_checks_see_an_import_inside_a_function() -> None:
    """The graph counts imports inside functions (`runtime.commands.run` imports the tracer
    only inside a function)."""
    assert ("runtime.commands.run", "planner.tracing.tracer") in _graph().edges
