"""A .gguf's header is read once per model load (export/gguf_once.py), and the model loaded is the same."""

from __future__ import annotations

import contextlib

import gguf
import pytest
import torch
from transformers import modeling_gguf_pytorch_utils as hf_gguf

import specrt.export.gguf_once as once
from specrt.export.loading import load_model
from tests.helpers import k_quant_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, default_gguf):
    # the real tokenizer's first 2,048 tokens: transformers' own way parses the header four times over
    return k_quant_gguf(tmp_path_factory.mktemp("once") / "tiny.gguf", default_gguf, main="Q5_1", vocab_size=2048)


def _counting_reader(monkeypatch) -> list[str]:
    built: list[str] = []
    real = gguf.GGUFReader

    class Counting(real):
        def __init__(self, path, mode="r"):
            built.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return built


def test_a_gguf_is_parsed_once_and_loads_the_same_model(tiny_gguf, monkeypatch):
    built = _counting_reader(monkeypatch)
    reader = gguf.GGUFReader
    fast = load_model(tiny_gguf, keep_hf=False)
    assert built == [str(tiny_gguf)]
    assert gguf.GGUFReader is reader and hf_gguf.load_gguf_checkpoint is not None  # restored after the load

    built.clear()
    monkeypatch.setattr(once, "gguf_parsed_once", contextlib.nullcontext)  # transformers' own way
    slow = load_model(tiny_gguf, keep_hf=False)
    assert len(built) > 1
    a, b = fast.module.state_dict(), slow.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert fast.module.cfg == slow.module.cfg and fast.hf_config.to_dict() == slow.hf_config.to_dict()
    assert fast.tokenizer.get_vocab() == slow.tokenizer.get_vocab()
    text = "Speculative decoding, exactly: 12 tokens."
    assert fast.tokenizer(text)["input_ids"] == slow.tokenizer(text)["input_ids"]


def test_the_swapped_names_are_restored_when_a_load_fails(tmp_path):
    names = (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint)
    with pytest.raises(RuntimeError), once.gguf_parsed_once():
        assert gguf.GGUFReader is not names[0]
        raise RuntimeError("a load that fails half-way")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == names


def test_metadata_is_handed_out_as_a_fresh_copy(tiny_gguf):
    with once.gguf_parsed_once():
        first = hf_gguf.load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
        first["config"]["edited"] = True  # transformers edits the dicts it is given
        second = hf_gguf.load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
    assert "edited" not in second["config"] and second["tokenizer"] == first["tokenizer"]


def test_an_export_s_check_load_and_block_read_share_one_parse(tiny_gguf, monkeypatch):
    """export_bundle holds gguf_parsed_once around its type check, the load (whose own context, nested, changes
    nothing) and the block reader: one parse of the file's header for all of them."""
    from specrt.export.gguf_blocks import GGUFBlocks, refuse_requantizing

    built = _counting_reader(monkeypatch)
    with once.gguf_parsed_once():
        refuse_requantizing(tiny_gguf)
        with once.gguf_parsed_once():
            hf_gguf.load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
        assert GGUFBlocks(tiny_gguf).type_of("blk.1.attn_q.weight") == "Q5_1"
    assert built == [str(tiny_gguf)]  # the block reader, after the nested exit, still had the outer one's reader
