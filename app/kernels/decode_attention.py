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

Speed (bench/RESULTS.md): bf16 pages run within 3-13% of torch SDPA on contiguous K/V for the
Llama-3.1-8B shape; fp4 pages are 1.3-3x slower than SDPA, not 3x faster: the unpack is instruction-
and latency-bound in this Triton form (the note there has the counts).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from app.engine.attention import causal_attention_ref
from app.kernels import paged
from app.kernels.fp4 import FP4Format

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # fewer tokens per split than this and the merge costs more than it gains


@triton.jit
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
    h = tl.program_id(0)
    b = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = sp * split_size
    end = tl.minimum(seq_len, start + split_size)
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
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_splits, D: tl.constexpr, CHUNK: tl.constexpr):
    """out[row] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), one program per (sequence, q head)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNK)
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for c0 in range(0, num_splits, CHUNK):
        lse = tl.load(part_lse_ptr + row * num_splits + c0 + c, mask=c0 + c < num_splits, other=float("-inf"))
        top = tl.maximum(top, lse)
    top_all = tl.max(top, 0)  # split 0 always holds tokens: finite
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    den = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, num_splits, CHUNK):
        mask = c0 + c < num_splits
        lse = tl.load(part_lse_ptr + row * num_splits + c0 + c, mask=mask, other=float("-inf"))
        w = tl.where(mask, tl.exp2(lse - top_all), 0.0)
        o = tl.load(part_o_ptr + (row * num_splits + c0 + c)[:, None] * D + d[None, :], mask=mask[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        den += w
    tl.store(out_ptr + row * D + d, paged.cast_out(acc / tl.sum(den, 0), out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                   block_n: int) -> int:
    """Enough (KV head, sequence, split) programs for about two waves over the SMs, but no split
    shorter than MIN_SPLIT_TOKENS and at most 256 splits."""
    sms = _num_sms(device)
    want = triton.cdiv(2 * sms, num_seqs * num_kv_heads)
    most = max(1, max_seq_len // max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(want, most, 256))


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] bf16/fp16: one new token per sequence
    k_pages, v_pages,  # one layer's pages (paged.py): Tensor | (values, scale) | FP4Tensor
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64 on the device: cached tokens, the new one included
    scale: float,
    max_seq_len: int,  # max(seq_lens) as a Python int (sizes the splits without a device sync)
    formats: tuple[FP4Format | None, FP4Format | None] = (None, None),
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    precise_pv: bool = False,
    asm: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] query dtype
    """Launcher. block_n: tokens per tile (None: 128 for fp4 pages, 64 otherwise, the fastest in
    bench/RESULTS.md); precise_pv: the PV product from p split into two bf16 terms (float32-accurate;
    costs 3% on fp4 pages and 30% on bf16 pages there); asm: the inline-PTX fp4 unpack (None: on
    CUDA), else plain Triton (the benchmark compares both)."""
    num_seqs, num_heads, head_dim = query.shape
    if block_n is None:
        block_n = 128 if paged.FP4 in (paged.page_kind(k_pages), paged.page_kind(v_pages)) else 64
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
    assert paged.is_pow2(block_n) and block_n >= 16, f"block_n must be a power of two >= 16 (got {block_n})"
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = num_splits_for(num_seqs, num_kv_heads, max_seq_len, query.device, block_n)
    split_size = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_seq_len, split_size))
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape and out.is_contiguous() and out.dtype == query.dtype
    part_o = part_lse = out
    if num_splits > 1:
        part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        query, out, part_o, part_lse,
        *paged.page_args(k_pages), *paged.page_args(v_pages),
        block_tables, seq_lens,
        scale * LOG2E, query.stride(0), query.stride(1), block_tables.stride(0), split_size, num_splits,
        H=num_kv_heads, GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim, BS=bs,
        **paged.page_constexprs(k_pages, formats[0], "K"), **paged.page_constexprs(v_pages, formats[1], "V"),
        DT=paged.operand_dtype(k_pages, v_pages), BLOCK_N=block_n, SPLIT=num_splits > 1, PRECISE=precise_pv,
        ASM=paged.use_asm(query.device) if asm is None else asm,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs * num_heads,)](part_o, part_lse, out, num_splits, D=head_dim, CHUNK=16, num_warps=4)
    return out


def decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_pages, v_pages,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    formats: tuple[FP4Format | None, FP4Format | None] = (None, None),
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] float32
    """Float32 attention over the dequantized pages (fp4 via app/kernels/fp4.py), one sequence at a time."""
    k_all = paged.dequantize_pages(k_pages, formats[0])  # [nb, bs, H, D]
    v_all = paged.dequantize_pages(v_pages, formats[1])
    bs = k_all.shape[1]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : math.ceil(n / bs)].long()
        k = k_all[blocks].flatten(0, 1)[:n]
        v = v_all[blocks].flatten(0, 1)[:n]
        out[i] = causal_attention_ref(query[i : i + 1], k, v, scale)[0]
    return out
