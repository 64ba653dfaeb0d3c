"""Decode attention per layer (bench/decode_layers.py's method: each layer its own cache, one CUDA graph of
the model's layers) with experiments/fp4_ablate.py's copies of the kernel beside the default: e.g. `fixed`
(no tile attended) and `no_merge` (no split merge), so that what a call costs whatever its length is
measured per layer too. The ablated copies' outputs are wrong by design and not checked.

    python3 experiments/fp4_layers_ablate.py --ablate full,fixed,no_merge,fixed_no_merge \
        [--contexts 8192,32768] [--batches 1,8,32] [--rounds 3] [--profile] [--json F]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import decode_layers  # noqa: E402
from bench.kernel_timings import HEAD_DIM  # noqa: E402
from experiments.fp4_ablate import VARIANTS, ablated_module, make_run  # noqa: E402


def main() -> None:
    ap = decode_layers.parser(__doc__)
    ap.add_argument("--ablate", default="full,fixed", help="fp4_ablate.py's variants, on the default pages")
    args = ap.parse_args()
    names = args.ablate.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"--ablate: unknown variants {unknown} (experiments/fp4_ablate.py has {sorted(VARIANTS)})")
    tmp = tempfile.mkdtemp()
    modules = {n: ablated_module(n, VARIANTS[n][0], tmp) for n in names}

    def ablated(variants, q, table, sl, ctx):
        base = variants["fp4"]  # the default format's pages, one Version per layer
        out = {}
        for name, mod in modules.items():
            runs = [make_run(name, mod, q, kp, vp, table, sl, HEAD_DIM ** -0.5, ctx) for kp, vp in base.pages]
            out[f"ablate_{name}"] = decode_layers.Layers(base.n, lambda i, runs=runs: runs[i]())
        return out

    decode_layers.run(args, extra=ablated, unchecked={f"ablate_{n}" for n in names}, ablate=args.ablate)


if __name__ == "__main__":
    main()
