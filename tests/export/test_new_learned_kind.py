"""Adding a learned drafter kind is new files only: a toy kind written into tmp_path (its spec, a torch
head and config, an objective, a graph writer, a runtime drafter), found through SPECRT_KIND_MODULES,
runs through the real pipeline: `specrt train`'s choices, training on a tiny target's distillation data,
export into a bundle (with its graph's parity check), and greedy generation equal to plain greedy.

The toy head is one residual SiLU layer over the target's last hidden state of the second-newest
committed token and the target's LM head (Medusa's first head, alone): it proposes a one-token chain."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specrt import kinds as registry

PACKAGE = "toy_learned_kind"

FILES = {
    "__init__.py": '''
        """The toy kind's spec: every reference names a module of this package."""
        from specrt.kinds import DrafterSpec, Training

        SPEC = DrafterSpec(
            name="toy", order=60, summary="one residual layer over the last hidden state, a one-token chain",
            runtime={"toy": "toy_learned_kind.runtime:ToyDrafter"},
            config="toy_learned_kind.head:ToyConfig", module="toy_learned_kind.head:ToyHead",
            graphs="toy_learned_kind.graphs:toy_graphs",
            training=Training(objective="toy_learned_kind.objective:ToyObjective", epochs=4.0, lr=3e-2,
                              test_epochs=40),
            example_config={},
        )
    ''',
    "head.py": '''
        """The torch module: hidden [.., H] -> out = h + silu(W h + b) -> the target's LM head."""
        from dataclasses import dataclass

        from torch import nn

        from specrt.export.drafters.base import FrozenTargetWeights


        @dataclass
        class ToyConfig:
            kind: str = "toy"


        class ToyHead(FrozenTargetWeights):
            def __init__(self, cfg, dec):
                super().__init__()
                self.cfg, self.dec = cfg, dec
                self.proj = nn.Linear(dec.hidden_size, dec.hidden_size)
                nn.init.zeros_(self.proj.weight)  # starts as the target's own head
                nn.init.zeros_(self.proj.bias)

            def features(self, hidden):
                return hidden + nn.functional.silu(self.proj(hidden))

            def forward(self, hidden):
                return self.lm_head(self.features(hidden))
    ''',
    "objective.py": '''
        """Row t (the target's hidden state of x[t]) predicts x[t+2] ~ p[t+1]."""
        import torch.nn.functional as F

        from specrt.export.training.objectives import Objective, shift_rows, soft_ce, top1_hits


        class ToyObjective(Objective):
            def __call__(self, batch):
                logits = F.linear(self.m.features(batch.hidden), self.sub_weight(self.m.lm_head.weight))
                mask = shift_rows(batch.valid, 1)
                loss = soft_ce(logits, shift_rows(batch.label_ids, 1), shift_rows(batch.label_p, 1), mask)
                return loss, [top1_hits(logits, shift_rows(batch.label_top, 1), mask & shift_rows(batch.answer, 1))]
    ''',
    "graphs.py": '''
        """toy/toy.onnx: hidden_in [B,R,H] -> logits [B,R,V]."""
        import torch

        from specrt.export.decoder_graph import _np
        from specrt.export.drafter_export import save_graph, session_parity
        from specrt.plugins.onnx_builder import FLOAT, GraphBuilder


        def toy_graph(module):
            g = GraphBuilder("toy")
            h, v = module.dec.hidden_size, module.dec.vocab_size
            hidden = g.input("hidden_in", FLOAT, ["batch", "rows", h])
            y = g.op("Add", g.op("MatMul", hidden, g.weight("proj.weight", _np(module.proj.weight).T)),
                     g.weight("proj.bias", _np(module.proj.bias)))
            x = g.op("Add", hidden, g.op("Mul", y, g.op("Sigmoid", y)))
            logits = g.op("MatMul", x, g.weight("lm_head.weight", _np(module.lm_head.weight).T))
            g.output(logits, "logits", FLOAT, ["batch", "rows", v])
            return g.model(doc="toy head")


        def toy_graphs(module, tmp, target_cfg, source, check_parity):
            graphs = {"toy": save_graph(toy_graph(module), tmp / "toy" / "toy.onnx", "toy", target_cfg, source)}
            parity = {}
            if check_parity:
                h = torch.randn(1, 3, target_cfg.hidden_size, generator=torch.Generator().manual_seed(0))
                with torch.no_grad():
                    parity["toy"] = session_parity(tmp / graphs["toy"].file, {"hidden_in": h}, module(h))
            return graphs, {}, parity
    ''',
    "runtime.py": '''
        """The runtime drafter: the toy graph on the second-newest committed token's hidden state."""
        import numpy as np

        from specrt.plugins.rejection_sample import sample_from
        from specrt.runtime.drafters import Drafter, Proposal
        from specrt.runtime.sampling import warp


        class ToyDrafter(Drafter):
            name = "toy"
            needs_hidden = True

            def __init__(self, ctx):
                entry = ctx.manifest.drafter("toy", ctx.bundle)
                self.session = ctx.session(entry["graphs"][0])
                self.state = None

            def observe(self, tokens, state=None):
                self.state = state

            def propose(self, tokens, max_nodes, max_depth, sampling, rng):
                if len(tokens) < 2 or max_nodes < 1 or max_depth < 1:
                    return Proposal()
                hidden = self.state.hidden[len(tokens) - 2][None, None]
                logits = self.session.run(None, {"hidden_in": hidden})[0][0, 0]
                if sampling.greedy:
                    return Proposal([int(np.argmax(logits))], [0])
                q = warp(logits, sampling)
                return Proposal([sample_from(q, float(rng.random()))], [0], q[None])
    ''',
}


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The toy kind's files in tmp_path, on sys.path and named by SPECRT_KIND_MODULES; afterwards the
    registry is as it was (it is keyed on the variable) and the toy modules are forgotten."""
    pkg = tmp_path / "src" / PACKAGE
    pkg.mkdir(parents=True)
    for name, text in FILES.items():
        (pkg / name).write_text(textwrap.dedent(text).lstrip())
    before = set(registry.kinds())
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setenv(registry.MODULES_ENV, PACKAGE)
    yield pkg.parent
    monkeypatch.delenv(registry.MODULES_ENV)
    for m in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[m]
    assert set(registry.kinds()) == before and "toy" not in registry.kinds()


def tiny_target(tmp: Path):
    """A 2-layer random Llama (vocab 128) with a word tokenizer, loaded as `export_bundle` takes it."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from specrt.export.loading import LoadedModel, module_from_hf
    from tests.helpers import TINY, save_tiny_folder, save_word_tokenizer

    tokenizer = save_word_tokenizer(tmp / "tokenizer", TINY["vocab_size"])
    folder = save_tiny_folder(tmp / "llama", "llama", None, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return LoadedModel(module=module_from_hf(hf), tokenizer=PreTrainedTokenizerFast.from_pretrained(tokenizer),
                       source=str(folder), hf_config=hf.config)


def test_the_registry_and_cli_list_the_new_kind(toy_kind):
    from specrt.kinds import kind, learned_kinds, runtime_drafters

    assert "toy" in learned_kinds() and runtime_drafters()["toy"].name == "toy"
    assert kind("toy").how_to_add == "`specrt train toy` then `specrt export --drafter toy`"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(toy_kind), os.environ.get("PYTHONPATH", "")])}
    for cmd in ("train", "export"):
        out = subprocess.run([sys.executable, "-c", "from specrt.cli import main; main()", cmd, "--help"],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0 and "toy" in out.stdout, (cmd, out.stdout[-2000:], out.stderr[-2000:])


def test_a_new_learned_kind_trains_exports_and_generates_losslessly(toy_kind, tmp_path):
    from specrt.export import drafters
    from specrt.export.bundle import ExportOptions, export_bundle
    from specrt.export.training.datagen import DistillData, generate
    from specrt.export.training.loop import TrainSettings, train
    from specrt.kinds import kind
    from specrt.runtime.generate import Generator
    from specrt.schema.manifest import Manifest

    target = tiny_target(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (6, 9, 8, 7)]
    seqs = list(generate(target.module, prompts, 24, (0, 1), batch_size=4, progress=False))
    data = DistillData.from_sequences(seqs, [len(p) for p in prompts], [False, False, False, True], (0, 1))

    # training: the spec's objective, through the real loop; it learns (held-out top-1 rises from the start)
    spec = kind("toy").training
    settings = TrainSettings(kind="toy", epochs=spec.test_epochs, batch_seqs=2, evals=4, draft_vocab=128,
                             precision="fp32")
    metrics = train(target.module, settings, tmp_path / "ck", data, progress=False)
    losses = [p["loss"] for p in metrics["curve"]]
    assert losses[-1] < losses[0], losses
    module = drafters.load(tmp_path / "ck", target.module)
    assert type(module).__module__ == f"{PACKAGE}.head"

    # export: the spec's graph writer, its parity checked, into a bundle next to the target
    export_bundle(target, tmp_path / "bundle", ExportOptions(progress=False, draft_layers=None,
                                                             drafters=(("toy", tmp_path / "ck"),)))
    manifest = Manifest.load(tmp_path / "bundle")
    entry = manifest.drafters["toy"]
    assert entry["graphs"] == ["toy"] and entry["parity_max_abs"]["toy"] < 1e-4, entry

    # generation: the spec's runtime drafter proposes; greedy output is plain greedy output
    accepted = 0
    for prompt in (seqs[0][0][:6].tolist(), prompts[3]):  # a prompt trained on, and a held-out one
        plain = Generator(tmp_path / "bundle", "plain", max_seq_len=64).generate_ids(prompt, 20)
        res = Generator(tmp_path / "bundle", "toy", num_draft_tokens=3, max_seq_len=64).generate_ids(prompt, 20)
        assert res.token_ids == plain.token_ids
        assert res.drafter == "toy" and res.stats.drafted > 0, res.stats
        accepted += res.stats.accepted
    assert accepted > 0  # the trained head's proposals are taken (3 + 1 of 32 here): it is used, not bypassed
