"""`specrt serve-triton`: a real tritonserver (nvidia-pytriton's, CPU) over the tiny bundle, called over HTTP.

One module-scoped server (the CLI in a subprocess, free ports, 2 instances of each model, the `draft`
drafter, 1 ONNX Runtime thread) answers every test; it is always stopped (SIGTERM to the CLI, which stops
tritonserver). Wall time on a 2-core AMD EPYC (AVX2, CPU only), beyond the session's tiny_bundle fixture:
about 15 s with the stub's environment cached (READY 6 s with 4 stub processes, requests 5 s, stop 4 s),
plus 15-20 s once to build that environment (pip; it is cached under specrt's cache folder).
Skipped with a reason where nvidia-pytriton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.deploy.triton import server as triton
from specrt.deploy.triton.repo import (
    GENERATE_MODEL,
    STREAM_MODEL,
    ServeSettings,
    set_instance_count,
    write_triton_repo,
)
from specrt.errors import SpecrtError

HAVE_PYTRITON = importlib.util.find_spec("pytriton") is not None
needs_tritonserver = pytest.mark.skipif(not HAVE_PYTRITON,
                                        reason="nvidia-pytriton is not installed: pip install -e '.[triton-server]'")
PROMPT = "Name three colours."
OTHER = "Write one sentence about the sea."
MAX_TOKENS = 24
MAX_SEQ_LEN = 64  # as tiny_reference


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    """(base URL, repository, stub environment) of `specrt serve-triton` over the tiny bundle."""
    env = triton.build_stub_env(triton.find_tritonserver())  # cached; the CLI reuses it (same key)
    tmp = tmp_path_factory.mktemp("triton_server")
    ports = [triton.free_port() for _ in range(3)]
    cmd = [sys.executable, "-c", "from specrt.cli import main; main()", "serve-triton", str(tiny_bundle),
           "--repo", str(tmp / "repo"), "--instances", "2", "--drafter", "draft", "--max-seq-len", str(MAX_SEQ_LEN),
           "--threads", "1", "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
           "--metrics-port", str(ports[2]), "--env-dir", str(env.path), "--log-file", str(tmp / "tritonserver.log"),
           "--ready-timeout", "240"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put("")], daemon=True).start()
    try:
        try:
            ready = lines.get(timeout=300)  # "" when the CLI exited first
        except queue.Empty:
            ready = ""
        assert "ready at" in ready, (ready, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        url = f"http://127.0.0.1:{ports[0]}"
        assert url in ready, ready
        yield url, tmp / "repo", env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:  # tritonserver still gets SIGTERM: it dies with its parent
                proc.kill()
                proc.wait()


def generate(url: str, prompt: str, model: str = GENERATE_MODEL, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/generate", json={"text_input": prompt, "max_tokens": MAX_TOKENS,
                                                                 **fields}, timeout=120)


def assert_equals_reference(body: dict, reference) -> None:
    assert body["text_output"] == reference.text, (body["text_output"], reference.text)
    assert body["tokens"] == len(reference.token_ids) and body["finish_reason"] == reference.finish_reason


@pytest.mark.triton_server
@needs_tritonserver
def test_greedy_equals_plain_decoding(server, tiny_reference):
    """Speculative (draft) greedy output through tritonserver == plain greedy decoding of the same target,
    over /generate and over the KServe /infer endpoint (BYTES tensors, the path numpy 2 broke)."""
    url, _, env = server
    meta = httpx.get(f"{url}/v2").json()
    assert meta["name"] == "triton" and meta["version"].startswith("2.")
    assert int(json.loads((env.path / "env.json").read_text())["numpy"].split(".")[0]) < 2
    reference = tiny_reference.generate(PROMPT, MAX_TOKENS)
    response = generate(url, PROMPT)
    assert response.status_code == 200, response.text
    body = response.json()
    assert_equals_reference(body, reference)
    assert json.loads(body["stats_json"])["drafter"] == "draft"
    for tiny in (1e-38, 1e-42, 1e-300):  # sampling's limit as T -> 0 is greedy (1e-38 was nan in float32: token 0)
        sampled = generate(url, PROMPT, temperature=tiny, seed=1)
        assert sampled.status_code == 200, sampled.text
        assert_equals_reference(sampled.json(), reference)

    prompt = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}
    infer = httpx.post(f"{url}/v2/models/{GENERATE_MODEL}/infer", timeout=120,
                       json={"parameters": {"max_tokens": MAX_TOKENS}, "inputs": [prompt]})
    assert infer.status_code == 200, infer.text
    outputs = {o["name"]: o["data"][0] for o in infer.json()["outputs"]}
    assert outputs["text_output"] == reference.text and outputs["tokens"] == len(reference.token_ids)
    # max_tokens is a request parameter (model.py), not a tensor: tritonserver refuses one, naming it
    tensor = httpx.post(f"{url}/v2/models/{GENERATE_MODEL}/infer", timeout=120, json={"inputs": [
        prompt, {"name": "max_tokens", "datatype": "INT64", "shape": [1], "data": [MAX_TOKENS]}]})
    assert tensor.status_code == 400 and "unexpected inference input 'max_tokens'" in tensor.json()["error"], \
        tensor.text


@pytest.mark.triton_server
@needs_tritonserver
def test_two_instances_serve_concurrent_requests(server, tiny_reference):
    """6 requests sent at once: every answer is the plain reference, both instances served some, and
    the server's own record proves two of them ran at the same time on different instances: each
    response's `executed` span is when its instance began and ended it, on the machine's one
    CLOCK_MONOTONIC; intersecting spans on two instances are concurrent execution, however fast or
    loaded the machine (one instance, or two taking turns, would leave no such pair)."""
    url, repo, _ = server
    assert "count: 2" in (repo / GENERATE_MODEL / "config.pbtxt").read_text()
    prompts = [PROMPT, OTHER] * 3
    references = {p: tiny_reference.generate(p, MAX_TOKENS) for p in set(prompts)}
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def call(i: int) -> None:
        start.wait()
        results[i] = generate(url, prompts[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each request has its own 120 s timeout
    spans = []
    for prompt, response in zip(prompts, results, strict=True):
        assert response is not None and response.status_code == 200, response and response.text
        assert_equals_reference(response.json(), references[prompt])
        stats = json.loads(response.json()["stats_json"])
        began, ended = stats["executed"]
        assert began <= ended, stats
        spans.append((stats["instance"], began, ended))
    assert {s[0] for s in spans} == {f"{GENERATE_MODEL}_0_0", f"{GENERATE_MODEL}_0_1"}, spans
    concurrent = [(a, b) for a in spans for b in spans if a[0] < b[0] and a[1] < b[2] and b[1] < a[2]]
    assert concurrent, f"no two requests ran at the same time on different instances: {spans}"


@pytest.mark.triton_server
@needs_tritonserver
def test_bad_requests_get_4xx_and_the_server_lives(server, tiny_reference):
    url, _, _ = server
    model = f"{url}/v2/models/{GENERATE_MODEL}"
    missing = httpx.post(f"{model}/generate", json={"max_tokens": 4}, timeout=60)
    assert missing.status_code == 400 and "text_input" in missing.json()["error"], missing.text
    wrong_type = httpx.post(f"{model}/infer", timeout=60, json={"inputs": [
        {"name": "text_input", "datatype": "INT32", "shape": [1], "data": [5]}]})
    assert wrong_type.status_code == 400 and "BYTES" in wrong_type.json()["error"], wrong_type.text
    bad_value = generate(url, PROMPT, max_tokens=0)
    assert bad_value.status_code == 400 and "max_tokens" in bad_value.json()["error"], bad_value.text
    bad_top_p = generate(url, PROMPT, top_p=1.5)
    assert bad_top_p.status_code == 400 and "top-p" in bad_top_p.json()["error"], bad_top_p.text
    for wraps in (4294967301, 3000000000):  # at INT32 Triton made them 5 and -1294967296
        huge = generate(url, PROMPT, max_tokens=wraps)
        assert huge.status_code == 400 and f"max_tokens {wraps} is out of range" in huge.json()["error"], huge.text
    # tritonserver 2.51 itself answers 500 to JSON it cannot convert; still an error, not a crash
    unparsable = httpx.post(f"{model}/generate", content=b"{not json", timeout=60)
    assert unparsable.status_code >= 400 and "error" in unparsable.json(), unparsable.text
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    good = generate(url, PROMPT)
    assert good.status_code == 200, good.text
    assert_equals_reference(good.json(), tiny_reference.generate(PROMPT, MAX_TOKENS))


# JSON literals that are not an integer max_tokens, and how the error shows each (tritonserver hands the
# model 1e3 as 1000.0 and an integer past int64 as a double). Declared as a TYPE_INT64 input, each got
# tritonserver's own HTTP 500 ("Unable to parse 'data': attempt to access JSON non-signed-integer as
# signed-integer") before model.py ran.
NOT_INTEGERS = {'"12"': '"12"', "12.5": "12.5", "true": "true", "1e3": "1000.0",
                str(2**63): "9.223372036854776e+18"}


@pytest.mark.triton_server
@needs_tritonserver
@pytest.mark.parametrize("model", [GENERATE_MODEL, STREAM_MODEL])
def test_a_non_integer_max_tokens_gets_400_naming_the_field(server, model):
    url, _, _ = server
    endpoint = "generate" if model == GENERATE_MODEL else "generate_stream"
    got = {}
    for literal in NOT_INTEGERS:
        body = f'{{"text_input": {json.dumps(PROMPT)}, "max_tokens": {literal}}}'.encode()
        response = httpx.post(f"{url}/v2/models/{model}/{endpoint}", content=body, timeout=60,
                              headers={"Content-Type": "application/json"})
        text = response.text
        if endpoint == "generate_stream" and text.startswith("data: "):  # one event: the error
            text = "".join(line[len("data: "):] for line in text.splitlines() if line.startswith("data: "))
        got[literal] = (response.status_code, text)
    expected = {literal: (400, f'max_tokens {shown} is not an integer: send a whole number from 1 to '
                               f'{MAX_SEQ_LEN - 1} (a JSON integer, e.g. "max_tokens": {MAX_SEQ_LEN - 1})')
                for literal, shown in NOT_INTEGERS.items()}
    assert {k: (status, json.loads(text).get("error")) for k, (status, text) in got.items()} == expected, got
    if model == GENERATE_MODEL:  # an integer still works (streamed: test_stream_concatenates_to_the_unary_output)
        integer = generate(url, PROMPT, max_tokens=3)
        assert integer.status_code == 200 and integer.json()["tokens"] == 3, integer.text


@pytest.mark.triton_server
@needs_tritonserver
def test_stream_concatenates_to_the_unary_output(server):
    """/generate_stream on the decoupled model: several text pieces, then a final event with the stats;
    the pieces concatenate to what /generate returns."""
    url, _, _ = server
    unary = generate(url, PROMPT).json()
    events = []
    with httpx.stream("POST", f"{url}/v2/models/{STREAM_MODEL}/generate_stream",
                      json={"text_input": PROMPT, "max_tokens": MAX_TOKENS}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert all("error" not in e for e in events), events
    *pieces, final = events
    assert len([p for p in pieces if p["text_output"]]) > 1, events
    assert "".join(p["text_output"] for p in pieces) == unary["text_output"]
    assert final["text_output"] == "" and final["tokens"] == unary["tokens"]
    assert final["finish_reason"] == unary["finish_reason"]
    assert json.loads(final["stats_json"])["instance"].startswith(STREAM_MODEL)

    with httpx.stream("POST", f"{url}/v2/models/{STREAM_MODEL}/generate_stream",
                      json={"text_input": PROMPT, "max_tokens": 0}, timeout=60) as response:
        errors = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert len(errors) == 1 and "max_tokens" in errors[0]["error"], errors


# ── without a server ──────────────────────────────────────────────────────────────────────────────
def test_missing_tritonserver_names_the_install():
    with pytest.raises(SpecrtError, match=r"nvidia-pytriton is not installed; pip install 'specrt\[triton-server\]'"):
        triton.find_tritonserver("specrt_no_such_package")


def test_stream_model_config_and_instance_count(tiny_bundle, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo = tmp_path / "repo"
    models = write_triton_repo(tiny_bundle, repo, ServeSettings(instances=3, stream=True))
    assert models[:2] == [GENERATE_MODEL, STREAM_MODEL]

    def config(model):
        return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())

    unary, stream = config(GENERATE_MODEL), config(STREAM_MODEL)
    assert not unary.model_transaction_policy.decoupled and stream.model_transaction_policy.decoupled
    assert stream.name == STREAM_MODEL and list(stream.input) == list(unary.input)
    assert (repo / STREAM_MODEL / "1" / stream.parameters["bundle"].string_value / "manifest.json").is_file()
    assert [g.count for g in stream.instance_group] == [3]
    assert set_instance_count(repo, GENERATE_MODEL, 2) == 3
    assert [g.count for g in config(GENERATE_MODEL).instance_group] == [2]
    assert not [p for p in (repo / GENERATE_MODEL).iterdir() if p.name.endswith(".tmp")]


def test_cli_refuses_what_it_cannot_serve(tiny_bundle, tmp_path):
    neither = CliRunner().invoke(cli, ["serve-triton", str(tmp_path)])
    assert isinstance(neither.exception, SpecrtError) and "neither a bundle" in str(neither.exception)
    repo = tmp_path / "repo"
    write_triton_repo(tiny_bundle, repo)
    bundle_only = CliRunner().invoke(cli, ["serve-triton", str(repo), "--drafter", "draft"])
    assert isinstance(bundle_only.exception, SpecrtError) and "--drafter applies when SOURCE is a bundle" in \
        str(bundle_only.exception)
    not_ours = tmp_path / "mine"
    (not_ours / "keep.txt").parent.mkdir()
    (not_ours / "keep.txt").write_text("mine")
    if HAVE_PYTRITON:  # the repository is written only once tritonserver is found
        replaced = CliRunner().invoke(cli, ["serve-triton", str(tiny_bundle), "--repo", str(not_ours)])
        assert isinstance(replaced.exception, SpecrtError) and "not a specrt Triton repository" in \
            str(replaced.exception)
    assert (not_ours / "keep.txt").read_text() == "mine"


def test_stub_environment_pins():
    requirements = triton.stub_requirements()
    assert triton.STUB_NUMPY in requirements and not [r for r in requirements if r.startswith("numpy==")]
    names = {r.split("==")[0] for r in requirements}
    assert {"onnxruntime", "tokenizers", "jinja2", "onnx"} <= names
    assert all("==" in r for r in requirements if r != triton.STUB_NUMPY)


def test_the_stub_environment_is_keyed_by_where_specrt_imports_from(monkeypatch, tmp_path):
    # an editable install's stub environment points at the checkout; one built for a copy of the checkout
    # elsewhere (same RECORD) must not be reused by this one
    dist = triton.TritonDist(tmp_path, tmp_path, "0.7.0")
    requirements = ["numpy<2"]
    here = triton.env_key(dist, requirements)
    assert triton.env_key(dist, requirements) == here
    real = importlib.util.find_spec

    def elsewhere(name, *a):
        spec = real(name, *a)
        if name == "specrt":
            spec = importlib.util.spec_from_file_location("specrt", tmp_path / "copy" / "specrt" / "__init__.py")
        return spec

    monkeypatch.setattr(triton.importlib.util, "find_spec", elsewhere)
    assert triton.env_key(dist, requirements) != here
