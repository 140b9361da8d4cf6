"""Where specrt keeps the default model and bundle (overridable with $SPECRT_HOME)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_BUNDLE_NAME = "smollm2-135m-instruct"


def home() -> Path:
    """Root of specrt's working files: $SPECRT_HOME, else ./artifacts in the current directory."""
    return Path(os.environ.get("SPECRT_HOME", "artifacts")).resolve()


def default_bundle() -> Path:
    """The bundle `make export build` writes and `specrt generate` uses when none is named."""
    return home() / "bundles" / DEFAULT_BUNDLE_NAME


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
