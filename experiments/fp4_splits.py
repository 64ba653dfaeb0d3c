"""The fp4 decode's split rule on the GPU: the default (decode_attention.fp4_splits, the cheapest split
count by the busiest SM's work) against the rule it replaced (`whole_wave_splits` below: the fewest
splits within 3% of the least waves x tokens per split), on the same pages, the two alternated twice
per row (best of each), with SDPA bf16 as bench/kernel_timings.py times it. Rows where both rules pick the
same count are listed without timing.

    python3 experiments/fp4_splits.py --contexts 1024,8192,32768,65536 --batches 1,2,4,8,16,32,64
    python3 experiments/fp4_splits.py --sweep --contexts 8192,32768 --batches 1,8,32 --json F
    python3 experiments/fp4_splits.py --fractions 0.125,0.25,0.5,1 --contexts 8192,32768,65536 --batches 1,4,8,32

--fractions times the two rules' counts as a captured decode graph runs them: planned for the
row's context (the engine plans its graphs for max_model_len) while the sequences hold only that
fraction of it, rows where the counts differ only.

--sweep times the default rule's split count against a grid of fixed counts instead (powers of two
and their 1.5x, down to splits of one 64-token tile, and the default rule's count for 1-4 programs
per SM), on the same pages, alternated twice (best of each): how far the rule is from the best count
measured, row by row. The JSON keeps every count's time.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import kernel_timings as K  # noqa: E402 (bench/kernel_timings.py: cases, pages, timing)

from app.kernels import decode_fp4_gluon  # noqa: E402
from app.kernels.decode_attention import (  # noqa: E402
    MIN_SPLIT_TOKENS, DecodeOptions, _num_sms, decode_attention, most_splits, num_splits_for, split_plan)


def whole_wave_splits(pairs: int, seq_len: int, block_n: int, programs_per_sm: int, sms: int) -> int:
    """The rule fp4_splits replaced (issue 19's eighth step to its thirteenth), for comparison: the same
    most splits, then the fewest within 3% of the least waves x tokens per split (a wave: programs_per_sm
    x sms programs, however many of an SM's slots the last one fills)."""
    most = most_splits(seq_len, block_n, 512)
    if pairs * most < sms // 2:
        most = most_splits(seq_len, block_n, MIN_SPLIT_TOKENS)
    costs = []
    for s in range(1, most + 1):
        split, launched = split_plan(seq_len, s, block_n)
        costs.append(triton.cdiv(pairs * launched, programs_per_sm * sms) * split)  # waves x tokens
    least = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= 1.03 * least)


def cases(args):
    """bench/kernel_timings.py's decode cases for --contexts and --batches, each with its random fp4 pages
    and the Gluon kernel's programs per SM: (row, q, table, sl, scale, pages, pps), pages the list
    [K pages, V pages] (decode_attention(q, *pages, ...)), emptied before the next case so that its
    memory is free for the next one's."""
    warnings.filterwarnings("ignore")  # SDPA's note on GQA inputs, once per row
    for row, q, table, sl, scale, nb in K.decode_cases([int(c) for c in args.contexts.split(",")],
                                                       [int(b) for b in args.batches.split(",")]):
        hk = K.MODELS[row["model"]][1]
        pages = [K.random_fp4_pages(nb, hk, K.FORMATS[0]), K.random_fp4_pages(nb, hk, K.FORMATS[1])]
        pps = decode_fp4_gluon.Launch(q, *pages, table, sl, 1.0, K.FORMATS[0].outliers).programs_per_sm()
        yield row, q, table, sl, scale, pages, pps
        pages.clear()
        torch.cuda.empty_cache()


def rule_counts(row: dict, pps: int) -> tuple[int, int]:
    """(the replaced rule's, the default's) split count for a case, as the launcher runs them."""
    ctx, batch, hk = row["ctx"], row["batch"], K.MODELS[row["model"]][1]
    new = num_splits_for(batch, hk, ctx, K.DEV, K.GLUON_TILE, pps, fp4_rule=True)
    old = whole_wave_splits(batch * hk, ctx, K.GLUON_TILE, pps, _num_sms(K.DEV))
    return split_plan(ctx, old, K.GLUON_TILE)[1], split_plan(ctx, new, K.GLUON_TILE)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768,65536")
    ap.add_argument("--batches", default="1,2,4,8,32")
    ap.add_argument("--sweep", action="store_true", help="the rule's split count against a grid of counts")
    ap.add_argument("--json", default=None, help="--sweep: every count's time per row, written after each row")
    ap.add_argument("--fractions", default=None, help="planned for the context, sequences this long (fractions of it)")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    if args.fractions:
        return planned(args)
    print("| model | ctx | batch | SDPA bf16 ms | splits (replaced rule) | ms | splits (default) | ms | "
          "default vs replaced rule | replaced rule vs SDPA | default vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row, q, table, sl, scale, pages, pps in cases(args):
        ctx = row["ctx"]
        old, new = rule_counts(row, pps)
        head = f"| {row['model']} | {ctx // 1024}k | {row['batch']} | {row['sdpa_ms']:.4f} | {old} |"
        if new == old:
            print(f"{head} | {new} | | same count | | |", flush=True)
            continue
        times = {"old": [], "new": []}
        for _ in range(2):
            for name, s in (("old", old), ("new", new)):
                times[name].append(K.bench(lambda: decode_attention(q, *pages, table, sl, scale, ctx, K.FORMATS,
                                                                    options=DecodeOptions(num_splits=s))))
        o, n, sdpa = min(times["old"]), min(times["new"]), row["sdpa_ms"]
        print(f"{head} {o:.4f} | {new} | {n:.4f} | {o / n:.3f}x | {sdpa / o:.2f}x | {sdpa / n:.2f}x |", flush=True)


def planned(args) -> None:
    """--fractions: the rules' counts planned for the row's context, the sequences shorter."""
    fractions = [float(f) for f in args.fractions.split(",")]
    print("| model | planned ctx | batch | splits (replaced rule / default) | "
          + " | ".join(f"{f:g} of it: replaced ms, default vs replaced" for f in fractions) + " |")
    print("|---|---|---|---|" + "---|" * len(fractions))
    for row, q, table, sl, scale, pages, pps in cases(args):
        ctx = row["ctx"]
        old, new = rule_counts(row, pps)
        if new == old:
            continue
        cells = []
        for f in fractions:
            short = torch.full_like(sl, max(1, int(f * ctx)))
            times = {old: float("inf"), new: float("inf")}
            for _ in range(2):
                for s in (old, new):
                    times[s] = min(times[s], K.bench(lambda: decode_attention(q, *pages, table, short, scale, ctx,
                                                                              K.FORMATS,
                                                                              options=DecodeOptions(num_splits=s))))
            cells.append(f"{times[old]:.4f}, {times[old] / times[new]:.3f}x")
        print(f"| {row['model']} | {ctx // 1024}k | {row['batch']} | {old} / {new} | " + " | ".join(cells) + " |",
              flush=True)


def sweep_counts(ctx: int, tile: int, rule: int, other_rules: list[int]) -> list[int]:
    """The split counts --sweep times: 1, 2, 3, 4, 6, 8, 12, ... up to splits of one tile (at most 256),
    the rule's and the rule's for other occupancies, as the launcher runs them (distinct)."""
    most = most_splits(ctx, tile, tile)
    grid = [c for p in range(9) for c in (2 ** p, 3 * 2 ** p // 2) if 1 <= c <= most]
    return sorted({split_plan(ctx, s, tile)[1] for s in grid + [rule] + other_rules})


def sweep(args) -> None:
    """--sweep: per row, the default rule's split count against every count of sweep_counts."""
    results = K.run_info(rows=[])
    print("| model | ctx | batch | SDPA bf16 ms | rule splits | rule ms | best splits | best ms | rule vs best | "
          "best vs SDPA | counts timed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row, q, table, sl, scale, pages, pps in cases(args):
        ctx, batch, hk = row["ctx"], row["batch"], K.MODELS[row["model"]][1]
        rule = num_splits_for(batch, hk, ctx, K.DEV, K.GLUON_TILE, pps, fp4_rule=True)
        by_pps = {p: num_splits_for(batch, hk, ctx, K.DEV, K.GLUON_TILE, p, fp4_rule=True) for p in (1, 2, 3, 4)}
        counts = sweep_counts(ctx, K.GLUON_TILE, rule, list(by_pps.values()))
        times = {c: float("inf") for c in counts}
        for _ in range(2):
            for c in counts:
                times[c] = min(times[c], K.bench(lambda: decode_attention(q, *pages, table, sl, scale, ctx,
                                                                          K.FORMATS,
                                                                          options=DecodeOptions(num_splits=c))))
        best = min(times, key=times.get)
        rule_n = split_plan(ctx, rule, K.GLUON_TILE)[1]
        row.update(programs_per_sm=pps, rule_splits=rule_n, rule_splits_by_programs_per_sm=by_pps, best_splits=best,
                   ms={str(c): t for c, t in times.items()}, rule_ms=times[rule_n], best_ms=times[best])
        results["rows"].append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print(f"| {row['model']} | {ctx // 1024}k | {batch} | {row['sdpa_ms']:.4f} | {rule_n} | {times[rule_n]:.4f} | "
              f"{best} | {times[best]:.4f} | {times[best] / times[rule_n]:.3f}x | {row['sdpa_ms'] / times[best]:.2f}x | "
              f"{len(counts)} |", flush=True)


if __name__ == "__main__":
    main()
