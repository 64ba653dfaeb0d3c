"""Where a small decode launch's time goes: the fp8 and fp4 Gluon kernels at the launches that stay far from the
copy rate (70B-TP8 shapes, 1 KV head; 8B at batch 1), per split count, with and without the split merge, next to
the floor of a CUDA graph of one and two trivial kernels and SDPA bf16.

    python3 experiments/small_launches.py [--cases 70B-TP8:8192:8,70B-TP8:8192:1,...] [--json $OUT/small.json]

Each time is bench/kernel_timings.bench's (the median of a CUDA graph's replays, L2 cleared before each). "kernel
only" replaces decode_attention's split merge with nothing (its output is then not the attention: a timing, not
a result), so full - kernel only is what the merge kernel adds to the graph; the floor rows are what any graph of
one or two kernels costs in this timing. Splits: the rule's count (decode_attention's, recorded from its
buffers), then forced counts of powers of two while a split keeps at least 64 tokens (the count launched is shown:
splits are rounded up to whole tiles of the build).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.kernels import decode_attention as da  # noqa: E402
from app.kernels import fp8  # noqa: E402
from app.kernels.decode_attention import DecodeOptions, decode_attention  # noqa: E402
from bench.kernel_timings import (BLOCK, DEV, FORMATS, HEAD_DIM, MODELS, bench, best_sdpa,  # noqa: E402
                                  random_fp4_pages, run_info, shuffled_tables)

CASES = "70B-TP8:8192:1,70B-TP8:8192:8,70B-TP8:8192:32,70B-TP8:32768:1,70B-TP8:32768:8,8B:8192:1"


def floors() -> dict:
    """us of a graph holding one, and two, one-element kernels."""
    x = torch.zeros(1, device=DEV)
    return {"one_kernel_us": 1e3 * bench(lambda: x.add_(1)),
            "two_kernels_us": 1e3 * bench(lambda: (x.add_(1), x.add_(1)))}


def time_splits(call, ctx: int) -> list[dict]:
    """[{splits, launched, full_us, kernel_only_us, merge_us}] for the rule's count (splits "rule") and forced powers
    of two; launched: the count the launch ran (a split is rounded up to whole tiles of the build)."""
    seen: list[int] = []
    split_buffers = da._split_buffers

    def recording(*a, **k):
        r = split_buffers(*a, **k)
        seen.append(r[1])
        return r

    rows = []
    counts = [None] + [s for s in (1, 2, 4, 8, 16, 32, 64, 128) if ctx // s >= 64]
    merge = da._merge_splits
    for s in counts:
        da._split_buffers = recording
        try:
            full = 1e3 * bench(lambda: call(s))
        finally:
            da._split_buffers = split_buffers
        da._merge_splits = lambda *a: None
        try:
            alone = 1e3 * bench(lambda: call(s))
        finally:
            da._merge_splits = merge
        rows.append({"splits": "rule" if s is None else s, "launched": seen[-1], "full_us": round(full, 2),
                     "kernel_only_us": round(alone, 2), "merge_us": round(full - alone, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES, help="MODEL:CTX:BATCH,...")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {**run_info(), **floors(), "rows": []}
    print(json.dumps({k: v for k, v in results.items() if k != "rows"}), flush=True)
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        model, ctx, batch = case.split(":")
        ctx, batch = int(ctx), int(batch)
        hq, hk = MODELS[model]
        table, nb = shuffled_tables(batch, ctx, gen)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, hq, HEAD_DIM, device=DEV).bfloat16()
        # as kernel_timings: K and V separate tensors (one tensor as both can serve the second read from L2),
        # the fastest backend
        k = torch.randn(batch, hk, ctx, HEAD_DIM, device=DEV).bfloat16()
        v = torch.randn_like(k)
        sdpa_ms, backend = best_sdpa(q.unsqueeze(2), k, v)
        sdpa_us = 1e3 * sdpa_ms
        del k, v
        scale = HEAD_DIM ** -0.5
        k8, v8 = (fp8.fp8_quantize(torch.randn(nb, BLOCK, hk, HEAD_DIM, device=DEV, dtype=torch.bfloat16))
                  for _ in range(2))
        kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
        calls = {
            "fp8": lambda s: decode_attention(q, k8, v8, table, sl, scale, ctx, options=DecodeOptions(num_splits=s)),
            "fp4": lambda s: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS,
                                              options=DecodeOptions(num_splits=s)),
        }
        for fmt, call in calls.items():
            for r in time_splits(call, ctx):
                row = {"model": model, "ctx": ctx, "batch": batch, "format": fmt, "sdpa_us": round(sdpa_us, 2),
                       "sdpa_backend": backend, **r}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        del k8, v8, kp, vp
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print("\nmodel ctx batch format | splits (launched) | full us | kernel only us | merge us | SDPA us")
    for r in results["rows"]:
        print(f"{r['model']} {r['ctx']} {r['batch']} {r['format']} | {r['splits']} ({r['launched']}) | "
              f"{r['full_us']} | {r['kernel_only_us']} | {r['merge_us']} | {r['sdpa_us']}")


if __name__ == "__main__":
    main()
