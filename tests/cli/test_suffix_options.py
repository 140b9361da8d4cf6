"""`--suffix-store` / `--suffix-min-prob` reach the suffix drafter; values outside their range are refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.cli.options import make_generator

RUNTIME = dict(max_seq_len=64, threads=1, num_draft_tokens=4, tree=None, acceptance="auto", ngram_max=3, ngram_min=1)


def test_options_set_the_store_bound_and_the_least_path_probability(tiny_bundle):
    gen = make_generator(tiny_bundle, "suffix", **RUNTIME, suffix_store=123, suffix_min_prob=0.4)
    assert (gen.drafter.store.max_tokens, gen.drafter.min_prob) == (123, 0.4)
    default = make_generator(tiny_bundle, "suffix", **RUNTIME)
    assert (default.drafter.store.max_tokens, default.drafter.min_prob) == (65536, 0.1)


@pytest.mark.parametrize("option,value", [("--suffix-store", "-1"), ("--suffix-min-prob", "1.5"),
                                          ("--suffix-min-prob", "nan")])
def test_out_of_range_values_name_the_option(tiny_bundle, option, value):
    out = CliRunner().invoke(cli, ["generate", str(tiny_bundle), "--prompt", "a b", "--raw", "--drafter", "suffix",
                                   option, value])
    assert out.exit_code == 2 and option in out.output, out.output
