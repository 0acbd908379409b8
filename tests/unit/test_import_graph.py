"""The package's import graph: arrows run down, no import cycles (issue 26).

Layers, top to bottom: server → frontend → core → runner → models → layers → kernels (``quant``, the offline
quantizer, sits between the runner and the models: it drives the model itself and needs nothing above it). Every ``import`` in ``onecard/`` counts, at module level or
inside a function or an ``if TYPE_CHECKING:`` block alike: a lazy import hides an arrow from the interpreter, not
from the design. The graph is read with ``ast`` (nothing is imported), so the test is cheap and deterministic.

The arrows and cycles that were there when this test was written and belong to other items of issue 26 are
listed below with their owner; the test fails on any arrow or cycle that is not listed (a listed cycle may
shrink or vanish, not grow).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["server", "frontend", "core", "runner", "models", "layers", "kernels"]
BETWEEN = {"quant": 3.5}             # side packages: a rank between two layers' indices

# Up-arrows known and tolerated: (importer prefix, imported module). None since the step contract moved to the
# runner (runner/step_io.py) and the vocabulary both processes read to onecard/vocab.py.
KNOWN_UP: set[tuple[str, str]] = set()
# Cycles known and tolerated (each found cycle must lie inside one of these).
KNOWN_CYCLES: list[set[str]] = []


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in (root / "onecard").rglob("*.py"):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the onecard modules it imports (anywhere in its body)."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` is an arrow to pkg.sub when that is a module, else to pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("onecard") else None
                if target and target != mod:
                    edges[mod].add(target)
    return edges


def layer_index(mod: str) -> float | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None
    if parts[1] in BETWEEN:
        return BETWEEN[parts[1]]
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def up_arrows(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    out = set()
    for a, targets in edges.items():
        for b in targets:
            la, lb = layer_index(a), layer_index(b)
            if la is not None and lb is not None and lb < la:
                out.add((a, b))
    return out


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    nodes = set(edges) | {b for t in edges.values() for b in t}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def test_graph_reader_sees_real_arrows():
    # the reader must see module-level, lazy and `from pkg import module` arrows, or the checks below are vacuous
    edges = import_graph(modules())
    assert "onecard.kernels.attention.metadata" in edges["onecard.models.qwen3"]
    assert "onecard.runner.model_runner" in edges["onecard.core.engine_core"]     # imported inside a function
    assert "onecard.kernels.dispatch" in edges["onecard.quant.calibrate"]         # from onecard.kernels import dispatch
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert up_arrows({"onecard.kernels.x": {"onecard.runner.y"}}) == {("onecard.kernels.x", "onecard.runner.y")}


def test_kernels_layers_models_quant_never_import_upward():
    bad = sorted((a, b) for a, b in up_arrows(import_graph(modules()))
                 if a.split(".")[1] in ("kernels", "layers", "models", "quant"))
    assert not bad, f"arrows that run up from kernels/layers/models/quant: {bad}"


def test_no_new_upward_arrows():
    bad = sorted((a, b) for a, b in up_arrows(import_graph(modules()))
                 if not any(a.startswith(pre) and b == target for pre, target in KNOWN_UP))
    assert not bad, f"arrows that run up (server → frontend → core → runner → models → layers → kernels): {bad}"


def test_no_new_import_cycles():
    bad = [sorted(c) for c in cycles(import_graph(modules())) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not bad, f"import cycles: {bad}"
