"""`specrt generate --drafter auto`: the JSON says which drafter the request ran and why."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specrt.cli import cli


def test_generate_auto_json_names_the_drafter(tiny_bundle):
    out = CliRunner().invoke(cli, ["generate", str(tiny_bundle), "--prompt", "a b a b a b", "--raw", "--json",
                                   "--drafter", "auto", "--auto-candidates", "ngram", "--max-new-tokens", "8",
                                   "--max-seq-len", "64"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["exactness"]["requested_drafter"] == "auto"
    assert res["drafter"] == res["auto"]["drafter"] == "ngram"  # unmeasured: explored first
    assert res["auto"]["reason"] == "explore" and res["auto"]["speedup"] == {"ngram": None}
