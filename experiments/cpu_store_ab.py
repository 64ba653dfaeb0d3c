r"""The CPU fp4 store of this tree against a git revision's, in one process, alternated.

Builds app/kernels/cpu_kernels.cpp as it is at --baseline (git show) beside this tree's extension,
quantizes the same random K and V (--tokens tokens x 2 KV heads of 64, the peer model's shapes,
the default KV formats: keys 4 outlier slots, both groups of 32, 4 scale targets) with each, one
thread, the two builds alternated --rounds times, and reports the best ns per 64-value vector of
each and their ratio. Both builds' pages must be byte-equal (the script stops otherwise).

    python experiments/cpu_store_ab.py --baseline HEAD --tokens 4096 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load as build

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.engine.kv_cache import DEFAULT_FP4_FORMATS, KVCacheSpec, create_kv_cache  # noqa: E402
from app.kernels import cpu_kernels  # noqa: E402
H, D, BS = 2, 64, 16  # the peer model's KV heads and head_dim, the serve config's block size


def baseline_module(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:app/kernels/cpu_kernels.cpp"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="store-ab-"))
    path = tmp / "cpu_kernels_baseline.cpp"
    path.write_bytes(src)
    name = f"app_cpu_kernels_ab_{hashlib.sha1(src).hexdigest()[:12]}"
    print(f"building {rev}'s extension ({name})", flush=True)
    return build(name=name, sources=[str(path)], verbose=False, extra_cflags=cpu_kernels.CFLAGS,
                 extra_ldflags=cpu_kernels.LDFLAGS)


def empty_pages(tokens: int) -> tuple:
    """One layer's (K pages, V pages) of an empty fp4 KV cache with room for `tokens` tokens."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, compute_dtype=torch.float32)
    return create_kv_cache("fp4", spec, -(-tokens // BS), "cpu").layer_pages(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="HEAD", help="git revision whose cpu_kernels.cpp is the baseline")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    current = cpu_kernels.load()
    if current is None:
        sys.exit(f"no CPU kernels extension: {cpu_kernels.problem()}")
    base = baseline_module(args.baseline)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(args.tokens, generator=gen)
    best: dict[tuple[str, str], float] = {}
    for i, (side, fmt) in enumerate(zip("KV", DEFAULT_FP4_FORMATS)):
        x = torch.randn(args.tokens, H, D, generator=gen)
        targets = [float(t) for t in fmt.scale_targets]
        out = {}
        for _ in range(args.rounds):
            for label, mod in (("baseline", base), ("current", current)):
                pages = list(empty_pages(args.tokens)[i])
                t0 = time.perf_counter()
                mod.store_fp4(x, slots, pages, fmt.group(D), targets)
                dt = time.perf_counter() - t0
                best[side, label] = min(best.get((side, label), float("inf")), dt)
                out[label] = pages
        for a, b in zip(out["baseline"], out["current"]):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                sys.exit(f"{side}: the two builds' pages differ")
    vectors = args.tokens * H
    print(f"\n`python experiments/cpu_store_ab.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, one thread\n")
    print(f"| side | {args.baseline} ns/vector | this tree ns/vector | this tree / {args.baseline} |")
    print("|---|---|---|---|")
    for side in "KV":
        b, c = best[side, "baseline"] / vectors * 1e9, best[side, "current"] / vectors * 1e9
        print(f"| {side} | {b:.0f} | {c:.0f} | {c / b:.3f}x |")


if __name__ == "__main__":
    main()
