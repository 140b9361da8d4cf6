"""The openvino peer family (tools/peers_openvino.py, tools/openvino_models.py, mk/openvino.mk):

- without its venv, the family is refused with `make setup-peers`; its modules import no heavy package
  at module level (specrt's venv imports them, and the openvino venv has no onnxruntime);
- the int4 export's command line spells out every option, matched to onnxruntime-genai's int4 build,
  and each conversion records them, lands atomically and happens once;
- the draft's HF folder is the target's first N layers, as transformers loads it;
- a run feeds ids, keeps the first EOS and cuts there; its lookup / draft values are the other peers';
- on the real converted model (where `make setup-peers` built it): the three engines decode greedily,
  and in exact mode lookup and draft reproduce plain decoding token for token.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specrt.errors import SpecrtError
from specrt.tools import openvino_models, peers_openvino
from specrt.tools.openvino_models import (
    OPENVINO_OPTIONS,
    RECORD,
    convert_all,
    draft_dir,
    export_command,
    is_converted,
    target_dir,
    truncated_hf_folder,
)
from specrt.tools.peers_openvino import device_properties, model_folders, openvino_python
from tests.helpers import save_tiny_folder

ENGINES = ["openvino-plain", "openvino-lookup", "openvino-draft"]


def fake_manifest(source, draft_layers: int | None = 2, eos=(2,)) -> SimpleNamespace:
    graphs = {} if draft_layers is None else {"draft": SimpleNamespace(
        source=f"{source} (first {draft_layers} of 3 layers)", config=SimpleNamespace(num_layers=draft_layers))}
    return SimpleNamespace(target=SimpleNamespace(source=str(source), config=SimpleNamespace(
        eos_token_ids=eos, max_position_embeddings=64)), graphs=graphs)


# ---- the venv ----------------------------------------------------------------------------------------

def test_without_its_venv_the_family_names_make_setup_peers(tmp_path, monkeypatch):
    from specrt.tools.peers import make_peers

    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    venv = tmp_path / "peers" / "venvs" / "openvino"
    with pytest.raises(SpecrtError, match="make setup-peers") as e:
        openvino_python()
    assert f"own venv {venv}, which is not built" in str(e.value)
    with pytest.raises(SpecrtError, match="make setup-peers"):  # refused before any worker starts
        make_peers("openvino", fake_manifest(tmp_path / "Tiny.gguf"), 1)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(SpecrtError, match="not built"):  # no stamp: the install did not finish
        openvino_python()
    (venv / ".installed").write_text("")
    assert openvino_python() == str(venv / "bin" / "python")


def test_its_modules_import_no_heavy_package():
    """The worker imports them in the openvino venv (no onnxruntime there), specrt's venv through peers.py."""
    code = ("import sys\n"
            "for m in ('numpy', 'torch', 'onnxruntime', 'openvino', 'openvino_genai', 'transformers', "
            "'safetensors', 'specrt.runtime'):\n"
            "    sys.modules[m] = None\n"
            "import specrt.tools.peers_openvino as p, specrt.tools.openvino_models as m\n"
            "print(p.device_properties(3)['INFERENCE_NUM_THREADS'], m.target_dir('x').name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "x-int4"]


def test_lookup_and_draft_values_are_the_other_peers():
    from specrt.export.bundle import DEFAULT_DRAFT_LAYERS
    from specrt.runtime.generate import Generator
    from specrt.tools.peers import ORTGENAI_NGRAM, PROMPT_LOOKUP_TOKENS

    assert peers_openvino.LOOKUP_TOKENS == PROMPT_LOOKUP_TOKENS
    assert peers_openvino.LOOKUP_NGRAM == ORTGENAI_NGRAM
    assert peers_openvino.DRAFT_TOKENS == inspect.signature(Generator).parameters["num_draft_tokens"].default
    assert openvino_models.DRAFT_LAYERS == DEFAULT_DRAFT_LAYERS


def test_device_properties_set_threads_paged_attention_and_exact_precision():
    assert device_properties(2) == {"INFERENCE_NUM_THREADS": 2, "ATTENTION_BACKEND": "PA"}
    exact = device_properties(4, exact=True)
    assert exact["INFERENCE_PRECISION_HINT"] == "f32" and exact["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0
    assert exact["KV_CACHE_PRECISION"] == "f32"
    assert exact["INFERENCE_NUM_THREADS"] == 4


# ---- the conversions -----------------------------------------------------------------------------------

def test_the_export_command_spells_out_every_int4_option():
    from specrt.tools.peer_models import ORTGENAI_OPTIONS

    cmd = export_command(Path("/hf"), Path("/out"), cli="optimum-cli")
    assert cmd[:5] == ["optimum-cli", "export", "openvino", "--model", "/hf"] and cmd[-1] == "/out"
    flags = " ".join(cmd[5:-1])
    assert flags == "--task text-generation-with-past --weight-format int4 --group-size 32 --ratio 1.0 --sym --all-layers"
    # comparable with onnxruntime-genai's int4 build: its block size, symmetric, every MatMul int4
    assert OPENVINO_OPTIONS["group_size"] == ORTGENAI_OPTIONS["block_size"] and ORTGENAI_OPTIONS["precision"] == "int4"
    assert "--sym" not in export_command(Path("/hf"), Path("/o"), {**OPENVINO_OPTIONS, "sym": False}, cli="x")


@pytest.fixture
def hf_folder(tmp_path):
    folder = save_tiny_folder(tmp_path / "Tiny-3L", "llama", None, num_hidden_layers=3)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def fake_export(monkeypatch):
    """optimum-cli stubbed: it writes an IR file (or fails for a model named fail-*), remembering each call
    and the config it read."""
    calls = []

    def run(cmd, stdout, stderr):
        model, out = Path(cmd[cmd.index("--model") + 1]), Path(cmd[-1])
        calls.append((cmd, json.loads((model / "config.json").read_text())))
        if model.name.startswith("fail"):
            stdout.write("nncf: out of cheese\n")
            return SimpleNamespace(returncode=3)
        out.mkdir(parents=True)
        (out / "openvino_model.xml").write_text("<net/>")
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(openvino_models.subprocess, "run", run)
    return calls


def test_conversions_record_their_options_land_atomically_and_happen_once(tmp_path, monkeypatch, hf_folder,
                                                                          fake_export):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))
    target, draft = convert_all(hf_folder, draft_layers=2, log=lambda m: None)
    assert (target, draft) == (target_dir("Tiny-3L"), draft_dir("Tiny-3L", 2))
    assert target == tmp_path / "home" / "peers" / "openvino" / "Tiny-3L-int4"
    assert draft.name == "Tiny-3L-first2-int4" and is_converted(target) and is_converted(draft)
    assert [cfg["num_hidden_layers"] for _, cfg in fake_export] == [3, 2]  # the draft export read a 2-layer config
    assert fake_export[0][0][fake_export[0][0].index("--model") + 1] == str(hf_folder)
    for folder in (target, draft):
        record = json.loads((folder / RECORD).read_text())
        assert record["options"] == OPENVINO_OPTIONS and record["hf"] == str(hf_folder)
        assert record["command"] == export_command(Path("HF"), Path("OUT"), cli="optimum-cli")
        assert set(record["versions"]) >= {"openvino", "openvino-genai", "optimum-intel", "nncf"}
    assert json.loads((draft / RECORD).read_text())["draft"] == {"layers": 2, "of": 3, "num_hidden_layers": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == [draft.name, target.name]  # no temporary left
    convert_all(hf_folder, draft_layers=2, log=lambda m: None)
    assert len(fake_export) == 2  # both there: nothing converted again
    convert_all(hf_folder, draft_layers=1, log=lambda m: None)
    assert len(fake_export) == 3 and is_converted(draft_dir("Tiny-3L", 1))  # another draft size: only it


def test_a_failed_conversion_leaves_nothing_and_quotes_the_exporter(tmp_path, monkeypatch, hf_folder, fake_export):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))
    failing = hf_folder.rename(tmp_path / "fail-3L")
    with pytest.raises(SpecrtError, match="failed \\(exit 3\\)") as e:
        convert_all(failing, draft_layers=2, log=lambda m: None)
    assert "out of cheese" in str(e.value)
    assert list((tmp_path / "home" / "peers" / "openvino").iterdir()) == []
    with pytest.raises(SpecrtError, match="not an HF model folder"):
        convert_all(tmp_path / "nowhere", log=lambda m: None)


def test_the_draft_folder_is_the_targets_first_layers(tmp_path, hf_folder):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "draft"
    cfg = truncated_hf_folder(hf_folder, out, 2)
    assert cfg["num_hidden_layers"] == 2 == json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert (out / "tokenizer.json").is_file()
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
    assert not any(".layers.2." in k for k in keys) and any(".layers.1." in k for k in keys)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys

    target = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert len(draft.model.layers) == 2
    # the same function as the target cut after its second layer (its final norm and head on top)
    target.model.layers = target.model.layers[:2]
    target.config.num_hidden_layers = 2
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, target(ids).logits)
    for bad in (0, 3):
        with pytest.raises(SpecrtError, match="choose 1 to 2 layers"):
            truncated_hf_folder(hf_folder, tmp_path / f"bad{bad}", bad)


def test_gemma3_layer_types_are_cut_with_the_layers(tmp_path):
    hf = save_tiny_folder(tmp_path / "g3", "gemma3_text", None, num_hidden_layers=2,
                          layer_types=["sliding_attention", "full_attention"])
    assert truncated_hf_folder(hf, tmp_path / "d", 1)["layer_types"] == ["sliding_attention"]


def test_unconverted_models_are_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    manifest = fake_manifest(tmp_path / "models" / "Tiny-1M.Q4_0.gguf", draft_layers=3)
    with pytest.raises(SpecrtError, match="make setup-peers") as e:
        model_folders(manifest)
    assert "Tiny-1M.Q4_0-int4 is not converted" in str(e.value) and "OPENVINO_DRAFT_LAYERS=3" in str(e.value)
    target, draft = target_dir("Tiny-1M.Q4_0"), draft_dir("Tiny-1M.Q4_0", 3)
    for folder in (target, draft):
        folder.mkdir(parents=True)
        (folder / "openvino_model.xml").write_text("")
    with pytest.raises(SpecrtError, match="not converted"):  # no record: an incomplete conversion
        model_folders(manifest)
    for folder in (target, draft):
        (folder / RECORD).write_text("{}")
    assert model_folders(manifest) == (target, draft)
    no_draft = fake_manifest(manifest.target.source, None)  # OpenVINO's draft: export's default truncation
    with pytest.raises(SpecrtError, match="first4-int4 is not converted"):
        model_folders(no_draft)
    default = draft_dir("Tiny-1M.Q4_0", 4)
    default.mkdir()
    for name in ("openvino_model.xml", RECORD):
        (default / name).write_text("{}")
    assert model_folders(no_draft) == (target, default)


# ---- one run ---------------------------------------------------------------------------------------------

class FakeConfig(SimpleNamespace):
    """openvino_genai.GenerationConfig's stand-in: takes whatever the runner sets."""


def test_a_run_feeds_ids_keeps_the_first_eos_and_cuts_there():
    seen = []

    class Pipe:
        def __init__(self, tokens):
            self.tokens = tokens

        def generate(self, inputs, cfg):
            seen.append((inputs, cfg))
            return SimpleNamespace(tokens=[self.tokens])

    ov = SimpleNamespace(Tensor=lambda a: a)
    ov_genai = SimpleNamespace(GenerationConfig=FakeConfig,
                               TokenizedInputs=lambda ids, mask: SimpleNamespace(input_ids=ids, attention_mask=mask))
    # a verify pass may return tokens past the EOS: they are dropped, the EOS kept
    run = peers_openvino._runner(Pipe([7, 8, 2, 9, 10]), ov, ov_genai, np, [2, 5], num_assistant_tokens=10)
    out, seconds = run([1, 2, 3], 16)
    assert out == [7, 8, 2] and seconds >= 0
    inputs, cfg = seen[-1]
    assert inputs.input_ids.dtype == np.int64 and inputs.input_ids.tolist() == [[1, 2, 3]]
    assert inputs.attention_mask.tolist() == [[1, 1, 1]]
    assert cfg.max_new_tokens == 16 and cfg.do_sample is False and cfg.num_beams == 1
    assert cfg.eos_token_id == 2 and cfg.stop_token_ids == {2, 5} and cfg.ignore_eos is False
    assert cfg.num_assistant_tokens == 10 and cfg.apply_chat_template is False
    assert peers_openvino._runner(Pipe([7, 8, 9, 10]), ov, ov_genai, np, [2])([1], 3)[0] == [7, 8, 9]


# ---- the real converted model --------------------------------------------------------------------------

PROMPTS = (("What is the capital of France? Answer in one word.", 32),
           ("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat", 32))


def openvino_ready(request) -> str | None:
    """Why the real test cannot run here (None: it can); the venv is looked for before the model."""
    from specrt.tools.peer_models import model_name

    try:
        openvino_python()
    except SpecrtError as e:
        return str(e)
    name = model_name(request.getfixturevalue("default_gguf"))
    for folder in (target_dir(name), draft_dir(name, openvino_models.DRAFT_LAYERS)):
        if not is_converted(folder):
            return f"{folder} is not converted: make setup-peers"
    return None


@pytest.mark.slow
def test_the_real_engines_decode_greedily_and_exactly_agree(request):
    from specrt.schema.manifest import Manifest
    from specrt.tools.peer_worker import close_peers, in_workers
    from specrt.tools.peers import make_peers

    why = openvino_ready(request)
    if why:
        pytest.skip(f"the openvino peer is not set up here: {why}")
    manifest = Manifest.load(request.getfixturevalue("real_bundle"))
    tok = request.getfixturevalue("real_generator").tokenizer
    eos = set(manifest.target.config.eos_token_ids)
    encoded = [(tok.encode_prompt(p), n) for p, n in PROMPTS]

    def well_formed(out, n):
        assert 0 < len(out) <= n and all(t not in eos for t in out[:-1]) and (len(out) == n or out[-1] in eos)
        return out

    peers = make_peers("openvino", manifest, 2)  # as the bench runs it: the plugin's default precision
    try:
        assert list(peers) == ENGINES
        assert [peers[e].reference for e in ENGINES] == [None, "openvino-plain", "openvino-plain"]
        settings = peers["openvino-draft"].settings
        assert settings["draft_layers"] == 4 and settings["group_size"] == 32 and settings["threads"] == 2
        for ids, n in encoded:
            plain, seconds = peers["openvino-plain"].run(ids, n)
            assert seconds > 0 and well_formed(plain, n) == peers["openvino-plain"].run(ids, n)[0]
            for engine in ENGINES[1:]:  # bf16 / int8-activation verify rows may flip a near-tie later on
                assert well_formed(peers[engine].run(ids, n)[0], n)[:1] == plain[:1]
    finally:
        close_peers(peers)

    exact = in_workers({"openvino": (peers_openvino.openvino_peers, (manifest, 2, None), {"exact": True},
                                     openvino_python())})
    try:
        assert {exact["openvino-plain"].settings[k] for k in ("inference_precision_hint", "kv_cache_precision")} == {"f32"}
        for ids, n in encoded:
            plain = well_formed(exact["openvino-plain"].run(ids, n)[0], n)
            assert exact["openvino-lookup"].run(ids, n)[0] == plain
            assert exact["openvino-draft"].run(ids, n)[0] == plain
    finally:
        close_peers(exact)
