"""What each part of the Gluon fp4 decode kernel costs in time: the kernel against copies of itself
with a part taken out, side by side on one GPU (outputs of the ablated copies are wrong by design).

    python3 experiments/fp4_ablate.py [--contexts 8192,32768] [--batches 1,8,32] [--rounds 3] [--json F]
        [--variants full,bare,...] [--modules tree=app/kernels/decode_fp4_gluon.py,cand=experiments/ab/x.py]
    ncu ... python3 experiments/fp4_ablate.py --profile l2_bare [--model 8B --contexts 32768 --batches 32]
        (one variant, one case, a few calls and no timing: for a profiler)

Variants (each a copy of app/kernels/decode_fp4_gluon.py with one textual change, loaded as its own
module, or the same module launched differently):
  full            the kernel as it is
  no_outliers     launched without key outlier slots (K_KO = 0: no gathers, no slot words copied)
  no_unpack       the code-to-number maps (_K16_UNPACK_PTX, _V16_UNPACK_PTX, the fp16 ones: F16_DEFAULT)
                  replaced by register moves: the code words go to the tensor cores as fp16 pairs, and
                  with the scale operand unused the compiler may drop the scales' reads and conversion
  bare            no_unpack without outlier slots
  l2              every whole tile copies the split's first tile (tile pairs: its first two), the same
                  pages over and over: L2 hits, L1 hits for the 4- and 8-byte copies, almost no DRAM
                  traffic; all the arithmetic kept
  l2_bare         l2 and bare together: what is left is the copies' issue from L2, the ring's waits
                  and barriers, the MMAs, the softmax and the program's fixed costs
  codes_only      bare without the per-token metadata copies (K and V scale words, the exponent words):
                  only the code bytes' 16- and 8-byte copies, 128 of the 150 bytes per token and KV
                  head, so the memory path's cost with and without the 4-byte copies
  fixed           no tile attended (the split's loop and ring skipped): the launch, the query's loads and
                  scratch, the epilogue's stores and the split merge: what the call's grid costs with no
                  tile attended (it grows with the number of programs, which the planner sets from the length)
  no_merge, fixed_no_merge
                  full and fixed without the split merge kernel that follows the decode kernel (every
                  case timed has more than one split; with one there is no merge to leave out)
  gather_hit      every key outlier slot gathers one of the query's first two dimensions (index & 1): the
                  gathers' addresses stay in L1 whatever the copies evict (and still depend on the tile,
                  so they stay in the loop), so what their misses cost (the slots' copies, index
                  arithmetic and FMAs all kept)
  warp_partials   the epilogue without the warps' O^T sum through shared memory: every warp stores its own
                  rescaled O^T [D, heads] (all four to the same addresses), what writing each warp's state
                  as a split of its own for the merge would save in the decode kernel (4x the partial
                  stores kept; the merge's extra reads not counted)
With --modules, every variant of every named copy of the module (the same textual edits must apply
to each), named module:variant, alternated in one run. Each row also has SDPA bf16
(bench/kernel_timings.py's timing) and the time to read the fp4 cache once at the measured copy rate
(`floor`: all 150 bytes per token and KV head, outlier slots included, also for the variants that do
not read them). CUDA-graph replay medians, variants alternated --rounds times per row, best of each
kept; every variant compiled with at most 128 registers (4 programs per SM).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_timings import (FORMATS, FP4_BYTES, HEAD_DIM, MODELS, add_case_args, best_times,  # noqa: E402
                                  copy_bandwidth, decode_cases, random_fp4_pages, run_info, save_row)
from experiments.fp4_ab import Version, load_module  # noqa: E402
from experiments.profile_decode import profile_case  # noqa: E402

MODULE = os.path.join(ROOT, "app", "kernels", "decode_fp4_gluon.py")
K_MOVES = '"mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4;"'
V_MOVES = '"mov.b32 $0, $8; mov.b32 $1, $9; mov.b32 $2, $8; mov.b32 $3, $9; ' \
          'mov.b32 $4, $8; mov.b32 $5, $9; mov.b32 $6, $8; mov.b32 $7, $9;"'
EDITS = {
    "no_unpack": [("gl.constexpr(_K16_UNPACK_PTX)", f"gl.constexpr({K_MOVES})"),
                  ("gl.constexpr(_V16_UNPACK_PTX)", f"gl.constexpr({V_MOVES})")],
    "l2": [("start + j * (4 * TW), end, bt_row", "start, end, bt_row"),  # single tiles
           ("n1 = start + (2 * q) * (4 * TW)", "n1 = start")],  # tile pairs: every pair copies the first two
    "no_meta": [(f"_async_load({b}.index(stage), {src}, mc)", "pass") for b, src in
                [("bks", "k1.to(i32) + rows_c"), ("bek", "k2.to(i32) + (rows_c >> 2)"),
                 ("bev", "v2.to(i32) + (rows_c >> 2)"), ("bsv", "v1.to(i32) + rows_c")]],
    "no_tiles": [("end = gl.minimum(seq_len, start + split)", "end = gl.minimum(seq_len, start)")],
    "gather_hit": [('            EL: gl.constexpr = "evict_last"',
                    '            iw = iw & 0x01010101\n            EL: gl.constexpr = "evict_last"')],
    "warp_partials": [
        ("        o = gl.sum(acc * gl.expand_dims(wgt * gl.expand_dims(inv, 0), 1), 0)  # [D, NH]",
         "        o3 = acc * gl.expand_dims(wgt * gl.expand_dims(inv, 0), 1)  # [WN, D, NH]\n"
         "        o = gl.zeros([D, NH], gl.float32, layout=gl.SliceLayout(0, MMA))"),
        ("            gl.store(part_o_ptr + gl.expand_dims(part * D, 0) + gl.expand_dims(dim_o, 1), o, mask=o_mask)",
         "            po = part_o_ptr + gl.expand_dims(part * D, 0) + gl.expand_dims(dim_o, 1)\n"
         "            gl.store(gl.expand_dims(po, 0).broadcast_to(o3.shape), o3,\n"
         "                     mask=gl.expand_dims(o_mask, 0).broadcast_to(o3.shape))")],
}
VARIANTS = {  # name -> (source edits, key outlier slots launched with)
    "full": ([], None), "no_outliers": ([], 0), "no_unpack": (["no_unpack"], None), "bare": (["no_unpack"], 0),
    "l2": (["l2"], None), "l2_bare": (["l2", "no_unpack"], 0), "codes_only": (["no_unpack", "no_meta"], 0),
    "fixed": (["no_tiles"], None),
    "no_merge": ([], None), "fixed_no_merge": (["no_tiles"], None),
    "gather_hit": (["gather_hit"], None), "warp_partials": (["warp_partials"], None),
}
NO_MERGE = {"no_merge", "fixed_no_merge"}  # the decode kernel alone, without the split merge after it


class KernelOnly(Version):
    """A Version that launches the decode kernel and not the split merge."""

    def __call__(self):
        self.launch.run(self.out, self.part_o, self.part_lse, self.split_size, self.num_splits)
        return self.out


def ablated_source(edits: list[str], path: str = MODULE) -> str:
    """The module's source (decode_fp4_gluon.py or a copy) with the named EDITS applied (each must match
    exactly once)."""
    src = open(path).read()
    for e in edits:
        for old, new in EDITS[e]:
            if src.count(old) != 1:
                raise ValueError(f"ablation {e}: expected one '{old}' in {path}, found {src.count(old)}")
            src = src.replace(old, new)
    return src


def ablated_module(name: str, edits: list[str], out_dir: str, source: str = MODULE):
    name = name.replace(":", "_")  # module:variant, as a file and module name
    path = os.path.join(out_dir, f"decode_fp4_gluon_{name}.py")
    with open(path, "w") as f:
        f.write(ablated_source(edits, source))
    return load_module(name, path)


def make_run(name: str, mod, q, kp, vp, table, sl, scale: float, ctx: int) -> Version:
    """Variant `name`'s decode on one case (its module, its key outlier slots, capped at 128 registers;
    the kernel alone for the NO_MERGE variants); `name` may carry a module prefix (module:variant)."""
    variant = name.split(":")[-1]
    return (KernelOnly if variant in NO_MERGE else Version)(mod, q, kp, vp, table, sl, scale, ctx,
                                                            k_outliers=VARIANTS[variant][1], maxnreg=128)


def profile(name: str, mod, model: str, ctx: int, batch: int, calls: int = 4) -> None:
    """One variant on one case (experiments/profile_decode.profile_case), called a few times for a
    profiler to look at."""
    q, kp, vp, table, sl = profile_case(model, ctx, batch)
    run = make_run(name, mod, q, kp, vp, table, sl, HEAD_DIM ** -0.5, ctx)
    for _ in range(calls):
        run()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(ap, rounds=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which, comma-separated (full is always run)")
    ap.add_argument("--profile", default=None, choices=list(VARIANTS),
                    help="run this variant on one case (--model, the first of --contexts and --batches) and exit")
    ap.add_argument("--model", default="8B", choices=list(MODELS), help="--profile's shape")
    ap.add_argument("--modules", default=None,
                    help="name=file,...: ablate each of these copies of the module (default: the tree's alone)")
    args = ap.parse_args()
    if args.profile and args.modules:
        ap.error("--profile runs the tree's module; it does not take --modules")
    tmp = tempfile.mkdtemp()
    if args.profile:
        profile(args.profile, ablated_module(args.profile, VARIANTS[args.profile][0], tmp), args.model,
                int(args.contexts.split(",")[0]), int(args.batches.split(",")[0]))
        return
    variants = ["full"] + [n for n in args.variants.split(",") if n != "full"]
    unknown = [n for n in variants if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.modules:  # module:variant for every named copy
        sources = dict(item.split("=", 1) for item in args.modules.split(","))
        mods = {f"{m}:{v}": ablated_module(f"{m}:{v}", VARIANTS[v][0], tmp, src)
                for m, src in sources.items() for v in variants}
    else:
        mods = {v: ablated_module(v, VARIANTS[v][0], tmp) for v in variants}
    names = list(mods)
    copy_bw = copy_bandwidth()
    results = run_info(copy_GBps=copy_bw / 1e9, rows=[])
    for row, q, table, sl, scale, nb in decode_cases([int(c) for c in args.contexts.split(",")],
                                                     [int(b) for b in args.batches.split(",")]):
        hk = MODELS[row["model"]][1]
        kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
        # every variant capped at 128 registers, the kernel's own count, so that all run 4 programs per SM
        # (without the cap the ablated copies take up to 168 and fewer programs fit)
        runs = {n: make_run(n, mods[n], q, kp, vp, table, sl, scale, row["ctx"]) for n in names}
        best = best_times(runs, args.rounds)
        row["floor_ms"] = row["batch"] * row["ctx"] * hk * FP4_BYTES / copy_bw * 1e3
        for n in names:
            row[f"{n}_ms"] = best[n]
            row[f"{n}_regs"], row[f"{n}_smem"] = runs[n].launch.resources()
            row[f"{n}_splits"] = runs[n].num_splits
        del kp, vp, runs
        save_row(results, row, args.json)
    print(f"\ncopy {copy_bw / 1e9:.0f} GB/s; times in ms, share of {names[0]}'s time in parentheses")
    print("| model | ctx | batch | SDPA | floor | " + " | ".join(names) + " |")
    for r in results["rows"]:
        full = r[f"{names[0]}_ms"]
        print(f"| {r['model']} | {r['ctx']} | {r['batch']} | {r['sdpa_ms']:.4f} | {r['floor_ms']:.4f} | "
              + " | ".join(f"{r[f'{n}_ms']:.4f} ({r[f'{n}_ms'] / full:.2f})" for n in names) + " |")


if __name__ == "__main__":
    main()
