"""Write a bundle: target (and draft) decoder graphs, tokenizer files and manifest.json.

Everything is written into a temporary sibling folder and renamed into place at the end, so a
failed export never leaves a half-written bundle behind.
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from tqdm import tqdm

from specrt import __version__
from specrt.errors import SpecrtError
from specrt.export import drafters, quantize
from specrt.export.decoder_graph import build_decoder_graph
from specrt.export.drafter_export import export_drafter
from specrt.export.loading import LoadedModel, load_model
from specrt.export.modeling import DecoderLM
from specrt.export.partials import remove_stale_partials
from specrt.export.reference_io import save_references
from specrt.export.safetensors_file import check_folder
from specrt.export.source_checks import check_same_vocab
from specrt.plugins.onnx_builder import OPSET
from specrt.runtime.exactness import measured_here, store_in_manifest
from specrt.schema.digests import file_digests
from specrt.schema.manifest import GraphEntry, Manifest

PARITY_TOLERANCE = 1e-3  # max |Δlogits|, fp32, ONNX Runtime vs the torch module
DEFAULT_DRAFT_LAYERS = 4  # the default draft: the target's first 4 layers (fewer when it has fewer than 5)


@dataclass
class ExportOptions:
    # layer-truncated copy of the target as the draft: N layers (0 / None: none), or "default" (draft_layer_count)
    draft_layers: int | str | None = "default"
    draft_model: Path | None = None  # or any HF folder / GGUF sharing the target's tokenizer
    check_parity: bool = True
    progress: bool = True
    drafters: tuple = ()  # learned drafters: (kind, checkpoint folder or None for the trained default)
    quantize: str | None = None  # "int4" / "int8": weight-only MatMulNBits for every graph (export/quantize.py)
    threads: int = 2  # ONNX Runtime threads the batch-invariance measurement runs with (the runtime default)
    # int4 from a GGUF: carry its Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks as they are (export/gguf_blocks.py); True quantizes
    # the dequantized weights again (fitted int4 blocks of 32, export/int4_fit.py: lossier)
    requantize: bool = False
    int4_head: bool = False  # ... but quantize the LM head again (int4: less to stream per pass, lossier)
    # the learned drafters' graphs (eagle, eagle3, medusa, mtp, block): None quantizes them as `quantize` does
    drafter_quantize: str | None = None


def draft_layer_count(requested: int | str | None, target_layers: int) -> int:
    """Layers of the truncated draft for `--draft-layers`: "default" is DEFAULT_DRAFT_LAYERS, fewer on a
    target with fewer than 5 layers (none on a 1-layer one); an explicit count must leave the draft
    smaller than the target; 0 / None: no truncated draft."""
    if requested == "default":
        return min(DEFAULT_DRAFT_LAYERS, target_layers - 1)
    if requested and not 1 <= requested < target_layers:
        allowed = f"0 to {target_layers - 1}" if target_layers > 1 else "only 0"
        raise SpecrtError(f"--draft-layers {requested}: the target has {target_layers} layer"
                          f"{'s' if target_layers != 1 else ''}, so choose {allowed} "
                          "(N: a draft of its first N layers; 0: no layer-truncated draft)")
    return requested or 0


def truncated_draft(module: DecoderLM, num_layers: int) -> DecoderLM:
    """First `num_layers` decoder layers of the target, plus its final norm and LM head."""
    if draft_layer_count(num_layers, module.cfg.num_layers) == 0:  # a count out of range is refused there
        raise SpecrtError("a layer-truncated draft keeps at least 1 layer (--draft-layers 0: no such draft)")
    draft = DecoderLM(module.cfg.truncated(num_layers))
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in module.state_dict().items() if k in own}, strict=True)
    return draft.eval()


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    check_same_vocab(target.module.cfg.vocab_size, draft.module.cfg.vocab_size, draft.source)
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise SpecrtError(f"draft tokenizer of {draft.source} differs from the target's: "
                          "the drafter must share the target's tokenizer")


def _save_graph(module: DecoderLM, folder: Path, role: str, source: str, progress: bool,
                taps: tuple[int, ...] = ()) -> GraphEntry:
    folder.mkdir(parents=True)
    with tqdm(total=module.cfg.num_layers, desc=f"export {role}", unit="layer", disable=not progress) as bar:
        model = build_decoder_graph(module, name=role, progress=bar.update, taps=taps)
    path = folder / "decoder.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="decoder.onnx.data", size_threshold=1024)
    files = [path, folder / "decoder.onnx.data"]
    return GraphEntry(role=role, file=f"{folder.name}/decoder.onnx", config=module.cfg,
                      inputs=[i.name for i in model.graph.input], outputs=[o.name for o in model.graph.output],
                      opset=OPSET, source=source, sha256=file_digests(*files))


def parity(module: DecoderLM, onnx_path: Path, prompt_len: int = 10, window: int = 6) -> dict:
    """Max |Δlogits| between ONNX Runtime and the torch module for prefill, decode and a verify window."""
    from specrt.engines.ort_cpu.runner import OrtDecoder

    cfg = module.cfg
    capacity = prompt_len + window + 2
    ort_model = OrtDecoder(onnx_path, cfg, capacity, threads=os.cpu_count() or 1)
    kv = module.new_kv(1, capacity)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len + 1 + window), generator=torch.Generator().manual_seed(0))
    report = {}
    for name, start, end in (("prefill", 0, prompt_len), ("decode", prompt_len, prompt_len + 1),
                             ("verify", prompt_len + 1, prompt_len + 1 + window)):
        t = end - start
        chunk, pos = ids[:, start:end], torch.arange(start, end)[None]
        mask, past = torch.tril(torch.ones(t, t, dtype=torch.bool))[None], torch.tensor([start])
        want, _ = module(chunk, pos, past, mask, kv)
        got, _ = ort_model.run(chunk.numpy(), pos.numpy(), past.numpy(), mask.numpy(), np.arange(t)[None])
        report[name] = float(np.abs(got - want.numpy()).max())
    return report


@contextmanager
def atomic_dir(out: Path, note=None):
    """Yield a temporary sibling folder; on success it replaces `out`, on failure it is removed. Partial
    folders that killed exports left in the same parent are removed first (`note` says so: default stderr)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out.parent, note or _to_stderr)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.replace(old)
            tmp.replace(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _to_stderr(text: str) -> None:
    tqdm.write(text, file=sys.stderr)  # between progress bars, not through them


def _save_tokenizer(target: LoadedModel, folder: Path) -> dict:
    tok = target.tokenizer
    tok.save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        raise SpecrtError(f"the tokenizer of {target.source} has no fast (tokenizer.json) form; specrt needs one")
    return {"file": f"{folder.name}/tokenizer.json", "chat_template": tok.chat_template or "",
            "bos_token": tok.bos_token, "eos_token": tok.eos_token}


def _versions() -> dict:
    import onnxruntime
    import transformers

    return {"specrt": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__}


DECODER_ROLES = ("target", "draft")  # the decoder graphs among a bundle's (the others: learned drafters')


def quantize_graphs(folder: Path, graphs: dict[str, GraphEntry], name: str, blocks: dict | None = None,
                    drafters: str | None = None) -> dict:
    """Quantize every graph in place (after the fp32 parity check); returns the manifest record. `blocks`:
    per role, the model file's own blocks by weight name, carried as they are (the others are quantized); a
    learned drafter's head made of the target's LM-head rows carries those rows' blocks (quantize.rows_of).
    `drafters`: the learned drafters' scheme, when it is not `name`'s."""
    from specrt.export.gguf_blocks import HEAD_WEIGHTS

    record = {**quantize.describe(name), "matmuls": {}}
    if drafters and drafters != name:
        record["drafters"] = quantize.describe(drafters)
    blocks = blocks or {}
    head = next((blocks["target"][w] for w in HEAD_WEIGHTS if w in blocks.get("target", {})), None)
    rows = quantize.HeadRows(head) if head is not None else None  # indexed once for every drafter graph
    for role, entry in graphs.items():
        learned = role not in DECODER_ROLES
        s = quantize.scheme(drafters or name if learned else name)
        path = folder / entry.file
        # fitted int4 for the decoders (target, draft model); learned drafters' graphs keep ONNX Runtime's
        # symmetric rounding until their acceptance is measured with the fit (a briefly trained EAGLE-3 head's
        # drafts stopped being accepted with it)
        own = blocks.get(role) or {}
        record["matmuls"][role], carried = quantize.quantize_file(path, s, own, fit=not learned,
                                                                  head=rows if learned else None, learned=learned)
        entry.sha256 = file_digests(path, path.with_name(path.name + ".data"))
        if carried:  # what the graph really carries (a truncated draft: only its layers')
            record.setdefault("from_model_file", {})[role] = {
                "weights": len(carried), "formats": sorted({own.get(w, head).format for w in carried})}
    return record


def carries_file_blocks(source: Path, opts: ExportOptions) -> bool:
    """Does this export carry the model file's own blocks: int4 of a GGUF, not --requantize?"""
    return opts.quantize == "int4" and not opts.requantize and source.suffix.lower() == ".gguf"


def model_file_blocks(target: LoadedModel, opts: ExportOptions, draft_is_copy: bool) -> dict:
    """Per role, the GGUF's own blocks by graph weight name, when int4 is asked of a GGUF target (and not
    --requantize): the target's, and the truncated draft's (the target's first layers, under the same names)."""
    source = Path(target.source)
    if not carries_file_blocks(source, opts):
        return {}
    from specrt.export.gguf_blocks import HEAD_WEIGHTS, projection_blocks

    blocks = projection_blocks(source, target.module.cfg)
    if opts.int4_head:
        blocks = {name: b for name, b in blocks.items() if name not in HEAD_WEIGHTS}
    if not blocks:
        return {}
    return {"target": blocks, **({"draft": blocks} if draft_is_copy else {})}


def resolve_drafters(requested) -> list[tuple[str, Path]]:
    """(kind, checkpoint folder) per requested drafter, checked before any weight is loaded: each from
    its given folder, or from where `specrt train KIND` saves it."""
    from specrt.export.drafters import public
    from specrt.paths import drafter_dir

    out = []
    for kind, path in requested:
        drafters.kind_spec(kind)
        folder = Path(path) if path else drafter_dir(kind)
        if not folder.exists():
            raise SpecrtError(f"no trained {kind} drafter at {folder}: run `specrt train {kind}` first, "
                              f"or pass --drafter-weights PATH (a specrt or public {kind} checkpoint)")
        if not folder.is_dir():
            raise SpecrtError(f"--drafter-weights {folder} is a file: pass the checkpoint folder that holds it "
                              "(with its config.json)")
        check_folder(folder, "convert it to safetensors in a trusted environment, or pass the folder "
                             f"`specrt train {kind}` wrote")
        if not (folder / drafters.CONFIG).is_file() and public.detect(folder) is None:
            raise SpecrtError(f"{folder} holds no drafter checkpoint (no config.json, no public "
                              f"{public.layouts_described()} layout): pass the folder `specrt train {kind}` wrote, "
                              "or a public checkpoint")
        out.append((kind, folder))
    return out


def load_drafters(target: LoadedModel, folders: list[tuple[str, Path]]) -> dict:
    return {kind: (drafters.load(folder, target.module), str(folder)) for kind, folder in folders}


def export_bundle(model: Path | LoadedModel, out: Path, opts: ExportOptions | None = None) -> Manifest:
    """Export `model` (a path, or an already loaded model) and its draft into the bundle folder `out`."""
    from specrt.export.gguf_once import gguf_parsed_once

    with gguf_parsed_once():  # a .gguf's header parsed once for its load, its types' check and its blocks' read
        return _export_bundle(model, out, opts or ExportOptions())


def _export_bundle(model: Path | LoadedModel, out: Path, opts: ExportOptions) -> Manifest:
    out = Path(out).resolve()
    folders = resolve_drafters(opts.drafters)
    if opts.quantize:
        quantize.scheme(opts.quantize)  # a bad name fails before any weight is loaded
    source = Path(model.source if isinstance(model, LoadedModel) else model)
    if carries_file_blocks(source, opts):
        from specrt.export.gguf_blocks import refuse_requantizing

        refuse_requantizing(source)  # int4 of a GGUF is its own blocks, or a refusal that names what is not
    with tqdm(total=5, desc="specrt export", unit="step", disable=not opts.progress) as steps:
        steps.set_postfix_str("loading weights")
        target = model if isinstance(model, LoadedModel) else load_model(model, keep_hf=False)
        learned = load_drafters(target, folders)
        draft_module, draft_source, draft_is_copy = None, "", False
        roles = {k: drafters.kind_spec(k).bundle_role for k in learned}
        role_kind = next((k for k, role in roles.items() if role == "draft"), None)
        if role_kind:  # a kind that fills the draft role (the fine-tuned truncated draft) replaces the plain copy
            draft_module, draft_source = learned[role_kind][0].lm, learned.pop(role_kind)[1]
        elif opts.draft_model is not None:
            draft = load_model(opts.draft_model, keep_hf=False)
            check_same_tokenizer(target, draft)
            draft_module, draft_source = draft.module, str(opts.draft_model)
        elif layers := draft_layer_count(opts.draft_layers, target.module.cfg.num_layers):
            draft_module, draft_is_copy = truncated_draft(target.module, layers), True
            draft_source = f"{target.source} (first {layers} of {target.module.cfg.num_layers} layers)"
        steps.update()

        with atomic_dir(out) as tmp:
            steps.set_postfix_str("writing graphs")
            # target layers a drafter reads besides the last (EAGLE-3's taps): extra target outputs
            taps = next((tuple(m.cfg.taps) for m, _ in learned.values() if getattr(m.cfg, "taps", None)), ())
            graphs = {"target": _save_graph(target.module, tmp / "target", "target", target.source, opts.progress,
                                            taps)}
            if draft_module is not None:
                graphs["draft"] = _save_graph(draft_module, tmp / "draft", "draft", draft_source, opts.progress)
            drafter_entries = {}
            for kind, (module, source) in learned.items():
                new, drafter_entries[kind] = export_drafter(module, tmp, target.module.cfg, source, opts.check_parity)
                graphs.update(new)
            steps.update()

            steps.set_postfix_str("tokenizer")
            tokenizer = _save_tokenizer(target, tmp / "tokenizer")
            steps.update()

            steps.set_postfix_str("parity check")
            checks = {}
            if opts.check_parity:
                modules = {"target": target.module, "draft": draft_module}
                for role, entry in graphs.items():
                    if role not in modules:
                        continue  # learned drafters were checked as they were written
                    checks[role] = parity(modules[role], tmp / entry.file)
                    worst = max(checks[role].values())
                    if worst > PARITY_TOLERANCE:
                        raise SpecrtError(f"{role} graph parity failed: max |Δlogits| {worst:.2e} > "
                                          f"{PARITY_TOLERANCE} ({checks[role]}); please report this model")
            steps.update()
            artifacts = {"parity_max_abs_logits": checks}
            if opts.check_parity:  # the fp32 modules' reference I/O, for `specrt validate --polygraphy`
                artifacts["reference_io"] = save_references(modules, graphs, tmp, taps)
            if opts.quantize:
                steps.set_postfix_str(f"quantizing ({opts.quantize})")
                blocks = model_file_blocks(target, opts, draft_is_copy)
                artifacts["quantization"] = quantize_graphs(tmp, graphs, opts.quantize, blocks, opts.drafter_quantize)
            steps.update()
            manifest = Manifest(graphs=graphs, tokenizer=tokenizer, versions=_versions(),
                                artifacts=artifacts, drafters=drafter_entries)
            steps.set_postfix_str("batch invariance on this machine")
            # measured here for the machine that exported; other machines measure at build or load
            store_in_manifest(manifest, measured_here(tmp, manifest, opts.threads, "ort"))
            manifest.save(tmp)
    return manifest
