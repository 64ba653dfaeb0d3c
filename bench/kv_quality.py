"""KV cache quality ablation: which fp4 options to make the default (DESIGN.md section 4).

Every variant is measured these ways:
  1. the trained stories260K model (head_dim 8, so the fp4 group is 8): teacher-forced NLL on
     tests/data/tinystories_eval.txt and how often its argmax next token equals bf16's ("TF top-1"),
     and greedy agreement with bf16 KV (LLM.generate); an fp32-KV row shows the metrics' noise floor;
  2. synthetic Llama-3-shaped KV at head_dim 128: relative error of decode attention outputs;
  3. bytes per token per KV head at head_dim 128 (K + V, all metadata) and capacity vs bf16;
  4. for fp8, plain fp4 and the default: the loss with only K or only V quantized;
  5. a real instruct model, SmolLM2-135M-Instruct (head_dim 64), over held-out English text (the
     documentation topics CPython ships in pydoc_data.topics), through the engine's own prompt-logprob
     path (SamplingParams.prompt_logprobs, chunked prefill, every key read back from the cache):
     NLL per token and teacher-forced top-1 agreement vs bf16 KV, for --real-variants.
Markdown tables go to stdout, progress to stderr. Results: bench/RESULTS.md.

    python bench/kv_quality.py --json /tmp/kv_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from app import LLM, SamplingParams
from app.config import FP4Config
from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import DenseKVCache, KVCacheSpec, kv_bytes_per_token, side_bytes_per_vector
from app.engine.models.decoder import apply_rope, rope_cos_sin
from app.kernels import fp4, fp8
from app.kernels.attention_ref import causal_attention_ref

THREADS = 2  # torch threads of every run (recorded in the output)

REPO = Path(__file__).resolve().parent.parent
EVAL_TEXT = REPO / "tests/data/tinystories_eval.txt"
HEAD_DIM = 128
BF16_BYTES = 2 * HEAD_DIM * 2  # K + V per token per KV head

SEARCH = (6.0, 5.0, 4.5, 4.0)
# Plain NVFP4-style fp4: groups of 16, no outliers, no rotation, amax scaled to 6. Variants override it.
PLAIN = dict(key_group_size=16, value_group_size=16, key_outliers=0, value_outliers=0, scale_targets=(6.0,))


def fp4_variant(**overrides) -> dict:
    return {**PLAIN, **overrides}


# (name, kv_cache_dtype, FP4Config options or None)
VARIANTS = [
    ("bf16", "bf16", None),
    ("fp8 per-token-head", "fp8", None),
    ("fp4 plain", "fp4", fp4_variant()),
    ("fp4 +1 out K,V", "fp4", fp4_variant(key_outliers=1, value_outliers=1)),
    ("fp4 +2 out K,V", "fp4", fp4_variant(key_outliers=2, value_outliers=2)),
    ("fp4 +4 out K,V", "fp4", fp4_variant(key_outliers=4, value_outliers=4)),
    ("fp4 +1 out K", "fp4", fp4_variant(key_outliers=1)),
    ("fp4 +2 out K", "fp4", fp4_variant(key_outliers=2)),
    ("fp4 +rot", "fp4", fp4_variant(rotate=True)),
    ("fp4 +rot +1 out K,V", "fp4", fp4_variant(key_outliers=1, value_outliers=1, rotate=True)),
    ("fp4 +rot +1 out K", "fp4", fp4_variant(key_outliers=1, rotate=True)),
    ("fp4 zscore z=2 <=2 out K,V", "fp4", fp4_variant(key_outliers=2, value_outliers=2, outlier_mode="zscore",
                                                       zscore=2.0)),
    # Spending the bytes on K (V barely matters in section 1) and choosing each group's scale.
    ("fp4 +1 out K, search 6/4", "fp4", fp4_variant(key_outliers=1, scale_targets=(6.0, 4.0))),
    ("fp4 +1 out K, search", "fp4", fp4_variant(key_outliers=1, scale_targets=SEARCH)),
    ("fp4 +2 out K, V g32", "fp4", fp4_variant(key_outliers=2, value_group_size=32)),
    ("fp4 +2 out K, V g32, search", "fp4", fp4_variant(key_outliers=2, value_group_size=32, scale_targets=SEARCH)),
    ("fp4 +3 out K, V g64, search", "fp4", fp4_variant(key_outliers=3, value_group_size=64, scale_targets=SEARCH)),
    ("fp4 +3 out K, V g128, search", "fp4", fp4_variant(key_outliers=3, value_group_size=128, scale_targets=SEARCH)),
    ("fp4 +4 out K,V, search", "fp4", fp4_variant(key_outliers=4, value_outliers=4, scale_targets=SEARCH)),
    ("fp4 +4 out K g32, V g64, search", "fp4", fp4_variant(key_outliers=4, key_group_size=32, value_group_size=64,
                                                            scale_targets=SEARCH)),
    ("fp4 +5 out K g32, V g128, search", "fp4", fp4_variant(key_outliers=5, key_group_size=32,
                                                             value_group_size=128, scale_targets=SEARCH)),
    # Section 5 (a real model's K/V): where the default's error comes from.
    ("fp4 +4 out K g32, V g16, search", "fp4", fp4_variant(key_outliers=4, key_group_size=32, scale_targets=SEARCH)),
    ("fp4 +4 out K, V g16, search", "fp4", fp4_variant(key_outliers=4, scale_targets=SEARCH)),
    ("fp4 +4 out K,V g32, search", "fp4", fp4_variant(key_outliers=4, value_outliers=4, key_group_size=32,
                                                       value_group_size=32, scale_targets=SEARCH)),
    ("fp4 +rot +4 out K g32, V g32, search", "fp4", fp4_variant(key_outliers=4, key_group_size=32,
                                                                 value_group_size=32, scale_targets=SEARCH,
                                                                 rotate=True)),
    ("fp4 +4 out K g16, V g32, search", "fp4", fp4_variant(key_outliers=4, value_group_size=32,
                                                            scale_targets=SEARCH)),
    ("fp4 +8 out K g16, V g16, search", "fp4", fp4_variant(key_outliers=8, scale_targets=SEARCH)),
    ("fp4 +4 out K g8, V g16, search", "fp4", fp4_variant(key_outliers=4, key_group_size=8, scale_targets=SEARCH)),
    # One scale per token (a group of 128 is the whole vector at head_dim 128 and, as gcd(128, 64), at
    # SmolLM2's 64): a decode kernel folds such a scale into the score (K) or the probability (V)
    # instead of multiplying every code (bench/RESULTS.md, issue 19's eighteenth step).
    ("fp4 +4 out K g128, V g32, search", "fp4", fp4_variant(key_outliers=4, key_group_size=128,
                                                             value_group_size=32, scale_targets=SEARCH)),
    ("fp4 +4 out K g32, V g128, search", "fp4", fp4_variant(key_outliers=4, key_group_size=32,
                                                             value_group_size=128, scale_targets=SEARCH)),
    ("fp4 +4 out K,V g128, search", "fp4", fp4_variant(key_outliers=4, key_group_size=128,
                                                        value_group_size=128, scale_targets=SEARCH)),
    ("fp4 +5 out K,V g128, search", "fp4", fp4_variant(key_outliers=5, key_group_size=128,
                                                        value_group_size=128, scale_targets=SEARCH)),
    ("fp4 K,V g128, search", "fp4", fp4_variant(key_group_size=128, value_group_size=128, scale_targets=SEARCH)),
    ("fp4 K g32, V g32, search", "fp4", fp4_variant(key_group_size=32, value_group_size=32, scale_targets=SEARCH)),
    # no key slots, their bytes spent on finer key groups: g8 keys are the default's 81 B per key vector
    ("fp4 K g16, V g32, search", "fp4", fp4_variant(key_group_size=16, value_group_size=32, scale_targets=SEARCH)),
    ("fp4 K g8, V g32, search", "fp4", fp4_variant(key_group_size=8, value_group_size=32, scale_targets=SEARCH)),
    # Fewer key slots than the default's 4 (each slot is a per-token query gather in the decode kernels)
    ("fp4 +1 out K g32, V g32, search", "fp4", fp4_variant(key_outliers=1, key_group_size=32, value_group_size=32,
                                                           scale_targets=SEARCH)),
    ("fp4 +2 out K g32, V g32, search", "fp4", fp4_variant(key_outliers=2, key_group_size=32, value_group_size=32,
                                                           scale_targets=SEARCH)),
    ("fp4 +3 out K g32, V g32, search", "fp4", fp4_variant(key_outliers=3, key_group_size=32, value_group_size=32,
                                                           scale_targets=SEARCH)),
    ("fp4 DEFAULT: +4 out K g32, V g32, search", "fp4", {}),  # FP4Config() as shipped
    # kv_cache_dtype fp8-fp4: keys as fp8, values in FP4Config()'s value format (its key options unused)
    ("fp8-fp4: fp8 K, DEFAULT fp4 V", "fp8-fp4", {}),
]
# Section 1 only: how far fp32 KV is from bf16 KV, the noise floor of the stories260K metrics.
CALIBRATION = ("fp32 KV (calibration)", "fp32", None)

PROMPTS = [
    "Once upon a time, there was a brave little dog named Spot.",
    "One sunny morning, Lucy found a shiny key under her bed.",
    "Billy the bunny wanted to jump higher than all his friends.",
    "In a small town, there lived a girl who loved to sing.",
    "Anna and her grandpa went fishing at the lake.",
    "There once was a big green dragon who was afraid of the dark.",
    "Sam got a new bike for his birthday.",
    "The little duck could not find its mom.",
    "One day, Kate and Jim found a box in the attic.",
    "Mommy said, \"Today we are going to the zoo!\"",
    "A tiny ant named Andy carried a crumb across the yard.",
    "It was snowing outside, and Ben wanted to build a snowman.",
    "Sue had a doll with a pretty pink dress.",
    "The sun was hot, and the ice cream was melting fast.",
    "Once there was a clown who forgot how to laugh.",
    "Tom and his dog played catch in the park every day.",
    "Ella loved to look at the stars with her telescope.",
    "A kind king lived in a castle on top of a hill.",
    "The train went choo choo as it came into the station.",
    "Lily was sad because her balloon flew away.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fp4_formats(opts: dict) -> tuple[fp4.FP4Format, fp4.FP4Format]:
    return FP4Config(**opts).formats()  # (K format, V format)


def sides(kind: str, opts: dict | None) -> list[tuple[str, fp4.FP4Format | None]]:
    """[(K's format kind, its fp4 format or None), (V's ...)]: fp8-fp4 is fp8 keys and fp4 values."""
    kinds = ("fp8", "fp4") if kind == "fp8-fp4" else (kind, kind)
    fmts = fp4_formats(opts) if opts is not None else (None, None)
    return [(k, f if k == "fp4" else None) for k, f in zip(kinds, fmts)]


def bytes_per_token_head(kind: str, opts: dict | None, head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(K bytes, V bytes) of one token in one KV head, scales and outlier slots included."""
    if kind in ("bf16", "fp32"):
        itemsize = 2 if kind == "bf16" else 4
        return itemsize * head_dim, itemsize * head_dim
    return tuple(side_bytes_per_vector(fmt, head_dim) for _, fmt in sides(kind, opts))  # fmt None: fp8


def size_cells(kind: str, opts: dict | None) -> list:
    total = sum(bytes_per_token_head(kind, opts))
    return [total, f"{BF16_BYTES / total:.2f}x"]


# -- 1. stories260K ------------------------------------------------------------------------------
def make_llm(kind: str, opts: dict | None, stories_dir: Path) -> LLM:
    extra = {"fp4": FP4Config(**opts)} if opts is not None else {}
    return LLM(model=str(stories_dir / "stories260K.bin"), tokenizer=str(stories_dir / "tok512.bin"),
               kv_cache_dtype=kind, cpu_threads=THREADS, **extra)


@torch.inference_mode()
def story_nll(llm: LLM, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Sum of next-token NLLs of one teacher-forced prefill through the cache (blocks 0, 1, ...),
    and the argmax next token at each position [len(ids) - 1]."""
    engine, n = llm.engine, len(ids)
    num_blocks = math.ceil(n / engine.config.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),  # [n]: consecutive blocks, so slot = position
        block_tables=torch.arange(num_blocks)[None],  # [1, num_blocks]
        seq_lens=[n],
        query_start_loc=[0, n],
    )
    input_ids = torch.tensor(ids)  # [n]
    hidden = engine.model(input_ids, torch.arange(n), engine.kv_cache, meta)  # [n, hidden]
    logits = engine.model.compute_logits(hidden[:-1])  # [n - 1, vocab]
    return F.cross_entropy(logits, input_ids[1:], reduction="sum").item(), logits.argmax(-1)


def agreement(ref: list[list[int]], out: list[list[int]], max_tokens: int) -> dict:
    prefix, same, full = [], 0, 0
    for a, b in zip(ref, out):
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), max_tokens)
        prefix.append(first_diff / max_tokens)
        same += sum(x == y for x, y in zip(a, b))
        full += first_diff == max_tokens
    return {"prefix": sum(prefix) / len(prefix), "overall": same / (len(ref) * max_tokens), "full": full}


def section_real(args) -> list[dict]:
    stories_dir = Path(args.stories_dir)
    stories = [s.strip() for s in EVAL_TEXT.read_text().split("\n\n") if s.strip()]
    prompts = PROMPTS[: args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results, ref_tokens, ref_top1 = [], None, None
    for name, kind, opts in VARIANTS[:1] + [CALIBRATION] + VARIANTS[1:]:
        t0 = time.perf_counter()
        llm = make_llm(kind, opts, stories_dir)
        story_ids = [llm.tokenizer.encode(s) for s in stories]
        assert all(len(ids) <= llm.engine.max_model_len for ids in story_ids), "a story is too long"
        # NLL first: it writes blocks behind the block manager's back, before generate uses any.
        nlls, top1s = zip(*(story_nll(llm, ids) for ids in story_ids))
        top1 = torch.cat(top1s)  # [num_tokens]
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        ref_tokens, ref_top1 = ref_tokens or tokens, top1 if ref_top1 is None else ref_top1  # bf16 runs first
        results.append({"variant": name, "nll": sum(nlls) / len(top1), "num_tokens": len(top1),
                        "teacher_forced_top1": (top1 == ref_top1).float().mean().item(),
                        "engine_kv_bytes_per_token": llm.engine.kv_bytes_per_token,
                        **agreement(ref_tokens, tokens, args.max_tokens)})
        log(f"[1] {name}: nll {results[-1]['nll']:.4f}, agreement {results[-1]['overall']:.3f} "
            f"({time.perf_counter() - t0:.1f} s)")
    for r in results:
        r["nll_delta"] = r["nll"] - results[0]["nll"]
    return results


# -- 5. SmolLM2 over held-out text, through prompt logprobs ------------------------------------------
REAL_MODEL = "smollm2-135m-instruct"
REAL_VARIANTS = ["bf16", "fp8 per-token-head", "fp4 plain", "fp4 +2 out K, V g32, search",
                 "fp4 DEFAULT: +4 out K g32, V g32, search"]


def heldout_windows(tokenizer, num_tokens: int, window: int, from_end: bool = False) -> list[list[int]]:
    """Windows of `window` tokens of CPython's pydoc topics (sorted by name; from_end: from the last name
    backwards, text disjoint from the held-out windows for calibration), num_tokens in all."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics, reverse=from_end):
        ids += tokenizer.encode(topics[name], add_special_tokens=False)
        if len(ids) >= num_tokens:
            break
    ids = ids[:num_tokens]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def real_model_llm(kind: str, opts: dict | None, chunk: int) -> LLM:
    """SmolLM2 with the variant's KV cache, prefills in chunks of `chunk` tokens, no prefix caching (so every
    window is scored through its own cache blocks)."""
    extra = {"fp4": FP4Config(**opts)} if opts is not None else {}
    return LLM(model=REAL_MODEL, kv_cache_dtype=kind, max_num_batched_tokens=chunk, enable_prefix_caching=False,
               cpu_threads=THREADS, **extra)


def heldout_scores(llm: LLM, num_tokens: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt_scores of the held-out windows."""
    return prompt_scores(llm, heldout_windows(llm.tokenizer, num_tokens, window))


def prompt_scores(llm: LLM, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, most likely next tokens) [scored tokens] of the prompts' tokens through the
    engine's prompt logprobs (every prompt's first token is not scored)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=1), log_every_s=30)
    # vLLM's shape: per position {token id: Logprob}, the prompt token's and the best (rank 1)
    lps = torch.tensor([d[t].logprob for o in outs for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])
    top1 = torch.tensor([next(t for t, e in d.items() if e.rank == 1) for o in outs for d in o.prompt_logprobs[1:]])
    return lps, top1


def section_smollm2(args) -> list[dict]:
    by_name = {name: (kind, opts) for name, kind, opts in VARIANTS}
    results, ref_top1 = [], None
    for name in args.real_variants:
        t0 = time.perf_counter()
        llm = real_model_llm(*by_name[name], args.real_chunk)
        lps, top1 = heldout_scores(llm, args.real_tokens, args.real_window)
        ref_top1 = top1 if ref_top1 is None else ref_top1  # bf16 runs first
        results.append({"variant": name, "nll": -lps.mean().item(), "num_tokens": len(lps),
                        "teacher_forced_top1": (top1 == ref_top1).float().mean().item(),
                        "engine_kv_bytes_per_token": llm.engine.kv_bytes_per_token})
        log(f"[5] {name}: nll {results[-1]['nll']:.4f}, TF top-1 {results[-1]['teacher_forced_top1']:.4f} "
            f"({time.perf_counter() - t0:.1f} s)")
    for r in results:
        r["nll_delta"] = r["nll"] - results[0]["nll"]
    return results


# -- 2. synthetic head_dim 128 ---------------------------------------------------------------------
SYN_KV_HEADS, SYN_GROUP, SYN_QUERIES, SYN_THETA = 2, 4, 16, 500000.0
SYN_DESCRIPTION = (
    f"synthetic KV, seed 1000+context: {SYN_KV_HEADS} KV heads x {SYN_GROUP} query heads, head_dim {HEAD_DIM}; "
    "K ~ N(0,1) x per-token lognormal(0,0.3) scale, plus 4 massive channels per KV head (consistent sign, "
    "|8..15|) among the 8 lowest-frequency RoPE pairs; sink at position 0 (K = 3x the massive pattern, "
    "V ~ 0.01 N(0,1)); RoPE theta 5e5 on K and Q; Q = last 16 positions, N(0,1) + unit bias on the massive "
    "channels, each (query, head) with one earlier key pulled towards it (+6 logits); V ~ N(0,1) with 0.1% "
    "of entries x10; formats quantize the fp32 K/V; rotated formats are dequantized back with R^T "
    "(same as attending with rotated q); error = ||o - o_bf16|| / ||o_bf16|| over all queries and heads"
)


def synthetic_qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + n)
    h, d, nq = SYN_KV_HEADS, HEAD_DIM, SYN_QUERIES

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    low_freq = torch.tensor([i + half for i in range(d // 2 - 8, d // 2) for half in (0, d // 2)])
    massive = torch.zeros(h, d)  # [kv_heads, head_dim]: per-head bias on the massive channels
    for head in range(h):
        ch = low_freq[torch.randperm(len(low_freq), generator=gen)[:4]]
        sign = torch.randint(0, 2, (4,), generator=gen).float() * 2 - 1
        massive[head, ch] = sign * (8 + 7 * torch.rand(4, generator=gen))
    token_scale = torch.exp(0.3 * randn(n, 1, 1))  # [n, 1, 1]
    k = randn(n, h, d) * token_scale + massive  # [n, kv_heads, head_dim], before RoPE
    k[0] = 3 * massive + 0.2 * randn(h, d)  # the attention sink
    q = randn(nq, h, SYN_GROUP, d) + massive.sign()[None, :, None, :]  # [nq, kv_heads, group, head_dim]
    q = q.reshape(nq, h * SYN_GROUP, d)  # [nq, heads, head_dim]
    inv_freq = 1.0 / SYN_THETA ** (torch.arange(0, d, 2).float() / d)  # [head_dim // 2]
    k = apply_rope(k, *rope_cos_sin(inv_freq, torch.arange(n)))
    q = apply_rope(q, *rope_cos_sin(inv_freq, torch.arange(n - nq, n)))
    # One key per (query, head), at a random earlier position, pulled towards that query: +6 logits.
    for j in range(nq):
        for head in range(h * SYN_GROUP):
            pos = torch.randint(1, n - nq + j + 1, (1,), generator=gen).item()
            k[pos, head // SYN_GROUP] += 6 * math.sqrt(d) * q[j, head] / q[j, head].norm() ** 2
    v = randn(n, h, d)  # [n, kv_heads, head_dim]
    v = torch.where(torch.rand(n, h, d, generator=gen) < 1e-3, 10 * v, v)
    v[0] = 0.01 * randn(h, d)
    return q, k, v


def quant_dequant(x: torch.Tensor, kind: str, fmt: fp4.FP4Format | None) -> torch.Tensor:
    """x [n, kv_heads, head_dim] float32 -> what the cache would give back, float32, original basis."""
    if kind == "bf16":
        return x.to(torch.bfloat16).float()
    if kind == "fp8":
        return fp8.fp8_dequantize(*fp8.fp8_quantize(x))
    rotation = fp4.hadamard_rotation(x.shape[-1]) if fmt.rotate else None
    return fp4.fp4_dequantize(fp4.fp4_quantize(x, fmt, rotation), fmt, rotation)


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    return ((o - ref).norm() / ref.norm()).item()


def section_synthetic(args) -> list[dict]:
    scale = HEAD_DIM ** -0.5
    errs = {name: {} for name, _, _ in VARIANTS}  # name -> {context: error vs bf16 KV}
    bf16_vs_fp32, sink_mass = {}, {}
    for n in args.contexts:
        t0 = time.perf_counter()
        q, k, v = synthetic_qkv(n)
        o_fp32 = causal_attention_ref(q, k, v, scale)  # [nq, heads, head_dim]
        # Attention mass on the sink, unmasked (the < 16 future keys in the denominator are negligible).
        q_grouped = q.view(SYN_QUERIES, SYN_KV_HEADS, SYN_GROUP, -1)  # [nq, kv_heads, group, head_dim]
        probs = torch.softmax(torch.einsum("qhgd,khd->qhgk", q_grouped, k) * scale, -1)  # [nq, kv_heads, group, n]
        sink_mass[n] = probs[..., 0].mean().item()
        o_bf16 = None
        for name, kind, opts in VARIANTS:
            (k_kind, k_fmt), (v_kind, v_fmt) = sides(kind, opts)
            o = causal_attention_ref(q, quant_dequant(k, k_kind, k_fmt), quant_dequant(v, v_kind, v_fmt), scale)
            o_bf16 = o if o_bf16 is None else o_bf16  # bf16 runs first
            errs[name][n] = rel_err(o, o_bf16)
        bf16_vs_fp32[n] = rel_err(o_bf16, o_fp32)
        log(f"[2] context {n}: sink mass {sink_mass[n]:.2f}, fp8 {errs['fp8 per-token-head'][n]:.2e}, "
            f"fp4 plain {errs['fp4 plain'][n]:.2e} ({time.perf_counter() - t0:.1f} s)")

    def geomean_ratio(name: str, base: str) -> float:
        return math.exp(sum(math.log(errs[name][n] / errs[base][n]) for n in args.contexts) / len(args.contexts))

    results = []
    for name, kind, _ in VARIANTS:
        r = {"variant": name, "error_vs_bf16": errs[name]}
        if kind == "bf16":
            r["error_vs_fp32"] = bf16_vs_fp32
        else:
            r["ratio_to_fp8"] = geomean_ratio(name, "fp8 per-token-head")
            r["ratio_to_fp4_plain"] = geomean_ratio(name, "fp4 plain")
        results.append(r)
    results.append({"sink_mass": sink_mass, "data": SYN_DESCRIPTION})
    return results


# -- 4. where the error comes from: K or V ---------------------------------------------------------
SPLIT_VARIANTS = [("fp8 per-token-head", "fp8", None), ("fp4 plain", "fp4", fp4_variant()),
                  ("fp4 DEFAULT", "fp4", {})]


class _FakeQuantCache(DenseKVCache):
    """fp32 pages holding what a format would give back, for K only or V only."""

    def __init__(self, spec, num_blocks, quantize_k, quantize_v):
        super().__init__(spec, num_blocks, "cpu", torch.float32)
        self.quantize_k, self.quantize_v = quantize_k, quantize_v

    def store(self, layer, key, value, slot_mapping):
        super().store(layer, self.quantize_k(key.float()), self.quantize_v(value.float()), slot_mapping)


def section_split(args) -> list[dict]:
    stories_dir = Path(args.stories_dir)
    stories = [s.strip() for s in EVAL_TEXT.read_text().split("\n\n") if s.strip()]
    llm = make_llm("fp32", None, stories_dir)
    story_ids = [llm.tokenizer.encode(s) for s in stories]
    engine = llm.engine

    def nll_with(quantize_k, quantize_v) -> float:
        engine.kv_cache = _FakeQuantCache(engine.kv_spec, engine.num_kv_blocks, quantize_k, quantize_v)
        nlls, top1 = zip(*(story_nll(llm, ids) for ids in story_ids))
        return sum(nlls) / sum(len(t) for t in top1)

    def bf16(x):
        return x.to(torch.bfloat16).float()

    base = nll_with(bf16, bf16)
    q, k, v = synthetic_qkv(4096)
    scale = HEAD_DIM ** -0.5
    o_ref = causal_attention_ref(q, bf16(k), bf16(v), scale)
    results = []
    for name, kind, opts in SPLIT_VARIANTS:
        k_fmt, v_fmt = fp4_formats(opts) if kind == "fp4" else (None, None)
        qk = lambda x, f=k_fmt: quant_dequant(x, kind, f)  # noqa: E731
        qv = lambda x, f=v_fmt: quant_dequant(x, kind, f)  # noqa: E731
        r = {"variant": name, "nll_delta_k_only": nll_with(qk, bf16) - base,
             "nll_delta_v_only": nll_with(bf16, qv) - base,
             "syn4k_err_k_only": rel_err(causal_attention_ref(q, qk(k), bf16(v), scale), o_ref),
             "syn4k_err_v_only": rel_err(causal_attention_ref(q, bf16(k), qv(v), scale), o_ref),
             "syn4k_err_both": rel_err(causal_attention_ref(q, qk(k), qv(v), scale), o_ref)}
        results.append(r)
        log(f"[4] {name}: {r}")
    return results


# -- 3. bytes --------------------------------------------------------------------------------------
def section_bytes(stories_spec: KVCacheSpec) -> list[dict]:
    results = []
    for name, kind, opts in VARIANTS:
        k_bytes, v_bytes = bytes_per_token_head(kind, opts)
        fmts = fp4_formats(opts) if opts is not None else None
        results.append({"variant": name, "k_bytes": k_bytes, "v_bytes": v_bytes, "bytes": k_bytes + v_bytes,
                        "capacity_vs_bf16": BF16_BYTES / (k_bytes + v_bytes),
                        "stories260K_bytes_per_token": kv_bytes_per_token(kind, stories_spec, fmts)})
    return results


# -- output ----------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="1,2,3,4", help="comma-separated subset of 1,2,3,4,5")
    ap.add_argument("--real-variants", default=";".join(REAL_VARIANTS),
                    help="section 5: variants, separated by ';' (names of the table; bf16 first)")
    ap.add_argument("--real-tokens", type=int, default=20480, help="section 5: held-out tokens")
    ap.add_argument("--real-window", type=int, default=1024, help="section 5: tokens per prompt")
    ap.add_argument("--real-chunk", type=int, default=512, help="section 5: max_num_batched_tokens")
    ap.add_argument("--contexts", default="1024,4096,16384,32768", help="synthetic context lengths")
    ap.add_argument("--stories-dir", default=str(REPO.parent / "shared/models/stories260K"))
    ap.add_argument("--num-prompts", type=int, default=20, help=f"greedy prompts (at most {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per greedy prompt")
    ap.add_argument("--json", default=None, help="also write every number to this file")
    args = ap.parse_args()
    sections = {int(s) for s in args.sections.split(",")}
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if not sections <= {1, 2, 3, 4, 5}:
        ap.error(f"--sections must be a subset of 1,2,3,4,5 (got {args.sections})")
    args.real_variants = args.real_variants.split(";")
    known = {name for name, _, _ in VARIANTS}
    if args.real_variants[0] != "bf16" or not set(args.real_variants) <= known:
        ap.error(f"--real-variants must start with bf16 and name variants of {sorted(known)}")
    if not 1 <= args.num_prompts <= len(PROMPTS):
        ap.error(f"--num-prompts must be in [1, {len(PROMPTS)}] (got {args.num_prompts})")
    if min(args.contexts) <= SYN_QUERIES:
        ap.error(f"--contexts must all be > {SYN_QUERIES} (got {args.contexts})")
    torch.set_num_threads(THREADS)  # the engines set the same (cpu_threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    out = {"command": " ".join(sys.argv), "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
           f"{torch.get_num_threads()} threads, torch {torch.__version__}", "date": time.strftime("%Y-%m-%d")}
    sizes = {name: size_cells(kind, opts) for name, kind, opts in VARIANTS + [CALIBRATION]}
    size_headers = [f"B/token/KV head @hd{HEAD_DIM}", "capacity vs bf16"]

    if 1 in sections:
        res = out["stories260K"] = section_real(args)
        print(f"\n### 1. stories260K (head_dim 8): NLL on {EVAL_TEXT.name} ({res[0]['num_tokens']} tokens), "
              f"greedy agreement with bf16 KV ({args.num_prompts} prompts x {args.max_tokens} tokens)\n")
        print(table(["variant", *size_headers, "NLL", "dNLL vs bf16", "TF top-1 agr", "prefix agr", "overall agr",
                     f"full match /{args.num_prompts}"],
                    [[r["variant"], *sizes[r["variant"]], f"{r['nll']:.4f}", f"{r['nll_delta']:+.4f}",
                      f"{r['teacher_forced_top1']:.3f}", f"{r['prefix']:.3f}", f"{r['overall']:.3f}", r["full"]]
                     for r in res]))
    if 2 in sections:
        res = out["synthetic"] = section_synthetic(args)
        *rows, extra = res
        print(f"\n### 2. Synthetic attention-output error vs bf16 KV, head_dim {HEAD_DIM} (bf16 row: vs fp32 KV)\n")
        print(f"Data: {extra['data']}. Sink attention mass: "
              + ", ".join(f"{n}: {m:.2f}" for n, m in extra["sink_mass"].items()) + "\n")
        ctx = [f"err @{n // 1024}k" if n % 1024 == 0 else f"err @{n}" for n in args.contexts]
        print(table(["variant", *size_headers, *ctx, "/ fp8 (geomean)", "/ fp4 plain (geomean)"],
                    [[r["variant"], *sizes[r["variant"]],
                      *(f"{e:.2e}" for e in r.get("error_vs_fp32", r["error_vs_bf16"]).values()),
                      f"{r['ratio_to_fp8']:.2f}" if "ratio_to_fp8" in r else "-",
                      f"{r['ratio_to_fp4_plain']:.2f}" if "ratio_to_fp4_plain" in r else "-"] for r in rows]))
    if 3 in sections:
        spec = KVCacheSpec(num_layers=5, num_kv_heads=4, head_dim=8, block_size=16, compute_dtype=torch.float32)
        res = out["bytes"] = section_bytes(spec)
        print(f"\n### 3. Bytes per token per KV head at head_dim {HEAD_DIM} (K + V, scales and outlier slots)\n")
        print(table(["variant", "K bytes", "V bytes", "K+V bytes", "capacity vs bf16", "stories260K B/token (engine)"],
                    [[r["variant"], r["k_bytes"], r["v_bytes"], r["bytes"], f"{r['capacity_vs_bf16']:.2f}x",
                      r["stories260K_bytes_per_token"]] for r in res]))
    if 4 in sections:
        res = out["split"] = section_split(args)
        print("\n### 4. K or V: the loss with only one of them quantized (stories260K NLL delta vs bf16 KV; "
              "synthetic 4k-context attention error vs bf16 KV)\n")
        print(table(["variant", "dNLL K only", "dNLL V only", "syn err K only", "syn err V only", "syn err both"],
                    [[r["variant"], f"{r['nll_delta_k_only']:+.4f}", f"{r['nll_delta_v_only']:+.4f}",
                      f"{r['syn4k_err_k_only']:.3f}", f"{r['syn4k_err_v_only']:.3f}", f"{r['syn4k_err_both']:.3f}"]
                     for r in res]))
    if 5 in sections:
        res = out["smollm2"] = section_smollm2(args)
        print(f"\n### 5. {REAL_MODEL} (head_dim 64): prompt-logprob NLL over {res[0]['num_tokens']} held-out tokens "
              f"(pydoc_data.topics, windows of {args.real_window}, prefill chunks of {args.real_chunk})\n")
        print(table(["variant", *size_headers, "engine B/token", "NLL", "dNLL vs bf16", "TF top-1 agr"],
                    [[r["variant"], *sizes[r["variant"]], r["engine_kv_bytes_per_token"], f"{r['nll']:.4f}",
                      f"{r['nll_delta']:+.4f}", f"{r['teacher_forced_top1']:.4f}"] for r in res]))
    out["runtime_s"] = time.perf_counter() - start
    print(f"\n{out['command']}: {out['runtime_s']:.0f} s on {out['machine']}, {out['date']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
