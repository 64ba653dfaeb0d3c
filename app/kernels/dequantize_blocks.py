"""Dequantize whole KV blocks of quantized pages (fp8, fp4) into dense pages of the compute dtype.

Prefill over quantized pages runs in two passes (app/engine/prefill_plan.py): the blocks of each
prefill sequence (its cached context and the chunk just stored) are dequantized once per layer into a
dense scratch, and the prefill kernel
then attends over the scratch as it does over bf16 pages. Dequantizing inside the attention kernel
instead repeats the work for every block of query rows of the sequence (a 2k-token chunk has 16-64
of them) and ran 3.5-3.9x slower than bf16 pages on an H200 (docs/history.md); here each cached
token is dequantized once, at the cost of a copy.

A program takes (one block of the plan, one KV head): program p reads block
`block_tables[prog_seq[p], prog_blk[p]]` of the pages and writes block `seq_off[prog_seq[p]] +
prog_blk[p]` of `out`. The values are those the attention kernels use: fp4 codes x group scale x
the second-level scale with the outliers put back, fp8 values x their scale, rounded once to the
output dtype (exact for fp4 whenever the value is a bf16 number, which codes x power-of-two scales are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels import paged
from app.kernels.fp4 import FP4Format


# the tables' width changes every step and the engine passes a slice of the step's tables, whose alignment
# changes with the slice: neither specializes (one compile, at start-up)
@triton.jit(do_not_specialize=("stride_bt",), do_not_specialize_on_alignment=("block_tables_ptr",))
def _dequantize_blocks_kernel(
    p0, p1, p2, p3, p4, out_ptr, block_tables_ptr, prog_seq_ptr, prog_blk_ptr, seq_off_ptr, stride_bt,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr,
    KIND: tl.constexpr, G: tl.constexpr, KO: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(prog_seq_ptr + p)
    b = tl.load(prog_blk_ptr + p)
    src = tl.load(block_tables_ptr + s.to(tl.int64) * stride_bt + b).to(tl.int64)
    dst = (tl.load(seq_off_ptr + s) + b).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    mask = t < BS
    rows = (src * BS + t) * H + h  # [BLOCK_T] slot * H + head
    a, sb, c, e, f = paged.load_raw(p0, p1, p2, p3, p4, rows, mask, KIND, D, G, KO)
    w, fac = paged.unpack_raw(a, sb, c, e, f, KIND, D, G, KO, True, DT, ASM)
    x = w.to(tl.float32) * fac[:, None]
    d = tl.arange(0, D)
    o_rows = ((dst * BS + t) * H + h) * D
    tl.store(out_ptr + o_rows[:, None] + d[None, :], paged.cast_out(x, out_ptr.dtype.element_ty), mask=mask[:, None])


def dequantize_blocks(
    pages,  # one layer's K or V pages (paged.py): (values, scale) fp8 or an FP4Tensor
    fmt: FP4Format | None,  # the fp4 format (None for fp8)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64: the pages' block ids
    prog_seq: torch.Tensor,  # [P] int32: the sequence of each block to dequantize
    prog_blk: torch.Tensor,  # [P] int32: its block index within the sequence
    seq_off: torch.Tensor,  # [num_seqs] int32: where each sequence's blocks start in out
    out: torch.Tensor,  # [num_out_blocks, block_size, H, D] bf16/fp16: the dense scratch
) -> torch.Tensor:
    """Write the P blocks the plan lists, dequantized, into out (other blocks of out untouched)."""
    kind = paged.page_kind(pages)
    assert kind in (paged.FP8, paged.FP4), "dense pages need no dequantization"
    nb, bs, h, d = paged.check_pages(pages, fmt, "pages")
    assert out.dim() == 4 and tuple(out.shape[1:]) == (bs, h, d) and out.is_contiguous(), (
        f"out must be [blocks, {bs}, {h}, {d}] contiguous (got {tuple(out.shape)})")
    assert out.dtype in (torch.bfloat16, torch.float16)
    assert prog_seq.shape == prog_blk.shape and prog_seq.dtype == prog_blk.dtype == torch.int32
    assert seq_off.dtype == torch.int32 and seq_off.shape[0] == block_tables.shape[0]
    assert block_tables.stride(-1) == 1
    num = prog_seq.shape[0]
    if num == 0:
        return out
    _dequantize_blocks_kernel[(num, h)](
        *paged.page_args(pages), out, block_tables, prog_seq, prog_blk, seq_off, block_tables.stride(0),
        H=h, D=d, BS=bs, BLOCK_T=max(triton.next_power_of_2(bs), 1), **_constexprs(pages, fmt),
        DT=paged.operand_dtype(pages, pages), ASM=paged.use_asm(out.device), num_warps=4,
    )
    return out


def _constexprs(pages, fmt: FP4Format | None) -> dict:
    c = paged.page_constexprs(pages, fmt, "")
    return {"KIND": c["_KIND"], "G": c["_G"], "KO": c["_KO"]}
