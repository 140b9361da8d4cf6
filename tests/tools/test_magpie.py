"""`specrt prompts` (tools/magpie.py): the target writes prompts from its chat template's user-turn prefix;
cut-off, short, marked-up, repeated and held-out-like ones are dropped; the file resumes."""

from __future__ import annotations

import json

import pytest

from specrt.runtime.generate import Generator
from specrt.tools.magpie import NearDuplicates, Writer, Written, heldout_texts, normalize, pre_query, verdict

LONG = ("Could you explain how the water cycle works, starting from evaporation over the oceans and ending "
        "with rain falling on the mountains and flowing back to the sea through the rivers")


@pytest.fixture(scope="module")
def gen(real_bundle):
    return Generator(real_bundle, "plain", max_seq_len=256, costs=None)


def test_the_prefix_ends_where_a_user_starts_writing(gen):
    plain, coder = pre_query(gen.tokenizer, None), pre_query(gen.tokenizer, "You are an expert programmer.")
    assert plain.endswith("<|im_start|>user\n") and coder.endswith("<|im_start|>user\n")
    assert "You are an expert programmer." in coder and "expert programmer" not in plain


def test_same_and_near_duplicates_are_found_and_others_are_not():
    seen = NearDuplicates(0.7)
    seen.add(LONG)
    assert seen.match(LONG.upper() + "?!")  # the same after normalising
    assert seen.match(LONG.replace("mountains", "hills"))  # one word of 31: Jaccard 25/31
    assert not seen.match("Write a haiku about the first snow of the winter in a quiet mountain village")
    assert not seen.match(" ".join(LONG.split()[:12]))  # a shared opening is not the same request
    assert normalize("  Hello,   World!! ") == "hello world"


def test_verdicts_name_why_a_prompt_is_dropped():
    kept, held = NearDuplicates(), NearDuplicates()
    for text in heldout_texts():
        held.add(text)
    shipped = heldout_texts()[0]
    w = lambda text, finished=True: Written(0, None, 0.7, text, finished)  # noqa: E731
    assert verdict(w(LONG, finished=False), kept, held) == "cut off"
    assert verdict(w("Hi there"), kept, held) == "too short"
    assert verdict(w("Tell me <|im_end|> a story about cats"), kept, held) == "markup"
    assert verdict(w(shipped.lower() + "!"), kept, held) == "held-out duplicate"
    assert verdict(w(LONG), kept, held) == ""
    kept.add(LONG)
    assert verdict(w(LONG.replace("rivers", "streams")), kept, held) == "duplicate"


def test_prompts_are_written_distinct_and_a_rerun_resumes(gen, tmp_path):
    out = tmp_path / "prompts.jsonl"
    first = Writer(gen, out).run(4, max_new_tokens=48, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["prompts"] == len(rows) == 4
    assert len({normalize(r["prompt"]) for r in rows}) == 4 and len({r["id"] for r in rows}) == 4
    assert all(r["split"] in ("train", "heldout") and r["category"] == "magpie" for r in rows)
    with open(out, "a") as f:
        f.write('{"id": "magpie-99", "prom')  # a line cut off mid-write by a stop
    second = Writer(gen, out).run(6, max_new_tokens=48, progress=False)
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert second["prompts"] == len(again) == 6 and again[:4] == rows
    attempts = [r["attempt"] for r in again]
    assert attempts == sorted(attempts) and len(set(attempts)) == 6


def test_batched_writing_samples_what_one_at_a_time_samples(real_bundle, gen, tmp_path):
    one = Writer(gen, tmp_path / "one.jsonl").run(3, max_new_tokens=40, progress=False)
    batched_gen = Generator(real_bundle, "plain", max_seq_len=256, slots=4, costs=None)
    many = Writer(batched_gen, tmp_path / "many.jsonl").run(3, max_new_tokens=40, slots=4, progress=False)
    assert one["prompts"] == many["prompts"] == 3
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "many.jsonl").read_text()


def test_a_template_that_refuses_system_turns_writes_without_them(tmp_path):
    from types import SimpleNamespace

    from specrt.errors import SpecrtError
    from specrt.tools.magpie import SENTINEL

    class NoSystem:  # as Gemma's template: raise_exception on a system message
        tok = SimpleNamespace(encode=lambda text, add_special_tokens: SimpleNamespace(ids=[len(text)]))

        def render_chat(self, messages):
            if messages[0]["role"] == "system":
                raise SpecrtError("chat template: System role not supported")
            return f"<start_of_turn>user\n{messages[0]['content']}<end_of_turn>\n<start_of_turn>model\n"

    writer = Writer(SimpleNamespace(tokenizer=NoSystem()), tmp_path / "p.jsonl")
    assert writer.systems == [None] and writer.prefixes == [[len("<start_of_turn>user\n")]]
    with pytest.raises(SpecrtError, match="--systems science: this bundle's chat template takes no system prompt"):
        Writer(SimpleNamespace(tokenizer=NoSystem()), tmp_path / "s.jsonl", systems="science")
    assert {writer.settings(a) for a in range(3)} == {(None, 0.7), (None, 0.85), (None, 1.0)}
    assert SENTINEL not in pre_query(NoSystem(), None)


def test_a_system_set_leans_the_prompts_and_a_file_keeps_its_set(gen, tmp_path):
    from specrt.errors import SpecrtError
    from specrt.tools.magpie import SYSTEM_SETS

    out = tmp_path / "science.jsonl"
    writer = Writer(gen, out, systems="science")
    assert writer.systems == list(SYSTEM_SETS["science"])
    assert all("physics tutor" not in text for text in map(str, Writer(gen, tmp_path / "m.jsonl").systems))
    assert any("physics tutor" in gen.tokenizer.tok.decode(p) for p in writer.prefixes)
    writer.run(3, max_new_tokens=48, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["systems"] == "science" and r["system"] in SYSTEM_SETS["science"] for r in rows)
    assert all(r["id"] == f"magpie-science-{r['attempt']}" for r in rows)  # never a mixed file's id
    with pytest.raises(SpecrtError, match="written with --systems science"):
        Writer(gen, out)  # the mixed set would give attempt i another system prompt than the file's rows had
    Writer(gen, out, systems="science").run(4, max_new_tokens=48, progress=False)
    assert len(out.read_text().splitlines()) == 4
    with pytest.raises(SpecrtError, match="choose one of mixed"):
        Writer(gen, tmp_path / "x.jsonl", systems="poetry")
    # a second file of the set, other seeds: ids of its own, so `specrt distill` can read both files
    other = tmp_path / "science2.jsonl"
    Writer(gen, other, systems="science", seed=500).run(2, max_new_tokens=48, progress=False)
    ids = [json.loads(line)["id"] for line in other.read_text().splitlines()]
    assert ids and all(i.startswith("magpie-science-s500-") for i in ids)
    assert not set(ids) & {json.loads(line)["id"] for line in out.read_text().splitlines()}


def test_every_system_set_renders_in_the_chat_template_and_gives_its_own_prefixes(gen, tmp_path):
    from specrt.tools.magpie import SYSTEM_SETS

    seen: set[tuple[int, ...]] = set()
    for name, systems in SYSTEM_SETS.items():
        writer = Writer(gen, tmp_path / f"{name}.jsonl", systems=name)
        assert writer.systems == list(systems), name  # the template takes every one of them
        for system, prefix in zip(systems, writer.prefixes, strict=True):
            if system is not None:
                assert system in gen.tokenizer.tok.decode(prefix), (name, system)
        mine = {tuple(p) for p in writer.prefixes} - seen if name != "mixed" else set()
        assert name == "mixed" or len(mine) == len(systems), f"{name} repeats another set's system prompt"
        seen |= {tuple(p) for p in writer.prefixes}
