"""The Gluon fp4 decode kernel's code-to-number variants side by side on one GPU (issue 19), in one run.

    python3 experiments/fp4_variants.py --json $OUT/variants.json [--skip accuracy|decode] [--variants bf16,fp16]

Variants (decode_attention's fp16= on each call; --variants picks):
  default  the committed default (decode_fp4_gluon.F16_DEFAULT);
  bf16     bf16 MMAs, the PTX unpack multiplying by the group scale (paged._FP4_UNPACK_BODY);
  fp16     fp16 MMAs: E2M1 -> E4M3 by shifts, the hardware's E4M3 -> fp16x2 conversion (the probabilities
           in fp16, the values' exponents in the softmax max).
1. accuracy: each variant against float32 attention over the dequantized pages (decode_attention_ref)
   and against the Triton fp4 kernel, per (sequence, query head), as tests/test_kernels_gluon.py
   checks them (bound 1e-2), plus values scaled by 1e4 and 1e-4 (the fp16 probabilities' range);
2. decode ms: SDPA bf16 (fastest backend) and each variant on the same pages, Llama-3.1-8B per GPU
   (32 q / 8 KV heads) and 70B at TP 8 (8 / 1), as bench/kernel_timings.py times them; at batch 1 and 32k,
   the default at other split counts (fewer, longer splits), and its kernel and its split merge
   (decode_attention._merge_splits) timed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from app.kernels import decode_fp4_gluon  # noqa: E402
from app.kernels.attention_ref import decode_attention_ref  # noqa: E402
from app.kernels.decode_attention import (  # noqa: E402
    DecodeOptions, _merge_splits, _split_buffers, decode_attention, num_splits_for)
from app.kernels.fp4 import FP4Format  # noqa: E402
from bench.kernel_timings import (DEV, FORMATS, FP4_BYTES, GLUON_TILE, MODELS, bench,  # noqa: E402
                           copy_bandwidth, decode_cases, random_fp4_pages, run_info)
from kernels_testing import cuda_fp4_pages  # noqa: E402

VARIANTS = {"default": None, "bf16": False, "fp16": True}  # decode_attention's fp16


SEQ_LENS = [1, 15, 16, 17, 63, 64, 65, 1025, 1027, 4099]


def worst_rel_err(out, ref):
    if out.isnan().any():
        return float("nan")
    diff = (out.float() - ref.float()).norm(dim=-1)
    return (diff / ref.float().norm(dim=-1).clamp_min(1e-30)).max().item()


def accuracy(results: dict, names) -> None:
    rows = results["accuracy"] = []
    cases = [(kvh, g, ko, ns, st, vm) for kvh, g in ((8, 4), (1, 8), (2, 1), (2, 3)) for ko in (4, 0)
             for ns in (None, 7) for st in (4,) for vm in (1.0,)]
    cases += [(8, 4, 4, None, 0, 1.0), (8, 4, 4, 1, 4, 1.0), (8, 4, 4, None, 4, 1e4), (8, 4, 4, None, 4, 1e-4),
              (1, 8, 4, None, 4, 1e4), (1, 8, 4, None, 4, 1e-4)]
    for kvh, group, ko, ns, st, vm in cases:
        formats = (FP4Format(group_size=32, outliers=ko), FP4Format(group_size=32))
        table, kp, vp = cuda_fp4_pages(SEQ_LENS, kvh, 16, formats, seed=kvh + group, v_mult=vm)
        query = torch.randn(len(SEQ_LENS), kvh * group, 128, device="cuda").bfloat16()
        lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
        ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, formats)
        tri = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                               options=DecodeOptions(kernel="fp4"))
        row = {"kv_heads": kvh, "group": group, "key_outliers": ko, "num_splits": ns, "stages": st, "v_mult": vm}
        for name in names:
            try:
                out = torch.full_like(query, float("nan"))
                decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats, out=out,
                                 options=DecodeOptions(kernel="gluon", num_splits=ns, num_stages=st,
                                                       fp16=VARIANTS[name]))
                row[f"{name}_vs_ref"] = worst_rel_err(out, ref)
                row[f"{name}_vs_triton"] = worst_rel_err(out, tri)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row[f"{name}_error"] = repr(e)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)


def decode(results: dict, copy_bw: float, contexts, batches, names, save=lambda: None) -> None:
    rows = results["decode"] = []
    registers = results["registers"] = {}  # (group, key slots, maxnreg, stages, fp16) -> registers per thread
    for row, q, table, sl, scale, nb in decode_cases(contexts, batches):
        ctx, batch, hk = row["ctx"], row["batch"], MODELS[row["model"]][1]
        kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
        for name in names:
            row[f"{name}_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS,
                                                               options=DecodeOptions(fp16=VARIANTS[name])))
            launch = decode_fp4_gluon.Launch(q, kp, vp, table, sl, 1.0, FORMATS[0].outliers, fp16=VARIANTS[name])
            c = launch.constexprs
            registers[str((c["GROUP"], c["K_KO"], None, c["STAGES"], c["F16"]))] = launch.resources()[0]
            row[f"{name}_vs_sdpa"] = row["sdpa_ms"] / row[f"{name}_ms"]
            fp4_bytes = batch * ctx * hk * FP4_BYTES
            row[f"{name}_bw_pct_copy"] = 100 * fp4_bytes / (row[f"{name}_ms"] * 1e-3) / copy_bw
        row["default_fp16"] = decode_fp4_gluon.F16_DEFAULT
        if batch == 1 and ctx == 32768:
            for ns in (32, 64, 128):
                row[f"default_splits{ns}_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx,
                                                                               FORMATS,
                                                                               options=DecodeOptions(num_splits=ns)))
            # the default's kernel and its split merge, apart
            launch = decode_fp4_gluon.Launch(q, kp, vp, table, sl, scale * 1.4426950408889634,
                                             FORMATS[0].outliers)
            ns = num_splits_for(batch, hk, ctx, DEV, GLUON_TILE, launch.programs_per_sm(), fp4_rule=True)
            split_size, ns, out, part_o, part_lse = _split_buffers(q, ctx, ns, GLUON_TILE, None)
            row["default_num_splits"] = ns
            row["default_kernel_only_ms"] = bench(lambda: launch.run(out, part_o, part_lse, split_size, ns))
            row["default_merge_only_ms"] = bench(lambda: _merge_splits(part_o, part_lse, out, ns))
        del kp, vp
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--contexts", default="1024,8192,32768,65536")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--skip", default="", help="accuracy,decode")
    args = ap.parse_args()
    names = args.variants.split(",")
    results = run_info()

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if "accuracy" not in args.skip:
        accuracy(results, names)
        save()
    if "decode" not in args.skip:
        results["copy_bw_GBps"] = copy_bandwidth() / 1e9
        decode(results, results["copy_bw_GBps"] * 1e9, [int(c) for c in args.contexts.split(",")],
               [int(b) for b in args.batches.split(",")], names, save)
        save()


if __name__ == "__main__":
    main()
