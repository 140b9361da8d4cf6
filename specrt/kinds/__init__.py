"""Drafter kinds, each declared once: one module per kind in this package holds its `SPEC`.

A spec says everything the rest of specrt needs to know about a kind, so nothing else lists kinds:

    runtime drafters   the names `generate --drafter` accepts and the class that runs each
    tune search        which search space `specrt tune` tries for each runtime drafter
    checkpoint         config and module classes, whether the target's LM head is shared
    export             the graph writer (or the bundle role the kind fills), the public-checkpoint
                       layout rule and loader
    training           objective, warm start, extra options from the data, default epochs and rate

Code is named by reference ("package.module:attribute") and imported only when used, so this
package imports neither torch nor onnxruntime: the runtime resolves only runtime references, the
exporter the torch ones. A learned kind's code lives in its own module(s), export/drafters/<kind>.py:
the torch module and config, the graph mix and writer, the objective, the public layout and loader.
Adding a kind is adding a module here (and the code it names) plus tests;
`tests/test_kind_coverage.py` fails until the kind has each kind of test, `tests/test_kind_refs.py`
until every reference resolves.

Kinds from outside this package (new files only, nothing here edited) are modules with a `SPEC`
named by an environment variable:

    SPECRT_KIND_MODULES=pkg.mod,other.mod   comma-separated module names, importable from sys.path

A kind named twice is refused. The registry is read once per value of SPECRT_KIND_MODULES. (Not
entry points: scanning the installed distributions costs ~0.1 s at every start of `specrt`.)
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from specrt.errors import SpecrtError

AUTO = "auto"  # not a drafter of its own: each request runs the bundle's drafter that pays most
MODULES_ENV = "SPECRT_KIND_MODULES"  # comma-separated modules with a `SPEC`: kinds from outside this package


def resolve(ref: str):
    """The object a "package.module:attribute" reference names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Training:
    """How `specrt train KIND` fits the kind to a target (every reference is torch code in export/)."""

    objective: str  # the training objective class (export/training/objectives.py or the kind's module)
    epochs: float  # default passes over the distillation data (≤ ~15 min on 2 CPU cores)
    lr: float
    test_epochs: int  # the brief training the test suite's fixtures give the kind
    warm_start: str | None = None  # (module, target, label vocab) -> None: initial weights from the target
    options_from_data: str | None = None  # (options, data, label vocab) -> options the data decides
    test_options: dict = field(default_factory=dict)  # config fields for the test suite's brief training
    # the trained checkpoint keeps the label vocabulary as its draft vocabulary: the exported head computes
    # the logits of those target ids only (kinds whose head is the target's, or trained on those rows only)
    head_vocab: bool = False


@dataclass(frozen=True)
class DrafterSpec:
    name: str  # the kind: manifest "drafters" key, checkpoint config "kind", `specrt train` argument
    summary: str  # one line for --help and docs
    order: int  # where it is listed
    runtime: dict[str, str]  # runtime drafter name -> its class (runtime/drafters/)
    search: dict[str, str] = field(default_factory=dict)  # runtime drafter -> tools/tune.py search space
    available: str = "drafter"  # when a bundle can run it: "always", "drafter" (exported), "graph:ROLE"
    config: str | None = None  # checkpoint config dataclass
    module: str | None = None  # the torch module
    shares_lm_head: Callable[[object], bool] = lambda cfg: True  # config -> the target's LM head is attached
    graphs: str | None = None  # (module, folder, target cfg, source, check_parity) -> (graphs, entry, parity)
    bundle_role: str | None = None  # exported as this role of the bundle instead of as a drafter ("draft")
    public_layout: str | None = None  # a public.PublicLayout: whether a folder holds the kind's public layout
    public_loader: str | None = None  # (folder, meta, weights, target) -> module, for public checkpoints
    training: Training | None = None
    example_config: dict = field(default_factory=dict)  # a small valid config on a 2-layer target (tests)
    # config of the random drafter the tests export with a tiny target of real vocabulary (49152; tests/helpers.py
    # random_drafters); None: example_config
    random_config: dict | None = None
    add_hint: str | None = None  # how a bundle gets the kind (default for learned kinds: train, then export)

    @property
    def learned(self) -> bool:
        """Has weights of its own: a checkpoint, training, an export step."""
        return self.module is not None

    @property
    def how_to_add(self) -> str:
        """The commands that give a bundle this kind."""
        return self.add_hint or f"`specrt train {self.name}` then `specrt export --drafter {self.name}`"

    def available_in(self, manifest) -> bool:
        if self.available == "always":
            return True
        if self.available.startswith("graph:"):
            return self.available[len("graph:"):] in manifest.graphs
        return self.name in manifest.drafters


def kinds() -> dict[str, DrafterSpec]:
    """Every kind, in listing order (`order`, then name): the modules of this package, each with a `SPEC`,
    and those SPECRT_KIND_MODULES names."""
    return _kinds(os.environ.get(MODULES_ENV, ""))


def _spec_of(module, where: str) -> DrafterSpec:
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, DrafterSpec):
        raise SpecrtError(f"{where} is no drafter kind: it holds no `SPEC = DrafterSpec(...)`")
    return spec


@cache
def _kinds(modules: str) -> dict[str, DrafterSpec]:
    specs = [importlib.import_module(f"{__name__}.{m.name}").SPEC for m in pkgutil.iter_modules(__path__)]
    specs += [_spec_of(importlib.import_module(m), f"module {m} ({MODULES_ENV})")
              for m in (m.strip() for m in modules.split(",")) if m]
    out: dict[str, DrafterSpec] = {}
    for s in sorted(specs, key=lambda s: (s.order, s.name)):
        if s.name in out and out[s.name] is not s:
            raise SpecrtError(f"drafter kind {s.name!r} is declared twice: rename one ({MODULES_ENV})")
        out[s.name] = s
    return out


def kind(name: str) -> DrafterSpec:
    if name not in kinds():
        raise SpecrtError(f"unknown drafter kind {name!r}: choose one of {', '.join(learned_kinds())}")
    return kinds()[name]


def learned_kinds() -> list[str]:
    """Kinds with weights: what `specrt train` and `specrt export --drafter` take."""
    return [n for n, s in kinds().items() if s.learned]


def runtime_drafters() -> dict[str, DrafterSpec]:
    """Runtime drafter name -> the kind that provides it."""
    return {name: s for s in kinds().values() for name in s.runtime}


def kind_of(drafter: str) -> DrafterSpec:
    table = runtime_drafters()
    if drafter not in table:
        raise SpecrtError(f"unknown drafter {drafter!r}: choose one of {', '.join([*table, AUTO])}")
    return table[drafter]


def bundle_drafters(manifest) -> list[str]:
    """Every name `--drafter` takes on a bundle: the model-free drafters, auto, then the runtime drafters
    of each kind the bundle holds (its draft model, its learned drafters)."""
    have = [s for s in kinds().values() if s.available_in(manifest)]
    free = [n for s in have if s.available == "always" for n in s.runtime]
    return [*free, AUTO, *(n for s in have if s.available != "always" for n in s.runtime)]


def not_in_bundle(drafter: str, manifest, bundle) -> str:
    """One line for `--drafter NAME` on a bundle without its kind: what the bundle runs, how to add it."""
    spec = kind_of(drafter)
    return (f"bundle {bundle} has no {spec.name} drafter for --drafter {drafter}; it runs "
            f"{', '.join(bundle_drafters(manifest))}. Add {spec.name} with {spec.how_to_add} (export writes the "
            "bundle anew: name every --drafter it should keep)")
