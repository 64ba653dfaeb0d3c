"""Offline throughput of the engine: prefill and decode tokens/s.

Random token prompts (no prefix-cache hits). Two runs with the same prompts:
  1. max_tokens=1: the time is prefill (plus one sampled token per request);
  2. max_tokens=N: decode tokens/s = (N - 1) * requests / (time of run 2 - time of run 1).

    python bench/offline_throughput.py --model tiny-llama --num-requests 64 --prompt-len 256 --output-len 64

Several KV formats side by side in one process (`--kv-cache-dtype fp4,bf16 --rounds 3`): one engine
per format, the formats' runs alternated (the order reversed every other round), each format's best
round reported, and its wall time over the first format's. On a noisy host this is the ratio to read;
separate processes (or servers run one after another) drift apart by more than the formats differ.
`fp4:T1/T2/...` is fp4 with those scale_targets (`--kv-cache-dtype fp4,fp4:6,bf16`: the default
search against plain NVFP4 scaling and bf16).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

import torch

from app import LLM, SamplingParams


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def kv_format(kind: str) -> dict:
    """LLM arguments of a --kv-cache-dtype entry: 'fp4:6/4' is fp4 with scale_targets (6.0, 4.0)."""
    dtype, _, targets = kind.partition(":")
    if not targets:
        return {"kv_cache_dtype": dtype}
    if dtype != "fp4":
        raise SystemExit(f"--kv-cache-dtype {kind}: only fp4 takes scale targets")
    return {"kv_cache_dtype": "fp4", "fp4": {"scale_targets": tuple(float(t) for t in targets.split("/"))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="bf16",
                    help="a KV format, or several, comma-separated; fp4:T1/T2/... is fp4 with those "
                         "scale_targets (e.g. fp4:6, plain NVFP4 scaling)")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds per format (the best is reported)")
    ap.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB (default: the engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0,
                    help="the engine's CPU threads (engine setting cpu_threads; 0: its default, this process's CPUs)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    kinds = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    if len(kinds) > 1 and args.device.startswith("cuda") and not args.kv_cache_memory:
        ap.error("several KV formats on a GPU need --kv-cache-memory: an engine sized by free memory would "
                 "count the earlier engines' caches as used, and the formats would get different budgets")
    extra = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}
    if args.threads:
        extra["cpu_threads"] = args.threads
    llms = {
        kind: LLM(
            model=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=args.prompt_len + args.output_len + 1, **kv_format(kind), **extra,
        )
        for kind in kinds
    }
    vocab = min(next(iter(llms.values())).engine.model_config.vocab_size, 259)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    for llm in llms.values():
        timed_generate(llm, prompts[:2], 4)  # warm-up
    times = {kind: {"prefill": [], "full": []} for kind in kinds}
    n_out = 0
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            times[kind]["prefill"].append(timed_generate(llms[kind], prompts, 1)[0])
            t_full, n_out = timed_generate(llms[kind], prompts, args.output_len)
            times[kind]["full"].append(t_full)
            print(f"round {r + 1}/{args.rounds} {kind}: prefill {times[kind]['prefill'][-1]:.2f} s, "
                  f"full {t_full:.2f} s", file=sys.stderr, flush=True)
    n_prompt = args.num_requests * args.prompt_len
    n_decode = n_out - args.num_requests
    first = kinds[0]
    for kind in kinds:
        t_prefill, t_full = min(times[kind]["prefill"]), min(times[kind]["full"])
        # decode: a round's full run less the same round's prefill, the best round
        t_decode = min(f - p for f, p in zip(times[kind]["full"], times[kind]["prefill"]))
        result = {
            "model": args.model,
            "kv_cache_dtype": kind,
            "requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "prefill_tok_s": round(n_prompt / t_prefill, 1),
            "decode_tok_s": round(n_decode / t_decode, 1) if t_decode > 0 else None,
            "total_tok_s": round((n_prompt + n_out) / t_full, 1),
            "wall_s": round(t_full, 2),
            "num_kv_blocks": llms[kind].engine.num_kv_blocks,
            "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
            else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "torch": torch.__version__,
        }
        if len(kinds) > 1:
            result[f"prefill_s_over_{first}"] = round(t_prefill / min(times[first]["prefill"]), 3)
            result[f"wall_s_over_{first}"] = round(t_full / min(times[first]["full"]), 3)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
