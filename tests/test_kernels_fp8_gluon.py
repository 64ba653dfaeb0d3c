"""The Gluon fp8 decode kernel (app/kernels/decode_fp8_gluon.py).

Gluon kernels do not run under Triton's interpreter, so the default suite checks what needs no GPU: the
kernel compiles for sm_90 (every build, with the installed Triton: its layouts convert without moving
data, which the compiler checks), `unsupported` names why a decode falls back, and the fallback (the
Triton fp8 kernel) is what runs where it cannot.

On a CUDA GPU (`TRITON_INTERPRET=0 python -m pytest tests/test_kernels_fp8_gluon.py`) it is checked
against float32 attention over the same pages and against the Triton fp8 kernel, per sequence and query
head: odd lengths (partial tiles), GQA 1, 2, 3, 4 and 8, one split and many, each build (0, 1 or 2 tiles
of loads ahead, 1 ahead capped at 128 registers), values whose scales span 2^-60 .. 2^60, 64-bit offsets, and the engine's inputs
(int32 tables and lengths, no options), which must take it; the builds agree bit for bit. Bound as in test_kernels_gluon.py: 1e-2.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from app.kernels import decode_attention as da
from app.kernels import decode_fp8_gluon, fp8, paged
from app.kernels.attention_ref import decode_attention_ref
from app.kernels.decode_attention import DecodeOptions, decode_attention
from app.kernels.fp4 import FP4Format
from kernels_testing import DEFAULT_FP4, block_tables, interpreted, keys_like_llama, pages_to, worst_rel_err

needs_gluon = pytest.mark.skipif(not decode_fp8_gluon.AVAILABLE, reason="this Triton has no Gluon")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or paged.interpreting()
                            or torch.cuda.get_device_capability() < (8, 9),
                            reason="needs a CUDA GPU of sm_89+ and TRITON_INTERPRET=0")


def _fp8_pages(seq_lens, kv_heads, block_size, seed, device="cpu", v_scales=False):
    """(block table, K pages, V pages): Llama-like keys and normal values quantized to fp8, blocks shuffled;
    v_scales: each value vector times 2^u, u uniform in -60..60."""
    table, num_blocks = block_tables(seq_lens, block_size, seed)
    gen = torch.Generator().manual_seed(seed)
    k = keys_like_llama(num_blocks, block_size, kv_heads, 128, gen=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, 128, generator=gen)
    if v_scales:
        v = v * torch.exp2(torch.randint(-60, 61, (num_blocks, block_size, kv_heads, 1), generator=gen).float())
    return table.to(device), pages_to(fp8.fp8_quantize(k), device), pages_to(fp8.fp8_quantize(v), device)


def test_unsupported_names_the_reason():
    def why(head_dim=128, heads=8, kv_heads=2, block_size=16, offset=0):
        q = torch.zeros(1, heads, head_dim, dtype=torch.bfloat16)
        k = fp8.fp8_quantize(torch.zeros(1, block_size, kv_heads, head_dim))
        v = fp8.fp8_quantize(torch.zeros(1, block_size, kv_heads, head_dim))
        if offset:  # K's E4M3 array starting `offset` bytes into its storage
            moved = torch.zeros(k[0].numel() + offset, dtype=torch.uint8)[offset:].view(k[0].shape)
            k = (moved.view(torch.float8_e4m3fn), k[1])
        return decode_fp8_gluon.unsupported(q, k, v, block_size)

    assert why(head_dim=64) == "head_dim 64 (needs 128)"
    assert why(heads=32, kv_heads=2) == "more than 8 query heads per KV head"
    assert why(block_size=8) == "block_size 8 not a multiple of 16"
    assert why(offset=4) == "E4M3 arrays not 16-byte aligned (read by 16-byte loads)"
    cpu = "Gluon kernels run on CUDA, not on CPU or under TRITON_INTERPRET"
    assert why() == (cpu if decode_fp8_gluon.AVAILABLE else "this Triton has no Gluon")
    # fp8 keys with fp4 values: the default value format (groups of 32, no slots) only
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    k = fp8.fp8_quantize(torch.zeros(1, 16, 2, 128))
    for v_fmt, reason in ((DEFAULT_FP4[1], cpu), (FP4Format(group_size=16), "fp4 values other than groups of 32"),
                          (FP4Format(group_size=32, outliers=1), "fp4 values other than groups of 32")):
        v = paged.quantize_pages(torch.zeros(1, 16, 2, 128), "fp4", v_fmt)
        got = decode_fp8_gluon.unsupported(q, k, v, 16, v_fmt)
        assert got is not None and got.startswith(reason if decode_fp8_gluon.AVAILABLE or reason != cpu
                                                  else "this Triton"), (v_fmt, got)


def test_the_build_follows_the_launch_size():
    """Loads two tiles ahead where every program of the launch fits on the SMs at once at the 2-ahead build's
    occupancy, one tile ahead beyond; DecodeOptions.prefetch names a build (0, 1 or 2) or refuses."""
    per_sm = decode_fp8_gluon.PREFETCH_2_PROGRAMS_PER_SM
    assert decode_fp8_gluon.prefetch_for(1, 132) == 2
    assert decode_fp8_gluon.prefetch_for(per_sm * 132, 132) == 2
    assert decode_fp8_gluon.prefetch_for(per_sm * 132 + 1, 132) == decode_fp8_gluon.PREFETCH == 1
    for bad in (3, -1):
        with pytest.raises(ValueError, match="prefetch must be None, 0, 1 or 2"):
            DecodeOptions(prefetch=bad)


@interpreted
def test_the_launcher_runs_the_build_the_launch_size_asks_for(monkeypatch):
    """decode_attention's fp8 Gluon path plans the splits with the 1-ahead build's programs per SM, then runs
    2 tiles ahead where the launch's programs fit 2 per SM, 1 beyond, unless DecodeOptions names one. The
    kernel is not launched (recorded instead: it needs CUDA); the CPU counts 4 SMs (decode_attention._num_sms);
    the split merge runs interpreted."""
    ran = []
    monkeypatch.setattr(decode_fp8_gluon, "programs_per_sm", lambda *a, **k: 3)
    monkeypatch.setattr(decode_fp8_gluon, "launch", lambda *a: ran.append(a[-1]["PREFETCH"]))
    for seqs, prefetch, want in ((1, None, 2), (4, None, 2), (5, None, 1), (1, 0, 0), (8, 2, 2)):
        table, kp, vp = _fp8_pages([40] * seqs, 2, 16, seed=0)
        query = torch.zeros(seqs, 8, 128, dtype=torch.bfloat16)
        lens = torch.full((seqs,), 40, dtype=torch.int32)
        da._decode_fp8_gluon(query, kp, vp, table, lens, 0.1, 40, 1, None, None, prefetch)
        assert ran[-1] == want, (seqs, prefetch, ran)  # 1 split: 2 x seqs programs against 2 x 4 SMs


@interpreted
def test_where_it_cannot_run_the_triton_fp8_kernel_does():
    """On the CPU (interpreted) the rule runs the Triton fp8 kernel: the default equals kernel="fp8" bit for
    bit, and kernel="gluon" is a ValueError naming why the Gluon kernel cannot run."""
    seq_lens = [1, 40]
    table, kp, vp = _fp8_pages(seq_lens, 2, 16, seed=1)
    query = torch.randn(len(seq_lens), 8, 128).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    default = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens))
    triton_fp8 = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens),
                                  options=DecodeOptions(kernel="fp8"))
    assert torch.equal(default, triton_fp8)
    with pytest.raises(ValueError, match="the Gluon fp8 kernel cannot run this decode: Gluon kernels run on CUDA"):
        decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens), options=DecodeOptions(kernel="gluon"))


@needs_gluon
def test_every_build_compiles_for_sm_90():
    """Each build compiles for sm_90 with the installed Triton at both shapes (8B, 70B at TP 8), through
    experiments/kernel_sass.py in a process of its own (Gluon does not compile under the interpreter this
    suite runs): the operand layouts' conversions (assert_trivial) hold and the builds the timings compare
    exist (0, 1 or 2 tiles ahead, 1 ahead capped at 128 registers, fp4 values 1 or 2 ahead). Registers are not
    pinned: they differ by Triton, but the 2-ahead builds must fit PREFETCH_2_PROGRAMS_PER_SM programs per SM."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(root, "experiments", "kernel_sass.py"), "--only", "Gluon fp8",
                          "--json"], capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"),
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    builds = ("Gluon fp8 kernel, 1 tile ahead", "Gluon fp8 kernel, 2 tiles ahead", "Gluon fp8 kernel, no loads ahead",
              "Gluon fp8 kernel, 1 tile ahead at 128 registers", "Gluon fp8 kernel, fp4 values, 1 tile ahead",
              "Gluon fp8 kernel, fp4 values, 2 tiles ahead")
    assert sorted((r["model"], r["kernel"]) for r in rows) == sorted((m, k) for m in ("8B", "70B-TP8") for k in builds)
    assert all(r["regs"] > 0 and r["ops"]["HMMA"] > 0 for r in rows)
    two = [r["regs"] for r in rows if "2 tiles" in r["kernel"]]
    assert all(65536 // (-(-n // 8) * 8 * 32 * decode_fp8_gluon.W) >= decode_fp8_gluon.PREFETCH_2_PROGRAMS_PER_SM
               for n in two), two
    assert all(r["regs"] <= 128 for r in rows if "128" in r["kernel"])


# partial tiles, one to three whole tiles with and without a partial one (the 2-ahead build's edge cases at one
# split), long sequences over many splits
SEQ_LENS = [1, 15, 16, 17, 63, 64, 65, 128, 150, 192, 255, 1025, 1027, 4099]


@on_gpu
@needs_gluon
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 1), (2, 2), (2, 3)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("prefetch,maxnreg", [(1, None), (2, None), (0, None), (1, 128)])
def test_matches_reference_on_gpu(kv_heads, group, num_splits, prefetch, maxnreg):
    table, kp, vp = _fp8_pages(SEQ_LENS, kv_heads, 16, seed=kv_heads + group, device="cuda")
    query = torch.randn(len(SEQ_LENS), kv_heads * group, 128, device="cuda").bfloat16()
    assert decode_fp8_gluon.unsupported(query, kp, vp, 16) is None
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=num_splits, prefetch=prefetch, maxnreg=maxnreg))
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, (None, None))
    assert worst_rel_err(out, ref) < 1e-2
    triton_out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS),
                                  options=DecodeOptions(kernel="fp8", num_splits=num_splits))
    assert worst_rel_err(out, triton_out) < 1e-2


def _fp8_fp4_pages(seq_lens, kv_heads, block_size, seed, v_mult=1.0):
    """(block table, K pages, V pages, formats) on the GPU: fp8 keys like Llama's, normal values (x v_mult) in the
    default fp4 value format (groups of 32, no slots), blocks shuffled."""
    table, num_blocks = block_tables(seq_lens, block_size, seed)
    gen = torch.Generator().manual_seed(seed)
    k = keys_like_llama(num_blocks, block_size, kv_heads, 128, gen=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, 128, generator=gen) * v_mult
    v_fmt = DEFAULT_FP4[1]
    return (table.cuda(), pages_to(fp8.fp8_quantize(k), "cuda"), pages_to(paged.quantize_pages(v, "fp4", v_fmt), "cuda"),
            (None, v_fmt))


@on_gpu
@needs_gluon
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 3)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("prefetch", [1, 2, 0])
@pytest.mark.parametrize("v_mult", [1.0, 3e4])
def test_fp4_values_match_reference_on_gpu(kv_heads, group, num_splits, prefetch, v_mult):
    """fp8 keys with fp4 values (kv_cache_dtype fp8-fp4) through the kernel's V_FP4 build (decode_fp4_gluon's value
    operand and fp16 map) against float32 attention over the same pages and the generic kernel (the rule's outside
    the kernel's scope or while FP8_FP4_GLUON is off); values near 1 and far from it."""
    table, kp, vp, formats = _fp8_fp4_pages(SEQ_LENS, kv_heads, 16, seed=kv_heads + group, v_mult=v_mult)
    query = torch.randn(len(SEQ_LENS), kv_heads * group, 128, device="cuda").bfloat16()
    assert decode_fp8_gluon.unsupported(query, kp, vp, 16, formats[1]) is None
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats, out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=num_splits, prefetch=prefetch))
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, formats)
    assert worst_rel_err(out, ref) < 1e-2
    generic = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                               options=DecodeOptions(kernel="generic", num_splits=num_splits))
    assert worst_rel_err(out, generic) < 1e-2


@on_gpu
@needs_gluon
def test_the_rule_takes_the_fp4_value_build_with_engine_inputs_on_gpu():
    """fp8-fp4 pages with the engine's inputs (int64 tables and lengths, no options) run the Gluon kernel: the rule's
    output is the forced kernel's, bit for bit."""
    if not da.FP8_FP4_GLUON:
        pytest.skip("FP8_FP4_GLUON is off: the rule runs the generic kernel on these pages")
    table, kp, vp, formats = _fp8_fp4_pages(SEQ_LENS, 2, 16, seed=4)
    query = torch.randn(len(SEQ_LENS), 8, 128, device="cuda").bfloat16()
    lens = torch.tensor(SEQ_LENS, dtype=torch.int64, device="cuda")
    rule = decode_attention(query, kp, vp, table.long(), lens, 128 ** -0.5, max(SEQ_LENS), formats)
    gluon = decode_attention(query, kp, vp, table.long(), lens, 128 ** -0.5, max(SEQ_LENS), formats,
                             options=DecodeOptions(kernel="gluon"))
    assert torch.equal(rule, gluon)


@on_gpu
@needs_gluon
@pytest.mark.parametrize("num_splits", [1, 4])
def test_extreme_magnitudes_on_gpu(num_splits):
    """Queries of 3e5 (past fp16's range) and 3e-6 (below its normal range), values whose scales span
    2^-60 .. 2^60: the query goes in times a power of two, the probabilities times the values' scales, at most 1."""
    seq_lens = [33, 200, 1, 1027]
    table, kp, vp = _fp8_pages(seq_lens, 2, 16, seed=5, device="cuda", v_scales=True)
    query = torch.randn(len(seq_lens), 8, 128, device="cuda")
    query[0] *= 3e5
    query[2] *= 3e-6
    query = query.bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens),
                           options=DecodeOptions(kernel="gluon", num_splits=num_splits))
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, (None, None))
    for i in range(len(seq_lens)):  # each sequence's outputs have their own magnitude
        assert worst_rel_err(out[i:i + 1], ref[i:i + 1].to(out.device)) < 1e-2, i


@on_gpu
@needs_gluon
def test_the_builds_agree_bit_for_bit_on_gpu():
    """At a fixed split count the builds (0, 1, 2 tiles of loads ahead) attend the same tiles in the same order
    with the same arithmetic: equal outputs, bit for bit, for each split count."""
    table, kp, vp = _fp8_pages(SEQ_LENS, 8, 16, seed=9, device="cuda")
    query = torch.randn(len(SEQ_LENS), 32, 128, device="cuda").bfloat16()
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
    for num_splits in (1, 3):
        outs = [decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS),
                                 options=DecodeOptions(kernel="gluon", num_splits=num_splits, prefetch=p))
                for p in (0, 1, 2)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]), num_splits


@on_gpu
@needs_gluon
def test_default_route_is_gluon_with_engine_inputs_on_gpu():
    """What the engine passes: int32 block tables and sequence lengths (also int64), no options, pages of 32
    tokens; also an fp16 query. The default is the Gluon kernel: bit-equal to kernel="gluon", not to the Triton
    fp8 kernel."""
    table32, kp, vp = _fp8_pages(SEQ_LENS, 8, 32, seed=3, device="cuda")
    for dtype, index in ((torch.bfloat16, torch.int32), (torch.float16, torch.int64)):
        table = table32.to(index)
        lens = torch.tensor(SEQ_LENS, dtype=index, device="cuda")
        query = torch.randn(len(SEQ_LENS), 32, 128, device="cuda").to(dtype)
        default = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS))
        forced = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS),
                                  options=DecodeOptions(kernel="gluon"))
        triton_out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS),
                                      options=DecodeOptions(kernel="fp8"))
        assert torch.equal(default, forced)
        assert not torch.equal(default, triton_out)
        ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, (None, None))
        assert worst_rel_err(default, ref) < 1e-2


@on_gpu
@needs_gluon
def test_64_bit_offsets_on_gpu(monkeypatch):
    """The int64 offset path that E4M3 arrays of 2 GiB or more take, forced on small pages."""
    real = decode_fp8_gluon.constexprs
    monkeypatch.setattr(decode_fp8_gluon, "constexprs", lambda *a, **k: dict(real(*a, **k), OFF64=True))
    table, kp, vp = _fp8_pages(SEQ_LENS, 8, 16, seed=6, device="cuda")
    query = torch.randn(len(SEQ_LENS), 32, 128, device="cuda").bfloat16()
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, (None, None))
    for num_splits, prefetch in ((None, None), (1, 0), (7, 2), (1, 1)):
        out = torch.full_like(query, float("nan"))
        decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), out=out,
                         options=DecodeOptions(kernel="gluon", num_splits=num_splits, prefetch=prefetch))
        assert worst_rel_err(out, ref) < 1e-2


@on_gpu
@needs_gluon
def test_falls_back_outside_its_scope_on_gpu():
    """head_dim 64: the rule runs the Triton fp8 kernel (equal to kernel="fp8"), kernel="gluon" says why not."""
    seq_lens = [100]
    table, num_blocks = block_tables(seq_lens, 16)
    gen = torch.Generator().manual_seed(0)
    kp = pages_to(fp8.fp8_quantize(torch.randn(num_blocks, 16, 2, 64, generator=gen)), "cuda")
    vp = pages_to(fp8.fp8_quantize(torch.randn(num_blocks, 16, 2, 64, generator=gen)), "cuda")
    query = torch.randn(1, 8, 64, device="cuda").bfloat16()
    lens = torch.tensor(seq_lens, device="cuda")
    with pytest.raises(ValueError, match="head_dim 64"):
        decode_attention(query, kp, vp, table.cuda(), lens, 0.1, 100, options=DecodeOptions(kernel="gluon"))
    out = decode_attention(query, kp, vp, table.cuda(), lens, 0.1, 100)
    assert torch.equal(out, decode_attention(query, kp, vp, table.cuda(), lens, 0.1, 100,
                                             options=DecodeOptions(kernel="fp8")))
