"""`specrt-run` works from a plain `pip install specrt` (no extras) in a fresh virtual environment:
no torch, no transformers, no HTTP server stack, and its greedy output equals the in-process runtime's.

The venv is made once for this module (about 30 s with a warm pip cache). The package is built from a copy
of the working tree, so the build's `build/` and `*.egg-info` land there and never in the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Name three colors."
# installed `specrt/<key>` <- repository folder `<value>` (pyproject's [tool.setuptools] package-dir)
SOURCE_ROOTS = {"": "specrt", "export": "export", "runtime": "runtime", "plugins": "plugins", "engines": "engines",
                "serving": "serving", "deploy": "deploy", "tools": "tools"}
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "venv", "artifacts", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache", ".whl", ".gl")


class Venv:
    def __init__(self, root: Path):
        self.root = root
        self.path = root / "venv"
        self.bin = self.path / ("Scripts" if os.name == "nt" else "bin")
        self.python = self.bin / "python"
        # nothing of this interpreter's environment leaks in: no PYTHONPATH, not the outer venv
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env["PATH"] = str(self.bin) + os.pathsep + self.env.get("PATH", "")

    def run(self, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        # cwd outside the repository: `import specrt` must find the installed package, not ./specrt
        return subprocess.run([str(a) for a in args], cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def site_package(self) -> Path:
        out = self.run(self.python, "-c", "import specrt, os; print(os.path.dirname(specrt.__file__))")
        assert out.returncode == 0, out.stderr[-2000:]
        return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """A fresh venv (no system site packages) with the repository installed, non-editable, without extras."""
    root = tmp_path_factory.mktemp("standalone")
    v = Venv(root)
    src = root / "src"
    t0 = time.perf_counter()
    shutil.copytree(REPO, src, ignore=NOT_SOURCES)
    made = v.run(sys.executable, "-m", "venv", v.path, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    t1 = time.perf_counter()
    pip = v.run(v.python, "-m", "pip", "install", "--quiet", src, timeout=600)
    assert pip.returncode == 0, f"pip install failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}"
    t2 = time.perf_counter()
    print(f"\nstandalone venv: created in {t1 - t0:.1f}s, `pip install` in {t2 - t1:.1f}s")
    return v


@pytest.mark.parametrize("module", ["torch", "transformers", "fastapi", "uvicorn", "prometheus_client"])
def test_no_torch_no_transformers_no_http_server(venv, module):
    out = venv.run(venv.python, "-c", f"import {module}")
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, (
        f"`import {module}` works in the standalone venv: a base dependency pulls it in\n{out.stdout}")


def test_installed_not_editable(venv):
    installed = venv.site_package()
    assert venv.path in installed.parents, f"specrt imports from {installed}, not from the venv"


def test_install_ships_every_module_and_data(venv):
    installed = venv.site_package()
    missing = []
    for dest, folder in SOURCE_ROOTS.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            rel = f.relative_to(REPO / folder)
            if not (installed / dest / rel).is_file():
                missing.append(f"{folder}/{rel}")
    for f in sorted((REPO / "specrt" / "data").glob("*.jsonl")):
        if not (installed / "data" / f.name).is_file():
            missing.append(f"specrt/data/{f.name}")
    assert not missing, ("not in the installed package (a package missing from [tool.setuptools] packages, "
                         "or a folder without __init__.py?): " + ", ".join(missing))


IMPORT_ALL = """
import importlib, pkgutil, sys
import specrt
bad = []
for m in pkgutil.walk_packages(specrt.__path__, "specrt."):
    if m.name.startswith(NEED_EXTRAS):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as e:
        bad.append(f"{m.name}: {type(e).__name__}: {e}")
bad += [f"{name} got imported" for name in ("torch", "transformers") if name in sys.modules]
print("\\n".join(bad))
"""
# the exporter and the Triton kernels need the [export] extra, the HTTP server and its load generators the
# [serve] extra; the Triton server's Python model runs inside Triton (`triton_python_backend_utils`)
NEED_EXTRAS = ("specrt.export", "specrt.plugins.triton_kernels", "specrt.deploy.triton.model", "specrt.serving.api",
               "specrt.serving.http", "specrt.serving.guards", "specrt.serving.metrics", "specrt.serving.protocol",
               "specrt.serving.scheduler", "specrt.serving.errors", "specrt.serving.counted",
               "specrt.serving.state", "specrt.serving.completion", "specrt.serving.routes",
               "specrt.tools.loadgen")


def test_runtime_modules_import_without_extras(venv):
    out = venv.run(venv.python, "-c", f"NEED_EXTRAS = {NEED_EXTRAS!r}\n" + IMPORT_ALL)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", "fails without the extras installed:\n" + out.stdout


def test_help_lists_runtime_commands(venv):
    out = venv.run(venv.bin / "specrt-run", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    commands = out.stdout.split("Commands:")[1].split()
    for name in ("generate", "serve", "bench", "info"):
        assert name in commands, out.stdout
    for name in ("export", "train"):
        assert name not in commands, out.stdout
    serve = venv.run(venv.bin / "specrt-run", "serve", "--help")
    assert serve.returncode == 0 and "Usage:" in serve.stdout, serve.stderr[-2000:]


def test_serve_without_the_extra_names_it(venv, tiny_bundle):
    out = venv.run(venv.bin / "specrt-run", "serve", tiny_bundle)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith("specrt-run: error: specrt serve needs") and "specrt[serve]" in out.stderr, out.stderr


def test_generate_equals_in_process_plain(venv, tiny_bundle):
    from specrt.runtime.generate import Generator

    gen = Generator(tiny_bundle, drafter="plain")
    expected = gen.generate_ids(gen.tokenizer.encode_prompt(PROMPT), 8).token_ids

    t0 = time.perf_counter()
    out = venv.run(venv.bin / "specrt-run", "generate", tiny_bundle, "--prompt", PROMPT, "--max-new-tokens", "8",
                   "--json", "--drafter", "ngram")
    print(f"\nspecrt-run generate (standalone venv): {time.perf_counter() - t0:.1f}s")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["drafter"] == "ngram"
    assert result["token_ids"] == expected
    assert result["stats"]["new_tokens"] == len(expected) > 0


def test_info_and_errors(venv, tiny_bundle):
    out = venv.run(venv.bin / "specrt-run", "info", tiny_bundle, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    assert s["model"]["num_layers"] == 2 and {"target", "draft"} <= set(s["graphs"])
    assert {"plain", "ngram", "draft"} <= set(s["drafters"])
    text = venv.run(venv.bin / "specrt-run", "info", tiny_bundle)
    assert text.returncode == 0 and "quantization" in text.stdout, text.stderr[-2000:]

    bad = venv.run(venv.bin / "specrt-run", "info", venv.root / "no-such-bundle")
    assert bad.returncode == 1
    assert bad.stderr.startswith("specrt-run: error: ") and "Traceback" not in bad.stderr, bad.stderr
