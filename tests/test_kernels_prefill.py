"""Chunked-prefill attention (Triton, interpreted on CPU) against float32 causal attention over the
dequantized pages, on ragged batches. Bound as for decode (tests/test_kernels_decode.py): 1e-2."""

import pytest
import torch

from app.kernels.decode_attention import DecodeOptions, decode_attention
from app.kernels.attention_ref import prefill_attention_ref
from app.kernels.prefill_attention import prefill_attention
from kernels_testing import block_tables, interpreted, random_pages, rel_err

# (cached context, new tokens): first chunks, later chunks, single tokens, 1025 and 1027 in all
RAGGED = [(0, 17), (15, 1), (16, 15), (0, 1), (1010, 17), (1008, 17)]
SHORT = [(0, 17), (15, 1), (16, 15), (0, 1), (90, 10)]
CASES = [
    ("bf16", (2, 1, 64, 16), RAGGED),
    ("bf16", (1, 8, 128, 1), SHORT),
    ("fp8", (1, 4, 64, 1), RAGGED),
    ("fp4", (1, 4, 128, 16), RAGGED),
    ("fp4", (2, 1, 64, 1), SHORT),
    ("fp4-zscore", (1, 8, 64, 16), SHORT),
    ("fp4", (1, 7, 128, 16), SHORT),  # Qwen2.5-7B's 7 query heads per KV head (28 / 4)
]


def _run(name, chunks, num_kv_heads, group, head_dim, block_size, seed=0, block_m=64, block_n=128, **kw):
    seq_lens = [c + q for c, q in chunks]
    table, num_blocks = block_tables(seq_lens, block_size, seed)
    k_pages, v_pages, formats = random_pages(name, num_blocks, block_size, num_kv_heads, head_dim, seed)
    qsl = torch.tensor([0] + [q for _, q in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=gen).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    prefill_attention(query, k_pages, v_pages, table, lens, qsl, scale, formats, block_m=block_m, block_n=block_n,
                      out=out, **kw)
    ref = prefill_attention_ref(query, k_pages, v_pages, table, lens, qsl, scale, formats)
    return out, ref, (query, k_pages, v_pages, table, lens, formats)


@pytest.mark.parametrize("name,shape,chunks", CASES)
@interpreted
def test_prefill_matches_reference_on_a_ragged_batch(name, shape, chunks):
    out, ref, _ = _run(name, chunks, *shape)
    assert rel_err(out, ref) < 1e-2


@interpreted
def test_chunked_equals_one_shot():
    """Rows of a later chunk (context 13, 27 new tokens) equal the same rows of a one-shot prefill."""
    _, _, (query, k_pages, v_pages, table, lens, formats) = _run("fp4", [(0, 40)], 1, 4, 64, 16)
    qsl = torch.tensor([0, 40], dtype=torch.int32)
    one = prefill_attention(query, k_pages, v_pages, table, lens, qsl, 0.125, formats, block_n=128)
    late = prefill_attention(query[13:], k_pages, v_pages, table, lens, torch.tensor([0, 27], dtype=torch.int32),
                             0.125, formats, block_n=128)
    assert rel_err(late, one[13:]) < 1e-6


@interpreted
def test_single_token_rows_equal_decode():
    out, _, (query, k_pages, v_pages, table, lens, formats) = _run("fp4", [(40, 1), (126, 1), (0, 1)], 2, 4, 64, 16)
    dec = decode_attention(query, k_pages, v_pages, table, lens, 64 ** -0.5, int(lens.max()), formats,
                           options=DecodeOptions(num_splits=2))
    assert rel_err(dec, out) < 4e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp8", "fp4", "fp4-plain", "fp4-zscore"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_full_grid(name, group, head_dim, block_size):
    out, ref, _ = _run(name, RAGGED, 2, group, head_dim, block_size)
    assert rel_err(out, ref) < 1e-2
