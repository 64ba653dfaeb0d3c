"""Summarize Nsight Compute's per-instruction (source page) counters of one kernel: where warps wait.

On the GPU machine (experiments/profile_decode.py runs one decode a few times):

    ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
        --section SpeedOfLight --import-source no -o prof -f \
        python3 experiments/profile_decode.py --model 8B --ctx 32768 --batch 32
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv

then anywhere: python experiments/ncu_source.py prof.csv [--top 25]

Prints the stall reasons over all samples, the share of samples before, inside and after the main
loop (experiments/kernel_sass.main_loop: the largest backward branch without the kernel's EXIT in its
range, among those with MMAs if any), the instructions with the most samples and their main reasons,
and the global and shared accesses by sectors / wavefronts with their ideal fraction.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.kernel_sass import main_loop, opcode  # noqa: E402


def number(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[str], list[dict]]:
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[head]
    return header, [dict(zip(header, r)) for r in rows[head + 1:] if len(r) >= len(header) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    header, data = read(args.csv)
    samples = "Warp Stall Sampling (All Samples)"
    stalls = [k for k in header if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(number(d[samples]) for d in data) or 1.0
    print(f"{len(data)} instructions, {total:.0f} samples")
    by_reason = {k: sum(number(d[k]) for d in data) for k in stalls}
    for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {k[6:]:20s} {100 * v / total:5.1f}%")

    span = main_loop([(int(d["Address"], 16), d["Source"]) for d in data])
    if span:
        j, i = span
        part = [sum(number(d[samples]) for d in seg) for seg in (data[:j], data[j:i + 1], data[i + 1:])]
        print(f"main loop: {i - j + 1} instructions; samples before {100 * part[0] / total:.1f}%, "
              f"in {100 * part[1] / total:.1f}%, after {100 * part[2] / total:.1f}%")

    by_op = collections.Counter()
    for d in data:
        if d["Source"].strip():
            by_op[opcode(d["Source"])] += number(d[samples])
    print("samples by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(12)))

    print(f"top {args.top} instructions (share of samples, main reasons):")
    for d in sorted(data, key=lambda d: -number(d[samples]))[:args.top]:
        s = number(d[samples])
        reasons = sorted(((k[6:], number(d[k])) for k in stalls), key=lambda kv: -kv[1])[:2]
        why = ", ".join(f"{k} {100 * v / max(s, 1):.0f}%" for k, v in reasons if v)
        print(f"  {100 * s / total:5.2f}%  {d['Address'][-5:]}  {d['Source'].strip()[:64]:64s} {why}")

    for title, col, ideal, excess in (
            ("global accesses: share of L2 sectors, ideal fraction", "L2 Theoretical Sectors Global",
             "L2 Theoretical Sectors Global Ideal", None),
            ("shared accesses: share of wavefronts, excess fraction", "L1 Wavefronts Shared", None,
             "L1 Wavefronts Shared Excessive")):
        rows = [d for d in data if number(d.get(col, "0")) > 0]
        t = sum(number(d[col]) for d in rows) or 1.0
        print(f"{title} (total {t:.0f}):")
        for d in sorted(rows, key=lambda d: -number(d[col]))[:12]:
            n = number(d[col])
            frac = number(d[ideal]) / n if ideal else number(d[excess]) / n
            print(f"  {100 * n / t:5.1f}%  {frac:.2f}  {d['Source'].strip()[:60]}")


if __name__ == "__main__":
    main()
