"""The Gluon fp4 decode kernel of this tree against other versions of it, side by side on one GPU.

    python3 experiments/fp4_ab.py --baseline HEAD~1 [--contexts 8192,32768] [--batches 1,8,32] [--json F]
    python3 experiments/fp4_ab.py --modules old=path/a.py,new=app/kernels/decode_fp4_gluon.py

Each version is a copy of app/kernels/decode_fp4_gluon.py: `--baseline REV` writes that revision's
(git show; on a machine with the repository) beside this tree's, `--modules name=file,...` names files
(on the GPU machine, which gets the working tree and no git). Every version runs its own Launch (its
split count from its own registers and shared memory, decode_attention's rule) and this tree's split
merge, on the same random pages and queries (bench/kernel_timings.py's cases, SDPA bf16 timed there too);
the versions are alternated `--rounds` times per row and the best of each kept (CUDA-graph replay
medians). Each version's output is compared with the first's (max abs difference: 0 when a change
only moves work around) and with float32 attention over the dequantized pages (worst relative error
per (sequence, head)). `--fraction F`: the sequences hold F of the context while the splits are
planned for all of it, as a decode graph runs them (SDPA's column stays the whole context's).
`--off64`: every version runs its build with 64-bit page offsets (what Launch takes for page arrays
of 2 GiB or more; forced on the cases' smaller pages, as tests/test_kernels_gluon.py does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.kernels.attention_ref import decode_attention_ref  # noqa: E402
from app.kernels.decode_attention import LOG2E, _merge_splits, _split_buffers, num_splits_for  # noqa: E402
from bench.kernel_timings import (FORMATS, MODELS, add_case_args, bench, best_times, decode_cases,  # noqa: E402
                                  random_fp4_pages, run_info, save_row)
from experiments.fp4_variants import worst_rel_err  # noqa: E402

MODULE = "app/kernels/decode_fp4_gluon.py"


def load_module(name: str, path: str):
    """A Python file (a copy of a product module, e.g. decode_fp4_gluon or store_kv) as its own module: Triton and
    Gluon read a kernel's source from its file."""
    spec = importlib.util.spec_from_file_location(f"fp4_ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def revision_file(rev: str, out_dir: str) -> str:
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{MODULE}"], capture_output=True, text=True,
                         check=True).stdout
    path = os.path.join(out_dir, f"decode_fp4_gluon_{rev.replace('~', '_').replace('/', '_')}.py")
    with open(path, "w") as f:
        f.write(src)
    return path


class Version:
    """One module's decode (kernel + this tree's merge) on one case; k_outliers (None: the format's)
    and maxnreg as Launch takes them."""

    def __init__(self, mod, q, kp, vp, table, sl, scale, ctx, k_outliers: int | None = None,
                 maxnreg: int | None = None, off64: bool = False):
        outliers = FORMATS[0].outliers if k_outliers is None else k_outliers
        # maxnreg only when given: a module's own Launch default (e.g. a capped variant's) stays in force
        cap = {} if maxnreg is None else {"maxnreg": maxnreg}
        self.launch = mod.Launch(q, kp, vp, table, sl, scale * LOG2E, outliers, **cap)
        if off64:  # the build that page arrays of 2 GiB or more take, forced on the case's smaller pages
            self.launch.constexprs["OFF64"] = True
        tile = mod.W * mod.TW
        ns = num_splits_for(q.shape[0], kp.codes.shape[2], ctx, q.device, tile, self.launch.programs_per_sm(),
                            fp4_rule=True)
        self.split_size, self.num_splits, self.out, self.part_o, self.part_lse = _split_buffers(q, ctx, ns, tile, None)

    def __call__(self):
        self.launch.run(self.out, self.part_o, self.part_lse, self.split_size, self.num_splits)
        _merge_splits(self.part_o, self.part_lse, self.out, self.num_splits)
        return self.out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="a git revision: its kernel module against this tree's")
    ap.add_argument("--modules", default=None, help="name=file,... (the first is the reference for equality)")
    ap.add_argument("--fraction", type=float, default=1.0,
                    help="sequences this fraction of the context long, splits planned for the whole context "
                         "(as a decode graph plans for max_model_len)")
    ap.add_argument("--off64", action="store_true",
                    help="every version runs its int64-offset build (what page arrays of 2 GiB or more take)")
    add_case_args(ap, rounds=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    if args.modules:
        paths = dict(item.split("=", 1) for item in args.modules.split(","))
    else:
        paths = {"baseline": revision_file(args.baseline or "HEAD", tmp), "tree": os.path.join(ROOT, MODULE)}
    mods = {name: load_module(name, path) for name, path in paths.items()}
    names = list(mods)
    results = run_info(versions=paths, rows=[])
    for row, q, table, sl, scale, nb in decode_cases([int(c) for c in args.contexts.split(",")],
                                                     [int(b) for b in args.batches.split(",")]):
        ctx, hk = row["ctx"], MODELS[row["model"]][1]
        kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
        if args.fraction != 1.0:
            sl = torch.full_like(sl, max(1, int(args.fraction * ctx)))
            row["seq_len"] = int(sl[0])
        versions = {n: Version(mods[n], q, kp, vp, table, sl, scale, ctx, off64=args.off64) for n in names}
        outs = {n: versions[n]().clone() for n in names}
        for n in names:  # run to run: a race would show here
            row[f"{n}_max_abs_diff_vs_itself"] = (versions[n]().float() - outs[n].float()).abs().max().item()
        if row["batch"] <= 8:  # the float32 reference is slow and large at big batches
            ref = decode_attention_ref(q, kp, vp, table, sl, scale, FORMATS)
            for n in names:
                row[f"{n}_rel_err"] = worst_rel_err(outs[n], ref)
        for n in names:
            row[f"{n}_max_abs_diff_vs_{names[0]}"] = (outs[n].float() - outs[names[0]].float()).abs().max().item()
            row[f"{n}_splits"] = versions[n].num_splits
            row[f"{n}_regs"], row[f"{n}_smem"] = versions[n].launch.resources()
            row[f"{n}_pair"] = versions[n].launch.constexprs_for(versions[n].split_size)["PAIR"]
        best = best_times(versions, args.rounds)
        for n in names:
            row[f"{n}_ms"] = best[n]
            row[f"{n}_vs_sdpa"] = row["sdpa_ms"] / best[n]
            row[f"{n}_speed_vs_{names[0]}"] = best[names[0]] / best[n]
        del kp, vp, versions, outs
        save_row(results, row, args.json)
    cols = " | ".join(f"{n} ms" for n in names)
    print(f"\n| model | ctx | batch | SDPA ms | {cols} | " + " | ".join(f"{n} vs {names[0]}" for n in names[1:])
          + " | " + " | ".join(f"{n} vs SDPA" for n in names) + " |")
    for r in results["rows"]:
        print(f"| {r['model']} | {r['ctx']} | {r['batch']} | {r['sdpa_ms']:.4f} | "
              + " | ".join(f"{r[f'{n}_ms']:.4f}" for n in names) + " | "
              + " | ".join(f"{r[f'{n}_speed_vs_{names[0]}']:.3f}x" for n in names[1:]) + " | "
              + " | ".join(f"{r[f'{n}_vs_sdpa']:.2f}x" for n in names) + " |")


if __name__ == "__main__":
    main()
