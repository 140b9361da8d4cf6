"""What the serving prefix cache saves on traffic that repeats a long prefix: one document (the shipped
held-out prompts joined, about --doc-tokens tokens) as the system message, then one question after another,
each request alone, on a fresh server with and without the cache; then a second turn of each conversation.

    python scripts/prefix_reuse.py BUNDLE [--doc-tokens 800] [--questions 8] [--max-tokens 32] [--threads 2]

Prints, per configuration, the median time to first token and tokens/s over the questions, and the cached
prompt tokens; every answer is checked against the cache-off server's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specrt.cli.bench_cmd import prompt_set
from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler


def run(bundle: str, doc: str, questions: list[str], max_tokens: int, threads: int, mb: int) -> dict:
    gen = Generator(bundle, drafter="plain", max_seq_len=2048, slots=1, threads=threads)
    scheduler = Scheduler(gen, prefix_cache_mb=mb).start()
    ttft, rates, cached, answers = [], [], [], []
    try:
        for q in questions:
            chat = [{"role": "system", "content": doc}, {"role": "user", "content": q}]
            for _turn in range(2):  # the question, then a follow-up resending the first turn
                h = scheduler.submit(gen.tokenizer.encode_chat(chat), max_tokens)
                r = h.wait()
                ttft.append(h.first_token_at - h.submitted)  # the scheduler's clock: perf_counter
                rates.append(len(r.token_ids) / (time.perf_counter() - h.submitted))
                cached.append(h.cached_tokens or 0)
                answers.append(r.token_ids)
                chat = chat + [{"role": "assistant", "content": gen.tokenizer.decode(r.token_ids)},
                               {"role": "user", "content": "Say that again in one sentence."}]
    finally:
        scheduler.stop()
    return {"ttft_ms": round(1e3 * statistics.median(ttft), 1), "tok_s": round(statistics.median(rates), 1),
            "cached": sum(cached), "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--doc-tokens", type=int, default=800)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompts = [p.prompt for p in prompt_set("heldout", None)]
    doc = " ".join(prompts)[: args.doc_tokens * 4]  # ~4 characters a token
    questions = [f"In the text above, what is said about {p.split()[2]}?" for p in prompts[: args.questions]]
    print("| prefix cache | median TTFT ms | median tok/s (incl. TTFT) | cached prompt tokens | answers equal |")
    print("|---|---|---|---|---|")
    off = None
    for mb in (0, 256):
        r = run(args.bundle, doc, questions, args.max_tokens, args.threads, mb)
        off = off or r
        same = sum(a == b for a, b in zip(r["answers"], off["answers"], strict=True))
        print(f"| {f'{mb} MB' if mb else 'off'} | {r['ttft_ms']} | {r['tok_s']} | {r['cached']} | "
              f"{same}/{len(r['answers'])} |", flush=True)


if __name__ == "__main__":
    main()
