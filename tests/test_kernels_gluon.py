"""The Gluon fp4 decode kernel (app/kernels/decode_fp4_gluon.py).

Gluon kernels do not run under Triton's interpreter, so the default suite checks what needs no GPU:
the launcher's choices (tile pairs, the code-to-number map, the ring's stages, key groups of 8, the
query's loads, given the compiler's register and spill reports) and `unsupported`, which says when a
decode falls back to the Triton kernels. (How the kernel compiles for sm_90, its registers and loop
instructions, is experiments/kernel_sass.py's to count, not a test's.)

On a CUDA GPU (`TRITON_INTERPRET=0 python -m pytest tests/test_kernels_gluon.py`) it is checked against
float32 attention over the dequantized pages and against the Triton fp4 kernel, per sequence and
query head: odd lengths, GQA 1, 2, 3, 4 and 8, one split and many, with and without key outlier
slots, with the cp.async ring and with loads into registers, with both code-to-number maps (values
also far from 2^0); the engine's inputs (int64 tables and lengths, no options) take the Gluon kernel; outside
its scope decode_attention falls back. Bound as in test_kernels_decode.py: about one bf16
rounding, 1e-2.
"""

import pytest
import torch
import triton

from app.kernels import decode_fp4_gluon, paged
from app.kernels.attention_ref import decode_attention_ref
from app.kernels.decode_attention import DecodeOptions, decode_attention
from app.kernels.fp4 import FP4Format
from kernels_testing import DEFAULT_FP4, cuda_fp4_pages, worst_rel_err

needs_gluon = pytest.mark.skipif(not decode_fp4_gluon.AVAILABLE, reason="this Triton has no Gluon")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or paged.interpreting(),
                            reason="needs a CUDA GPU and TRITON_INTERPRET=0")


def _zero_pages(kv_heads=2, blocks=1, block_size=16, head_dim=128, formats=DEFAULT_FP4):
    """K and V fp4 pages of zeros on the CPU."""
    return tuple(paged.quantize_pages(torch.zeros(blocks, block_size, kv_heads, head_dim), "fp4", f) for f in formats)


def _moved(pages, field, offset):
    """The pages with array `field` (codes, scales, scale_exp, out_vals, out_idx) starting `offset` bytes into
    its storage."""
    t = pages[field].view(torch.uint8)
    moved = torch.zeros(t.numel() + offset, dtype=torch.uint8)[offset:].view(t.shape).view(pages[field].dtype)
    return type(pages)(*pages[:field], moved, *pages[field + 1:])


def _in_scope_case(kv_heads, group, formats, seed):
    """Pages of SEQ_LENS in `formats`, a query and the lengths, on the GPU: a case this kernel takes."""
    table, kp, vp = cuda_fp4_pages(SEQ_LENS, kv_heads, 16, formats, seed=seed)
    query = torch.randn(len(SEQ_LENS), kv_heads * group, 128, device="cuda").bfloat16()
    assert decode_fp4_gluon.unsupported(query, kp, vp, formats, 16) is None
    return table, kp, vp, query, torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")


def _matches_references(out, query, kp, vp, table, lens, formats):
    """out (a Gluon decode over SEQ_LENS) within 1e-2 of float32 attention over the same pages and of the Triton
    fp4 kernel's result; returns the float32 reference."""
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, formats)
    assert worst_rel_err(out, ref) < 1e-2
    triton_out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                                  options=DecodeOptions(kernel="fp4"))
    assert worst_rel_err(out, triton_out) < 1e-2
    return ref


def _cpu_launch(group=4, kv_heads=2, seqs=2, pages=None, **kw):
    """The launcher's decisions (Launch.constexprs etc.) for `seqs` sequences on CPU tensors: nothing is
    compiled or launched."""
    q = torch.zeros(seqs, group * kv_heads, 128, dtype=torch.bfloat16)
    k, v = pages or _zero_pages(kv_heads)
    table, lens = torch.zeros(seqs, 1, dtype=torch.int32), torch.ones(seqs, dtype=torch.int32)
    return decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, 4, **kw)


def test_unsupported_names_the_reason(monkeypatch):
    def why(head_dim=128, heads=8, kv_heads=2, formats=DEFAULT_FP4, block_size=16, offset=0, field=0, stages=None):
        q = torch.zeros(1, heads, head_dim, dtype=torch.bfloat16)
        k, v = _zero_pages(kv_heads, 1, block_size, head_dim, formats)
        if offset:  # one of K's arrays (codes, scales, exponents, ...) starting `offset` bytes into its storage
            k = _moved(k, field, offset)
        return decode_fp4_gluon.unsupported(q, k, v, formats, block_size, stages)

    assert why(head_dim=64) == "head_dim 64 (needs 128)"
    kg16 = (FP4Format(group_size=16, outliers=4), FP4Format(group_size=32))
    monkeypatch.setattr(decode_fp4_gluon, "KEY_GROUPS_OF_16", False)
    assert why(formats=kg16) == "key groups of 16 (the KG16 build is off: KEY_GROUPS_OF_16)"
    monkeypatch.setattr(decode_fp4_gluon, "KEY_GROUPS_OF_16", True)
    assert why(formats=kg16, stages=0) == "key groups of 16 run on the cp.async ring only (num_stages > 0)"
    assert why(formats=(FP4Format(group_size=4), FP4Format(group_size=32))) == (
        "groups other than 32 (or 8 or 16 for keys)")
    assert why(formats=(FP4Format(group_size=32, outliers=4), FP4Format(group_size=8))) == (
        "groups other than 32 (or 8 or 16 for keys)")
    assert why(formats=(FP4Format(group_size=8, outliers=4), FP4Format(group_size=32))) == (
        "key groups of 8 with key outlier slots")
    assert why(formats=(FP4Format(group_size=8, outliers=2), FP4Format(group_size=32))) == (
        "key groups of 8 with key outlier slots")
    assert why(formats=(FP4Format(group_size=8), FP4Format(group_size=32)), stages=0) == (
        "key groups of 8 run on the cp.async ring only (num_stages > 0)")
    assert why(formats=(FP4Format(group_size=32, outliers=4), FP4Format(group_size=32, outliers=1))) == (
        "value outlier slots")
    assert why(formats=(FP4Format(group_size=32, outliers=2), FP4Format(group_size=32))) == (
        "key outlier slots other than 0 or 4")
    assert why(heads=32) == "more than 8 query heads per KV head"
    assert why(block_size=8) == "block_size 8 not a multiple of 16"
    for field in range(5):  # codes, scales, scale_exp, out_vals, out_idx
        assert why(offset=2, field=field).startswith("page arrays not 4-byte aligned"), field
    # in scope (the default format, key groups of 8 without slots, of 16 with or without): on this CPU (or a
    # Triton without Gluon) it still says no
    for formats in (DEFAULT_FP4, (FP4Format(group_size=8), FP4Format(group_size=32)), kg16,
                    (FP4Format(group_size=16), FP4Format(group_size=32))):
        assert why(formats=formats) in ("Gluon kernels run on CUDA, not on CPU or under TRITON_INTERPRET",
                                        "this Triton has no Gluon"), formats


@needs_gluon
def test_key_groups_of_8_run_on_the_ring_without_key_slots():
    """Key groups of 8 (16 scale bytes per key vector) build KG8, on the cp.async ring and without key
    outlier slots only: anything else is refused before anything is compiled; the default format's
    pages do not build it."""
    kg8 = (FP4Format(group_size=8), FP4Format(group_size=32))
    k, v = _zero_pages(kv_heads=1, blocks=2, formats=kg8)
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    assert decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, 0).constexprs["KG8"]
    with pytest.raises(ValueError, match="key groups of 8 run on the cp.async ring only"):
        decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, 0, stages=0)
    with pytest.raises(ValueError, match="key groups of 8 run without key outlier slots"):
        decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, 4)
    assert not _cpu_launch(group=8, kv_heads=1).constexprs["KG8"]


@needs_gluon
def test_key_groups_of_16_build_kg16_on_the_ring():
    """Key groups of 16 (8 scale bytes per key vector) build KG16, with or without key outlier slots, on the
    cp.async ring only; the default format's pages and key groups of 8 do not."""
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for slots in (4, 0):
        k, v = _zero_pages(kv_heads=1, blocks=2, formats=(FP4Format(group_size=16, outliers=slots),
                                                          FP4Format(group_size=32)))
        c = decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, slots).constexprs
        assert (c["KG16"], c["KG8"], c["K_KO"]) == (True, False, slots)
        with pytest.raises(ValueError, match="key groups of 16 run on the cp.async ring only"):
            decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, slots, stages=0)
    assert not _cpu_launch(group=8, kv_heads=1).constexprs["KG16"]
    k, v = _zero_pages(kv_heads=1, blocks=2, formats=(FP4Format(group_size=8), FP4Format(group_size=32)))
    assert not decode_fp4_gluon.Launch(q, k, v, table, lens, 1.0, 0).constexprs["KG16"]


@needs_gluon
def test_num_stages_other_than_0_or_a_power_of_two_is_refused():
    """num_stages=1 would compile to a ring with no copy ahead (the kernel then reads before its
    copies land), 2 to two one-tile allocations (the ring's even and odd tiles), which Triton 3.6
    fails to compile: refused before anything is launched, as are 3 (not a power of two) and -1."""
    pages = _zero_pages(kv_heads=1, blocks=2)
    for stages in (1, 2, 3, -1):
        with pytest.raises(ValueError, match="must be 0 .* or a power of two >= 4"):
            _cpu_launch(group=8, kv_heads=1, pages=pages, stages=stages)
    for stages, expect in ((None, decode_fp4_gluon.STAGES), (0, 0), (4, 4), (8, 8)):
        assert _cpu_launch(group=8, kv_heads=1, pages=pages, stages=stages).constexprs["STAGES"] == expect


@needs_gluon
def test_the_code_to_number_map_does_not_depend_on_the_batch():
    """fp16 maps by default for every batch size (a sequence's rounding must not depend on its
    batch: CUDA-graph buckets pad it); fp16= forces either."""
    def f16(seqs, kv_heads, **kw):
        return _cpu_launch(4, kv_heads, seqs, **kw).constexprs["F16"]

    assert {f16(1, 8), f16(7, 8), f16(8, 8), f16(32, 1), f16(64, 1)} == {decode_fp4_gluon.F16_DEFAULT} == {True}
    assert f16(8, 8, fp16=False) is False and f16(1, 1, fp16=True) is True and f16(128, 8, fp16=False) is False


@needs_gluon
def test_tile_pairs_where_the_query_heads_leave_padding_columns():
    """Tile pairs (PAIR: the fewest whole tiles in a split that takes them) at up to 4 query heads per
    KV head with the 4-tile ring, under PAIR_MAXNREG registers unless a cap is given; never at 5-8 heads
    (no padding columns), with loads into registers or an 8-tile ring; pair= overrides, 0 never."""
    def launch(group, **kw):
        return _cpu_launch(group, **kw).constexprs

    for group in (1, 2, 3, 4):
        c = launch(group)
        assert c["PAIR"] == decode_fp4_gluon.PAIR_MIN_TILES > 0 and c["maxnreg"] == decode_fp4_gluon.PAIR_MAXNREG
    for group in (5, 8):
        assert launch(group)["PAIR"] == 0 and "maxnreg" not in launch(group)
    assert launch(4, stages=0)["PAIR"] == 0 and launch(4, stages=8)["PAIR"] == 0
    assert launch(4, pair=0)["PAIR"] == 0 and "maxnreg" not in launch(4, pair=0)
    assert launch(4, pair=1)["PAIR"] == 1 and launch(4, pair=3, maxnreg=96)["maxnreg"] == 96


@needs_gluon
def test_pages_not_aligned_for_the_joined_pair_copies_take_single_tiles(monkeypatch):
    """The pairs' joined copies (Triton < 3.9) restate the page arrays' alignment to the compiler: K codes
    from 16-byte, V codes and key outlier values from 8-byte boundaries. Pages aligned only to the 4 bytes
    `unsupported` asks for run single tiles; with per-tile copies (Triton 3.9) they pair."""
    def launch(field=None, offset=0, values=False):
        k, v = _zero_pages()
        if offset:  # one array starting `offset` bytes into its storage
            k, v = (k, _moved(v, field, offset)) if values else (_moved(k, field, offset), v)
        return _cpu_launch(pages=(k, v)).constexprs["PAIR"]

    pair = decode_fp4_gluon.PAIR_MIN_TILES
    monkeypatch.setattr(decode_fp4_gluon, "ONE_COPY_PER_PAIR", True)
    assert launch() == pair
    assert launch(0, 8) == 0 and launch(0, 4) == 0  # K codes 8 or 4 bytes in
    assert launch(0, 4, values=True) == 0 and launch(0, 8, values=True) == pair  # V codes
    assert launch(3, 4) == 0 and launch(3, 8) == pair  # key outlier values
    assert launch(1, 4) == pair  # scales: one word per token, copied 4 bytes at a time either way
    # key groups of 8: a token's 16 scale bytes are one 16-byte copy, so the scales must start 16-byte aligned
    kg8 = _zero_pages(formats=(FP4Format(group_size=8), FP4Format(group_size=32)))
    q, table, lens = torch.zeros(2, 8, 128, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for offset, expect in ((0, pair), (4, 0), (8, 0)):
        k = _moved(kg8[0], 1, offset) if offset else kg8[0]
        assert decode_fp4_gluon.Launch(q, k, kg8[1], table, lens, 1.0, 0).constexprs["PAIR"] == expect, offset
    monkeypatch.setattr(decode_fp4_gluon, "ONE_COPY_PER_PAIR", False)
    assert launch(0, 4) == pair


@needs_gluon
def test_a_launch_whose_splits_cannot_pair_runs_the_single_tile_build():
    """Where the plan's longest split is shorter than PAIR whole tiles no program can pair: that launch
    takes the single-tile build (PAIR 0 under the paired build's register cap, the one the split plan was
    made for: PAIR_MAXNREG or the caller's), longer splits the paired one."""
    for cap in (None, 96):
        launch = _cpu_launch(maxnreg=cap)
        pair, tile = decode_fp4_gluon.PAIR_MIN_TILES, decode_fp4_gluon.W * decode_fp4_gluon.TW
        for split in (pair * tile, 4 * pair * tile):
            assert launch.constexprs_for(split) == launch.constexprs and launch.constexprs["PAIR"] == pair
        for split in (tile, (pair - 1) * tile):
            assert launch.constexprs_for(split) == dict(launch.constexprs, PAIR=0)
            assert launch.constexprs["maxnreg"] == (cap or decode_fp4_gluon.PAIR_MAXNREG)
    off = _cpu_launch(pair=0)
    assert off.constexprs_for(tile) == off.constexprs_for(64 * tile) == off.constexprs


@needs_gluon
def test_the_query_takes_two_byte_loads_where_its_vector_loads_do_not_fit(monkeypatch):
    """Launch runs the first build the compiler fits: tile pairs with the query's vector loads, pairs with
    its two-byte loads, single tiles with vector loads, single tiles with two-byte loads. Pairs fit where
    nothing spills, vector loads where query_vector_fits; bf16 maps always take two-byte loads. The
    compiler's report (registers, shared memory, spilled bytes) is given per build here."""
    def settle(report, **kw):
        monkeypatch.setattr(decode_fp4_gluon.Launch, "_compiled", lambda self: report(self.constexprs))
        launch = _cpu_launch(**kw)
        launch.resources()
        c = launch.constexprs
        return c["PAIR"] > 0, c["QVEC"], c.get("maxnreg")

    cap = decode_fp4_gluon.PAIR_MAXNREG
    assert settle(lambda c: (128, 0, 0)) == (True, True, cap)
    assert settle(lambda c: (128, 0, 8 if c["QVEC"] else 0)) == (True, False, cap)
    assert settle(lambda c: (128, 0, 8 if c["PAIR"] else 0)) == (False, True, None)
    assert settle(lambda c: (128, 0, 8) if c["PAIR"] else (148 if c["QVEC"] else 128, 0, 0)) == (False, False, None)
    assert settle(lambda c: (128, 0, 8) if c["PAIR"] else (148 if c["QVEC"] else 128, 0, 0), maxnreg=96) \
        == (False, False, 96)  # single tiles keep the caller's cap
    assert settle(lambda c: (128, 0, 0), fp16=False) == (True, False, cap)
    assert settle(lambda c: (148 if c["QVEC"] else 128, 0, 0), group=8, kv_heads=1) == (False, False, None)
    assert settle(lambda c: (126, 0, 0), group=8, kv_heads=1) == (False, True, None)
    assert not decode_fp4_gluon.query_vector_fits(129, 0) and not decode_fp4_gluon.query_vector_fits(128, 8)


SEQ_LENS = [1, 15, 16, 17, 63, 64, 65, 1025, 1027, 4099]


@on_gpu
@needs_gluon
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 1), (2, 2), (2, 3)])
@pytest.mark.parametrize("key_outliers", [4, 0])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("stages", [decode_fp4_gluon.STAGES, 0])
def test_matches_reference_on_gpu(kv_heads, group, key_outliers, num_splits, stages):
    formats = (FP4Format(group_size=32, outliers=key_outliers), FP4Format(group_size=32))
    table, kp, vp, query, lens = _in_scope_case(kv_heads, group, formats, kv_heads + group)
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats, out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=num_splits, num_stages=stages))
    _matches_references(out, query, kp, vp, table, lens, formats)


@on_gpu
@needs_gluon
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 1), (2, 3)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_key_groups_of_8_match_reference_on_gpu(kv_heads, group, num_splits):
    """The KG8 build (key groups of 8, no key slots) against float32 attention over the same pages and the
    Triton fp4 kernel: partial tiles, GQA groupings, one split (long: tile pairs where the group leaves
    padding columns) and seven (short: single tiles)."""
    formats = (FP4Format(group_size=8), FP4Format(group_size=32))
    table, kp, vp, query, lens = _in_scope_case(kv_heads, group, formats, kv_heads + group + 100)
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats, out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=num_splits))
    ref = _matches_references(out, query, kp, vp, table, lens, formats)
    if num_splits is None and group == 4:  # loads into registers: the Triton kernel runs them, or Gluon says why
        stage0 = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                                  options=DecodeOptions(num_stages=0))
        assert worst_rel_err(stage0, ref) < 1e-2
        with pytest.raises(ValueError, match="cannot run this decode: key groups of 8 run on the cp.async ring"):
            decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                             options=DecodeOptions(kernel="gluon", num_stages=0))


@on_gpu
@needs_gluon
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 1), (2, 3)])
@pytest.mark.parametrize("key_outliers", [4, 0])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_key_groups_of_16_match_reference_on_gpu(monkeypatch, kv_heads, group, key_outliers, num_splits):
    """The KG16 build (key groups of 16, with and without key slots), switched on, against float32 attention
    over the same pages and the Triton fp4 kernel: partial tiles, GQA groupings, one split (long: tile pairs
    where the group leaves padding columns) and seven (short: single tiles); the rule takes it."""
    monkeypatch.setattr(decode_fp4_gluon, "KEY_GROUPS_OF_16", True)
    ran = []

    class Observed(decode_fp4_gluon.Launch):
        def run(self, *args):
            super().run(*args)
            ran.append((self.constexprs["KG16"], self.constexprs["K_KO"]))

    monkeypatch.setattr(decode_fp4_gluon, "Launch", Observed)
    formats = (FP4Format(group_size=16, outliers=key_outliers), FP4Format(group_size=32))
    table, kp, vp, query, lens = _in_scope_case(kv_heads, group, formats, kv_heads + group + 200)
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats, out=out,
                     options=DecodeOptions(num_splits=num_splits))
    assert ran == [(True, key_outliers)]
    _matches_references(out, query, kp, vp, table, lens, formats)


@on_gpu
@needs_gluon
@pytest.mark.parametrize("off64", [False, True])
@pytest.mark.parametrize("fp16", [True, False])
@pytest.mark.parametrize("stages", [decode_fp4_gluon.STAGES, 8])
def test_key_groups_of_8_other_builds_on_gpu(monkeypatch, stages, fp16, off64):
    """KG8 with what the reference cases above leave at their defaults: bf16 code maps (fp16=False), the
    8-tile ring, and the int64 offsets that page arrays of 2 GiB or more take (forced on small pages), each
    against float32 attention; on the 4-tile ring 8 KV heads x 4 in one split run tile pairs (Triton 3.6:
    no KG8 paired build spills there), seven splits and 1 x 8 single tiles, and the 8-tile ring never pairs.
    Every launch's build, as run() launches it, is checked to be the one asked for."""
    seen = []

    class Observed(decode_fp4_gluon.Launch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if off64:
                self.constexprs["OFF64"] = True

        def run(self, out, part_o, part_lse, split_size, num_splits):
            super().run(out, part_o, part_lse, split_size, num_splits)
            seen.append((self.query.shape[1] // self.pages[0].shape[2], num_splits,
                         self.constexprs_for(split_size)))

    monkeypatch.setattr(decode_fp4_gluon, "Launch", Observed)
    formats = (FP4Format(group_size=8), FP4Format(group_size=32))
    for kv_heads, group in ((8, 4), (1, 8)):
        table, kp, vp = cuda_fp4_pages(SEQ_LENS, kv_heads, 16, formats, seed=kv_heads + stages + 10 * fp16)
        query = torch.randn(len(SEQ_LENS), kv_heads * group, 128, device="cuda").bfloat16()
        lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
        ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, formats)
        for num_splits in (1, 7):
            out = torch.full_like(query, float("nan"))
            decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats, out=out,
                             options=DecodeOptions(kernel="gluon", num_splits=num_splits, num_stages=stages,
                                                   fp16=fp16))
            assert worst_rel_err(out, ref) < 1e-2, (kv_heads, group, num_splits)
    assert [(g, n) for g, n, _ in seen] == [(4, 1), (4, 7), (8, 1), (8, 7)], seen
    for group, num_splits, c in seen:
        assert (c["KG8"], c["K_KO"], c["STAGES"], c["F16"], c["OFF64"]) == (True, 0, stages, fp16, off64), c
        pairs = stages == decode_fp4_gluon.STAGES and group == 4 and num_splits == 1
        assert (c["PAIR"] > 0) == pairs, (group, num_splits, c["PAIR"])


@on_gpu
@needs_gluon
@pytest.mark.parametrize("stages", [decode_fp4_gluon.STAGES, 8])
@pytest.mark.parametrize("kv_heads,group", [(2, 3), (1, 8)])
def test_ring_whole_tile_counts_on_gpu(stages, kv_heads, group):
    """The ring's loop attends two whole tiles per iteration (an even and an odd one, from its two
    allocations) and one more when their count is odd, after the partial tile when there is one:
    lengths 64 n + {0, 1, 63} in one split give 0 to 6 whole tiles, with and without a partial one."""
    seq_lens = [64 * n + e for n in range(7) for e in (0, 1, 63) if 64 * n + e > 0]
    table, kp, vp = cuda_fp4_pages(seq_lens, kv_heads, 16, DEFAULT_FP4, seed=stages + group)
    query = torch.randn(len(seq_lens), kv_heads * group, 128, device="cuda").bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens), DEFAULT_FP4, out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=1, num_stages=stages))
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
    assert worst_rel_err(out, ref) < 1e-2


@on_gpu
@needs_gluon
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fp16", [True, False])
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (2, 1), (4, 2), (2, 3)])
def test_tile_pairs_on_gpu(num_splits, kv_heads, group, fp16):
    """Tile pairs from one whole tile on (pair=1): the masked first pass (the partial tile, the lone
    last whole tile of an odd count, or both), then pairs of whole tiles from the ring's two sets, each
    head's two column states merged at the end; lengths 64 n + {0, 1, 63} give 0 to 12 whole tiles; both
    code-to-number maps. Against the reference. Skipped where this Triton's paired kernel spills (the
    launcher then runs single tiles: test_tile_pairs_that_spill_fall_back_to_single_tiles_on_gpu)."""
    seq_lens = [64 * n + e for n in range(13) for e in (0, 1, 63) if 64 * n + e > 0]
    table, kp, vp = cuda_fp4_pages(seq_lens, kv_heads, 16, DEFAULT_FP4, seed=num_splits + group)
    query = torch.randn(len(seq_lens), kv_heads * group, 128, device="cuda").bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    launch = decode_fp4_gluon.Launch(query, kp, vp, table, lens, 1.0, 4, pair=1, fp16=fp16)
    launch.resources()
    if launch.constexprs["PAIR"] == 0:  # e.g. Triton 3.6 with pair=1 and bf16 maps (128 bytes; at PAIR 16 none)
        pytest.skip(f"this build of the paired kernel (pair=1, fp16={fp16}) spills with this Triton: the launcher "
                    "runs single tiles")
    assert launch.constexprs["PAIR"] == 1 and launch.constexprs["maxnreg"] == decode_fp4_gluon.PAIR_MAXNREG
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens), DEFAULT_FP4, out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=num_splits, pair=1, fp16=fp16))
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
    assert worst_rel_err(out, ref) < 1e-2


@on_gpu
@needs_gluon
def test_a_short_sequence_gives_the_same_result_in_either_build_on_gpu(monkeypatch):
    """Short sequences beside a long one run in the paired build (their splits take its single-tile
    branch); on their own the launch (a split plan shorter than PAIR_MIN_TILES tiles) takes the
    single-tile build. Their results are identical."""
    builds = []
    constexprs_for = decode_fp4_gluon.Launch.constexprs_for

    def spy(self, split_size):
        c = constexprs_for(self, split_size)
        builds.append(c["PAIR"])
        return c

    monkeypatch.setattr(decode_fp4_gluon.Launch, "constexprs_for", spy)
    pair = decode_fp4_gluon.PAIR_MIN_TILES
    long_len = 64 * pair * 2 + 5
    short = [1, 63, 64, 65, 300, 64 * (pair - 1)]  # the longest: a plan of PAIR - 1 tiles
    table, kp, vp = cuda_fp4_pages([long_len] + short, 8, 16, DEFAULT_FP4, seed=11)
    query = torch.randn(1 + len(short), 32, 128, device="cuda").bfloat16()
    lens = torch.tensor([long_len] + short, dtype=torch.int32, device="cuda")
    both = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, long_len, DEFAULT_FP4,
                            options=DecodeOptions(kernel="gluon", num_splits=1))
    alone = decode_attention(query[1:], kp, vp, table[1:], lens[1:], 128 ** -0.5, max(short), DEFAULT_FP4,
                             options=DecodeOptions(kernel="gluon", num_splits=1))
    if builds[0] == 0:
        pytest.skip("the paired kernel spills with this Triton: the launcher runs single tiles")
    assert builds == [pair, 0]  # the paired build, then the single-tile one
    assert torch.equal(both[1:], alone)
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
    assert worst_rel_err(both, ref) < 1e-2


@on_gpu
@needs_gluon
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 3), (2, 1)])
def test_the_querys_vector_loads_give_the_two_byte_loads_result_on_gpu(monkeypatch, kv_heads, group):
    """The query's MMA operand by 16-byte loads (QVEC, padding columns repeating a head of the group
    instead of zeros) gives bit for bit the output of its two-byte loads: one split and seven, tile
    pairs and single tiles (sequences below and above PAIR_MIN_TILES whole tiles), the default format
    with key slots and key groups of 8 without."""
    built = []

    class Forced(decode_fp4_gluon.Launch):
        def _settle_pair(self):
            super()._settle_pair()
            self.constexprs["QVEC"] = qvec
            built.append(dict(self.constexprs))

    monkeypatch.setattr(decode_fp4_gluon, "Launch", Forced)
    seq_lens = [1, 65, 1025, 4099, 20000]
    for key_outliers, formats in ((4, DEFAULT_FP4), (0, (FP4Format(group_size=8), FP4Format(group_size=32)))):
        table, kp, vp = cuda_fp4_pages(seq_lens, kv_heads, 16, formats, seed=kv_heads + group)
        query = torch.randn(len(seq_lens), kv_heads * group, 128, device="cuda").bfloat16()
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        for num_splits in (1, 7):
            outs = []
            for qvec in (True, False):
                out = torch.full_like(query, float("nan"))
                decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(seq_lens), formats, out=out,
                                 options=DecodeOptions(kernel="gluon", num_splits=num_splits))
                assert built[-1]["QVEC"] == qvec
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (key_outliers, num_splits)
            ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, formats)
            assert worst_rel_err(outs[0], ref) < 1e-2
    assert all(c["F16"] for c in built)
    if (kv_heads, group) == (8, 4) and triton.__version__.startswith("3.6."):
        # Triton 3.6 pairs these (no spill; 3.9's paired kernel spills, so single tiles): the sequences
        # below PAIR_MIN_TILES whole tiles take the paired build's single-tile branch
        assert all(c["PAIR"] for c in built)


@on_gpu
@needs_gluon
def test_tile_pairs_that_spill_fall_back_to_single_tiles_on_gpu(monkeypatch):
    """With too few registers for the paired kernel (a cap of 64: it spills) the launcher takes single
    tiles, without the pairs' cap, on the first thing it does that compiles (here the launch itself), and
    the result is still the reference's."""
    monkeypatch.setattr(decode_fp4_gluon, "PAIR_MAXNREG", 64)
    seq_lens = [4099, 1025, 3000]
    table, kp, vp = cuda_fp4_pages(seq_lens, 8, 16, DEFAULT_FP4, seed=5)
    query = torch.randn(len(seq_lens), 32, 128, device="cuda").bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    launch = decode_fp4_gluon.Launch(query, kp, vp, table, lens, 128 ** -0.5 * 1.4426950408889634, 4)
    assert launch.constexprs["PAIR"] == decode_fp4_gluon.PAIR_MIN_TILES and launch.constexprs["maxnreg"] == 64
    out = torch.full_like(query, float("nan"))
    part = torch.empty(1, dtype=torch.float32, device="cuda")
    launch.run(out, part, part, -(-max(seq_lens) // 64) * 64, 1)  # one split of whole tiles
    assert launch.constexprs["PAIR"] == 0 and "maxnreg" not in launch.constexprs
    assert launch._compiled()[2] == 0  # what ran did not spill
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
    assert worst_rel_err(out, ref) < 1e-2


@on_gpu
@needs_gluon
@pytest.mark.parametrize("stages", [decode_fp4_gluon.STAGES, 0])
def test_a_sequence_shorter_than_the_plan_spreads_over_its_splits_on_gpu(stages, monkeypatch):
    """Planned for 8192 tokens in 4 splits (as a decode graph plans for max_model_len), a 1025-token
    sequence runs 4 splits of 320 (5 tiles; not one of 2048 and three empty), 17 tokens one split,
    4099 tokens 4 of 1088; the result as the reference."""
    import app.kernels.decode_attention as da

    seen = []
    merge = da._merge_splits
    monkeypatch.setattr(da, "_merge_splits", lambda o, lse, out, n: (seen.append(lse.clone()), merge(o, lse, out, n)))
    seq_lens = [1025, 17, 4099]
    table, kp, vp = cuda_fp4_pages(seq_lens, 2, 16, DEFAULT_FP4, seed=11)
    query = torch.randn(len(seq_lens), 8, 128, device="cuda").bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(query, float("nan"))
    decode_attention(query, kp, vp, table, lens, 128 ** -0.5, 8192, DEFAULT_FP4, out=out,
                     options=DecodeOptions(kernel="gluon", num_splits=4, num_stages=stages))
    ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
    assert worst_rel_err(out, ref) < 1e-2
    (lse,) = seen  # [sequences, heads, splits]
    assert lse.isfinite().sum(-1).tolist() == [[4] * 8, [1] * 8, [4] * 8]


@on_gpu
@needs_gluon
@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (1, 8), (2, 3)])
@pytest.mark.parametrize("stages", [decode_fp4_gluon.STAGES, 0])
def test_code_maps_match_reference_on_gpu(fp16, kv_heads, group, stages):
    """Both code-to-number maps (bf16 bit arithmetic; fp16 through E4M3), forced by fp16= whatever the
    shape's default, against the reference and the Triton kernel as above, with key outlier slots, one split and
    many; values also x 1e4 and x 1e-4 (with fp16 the probabilities carry the values' second-level
    exponents, which these move far from 2^0)."""
    for v_mult in (1.0, 1e4, 1e-4):
        table, kp, vp = cuda_fp4_pages(SEQ_LENS, kv_heads, 16, DEFAULT_FP4, seed=kv_heads + group, v_mult=v_mult)
        query = torch.randn(len(SEQ_LENS), kv_heads * group, 128, device="cuda").bfloat16()
        lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
        ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
        triton_out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), DEFAULT_FP4,
                                      options=DecodeOptions(kernel="fp4"))
        for num_splits in (None, 7):
            out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), DEFAULT_FP4,
                                   options=DecodeOptions(kernel="gluon", num_splits=num_splits, num_stages=stages,
                                                         fp16=fp16))
            assert worst_rel_err(out, ref) < 1e-2, (v_mult, num_splits)
            assert worst_rel_err(out, triton_out) < 1e-2, (v_mult, num_splits)


@on_gpu
@needs_gluon
def test_default_route_is_gluon_with_engine_inputs_on_gpu():
    """What the engine passes: int64 block tables and sequence lengths, no kernel options, pages of
    32 tokens; also an fp16 query. The default call must be the Gluon kernel: its output equals the
    kernel="gluon" call's bit for bit and differs from the Triton fp4 kernel's."""
    formats = DEFAULT_FP4
    table, kp, vp = cuda_fp4_pages(SEQ_LENS, 8, 32, formats, seed=3)
    table = table.long()
    lens = torch.tensor(SEQ_LENS, dtype=torch.int64, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        query = torch.randn(len(SEQ_LENS), 32, 128, device="cuda").to(dtype)
        default = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats)
        forced = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                                  options=DecodeOptions(kernel="gluon"))
        triton_out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), formats,
                                      options=DecodeOptions(kernel="fp4"))
        assert torch.equal(default, forced)
        assert not torch.equal(default, triton_out)
        ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, formats)
        assert worst_rel_err(default, ref) < 1e-2


@on_gpu
@needs_gluon
def test_default_is_the_ring_on_gpu():
    """The default loads through the cp.async ring: it equals num_stages=STAGES bit for bit and
    differs from loads into registers (in one split the ring attends the partial tile first, so the
    float sums differ)."""
    for kv_heads, group in ((1, 8), (8, 4)):
        lens = [4099, 1027]
        table, kp, vp = cuda_fp4_pages(lens, kv_heads, 16, DEFAULT_FP4, seed=kv_heads)
        # a seeded query: the two summation orders part in only 1-10 of the 2,048-8,192 bf16
        # outputs, and with unseeded queries every output was equal in 5 of 40 trials on the H200
        # (the `not equal` below failed one run of the file in five)
        gen = torch.Generator(device="cuda").manual_seed(100 + kv_heads)
        query = torch.randn(len(lens), kv_heads * group, 128, device="cuda", generator=gen).bfloat16()
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        default, ring, registers = (
            decode_attention(query, kp, vp, table, sl, 128 ** -0.5, max(lens), DEFAULT_FP4,
                             options=DecodeOptions(num_splits=1, num_stages=st))
            for st in (None, decode_fp4_gluon.STAGES, 0))
        assert torch.equal(default, ring) and not torch.equal(default, registers)
        ref = decode_attention_ref(query, kp, vp, table, sl, 128 ** -0.5, DEFAULT_FP4)
        assert worst_rel_err(registers, ref) < 1e-2 and worst_rel_err(ring, ref) < 1e-2


@on_gpu
@needs_gluon
def test_64_bit_offsets_on_gpu(monkeypatch):
    """The int64 offset path that page arrays of 2 GiB or more take, forced on small pages."""
    class Off64(decode_fp4_gluon.Launch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.constexprs["OFF64"] = True

    monkeypatch.setattr(decode_fp4_gluon, "Launch", Off64)
    table, kp, vp = cuda_fp4_pages(SEQ_LENS, 8, 16, DEFAULT_FP4, seed=5)
    query = torch.randn(len(SEQ_LENS), 32, 128, device="cuda").bfloat16()
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
    for num_splits, stages in ((None, 0), (1, 0), (None, decode_fp4_gluon.STAGES), (1, decode_fp4_gluon.STAGES)):
        out = decode_attention(query, kp, vp, table, lens, 128 ** -0.5, max(SEQ_LENS), DEFAULT_FP4,
                               options=DecodeOptions(kernel="gluon", num_splits=num_splits, num_stages=stages))
        ref = decode_attention_ref(query, kp, vp, table, lens, 128 ** -0.5, DEFAULT_FP4)
        assert worst_rel_err(out, ref) < 1e-2


@on_gpu
@needs_gluon
def test_falls_back_outside_its_scope_on_gpu():
    formats = (FP4Format(group_size=32, outliers=1), FP4Format(group_size=16))
    table, kp, vp = cuda_fp4_pages([100], 2, 16, formats, seed=0)
    query = torch.randn(1, 8, 128, device="cuda").bfloat16()
    assert decode_fp4_gluon.unsupported(query, kp, vp, formats, 16) == "groups other than 32 (or 8 or 16 for keys)"
    lens = torch.tensor([100], device="cuda")
    with pytest.raises(ValueError, match="groups other than 32"):
        decode_attention(query, kp, vp, table, lens, 0.1, 100, formats, options=DecodeOptions(kernel="gluon"))
    out = decode_attention(query, kp, vp, table, lens, 0.1, 100, formats)
    ref = decode_attention_ref(query, kp, vp, table, lens, 0.1, formats)
    assert worst_rel_err(out, ref) < 1e-2
