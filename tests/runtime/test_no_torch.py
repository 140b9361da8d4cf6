"""A deployment needs no torch: the runtime and `specrt generate` work with torch made unimportable."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCK = ("import sys\n"
         "class Block:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name.split('.')[0] in ('torch', 'transformers'):\n"
         "            raise ImportError('blocked: ' + name)\n"
         "sys.meta_path.insert(0, Block())\n")


def test_generate_runs_without_torch(real_bundle):
    code = BLOCK + ("from specrt.cli import main\n"
                    f"sys.argv = ['specrt', 'generate', {str(real_bundle)!r}, '--prompt', 'Say hi.',"
                    " '--drafter', 'ngram', '--max-new-tokens', '8', '--json']\n"
                    "main()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["stats"]["new_tokens"] == len(result["token_ids"]) > 0
    assert {"text", "token_ids", "drafter", "finish_reason", "stats"} <= set(result)
    assert {"new_tokens", "seconds", "tokens_per_s", "steps", "mean_accepted_len", "acceptance_rate"} <= set(
        result["stats"])


def test_runtime_modules_do_not_import_torch():
    code = BLOCK + ("import specrt.runtime.generate, specrt.tools.bench, specrt.runtime.drafters.draft_model\n"
                    "import specrt.runtime.drafters.ngram, specrt.engines.ort_cpu.build, specrt.engines.trt.build, specrt.cli\n"
                    "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
