"""Decode attention per layer as a decode step runs it: many layers back to back in one CUDA graph,
SDPA bf16 against the fp4 decode (the default format, and key groups of 8), side by side on one GPU.

    python3 bench/decode_layers.py [--contexts 8192,32768] [--batches 1,8,32] [--rounds 3] [--json F]
        [--budget-gb 90] [--splits 16,32,...] [--profile]

bench/kernel_timings.py times ONE attention call per CUDA-graph replay, L2 cleared before each: every
time carries the timing harness (about 4.4 us for one tiny kernel, 6.2 us for two, on an H200), and the
block table, lengths and query start cold. A decode step runs every layer's attention in one graph, with
the block table and lengths shared by the layers (so warm in L2 after the first) and the query just
written by the layer's RoPE. Here each layer has a
cache of its own (no layer reads another's K/V from L2), the query, block table and lengths are
shared, and one graph runs `layers` calls back to back: "per layer" = replay median / layers (L2
cleared before each replay by do_bench). `layers` = the model's (32 for 8B, 80 for 70B) or fewer where
the caches would not fit in --budget-gb (every format's caches are resident together). The single-call
time of layer 0 (bench/kernel_timings.py's method) is timed beside it in the same rounds.

Every row: SDPA bf16 (contiguous K/V, its fastest backend for this shape picked on the single call, the
same backend for the layered graph), decode_attention on default-format fp4 pages ("fp4") and on
KG8 pages ("kg8": FP4Config(key_group_size=8, key_outliers=0)), each variant on caches of its own. The
layered graph of every variant is checked against the last layer's call alone (the same output: a graph
that ran something else would show). --splits adds the default format with other split counts than
decode_attention plans (`fp4_planned_splits`). experiments/fp4_layers_ablate.py adds copies of the kernel
with a part taken out, through `run`'s `extra`. --profile adds, per variant, what the
profiler records of three replays of its layered graph: each kernel's device time per layer, their sum,
and the span from the first kernel's start to the last one's end (the difference is time between
kernels: launch gaps and dependency waits, and whatever the profiler's own tracing adds; span and sum
come from the replay with the shortest span, the per-kernel times are the replays' mean).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.kernels import decode_fp4_gluon  # noqa: E402
from app.kernels.decode_attention import DecodeOptions, decode_attention, num_splits_for, split_plan  # noqa: E402
from bench.kernel_timings import (BF16_BYTES, DEV, FORMATS, GLUON_TILE, HEAD_DIM, KG8, MODELS,  # noqa: E402
                                  add_case_args, best_sdpa, best_times, random_fp4_pages, run_info, save_row,
                                  sdpa_decode, shuffled_tables)

MODEL_LAYERS = {"8B": 32, "70B-TP8": 80}


def layers_for(model: str, batch: int, ctx: int, budget_bytes: float) -> int:
    """The model's layer count, or as many layers as fit in budget_bytes with the three variants' caches
    resident together (bf16 K+V, default fp4 K+V, KG8 K+V: each its own pages), at least 1."""
    hk = MODELS[model][1]
    fp4 = sum(f.bytes_per_vector(HEAD_DIM) for f in FORMATS)
    kg8 = KG8.bytes_per_vector(HEAD_DIM) + FORMATS[1].bytes_per_vector(HEAD_DIM)
    per_token = BF16_BYTES + fp4 + kg8
    per_layer = batch * ctx * hk * per_token
    return max(1, min(MODEL_LAYERS[model], math.floor(budget_bytes / per_layer)))


class Layers:
    """`n` calls of one attention variant, each on its own layer's cache; call(i) runs layer i alone
    (pages: the layers' (K, V) fp4 pages, where the variant has them)."""

    def __init__(self, n, call, pages=None):
        self.n, self.call, self.pages = n, call, pages

    def __call__(self):
        for i in range(self.n):
            out = self.call(i)
        return out


def sdpa_layers(q, batch, hk, ctx, n):
    """SDPA on n layers' contiguous bf16 K/V, every call on the backend fastest for layer 0's single call."""
    from torch.nn.attention import sdpa_kernel

    ks = [torch.randn(batch, hk, ctx, HEAD_DIM, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
    vs = [torch.randn_like(k) for k in ks]
    q4 = q[:, :, None]
    _, name = best_sdpa(q4, ks[0], vs[0])
    backend = getattr(torch.nn.attention.SDPBackend, name)

    def call(i):
        with sdpa_kernel(backend):
            return sdpa_decode(q4, ks[i], vs[i])
    return Layers(n, call), name


def fp4_layers(q, table, sl, nb, hk, ctx, n, kfmt):
    """decode_attention on n layers' fp4 pages (keys in kfmt, values in the default value format)."""
    kps = [random_fp4_pages(nb, hk, kfmt) for _ in range(n)]
    vps = [random_fp4_pages(nb, hk, FORMATS[1]) for _ in range(n)]
    fmts, scale = (kfmt, FORMATS[1]), HEAD_DIM ** -0.5
    return Layers(n, lambda i: decode_attention(q, kps[i], vps[i], table, sl, scale, ctx, fmts), list(zip(kps, vps)))


def rule_splits(q, base: Layers, table, sl, ctx) -> int:
    """The split count decode_attention plans for base's pages (fp4_splits at the kernel's programs per SM)."""
    kp, vp = base.pages[0]
    pps = decode_fp4_gluon.Launch(q, kp, vp, table, sl, 1.0, FORMATS[0].outliers).programs_per_sm()
    return num_splits_for(q.shape[0], kp.codes.shape[2], ctx, DEV, GLUON_TILE, pps, fp4_rule=True)


def split_layers(splits: int, base: Layers, q, table, sl, ctx):
    """decode_attention on base's pages (the default format) with `splits` splits instead of the planned count."""
    fmts, scale = FORMATS, HEAD_DIM ** -0.5
    return Layers(base.n, lambda i: decode_attention(q, *base.pages[i], table, sl, scale, ctx, fmts,
                                                     options=DecodeOptions(num_splits=splits)))


def captured(fn):
    """(a CUDA graph of fn, replayed once, and fn's output in the graph's memory), fn run eagerly first."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    return g, out


def graph_output(fn) -> torch.Tensor:
    """fn's output when replayed from a CUDA graph (a copy)."""
    g, out = captured(fn)
    out = out.clone()
    del g
    return out


def time_row(variants: dict, rounds: int, unchecked=()) -> dict:
    """Each variant's single call (layer 0) and whole layered graph, alternated `rounds` times, best of each;
    the layered graph's last output against the last layer's call alone (not for the `unchecked` variants,
    whose output nothing can be compared with)."""
    row = {}
    for name, lay in variants.items():
        if name in unchecked:
            continue
        alone = lay.call(lay.n - 1).float()
        row[f"{name}_layered_max_abs_diff"] = (graph_output(lay).float() - alone).abs().max().item()
    runs = {}
    for name, lay in variants.items():
        runs[f"{name}_single"] = (lambda lay: lambda: lay.call(0))(lay)
        runs[f"{name}_layered"] = lay
    best = best_times(runs, rounds)
    for name, lay in variants.items():
        row[f"{name}_single_ms"] = best[f"{name}_single"]
        row[f"{name}_per_layer_ms"] = best[f"{name}_layered"] / lay.n
    for name in variants:
        if name != "sdpa":
            row[f"{name}_single_vs_sdpa"] = row["sdpa_single_ms"] / row[f"{name}_single_ms"]
            row[f"{name}_per_layer_vs_sdpa"] = row["sdpa_per_layer_ms"] / row[f"{name}_per_layer_ms"]
    return row


def kernel_profile(lay: Layers, replays: int = 3) -> dict:
    """Per layer, from the profiler's kernel records of `replays` replays of lay's layered graph (L2 cleared
    before each, as do_bench does): each kernel's device time (us, by name, the replays' mean), and of the
    replay with the shortest span from the first kernel's start to the last one's end ("span") that span and
    its kernels' sum ("busy"): span - busy is the time between kernels (the profiler's tracing included)."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    g, _ = captured(lay)
    replays_seen, names = [], {}
    for _ in range(replays):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if not ks:
            return {"error": "the profiler recorded no kernels of the graph"}
        start = min(e.time_range.start for e in ks)
        end = max(e.time_range.end for e in ks)
        replays_seen.append((end - start, sum(e.time_range.elapsed_us() for e in ks)))
        for e in ks:
            names[e.name[:80]] = names.get(e.name[:80], 0.0) + e.time_range.elapsed_us() / replays / lay.n
    del g
    span, busy = min(replays_seen)  # the replay with the shortest span, its own sum
    return {"span_us": span / lay.n, "busy_us": busy / lay.n,
            "kernels_us": dict(sorted(names.items(), key=lambda kv: -kv[1]))}


def print_table(rows) -> None:
    print("\n| model | ctx | batch | layers | SDPA single ms | SDPA per layer ms | fp4 single ms | fp4 per layer ms | "
          "kg8 per layer ms | fp4 vs SDPA, single | fp4 vs SDPA, per layer | kg8 vs SDPA, per layer |")
    for r in rows:
        print(f"| {r['model']} | {r['ctx'] // 1024}k | {r['batch']} | {r['layers']} | {r['sdpa_single_ms']:.4f} | "
              f"{r['sdpa_per_layer_ms']:.4f} | {r['fp4_single_ms']:.4f} | {r['fp4_per_layer_ms']:.4f} | "
              f"{r['kg8_per_layer_ms']:.4f} | {r['fp4_single_vs_sdpa']:.2f}x | {r['fp4_per_layer_vs_sdpa']:.2f}x | "
              f"{r['kg8_per_layer_vs_sdpa']:.2f}x |")
    extra = sorted({k[:-len("_per_layer_ms")] for r in rows for k in r if k.endswith("_per_layer_ms")}
                   - {"sdpa", "fp4", "kg8"}, key=lambda e: (e.startswith("splits_"), len(e), e))
    if extra:
        cols = " | ".join(f"{e} per layer ms (vs fp4)" for e in extra)
        print(f"\n| model | ctx | batch | fp4 per layer ms | {cols} |")
        for r in rows:
            print(f"| {r['model']} | {r['ctx'] // 1024}k | {r['batch']} | {r['fp4_per_layer_ms']:.4f} | " + " | ".join(
                f"{r[f'{e}_per_layer_ms']:.4f} ({r[f'{e}_per_layer_ms'] / r['fp4_per_layer_ms']:.2f})"
                if f"{e}_per_layer_ms" in r else "-" for e in extra) + " |")
    if rows and "fp4_profile" in rows[0]:
        print("\n| model | ctx | batch | variant | per layer us (timed) | span us | busy us | between kernels us | "
              "kernels (us per layer) |")
        for r in rows:
            for name in [k[:-len("_profile")] for k in r if k.endswith("_profile")]:
                pr = r[f"{name}_profile"]
                if "error" in pr:
                    print(f"| {r['model']} | {r['ctx'] // 1024}k | {r['batch']} | {name} | {pr['error']} |")
                    continue
                ks = "; ".join(f"{k[:40]} {v:.2f}" for k, v in list(pr["kernels_us"].items())[:3])
                print(f"| {r['model']} | {r['ctx'] // 1024}k | {r['batch']} | {name} | "
                      f"{1e3 * r[f'{name}_per_layer_ms']:.2f} | {pr['span_us']:.2f} | {pr['busy_us']:.2f} | "
                      f"{pr['span_us'] - pr['busy_us']:.2f} | {ks} |")


def parser(doc: str = __doc__) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(ap, rounds=3)
    ap.add_argument("--budget-gb", type=float, default=90.0, help="device memory for the layers' caches")
    ap.add_argument("--splits", default="",
                    help="also the default format with these split counts (e.g. 16,32,64,128) instead of the plan's")
    ap.add_argument("--profile", action="store_true",
                    help="also each variant's kernels per layer from the profiler (device time, gaps)")
    return ap


def run(args, extra=None, unchecked=(), **info) -> dict:
    """Every (model, context, batch) row of args; `extra(variants, q, table, seq_lens, ctx)` may add variants
    (name -> Layers) built on the others' pages, `unchecked` names those whose output is not comparable."""
    results = run_info(rows=[], budget_gb=args.budget_gb, **info)
    gen = torch.Generator().manual_seed(0)
    for model, (hq, hk) in MODELS.items():
        for ctx in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                n = layers_for(model, batch, ctx, args.budget_gb * 1e9)
                table, nb = shuffled_tables(batch, ctx, gen)
                sl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
                q = torch.randn(batch, hq, HEAD_DIM, device=DEV).bfloat16()
                sdpa, backend = sdpa_layers(q, batch, hk, ctx, n)
                variants = {"sdpa": sdpa, "fp4": fp4_layers(q, table, sl, nb, hk, ctx, n, FORMATS[0]),
                            "kg8": fp4_layers(q, table, sl, nb, hk, ctx, n, KG8)}
                if extra is not None:
                    variants.update(extra(variants, q, table, sl, ctx))
                planned = rule_splits(q, variants["fp4"], table, sl, ctx)
                launched = {split_plan(ctx, planned, GLUON_TILE)[1]}
                for k in [int(x) for x in args.splits.split(",") if x]:
                    k = split_plan(ctx, min(k, 256), GLUON_TILE)[1]  # as launched (the merge takes <= 256)
                    if k not in launched:
                        launched.add(k)
                        variants[f"splits_{k}"] = split_layers(k, variants["fp4"], q, table, sl, ctx)
                row = {"model": model, "ctx": ctx, "batch": batch, "layers": n, "sdpa_backend": backend,
                       "fp4_planned_splits": planned, **time_row(variants, args.rounds, unchecked)}
                if args.profile:
                    row.update({f"{name}_profile": kernel_profile(lay) for name, lay in variants.items()})
                del variants, sdpa  # every layer's caches (no other reference holds them)
                save_row(results, row, args.json)
    print_table(results["rows"])
    return results


def main() -> None:
    run(parser().parse_args())


if __name__ == "__main__":
    main()
