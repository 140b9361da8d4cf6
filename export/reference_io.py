"""Reference inputs and outputs of a decoder graph, saved at export from the PyTorch module (CPU).

One fixed verify step per graph: past_len 0, a 6-token window with a branching tree mask, a small KV
capacity and seeded token ids. The files are Polygraphy's formats, so `specrt validate --polygraphy`
(and `polygraphy run --load-inputs ... --load-outputs ...` by hand) can check any backend against them:

    reference/{role}_inputs.json   a list of feed dicts (`polygraphy run --load-inputs`)
    reference/{role}_outputs.json  a RunResults with one iteration of runner "pytorch"
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specrt.export.modeling import DecoderLM
from specrt.runtime.tree import Tree

REFERENCE_DIR = "reference"
RUNNER = "pytorch"
CAPACITY = 16  # KV rows: the window fits with room to spare
PARENTS = (-1, 0, 0, 1, 1, 2)  # a branching tree of 6 tokens: root, two children, three grandchildren


def tree_inputs(parents=PARENTS) -> tuple[np.ndarray, np.ndarray]:
    """(tree_mask [1,T,T], position_ids [1,T]) of a tree given by its parent list (parents[0] = -1):
    the runtime's own Tree, positions = depth. Copies: a Tree's arrays are read-only (shared by every tree of
    that shape), and these become torch tensors."""
    tree = Tree.from_parents(list(parents))
    return tree.mask[None].copy(), tree.depth.astype(np.int64)[None]


def reference_feed(module: DecoderLM, seed: int = 0) -> dict[str, np.ndarray]:
    """The graph's inputs for one verify step over PARENTS at past_len 0 (zeroed KV of CAPACITY rows)."""
    cfg = module.cfg
    mask, pos = tree_inputs()
    t = mask.shape[-1]
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(seed))
    feed = {"input_ids": ids.numpy(), "position_ids": pos, "past_len": np.zeros(1, np.int64), "tree_mask": mask,
            "logits_index": np.arange(t, dtype=np.int64)[None]}
    shape = (1, cfg.num_kv_heads, CAPACITY, cfg.head_dim)
    for i in range(cfg.num_layers):
        feed[f"past_key.{i}"] = np.zeros(shape, np.float32)
        feed[f"past_value.{i}"] = np.zeros(shape, np.float32)
    return feed


def reference_outputs(module: DecoderLM, feed: dict[str, np.ndarray], taps: tuple[int, ...] = ()) -> dict:
    """The module's outputs for `feed`, named as the graph's: logits, hidden_states, (aux_hidden_states),
    present_key.i / present_value.i."""
    kv = [(torch.from_numpy(feed[f"past_key.{i}"].copy()), torch.from_numpy(feed[f"past_value.{i}"].copy()))
          for i in range(module.cfg.num_layers)]
    t = {k: torch.from_numpy(feed[k]) for k in ("input_ids", "position_ids", "past_len", "tree_mask", "logits_index")}
    out = module(t["input_ids"], t["position_ids"], t["past_len"], t["tree_mask"], kv,
                 logits_index=t["logits_index"], taps=taps)
    names = ["logits", "hidden_states"] + (["aux_hidden_states"] if taps else [])
    result = {name: value.numpy() for name, value in zip(names, out, strict=True)}
    for i, (k, v) in enumerate(kv):  # written in place, as the graph's TensorScatter does
        result[f"present_key.{i}"], result[f"present_value.{i}"] = k.numpy(), v.numpy()
    return result


def save_reference(module: DecoderLM, out_dir: Path, role: str, taps: tuple[int, ...] = ()) -> dict:
    """Write reference/{role}_inputs.json and reference/{role}_outputs.json under the bundle folder
    `out_dir`; returns the manifest record {"inputs": path, "outputs": path} (relative to the bundle)."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json
    from polygraphy.logger import G_LOGGER

    folder = Path(out_dir) / REFERENCE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    feed = reference_feed(module)
    results = RunResults()
    results.add([reference_outputs(module, feed, taps)], runner_name=RUNNER)
    record = {"inputs": f"{REFERENCE_DIR}/{role}_inputs.json", "outputs": f"{REFERENCE_DIR}/{role}_outputs.json"}
    with G_LOGGER.verbosity(G_LOGGER.WARNING):  # no "Saving ..." lines in the export's output
        save_json([feed], Path(out_dir) / record["inputs"], description=f"{role} reference inputs")
        results.save(Path(out_dir) / record["outputs"])
    return record


def save_references(modules: dict, graphs: dict, out_dir: Path, taps: tuple[int, ...] = ()) -> dict:
    """save_reference for the target and draft LMs of a bundle being written (the `taps` are the
    target's); {} without Polygraphy installed (`specrt validate --polygraphy` then asks to re-export)."""
    try:
        import polygraphy  # noqa: F401
    except ImportError:
        return {}
    return {role: save_reference(modules[role], out_dir, role, taps if role == "target" else ())
            for role in ("target", "draft") if role in graphs and modules.get(role) is not None}
