"""The packages form layers, and no module imports a layer above its own (not even lazily, inside a
function). Bottom to top:

    specrt (errors, paths) → schema · plugins · kinds → engines → runtime → runtime.serving → export
    → tools → cli

Checked twice: statically over every import statement of every module, and by importing each layer in
a fresh interpreter where the layers above it cannot be imported at all.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

LAYERS = [
    ("specrt", "specrt.errors", "specrt.paths"),
    ("specrt.schema", "specrt.plugins", "specrt.kinds"),
    ("specrt.engines",),
    ("specrt.runtime",),
    ("specrt.runtime.serving",),
    ("specrt.export",),
    ("specrt.tools",),
    ("specrt.cli",),
]
# modules that import a third-party package only their host process has (Triton's Python backend)
HOST_ONLY = {"specrt.runtime.serving.triton.model"}


def layer_of(module: str) -> int:
    """The layer of the longest package prefix of `module`."""
    best, level = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), i
    return level


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


def test_every_module_has_a_layer():
    found = modules()
    assert len(found) > 80 and "specrt.runtime.generate" in found and "specrt.engines.trt.runner" in found
    assert not [m for m in found if layer_of(m) < 0]


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, path in modules().items():
        for name in imported(path, module):
            if layer_of(name) > layer_of(module):
                upward.append(f"{module} imports {name}")
    assert not upward, "\n".join(sorted(upward))


def test_the_layer_check_sees_lazy_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from specrt.tools.bench import Peer\n    from . import generate\n")
    assert imported(source, "specrt.runtime.probe") == {"specrt.tools.bench", "specrt.tools.bench.Peer",
                                                        "specrt.runtime", "specrt.runtime.generate"}
    assert layer_of("specrt.tools.bench") > layer_of("specrt.runtime.probe")


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


@pytest.mark.parametrize("level", range(len(LAYERS) - 1), ids=[n[0] for n in LAYERS[:-1]])
def test_each_layer_imports_with_the_layers_above_it_unimportable(level):
    above = [n for names in LAYERS[level + 1 :] for n in names]
    # a lower layer's own package name is a prefix of some higher packages (specrt.runtime.serving): block
    # only the higher packages themselves
    mine = sorted(m for m in modules() if layer_of(m) == level and m not in HOST_ONLY)
    assert mine
    proc = subprocess.run([sys.executable, "-c", BLOCKER, json.dumps(above), json.dumps(mine)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
