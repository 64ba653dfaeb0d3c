"""Chunked-prefill attention over a paged KV cache (bf16/fp16, fp8 or fp4 pages), ragged batches.

The engine stores a step's new K/V before attending, so every key a new token sees (its cached
context and the new tokens up to itself) is read from the pages, in the cache's format. Sequence i
owns query rows query_start_loc[i]:query_start_loc[i+1]; its q_len new tokens sit at positions
seq_len - q_len .. seq_len - 1 and attend causally.

A program takes (BLOCK_Q new tokens of one sequence, one KV head) and packs the `group` query heads
sharing that KV head into its rows (BLOCK_Q x group rows), so each K/V tile is loaded and
dequantized once for all of them; the loop runs over key tiles up to the block's last position
with an online softmax. Programs find their sequence by binary search over query_start_loc: there
are cdiv(num_tokens, BLOCK_Q) + num_seqs of them per KV head, and sequence i owns those from
(query_start_loc[i] - query_start_loc[0]) // BLOCK_Q + i on (the spare ones exit at once;
query_start_loc may be a slice of a step's, whose rows then start at query_start_loc[0]). fp4 outliers are added into
the dequantized tiles (rounded to bf16 there), which all BLOCK_M query rows then share: re-reading
queries at the outlier indices, as decode does, cost 6x here (docs/history.md). precise_pv
splits the probabilities into two bf16 terms for the PV product (float32-accurate, one more
tensor-core product, 25% slower on bf16 pages).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from app.kernels import paged
from app.kernels.decode_attention import LOG2E
from app.kernels.fp4 import FP4Format


# num_seqs and the tables' width change every step, and the engine passes slices of the step's tables,
# lengths and query offsets (app/engine/kv_cache.py's scratch groups), whose alignment changes with the
# slice: none of them specializes, so the kernel compiles once, at start-up, not while serving
@triton.jit(do_not_specialize=("num_seqs", "stride_bt"),
            do_not_specialize_on_alignment=("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"))
def _prefill_kernel(
    q_ptr, out_ptr,
    k0, k1, k2, k3, k4, v0, v1, v2, v3, v4,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs,
    sm_scale_log2, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    K_KIND: tl.constexpr, K_G: tl.constexpr, K_KO: tl.constexpr,
    V_KIND: tl.constexpr, V_G: tl.constexpr, V_KO: tl.constexpr,
    DT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr, ASM: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    # the sequence: the last i with (query_start_loc[i] - query_start_loc[0]) // BLOCK_Q + i <= pid
    base = tl.load(query_start_loc_ptr)
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid)
    q_start = tl.load(query_start_loc_ptr + lo)
    q_len = tl.load(query_start_loc_ptr + lo + 1) - q_start
    qb = pid - ((q_start - base) // BLOCK_Q + lo)
    if qb * BLOCK_Q >= q_len:
        return
    if SKIP_DECODES and q_len == 1:
        return  # the caller runs the decode kernel on these rows
    seq_len = tl.load(seq_lens_ptr + lo)
    ctx = seq_len - q_len
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    r = tl.arange(0, BLOCK_M)
    t = qb * BLOCK_Q + r // GP  # new-token index within the sequence
    gi = r % GP
    row_mask = (t < q_len) & (gi < GROUP)
    pos = ctx + t  # [BLOCK_M] position of each row's token
    head = h * GROUP + gi
    d = tl.arange(0, D)
    q_rows = (q_start + t).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None], other=0.0).to(DT)
    bt_row = block_tables_ptr + lo.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_end = tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_Q)
    j = tl.arange(0, BLOCK_N)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + j
        n_mask = n < kv_end
        rows = paged.page_rows(bt_row, n, n_mask, BS, H, h)
        ka, kb, kc, kd, ke = paged.load_raw(k0, k1, k2, k3, k4, rows, n_mask, K_KIND, D, K_G, K_KO)
        va, vb, vc, vd, ve = paged.load_raw(v0, v1, v2, v3, v4, rows, n_mask, V_KIND, D, V_G, V_KO)
        wk, fk = paged.unpack_raw(ka, kb, kc, kd, ke, K_KIND, D, K_G, K_KO, True, DT, ASM)
        s = paged.mma(q, tl.trans(wk), None) * fk[None, :]  # [BLOCK_M, BLOCK_N]
        s = tl.where((n[None, :] <= pos[:, None]) & n_mask[None, :], s * sm_scale_log2, float("-inf"))
        wv, fv = paged.unpack_raw(va, vb, vc, vd, ve, V_KIND, D, V_G, V_KO, True, DT, ASM)
        m, l, acc = paged.softmax_step(s, m, l, acc, wv, fv, DT, PRECISE)
    o_rows = (q_start + t).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + d[None, :], paged.cast_out(acc / l[:, None], out_ptr.dtype.element_ty),
             mask=row_mask[:, None])


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16/fp16: the step's new tokens
    k_pages, v_pages,  # one layer's pages (paged.py), the new tokens' K/V already stored
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32 on the device: cached tokens after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 on the device: cu_seqlens of the new tokens
    scale: float,
    formats: tuple[FP4Format | None, FP4Format | None] = (None, None),
    block_m: int = 128,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    precise_pv: bool = False,
    asm: bool | None = None,
    out: torch.Tensor | None = None,
    skip_decodes: bool = False,
    num_rows: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] query dtype
    """Launcher. The sequences may be a slice of a step's: query_start_loc then holds absolute rows
    of query (query_start_loc[0] > 0 allowed) and only rows query_start_loc[0]:query_start_loc[-1]
    are written, num_rows of them (a host int; None: all of query). skip_decodes: sequences with one
    new token are left to the caller (their rows of out untouched). The default tiles (128 query rows x
    32 keys, 4 warps, 2 stages) measured fastest of eight on an H200 for bf16 pages at 8B shapes
    (docs/history.md)."""
    num_heads, head_dim = query.shape[1:]
    num_seqs = seq_lens.shape[0]
    _, bs, num_kv_heads, d_k = paged.check_pages(k_pages, formats[0], "k_pages")
    _, bs_v, num_kv_heads_v, d_v = paged.check_pages(v_pages, formats[1], "v_pages")
    assert (bs, num_kv_heads, d_k) == (bs_v, num_kv_heads_v, d_v) == (bs, num_kv_heads, head_dim), (
        f"K pages {(bs, num_kv_heads, d_k)}, V pages {(bs_v, num_kv_heads_v, d_v)} and query head_dim "
        f"{head_dim} disagree")
    paged.check_head_dim(head_dim)
    assert query.dtype in (torch.bfloat16, torch.float16) and query.stride(-1) == 1
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(-1) == 1
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype in (torch.int32, torch.int64)
    assert paged.is_pow2(block_m) and paged.is_pow2(block_n) and block_n >= 16
    group = num_heads // num_kv_heads
    gp = triton.next_power_of_2(group)
    block_q = max(1, block_m // gp)  # BLOCK_M = block_q * gp rows, at least 16 for tl.dot
    assert block_q * gp >= 16, f"block_m {block_m} gives fewer than 16 rows for group {group}"
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1
    num_tokens = query.shape[0] if num_rows is None else num_rows
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, out, *paged.page_args(k_pages), *paged.page_args(v_pages),
        block_tables, seq_lens, query_start_loc, num_seqs,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        H=num_kv_heads, GROUP=group, GP=gp, D=head_dim, BS=bs,
        **paged.page_constexprs(k_pages, formats[0], "K"), **paged.page_constexprs(v_pages, formats[1], "V"),
        DT=paged.operand_dtype(k_pages, v_pages), BLOCK_Q=block_q, BLOCK_N=block_n, PRECISE=precise_pv,
        ASM=paged.use_asm(query.device) if asm is None else asm, SKIP_DECODES=skip_decodes,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out

