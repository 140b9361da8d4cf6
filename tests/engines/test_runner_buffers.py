"""The ONNX Runtime runner binds each pass's inputs and outputs to buffers of its own, kept while their
shapes hold (engines/ort_cpu/runner.py): what a pass returns is still the caller's after later passes,
and passes of changing shapes compute what a fresh decoder computes for them."""

from __future__ import annotations

import numpy as np

from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.runtime.tree import Tree
from specrt.schema.manifest import Manifest

CAPACITY = 64


def _pass(dec: OrtDecoder, tokens, past: int, rows=None) -> dict:
    tree = Tree.chain(len(tokens) - 1)
    rows = np.arange(tree.size) if rows is None else np.asarray(rows)
    return dec.run_all(np.asarray([tokens], np.int64), (past + tree.depth)[None].astype(np.int64),
                       np.array([past], np.int64), tree.mask[None], rows[None].astype(np.int64))


def test_outputs_stay_the_callers_and_shapes_may_change(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    cfg = manifest.target.config
    path = tiny_bundle / manifest.graphs["target"].file
    dec = OrtDecoder(path, cfg, CAPACITY, threads=1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 9).tolist()
    steps = [(prompt, 0, [8]), ([5], 9, None), ([7], 10, None), ([1, 2, 3], 11, None), ([4], 14, None)]
    got = [_pass(dec, *s) for s in steps]  # every result kept while the later passes run
    kept = [{k: v.copy() for k, v in g.items()} for g in got]
    for i, (tokens, past, rows) in enumerate(steps):
        fresh = OrtDecoder(path, cfg, CAPACITY, threads=1)  # the same passes, each shape bound anew
        for s in steps[:i]:
            _pass(fresh, *s)
        want = _pass(fresh, tokens, past, rows)
        assert got[i]["logits"].shape == (1, len(rows or tokens), cfg.vocab_size)
        for name in want:
            assert np.array_equal(got[i][name], want[name]), (i, name)
            assert np.array_equal(got[i][name], kept[i][name]), (i, name)  # not overwritten by later passes
        assert got[i]["logits"].base is None or not np.shares_memory(got[i]["logits"], got[-1]["logits"])
