"""Imports go one way: dapo_kernels (bottom) <- npu_ops <- dapo_trainer, with no cycle.

The static imports of every module of the three packages (module level and inside functions,
relative ones resolved) form a graph, so without a cycle no import needs to sit inside a function to
dodge one; the test fails on

* an upward edge (dapo_kernels -> npu_ops or dapo_trainer, npu_ops -> dapo_trainer);
* npu_ops importing anything of dapo_kernels but ``dapo_kernels.backend_api`` (the backend contract);
* dapo_trainer importing a private module of dapo_kernels (a path segment starting with ``_``);
* ``dapo_trainer.model`` importing anything of ``dapo_trainer.parallel`` (the model is plain;
  parallelism is applied to a built model), and ``parallel.collectives`` importing the trainer;
* any import cycle between modules, or between packages: every module counted as its package at
  each depth (``dapo_trainer.tools.profiler`` as ``dapo_trainer.tools``), no package imports one that
  imports it back;
* ``dapo_trainer.tools`` imported by anything but ``tools/`` itself and the demos (entry points above
  the trainer): the diagnostics import the trainer, never the reverse.

It also checks the runtime side in a fresh interpreter: ``import dapo_kernels`` loads nothing of
npu_ops or dapo_trainer.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dapo_kernels", "npu_ops", "dapo_trainer")
LAYER = {name: i for i, name in enumerate(PACKAGES)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    """{module name: (path, is_package)} of every .py file in the three packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = (path, path.name == "__init__.py")
    return out


def _resolve(base: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = base.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _extensions() -> set:
    """Compiled modules (``dapo_kernels._C``): ``from . import _C`` imports them, not the package.
    Read from setup.py's declarations, so a clone without the built ``.so`` sees them too."""
    return set(re.findall(r'Extension\(\s*"([\w.]+)"', (ROOT / "setup.py").read_text()))


def _graph(modules: dict) -> dict:
    """{module: {imported project module}}; ``from pkg import name`` counts as importing ``pkg.name``
    when that is a module (or a compiled extension), else ``pkg``."""
    submodules = set(modules) | _extensions()
    edges = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    targets.add(sub if sub in submodules else mod)
        edges[name] = {t for t in targets if t in modules and t != name}
    return edges


def _cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_known_edges():
    """The graph is not vacuous: edges that must exist are found."""
    edges = _graph(_modules())
    assert "dapo_kernels.backend_api" in edges["npu_ops"]
    assert "dapo_trainer.offload" in edges["dapo_trainer.model"]
    assert "dapo_trainer.model" in edges["dapo_trainer.parallel.tensor"]
    assert "dapo_kernels.ops._row_stats" in edges["dapo_kernels.ops.linear_log_probs"]
    assert "dapo_trainer.memory_model" in edges["dapo_trainer.tools.tune"]
    assert "dapo_trainer.trainer" in edges["dapo_trainer.tools.profiler"]
    assert "dapo_trainer.rollout_dump" in edges["dapo_trainer.generation"]
    assert "dapo_trainer.rewards.verifiers" in edges["dapo_trainer.rewards"]
    assert len(edges) > 50


def test_no_upward_import():
    edges = _graph(_modules())
    bad = [(a, b) for a, targets in edges.items() for b in targets
           if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert not bad, f"upward imports (dapo_kernels <- npu_ops <- dapo_trainer): {sorted(bad)}"


def test_npu_ops_uses_only_the_backend_api():
    edges = _graph(_modules())
    bad = [(a, b) for a, targets in edges.items() if a.startswith("npu_ops") for b in targets
           if b.startswith("dapo_kernels") and b != "dapo_kernels.backend_api"]
    assert not bad, f"npu_ops may import only dapo_kernels.backend_api: {sorted(bad)}"


def test_trainer_uses_no_private_module_of_dapo_kernels():
    edges = _graph(_modules())
    bad = [(a, b) for a, targets in edges.items() if a.startswith("dapo_trainer") for b in targets
           if b.startswith("dapo_kernels") and any(p.startswith("_") for p in b.split("."))]
    assert not bad, f"dapo_trainer imports private dapo_kernels modules: {sorted(bad)}"


def test_model_imports_nothing_of_parallel():
    """The model is plain: no import of dapo_trainer.parallel, directly or through another trainer module."""
    edges = _graph(_modules())
    seen, todo = set(), ["dapo_trainer.model"]
    while todo:
        for b in edges.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    bad = sorted(b for b in seen if b.startswith("dapo_trainer.parallel"))
    coll = edges["dapo_trainer.parallel.collectives"]
    assert not bad, f"the model imports parallel/: {bad}"
    assert not {b for b in coll if b.startswith("dapo_trainer")}, f"collectives must be a leaf: {coll}"


def test_no_import_cycle():
    cycles = _cycles(_graph(_modules()))
    assert not cycles, f"import cycles: {cycles}"


def _collapse(edges: dict, depth: int) -> dict:
    """``edges`` with every module named by its first ``depth`` dotted parts (its package at that depth)."""
    out = {}
    for a, targets in edges.items():
        ua = ".".join(a.split(".")[:depth])
        out.setdefault(ua, set()).update(".".join(b.split(".")[:depth]) for b in targets)
        out[ua].discard(ua)
    return out


# Package cycles still to remove, each with the issue that removes it; an entry whose cycle is gone fails.
KNOWN_PACKAGE_CYCLES: list = []


def test_no_package_import_cycle():
    """At every package depth the collapsed graph has no cycle but the listed ones, and each listed one still exists."""
    edges = _graph(_modules())
    found = [c for depth in range(2, max(m.count(".") for m in edges) + 1) for c in _cycles(_collapse(edges, depth))]
    assert [c for c in found if c not in KNOWN_PACKAGE_CYCLES] == [], f"package import cycles: {found}"
    gone = [c for c in KNOWN_PACKAGE_CYCLES if c not in found]
    assert not gone, f"delete these from KNOWN_PACKAGE_CYCLES, their cycle is gone: {gone}"


def test_tools_sit_above_the_trainer():
    """Only tools/ and the demos (entry points above the trainer) import dapo_trainer.tools."""
    edges = _graph(_modules())
    above = ("dapo_trainer.tools", "dapo_trainer.demo")
    bad = sorted((a, b) for a, targets in edges.items() for b in targets
                 if b.startswith("dapo_trainer.tools") and not a.startswith(above))
    assert not bad, f"tools/ imported from below it: {bad}"


def test_package_collapse_finds_a_package_cycle():
    """Modules that import no module back still make a cycle when their packages do."""
    edges = {"p.a.x": {"p.b.y"}, "p.b.z": {"p.a.w"}, "p.a.w": set(), "p.b.y": set()}
    assert _cycles(edges) == []
    assert _cycles(_collapse(edges, 2)) == [["p.a", "p.b"]]


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _loaded_after_import(module: str, prefixes: tuple) -> list:
    """The modules starting with ``prefixes`` that ``import module`` loads in a fresh interpreter."""
    code = (f"import json, sys, {module}\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_dapo_kernels_loads_no_upper_layer():
    assert _loaded_after_import("dapo_kernels", ("npu_ops", "dapo_trainer", "torch_npu")) == []


def test_import_model_loads_no_parallel():
    """Importing the model loads nothing of dapo_trainer.parallel (the package itself imports eagerly)."""
    assert _loaded_after_import("dapo_trainer.model", ("dapo_trainer.parallel",)) == []
