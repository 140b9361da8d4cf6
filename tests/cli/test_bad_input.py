"""Bad input: non-zero exit, one line naming the problem, and no half-written bundle."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import save_tiny_folder

_CLI = "from specrt.cli import main; main()"
# the CLI, reporting on stdout as it exits whether torch was imported by then
_REPORTS_TORCH = "import atexit, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules)); " + _CLI


def specrt(*args, env=None, script=_CLI) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def specrt_before_torch(*args) -> subprocess.CompletedProcess:
    """The CLI, for an error its input's files show: it must come before torch is imported (seconds)."""
    proc = specrt(*args, script=_REPORTS_TORCH)
    assert "torch imported: False" in proc.stdout, (proc.stdout, proc.stderr[-1500:])
    return proc


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("specrt: error:"), proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    for n in needles:
        assert n in lines[-1], lines[-1]


def assert_usage_error(proc, option, *needles):
    """Click's own refusal of an option value: exit 2, its last line `Error: Invalid value for 'OPTION'`."""
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"Error: Invalid value for '{option}'"), last
    for n in needles:
        assert n in last, last


def linked_copy(bundle: Path, dst: Path) -> Path:
    """A copy of `bundle` to change: JSON and tokenizer files copied, the large graph files symlinked."""
    def copy(src, to):
        if src.endswith(".json") or "/tokenizer/" in src:
            shutil.copy2(src, to)
        else:
            os.symlink(src, to)
    shutil.copytree(bundle, dst, copy_function=copy)
    return dst


def edit_manifest(bundle: Path, edit) -> dict:
    d = json.loads((bundle / "manifest.json").read_text())
    edit(d)
    (bundle / "manifest.json").write_text(json.dumps(d))
    return d


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def assert_nothing_written(parent: Path):
    leftovers = [p.name for p in parent.iterdir()] if parent.exists() else []
    assert leftovers == [], f"half-written output left behind: {leftovers}"


def test_missing_model_path(tmp_path):
    out = tmp_path / "out"
    proc = specrt("export", "--model", tmp_path / "nope", "-o", out / "b")
    assert_one_line_error(proc, "nope", "does not exist")
    assert_nothing_written(out)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "m" / "model.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"not a gguf at all" * 100)
    out = tmp_path / "out"
    proc = specrt("export", "--model", bad, "-o", out / "b")
    assert_one_line_error(proc, "model.gguf", "not a GGUF")
    assert_nothing_written(out)


@pytest.mark.parametrize("case", ["missing", "not_gguf", "bad_magic", "no_config", "missing_draft"])
def test_a_model_path_that_is_no_model_is_refused_before_torch_loads(tmp_path, case):
    """`export` checks --model and --draft-model (a folder with config.json, or a file with GGUF's magic) before
    it imports torch and transformers: the error comes at once, not after seconds of loading."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "notes.txt").write_text("weights elsewhere")
    (folder / "model.gguf").write_bytes(b"GGML" + bytes(60))
    good = folder / "ok.gguf"
    good.write_bytes(b"GGUF" + bytes(60))  # passes the path check; refused later if ever loaded
    model, draft, needle = {"missing": (tmp_path / "nope", None, "does not exist"),
                            "not_gguf": (folder / "notes.txt", None, "not a .gguf"),
                            "bad_magic": (folder / "model.gguf", None, "bad magic bytes"),
                            "no_config": (folder, None, "has no config.json"),
                            "missing_draft": (good, tmp_path / "draft", "does not exist")}[case]
    out = tmp_path / "out"
    args = ["export", "--model", model, "-o", out / "b"] + (["--draft-model", draft] if draft else [])
    proc = specrt_before_torch(*args)
    assert_one_line_error(proc, needle, str(draft or model))
    assert_nothing_written(out)


def test_truncated_gguf(tmp_path, default_gguf):
    bad = tmp_path / "m" / "cut.gguf"
    bad.parent.mkdir()
    with default_gguf.open("rb") as f:
        bad.write_bytes(f.read(4096))  # right magic, cut short
    out = tmp_path / "out"
    proc = specrt("export", "--model", bad, "-o", out / "b")
    assert_one_line_error(proc, "cut.gguf")
    assert_nothing_written(out)


def test_vocab_mismatch_is_refused(tmp_path, tokenizer_dir):
    target = save_tiny_folder(tmp_path / "target", "llama", tokenizer_dir, vocab_size=49152)
    # padded embedding rows beyond the tokenizer's ids are normal for one model, not between two
    draft = save_tiny_folder(tmp_path / "draft", "llama", tokenizer_dir, vocab_size=49280)
    out = tmp_path / "out"
    proc = specrt_before_torch("export", "--model", target, "--draft-model", draft, "-o", out / "b", "--no-parity-check")
    assert_one_line_error(proc, "draft vocab 49280", "target vocab 49152", "tokenizer", str(draft))
    assert_nothing_written(out)


def test_the_export_refuses_a_loaded_draft_of_another_vocab_with_the_same_line():
    """A draft whose folder does not show its vocab_size (a .gguf) is refused by the export, once loaded."""
    from types import SimpleNamespace

    from specrt.errors import SpecrtError
    from specrt.export.bundle import check_same_tokenizer

    def loaded(vocab, source):
        return SimpleNamespace(module=SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab)), source=source)

    with pytest.raises(SpecrtError, match=r"draft vocab 49280 != target vocab 49152 \(d.gguf\): .*tokenizer"):
        check_same_tokenizer(loaded(49152, "t.gguf"), loaded(49280, "d.gguf"))


def test_config_vocab_below_the_tokenizer_ids_is_refused(tmp_path, tokenizer_dir):
    folder = save_tiny_folder(tmp_path / "m", "llama", tokenizer_dir, vocab_size=1000)
    out = tmp_path / "out"
    proc = specrt_before_torch("export", "--model", folder, "-o", out / "b", "--draft-layers", "1", "--no-parity-check")
    assert_one_line_error(proc, "49152 tokens", "vocab_size 1000", str(folder / "tokenizer.json"),
                          str(folder / "config.json"))
    assert_nothing_written(out)


def test_broken_chat_template_is_refused_at_export(tmp_path, tokenizer_dir):
    folder = save_tiny_folder(tmp_path / "m", "llama", tokenizer_dir, vocab_size=49152)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # the template in tokenizer_config.json, as older HF
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m }"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    proc = specrt_before_torch("export", "--model", folder, "-o", out / "b", "--draft-layers", "1", "--no-parity-check")
    assert_one_line_error(proc, str(folder / "tokenizer_config.json"), "not a valid Jinja template", "line 1")
    assert_nothing_written(out)


def test_unsupported_family_is_refused(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    proc = specrt_before_torch("export", "--model", folder, "-o", tmp_path / "out" / "b")
    assert_one_line_error(proc, "gpt2", "not supported")


def test_corrupt_onnx_in_bundle(tmp_path, real_bundle):
    """A graph ONNX Runtime cannot read (and no digest recorded that would catch it first)."""
    bundle = tmp_path / "b"
    shutil.copytree(real_bundle, bundle, ignore=shutil.ignore_patterns("*.data"))
    edit_manifest(bundle, lambda d: [g.pop("sha256") for g in d["graphs"].values()])
    (bundle / "target" / "decoder.onnx").write_bytes(b"\x00garbage" * 64)
    proc = specrt("generate", bundle, "--prompt", "hi")
    assert_one_line_error(proc, "decoder.onnx", "export the bundle again")


@pytest.mark.parametrize("content", [b"", b"{garbage", b'{"version": "1.0"}'], ids=["empty", "garbage", "no-model"])
def test_bad_tokenizer_json(tmp_path, real_bundle, content):
    bundle = linked_copy(real_bundle, tmp_path / "b")
    (bundle / "tokenizer" / "tokenizer.json").write_bytes(content)
    proc = specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, str(bundle / "tokenizer" / "tokenizer.json"), "not a valid tokenizer file",
                          "re-export the bundle")


def test_broken_chat_template_in_the_bundle(tmp_path, real_bundle):
    bundle = linked_copy(real_bundle, tmp_path / "b")
    edit_manifest(bundle, lambda d: d["tokenizer"].update(chat_template="{% for m in messages %}{{ m }"))
    proc = specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, str(bundle / "manifest.json"), "tokenizer.chat_template is not a valid Jinja template",
                          "line 1")


def target_config(**values):
    return lambda d: d["graphs"]["target"]["config"].update(values)


@pytest.mark.parametrize("edit, says", [
    (target_config(num_layers="30"), "graphs.target.config.num_layers must be a positive integer, got '30'"),
    (target_config(num_layers=[]), "graphs.target.config.num_layers must be a positive integer, got []"),
    (target_config(num_kv_heads=0), "graphs.target.config.num_kv_heads must be a positive integer, got 0"),
    (target_config(head_dim=65), "graphs.target.config.rope_inv_freq must be head_dim / 2 = 32.5 frequencies"),
    (lambda d: d.update(graphs={}), "graphs must be an object of graphs with a 'target' entry, got {}"),
    (lambda d: d.update(graphs=[]), "graphs must be an object of graphs with a 'target' entry, got []"),
], ids=["num_layers-str", "num_layers-list", "num_kv_heads-0", "head_dim-odd", "graphs-empty", "graphs-list"])
def test_manifest_values_of_the_wrong_type(tmp_path, real_bundle, edit, says):
    bundle = linked_copy(real_bundle, tmp_path / "b")
    edit_manifest(bundle, edit)
    proc = specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, f"{bundle / 'manifest.json'}: {says}", "re-export the bundle")


@pytest.mark.parametrize("key, edit", [
    ("graphs.target.file", lambda d: d["graphs"]["target"].update(file="../outside/decoder.onnx")),
    ("tokenizer.file", lambda d: d["tokenizer"].update(file="/etc/hostname")),
    ("artifacts.onnxruntime.graphs.target.file", lambda d: d["artifacts"].update(
        onnxruntime={"graphs": {"target": {"file": "../outside/decoder.onnx"}}})),
], ids=["graph", "tokenizer", "built-graph"])
def test_manifest_paths_outside_the_bundle_are_refused(tmp_path, real_bundle, key, edit):
    bundle = linked_copy(real_bundle, tmp_path / "b")
    os.symlink(real_bundle / "target", tmp_path / "outside")  # a real graph there: it used to be loaded
    edit_manifest(bundle, edit)
    proc = specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, f"{key} must be a relative path inside the bundle", "re-export the bundle")


def test_flipped_bytes_in_a_bundle_file_are_refused(tmp_path, real_bundle):
    bundle = linked_copy(real_bundle, tmp_path / "b")
    graph = bundle / "target" / "decoder.onnx"
    graph.unlink()
    shutil.copy(real_bundle / "target" / "decoder.onnx", graph)
    flip_byte(graph, graph.stat().st_size // 2)
    expected = json.loads((bundle / "manifest.json").read_text())["graphs"]["target"]["sha256"]["decoder.onnx"]
    proc = specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "2", env={"SPECRT_HOME": tmp_path / "h"})
    assert_one_line_error(proc, str(graph), f"expected {expected}", "re-export or re-copy the bundle")


def test_verify_rehashes_what_the_digest_cache_trusts(tmp_path, real_bundle):
    """A file changed without a new size or mtime passes the cached check; --verify hashes it again."""
    bundle = linked_copy(real_bundle, tmp_path / "b")
    graph = bundle / "draft" / "decoder.onnx"  # plain decoding does not open it; the check covers every file
    graph.unlink()
    shutil.copy2(real_bundle / "draft" / "decoder.onnx", graph)
    env = {"SPECRT_HOME": tmp_path / "h"}
    assert specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "1", env=env).returncode == 0
    st = graph.stat()
    flip_byte(graph, st.st_size // 2)
    os.utime(graph, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = specrt("generate", bundle, "--prompt", "hi", "--max-new-tokens", "1", "--verify", env=env)
    assert_one_line_error(proc, str(graph), "is corrupt or was changed", "re-export or re-copy the bundle")


def test_missing_bundle(tmp_path):
    proc = specrt("generate", tmp_path / "none", "--prompt", "hi")
    assert_one_line_error(proc, "none", "specrt export")


def test_validate_verify_checks_the_files_before_the_graphs(tmp_path, real_bundle):
    bundle = linked_copy(real_bundle, tmp_path / "b")
    graph = bundle / "draft" / "decoder.onnx"
    graph.unlink()
    shutil.copy2(real_bundle / "draft" / "decoder.onnx", graph)
    flip_byte(graph, 100)
    proc = specrt("validate", bundle, "--polygraphy", "--verify", env={"SPECRT_HOME": tmp_path / "h"})
    assert_one_line_error(proc, str(graph), "is corrupt or was changed", "re-export or re-copy the bundle")


def test_max_seq_len_beyond_the_model_maximum(real_bundle):
    proc = specrt("generate", real_bundle, "--prompt", "hi", "--max-seq-len", "16384")
    assert_one_line_error(proc, "--max-seq-len 16384", "max_position_embeddings 8192", "--max-seq-len 8192 or less")


@pytest.mark.parametrize("option, value, says", [
    ("--temperature", "nan", "nan is not a finite number"),
    ("--temperature", "inf", "inf is not a finite number"),
    ("--top-p", "nan", "nan is not a finite number"),
    ("--seed", "-1", "-1 is not in the range x>=0"),
])
def test_sampling_values_that_would_sample_garbage(real_bundle, option, value, says):
    sampled = [] if option == "--temperature" else ["--temperature", "1"]
    proc = specrt("generate", real_bundle, "--prompt", "hi", "--max-new-tokens", "8", *sampled, option, value)
    assert_usage_error(proc, option, says)


@pytest.mark.parametrize("option", ["--tree", "--prompt"])
def test_arguments_that_are_not_utf8(real_bundle, option):
    args = {"--prompt": "hi", "--tree": "chain", option: os.fsdecode(b"\xff\xfe")}
    proc = specrt("generate", real_bundle, "--max-new-tokens", "2", *[x for kv in args.items() for x in kv])
    assert_usage_error(proc, option, "is not valid UTF-8")


def test_tree_file_that_is_not_utf8(tmp_path, real_bundle):
    tree = tmp_path / "tree.json"
    tree.write_bytes(b"\xff\xfe[[0], [1]]")
    proc = specrt("generate", real_bundle, "--prompt", "hi", "--max-new-tokens", "2", "--tree", tree)
    assert_one_line_error(proc, str(tree), "not UTF-8 text", "[[0], [1], [0, 0]]")


def test_prompt_longer_than_capacity(real_bundle):
    proc = specrt("generate", real_bundle, "--prompt", "word " * 200, "--max-seq-len", "64")
    assert_one_line_error(proc, "KV capacity is 64", "--max-seq-len")


def test_unknown_drafter(real_bundle):
    proc = specrt("generate", real_bundle, "--prompt", "hi", "--drafter", "medusa2")
    assert_one_line_error(proc, "medusa2", "plain")


def test_bad_prompts_file(tmp_path, real_bundle):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{not json}\n')
    proc = specrt("bench", real_bundle, "--prompts", f, "--drafters", "plain", "--max-new-tokens", "2")
    assert_one_line_error(proc, "p.jsonl:2")


def test_build_trt_without_tensorrt_says_what_to_install(real_bundle):
    from specrt.engines.trt.build import tensorrt_available

    if tensorrt_available():  # pragma: no cover - only where TensorRT exists
        pytest.skip("TensorRT is installed here; this test covers machines without it")
    proc = specrt("build", real_bundle, "--backend", "trt")
    assert_one_line_error(proc, "TensorRT is not installed", "pip install tensorrt")


def test_export_with_an_untrained_drafter_says_how_to_train_it(tmp_path):
    folder = save_tiny_folder(tmp_path / "m", "llama", None)
    out = tmp_path / "out"
    proc = specrt("export", "--model", folder, "-o", out / "b", "--drafter", "eagle",
                  env={"SPECRT_HOME": str(tmp_path / "home")})
    assert_one_line_error(proc, "no trained eagle drafter", "specrt train eagle")
    assert_nothing_written(out)


def test_export_drafter_weights_that_are_not_a_checkpoint(tmp_path):
    folder = save_tiny_folder(tmp_path / "m", "llama", None)
    (tmp_path / "ck").mkdir()
    out = tmp_path / "out"
    proc = specrt("export", "--model", folder, "-o", out / "b", "--drafter", "medusa", "--drafter-weights",
                  tmp_path / "ck")
    assert_one_line_error(proc, "ck", "config.json")
    assert_nothing_written(out)


def tiny_medusa_checkpoint(folder: Path, target: Path) -> Path:
    """A specrt Medusa checkpoint for the model at `target` whose model.safetensors is really a pickle."""
    from transformers import AutoConfig

    from specrt.export.loading import decoder_config

    folder.mkdir()
    meta = {"kind": "medusa", "num_heads": 2, "num_layers": 1, "own_heads": False,
            "decoder": decoder_config(AutoConfig.from_pretrained(target)).to_dict()}
    (folder / "config.json").write_text(json.dumps(meta))
    (folder / "model.safetensors").write_bytes(pickle.dumps({"heads.0.weight": [0.0] * 8}))
    return folder


def test_drafter_weights_that_are_a_pickle_named_safetensors(tmp_path, tokenizer_dir):
    folder = save_tiny_folder(tmp_path / "m", "llama", tokenizer_dir, vocab_size=49152)
    ck = tiny_medusa_checkpoint(tmp_path / "ck", folder)
    out = tmp_path / "out"
    proc = specrt("export", "--model", folder, "-o", out / "b", "--drafter", "medusa", "--drafter-weights", ck,
                  "--no-parity-check")
    assert_one_line_error(proc, str(ck / "model.safetensors"), "not a safetensors file", "pickle")
    assert_nothing_written(out)


def test_export_drafter_kind_equals_folder_reads_that_folder(tmp_path, tokenizer_dir):
    folder = save_tiny_folder(tmp_path / "m", "llama", tokenizer_dir, vocab_size=49152)
    ck = tiny_medusa_checkpoint(tmp_path / "ck", folder)
    out = tmp_path / "out"
    proc = specrt("export", "--model", folder, "-o", out / "b", "--drafter", f"medusa={ck}", "--no-parity-check")
    assert_one_line_error(proc, str(ck / "model.safetensors"), "not a safetensors file")  # KIND=FOLDER was read
    assert_nothing_written(out)
    assert_usage_error(specrt("export", "--model", folder, "-o", out / "b", "--drafter", "bogus=x"), "--drafter",
                       "'bogus' is not a learned drafter kind", "eagle3")
    assert_usage_error(specrt("export", "--model", folder, "-o", out / "b", "--drafter", f"medusa={tmp_path / 'no'}"),
                       "--drafter", "is not a checkpoint folder")


def test_model_weights_that_are_a_pickle_named_safetensors(tmp_path, tokenizer_dir):
    folder = save_tiny_folder(tmp_path / "m", "llama", tokenizer_dir, vocab_size=49152)
    (folder / "model.safetensors").write_bytes(pickle.dumps({"model.embed_tokens.weight": [0.0] * 8}))
    out = tmp_path / "out"
    proc = specrt_before_torch("export", "--model", folder, "-o", out / "b", "--no-parity-check")
    assert_one_line_error(proc, str(folder / "model.safetensors"), "not a safetensors file", "pickle")
    assert_nothing_written(out)


def test_train_rejects_a_malformed_setting(tmp_path):
    proc = specrt("train", "medusa", "--set", "num_heads", "--target", tmp_path / "none")
    assert_one_line_error(proc, "--set", "KEY=VALUE")


def test_a_tree_file_holding_no_paths_is_refused(tmp_path, tiny_bundle):
    """`--tree empty.json` holding [] compiled to the root alone: plain decoding, silently."""
    tree = tmp_path / "empty.json"
    tree.write_text("[]")
    proc = specrt("generate", tiny_bundle, "--prompt", "hi", "--max-new-tokens", "2", "--drafter", "draft",
                  "--tree", tree)
    assert_one_line_error(proc, str(tree), "the tree is empty", "--drafter plain", "omit --tree")


@pytest.mark.parametrize("drafter", ["plain", "draft"])
def test_tiny_temperatures_sample_the_argmax_not_token_0(tiny_bundle, drafter):
    """--temperature 1e-300 passed validation, then logits / float32(T) was inf - inf = nan: token 0 every
    step, reported lossless. The limit of sampling as T -> 0 is the argmax: greedy's tokens."""
    from click.testing import CliRunner

    from specrt.cli import cli

    def token_ids(temperature: str) -> list[int]:
        r = CliRunner().invoke(cli, ["generate", str(tiny_bundle), "--prompt", "Name three colours.", "--json",
                                     "--max-new-tokens", "12", "--max-seq-len", "64", "--drafter", drafter,
                                     "--temperature", temperature, "--seed", "3"])
        assert r.exit_code == 0, (r.output, r.exception)
        out = json.loads(r.stdout.splitlines()[-1])
        assert out["lossless"] is True
        return out["token_ids"]

    greedy = token_ids("0")
    assert len(set(greedy)) > 1  # a real sequence, not one token repeated
    assert token_ids("1e-300") == greedy
    assert token_ids("1e-38") == greedy
    assert token_ids("1e-42") == greedy  # overflows even the tiny model's logits (|logit| < 3.4) in float32


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bundle_path_that_is_a_file_is_named_as_a_file(tmp_path, command):
    """`specrt generate README.md` once said the file "does not exist" and advised exporting over it."""
    path = tmp_path / "README.md"
    path.write_text("# not a bundle\n")
    proc = specrt(command, path, *(["--prompt", "hi"] if command == "generate" else []))
    assert_one_line_error(proc, "README.md is a file, not a bundle folder", "manifest.json")
    assert "specrt export -o" not in proc.stderr and path.read_text() == "# not a bundle\n"
