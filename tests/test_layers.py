"""The packages form a dependency graph, and no module imports a package its own may not reach (not
even lazily, inside a function). Each package names the packages it builds on; what they build on is
reachable too:

    specrt (errors, paths)
    ├── kinds, plugins                      the registry, the kernels
    schema → kinds                          manifest, configs
    engines → schema, plugins               backends
    runtime → engines, kinds                the hot path
    export → runtime     serving → runtime     deploy → runtime     (siblings: none imports another)
    tools → export, serving, deploy         benchmarks, peers, load generators
    cli → tools

Checked twice: statically over every import statement of every module, and by importing each package in
a fresh interpreter where every package it may not reach cannot be imported at all.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import tomllib

BASE = "specrt"  # specrt/__init__.py, errors, paths
GRAPH: dict[str, tuple[str, ...]] = {
    BASE: (),
    "specrt.kinds": (BASE,),
    "specrt.plugins": (BASE,),
    "specrt.schema": ("specrt.kinds",),
    "specrt.engines": ("specrt.schema", "specrt.plugins"),
    "specrt.runtime": ("specrt.engines", "specrt.kinds"),
    "specrt.export": ("specrt.runtime",),
    "specrt.serving": ("specrt.runtime",),
    "specrt.deploy": ("specrt.runtime",),
    "specrt.tools": ("specrt.export", "specrt.serving", "specrt.deploy"),
    "specrt.cli": ("specrt.tools",),
}
# modules that import a third-party package only their host process has (Triton's Python backend)
HOST_ONLY = {"specrt.deploy.triton.model"}


def package_of(module: str) -> str:
    """The graph's package that is the longest prefix of `module` (specrt's own modules: BASE)."""
    best = BASE
    for name in GRAPH:
        if (module == name or module.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


@cache
def reachable(package: str) -> frozenset[str]:
    """`package` and every package it builds on, directly or through others."""
    out = {package}
    for dep in GRAPH[package]:
        out |= reachable(dep)
    return frozenset(out)


def back_edges(found: dict[str, Path]) -> list[str]:
    """Every import of a package its module's package may not reach."""
    return sorted(f"{module} imports {name}" for module, path in found.items() for name in imported(path, module)
                  if package_of(name) not in reachable(package_of(module)))


def modules() -> dict[str, Path]:
    """Every specrt module and its source file (each package's folder from pyproject's package-dir)."""
    root = Path(__file__).resolve().parents[1]
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in folders.items():
        for path in sorted((root / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imported(path: Path, module: str) -> set[str]:
    """Every specrt module named by an import statement anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {n for n in names if n == "specrt" or n.startswith("specrt.")}


def test_the_graph_is_acyclic_and_every_module_has_a_package():
    for package in GRAPH:
        assert all(package not in reachable(dep) for dep in GRAPH[package]), f"{package} is on a cycle"
    found = modules()
    assert len(found) > 80 and "specrt.runtime.generate" in found and "specrt.engines.trt.runner" in found
    assert {package_of(m) for m in found} == set(GRAPH)


def test_no_module_imports_a_package_it_may_not_reach():
    upward = back_edges(modules())
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module, source", [
    ("specrt.runtime.probe", "from specrt.serving.scheduler import Scheduler\n"),  # upward
    ("specrt.export.probe", "def f():\n    from specrt.serving import api\n"),  # to a sibling, lazily
    ("specrt.serving.probe", "import specrt.export.bundle\n"),  # the other way
    ("specrt.engines.probe", "from ..runtime import generate\n"),  # relative
])
def test_a_deliberate_back_edge_fails_the_check(tmp_path, module, source):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert back_edges({module: path}), f"{module}: {source!r} was not caught"


def test_the_layer_check_sees_lazy_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from specrt.tools.bench import Peer\n    from . import generate\n")
    assert imported(source, "specrt.runtime.probe") == {"specrt.tools.bench", "specrt.tools.bench.Peer",
                                                        "specrt.runtime", "specrt.runtime.generate"}
    assert back_edges({"specrt.runtime.probe": source}) == ["specrt.runtime.probe imports specrt.tools.bench",
                                                            "specrt.runtime.probe imports specrt.tools.bench.Peer"]


BLOCKER = """
import importlib, importlib.abc, json, sys
blocked, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(f"{name} is above this layer")

sys.meta_path.insert(0, Block())
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(json.dumps(failed))
"""


@pytest.mark.parametrize("package", [p for p in GRAPH if p != "specrt.cli"])
def test_each_package_imports_with_the_ones_it_may_not_reach_unimportable(package):
    blocked = sorted(p for p in GRAPH if p not in reachable(package))
    mine = sorted(m for m in modules() if package_of(m) == package and m not in HOST_ONLY)
    assert mine
    proc = subprocess.run([sys.executable, "-c", BLOCKER, json.dumps(blocked), json.dumps(mine)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
