"""store_kv as a decode step runs it: a few (token, KV head) vectors per layer, one launch per layer, all of
a step's layers in one CUDA graph; per layer = replay / layers. Each page format (bf16, fp8, fp4, fp8 keys with
fp4 values) at the launch the rule picks (`store_kv.launch_for`) and at other
(rows per program, warps) builds, alternated over --rounds, best of each. The pages each build writes are
compared with the rule's (bytes equal) so a faster build is a drop-in. --modules name=path,... times other
versions of app/kernels/store_kv.py beside this tree's (each build of each, alternated; labels "name:build").

    python3 experiments/store_small.py [--tokens 8,32,64,128,512] [--layers 32] [--rounds 3] [--json F]
    git show REV:app/kernels/store_kv.py > /tmp/store_old.py
    python3 experiments/store_small.py --modules old=/tmp/store_old.py --builds rule

Inputs as the engine passes them: K and V are views of one fused QKV projection output (Llama-3.1-8B: 32
query and 8 KV heads of 128), bf16, slots scattered over the layer's pages, the non-finite flag buffer on.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernel_timings import BLOCK, DEV, FORMATS, HEAD_DIM, bench, run_info, save_row  # noqa: E402
from app.kernels import paged  # noqa: E402
from app.kernels.store_kv import store_kv  # noqa: E402
from experiments.fp4_ab import load_module  # noqa: E402

Q_HEADS, KV_HEADS = 32, 8
NUM_BLOCKS = 1024
BUILDS = {"rule": (None, None), "r1w1": (1, 1), "r2w1": (2, 1), "r4w1": (4, 1), "r8w1": (8, 1), "r2w2": (2, 2),
          "r4w2": (4, 2), "r8w2": (8, 2), "r4w4": (4, 4), "r8w4": (8, 4), "r16w4": (16, 4)}
KINDS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "fp4": ("fp4", "fp4"), "fp8-fp4": ("fp8", "fp4")}


def layer_pages(kind: str, fmt):
    z = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, device=DEV)
    return paged.quantize_pages(z, kind, fmt if kind == "fp4" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8,32,64,128,512")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--builds", default=",".join(BUILDS))
    ap.add_argument("--modules", default="", help="name=path,...: other versions of app/kernels/store_kv.py")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    stores = {"": store_kv}
    for item in filter(None, args.modules.split(",")):
        name, path = item.split("=", 1)
        stores[f"{name}:"] = load_module(f"store_kv_{name}", path).store_kv
    results = {**run_info(layers=args.layers), "rows": []}
    gen = torch.Generator(device=DEV).manual_seed(0)
    builds = {f"{m}{b}": (fn, *BUILDS[b]) for m, fn in stores.items() for b in args.builds.split(",")}
    for kind in args.kinds.split(","):
        k_kind, v_kind = KINDS[kind]
        fmts = (FORMATS[0] if k_kind == "fp4" else None, FORMATS[1] if v_kind == "fp4" else None)
        layers = [(layer_pages(k_kind, fmts[0]), layer_pages(v_kind, fmts[1])) for _ in range(args.layers)]
        for tokens in (int(t) for t in args.tokens.split(",")):
            qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEV, generator=gen).bfloat16()
            k = qkv[:, Q_HEADS * HEAD_DIM:(Q_HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
            v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
            slots = torch.randperm(NUM_BLOCKS * BLOCK, device=DEV, generator=gen)[:tokens]
            flags = torch.zeros(tokens, dtype=torch.int32, device=DEV)

            def step(store, block_r, warps):
                launch = {"block_r": block_r, "num_warps": warps} if block_r else {}  # "rule": the version's own
                for kp, vp in layers:
                    store(k, v, slots, kp, vp, fmts, nonfinite=flags, **launch)

            def first_layer(store, block_r, warps) -> list[torch.Tensor]:
                # layer 0's pages from zero after one step of this build
                kp, vp = layers[0]
                for t in paged.page_args(kp) + paged.page_args(vp):
                    t.zero_()
                step(store, block_r, warps)
                return [t.clone() for t in paged.page_args(kp) + paged.page_args(vp)]

            ref = first_layer(store_kv, *BUILDS["rule"])
            equal = {name: all(torch.equal(a, b) for a, b in zip(ref, first_layer(*build)))
                     for name, build in builds.items()}
            best = {n: float("inf") for n in builds}
            for _ in range(args.rounds):
                for name, build in builds.items():
                    best[name] = min(best[name], bench(lambda: step(*build)))
            row = {"kind": kind, "tokens": tokens, "rows": tokens * KV_HEADS,
                   **{f"{n}_us_per_layer": round(1e3 * ms / args.layers, 3) for n, ms in best.items()},
                   "bytes_equal_to_rule": equal}
            save_row(results, row, args.json)
        del layers
        torch.cuda.empty_cache()
    names = list(builds)
    print("| format | tokens | " + " | ".join(f"{n} us/layer" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in results["rows"]:
        print(f"| {r['kind']} | {r['tokens']} | " + " | ".join(f"{r[f'{n}_us_per_layer']:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
