"""Key smoothing folded into W_q / W_k against the fp4 key outlier slots, on SmolLM2's real K/V.

The fp4 cache keeps 4 outlier slots per key vector (docs/history.md: 6-14% of the Gluon decode
kernel's time, issue 19). Key outliers in Llama-class models sit largely in a few channels, and a
per-channel factor c moves them into the query where no cache format sees them: keys / c, queries
x c, the scores unchanged (QServe's SmoothAttention, Lin et al. 2024, arXiv:2405.04532). With
rotate-half RoPE, channels d and d + head_dim/2 rotate together, so they share one factor, and the
factor then commutes with RoPE: it folds into the rows of W_k (/ c) and W_q (x c, every query head of
the KV head) once, at load, with no work per step. Factors here are powers of two, so the folded
weights and every score are exact: with a bf16 cache the model's logits do not change at all.

This measures whether smoothing lets the cache drop (some of) the slots at the default's accuracy:
the factors come from the post-RoPE keys of a calibration text (the last pydoc topics, disjoint from
bench/kv_quality.py's held-out windows, which come from the first), c = stat^alpha normalized to a
geometric mean of 1 per head (stat: absmax or rms per channel pair), then the held-out NLL through the
engine's prompt logprobs exactly as bench/kv_quality.py section 5.

    python experiments/kv_smoothing.py --runs "bf16|none;fp4 DEFAULT: +4 out K g32, V g32, search|none;..."

A run is "<bench/kv_quality.py variant name>|<none | absmax:ALPHA | rms:ALPHA>". Results: docs/history.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import LLM, SamplingParams  # noqa: E402
from bench.kv_quality import VARIANTS, heldout_scores, heldout_windows, log, real_model_llm  # noqa: E402


def key_statistics(llm: LLM, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per layer, KV head and channel, the absmax and the rms of the keys the cache is given (post-RoPE),
    over the windows' prefill: {"absmax": [L, K, D], "rms": [L, K, D]} float32."""
    cache = llm.engine.kv_cache
    absmax, sumsq, count = {}, {}, {}
    store = cache.store

    def recording_store(layer, key, value, slot_mapping, nonfinite=None):
        k = key.float()  # [T, K, D]
        absmax[layer] = torch.maximum(absmax.get(layer, torch.zeros_like(k[0])), k.abs().amax(0))
        sumsq[layer] = sumsq.get(layer, 0) + k.pow(2).sum(0)
        count[layer] = count.get(layer, 0) + k.shape[0]
        return store(layer, key, value, slot_mapping, nonfinite)

    cache.store = recording_store
    try:
        llm.generate(windows, SamplingParams(max_tokens=0, prompt_logprobs=1))
    finally:
        cache.store = store
    layers = sorted(absmax)
    return {"absmax": torch.stack([absmax[i] for i in layers]),
            "rms": torch.stack([(sumsq[i] / count[i]).sqrt() for i in layers])}


def smoothing_factors(stat: torch.Tensor, alpha: float) -> torch.Tensor:
    """[L, K, D] per-channel statistic -> [L, K, D] powers of two c (keys / c, queries x c): stat^alpha
    with channels d and d + D/2 (a rotate-half RoPE pair) sharing the larger, normalized to a geometric
    mean of 1 per head, rounded to the nearest power of two."""
    half = stat.shape[-1] // 2
    pair = torch.maximum(stat[..., :half], stat[..., half:]).clamp_min(1e-6)
    log2c = alpha * pair.log2()
    log2c = torch.round(log2c - log2c.mean(-1, keepdim=True))
    return torch.cat([log2c, log2c], -1).exp2()


@torch.no_grad()
def fold_into_weights(model, factors: torch.Tensor) -> None:
    """W_k rows of channel d of KV head j / c[layer, j, d]; W_q rows of every query head of KV head j
    x the same (the fused qkv weight sees it: q_proj/k_proj are views of it)."""
    for layer, c in zip(model.model.layers, factors):
        attn = layer.self_attn
        kv, d = attn.num_kv_heads, attn.head_dim
        group = attn.num_heads // kv
        wk = attn.k_proj.weight.view(kv, d, -1)
        wq = attn.q_proj.weight.view(kv, group, d, -1)
        c = c.to(wk.device)
        wk.copy_((wk.float() / c[:, :, None]).to(wk.dtype))
        wq.copy_((wq.float() * c[:, None, :, None]).to(wq.dtype))


def run(kind: str, opts: dict | None, smoothing: str, args) -> dict:
    t0 = time.perf_counter()
    llm = real_model_llm(kind, opts, args.chunk)
    spread = None
    if smoothing != "none":
        stat, alpha = smoothing.split(":")
        stats = key_statistics(llm, heldout_windows(llm.tokenizer, args.calibration_tokens, args.window, from_end=True))
        factors = smoothing_factors(stats[stat], float(alpha))
        spread = float(factors.max() / factors.min())
        fold_into_weights(llm.engine.model, factors)
    lps, top1 = heldout_scores(llm, args.tokens, args.window)
    return {"nll": -lps.mean().item(), "top1": top1, "factor_spread": spread, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="';'-separated 'variant|smoothing' (the first is the reference)")
    ap.add_argument("--tokens", type=int, default=10240, help="held-out tokens (bench/kv_quality.py --real-tokens)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per prompt")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    by_name = {name: (kind, opts) for name, kind, opts in VARIANTS}
    rows, ref = [], None
    print("| variant | smoothing | max/min factor | NLL | dNLL vs first | TF top-1 |\n|---|---|---|---|---|---|")
    for spec in args.runs.split(";"):
        name, smoothing = spec.rsplit("|", 1)
        r = run(*by_name[name], smoothing, args)
        ref = ref or r
        row = {"variant": name, "smoothing": smoothing, "nll": r["nll"], "nll_delta": r["nll"] - ref["nll"],
               "teacher_forced_top1": (r["top1"] == ref["top1"]).float().mean().item(),
               "factor_spread": r["factor_spread"], "num_tokens": len(r["top1"])}
        rows.append(row)
        log(f"{name} | {smoothing}: {r['seconds']:.0f} s")
        spread = "-" if row["factor_spread"] is None else f"{row['factor_spread']:.0f}"
        print(f"| {name} | {smoothing} | {spread} | {row['nll']:.4f} | {row['nll_delta']:+.4f} | "
              f"{100 * row['teacher_forced_top1']:.1f}% |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
