"""manifest.json is checked field by field when it is loaded: a wrong type, range or path is one error that
names the file, the field, the value and the fix."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from specrt.errors import SpecrtError
from specrt.schema.config import CONFIG_CHECKS, DecoderConfig
from specrt.schema.manifest import Manifest
from tests.schema.bundles import manifest_dict


def load_with(tmp_path, edit) -> Manifest:
    d = manifest_dict()
    edit(d)
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    return Manifest.load(tmp_path)


def target_config(**values):
    return lambda d: d["graphs"]["target"]["config"].update(values)


BAD = [  # (edit, field named, what it must be, the value as shown)
    (target_config(num_layers="30"), "graphs.target.config.num_layers", "a positive integer", "'30'"),
    (target_config(num_layers=[]), "graphs.target.config.num_layers", "a positive integer", "[]"),
    (target_config(num_layers=True), "graphs.target.config.num_layers", "a positive integer", "True"),
    (target_config(num_layers=2.0), "graphs.target.config.num_layers", "a positive integer", "2.0"),
    (target_config(num_kv_heads=0), "graphs.target.config.num_kv_heads", "a positive integer", "0"),
    (target_config(vocab_size=-5), "graphs.target.config.vocab_size", "a positive integer", "-5"),
    (target_config(rms_norm_eps="1e-6"), "graphs.target.config.rms_norm_eps", "a positive finite number", "'1e-6'"),
    (target_config(tie_word_embeddings="yes"), "graphs.target.config.tie_word_embeddings", "true or false", "'yes'"),
    (target_config(eos_token_ids=[-1]), "graphs.target.config.eos_token_ids", "a list of integers >= 0", "[-1]"),
    (target_config(rope_inv_freq=[]), "graphs.target.config.rope_inv_freq", "a non-empty list of finite numbers", "[]"),
    (target_config(num_heads=5), "graphs.target.config.num_heads", "a multiple of num_kv_heads (2)", "5"),
    (lambda d: d["graphs"]["target"]["config"].pop("hidden_size"), "graphs.target.config.hidden_size",
     "a positive integer", "nothing (the field is missing)"),
    (lambda d: d.update(graphs={}), "graphs", "an object of graphs with a 'target' entry", "{}"),
    (lambda d: d.update(graphs=[]), "graphs", "an object of graphs with a 'target' entry", "[]"),
    (lambda d: d["graphs"]["target"].update(opset="24"), "graphs.target.opset", "a positive integer", "'24'"),
    (lambda d: d["graphs"]["target"].update(inputs="input_ids"), "graphs.target.inputs", "a list of strings",
     "'input_ids'"),
    (lambda d: d["graphs"]["target"].update(sha256={"decoder.onnx": "xyz"}), "graphs.target.sha256",
     "an object of file name -> sha256 hex digest", "{'decoder.onnx': 'xyz'}"),
    (lambda d: d.update(tokenizer="tokenizer.json"), "tokenizer", "an object", "'tokenizer.json'"),
    (lambda d: d.update(drafters={"medusa": {"kind": "medusa", "graphs": ["medusa"], "config": {}}}),
     "drafters.medusa.graphs", "names of entries in graphs (target)", "['medusa']"),
    (lambda d: d.update(drafters={"eagle3": {"kind": "eagle3", "graphs": ["target"], "config": {},
                                             "acceptance_by_depth": [0.4, 1.5]}}),
     "drafters.eagle3.acceptance_by_depth", "a list of numbers in 0..1", "[0.4, 1.5]"),
]


@pytest.mark.parametrize("edit, key, expected, shown", BAD, ids=[f"{b[1]}={b[3]}" for b in BAD])
def test_a_wrong_type_or_range_names_the_field_and_the_value(tmp_path, edit, key, expected, shown):
    with pytest.raises(SpecrtError) as e:
        load_with(tmp_path, edit)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'manifest.json'}: {key} must be {expected}"), message
    assert f"got {shown}" in message and message.endswith("re-export the bundle")
    assert "\n" not in message


PATHS = [  # every path the manifest names must stay inside the bundle
    (lambda d: d["graphs"]["target"].update(file="../x/decoder.onnx"), "graphs.target.file", "'../x/decoder.onnx'"),
    (lambda d: d["graphs"]["target"].update(file="target/../../x.onnx"), "graphs.target.file", "'target/../../x.onnx'"),
    (lambda d: d["tokenizer"].update(file="/etc/passwd"), "tokenizer.file", "'/etc/passwd'"),
    (lambda d: d["artifacts"].update(onnxruntime={"graphs": {"target": {"file": "/tmp/opt.onnx"}}}),
     "artifacts.onnxruntime.graphs.target.file", "'/tmp/opt.onnx'"),
    (lambda d: d["artifacts"].update(reference_io={"target": {"inputs": "../in.json", "outputs": "o.json"}}),
     "artifacts.reference_io.target.inputs", "'../in.json'"),
    (lambda d: d["graphs"]["target"].update(sha256={"../decoder.onnx": "0" * 64}), "graphs.target.sha256",
     "{'../decoder.onnx'"),
]


@pytest.mark.parametrize("edit, key, shown", PATHS, ids=[p[1] for p in PATHS])
def test_paths_outside_the_bundle_are_refused(tmp_path, edit, key, shown):
    with pytest.raises(SpecrtError) as e:
        load_with(tmp_path, edit)
    assert f": {key} must be " in str(e.value) and f"got {shown}" in str(e.value), str(e.value)


def test_a_valid_manifest_loads_with_paths_inside_the_bundle(tmp_path):
    m = load_with(tmp_path, lambda d: d["artifacts"].update(
        onnxruntime={"graphs": {"target": {"file": "target/./decoder.ort-opt.onnx"}}}))
    assert m.target.config.num_layers == 2 and m.target.config.rope_inv_freq == tuple(manifest_dict()[
        "graphs"]["target"]["config"]["rope_inv_freq"])
    assert m.onnx_path(tmp_path, "target") == tmp_path / "target/decoder.onnx"  # the built file is absent


def test_json_that_is_not_an_object_is_one_error(tmp_path):
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(SpecrtError, match="schema_version None"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(SpecrtError, match="not readable JSON"):
        Manifest.load(tmp_path)


def test_every_config_field_has_a_check():
    """A field added to DecoderConfig without a check in CONFIG_CHECKS would be read unchecked."""
    assert set(CONFIG_CHECKS) == {f.name for f in fields(DecoderConfig)}
