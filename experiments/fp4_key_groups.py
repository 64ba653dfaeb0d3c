"""The Gluon fp4 decode kernel on three key formats: the default (key groups of 32 with 4 outlier slots), key
groups of 8 without slots (81 bytes per key vector at head_dim 128 either way; FP4Config(key_group_size=8,
key_outliers=0)) and key groups of 16 with 4 slots (85 bytes: the accuracy option, FP4Config(key_group_size=16)),
side by side on one GPU.

    python3 experiments/fp4_key_groups.py [--contexts 8192,32768] [--batches 1,8,32] [--rounds 3] [--json F]

Timed: the kernel on default-format pages ("tree"), on the same pages launched without slots ("tree0",
wrong by design: what the slots cost), and on pages of the g8 format ("kg8": the KG8 build, a token's 16
key scale bytes one 16-byte copy, each code word multiplied by its own group's scale, no slot gathers),
on pages of the g16 format with slots ("kg16": the KG16 build, decode_fp4_gluon.KEY_GROUPS_OF_16), the value
pages shared; alternated --rounds times per row, best of each (CUDA-graph replay medians, with
the split merge). Accuracy: each format against float32 attention over its own pages (worst relative
error per (sequence, head)), on the timing rows up to batch 8 and on partial-tile lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.kernels.attention_ref import decode_attention_ref  # noqa: E402
from app.kernels import decode_fp4_gluon  # noqa: E402
from app.kernels.fp4 import FP4Format  # noqa: E402
from bench.kernel_timings import (DEV, FORMATS, HEAD_DIM, KG8, MODELS, add_case_args, best_times,  # noqa: E402
                                  decode_cases, random_fp4_pages, run_info, save_row, shuffled_tables)
from experiments.fp4_ab import Version  # noqa: E402
from experiments.fp4_variants import worst_rel_err  # noqa: E402

KG16 = FP4Format(group_size=16, outliers=FORMATS[0].outliers, scale_targets=FORMATS[0].scale_targets)


def versions(q, pages, table, sl, ctx):
    kp, kp8, kp16, vp = pages
    mod, scale = decode_fp4_gluon, HEAD_DIM ** -0.5
    return {"tree": Version(mod, q, kp, vp, table, sl, scale, ctx),
            "tree0": Version(mod, q, kp, vp, table, sl, scale, ctx, k_outliers=0),
            "kg8": Version(mod, q, kp8, vp, table, sl, scale, ctx, k_outliers=0),
            "kg16": Version(mod, q, kp16, vp, table, sl, scale, ctx)}


def errors(vs, q, pages, table, sl) -> dict:
    kp, kp8, kp16, vp = pages
    out = {}
    for name, kpages, fmt in (("tree", kp, FORMATS[0]), ("kg8", kp8, KG8), ("kg16", kp16, KG16)):
        ref = decode_attention_ref(q, kpages, vp, table, sl, HEAD_DIM ** -0.5, (fmt, FORMATS[1]))
        out[f"{name}_rel_err"] = worst_rel_err(vs[name](), ref)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(ap, rounds=3)
    args = ap.parse_args()
    assert KG8.group(HEAD_DIM) == 8 and KG8.bytes_per_vector(HEAD_DIM) == FORMATS[0].bytes_per_vector(HEAD_DIM)
    results = run_info(rows=[], accuracy=[], key_bytes=KG8.bytes_per_vector(HEAD_DIM))

    # accuracy on partial tiles and short / long splits, both shapes
    gen = torch.Generator().manual_seed(1)
    for model, (hq, hk) in MODELS.items():
        for lens in ([1000, 17, 333, 8192], [5000, 4999, 64, 1]):
            ctx = max(lens)
            table, nb = shuffled_tables(len(lens), ctx, gen)
            pages = (random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, KG8),
                     random_fp4_pages(nb, hk, KG16), random_fp4_pages(nb, hk, FORMATS[1]))
            q = torch.randn(len(lens), hq, HEAD_DIM, device=DEV).bfloat16()
            sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
            row = {"model": model, "lens": lens, **errors(versions(q, pages, table, sl, ctx), q, pages, table, sl)}
            results["accuracy"].append(row)
            print(json.dumps(row), flush=True)

    for row, q, table, sl, scale, nb in decode_cases([int(c) for c in args.contexts.split(",")],
                                                     [int(b) for b in args.batches.split(",")]):
        hk = MODELS[row["model"]][1]
        pages = (random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, KG8), random_fp4_pages(nb, hk, KG16),
                 random_fp4_pages(nb, hk, FORMATS[1]))
        vs = versions(q, pages, table, sl, row["ctx"])
        if row["batch"] <= 8:
            row.update(errors(vs, q, pages, table, sl))
        best = best_times(vs, args.rounds)
        for n in vs:
            row[f"{n}_ms"] = best[n]
            row[f"{n}_splits"] = vs[n].num_splits
            row[f"{n}_regs"], row[f"{n}_smem"] = vs[n].launch.resources()
            row[f"{n}_pair"] = vs[n].launch.constexprs_for(vs[n].split_size)["PAIR"]
        del pages, vs
        save_row(results, row, args.json)
    print("\n| model | ctx | batch | SDPA bf16 ms | tree ms | tree0 ms | kg8 ms | kg16 ms | kg8 vs tree | "
          "kg16 vs tree | tree0 vs tree | kg16 vs SDPA | splits (tree, kg8, kg16) | rel err (tree, kg8, kg16) |")
    for r in results["rows"]:
        err = (f"{r['tree_rel_err']:.4f}, {r['kg8_rel_err']:.4f}, {r['kg16_rel_err']:.4f}" if "kg8_rel_err" in r
               else "-")
        print(f"| {r['model']} | {r['ctx'] // 1024}k | {r['batch']} | {r['sdpa_ms']:.4f} | {r['tree_ms']:.4f} | "
              f"{r['tree0_ms']:.4f} | {r['kg8_ms']:.4f} | {r['kg16_ms']:.4f} | {r['tree_ms'] / r['kg8_ms']:.3f}x | "
              f"{r['tree_ms'] / r['kg16_ms']:.3f}x | {r['tree_ms'] / r['tree0_ms']:.3f}x | "
              f"{r['sdpa_ms'] / r['kg16_ms']:.2f}x | {r['tree_splits']}, {r['kg8_splits']}, {r['kg16_splits']} | "
              f"{err} |")


if __name__ == "__main__":
    main()
