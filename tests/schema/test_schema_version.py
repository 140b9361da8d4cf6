"""A bundle whose maths a schema-1 reader cannot compute (sliding windows, Gemma's norms and caps) is written as
schema 2, so that an older specrt refuses it in one line instead of dropping the config keys it does not know."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig
from specrt.schema.manifest import READS, SCHEMA_2_FIELDS, Manifest, schema_for
from tests.schema.bundles import manifest_dict

# the fields every schema-1 manifest had: a reader of schema 1 computes exactly these
SCHEMA_1_FIELDS = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "rms_norm_eps", "rope_inv_freq", "rope_attention_scaling",
                   "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "max_position_embeddings",
                   "eos_token_ids"}
# a value other than the default for each schema-2 field, valid for the 2-layer test config
NEW_VALUES = {"layer_windows": (4, 0), "activation": "gelu_tanh", "embed_scale": 8.0, "sandwich_norms": True,
              "query_pre_attn_scalar": 16.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
              "layer_rope": (1, 0), "local_rope_inv_freq": tuple(1.0 / 10 ** (i / 8) for i in range(8)),
              "local_rope_attention_scaling": 0.5}


COMPANIONS = {"layer_rope": {"local_rope_inv_freq": NEW_VALUES["local_rope_inv_freq"]}}  # its relation needs it


def base() -> DecoderConfig:
    return DecoderConfig.from_dict(manifest_dict()["graphs"]["target"]["config"])


def test_every_config_field_is_placed_in_a_schema():
    """A field added to DecoderConfig must say which readers understand it (else an old reader ignores it)."""
    names = {f.name for f in fields(DecoderConfig)}
    assert names == SCHEMA_1_FIELDS | set(SCHEMA_2_FIELDS) and not SCHEMA_1_FIELDS & set(SCHEMA_2_FIELDS)
    assert set(NEW_VALUES) == set(SCHEMA_2_FIELDS)


def test_a_llama_style_bundle_stays_schema_1():
    assert schema_for([base(), base().truncated(1)]) == 1


@pytest.mark.parametrize("name", SCHEMA_2_FIELDS)
def test_each_new_field_makes_the_bundle_schema_2(name, tmp_path):
    cfg = replace(base(), **{name: NEW_VALUES[name]}, **COMPANIONS.get(name, {}))
    assert schema_for([base(), cfg]) == 2
    d = manifest_dict()
    d["graphs"]["target"]["config"] = cfg.to_dict()
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    m = Manifest.load(tmp_path)  # this specrt reads schema 2 ...
    assert getattr(m.target.config, name) == NEW_VALUES[name]
    written = json.loads(m.to_json())
    assert written["schema_version"] == 2  # ... and writes it, so that a schema-1 reader refuses it
    assert written["graphs"]["target"]["config"][name] == json.loads(json.dumps(NEW_VALUES[name]))


def test_a_schema_this_specrt_does_not_read_is_one_line(tmp_path):
    d = manifest_dict()
    d["schema_version"] = max(READS) + 1
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(SpecrtError, match=r"schema_version 3, this specrt reads 1 and 2: export the bundle again"):
        Manifest.load(tmp_path)
