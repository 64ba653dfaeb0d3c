"""Split-KV flash-decoding (Triton, interpreted on CPU) against float32 attention over the
dequantized pages.

Bound: the kernel computes in float32 around bf16 tensor-core products of exact operands and writes
bf16 outputs, so its relative error against the float32 reference is about one bf16 rounding
(2^-9 = 2e-3): 1e-2 is the bound. Outputs are poisoned with NaN first.
"""

import pytest
import torch

from app.kernels.attention_ref import decode_attention_ref
from app.kernels.decode_attention import FP4_SPLIT_TOKENS, DecodeOptions, decode_attention, fp4_splits, split_cost
from app.kernels import paged
from kernels_testing import block_tables, interpreted, pages_to, random_pages, rel_err

ODD_LENGTHS = [1, 15, 16, 17, 1025, 1027]
SHORT = [1, 15, 16, 17, 100]  # the interpreter is slow: long sequences only where they add something
# (format, (num_kv_heads, group, head_dim, block_size), seq_lens): every format, GQA 1/4/8, head_dim
# 64/128, block size 1/16 and the odd lengths each appear; the full product is test_decode_full_grid
CASES = [
    ("bf16", (2, 1, 64, 16), ODD_LENGTHS),
    ("bf16", (1, 8, 128, 1), ODD_LENGTHS),
    ("fp8", (1, 4, 64, 16), ODD_LENGTHS),
    ("fp8", (2, 1, 128, 1), SHORT),
    ("fp8-fp4", (1, 4, 128, 16), ODD_LENGTHS),
    ("fp8-fp4", (2, 8, 64, 1), SHORT),
    ("fp4", (1, 4, 128, 16), ODD_LENGTHS),
    ("fp4", (2, 1, 64, 1), SHORT),
    ("fp4", (1, 8, 64, 16), SHORT),
    ("fp4-plain", (1, 4, 64, 16), SHORT),
    ("fp4-zscore", (2, 4, 64, 1), SHORT),
    ("fp4", (1, 7, 128, 16), SHORT),  # Qwen2.5-7B's 7 query heads per KV head (28 / 4)
    ("bf16", (1, 7, 128, 16), SHORT),
]


def _run(name, seq_lens, num_kv_heads, group, head_dim, block_size, seed=0, block_n=128, plan=None, **kw):
    """decode_attention against the reference; plan: the max_seq_len the splits are planned for
    (default max(seq_lens))."""
    table, num_blocks = block_tables(seq_lens, block_size, seed)
    k_pages, v_pages, formats = random_pages(name, num_blocks, block_size, num_kv_heads, head_dim, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    decode_attention(query, k_pages, v_pages, table, lens, scale, plan or max(seq_lens), formats, out=out,
                     options=DecodeOptions(block_n=block_n, **kw))
    ref = decode_attention_ref(query, k_pages, v_pages, table, lens, scale, formats)
    return out, ref


@pytest.mark.parametrize("name,shape,seq_lens", CASES)
@interpreted
def test_decode_matches_reference(name, shape, seq_lens):
    out, ref = _run(name, seq_lens, *shape, num_splits=3)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("name,shape,seq_lens", [c for c in CASES if c[0].startswith("fp4") and c[1][2] < 128])
@interpreted
def test_fp4_kernel_at_head_dim_64_matches_reference(name, shape, seq_lens):
    """At head_dim 64 the launcher picks the generic kernel (faster there); forced, the fp4 kernel
    is still right (block size 1, GQA 1 and 8, value outliers)."""
    out, ref = _run(name, seq_lens, *shape, num_splits=3, kernel="fp4")
    assert rel_err(out, ref) < 1e-2


@interpreted
def test_one_split_equals_many():
    """Splits merged by log-sum-exp give the one-split result (up to bf16 rounding of the output);
    seven splits of 1027 tokens leave some splits empty for the shorter sequence."""
    seq_lens = [1027, 17]
    one, ref = _run("fp4", seq_lens, 1, 4, 64, 16, num_splits=1)
    many, _ = _run("fp4", seq_lens, 1, 4, 64, 16, num_splits=7)
    assert rel_err(many, one) < 4e-3 and rel_err(one, ref) < 1e-2


@interpreted
def test_block_n_64_and_precise_pv():
    out, ref = _run("fp4", [17, 64, 65, 129], 1, 4, 64, 16, block_n=64, num_splits=2)
    precise, _ = _run("fp4", [17, 64, 65, 129], 1, 4, 64, 16, block_n=64, num_splits=2, precise_pv=True)
    assert rel_err(out, ref) < 1e-2 and rel_err(precise, ref) < 1e-2


def test_decode_checks_its_inputs():
    table, num_blocks = block_tables([5], 16)
    k_pages, v_pages, formats = random_pages("fp4", num_blocks, 16, 2, 64)
    query = torch.randn(1, 4, 64).bfloat16()
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(AssertionError, match="query head_dim 32 disagree"):
        decode_attention(query[..., :32], k_pages, v_pages, table, lens, 1.0, 5, formats)
    with pytest.raises(AssertionError, match="num_heads 3 not a multiple of num_kv_heads 2"):
        decode_attention(query[:, :3], k_pages, v_pages, table, lens, 1.0, 5, formats)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp8", "fp4", "fp4-plain", "fp4-zscore"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_full_grid(name, group, head_dim, block_size, num_splits):
    out, ref = _run(name, ODD_LENGTHS, 2, group, head_dim, block_size, num_splits=num_splits)
    assert rel_err(out, ref) < 1e-2


def test_fp4_split_cost_counts_the_busiest_sm():
    """132 SMs x 4 program slots, 64-token tiles: 70B at TP 8, batch 32, 8k context."""
    # 16 splits of 512 tokens: 512 programs, 4 on the busiest SM, one whole wave
    assert split_cost(32, 8192, 64, 16, 4, 132) == 4 * (512 + 160)
    # 8 splits of 1024: 256 programs, 2 on the busiest SM, each at 1.12x a token's cost
    assert split_cost(32, 8192, 64, 8, 4, 132) == pytest.approx(2 * (1024 * 1.12 + 160))
    # 20 splits round to 410 -> 448-token splits (19 of them): 608 programs, 5 on an SM: two waves
    assert split_cost(32, 8192, 64, 20, 4, 132) == 2 * 4 * (448 + 160)


@interpreted
def test_fp8_kernel_agrees_with_the_generic_kernel():
    """fp8 K and V pages run _decode_fp8_kernel (16-bit words split into even and odd halves, fp16
    operands, value scales folded into the scores); the generic kernel reads the same pages as bf16
    tiles. Both agree with each other and with float32 attention; seven splits leave empty ones."""
    seq_lens = [1, 17, 300]
    import app.kernels.decode_attention as da

    fp8, ref = _run("fp8", seq_lens, 2, 4, 128, 16, num_splits=7, block_n=None)
    generic, _ = _run("fp8", seq_lens, 2, 4, 128, 16, num_splits=7, kernel="generic")
    assert rel_err(fp8, generic) < 4e-3 and rel_err(fp8, ref) < 1e-2
    assert da.FP8_BLOCK_N >= 16


_CUDA = [pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or paged.interpreting(), reason="needs CUDA (and TRITON_INTERPRET unset)"))]


_CPU = [pytest.param("cpu", marks=interpreted)]


@pytest.mark.parametrize("device", _CPU + _CUDA)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_kernel_at_extreme_magnitudes(device, num_splits):
    """The fp8 kernel's fp16 operands hold any magnitude the format stores: queries of 3e5 (past fp16's
    range) and 3e-6 (below its normal range) go in scaled by a power of two; values whose scales span
    2^-60 .. 2^60 go through the PV product as probability x scale <= 1. Against float32 attention over
    the same pages (on the GPU: the PTX conversion and fp16 tensor cores; on the CPU: the interpreter)."""
    from app.kernels import fp8

    seq_lens = [33, 200, 1]
    kv_heads, group, d, bs = 2, 4, 128, 16
    table, nb = block_tables(seq_lens, bs)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(nb, bs, kv_heads, d, generator=gen)
    v = torch.randn(nb, bs, kv_heads, d, generator=gen) * torch.exp2(torch.randint(-60, 61, (nb, bs, kv_heads, 1),
                                                                                generator=gen).float())
    q = torch.randn(len(seq_lens), kv_heads * group, d, generator=gen)
    q[0] *= 3e5
    q[2] *= 3e-6
    k_pages, v_pages = fp8.fp8_quantize(k), fp8.fp8_quantize(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = decode_attention_ref(q.bfloat16(), k_pages, v_pages, table, lens, d ** -0.5, (None, None))
    dev = torch.device(device)
    out = torch.full((len(seq_lens), kv_heads * group, d), float("nan"), dtype=torch.bfloat16, device=dev)
    decode_attention(q.bfloat16().to(dev), pages_to(k_pages, dev), pages_to(v_pages, dev), table.to(dev), lens.to(dev), d ** -0.5,
                     max(seq_lens), out=out, options=DecodeOptions(num_splits=num_splits))
    # per sequence: each one's outputs have their own magnitude (its values' scales)
    for i in range(len(seq_lens)):
        assert rel_err(out[i].cpu(), ref[i]) < 1e-2, i


@pytest.mark.parametrize("device", _CPU + _CUDA)
@pytest.mark.parametrize("group,head_dim,block_size", [(4, 128, 16), (8, 64, 1), (1, 128, 16)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_fp8_keys_with_fp4_values_on_the_device(device, group, head_dim, block_size, num_splits):
    """fp8-fp4 pages (fp8 keys, fp4 values) through the rule's kernel (the generic one) on the device (on the
    GPU: the PTX unpack and bf16 tensor cores) against float32 attention over the same pages: GQA 1/4/8,
    head_dim 64/128, block size 1/16, one split and five (some empty)."""
    seq_lens = [1, 17, 300, 1027] if device == "cuda" else [1, 17, 100]
    kv_heads = 2
    table, nb = block_tables(seq_lens, block_size, seed=3)
    k_pages, v_pages, formats = random_pages("fp8-fp4", nb, block_size, kv_heads, head_dim, seed=3)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = decode_attention_ref(q, k_pages, v_pages, table, lens, head_dim ** -0.5, formats)
    dev = torch.device(device)
    out = torch.full_like(q, float("nan"), device=dev)
    decode_attention(q.to(dev), pages_to(k_pages, dev), pages_to(v_pages, dev), table.to(dev), lens.to(dev), head_dim ** -0.5,
                     max(seq_lens), formats, out=out, options=DecodeOptions(num_splits=num_splits))
    assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("pairs,seq_len,splits", [
    (1, 32768, 128),  # 70B at TP 8, batch 1: 512-token splits would leave 64 programs for 132 SMs
    (2, 32768, 64),  # batch 2: 128 programs of 512 tokens (the H200 measured 0.0218 ms against 0.0227 for 128 splits)
    (4, 32768, 64),  # (0.0282 ms against 0.0328)
    (1, 65536, 128),  # (0.0221 ms against 0.0238 for 256 splits)
    (1, 8192, 64),  # 70B at TP 8, batch 1, 8k: 64 programs of 128 tokens (0.943x the time of 32 of 256)
    (8, 8192, 16),  # Llama-3.1-8B batch 1: 128 programs of 512 tokens
    (256, 32768, 2),  # batch 32: one full wave; 3 splits would start a mostly idle second
    (1024, 32768, 1),  # enough (sequence, KV head) pairs: no split
    # 2 programs of 1024 tokens per SM rather than 4 of 512 (0.929x the time at 70B TP 8 batch 8, 32k,
    # 0.980x at 8B batch 1; 0.935x at 70B batch 32, 8k)
    (8, 32768, 32),
    (32, 8192, 8),
    (64, 32768, 8),  # 8B batch 8: 4096-token programs, 4 per SM (2 per SM measured 1.125x the time)
    (1, 100, 1),
])
def test_fp4_splits(pairs, seq_len, splits):
    """132 SMs x 4 programs, 64-token tiles (the Gluon kernel's); split counts as asked for (the launcher
    runs the same here)."""
    got = fp4_splits(pairs, seq_len, 64, 4, 132)
    assert got == splits
    assert seq_len // got >= min(FP4_SPLIT_TOKENS[-1], seq_len)


def test_decode_layers_plans_the_models_layers_within_the_memory_budget():
    """bench/decode_layers.py runs the model's layers (32 / 80) unless the three variants' caches (bf16 K+V 512,
    default fp4 K+V 150, KG8 K+V 150 bytes per token and KV head: KG8 keys take the default's 81 bytes)
    would exceed the budget, then as many as fit."""
    from bench.decode_layers import layers_for

    assert layers_for("8B", 8, 8192, 90e9) == 32
    assert layers_for("70B-TP8", 32, 32768, 90e9) == 80
    per_layer = 32 * 32768 * 8 * (512 + 2 * 150)
    assert layers_for("8B", 32, 32768, 90e9) == int(90e9 // per_layer) == 13
    assert layers_for("8B", 32, 32768, 1e9) == 1  # never none


def test_fp4_splits_capped_by_the_longest_split_that_fills_half_the_sms():
    """At most the splits of the longest of FP4_SPLIT_TOKENS (512, 256, 128) for which the programs
    number at least half the SMs (66), of the shortest where none does; the cost alone would often split
    further (shorter programs on idle SMs)."""
    assert split_cost(16, 4096, 64, 16, 4, 132) < split_cost(16, 4096, 64, 8, 4, 132)
    assert fp4_splits(16, 4096, 64, 4, 132) == 4096 // 512  # 16 x 8 = 128 programs of 512 tokens
    assert fp4_splits(2, 8192, 64, 4, 132) == 8192 // 128  # 2 x 16 and 2 x 32 are too few: 2 x 64
    assert fp4_splits(4, 2048, 64, 4, 132) == 2048 // 128  # none is enough: the shortest


@interpreted
def test_fp4_kernel_agrees_with_the_generic_kernel():
    """The engine's fp4 cache runs _decode_fp4_kernel; the generic kernel reads the same pages
    another way (nibbles interleaved, PV untransposed, outliers over padded rows)."""
    seq_lens = [1, 17, 300]
    fp4, ref = _run("fp4", seq_lens, 2, 4, 128, 16, num_splits=3)
    generic, _ = _run("fp4", seq_lens, 2, 4, 128, 16, num_splits=3, kernel="generic")
    assert rel_err(fp4, generic) < 4e-3 and rel_err(fp4, ref) < 1e-2


@pytest.mark.parametrize("name", ["bf16", "fp4"])
@interpreted
def test_a_sequence_shorter_than_the_plan_spreads_over_its_splits(name, monkeypatch):
    """A decode planned for a longer max_seq_len than its sequences (a decode graph plans for
    max_model_len) splits each sequence's own length: 4 splits planned for 4096 tokens, 128-token tiles,
    a 1025-token sequence in 3 splits of 384 (not one of 1024, one of 1 and two empty); 17 tokens in one
    split; the result as the reference."""
    import app.kernels.decode_attention as da

    seen = []
    merge = da._merge_splits
    monkeypatch.setattr(da, "_merge_splits", lambda o, lse, out, n: (seen.append(lse.clone()), merge(o, lse, out, n)))
    out, ref = _run(name, [1025, 17], 1, 4, 64, 16, plan=4096, num_splits=4)
    assert rel_err(out, ref) < 1e-2
    (lse,) = seen  # [sequences, heads, splits]
    assert lse.isfinite().sum(-1).tolist() == [[3] * 4, [1] * 4]


def test_decode_options_refuse_what_no_kernel_runs():
    """DecodeOptions (what tests and benchmarks pin below the rules) refuses an unknown kernel and
    precise_pv on a kernel without it; a kernel named for pages it does not read is a ValueError."""
    with pytest.raises(ValueError, match="must be None, 'gluon', 'fp4', 'fp8' or 'generic'"):
        DecodeOptions(kernel="triton")
    with pytest.raises(ValueError, match="precise_pv runs the Triton fp4 or generic kernel"):
        DecodeOptions(kernel="fp8", precise_pv=True)
    with pytest.raises(ValueError, match="the fp8 kernel reads fp8 K and V pages"):
        _run("fp4", [17, 40], 1, 4, 64, 16, kernel="fp8")
    with pytest.raises(ValueError, match="the Gluon fp8 kernel cannot run this decode: head_dim 64"):
        _run("fp8", [17, 40], 1, 4, 64, 16, kernel="gluon")
