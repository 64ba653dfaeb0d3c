"""Split-KV flash-decoding over a paged KV cache (bf16/fp16, fp8 or fp4 pages), GQA-aware.

One new query token per sequence. A program takes (KV head, sequence, split): it loads the query
rows of all `group` query heads that share the KV head (padded to 16 rows for tl.dot), walks its
split's share of the sequence in tiles of BLOCK_N tokens (each token's page looked up in the block
table), loads each K/V tile once for all of them, dequantizes it in registers (paged.unpack_raw),
and keeps an online softmax in base 2. fp4 key outliers are added to the scores exactly (the
query element at the outlier index times the kept value), value outliers into the tile. With one
split it writes the output; with several, each split writes its normalized partial output and
log-sum-exp, and `_merge_kernel` combines them. Splitting the KV range is what keeps 132 SMs busy
at batch 1 and long context.

The engine's default fp4 cache (and key groups of 8 without key slots) runs decode_fp4_gluon's kernel on
CUDA (Gluon: explicit layouts around the fp4 unpack; its docstring says how, `unsupported` says what it
needs); other fp4 K and V pages run _decode_fp4_kernel, the same algorithm arranged around the unpack in plain Triton (also
what the CPU tests interpret). fp8 K and V pages run decode_fp8_gluon's kernel on CUDA where it can (its `unsupported`),
else _decode_fp8_kernel; every other combination runs _decode_kernel.

Speed (bench/RESULTS.md, "Decode attention", H200): bf16 pages run within 3-12% of torch SDPA on
contiguous K/V for the Llama-3.1-8B shape from 8k context and batch 8; fp4 pages (Gluon) 1.53-1.85x faster
than SDPA at 8k-32k and batch 8-32 (70B at TP 8: 1.15-1.64x), bound by instruction issue rather than
bytes (experiments/kernel_sass.py counts the loop's instructions without a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from app.kernels import decode_fp4_gluon, decode_fp8_gluon, paged
from app.kernels.fp4 import FP4Format

LOG2E = 1.4426950408889634
# Triton compiles a variant per value class of an int argument (1, a multiple of 16, other): the split
# plan changes with every mixed step's decode batch, so these stay unspecialized (one compile, done at
# start-up) instead of compiling again in the middle of serving.
SPLIT_ARGS = ("split_size", "num_splits")
MIN_SPLIT_TOKENS = 256  # fewer tokens per split than this and the merge costs more than it gains
# The fp4 kernels' splits are at least the longest of these that still leaves a program for half the
# SMs: their programs' fixed costs (ring fill, the tile pipeline's latency) make 4-tile splits slower
# than fewer programs of 8 tiles where the SMs stay busy (docs/history.md, the fp4 kernel's eighth step),
# and with one KV head at batch 1-2 (70B at TP 8) 2-tile splits beat 4-tile ones once the split merge
# takes one load (0.94x the time at 8k, batch 1; fourteenth step).
FP4_SPLIT_TOKENS = (512, 256, 128)
# Among the split counts that rule allows, the fp4 kernels take the cheapest by the busiest SM's work:
# its programs x (tokens per split x the per-token slowdown when fewer programs share the SM than it has
# slots + a fixed cost per program). Fitted on the H200's sweep of split counts (docs/history.md, the fp4
# kernel's fourteenth step): a program costs about 160 tokens' time whatever its length (the query and its
# scratch, the ring's fill, the warps' merge, the partial result), and a token takes 1.12x as long with
# 2 programs on an SM as with 4 (1.03x with 3; alone, 1.5x). So at 70B TP 8, batch 32, 8k context 256
# programs of 1024 tokens (2 per SM) beat 512 of 512 (4 per SM) by 7%, while at 8B, batch 8, 32k, where
# programs are 4096 tokens long, 4 per SM still win by 12%. The slowdowns were measured with 4 program
# slots per SM; for a kernel with fewer slots, programs that fill them count at full speed and fewer
# take the same table.
PROGRAM_COST_TOKENS = 160
# The fp8 kernel's tile, software-pipeline depth and programs per SM for its split count: 64-token tiles
# with 2 stages compile to 127 registers (4 programs per SM fit) and 45 loop instructions per (token, KV
# head) on Triton 3.6 for sm_90 (128-token tiles: 35, at 179 registers); splits planned as the generic
# kernel's. Not yet swept on a GPU.
FP8_BLOCK_N, FP8_STAGES, FP8_PROGRAMS_PER_SM = 64, 2, 2
# fp8 K and V pages run decode_fp8_gluon's kernel where it can (its `unsupported`), else _decode_fp8_kernel: on an
# H100 it was 1.08-1.55x the Triton kernel's speed at 8B and 70B-TP8 shapes, 8k-32k, batch 1-128, but for one row
# timed first after quantizing 17 GB (0.98x there; its builds timed after that first one: 1.10-1.16x)
# (bench/RESULTS.md, "Decode attention"). False keeps the Triton kernel (for comparisons).
FP8_GLUON = True
# fp8 keys with fp4 values (kv_cache_dtype fp8-fp4) in the same kernel (its V_FP4 build: the fp4 kernel's value
# operand) where it can, else the generic kernel: on an H100 it ran at 1.00-2.28x SDPA bf16 where the generic
# kernel gave 0.81-1.29x (8B and 70B-TP8 shapes, 8k-32k, batch 1-128; bench/RESULTS.md, "Decode attention").
# False keeps the generic kernel (for comparisons).
FP8_FP4_GLUON = True
SHARED_SM_SLOWDOWN = {1: 1.5, 2: 1.12, 3: 1.03}  # programs on an SM (fewer than its slots) -> per-token cost


@triton.jit
def _program_split(seq_lens_ptr, split_size, num_splits, BLOCK_N: tl.constexpr):
    """This program's KV head, sequence and split, and the split's token range [start, end) (empty
    past the sequence's end); the grid is (KV heads, sequences, splits). Each sequence's own length
    is split num_splits ways in whole tiles, no split longer than the plan's split_size, so that a
    sequence shorter than the plan (a decode graph plans for max_model_len) spreads over as many of its
    splits as it has tiles for, not over a few full splits with the rest empty."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split = tl.minimum(split_size // BLOCK_N, tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N)) * BLOCK_N
    start = sp * split
    return h, b, sp, start, tl.minimum(seq_len, start + split)


@triton.jit(do_not_specialize=SPLIT_ARGS)
def _decode_kernel(
    q_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    k0, k1, k2, k3, k4, v0, v1, v2, v3, v4,
    block_tables_ptr, seq_lens_ptr,
    sm_scale_log2, stride_q_seq, stride_q_head, stride_bt, split_size, num_splits,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    K_KIND: tl.constexpr, K_G: tl.constexpr, K_KO: tl.constexpr,
    V_KIND: tl.constexpr, V_G: tl.constexpr, V_KO: tl.constexpr,
    DT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISE: tl.constexpr, ASM: tl.constexpr,
):
    h, b, sp, start, end = _program_split(seq_lens_ptr, split_size, num_splits, BLOCK_N)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    g_mask = g < GROUP
    q_rows = b.to(tl.int64) * stride_q_seq + (h * GROUP + g) * stride_q_head  # [GP]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=g_mask[:, None], other=0.0).to(DT)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    t = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + t
        n_mask = n < end
        rows = paged.page_rows(bt_row, n, n_mask, BS, H, h)
        ka, kb, kc, kd, ke = paged.load_raw(k0, k1, k2, k3, k4, rows, n_mask, K_KIND, D, K_G, K_KO)
        wk, fk = paged.unpack_raw(ka, kb, kc, kd, ke, K_KIND, D, K_G, K_KO, False, DT, ASM)
        s = paged.mma(q, tl.trans(wk), None) * fk[None, :]  # [GP, BLOCK_N]
        if K_KIND == 2 and K_KO > 0:
            s = paged.outlier_scores(s, q_ptr, q_rows, g_mask, kd, ke, n_mask, K_KO)
        s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))  # base-2 logits
        va, vb, vc, vd, ve = paged.load_raw(v0, v1, v2, v3, v4, rows, n_mask, V_KIND, D, V_G, V_KO)
        wv, fv = paged.unpack_raw(va, vb, vc, vd, ve, V_KIND, D, V_G, V_KO, True, DT, ASM)
        m, l, acc = paged.softmax_step(s, m, l, acc, wv, fv, DT, PRECISE)
    heads = h * GROUP + g
    if not SPLIT:
        o_ptr = out_ptr + (b * (H * GROUP) + heads)[:, None].to(tl.int64) * D + d[None, :]
        tl.store(o_ptr, paged.cast_out(acc / l[:, None], out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # an empty split (past this sequence's end) writes lse -inf and zeros
        empty = l == 0.0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
        part = (b * (H * GROUP) + heads).to(tl.int64) * num_splits + sp  # [GP]
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=g_mask[:, None])
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _store_halves(out_ptr, part_o_ptr, part_lse_ptr, acc_even, acc_odd, m, l, h, b, sp, num_splits,
                  H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """The even/odd kernels' epilogue: O^T's halves acc_even, acc_odd [D/2, GP] (running max m, sum l
    [GP]) written interleaved, as the output (one split) or as the split's normalized partial output
    and log-sum-exp; an empty split (past its sequence's end) writes lse -inf and zeros."""
    GP: tl.constexpr = acc_even.shape[1]
    g = tl.arange(0, GP)
    i = tl.arange(0, D // 2)
    g_mask = g < GROUP
    heads = h * GROUP + g
    empty = l == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l))
    if not SPLIT:
        o_ptr = out_ptr + (b * (H * GROUP) + heads)[None, :].to(tl.int64) * D + 2 * i[:, None]  # [DH, GP]
        dtype = out_ptr.dtype.element_ty
        tl.store(o_ptr, paged.cast_out(acc_even * inv[None, :], dtype), mask=g_mask[None, :])
        tl.store(o_ptr + 1, paged.cast_out(acc_odd * inv[None, :], dtype), mask=g_mask[None, :])
    else:
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
        part = (b * (H * GROUP) + heads).to(tl.int64) * num_splits + sp  # [GP]
        o_ptr = part_o_ptr + part[None, :] * D + 2 * i[:, None]
        tl.store(o_ptr, acc_even * inv[None, :], mask=g_mask[None, :])
        tl.store(o_ptr + 1, acc_odd * inv[None, :], mask=g_mask[None, :])
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit(do_not_specialize=SPLIT_ARGS)
def _decode_fp4_kernel(
    q_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    k0, k1, k2, k3, k4, v0, v1, v2, v3, v4,
    block_tables_ptr, seq_lens_ptr,
    sm_scale_log2, stride_q_seq, stride_q_head, stride_bt, split_size, num_splits,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    K_G: tl.constexpr, K_KO: tl.constexpr, V_G: tl.constexpr, V_KO: tl.constexpr,
    DT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISE: tl.constexpr, ASM: tl.constexpr,
):
    """_decode_kernel for fp4 K and V pages, shaped for the fp4 unpack (docs/history.md has the
    counts): each head vector is used as its even and odd halves (the query is loaded split the same
    way and the output written back interleaved), so the unpacked nibbles never need interleaving;
    the PV product runs transposed, O^T [D/2, GP] = V^T P^T, which puts the freshly unpacked V tile
    in the tensor cores' register operand; key outliers add q[idx] * val to the scores, gathered
    once per real query head rather than per padded row."""
    h, b, sp, start, end = _program_split(seq_lens_ptr, split_size, num_splits, BLOCK_N)
    DH: tl.constexpr = D // 2
    g = tl.arange(0, GP)
    i = tl.arange(0, DH)
    g_mask = g < GROUP
    q_rows = b.to(tl.int64) * stride_q_seq + (h * GROUP + g) * stride_q_head  # [GP]
    q_even = tl.load(q_ptr + q_rows[:, None] + 2 * i[None, :], mask=g_mask[:, None], other=0.0).to(DT)
    q_odd = tl.load(q_ptr + q_rows[:, None] + 2 * i[None, :] + 1, mask=g_mask[:, None], other=0.0).to(DT)
    q_head0 = q_ptr + b.to(tl.int64) * stride_q_seq + (h * GROUP) * stride_q_head
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc_even = tl.zeros([DH, GP], tl.float32)  # transposed: O^T
    acc_odd = tl.zeros([DH, GP], tl.float32)
    t = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + t
        n_mask = n < end
        rows = paged.page_rows(bt_row, n, n_mask, BS, H, h)
        kc, ks, ke = paged.load_fp4_groups(k0, k1, k2, rows, n_mask, D, K_G)
        k_even, k_odd = paged.fp4_unpack_groups(kc, ks, ASM)
        s = paged.mma(q_even, tl.trans(k_even.to(DT)), None)
        s = paged.mma(q_odd, tl.trans(k_odd.to(DT)), s) * paged.pow2_scale(ke)[None, :]  # [GP, BLOCK_N]
        if K_KO > 0:
            s = _fp4_key_outliers(s, q_head0, stride_q_head, k3, k4, rows, n_mask, g, GROUP, K_KO)
        s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))  # base-2 logits
        vc, vs, ve = paged.load_fp4_groups(v0, v1, v2, rows, n_mask, D, V_G)
        v_even, v_odd = paged.fp4_unpack_groups(vc, vs, ASM)
        fv = paged.pow2_scale(ve)
        if V_KO > 0:
            v_even, v_odd = _fp4_value_outliers(v_even, v_odd, v3, v4, rows, n_mask, ve, V_KO)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        p = p * fv[None, :]
        p_hi = p.to(DT)
        vt_even = tl.trans(v_even.to(DT))  # [DH, BLOCK_N]
        vt_odd = tl.trans(v_odd.to(DT))
        pt = tl.trans(p_hi)  # [BLOCK_N, GP]
        acc_even = paged.mma(vt_even, pt, acc_even * alpha[None, :])
        acc_odd = paged.mma(vt_odd, pt, acc_odd * alpha[None, :])
        if PRECISE:
            pt_lo = tl.trans((p - p_hi.to(tl.float32)).to(DT))
            acc_even = paged.mma(vt_even, pt_lo, acc_even)
            acc_odd = paged.mma(vt_odd, pt_lo, acc_odd)
        m = m_new
    _store_halves(out_ptr, part_o_ptr, part_lse_ptr, acc_even, acc_odd, m, l, h, b, sp, num_splits, H, GROUP, D, SPLIT)


# Two E4M3 bytes in each 16-bit half of $2 (elements 2i, 2i+1 of a vector in each) -> fp16x2 of the even
# bytes and fp16x2 of the odd ones: one prmt gathers each pair, cvt.rn.f16x2.e4m3x2 widens it (exact: every
# E4M3 value is an fp16 value).
_E4M3_HALVES_PTX = tl.constexpr("""
{
  .reg .b32 t;
  .reg .b16 lo, hi;
  prmt.b32 t, $2, 0, 0x3120;
  mov.b32 {lo, hi}, t;
  cvt.rn.f16x2.e4m3x2 $0, lo;
  cvt.rn.f16x2.e4m3x2 $1, hi;
}
""")


@triton.jit
def _e4m3_halves(x, DT: tl.constexpr, ASM: tl.constexpr):
    """uint16 words [...] holding the E4M3 bytes of elements 2i (low byte) and 2i+1 (high byte) -> (even,
    odd) in DT, exactly: fp16 from the PTX, the plain-Triton path's DT otherwise (the interpreter's)."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3_HALVES_PTX, "=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=2)
    even = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DT)
    odd = (x >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DT)
    return even, odd


@triton.jit
def _fp16_pow2(amax):
    """The power of two that brings amax (> 0, float32) to [2^13, 2^14): the query in fp16 with no
    overflow and nothing below fp16's normal range but elements 2^-27 of its largest."""
    return (tl.minimum(tl.maximum(267 - (amax.to(tl.int32, bitcast=True) >> 23), 1), 254) << 23).to(
        tl.float32, bitcast=True)


@triton.jit(do_not_specialize=SPLIT_ARGS)
def _decode_fp8_kernel(
    q_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    k_vals, k_scale, v_vals, v_scale,
    block_tables_ptr, seq_lens_ptr,
    sm_scale_log2, stride_q_seq, stride_q_head, stride_bt, split_size, num_splits,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    DT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
):
    """_decode_kernel for fp8 K and V pages, in fp16 MMAs (its instruction counts: FP8_BLOCK_N's
    comment). Each vector is read as 16-bit words of two E4M3 values and used as its even and odd halves
    (the query split alike, the output written back interleaved), so one prmt and one hardware widening
    per two values make the MMA operands in registers (the generic kernel's E4M3 -> bf16 conversion ran
    after the shared-memory round trip, with byte-wise shared loads and float32 round trips). The query
    goes to fp16 times a power of two (_fp16_pow2; the scores take it back), the keys' scales multiply the
    scores, and each value's scale joins its score as log2(scale), so the probabilities go to the PV MMA
    already weighted by it and at most 1 (exact to fp16's 11 bits relative to the largest whatever the
    values' magnitudes); the sums take it back (p / scale)."""
    h, b, sp, start, end = _program_split(seq_lens_ptr, split_size, num_splits, BLOCK_N)
    DH: tl.constexpr = D // 2
    g = tl.arange(0, GP)
    i = tl.arange(0, DH)
    g_mask = g < GROUP
    q_rows = b.to(tl.int64) * stride_q_seq + (h * GROUP + g) * stride_q_head  # [GP]
    q_even = tl.load(q_ptr + q_rows[:, None] + 2 * i[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q_odd = tl.load(q_ptr + q_rows[:, None] + 2 * i[None, :] + 1, mask=g_mask[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(q_even), 1), 0), tl.max(tl.max(tl.abs(q_odd), 1), 0))
    qf = _fp16_pow2(tl.maximum(amax, 1e-30))
    q_even = (q_even * qf).to(DT)  # [GP, D/2]
    q_odd = (q_odd * qf).to(DT)
    k_factor = sm_scale_log2 / qf
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_words = k_vals.to(tl.pointer_type(tl.uint16))
    v_words = v_vals.to(tl.pointer_type(tl.uint16))
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc_even = tl.zeros([DH, GP], tl.float32)  # transposed: O^T
    acc_odd = tl.zeros([DH, GP], tl.float32)
    t = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + t
        n_mask = n < end
        rows = paged.page_rows(bt_row, n, n_mask, BS, H, h)
        kw = tl.load(k_words + rows[:, None] * DH + i[None, :], mask=n_mask[:, None], other=0)  # [N, D/2]
        fk = tl.load(k_scale + rows, mask=n_mask, other=0.0)
        k_even, k_odd = _e4m3_halves(kw, DT, ASM)
        s = paged.mma(q_even, tl.trans(k_even), None)
        s = paged.mma(q_odd, tl.trans(k_odd), s) * (fk * k_factor)[None, :]  # [GP, N] base-2 logits
        vw = tl.load(v_words + rows[:, None] * DH + i[None, :], mask=n_mask[:, None], other=0)
        fv = tl.maximum(tl.load(v_scale + rows, mask=n_mask, other=1.0), 1e-30)
        s = tl.where(n_mask[None, :], s + tl.log2(fv)[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])  # probability x the value's scale
        l = l * alpha + tl.sum(p / fv[None, :], 1)
        v_even, v_odd = _e4m3_halves(vw, DT, ASM)
        pt = tl.trans(p.to(DT))  # [N, GP]
        acc_even = paged.mma(tl.trans(v_even), pt, acc_even * alpha[None, :])
        acc_odd = paged.mma(tl.trans(v_odd), pt, acc_odd * alpha[None, :])
        m = m_new
    _store_halves(out_ptr, part_o_ptr, part_lse_ptr, acc_even, acc_odd, m, l, h, b, sp, num_splits, H, GROUP, D, SPLIT)


@triton.jit
def _fp4_key_outliers(s, q_head0, stride_q_head, p_val, p_idx, rows, mask, g, GROUP: tl.constexpr, KO: tl.constexpr):
    """s [GP, N] + sum over slots of out_val[n] * q[g, out_idx[n]], exact in float32, for the GROUP
    real query rows: the slots are loaded once as [N, KOP] and each query head's elements gathered
    from it (L1 hits: the program's queries are a few KB)."""
    KOP: tl.constexpr = triton.next_power_of_2(KO)
    k = tl.arange(0, KOP)
    slot_mask = mask[:, None] & (k < KO)[None, :]
    idx = tl.load(p_idx + rows[:, None] * KO + k[None, :], mask=slot_mask, other=0).to(tl.int32)
    val = tl.load(p_val + rows[:, None] * KO + k[None, :], mask=slot_mask, other=0.0).to(tl.float32)
    for r in tl.static_range(GROUP):
        qv = tl.load(q_head0 + r * stride_q_head + idx).to(tl.float32)  # [N, KOP]
        s = tl.where(g[:, None] == r, s + tl.sum(qv * val, 1)[None, :], s)
    return s


@triton.jit
def _fp4_value_outliers(w_even, w_odd, p_val, p_idx, rows, mask, e, KO: tl.constexpr):
    """Add the fp4 value outlier slots into the unpacked halves (in their units: value / pow2_scale)."""
    N: tl.constexpr = w_even.shape[0]
    DH: tl.constexpr = w_even.shape[1]
    i = tl.arange(0, DH)
    inv_f = paged.inv_pow2_scale(e)
    add_even = tl.zeros([N, DH], tl.float32)
    add_odd = tl.zeros([N, DH], tl.float32)
    for slot in tl.static_range(KO):
        idx = tl.load(p_idx + rows * KO + slot, mask=mask, other=0).to(tl.int32)
        val = tl.load(p_val + rows * KO + slot, mask=mask, other=0.0).to(tl.float32) * inv_f
        hit = i[None, :] == (idx >> 1)[:, None]
        add_even += tl.where(hit & ((idx & 1) == 0)[:, None], val[:, None], 0.0)
        add_odd += tl.where(hit & ((idx & 1) == 1)[:, None], val[:, None], 0.0)
    return w_even.to(tl.float32) + add_even, w_odd.to(tl.float32) + add_odd


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_splits, D: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """out[row, d-block] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), one program per (sequence
    and q head, block of BLOCK_D dimensions), every split in one load (SPLITS: num_splits rounded up
    to a power of two, at most 256): two memory round trips in all, however many splits (a loop
    over chunks of splits was latency-bound at batch 1: 16 us for 8 rows of 128 splits)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c = tl.arange(0, SPLITS)
    mask = c < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + c, mask=mask, other=float("-inf"))
    w = tl.where(mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)  # split 0 always holds tokens: a finite max
    o = tl.load(part_o_ptr + (row * num_splits + c)[:, None] * D + d[None, :], mask=mask[:, None], other=0.0)
    acc = tl.sum(w[:, None] * o, 0)
    tl.store(out_ptr + row * D + d, paged.cast_out(acc / tl.sum(w, 0), out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                   block_n: int, programs_per_sm: int = 2, fp4_rule: bool = False) -> int:
    """How many splits of the KV range, at most 256. Default: about programs_per_sm x SMs (KV head,
    sequence, split) programs in all, no split shorter than MIN_SPLIT_TOKENS. fp4_rule (the fp4
    kernels, programs_per_sm of which run at once on an SM): fp4_splits, the cheapest count by the
    busiest SM's work, splits of at least FP4_SPLIT_TOKENS' shortest."""
    sms = _num_sms(device)
    if fp4_rule:
        return fp4_splits(num_seqs * num_kv_heads, max_seq_len, block_n, programs_per_sm, sms)
    most = most_splits(max_seq_len, block_n, MIN_SPLIT_TOKENS)
    want = triton.cdiv(programs_per_sm * sms, num_seqs * num_kv_heads)
    return max(1, min(want, most))


def most_splits(max_seq_len: int, block_n: int, shortest: int) -> int:
    """The most splits of max_seq_len tokens with none shorter than `shortest` tokens or one tile, at most 256."""
    return max(1, min(256, max_seq_len // max(shortest, block_n)))


def fp4_splits(pairs: int, max_seq_len: int, block_n: int, programs_per_sm: int, sms: int) -> int:
    """num_splits_for's fp4 rule for `pairs` (sequence, KV head) pairs on `sms` SMs: at most the splits of
    the longest of FP4_SPLIT_TOKENS for which pairs x that many splits is at least half the SMs (of the
    shortest if none is), at most 256; of those, the fewest within 1% of the cheapest (split_cost)."""
    for shortest in FP4_SPLIT_TOKENS:
        most = most_splits(max_seq_len, block_n, shortest)
        if pairs * most >= sms // 2:
            break
    return _cheapest_splits(pairs, max(max_seq_len, 1), block_n, most, programs_per_sm, sms)


def split_cost(pairs: int, seq_len: int, block_n: int, splits: int, programs_per_sm: int, sms: int) -> float:
    """The busiest SM's work, in tokens' time, for `splits` splits (rounded as the launcher rounds
    them), each program PROGRAM_COST_TOKENS more whatever its length. Programs that fit the SM's slots
    at once: each of them at the slowdown for that many (SHARED_SM_SLOWDOWN). More: whole waves of
    programs_per_sm, a last partial wave costing a whole one (its programs start as earlier ones end,
    not together; the rule this one replaced, waves x tokens per split, held there on the H200)."""
    split, launched = split_plan(seq_len, splits, block_n)
    on_sm = triton.cdiv(pairs * launched, sms)
    if on_sm < programs_per_sm:
        return on_sm * (split * SHARED_SM_SLOWDOWN.get(on_sm, 1.0) + PROGRAM_COST_TOKENS)
    return triton.cdiv(on_sm, programs_per_sm) * programs_per_sm * (split + PROGRAM_COST_TOKENS)


@functools.lru_cache(maxsize=4096)
def _cheapest_splits(pairs: int, seq_len: int, block_n: int, most: int, programs_per_sm: int, sms: int) -> int:
    costs = [split_cost(pairs, seq_len, block_n, s, programs_per_sm, sms) for s in range(1, most + 1)]
    least = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= 1.01 * least)  # splits cost merges: the fewest


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Choices below decode_attention's rules, for tests, benchmarks and experiments; the engine passes
    none.

    kernel: None (the rule: the Gluon kernel for fp4 K and V pages in decode_fp4_gluon's scope,
    _decode_fp4_kernel for other fp4 pages with head_dim >= 128, decode_fp8_gluon's kernel for fp8 K and V
    pages in its scope (while FP8_GLUON) and for fp8 keys with fp4 values (while FP8_FP4_GLUON),
    _decode_fp8_kernel for other fp8 K and V pages, _decode_kernel for everything else), "gluon" (the pages'
    Gluon kernel, fp4's or fp8's (fp8 keys with fp8 or fp4 values), required: ValueError naming why it
    cannot run), "fp4" (_decode_fp4_kernel), "fp8" (_decode_fp8_kernel) or "generic" (_decode_kernel, any
    pages). num_splits: the split count (None: num_splits_for's rule).
    Triton kernels only: block_n, tokens per tile (None: 128 for fp4 pages, FP8_BLOCK_N for the fp8
    kernel, 64 otherwise, the fastest in docs/history.md); num_warps; precise_pv: the PV product from p
    split into two bf16 terms (float32-accurate; the rule then takes _decode_fp4_kernel or
    _decode_kernel); asm: the inline-PTX fp4 unpack (None: on CUDA; False: plain Triton, which also rules
    out the Gluon kernel).
    num_stages: for the Gluon kernel, 0 (loads into registers; key groups of 8 then run the Triton
    kernel) or the tiles of its cp.async ring, a power of two >= 4 (None: decode_fp4_gluon.STAGES; other
    values raise ValueError); for the Triton kernels, the software-pipeline depth (None: 2, and for fp4
    pages 1 once batch x KV heads >= 8).
    maxnreg: a register cap on CUDA (None: 128 for _decode_fp4_kernel at head_dim 128; for the Gluon
    kernel decode_fp4_gluon.PAIR_MAXNREG (128) with tile pairs, else none; 0: none, which leaves the
    paired Gluon kernel at 161-168 registers, 3 programs per SM).
    Gluon kernel only: fp16, its code-to-number map, fp16 MMAs (True) or bf16 (False) (None:
    decode_fp4_gluon.F16_DEFAULT); pair, tile pairs (two tiles per pass in the MMA's padding columns, at
    most 4 query heads per KV head and a 4-tile ring) for splits with at least this many whole tiles, 0
    never (None: decode_fp4_gluon.PAIR_MIN_TILES). The fp8 Gluon kernel: prefetch, the whole tiles whose loads
    are issued ahead of the one attended, 0, 1 or 2 (None: decode_fp8_gluon.prefetch_for's rule); maxnreg
    applies (None: uncapped)."""

    kernel: str | None = None
    num_splits: int | None = None
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    precise_pv: bool = False
    asm: bool | None = None
    maxnreg: int | None = None
    fp16: bool | None = None
    pair: int | None = None
    prefetch: int | None = None

    def __post_init__(self) -> None:
        if self.kernel not in (None, "gluon", "fp4", "fp8", "generic"):
            raise ValueError(f"DecodeOptions.kernel must be None, 'gluon', 'fp4', 'fp8' or 'generic' "
                             f"(got {self.kernel!r})")
        if self.prefetch not in (None, 0, 1, 2):
            raise ValueError(f"DecodeOptions.prefetch must be None, 0, 1 or 2 (got {self.prefetch!r})")
        if self.precise_pv and self.kernel in ("gluon", "fp8"):
            raise ValueError(f"precise_pv runs the Triton fp4 or generic kernel, not {self.kernel!r}")


_RULE = DecodeOptions()


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] bf16/fp16: one new token per sequence
    k_pages, v_pages,  # one layer's pages (paged.py): Tensor | (values, scale) | FP4Tensor
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64 on the device: cached tokens, the new one included
    scale: float,
    max_seq_len: int,  # max(seq_lens) as a Python int (sizes the splits without a device sync)
    formats: tuple[FP4Format | None, FP4Format | None] = (None, None),
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim] contiguous, the query's dtype
    options: DecodeOptions | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] query dtype
    """Attention of each sequence's new token over its cached tokens. The kernel, its build and the
    split count follow rules (DecodeOptions says which; `options` pins them for tests and benchmarks)."""
    o = options or _RULE
    kernel, num_splits, block_n, num_warps, num_stages = o.kernel, o.num_splits, o.block_n, o.num_warps, o.num_stages
    precise_pv, asm, maxnreg = o.precise_pv, o.asm, o.maxnreg
    num_seqs, num_heads, head_dim = query.shape
    _, bs, num_kv_heads, d_k = paged.check_pages(k_pages, formats[0], "k_pages")
    _, bs_v, num_kv_heads_v, d_v = paged.check_pages(v_pages, formats[1], "v_pages")
    assert (bs, num_kv_heads, d_k) == (bs_v, num_kv_heads_v, d_v) == (bs, num_kv_heads, head_dim), (
        f"K pages {(bs, num_kv_heads, d_k)}, V pages {(bs_v, num_kv_heads_v, d_v)} and query head_dim "
        f"{head_dim} disagree")
    paged.check_head_dim(head_dim)
    assert query.dtype in (torch.bfloat16, torch.float16), f"query must be bf16/fp16 (got {query.dtype})"
    assert query.stride(-1) == 1, "query's last dim must be contiguous"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(-1) == 1
    assert block_tables.dtype in (torch.int32, torch.int64) and seq_lens.shape == (num_seqs,)
    kinds = (paged.page_kind(k_pages), paged.page_kind(v_pages))
    fp4_pages, fp8_pages = kinds == (paged.FP4, paged.FP4), kinds == (paged.FP8, paged.FP8)
    fp8_fp4_pages = kinds == (paged.FP8, paged.FP4)
    if kernel in (None, "gluon"):
        why = "K and V pages are not both fp4, both fp8, or fp8 keys with fp4 values"
        if precise_pv:
            why = "precise_pv runs a Triton kernel"
        elif fp4_pages:
            why = decode_fp4_gluon.unsupported(query, k_pages, v_pages, formats, bs, num_stages)
            if why is None and asm is False:
                why = "asm=False asks for the plain-Triton unpack"
        elif fp8_pages or fp8_fp4_pages:
            why = decode_fp8_gluon.unsupported(query, k_pages, v_pages, bs, formats[1])
            if why is None and asm is False:
                why = "asm=False asks for the plain-Triton conversion"
            elif why is None and kernel is None and not (FP8_GLUON if fp8_pages else FP8_FP4_GLUON):
                why = "FP8_GLUON is off" if fp8_pages else "FP8_FP4_GLUON is off"
        if kernel == "gluon" and why is not None:
            raise ValueError(f"the Gluon {'fp8' if fp8_pages or fp8_fp4_pages else 'fp4'} kernel cannot run this "
                             f"decode: {why}")
        if why is None and (fp8_pages or fp8_fp4_pages):
            return _decode_fp8_gluon(query, k_pages, v_pages, block_tables, seq_lens, scale, max_seq_len, num_splits,
                                     out, maxnreg, o.prefetch)
        if why is None:
            return _decode_gluon(query, k_pages, v_pages, block_tables, seq_lens, scale, max_seq_len, formats,
                                 num_splits, out, maxnreg, num_stages, o.fp16, o.pair)
        # The fp4 kernel where it measured faster (docs/history.md): head_dim 128, capped at 128
        # registers, and 256, uncapped (capped it spills); at 64 the generic kernel was 1.2-1.6x faster.
        kernel = "fp4" if fp4_pages and head_dim >= 128 else "fp8" if fp8_pages and not precise_pv else "generic"
    if (kernel == "fp4" and not fp4_pages) or (kernel == "fp8" and not fp8_pages):
        raise ValueError(f"the {kernel} kernel reads {kernel} K and V pages (got page kinds {kinds})")
    both_fp4, both_fp8 = kernel == "fp4", kernel == "fp8"
    cap = (128 if head_dim == 128 else 0) if maxnreg is None else maxnreg
    capped = both_fp4 and cap > 0 and not paged.interpreting()
    if block_n is None:
        block_n = 128 if paged.FP4 in kinds else (FP8_BLOCK_N if both_fp8 else 64)
    assert paged.is_pow2(block_n) and block_n >= 16, f"block_n must be a power of two >= 16 (got {block_n})"
    group = num_heads // num_kv_heads
    if num_splits is None:
        per_sm = max(1, 65536 // (cap * 32 * num_warps)) if capped else FP8_PROGRAMS_PER_SM if both_fp8 else 2
        num_splits = num_splits_for(num_seqs, num_kv_heads, max_seq_len, query.device, block_n, per_sm,
                                    fp4_rule=both_fp4)
    split_size, num_splits, out, part_o, part_lse = _split_buffers(query, max_seq_len, num_splits, block_n, out)
    common = dict(
        H=num_kv_heads, GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim, BS=bs,
        DT=(tl.float32 if paged.interpreting() else tl.float16) if both_fp8 else paged.operand_dtype(k_pages, v_pages),
        BLOCK_N=block_n, SPLIT=num_splits > 1, PRECISE=precise_pv,
        ASM=paged.use_asm(query.device) if asm is None else asm, num_warps=num_warps,
    )
    args = (query, out, part_o, part_lse, *paged.page_args(k_pages), *paged.page_args(v_pages),
            block_tables, seq_lens, scale * LOG2E, query.stride(0), query.stride(1), block_tables.stride(0),
            split_size, num_splits)
    if both_fp8:
        _decode_fp8_kernel[(num_kv_heads, num_seqs, num_splits)](
            query, out, part_o, part_lse, *k_pages, *v_pages, *args[14:],
            **{k: v for k, v in common.items() if k != "PRECISE"}, num_stages=FP8_STAGES if num_stages is None
            else num_stages)
    elif both_fp4:
        # 128 registers at head_dim 128: four programs (16 warps) per SM instead of two; a few spill
        # slots are the cheaper side of that trade. One pipeline stage, except for fewer than 8
        # (sequence, KV head) pairs (70B at TP 8, batch 1), where two were faster (docs/history.md).
        if num_stages is None:
            num_stages = 1 if num_seqs * num_kv_heads >= 8 else 2
        tuning = {"maxnreg": cap} if capped else {}
        _decode_fp4_kernel[(num_kv_heads, num_seqs, num_splits)](
            *args, K_G=formats[0].group(head_dim), K_KO=formats[0].outliers, V_G=formats[1].group(head_dim),
            V_KO=formats[1].outliers, num_stages=num_stages, **tuning, **common)
    else:
        _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
            *args, **paged.page_constexprs(k_pages, formats[0], "K"), **paged.page_constexprs(v_pages, formats[1], "V"),
            num_stages=2 if num_stages is None else num_stages, **common)
    _merge_splits(part_o, part_lse, out, num_splits)
    return out


def warm_builds(num_heads: int, k_pages, v_pages, formats: tuple[FP4Format | None, FP4Format | None],
                dtype: torch.dtype, max_blocks_per_seq: int) -> None:
    """Compile, before serving, every build of the decode kernels that decode_attention's rules can pick
    for these pages, by launching it once per case its rules tell apart: split or not, the Gluon kernel's
    tile pairs or single tiles (Launch.constexprs_for: long or one-tile splits), the fp8 Gluon kernel's
    loads ahead (prefetch_for: by launch size, named here), the Triton fp4 kernel's
    pipeline depth (batch x KV heads under 8 or not), and the split merge for every power of two of
    splits up to 256. Without this, the first mixed step (whose decode rows are planned on their real
    lengths, not a graph's) or the first long context compiled them while serving (1-3 s each on a cold
    machine, the step waiting). Every case runs one-token sequences over block 0: reads only, outputs
    discarded."""
    head_dim = paged.check_pages(k_pages, formats[0], "k_pages")[3]
    device = paged.page_args(k_pages)[0].device
    tile = decode_fp4_gluon.W * decode_fp4_gluon.TW
    long = 64 * 128  # splits of 4096 tokens: paired in the Gluon kernel wherever pairs exist
    # the fp8 Gluon kernel's builds by launch size (decode_fp8_gluon.prefetch_for), each named here
    fp8_keys = paged.page_kind(k_pages) == paged.FP8 and paged.page_kind(v_pages) in (paged.FP8, paged.FP4)
    prefetches = (1, 2) if fp8_keys else (None,)
    for num_seqs in (1, 8):
        query = torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
        for max_seq_len, num_splits in ((1, 1), (2 * tile, 2), (long, 1), (long, 2)):
            for prefetch in prefetches:
                decode_attention(query, k_pages, v_pages, tables, lens, 1.0, max_seq_len, formats,
                                 options=DecodeOptions(num_splits=num_splits, prefetch=prefetch))
        # the rule's own call: the Gluon kernels size their splits from a compiled build's registers
        # (programs_per_sm), which loads it here rather than in the first step's call
        decode_attention(query, k_pages, v_pages, tables, lens, 1.0, 1, formats)
    out = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    for splits in (2 ** i for i in range(1, 9)):
        part_o = torch.zeros(1, num_heads, splits, head_dim, dtype=torch.float32, device=device)
        _merge_splits(part_o, torch.zeros(1, num_heads, splits, dtype=torch.float32, device=device), out, splits)


def _decode_gluon(query, k_pages, v_pages, block_tables, seq_lens, scale, max_seq_len, formats, num_splits, out,
                  maxnreg: int | None, stages: int | None, fp16: bool | None, pair: int | None) -> torch.Tensor:
    launch = decode_fp4_gluon.Launch(query, k_pages, v_pages, block_tables, seq_lens, scale * LOG2E,
                                     formats[0].outliers, maxnreg, stages, fp16, pair)
    tile = decode_fp4_gluon.W * decode_fp4_gluon.TW
    if num_splits is None:
        num_splits = num_splits_for(query.shape[0], k_pages.codes.shape[2], max_seq_len, query.device, tile,
                                    launch.programs_per_sm(), fp4_rule=True)
    split_size, num_splits, out, part_o, part_lse = _split_buffers(query, max_seq_len, num_splits, tile, out)
    launch.run(out, part_o, part_lse, split_size, num_splits)
    _merge_splits(part_o, part_lse, out, num_splits)
    return out


def _decode_fp8_gluon(query, k_pages, v_pages, block_tables, seq_lens, scale, max_seq_len, num_splits, out,
                      maxnreg: int | None, prefetch: int | None) -> torch.Tensor:
    """The splits planned for the default build (PREFETCH whole tiles ahead) as fp4_rule plans them, then the
    build for the programs that leaves (decode_fp8_gluon.prefetch_for) unless `prefetch` names one."""
    const = decode_fp8_gluon.constexprs(query, k_pages, v_pages)
    if maxnreg:
        const["maxnreg"] = maxnreg
    tile = decode_fp8_gluon.W * decode_fp8_gluon.TW
    num_kv_heads = k_pages[0].shape[2]
    if num_splits is None:
        per_sm = decode_fp8_gluon.programs_per_sm(query, k_pages, v_pages, block_tables, seq_lens, const)
        num_splits = num_splits_for(query.shape[0], num_kv_heads, max_seq_len, query.device, tile, per_sm,
                                    fp4_rule=True)
    split_size, num_splits, out, part_o, part_lse = _split_buffers(query, max_seq_len, num_splits, tile, out)
    if prefetch is None:
        prefetch = decode_fp8_gluon.prefetch_for(query.shape[0] * num_kv_heads * num_splits, _num_sms(query.device))
    const["PREFETCH"] = prefetch
    decode_fp8_gluon.launch(query, k_pages, v_pages, block_tables, seq_lens, scale * LOG2E, out, part_o, part_lse,
                            split_size, num_splits, const)
    _merge_splits(part_o, part_lse, out, num_splits)
    return out


def split_plan(max_seq_len: int, num_splits: int, tile: int) -> tuple[int, int]:
    """(split_size, num_splits) as launched when `num_splits` are asked for: the split length rounded
    up to whole tiles, and the count of splits that leaves."""
    split_size = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), tile) * tile
    return split_size, max(1, triton.cdiv(max_seq_len, split_size))


def _split_buffers(query, max_seq_len: int, num_splits: int, tile: int, out):
    """Split length rounded up to whole tiles (and the split count it leaves), the output, and with
    several splits the float32 partial outputs and log-sum-exps: (split_size, num_splits, out,
    part_o, part_lse); part_o and part_lse are `out` when unused."""
    num_seqs, num_heads, head_dim = query.shape
    split_size, num_splits = split_plan(max_seq_len, num_splits, tile)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape and out.is_contiguous() and out.dtype == query.dtype
    part_o = part_lse = out
    if num_splits > 1:
        part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    return split_size, num_splits, out, part_o, part_lse


def _merge_splits(part_o, part_lse, out, num_splits: int) -> None:
    if num_splits > 1:
        num_seqs, num_heads, head_dim = out.shape
        splits = triton.next_power_of_2(num_splits)
        block_d = math.gcd(head_dim, 32)
        _merge_kernel[(num_seqs * num_heads, head_dim // block_d)](
            part_o, part_lse, out, num_splits, D=head_dim, SPLITS=splits, BLOCK_D=block_d,
            num_warps=max(1, min(8, splits * block_d // 1024)))

