"""Where specrt keeps its working files: the default model, bundles, trained drafters, distillation
stores. One root, $SPECRT_HOME, else ./artifacts of the current directory: the folder the Makefile
uses too (it exports SPECRT_HOME=$(CURDIR)/artifacts), so the commands run in the checkout find what
`make` built; from another folder, set SPECRT_HOME or name the bundle. A default bundle that is not
there is refused with where specrt looked and that fix."""

from __future__ import annotations

import os
from pathlib import Path

from specrt.errors import SpecrtError

DEFAULT_BUNDLE_NAME = "smollm2-135m-instruct"
HOME_ENV = "SPECRT_HOME"
HOME_HELP = ("Files specrt writes and finds by default (the default model, bundles, drafters, stores) live under "
             "$SPECRT_HOME, default ./artifacts of the current directory (the Makefile uses the checkout's "
             "artifacts/). From another folder, set SPECRT_HOME=/path/to/checkout/artifacts or name the BUNDLE.")


def home() -> Path:
    """Root of specrt's working files: $SPECRT_HOME, else ./artifacts in the current directory."""
    return Path(os.environ.get(HOME_ENV) or "artifacts").resolve()


def default_bundle() -> Path:
    """The bundle `make export build` writes and `specrt generate` uses when none is named."""
    return home() / "bundles" / DEFAULT_BUNDLE_NAME


def existing_default_bundle() -> Path:
    """The default bundle, for a command given no BUNDLE; when it is not there, one line saying where
    specrt looked (and why there) and how to point it at the bundle `make` built."""
    bundle = default_bundle()
    if bundle.is_dir():
        return bundle
    why = f"{HOME_ENV} is {home()}" if os.environ.get(HOME_ENV) else \
        f"{HOME_ENV} is not set, so specrt looked under ./artifacts of the current directory, {Path.cwd()}"
    raise SpecrtError(f"no BUNDLE given and the default bundle {bundle} does not exist ({why}): name the bundle, "
                      f"or set {HOME_ENV}=/path/to/checkout/artifacts (where `make run` put it), or build it here "
                      "with `specrt export` then `specrt build`")


def models_dir() -> Path:
    return home() / "models"


def drafter_dir(kind: str) -> Path:
    """Where `specrt train KIND` saves the drafter for the default model (and export looks for it)."""
    return home() / "drafters" / kind


def train_cache_dir() -> Path:
    return home() / "train" / "cache"


def cache_dir() -> Path:
    """Small caches specrt may drop at any time (file digests): $SPECRT_HOME/cache when $SPECRT_HOME is
    set, else the user cache folder ($XDG_CACHE_HOME, default ~/.cache)/specrt."""
    if os.environ.get("SPECRT_HOME"):
        return home() / "cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specrt"
