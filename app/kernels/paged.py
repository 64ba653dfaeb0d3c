"""Paged K/V pages as the Triton kernels see them: layouts, checks, the dequantized reference, tile loads.

One layer's K (or V) pages come in one of three forms (app/engine/kv_cache.py allocates them):
  dense  Tensor [num_blocks, block_size, num_kv_heads, head_dim]  bf16 | fp16
  fp8    (values [nb, bs, H, D] float8_e4m3fn, scale [nb, bs, H] float32)
  fp4    FP4Tensor(codes [nb, bs, H, D/2] uint8, scales [nb, bs, H, D/G] e4m3, scale_exp [nb, bs, H]
                   uint8, out_vals [nb, bs, H, k] bf16, out_idx [nb, bs, H, k] uint8)
Token t of a sequence sits in slot block_table[t // block_size] * block_size + t % block_size. Every
array is contiguous, so viewed as [rows, width] its row `slot * H + head` holds that token's data for
that head: the kernels address all formats by that row.

In registers, a tile of N tokens comes back as (w [N, D] in the compute dtype, f [N] float32) with
value = w * f[:, None]: dense pages have f = 1; fp8 pages carry their per-vector scale in f; fp4 pages
give w = E2M1 value x E4M3 group scale x 2^-8 (exact in bf16: at most 6 significant bits, magnitudes
2^-18 .. 10.5) and f = 2^(scale_exp - 127 + 8), the per-vector power of two. The kernels fold f into
the scores (K) or into the probabilities (V), so the group scales are the only per-element multiply.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from app.kernels import fp4, fp8

DENSE, FP8, FP4 = 0, 1, 2
_DENSE_DTYPES = (torch.bfloat16, torch.float16)


def page_kind(pages) -> int:
    if isinstance(pages, fp4.FP4Tensor):
        return FP4
    if isinstance(pages, tuple):
        return FP8
    return DENSE


def check_pages(pages, fmt: fp4.FP4Format | None, what: str) -> tuple[int, int, int, int]:
    """Assert dtypes, shapes and contiguity; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    kind = page_kind(pages)
    if kind == DENSE:
        assert pages.dtype in _DENSE_DTYPES, f"{what}: dense pages must be bf16 or fp16 (got {pages.dtype})"
        assert pages.dim() == 4 and pages.is_contiguous(), f"{what}: pages must be contiguous [nb, bs, H, D]"
        return tuple(pages.shape)
    if kind == FP8:
        values, scale = pages
        assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, f"{what}: fp8 dtypes"
        assert values.dim() == 4 and values.is_contiguous() and scale.is_contiguous(), f"{what}: fp8 layout"
        assert scale.shape == values.shape[:3], f"{what}: scale {tuple(scale.shape)} vs values {tuple(values.shape)}"
        return tuple(values.shape)
    assert fmt is not None, f"{what}: fp4 pages need their FP4Format"
    nb, bs, h, half = pages.codes.shape
    d = 2 * half
    fmt.check(d)
    expect = {
        "codes": ((nb, bs, h, half), torch.uint8),
        "scales": ((nb, bs, h, d // fmt.group(d)), torch.float8_e4m3fn),
        "scale_exp": ((nb, bs, h), torch.uint8),
        "out_vals": ((nb, bs, h, fmt.outliers), torch.bfloat16),
        "out_idx": ((nb, bs, h, fmt.outliers), torch.uint8),
    }
    for name, (shape, dtype) in expect.items():
        t = getattr(pages, name)
        assert tuple(t.shape) == shape and t.dtype == dtype, (
            f"{what}.{name}: expected {shape} {dtype}, got {tuple(t.shape)} {t.dtype}")
        assert t.is_contiguous(), f"{what}.{name} must be contiguous"
    return nb, bs, h, d


def quantize_pages(x: torch.Tensor, kind: str, fmt: fp4.FP4Format | None = None):
    """Pages holding x [num_blocks, block_size, H, D] in format kind ("bf16", "fp16", "fp8", "fp4"),
    quantized by the torch reference (for tests and benchmarks)."""
    if kind == "fp4":
        return fp4.FP4Tensor(*(t.contiguous() for t in fp4.fp4_quantize(x, fmt)))
    if kind == "fp8":
        return fp8.fp8_quantize(x)
    return x.to({"bf16": torch.bfloat16, "fp16": torch.float16}[kind]).contiguous()


def page_args(pages) -> list[torch.Tensor]:
    """The five pointers a kernel takes for one of K or V (unused ones repeat the first)."""
    kind = page_kind(pages)
    if kind == DENSE:
        return [pages] * 5
    if kind == FP8:
        values, scale = pages
        return [values.view(torch.uint8), scale, scale, scale, scale]
    return [pages.codes, pages.scales.view(torch.uint8), pages.scale_exp, pages.out_vals, pages.out_idx]


def page_constexprs(pages, fmt: fp4.FP4Format | None, prefix: str) -> dict:
    kind = page_kind(pages)
    group, slots = 1, 0
    if kind == FP4:
        d = 2 * pages.codes.shape[-1]
        group, slots = fmt.group(d), fmt.outliers
    return {f"{prefix}_KIND": kind, f"{prefix}_G": group, f"{prefix}_KO": slots}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_asm(device: torch.device) -> bool:
    """Inline PTX (the fast fp4 unpack) only on a real CUDA device; the interpreter runs plain Triton."""
    return device.type == "cuda" and not interpreting()


def operand_dtype(k_pages, v_pages):
    """tl dtype of the dot operands: the pages' own for dense pages, bf16 for fp8 and fp4. Under the
    interpreter float32 (exact for every such value), because Triton 3.9's interpreter multiplies
    bf16 dot operands as raw 16-bit integers and truncates float32 -> bf16 casts."""
    dtypes = {p.dtype if page_kind(p) == DENSE else torch.bfloat16 for p in (k_pages, v_pages)}
    assert len(dtypes) == 1, f"K and V pages must share a compute dtype (got {dtypes})"
    if interpreting():
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtypes.pop()]


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_head_dim(head_dim: int) -> None:
    assert is_pow2(head_dim) and 32 <= head_dim <= 256, (
        f"the kernels need a power-of-two head_dim in [32, 256] (got {head_dim}); use the torch path")


_INTERPRET: tl.constexpr = tl.constexpr(interpreting())


# -- bit helpers ---------------------------------------------------------------------------------
@triton.jit
def to_bf16(x):
    """float32 -> bf16, round to nearest even (the interpreter's own cast truncates)."""
    if _INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def cast_out(x, dtype: tl.constexpr):
    """float32 -> an output dtype, rounding to nearest even also under the interpreter."""
    if dtype == tl.bfloat16:
        return to_bf16(x)
    return x.to(dtype)


@triton.jit
def e4m3_to_f32(b):
    """E4M3 (fn) bits (uint8 or int32, sign ignored: scales are >= 0) -> float32, exactly."""
    b = b.to(tl.int32) & 0x7F
    e = b >> 3
    m = b & 7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)
    return mant * ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # x 2^(e - 10)


@triton.jit
def e2m1_to_f32(n):
    """E2M1 codes (int32 0..15) -> float32: 0, .5, 1, 1.5, 2, 3, 4, 6 with sign bit 3."""
    mag = n & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)  # (1 + m/2) * 2^(e-1), e >= 1
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
    return tl.where((n & 8) != 0, -v, v)


# Four bytes of E2M1 codes (element 2i in the low nibble of byte i) times their bf16 scales -> bf16.
# prmt spreads bytes (b0, b1) to the high bytes of the two 16-bit lanes: y = [0, b0, 0, b1]. Each
# output pair then needs a nibble's magnitude at bf16 bits 6..8 (the two low exponent bits and the
# top mantissa bit) and its sign at bit 15: that bf16 is the E2M1 value x 2^-126 (0.5 becomes a
# subnormal, which bf16 multiplies keep). Low nibbles: (y >> 2 | y << 4) & M, one lop3. High nibbles:
# (y >> 6) & M | (y & signs): y's own bit 8 (the byte's bit 0) would spoil (y >> 6 | y) & M. The
# scale operand is group scale x 2^118, so the product is value x scale x 2^-8, exact. Elementwise
# with pack=4: inputs $4 (4 codes) and $5, $6 (4 scales); outputs $0, $1 (low nibbles), $2, $3 (high).
# The body, with the scale registers of element pairs (0, 1) and (2, 3) as SCALE01 and SCALE23.
_FP4_UNPACK_BODY = """
  prmt.b32 y, $4, z, 0x1404;
  shr.b32 t, y, 2; shl.b32 u, y, 4; lop3.b32 t, t, u, 0x81C081C0, 0xA8;
  mul.rn.bf16x2 $0, t, SCALE01;
  shr.b32 t, y, 6; and.b32 u, y, 0x80008000; lop3.b32 t, t, u, 0x81C081C0, 0xEC;
  mul.rn.bf16x2 $2, t, SCALE01;
  prmt.b32 y, $4, z, 0x3424;
  shr.b32 t, y, 2; shl.b32 u, y, 4; lop3.b32 t, t, u, 0x81C081C0, 0xA8;
  mul.rn.bf16x2 $1, t, SCALE23;
  shr.b32 t, y, 6; and.b32 u, y, 0x80008000; lop3.b32 t, t, u, 0x81C081C0, 0xEC;
  mul.rn.bf16x2 $3, t, SCALE23;
"""
_FP4_UNPACK_PTX = tl.constexpr("""
{
  .reg .b32 z, y, t, u;
  mov.b32 z, 0;""" + _FP4_UNPACK_BODY.replace("SCALE01", "$5").replace("SCALE23", "$6") + "}\n")


@triton.jit
def _fp4_unpack(c, sc, ASM: tl.constexpr):
    """codes c [..] uint8, scales sc [..] (bf16, group scale x 2^118) -> (low, high) nibbles x scale x
    2^-8 (exact in bf16): element 2i and element 2i+1 of the vector. bf16 from the PTX, float32 from
    the plain-Triton path."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _FP4_UNPACK_PTX, "=r,=r,=r,=r,r,r,r", [c, sc],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        ci = c.to(tl.int32)
        s8 = sc.to(tl.float32) * 1.1754943508222875e-38  # x 2^-126: scale x 2^-8
        lo = e2m1_to_f32(ci & 15) * s8
        hi = e2m1_to_f32(ci >> 4) * s8
    return lo, hi


# The same unpack with the group scales as raw E4M3 bits, one int32 per element ($5..$8, pack=4).
# fp4.py never writes a subnormal scale, so bf16(scale x 2^118) = bits x 16 + 0x7700: the shift puts
# E4M3's exponent E and 3 mantissa bits into bf16's fields and 0x7700 = 238 << 7 adds 238 to the
# exponent, 2^(E + 238 - 127) = 2^(E - 7) x 2^118. A prmt pairs the low halves of two elements'
# words, so the scales need no conversion or packing outside the asm: in the tensor-core operand
# layout, where Triton runs the unpack, the float conversion cost a dozen instructions per scale.
_FP4_UNPACK_SCALEBITS_PTX = tl.constexpr("""
{
  .reg .b32 z, y, t, u, s01, s23;
  mov.b32 z, 0;
  prmt.b32 s01, $5, $6, 0x5410; mad.lo.u32 s01, s01, 16, 0x77007700;
  prmt.b32 s23, $7, $8, 0x5410; mad.lo.u32 s23, s23, 16, 0x77007700;""" + _FP4_UNPACK_BODY.replace(
    "SCALE01", "s01").replace("SCALE23", "s23") + "}\n")


@triton.jit
def load_fp4_groups(p0, p1, p2, rows, mask, D: tl.constexpr, G: tl.constexpr):
    """One fp4 head's codes [N, D/G, G/2] uint8, group scale bits [N, D/G] uint8 and second-level
    exponents [N] int32 for the N tokens at `rows` (the scales and outliers of paged.py's layout)."""
    NG: tl.constexpr = D // G
    GH: tl.constexpr = G // 2
    j = tl.arange(0, NG)
    c = tl.arange(0, GH)
    codes = tl.load(p0 + rows[:, None, None] * (D // 2) + (j * GH)[None, :, None] + c[None, None, :],
                    mask=mask[:, None, None], other=0)
    sbits = tl.load(p1 + rows[:, None] * NG + j[None, :], mask=mask[:, None], other=0)
    e = tl.load(p2 + rows, mask=mask, other=0).to(tl.int32)
    return codes, sbits, e


@triton.jit
def fp4_unpack_groups(codes, sbits, ASM: tl.constexpr):
    """codes [N, NG, GH], scale bits [N, NG] (normal E4M3) -> (even, odd) [N, NG*GH]: elements 2i and
    2i+1 of each vector, value x group scale x 2^-8 (exact in bf16; float32 on the plain path).
    Multiply by pow2_scale(e) to get the stored value. Keeping the even and odd halves apart (the
    query and the output are split alike) saves interleaving them."""
    N: tl.constexpr = codes.shape[0]
    NG: tl.constexpr = codes.shape[1]
    GH: tl.constexpr = codes.shape[2]
    if ASM:
        sw = tl.broadcast_to(sbits.to(tl.int32)[:, :, None], (N, NG, GH))
        lo, hi = tl.inline_asm_elementwise(
            _FP4_UNPACK_SCALEBITS_PTX, "=r,=r,=r,=r,r,r,r,r,r", [codes, sw],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:  # float32 scale x 2^118, as _fp4_unpack takes it (exact: powers of two)
        sc = e4m3_to_f32(sbits) * 3.3230699894622794e35
        lo, hi = _fp4_unpack(codes, tl.broadcast_to(sc[:, :, None], (N, NG, GH)), False)
    return tl.reshape(lo, (N, NG * GH)), tl.reshape(hi, (N, NG * GH))


@triton.jit
def pow2_scale(e):
    """Second-level exponent bits [N] int32 -> 2^(scale_exp - 127 + 8) float32 (the factor the
    unpacked tiles leave out)."""
    return ((tl.minimum(e, 246) + 8) << 23).to(tl.float32, bitcast=True)


@triton.jit
def inv_pow2_scale(e):
    """1 / pow2_scale(e) = 2^(119 - scale_exp): outlier values in the unpacked tiles' units."""
    return (tl.maximum(246 - e, 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_raw(p0, p1, p2, p3, p4, rows, mask, KIND: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
             KO: tl.constexpr):
    """Issue the loads of one head's data for N tokens at `rows` [N] (int64, slot * H + head) and
    return the raw page bytes as five tensors (unused ones are placeholders). The kernels load a tile
    where they use it; Triton's software pipelining (num_stages >= 2) issues the next tile's loads
    early."""
    N: tl.constexpr = rows.shape[0]
    if KIND == 2:
        NG: tl.constexpr = D // G
        KOP: tl.constexpr = triton.next_power_of_2(KO) if KO > 0 else 1
        col = tl.arange(0, D // 2)
        j = tl.arange(0, NG)
        k = tl.arange(0, KOP)
        a = tl.load(p0 + rows[:, None] * (D // 2) + col[None, :], mask=mask[:, None], other=0)  # codes [N, D/2]
        b = tl.load(p1 + rows[:, None] * NG + j[None, :], mask=mask[:, None], other=0)  # scale bits [N, NG]
        c = tl.load(p2 + rows, mask=mask, other=0)  # scale_exp [N]
        slot_mask = mask[:, None] & (k < KO)[None, :]
        e = tl.load(p4 + rows[:, None] * KO + k[None, :], mask=slot_mask, other=0)  # out_idx [N, KOP]
        f = tl.load(p3 + rows[:, None] * KO + k[None, :], mask=slot_mask, other=0.0)  # out_vals [N, KOP]
    else:
        d = tl.arange(0, D)
        a = tl.load(p0 + rows[:, None] * D + d[None, :], mask=mask[:, None], other=0)  # values [N, D]
        if KIND == 1:
            b = tl.load(p1 + rows, mask=mask, other=0.0)  # float32 scale [N]
        else:
            b = tl.full([N], 1.0, tl.float32)
        c = tl.zeros([N], tl.int8)
        e = c
        f = c
    return a, b, c, e, f


@triton.jit
def unpack_raw(a, b, c, idx, val, KIND: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KO: tl.constexpr,
               OUTLIERS_IN_TILE: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """Raw page bytes from load_raw -> (w [N, D] DT, f [N] float32) with value = w * f[:, None].

    With OUTLIERS_IN_TILE the fp4 outlier slots are added into w (a compare and select per element
    and slot) and the sum rounded to DT; otherwise the caller adds them exactly (outlier_scores)."""
    N: tl.constexpr = a.shape[0]
    if KIND == 0:
        w = a.to(DT)
        f = b
    elif KIND == 1:
        w = a.to(tl.float8e4nv, bitcast=True).to(DT)
        f = b
    else:
        NG: tl.constexpr = D // G
        GH: tl.constexpr = G // 2
        sc = (e4m3_to_f32(b) * 3.3230699894622794e35).to(tl.bfloat16)  # group scale x 2^118, exact
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (N, NG, GH)), (N, D // 2))
        lo, hi = _fp4_unpack(a, sc, ASM)
        w = tl.reshape(tl.interleave(lo, hi), (N, D))
        e = c.to(tl.int32)
        f = pow2_scale(e)
        if OUTLIERS_IN_TILE and KO > 0:
            KOP: tl.constexpr = triton.next_power_of_2(KO)
            k = tl.arange(0, KOP)
            d = tl.arange(0, D)
            idx = idx.to(tl.int32)
            val = val.to(tl.float32)
            add = tl.zeros([N, D], tl.float32)
            for slot in tl.static_range(KO):
                idx_s = tl.sum(tl.where(k[None, :] == slot, idx, 0), 1)
                val_s = tl.sum(tl.where(k[None, :] == slot, val, 0.0), 1)
                add += tl.where(d[None, :] == idx_s[:, None], val_s[:, None], 0.0)
            w = w.to(tl.float32) + add * inv_pow2_scale(e)[:, None]
        w = w.to(DT)
    return w, f


@triton.jit
def outlier_scores(s, q_ptr, q_rows, q_mask, idx, val, mask, KO: tl.constexpr):
    """s [M, N] + the fp4 key outlier slots' share of q.k: sum over slots of out_val[n] * q[m,
    out_idx[n]], exact in float32. idx, val [N, KOP] come from load_raw; the query
    elements are re-read at the indices (L1 hits: a program's queries are a few KB)."""
    KOP: tl.constexpr = triton.next_power_of_2(KO)
    k = tl.arange(0, KOP)
    idx = idx.to(tl.int32)
    val = val.to(tl.float32)
    for slot in tl.static_range(KO):
        idx_s = tl.sum(tl.where(k[None, :] == slot, idx, 0), 1)
        val_s = tl.sum(tl.where(k[None, :] == slot, val, 0.0), 1)
        qv = tl.load(q_ptr + q_rows[:, None] + idx_s[None, :], mask=q_mask[:, None] & mask[None, :], other=0.0)
        s += qv.to(tl.float32) * val_s[None, :]
    return s


@triton.jit
def mma(a, b, acc):
    """tl.dot; float32 operands (the interpreter's) multiply in IEEE float32, not tf32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def pv_dot(acc, p, w, DT: tl.constexpr, PRECISE: tl.constexpr):
    """acc + p @ w with p [M, N] float32 rounded to DT; PRECISE adds the rounding residue as a
    second product (p = hi + lo, both DT), which makes the PV product float32-accurate: decode is
    bound by memory, so the extra tensor-core work is free there."""
    hi = p.to(DT)
    acc = mma(hi, w, acc)
    if PRECISE and DT != tl.float32:
        acc = mma((p - hi.to(tl.float32)).to(DT), w, acc)
    return acc


@triton.jit
def softmax_step(s, m, l, acc, wv, fv, DT: tl.constexpr, PRECISE: tl.constexpr):
    """One tile of the online softmax in base 2: scores s [M, N] (log2 units, masked to -inf), V
    tile (wv [N, D], fv [N]) -> the new running max m [M], sum l [M] and output acc [M, D]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = pv_dot(acc * alpha[:, None], p * fv[None, :], wv, DT, PRECISE)
    return m_new, l, acc


@triton.jit
def page_rows(block_table_row, n, mask, BS: tl.constexpr, H: tl.constexpr, h):
    """Rows (slot * H + head, int64) of token positions n [N] of one sequence."""
    blk = tl.load(block_table_row + n // BS, mask=mask, other=0).to(tl.int64)
    return (blk * BS + n % BS) * H + h
