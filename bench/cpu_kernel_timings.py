r"""The CPU path's attention and store kernels against the torch reference, one thread (as a Serve
replica runs them: Ray sets OMP_NUM_THREADS=1 for its fraction of a CPU), best of --repeat.

Shapes are the side-by-side benchmark's (bench/cpu_vs_vllm.py: 2 KV heads of 64, blocks of 16,
the brief's 3,247-token prompt), in the compute dtype the engine picks on this CPU (--dtype auto:
bf16 with AVX512-BF16, float32 without):

- prefill: what cpu_kernels.prefill / prefix_attention run (bf16: the extension's flash loop;
  float32: torch's flash kernel, the causal call split in two) and torch's
  own CPU flash kernel (F.scaled_dot_product_attention), causal square chunks and the
  non-causal shared-prefix call of cascade decoding; GFLOP/s counts 4 x nq x nk x D x heads
  (halved when causal).
- decode: one step of --seqs sequences of --ctx tokens each through KVCache.attention, per KV
  format: the extension (distinct pages; and all sharing one prompt's blocks, in cascade and
  not) and the torch reference (`use_cpu_kernels = False`; distinct pages, fewer sequences as it
  is slow). ns per (token, KV head) = time / (seqs x ctx x 2).
- store: quantizing --store-tokens new tokens' K and V into fp4 / fp8 pages, ns per 64-value
  vector, extension and reference.

    python bench/cpu_kernel_timings.py --seqs 128 --ctx 3247
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
import torch.nn.functional as F

from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCacheSpec, create_kv_cache
from app.engine.model_runner import resolve_dtype
from app.kernels import cpu_kernels

H, D, BS = 2, 64, 16  # KV heads = query heads (the peer model), head_dim, block size
DTYPE = torch.bfloat16  # the compute dtype (main() sets it from --dtype)


def best(fn, repeat: int) -> float:
    fn()  # warm-up (and oneDNN's kernel for the shape)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def prefill_rows(repeat: int) -> list[tuple]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for nq, nk, causal in ((2048, 2048, True), (1024, 4096, False), (256, 3232, False)):
        q = torch.randn(nq, H, D, generator=gen).to(DTYPE)
        k, v = (torch.randn(nk, H, D, generator=gen).to(DTYPE) for _ in range(2))
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if causal:
            ours = best(lambda: cpu_kernels.prefill(q, k, v, D ** -0.5), repeat)
        else:
            ours = best(lambda: cpu_kernels.prefix_attention(q, k, v, D ** -0.5), repeat)
        torch_s = best(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal), repeat)
        flops = 4 * nq * nk * D * H / (2 if causal else 1)
        rows.append((f"{nq} x {nk}{' causal' if causal else ''}", torch_s * 1e3, ours * 1e3,
                     flops / torch_s / 1e9, flops / ours / 1e9))
    return rows


def decode_cache(kv: str, num_seqs: int, ctx: int, shared: bool, gen):
    """A one-layer cache of `kv` holding num_seqs sequences of ctx tokens (all sharing the first
    ctx // BS blocks when `shared`), and one decode step's (meta, q)."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, compute_dtype=DTYPE)
    per_seq = -(-ctx // BS)
    prefix = ctx // BS if shared else 0  # shared full blocks
    num_blocks = prefix + num_seqs * (per_seq - prefix) + 1
    cache = create_kv_cache(kv, spec, num_blocks, "cpu")
    n = num_blocks * BS
    for start in range(0, n, 8192):  # fill every page
        m = min(8192, n - start)
        cache.store(0, torch.randn(m, H, D, generator=gen).bfloat16(), torch.randn(m, H, D, generator=gen).bfloat16(),
                    torch.arange(start, start + m))
    tables = [list(range(prefix)) + list(range(prefix + i * (per_seq - prefix), prefix + (i + 1) * (per_seq - prefix)))
              for i in range(num_seqs)]
    meta = AttentionMetadata(slot_mapping=torch.full((num_seqs,), -1), block_tables=torch.tensor(tables, dtype=torch.int32),
                             seq_lens=[ctx] * num_seqs, query_start_loc=list(range(num_seqs + 1)))
    q = torch.randn(num_seqs, H, D, generator=gen).to(DTYPE)
    return cache, meta, q


def decode_rows(num_seqs: int, ctx: int, ref_seqs: int, repeat: int) -> list[tuple]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    for kv in ("bf16", "fp8", "fp4"):
        per_token = lambda s, n: s / (n * ctx * H) * 1e9  # noqa: E731
        cache, meta, q = decode_cache(kv, num_seqs, ctx, False, gen)
        ext = best(lambda: cache.attention(0, q, meta, D ** -0.5), repeat)
        rcache, rmeta, rq = decode_cache(kv, ref_seqs, ctx, False, gen)
        rcache.use_cpu_kernels = False
        ref = best(lambda: rcache.attention(0, rq, rmeta, D ** -0.5), max(1, repeat // 3))
        scache, smeta, sq = decode_cache(kv, num_seqs, ctx, True, gen)
        cascade = best(lambda: scache.attention(0, sq, smeta, D ** -0.5), repeat)
        scache.cascade_min_tokens = 0
        scache._cascade_step = None
        alone = best(lambda: scache.attention(0, sq, smeta, D ** -0.5), repeat)
        rows.append((kv, per_token(ref, ref_seqs), per_token(ext, num_seqs), per_token(alone, num_seqs),
                     per_token(cascade, num_seqs)))
    return rows


def store_rows(num_tokens: int, repeat: int) -> list[tuple]:
    rows = []
    gen = torch.Generator().manual_seed(2)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, compute_dtype=DTYPE)
    k, v = (torch.randn(num_tokens, H, D, generator=gen).to(DTYPE) for _ in range(2))
    slots = torch.randperm(num_tokens, generator=gen)
    for kv in ("fp8", "fp4"):
        times = []
        for use in (False, True):
            cache = create_kv_cache(kv, spec, num_tokens // BS + 1, "cpu")
            cache.use_cpu_kernels = use
            times.append(best(lambda: cache.store(0, k, v, slots), repeat))
        vectors = 2 * num_tokens * H
        rows.append((kv, times[0] / vectors * 1e9, times[1] / vectors * 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=128, help="decode: sequences in the step")
    ap.add_argument("--ctx", type=int, default=3247, help="decode: tokens per sequence")
    ap.add_argument("--ref-seqs", type=int, default=16, help="decode: sequences of the (slow) torch reference")
    ap.add_argument("--store-tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="compute dtype (auto: the engine's choice on this CPU)")
    args = ap.parse_args()
    global DTYPE
    DTYPE = resolve_dtype(args.dtype, torch.device("cpu"))
    if not cpu_kernels.available():
        sys.exit(f"the CPU extension is unavailable: {cpu_kernels.problem()}")
    torch.set_num_threads(1)
    has_bf16 = cpu_kernels.load().has_prefill_bf16()
    print(f"`python bench/cpu_kernel_timings.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
          f"{platform.machine()}, AVX512-BF16 flash loop: {'yes' if has_bf16 else 'no (torch kernel instead)'}, "
          f"torch {torch.__version__}, 1 thread, {str(DTYPE).removeprefix('torch.')} compute\n")
    print(f"| prefill attention ({str(DTYPE).removeprefix('torch.')}, 2 heads of 64) | torch SDPA ms | ours ms | torch GFLOP/s | ours GFLOP/s | speedup |")
    print("|---|---|---|---|---|---|")
    for name, t, o, tg, og in prefill_rows(args.repeat):
        print(f"| {name} | {t:.2f} | {o:.2f} | {tg:.0f} | {og:.0f} | {t / o:.2f}x |")
    print(f"\n| decode, {args.seqs} x {args.ctx} tokens (ns per token and KV head) | torch reference "
          f"({args.ref_seqs} seqs) | extension, distinct | extension, one shared prompt, no cascade | "
          "extension, shared, cascade |")
    print("|---|---|---|---|---|")
    for kv, ref, ext, alone, cascade in decode_rows(args.seqs, args.ctx, args.ref_seqs, args.repeat):
        print(f"| {kv} | {ref:.1f} | {ext:.1f} | {alone:.1f} | {cascade:.1f} |")
    print(f"\n| store, {args.store_tokens} tokens' K and V (ns per vector of 64) | torch reference | extension | speedup |")
    print("|---|---|---|---|")
    for kv, ref, ext in store_rows(args.store_tokens, args.repeat):
        print(f"| {kv} | {ref:.0f} | {ext:.0f} | {ref / ext:.1f}x |")


if __name__ == "__main__":
    main()
