"""Every "package.module:attribute" reference of every registered kind (specrt/kinds/) resolves to what
its field promises: runtime ones always, torch ones (export, training, public checkpoints) when torch
is importable. A failure names the kind and the field. Also: the registry finds kinds from outside
the package (SPECRT_KIND_MODULES), and the Makefile trains the registry's learned kinds."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specrt import kinds as registry
from specrt.errors import SpecrtError
from specrt.kinds import kinds, learned_kinds, resolve

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _resolved(kind: str, field: str, ref: str):
    try:
        return resolve(ref)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"kind {kind!r} field {field} = {ref!r} does not resolve: {type(e).__name__}: {e}")


def _is_class(base):
    return lambda obj: isinstance(obj, type) and (base is None or issubclass(obj, base))


def _config_of(name: str):
    def check(obj) -> bool:
        names = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
        return isinstance(obj, type) and "kind" in names and names["kind"].default == name
    return check


def runtime_refs():
    """(kind, field, reference, check) of every runtime reference."""
    from specrt.runtime.drafters import Drafter

    return [(s.name, f"runtime[{name!r}]", ref, _is_class(Drafter)) for s in kinds().values()
            for name, ref in s.runtime.items()]


def torch_refs():
    """(kind, field, reference, check) of every torch reference (export/, training, public layouts)."""
    from torch import nn

    from specrt.export.drafters.public import PublicLayout
    from specrt.export.training.objectives import Objective

    out = []
    for s in kinds().values():
        fields = [("config", s.config, _config_of(s.name)), ("module", s.module, _is_class(nn.Module)),
                  ("graphs", s.graphs, callable), ("public_layout", s.public_layout,
                                                   lambda o: isinstance(o, PublicLayout)),
                  ("public_loader", s.public_loader, callable)]
        if s.training:
            t = s.training
            fields += [("training.objective", t.objective, _is_class(Objective)),
                       ("training.warm_start", t.warm_start, callable),
                       ("training.options_from_data", t.options_from_data, callable)]
        out += [(s.name, f, ref, check) for f, ref, check in fields if ref is not None]
    return out


def _ids(refs):
    return [f"{k}.{f}" for k, f, _, _ in refs]


RUNTIME = runtime_refs()


@pytest.mark.parametrize("kind,field,ref,check", RUNTIME, ids=_ids(RUNTIME))
def test_runtime_reference_resolves(kind, field, ref, check):
    obj = _resolved(kind, field, ref)
    assert check(obj), f"kind {kind!r} field {field} = {ref!r} is {obj!r}, not a runtime Drafter class"


@pytest.mark.skipif(not HAS_TORCH, reason="the export extra (torch) is not installed")
def test_every_torch_reference_resolves_to_what_its_field_promises():
    bad = []
    for kind, field, ref, check in torch_refs():
        obj = _resolved(kind, field, ref)
        if not check(obj):
            bad.append(f"kind {kind!r} field {field} = {ref!r} is {obj!r}")
    assert not bad, "; ".join(bad)


def test_each_spec_is_consistent():
    for s in kinds().values():
        assert set(s.search) <= set(s.runtime), f"kind {s.name!r}: search names a drafter it does not run"
        if s.learned:
            assert s.config and s.training, f"learned kind {s.name!r} needs config and training"
            assert s.graphs or s.bundle_role, f"learned kind {s.name!r} needs graphs or a bundle_role"
        assert bool(s.public_layout) == bool(s.public_loader), \
            f"kind {s.name!r}: public_layout and public_loader come together"


def test_search_spaces_exist():
    from specrt.tools.tune import SPACES

    for s in kinds().values():
        missing = set(s.search.values()) - set(SPACES)
        assert not missing, f"kind {s.name!r} field search names unknown spaces {sorted(missing)}"


def test_kinds_from_outside_the_package(tmp_path, monkeypatch):
    """SPECRT_KIND_MODULES adds kinds; the registry is keyed on it, so unsetting it drops them."""
    (tmp_path / "outside_kind.py").write_text(
        "from specrt.kinds import DrafterSpec\n"
        "SPEC = DrafterSpec(name='outside', order=50, summary='a test kind',\n"
        "                   runtime={'outside': 'specrt.runtime.drafters.plain:Plain'}, available='always')\n")
    (tmp_path / "twice_kind.py").write_text(
        "from specrt.kinds import DrafterSpec\n"
        "SPEC = DrafterSpec(name='ngram', order=50, summary='a clash', runtime={})\n")
    (tmp_path / "no_kind.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(kinds())
    try:
        monkeypatch.setenv(registry.MODULES_ENV, "outside_kind")
        assert list(kinds())[-1] == "outside" and "outside" in registry.runtime_drafters()
        monkeypatch.setenv(registry.MODULES_ENV, "twice_kind")
        with pytest.raises(SpecrtError, match="'ngram' is declared twice"):
            kinds()
        monkeypatch.setenv(registry.MODULES_ENV, "no_kind")
        with pytest.raises(SpecrtError, match="no_kind.*no drafter kind"):
            kinds()
        monkeypatch.delenv(registry.MODULES_ENV)
        assert list(kinds()) == before
    finally:
        for m in ("outside_kind", "twice_kind", "no_kind"):
            sys.modules.pop(m, None)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_train_trains_every_learned_kind():
    out = subprocess.run(["make", "-s", "-n", "train"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("for k in ")), "")
    assert line.removeprefix("for k in ").split("; do")[0].split() == learned_kinds(), out[-2000:]
