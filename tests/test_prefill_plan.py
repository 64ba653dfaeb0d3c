"""The GPU prefill plan (app/engine/prefill_plan.py) with exact expectations, and the block
dequantization kernel (Triton, interpreted on CPU) against its torch reference."""

import pytest
import torch

from app.engine.prefill_plan import plan_prefill
from app.kernels.attention_ref import dequantize_blocks_ref
from app.kernels.dequantize_blocks import dequantize_blocks
from kernels_testing import random_pages

CPU = torch.device("cpu")
# a mixed step: sequence 0 a 17-token chunk over 23 cached, 1 a decode, 2 a 12-token chunk over 88, 3 a decode
SEQ_LENS, QSL = [40, 9, 100, 5], [0, 17, 18, 30, 31]


def test_mixed_step_plan():
    plan = plan_prefill(SEQ_LENS, QSL, 16, quantized=True, scratch_blocks=64, device=CPU)
    assert plan.decodes.rows.tolist() == [17, 30] and plan.decodes.seqs.tolist() == [1, 3]
    assert plan.decodes.max_seq_len == 9
    (g,) = plan.groups
    assert (g.first, g.end, g.row_start, g.row_end, g.num_blocks) == (0, 3, 0, 30, 10)
    assert g.seq_off.tolist() == [0, 3, 3]  # the decode between them owns no scratch block
    assert g.prog_seq.tolist() == [0] * 3 + [2] * 7  # all cdiv(40, 16) and cdiv(100, 16) blocks
    assert g.prog_blk.tolist() == [0, 1, 2] + list(range(7))
    assert g.tables[0, :3].tolist() == [0, 1, 2] and g.tables[2, :7].tolist() == list(range(3, 10))


def test_plan_groups_fit_the_scratch_and_a_long_sequence_goes_alone():
    plan = plan_prefill(SEQ_LENS, QSL, 16, quantized=True, scratch_blocks=5, device=CPU)
    assert [(g.first, g.end, g.num_blocks) for g in plan.groups] == [(0, 1, 3), (2, 3, 7)]
    assert (plan.groups[1].row_start, plan.groups[1].row_end) == (18, 30)
    assert plan.groups[1].seq_off.tolist() == [0] and plan.groups[1].prog_blk.tolist() == list(range(7))


def test_dense_pages_need_no_scratch_and_a_step_without_decodes_has_no_decode_rows():
    dense = plan_prefill(SEQ_LENS, QSL, 16, quantized=False, scratch_blocks=64, device=CPU)
    assert dense.groups == [] and dense.decodes.rows.tolist() == [17, 30]
    assert plan_prefill([40, 30], [0, 17, 30], 16, True, 64, CPU).decodes is None
    assert plan_prefill([9, 5], [0, 1, 2], 16, True, 64, CPU).groups == []  # decodes only: nothing planned


@pytest.mark.parametrize("name", ["fp8", "fp4", "fp4-zscore"])
def test_dequantize_blocks_matches_reference(name):
    k_pages, _, formats = random_pages(name, 12, 16, 2, 64, seed=3)
    tables = torch.tensor([[5, 2, 9, 0], [7, 11, 1, 3]], dtype=torch.int32)
    prog_seq = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    prog_blk = torch.tensor([0, 1, 2, 1, 3], dtype=torch.int32)
    seq_off = torch.tensor([4, 0], dtype=torch.int32)
    out = torch.full((8, 16, 2, 64), float("nan"), dtype=torch.bfloat16)
    ref = out.clone()
    dequantize_blocks(k_pages, formats[0], tables, prog_seq, prog_blk, seq_off, out)
    dequantize_blocks_ref(k_pages, formats[0], tables, prog_seq, prog_blk, seq_off, ref)
    written = [4, 5, 6, 1, 3]
    assert torch.equal(out[written], ref[written])
    assert out[[0, 2, 7]].isnan().all()  # blocks the plan does not list stay untouched
