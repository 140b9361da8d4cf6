"""check_safetensors: a real safetensors file passes whatever its header length; anything else is named."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from specrt.errors import SpecrtError
from specrt.export.safetensors_file import check_safetensors


def header_length(path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def test_a_header_length_whose_low_byte_is_a_pickle_mark_still_passes(tmp_path):
    """The first byte of a safetensors file is its header length's low byte, which is 0x80 (a pickle's
    protocol mark) for one header length in 256."""
    for n in range(1, 400):  # tensor names of growing length until the header's length ends in 0x80
        path = tmp_path / f"{n}.safetensors"
        save_file({"w" * n: torch.zeros(2)}, path)
        if header_length(path) % 256 == 0x80:
            break
    assert path.read_bytes()[:1] == b"\x80"
    check_safetensors(path)


@pytest.mark.parametrize("content,why", [(pickle.dumps({"w": [0.0] * 8}), "a Python pickle"),
                                         (b"PK\x03\x04" + bytes(60), "a zip archive"),
                                         (b"GGUF" + bytes(60), "a GGUF file"),
                                         ((20).to_bytes(8, "little") + b"not json, twenty by.", "not JSON"),
                                         ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
                                         (b"1234", "only 4 bytes")])
def test_other_files_named_safetensors_are_named(tmp_path, content, why):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(SpecrtError, match=f"{path.name} is not a safetensors file.*{why}"):
        check_safetensors(path)
