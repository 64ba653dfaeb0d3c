"""The fp4 decode's split rule on the GPU: the default (decode_attention.whole_wave_splits, splits of
at least LONG_SPLIT_TOKENS where the SMs stay busy) against the earlier rule (splits of at least
MIN_SPLIT_TOKENS), on the same pages, the two alternated twice per row (best of each), with SDPA
bf16 as bench/kernels.py times it.

    python3 bench/fp4_splits.py --contexts 8192,32768,65536 --batches 1,2,4,8,32
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels as K  # noqa: E402 (bench/kernels.py: cases, pages, timing)

from app.kernels import decode_fp4_gluon  # noqa: E402
from app.kernels.decode_attention import (  # noqa: E402
    MIN_SPLIT_TOKENS, _fewest_splits_filling_waves, _num_sms, decode_attention, most_splits, num_splits_for)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768,65536")
    ap.add_argument("--batches", default="1,2,4,8,32")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # SDPA's note on GQA inputs, once per row
    sms = _num_sms(K.DEV)
    print("| model | ctx | batch | SDPA bf16 ms | splits (256-token rule) | ms | splits (default) | ms | "
          "default vs 256-token rule | 256-token rule vs SDPA | default vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    for row, q, table, sl, scale, nb in K.decode_cases(contexts, batches):
        hk = K.MODELS[row["model"]][1]
        kp, vp = K.random_fp4_pages(nb, hk, K.FORMATS[0]), K.random_fp4_pages(nb, hk, K.FORMATS[1])
        ctx, batch = row["ctx"], row["batch"]
        pps = decode_fp4_gluon.Launch(q, kp, vp, table, sl, 1.0, K.FORMATS[0].outliers).programs_per_sm()
        new = num_splits_for(batch, hk, ctx, K.DEV, K.GLUON_TILE, pps, whole_waves=True)
        old = _fewest_splits_filling_waves(batch * hk, ctx, K.GLUON_TILE, most_splits(ctx, K.GLUON_TILE, MIN_SPLIT_TOKENS),
                                           pps * sms)
        times = {"old": [], "new": []}
        for _ in range(2):
            for name, s in (("old", old), ("new", new)):
                times[name].append(K.bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, K.FORMATS,
                                                                    num_splits=s)))
        o, n, sdpa = min(times["old"]), min(times["new"]), row["sdpa_ms"]
        print(f"| {row['model']} | {ctx // 1024}k | {batch} | {sdpa:.4f} | {old} | {o:.4f} | {new} | {n:.4f} | "
              f"{o / n:.3f}x | {sdpa / o:.2f}x | {sdpa / n:.2f}x |", flush=True)
        kp = vp = None  # free the pages before the next row
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
