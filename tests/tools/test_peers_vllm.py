"""tools/peers_vllm.py: what runs without vLLM (where its venv and model folder must be, the thread
binding, the `vllm serve` command line, EOS handling), and one real run in the vLLM venv when
`make setup-peers` has built it (CI does not build peers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specrt.errors import SpecrtError
from specrt.tools import peers_vllm as pv


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    return tmp_path


def test_vllm_python_names_the_setup_command_when_the_venv_is_absent(home):
    with pytest.raises(SpecrtError, match=r"peers/venvs/vllm.*make setup-peers"):
        pv.vllm_python()
    python = home / "peers" / "venvs" / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert pv.vllm_python() == str(python)


def test_model_dir_needs_a_complete_hf_folder(home):
    from specrt.tools.peer_models import HF_RECORD

    source = "/models/Some-Model.Q4_1.gguf"
    with pytest.raises(SpecrtError, match=r"peers/hf/Some-Model.Q4_1.*make setup-peers"):
        pv.model_dir(source)
    folder = home / "peers" / "hf" / "Some-Model.Q4_1"
    folder.mkdir(parents=True)
    with pytest.raises(SpecrtError, match="incomplete"):  # a folder without its record is half-written
        pv.model_dir(source)
    (folder / HF_RECORD).write_text("{}")
    assert pv.model_dir(source) == folder


def test_threads_bind_the_first_cores_this_process_may_use():
    assert pv.cpu_list(2, [7, 3, 5]) == [3, 5]
    env = pv.engine_env(2, [4, 5, 6])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4,5" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    with pytest.raises(SpecrtError, match="3 threads asked for.*2 CPUs"):
        pv.cpu_list(3, [0, 1])


def test_serve_command_runs_the_openai_server_module_bf16_without_prefix_caching():
    argv, env = pv.serve_command("/v/bin/python", "/hf/M", 8123, 2, 2048, available=[0, 1])
    # not the `vllm` console script: its parser asks importlib.metadata for a distribution named vllm
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert value("--model") == "/hf/M" and value("--port") == "8123" and value("--host") == "127.0.0.1"
    assert value("--dtype") == "bfloat16" and value("--max-model-len") == "2048"
    assert value("--generation-config") == "vllm" and value("--served-model-name") == "M"
    assert "--no-enable-prefix-caching" in argv
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"


def test_context_is_specrts_kv_capacity():
    assert pv.context_length(None, 8192) == 2048
    assert pv.context_length(None, 512) == 512
    assert pv.context_length(1024, 8192) == 1024


def test_output_is_kept_through_the_first_eos():
    assert pv.keep_through_eos([5, 6, 2, 7], {2}, 10) == [5, 6, 2]
    assert pv.keep_through_eos([5, 6, 7], {2}, 2) == [5, 6]
    assert pv.keep_through_eos([], {2}, 4) == []


def test_suffix_engine_only_where_its_module_imports():
    assert pv.available_engines(lambda m: False) == ["vllm-plain", "vllm-ngram"]
    assert pv.available_engines(lambda m: True) == ["vllm-plain", "vllm-ngram", "vllm-suffix"]
    assert pv.ENGINES["vllm-ngram"] == ("vllm-plain", pv.NGRAM) and pv.ENGINES["vllm-plain"][0] is None


def test_the_worker_side_imports_nothing_the_vllm_venv_lacks():
    """The vLLM venv has specrt without its dependencies: unpickling the family's factory and the
    manifest there must not need onnxruntime, numpy or specrt.runtime."""
    code = ("import sys\n"
            "for m in ('onnxruntime', 'numpy', 'tokenizers', 'specrt.runtime'): sys.modules[m] = None\n"
            "import specrt.tools.peers_vllm, specrt.tools.peer_worker, specrt.schema.manifest\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


VENV_PYTHON = pv.venv_dir() / "bin" / "python"


@pytest.mark.skipif(not VENV_PYTHON.is_file(), reason=f"the vLLM venv {pv.venv_dir()} is not built "
                    "(`make setup-peers`; CI does not build peers)")
def test_real_vllm_peers_decode_greedily_in_their_own_venv(real_bundle):
    from specrt.runtime.generate import Generator
    from specrt.schema.manifest import Manifest
    from specrt.tools.peer_models import ensure_hf_folder
    from specrt.tools.peer_worker import close_peers
    from specrt.tools.peers import make_peers

    manifest = Manifest.load(real_bundle)
    ensure_hf_folder(manifest.target.source)
    ids = Generator(real_bundle, "plain", max_seq_len=256).tokenizer.encode_prompt("Reply with one word: yes or no?")
    peers = make_peers("vllm", manifest, 2)  # 2048: the context its compile cache was built for
    try:
        assert {"vllm-plain", "vllm-ngram"} <= set(peers)
        assert peers["vllm-ngram"].reference == "vllm-plain" and peers["vllm-plain"].reference is None
        assert peers["vllm-plain"].settings["dtype"] == "bfloat16"
        assert peers["vllm-ngram"].settings["speculative_config"]["method"] == "ngram"
        out, seconds = peers["vllm-plain"].run(ids, 48)
        again, _ = peers["vllm-plain"].run(ids, 48)
        assert out == again and 0 < len(out) <= 48 and seconds > 0  # greedy: the same tokens twice
        assert out[-1] in manifest.target.config.eos_token_ids  # a one-word answer stops, EOS kept
        short, _ = peers["vllm-ngram"].run(ids, 3)
        assert len(short) == 3
    finally:
        close_peers(peers)
