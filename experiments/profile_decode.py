"""One decode configuration, called a few times, for a profiler (ncu) to look at.

    ncu --kernel-name regex:decode --launch-skip 2 --launch-count 1 \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 experiments/profile_decode.py --model 8B --ctx 32768 --batch 32 [--kernel gluon|triton] [--format fp8]

Pages are random valid fp4 encodings in the engine's default format (bench/kernel_timings.py's), or with
--format fp8 random bf16 K/V quantized to fp8 (the Gluon fp8 kernel, or with --kernel triton _decode_fp8_kernel),
shuffled over the cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.kernels import fp8  # noqa: E402
from app.kernels.decode_attention import DecodeOptions, decode_attention  # noqa: E402
from bench.kernel_timings import BLOCK, DEV, FORMATS, HEAD_DIM, MODELS, random_fp4_pages, shuffled_tables  # noqa: E402


def profile_case(model: str, ctx: int, batch: int, fmt: str = "fp4"):
    """One decode case for a profiler: (query, K pages, V pages, shuffled block table, lengths), random
    valid fp4 encodings in the engine's default formats (fmt "fp4") or random bf16 K/V quantized to fp8 (fmt
    "fp8"), every sequence `ctx` long."""
    hq, hk = MODELS[model]
    table, nb = shuffled_tables(batch, ctx, torch.Generator().manual_seed(0))
    if fmt == "fp8":
        kp, vp = (fp8.fp8_quantize(torch.randn(nb, BLOCK, hk, HEAD_DIM, device=DEV, dtype=torch.bfloat16))
                  for _ in range(2))
    else:
        kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
    q = torch.randn(batch, hq, HEAD_DIM, device=DEV).bfloat16()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return q, kp, vp, table, sl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8B", choices=list(MODELS))
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kernel", default="gluon", choices=["gluon", "triton"])
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--format", default="fp4", choices=["fp4", "fp8"])
    args = ap.parse_args()
    q, kp, vp, table, sl = profile_case(args.model, args.ctx, args.batch, args.format)
    triton_kernel = "fp8" if args.format == "fp8" else "fp4"
    options = DecodeOptions(kernel=triton_kernel if args.kernel == "triton" else "gluon")
    formats = (None, None) if args.format == "fp8" else FORMATS
    for _ in range(args.calls):
        decode_attention(q, kp, vp, table, sl, HEAD_DIM ** -0.5, args.ctx, formats, options=options)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
