"""One decode configuration, called a few times, for a profiler (ncu) to look at.

    ncu --kernel-name regex:decode --launch-skip 2 --launch-count 1 \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 bench/profile_decode.py --model 8B --ctx 32768 --batch 32 [--kernel gluon|triton]

Pages are random valid fp4 encodings in the engine's default format (bench/kernel_timings.py's), shuffled
over the cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernel_timings import FORMATS, HEAD_DIM, MODELS, profile_case  # noqa: E402

from app.kernels.decode_attention import decode_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8B", choices=list(MODELS))
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kernel", default="gluon", choices=["gluon", "triton"])
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    q, kp, vp, table, sl = profile_case(args.model, args.ctx, args.batch)
    kw = {"fp4_kernel": True} if args.kernel == "triton" else {"gluon": True}
    for _ in range(args.calls):
        decode_attention(q, kp, vp, table, sl, HEAD_DIM ** -0.5, args.ctx, FORMATS, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
