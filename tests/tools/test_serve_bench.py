"""tools/serve_bench.py: its statistics and table, the server lifecycle, and the client against a real
`specrt serve` subprocess on the real model's bundle."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.tools import serve_bench as sb
from tests.helpers import eventually

# ---- pure parts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q", [0, 5, 50, 95, 100])
def test_percentile_matches_numpys_linear_interpolation(q):
    rng = np.random.default_rng(q)
    for n in (1, 2, 7, 40):
        xs = rng.random(n).tolist()
        assert sb.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_of_nothing_is_none_and_q_is_checked():
    assert sb.percentile([], 50) is None
    with pytest.raises(ValueError, match="101"):
        sb.percentile([1.0], 101)


def test_count_equal_counts_same_request_pairs_and_never_a_failure():
    assert sb.count_equal(["a", "b", None, "d"], ["a", "x", None, "d"]) == 2
    assert sb.count_equal([None], [None]) == 0
    with pytest.raises(ValueError, match="2 texts against 1"):
        sb.count_equal(["a", "b"], ["a"])


def test_summarize_counts_tokens_latency_and_ttft_of_successful_requests_only():
    outs = [sb.Outcome("hi", 10, 1.0, 0.2), sb.Outcome("yo", 30, 3.0, 0.4),
            sb.Outcome(None, 0, 9.0, None, "HTTP 500: boom")]
    row = sb.summarize("e", 4, True, outs, 2.0, single=["hi", "no", "x"], plain=["hi", "yo", None])
    assert row["tokens"] == 40 and row["tokens_per_s"] == 20.0
    assert row["errors"] == 1 and row["first_error"] == "HTTP 500: boom"
    assert row["latency_p50_s"] == 2.0 and row["latency_p95_s"] == pytest.approx(2.9)
    assert row["ttft_p50_s"] == pytest.approx(0.3)
    assert row["same_as_single"] == 1 and row["same_as_plain"] == 2
    assert sb.summarize("e", 1, False, outs[:1], 1.0)["same_as_single"] is None


def test_format_table_shows_equality_as_a_fraction_and_blanks_what_was_not_measured():
    a = sb.summarize("vllm-bfloat16", 1, False, [sb.Outcome("x", 4, 1.0, 1.0)] * 2, 1.0, ["x", "y"])
    b = sb.summarize("specrt-ngram", 16, True, [sb.Outcome("x", 4, 1.0, 0.5)] * 2, 1.0, ["x", "x"], ["x", "x"])
    c = sb.summarize("specrt-ngram", 16, True, [sb.Outcome("x", 3, 1.0, 0.5, gaps_s=[0.25, 0.25])], 1.0)
    c["rate"] = 2.5
    c["server_rss_mb"] = 812.5
    table = sb.format_table([a, b, c]).splitlines()
    assert table[0].startswith("| engine | load | stream | tok/s") and table[0].endswith("| server RSS MB |")
    assert table[2] == "| vllm-bfloat16 | 1 users | no | 8.0 | 1.0 | 1.0 | 1.0 | 1.0 |  |  | 0 | 1/2 |  |  |"
    assert table[3] == "| specrt-ngram | 16 users | yes | 8.0 | 1.0 | 1.0 | 0.5 | 0.5 |  |  | 0 | 2/2 | 2/2 |  |"
    assert table[4] == ("| specrt-ngram | 16 users, 2.5 req/s | yes | 3.0 | 1.0 | 1.0 | 0.5 | 0.5 | 250.0 | 250.0 | 0 "
                        "|  |  | 812.5 |")


def test_summarize_takes_itl_over_every_gap_and_tpot_per_request():
    outs = [sb.Outcome("a", 5, 1.0, 0.2, gaps_s=[0.1, 0.1, 0.3, 0.3]), sb.Outcome("b", 3, 2.0, 1.0, gaps_s=[0.5, 0.5]),
            sb.Outcome(None, 0, 9.0, None, "HTTP 500: boom", gaps_s=[9.0])]
    row = sb.summarize("e", 2, True, outs, 1.0)
    assert row["itl_p50_s"] == 0.3 and row["itl_p95_s"] == 0.5  # the failed request's gaps are left out
    assert row["tpot_p50_s"] == pytest.approx((0.2 + 0.5) / 2)  # (1.0 - 0.2) / 4 and (2.0 - 1.0) / 2
    assert row["ttft_p95_s"] == pytest.approx(0.96)
    assert sb.summarize("e", 1, False, [sb.Outcome("x", 4, 1.0, 1.0)], 1.0)["itl_p50_s"] is None


def test_arrivals_are_a_seeded_poisson_process():
    times = sb.arrivals(4000, 8.0)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps > 0) and times == sb.arrivals(4000, 8.0)
    assert abs(gaps.mean() - 1 / 8) < 0.05 / 8  # exponential gaps: mean 1/rate …
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # … and coefficient of variation 1 (not a fixed pace)
    assert sb.arrivals(3, None) == [0.0, 0.0, 0.0]
    with pytest.raises(SpecrtError, match="--rate"):
        sb.arrivals(3, 0.0)


def test_levels_put_the_single_request_reference_first_once():
    assert sb.levels_of([4, 1]) == [(1, False), (4, False), (4, True), (1, True)]
    assert sb.levels_of([8])[0] == sb.SINGLE and len(sb.levels_of([8])) == 3


def test_sse_events_parse_data_lines_and_the_done_marker():
    lines = [": comment", 'data: {"a": 1}', "", "data: [DONE]"]
    assert list(sb._sse_events(lines)) == [{"a": 1}, "[DONE]"]


def test_write_json_is_atomic(tmp_path):
    path = tmp_path / "out.json"
    sb.write_json(path, {"rows": [1]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    with pytest.raises(TypeError):
        sb.write_json(path, {(1, 2): "tuple keys are not JSON"})
    assert json.loads(path.read_text()) == {"rows": [1]}  # the old file, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_specrt_serve_command_passes_slots_drafter_and_runtime_flags():
    argv = sb.specrt_serve_command("B", 8123, 16, "ngram", ["--threads", "2"], specrt="/x/specrt")
    assert argv[:3] == ["/x/specrt", "serve", "B"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--slots") + 1] == "16"
    assert argv[argv.index("--drafter") + 1] == "ngram" and argv[-2:] == ["--threads", "2"]
    assert "--drafter" not in sb.specrt_serve_command("B", 1, 1, None, [])  # the bundle's tuned choice


def test_compare_refuses_an_unknown_peer(tmp_path):
    with pytest.raises(SpecrtError, match="unknown --peer 'nope': choose from vllm"):
        sb.compare(tmp_path, "nope", None, ["p"], 4, [1], 2, None, [])


# ---- servers ------------------------------------------------------------------------------------------------

FAKE_SERVER = textwrap.dedent("""
    import http.server, json, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # lives until a signal
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "fake"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_server_waits_for_v1_models_and_ends_the_whole_process_group(tmp_path):
    script, child = tmp_path / "fake.py", tmp_path / "child.pid"
    script.write_text(FAKE_SERVER)
    port = sb.free_port()
    pid, group = None, []
    try:
        # ready in well under a second; the 120 s is only the give-up point
        with sb.server("fake", [sys.executable, str(script), str(port), str(child)], port,
                       timeout=120, started=group.append) as (url, model):
            assert model == "fake" and url == f"http://127.0.0.1:{port}"
            pid = int(child.read_text())  # written before the server listens, so before it was ready
            assert _alive(pid)
            # the server and its child, both: more than either alone
            assert sb.group_rss_mb(group[0]) * 1024 > max(_rss_kb(group[0]), _rss_kb(pid))
        # the group got SIGTERM as the block closed: the child dies at once (it has no handler)
        assert eventually(lambda: not _alive(pid), 60), "the server's child outlived it"
    finally:
        if pid is not None and _alive(pid):  # never leave it behind, even when the test failed
            os.kill(pid, signal.SIGKILL)


def test_group_rss_sums_the_groups_processes_only(tmp_path):
    def proc(pid, comm, pgrp, rss_kb):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S 1 {pgrp} {pgrp} 0 -1 4194560 0 0\n")
        (d / "status").write_text(f"Name:\t{comm}\nVmRSS:\t{rss_kb} kB\n")

    proc(10, "specrt", 10, 1024)
    proc(11, "a (b) c", 10, 512)  # a name with spaces and parentheses
    proc(12, "other", 99, 4096)
    (tmp_path / "self").mkdir()
    assert sb.group_rss_mb(10, tmp_path) == 1.5
    assert sb.group_rss_mb(7, tmp_path) is None
    assert sb.group_rss_mb(10, tmp_path / "missing") is None


def test_a_server_that_exits_is_refused_quoting_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(SpecrtError, match=r"(?s)exited with code 3 before.*no model here"):
        with sb.server("broken", argv, sb.free_port(), timeout=120, log_dir=tmp_path):  # it exits at once
            pass
    assert len(list(tmp_path.glob("specrt-serve-bench-broken-*.log"))) == 1  # kept for the post-mortem


# ---- the client against a real `specrt serve` ----------------------------------------------------------------

def test_client_measures_a_real_specrt_serve_streamed_and_not(real_bundle):
    specrt = os.path.join(os.path.dirname(sys.executable), "specrt")
    port = sb.free_port()
    argv = sb.specrt_serve_command(real_bundle, port, 2, "ngram", ["--threads", "2"], specrt=specrt)
    prompts = ["Name three colors.", "Count from one to five."]
    with sb.server("specrt", argv, port, timeout=600) as (url, model):  # up in seconds; 600: the give-up point
        plain, wall = sb.run_load(url, model, prompts, 8, 2, False)
        streamed, _ = sb.run_load(url, model, prompts, 8, 1, True)
        bad, _ = sb.run_load(url, model, prompts[:1], 0, 1, False)  # max_tokens 0: refused by the server
    assert all(o.error is None for o in plain + streamed), [o.error for o in plain + streamed]
    assert [o.text for o in streamed] == [o.text for o in plain] and all(o.text for o in plain)
    assert all(0 < o.tokens <= 8 for o in plain + streamed)
    assert [o.tokens for o in streamed] == [o.tokens for o in plain]  # from the usage chunk
    assert all(o.prompt_tokens and o.prompt_tokens > 3 for o in plain + streamed)
    assert [o.prompt_tokens for o in streamed] == [o.prompt_tokens for o in plain]
    assert all(o.ttft_s == o.latency_s for o in plain)
    assert all(0 < o.ttft_s < o.latency_s for o in streamed)
    assert all(o.gaps_s == [] for o in plain) and all(0 < len(o.gaps_s) < o.tokens for o in streamed)
    assert all(o.ttft_s + sum(o.gaps_s) <= o.latency_s for o in streamed)
    assert 0 < wall and bad[0].error.startswith("HTTP 4") and bad[0].text is None
    dead, _ = sb.run_load(url, model, prompts[:1], 4, 1, True)  # the server is gone now
    assert dead[0].error and "Connect" in dead[0].error


def test_bench_serve_passes_given_runtime_options_on_to_specrt_serve():
    from specrt.cli.bench_serve_cmd import _runtime_flags

    flags = _runtime_flags({"threads": 2, "max_seq_len": 512, "adaptive": False, "backend": "auto", "tree": None})
    assert flags == ["--threads", "2", "--max-seq-len", "512", "--fixed-depth"]  # defaults left out, threads kept


@pytest.mark.parametrize("flag", ["--rate", "--long-prompt", "--prefix-cache-mb", "--prefill-chunk"])
def test_bench_serve_refuses_a_process_option_without_a_server_process(tmp_path, flag):
    from click.testing import CliRunner

    from specrt.cli.bench_serve_cmd import command

    result = CliRunner().invoke(command, [str(tmp_path), flag, "2"])
    assert result.exit_code == 2 and f"{flag} needs --peer or --process" in result.output


def test_bench_serve_hands_its_server_options_to_specrt_serve(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specrt.cli import bench_serve_cmd

    seen = []
    monkeypatch.setattr(bench_serve_cmd, "_peer", lambda *args, **kw: seen.append(args[-1]))
    args = [str(tmp_path), "--process", "--prefix-cache-mb", "0", "--prefill-chunk", "16"]
    result = CliRunner().invoke(bench_serve_cmd.command, args)
    assert result.exit_code == 0, result.output
    assert seen == [["--prefix-cache-mb", "0", "--prefill-chunk", "16"]]


def test_a_long_prompt_is_the_loads_own_text_and_queues_behind_the_first_users():
    prompts = ["Name three colors.", "Write a haiku about rain.", "What is 2 + 2?"]
    text = sb.long_prompt(100, prompts)
    body, ask = text.rsplit("\n\n", 1)
    assert len(body) == 400 and body.startswith(prompts[0] + "\n" + prompts[1]) and ask.startswith("Summarize")
    load, at = sb.intruded(prompts, text, 2)
    assert at == 2 and load == prompts[:2] + [text] + prompts[2:]
    assert sb.intruded(prompts, text, 16) == (prompts + [text], 3)
    with pytest.raises(SpecrtError, match="--long-prompt 0"):
        sb.long_prompt(0, prompts)


def test_a_long_prompt_run_gets_a_row_of_the_other_requests_after_its_level():
    single = [sb.Outcome("a", 4, 1.0, 1.0), sb.Outcome("b", 4, 1.0, 1.0)]
    streamed = [sb.Outcome("a", 4, 1.0, 0.1, gaps_s=[0.1] * 3), sb.Outcome("b", 4, 1.0, 0.1, gaps_s=[0.1] * 3)]
    others = [sb.Outcome("a", 4, 2.0, 0.1, gaps_s=[0.1, 0.9, 0.1]), sb.Outcome("b", 4, 2.0, 0.1, gaps_s=[0.1] * 3)]
    long = sb.Outcome("c", 8, 3.0, 1.5, prompt_tokens=2011)
    results = {sb.SINGLE: (single, 2.0), (2, True): (streamed, 1.0)}
    rows = sb.rows_of("specrt-plain", results, ["a", "b"], long_runs={(2, True): (others, 2.5, long)})
    assert len(rows) == 3 and "long_prompt" not in rows[1]
    assert rows[2]["long_prompt"] == {"prompt_tokens": 2011, "ttft_s": 1.5, "latency_s": 3.0, "error": None}
    assert rows[2]["requests"] == 2 and rows[2]["same_as_plain"] == 2 and rows[2]["itl_p95_s"] > rows[1]["itl_p95_s"]
    assert "| 2 users + a 2011-token prompt | yes |" in sb.format_table(rows).splitlines()[4]


def test_bench_serve_peer_without_its_venv_names_the_setup_command(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specrt.cli.bench_serve_cmd import command

    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    result = CliRunner().invoke(command, [str(tmp_path), "--peer", "vllm"])
    assert isinstance(result.exception, SpecrtError) and "make setup-peers" in str(result.exception)
