"""Requests that arrive together with the same prompt prefix (a shared system prompt, the brief's
shared-prompt load test, a swarm's common context), with and without the scheduler holding a
request whose next prompt block another running request is computing, in one run.

    PYTHONPATH=. python bench/shared_prefix.py --model smollm2-135m-instruct --kv-cache-dtype fp4 \
        --num-requests 8 --prefix-len 1536 --suffix-len 32 --output-len 16

Per mode: wall time of the batch (all submitted at once), prompt tokens the model computed (the
rest came from the prefix cache), mean time to first token, and how many requests generated the
same tokens as in the first row (greedy; the two modes batch the prompt chunks differently, and
on random-token prompts a different rounding can flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from app import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], output_len: int, share: bool) -> dict:
    eng = llm.engine
    eng.reset_prefix_cache()
    eng.scheduler.share_inflight_prefixes = share
    hits0, prompt0 = eng.scheduler.num_prefix_hit_tokens_total, eng.scheduler.num_prompt_tokens_total
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - t0
    hits = eng.scheduler.num_prefix_hit_tokens_total - hits0
    prompt = eng.scheduler.num_prompt_tokens_total - prompt0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"share_inflight_prefixes": share, "wall_s": round(wall, 2), "prompt_tokens": prompt,
            "prompt_tokens_computed": prompt - hits, "mean_ttft_s": round(sum(ttft) / len(ttft), 2),
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--kv-cache-dtype", default="fp4")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1536)
    ap.add_argument("--suffix-len", type=int, default=32, help="distinct tokens after the shared prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="each mode this many times, alternating")
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=2048)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(args.suffix_len)] for _ in range(args.num_requests)]
    run(llm, prompts[:1], 2, True)  # warm-up
    rows = [run(llm, prompts, args.output_len, share) for _ in range(args.repeats) for share in (False, True)]
    first = rows[0]["tokens"]
    for r in rows:  # batch shapes differ between modes, so float rounding may flip a near-tie
        r["same_tokens_as_first_row"] = sum(a == b for a, b in zip(r.pop("tokens"), first))
        print(json.dumps({"model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
                          "requests": args.num_requests, "prefix_len": args.prefix_len, **r}), flush=True)


if __name__ == "__main__":
    main()
