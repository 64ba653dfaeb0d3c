"""Quantize a step's new K/V and write them into their slots of the paged cache: one launch per layer.

A program takes BLOCK_R (token, KV head) vectors of K and of V, quantizes each into the pages'
format (bf16/fp16 cast, fp8 E4M3 with a float32 scale per vector, or fp4 as app/kernels/fp4.py
defines it) and writes them to row slot * H + head of every page array (paged.py).

fp4 follows fp4_quantize step by step, in float32 without fused multiply-adds (but the explicit ones of
_div_by_e4m3) and with correctly rounded division, so it writes the same bits (among outlier candidates of
equal magnitude both take the lowest index first; each candidate scale's values are rounded onto the E2M1
grid by an add and a subtract (_e2m1_round, equal to the reference's encode-then-decode) and only the
winner's are encoded; a division by an E4M3 scale, or by a scale target with an E4M3 significand, is a
multiply by the reciprocal and one exact correction, proven equal to IEEE division by exhaustion), with two
documented exceptions that only move a value between two equally valid encodings:
  * the scale search sums squared errors in another order, so two candidate scales whose errors
    agree to float32 rounding may be chosen differently;
  * the second-level exponent is ceil(log2(y)) computed exactly from y's bits; torch's float log2
    can round a y just above a power of two down to it (one part in 2^21) and pick the exponent
    one lower. Both keep every group scale within E4M3's range.
fp8 divides by amax / 448 with IEEE division (as torch does on CUDA). Rotation (fmt.rotate) is
applied by the caller in torch before the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels import fp4, fp8, paged
from app.kernels.fp4 import FP4Format

# Stores of more (token, KV head) rows than this are prefill chunks, fewer decode steps. fp4 is a long
# dependent chain per vector, so a decode step takes one vector per one-warp program (the most programs in
# flight, no cross-warp exchange) and a prefill chunk 4 per one-warp program (fewer instructions per vector);
# bf16 and fp8 pages, a copy or one scale per vector, take 4 / 16 rows per 4-warp program.
WIDE_ROWS = 4096


def launch_for(num_rows: int, fp4_pages: bool) -> tuple[int, int]:
    """(rows per program, warps per program) of a store of num_rows (token, KV head) vectors. The
    interpreter (CPU tests) runs programs one after another, so it takes the widest build: every build
    writes the same bits (tests/test_kernels_store.py runs each)."""
    if fp4_pages and not paged.interpreting():
        return (1, 1) if num_rows <= WIDE_ROWS else (4, 1)
    return (4, 4) if num_rows <= WIDE_ROWS else (16, 4)


@triton.jit
def _e4m3_encode(v):
    """float32 v >= 0 -> E4M3 (fn) code, round to nearest even, saturating at 448 (int32)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits, RNE
    sub = ((v * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # multiples of 2^-9, RNE
    return tl.minimum(tl.where(v < 0.015625, sub, normal), 126)


@triton.jit
def _e2m1_round(v):
    """float32 -> the nearest E2M1 value (float32, v's sign), ties to the even code, saturating at 6: the
    value fp4.e2m1_encode's code decodes to. E2M1 is a float with one mantissa bit, spacing 0.5 below 2,
    1 in [2, 4), 2 from 4: adding and subtracting 2^23 x the spacing of |v|'s binade rounds |v| to a
    multiple of it, ties to even (at every E2M1 midpoint the even multiple is the even code)."""
    a = tl.abs(v)
    binade = tl.minimum(tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127), 129)  # 2^0 .. 2^2
    magic = ((binade + 22) << 23).to(tl.float32, bitcast=True)  # 2^23 x spacing (spacing 2^(binade-128))
    r = tl.minimum((a + magic) - magic, 6.0)
    return tl.where(v < 0, -r, r)


@triton.jit
def _e2m1_code(r):
    """An E2M1 value (float32, as _e2m1_round returns) -> its code (int32 0..15, sign bit 3 when r < 0)."""
    a = tl.abs(r)
    bits = a.to(tl.int32, bitcast=True)
    mag = tl.where(a < 1.0, (a * 2.0).to(tl.int32), (((bits >> 23) - 126) << 1) | ((bits >> 22) & 1))
    return tl.where(r < 0, mag | 8, mag)


@triton.jit
def _e4m3_reciprocal(sc):
    """E4M3 codes of normal values (exponent field 1..15; sign ignored) -> RN(1 / value) in float32, exactly:
    RN(1 / (1 + m/8)) for the code's 3 mantissa bits m from a table of bits, its exponent moved by the code's."""
    m = sc & 7
    bits = tl.where(m < 4,
                    tl.where(m < 2, tl.where(m == 0, 0x3F800000, 0x3F638E39), tl.where(m == 2, 0x3F4CCCCD, 0x3F3A2E8C)),
                    tl.where(m < 6, tl.where(m == 4, 0x3F2AAAAB, 0x3F1D89D9), tl.where(m == 6, 0x3F124925, 0x3F088889)))
    return (bits + ((7 - ((sc >> 3) & 15)) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _div_by_e4m3(x, s, r):
    """RN(x / s) for a normal E4M3 value s, given r = RN(1 / s): x * r and one correction by the exact
    remainder (Markstein), three operations instead of an IEEE division. Equal to x / s for every float32
    significand of x and every E4M3 significand of s (checked exhaustively, tests/test_kernels_store.py);
    for |x| below ~2^-100 (the remainder may underflow) the two may differ, but x / s is then far below E2M1's
    first step, so the value (0) and its error (x) are the same."""
    y = x * r
    return tl.fma(tl.fma(-s, y, x), r, y)


@triton.jit
def _ceil_log2(y):
    """ceil(log2(y)) for float32 y > 0, exactly (from the bits; subnormals give <= -126)."""
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    up = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.where(e == 0, -126, e - 127 + up)


@triton.jit
def _sum3(x):
    """[R, NG, NS, SUB] -> [R]."""
    return tl.sum(tl.sum(tl.sum(x, 3), 2), 1)


@triton.jit
def _max3(x):
    """[R, NG, NS, SUB] -> [R]."""
    return tl.max(tl.max(tl.max(x, 3), 2), 1)


@triton.jit
def _try_scale(xn, amax_n, target: tl.constexpr, rcp: tl.constexpr, best_err, best_sc, best_val):
    """Scale each group's amax to `target`; keep, per group, the candidate with the lowest squared error
    (its scale code and its values on the E2M1 grid: the codes are taken once, from the winner's values)."""
    if rcp > 0:  # target's significand is an E4M3 one: x / target in three operations, exactly (_div_by_e4m3)
        scaled = _div_by_e4m3(amax_n, target, rcp)
    else:
        scaled = tl.math.div_rn(amax_n, target)
    sc = _e4m3_encode(tl.maximum(scaled, 0.015625))  # never subnormal (fp4.py)
    dec = paged.e4m3_to_f32(sc)[:, :, None, None]  # > 0: sc >= 2^-6, a normal E4M3 value
    val = _e2m1_round(_div_by_e4m3(xn, dec, _e4m3_reciprocal(sc)[:, :, None, None]))
    diff = val * dec - xn
    err = tl.sum(tl.sum(diff * diff, 3), 2)
    better = err < best_err
    return (tl.where(better, err, best_err), tl.where(better, sc, best_sc),
            tl.where(better[:, :, None, None], val, best_val))


@triton.jit
def _store_fp4(x_ptr, off, prow, valid, p0, p1, p2, p3, p4, R: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
               KO: tl.constexpr, ZSCORE: tl.constexpr, Z, MIN_T: tl.constexpr,
               T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr, NT: tl.constexpr,
               R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr):
    """Quantize the vectors at element offsets off [R] and write them to page rows prow [R]. A vector is held as
    [groups, G / SUB, SUB]: a thread's SUB neighbours lie in one group, so that a group's sums and maxima are a
    few shuffles and each thread computes the scales of its own group only."""
    NG: tl.constexpr = D // G
    SUB: tl.constexpr = 4 if G >= 4 else G
    NS: tl.constexpr = G // SUB
    d = (tl.arange(0, NG)[None, :, None, None] * G + tl.arange(0, NS)[None, None, :, None] * SUB
         + tl.arange(0, SUB)[None, None, None, :])  # [1, NG, NS, SUB]: the element index
    x = tl.load(x_ptr + off[:, None, None, None] + d, mask=valid[:, None, None, None], other=0.0).to(tl.float32)
    if KO > 0:
        # outliers: the KO largest |x| (zscore: among |x - mean| > Z * std), largest first
        if ZSCORE:
            mean = tl.math.div_rn(_sum3(x), D * 1.0)
            dev = x - mean[:, None, None, None]
            std = tl.math.sqrt_rn(tl.math.div_rn(_sum3(dev * dev), D * 1.0))
            mag = tl.where(tl.abs(dev) > Z * std[:, None, None, None], tl.abs(x), -1.0)
        else:
            mag = tl.abs(x)
        for k in tl.static_range(KO):
            top = _max3(mag)
            # the lowest index holding the largest magnitude (argmax, ties to the left)
            idx = tl.min(tl.min(tl.min(tl.where(mag == top[:, None, None, None], d, D), 3), 2), 1)
            if ZSCORE:
                used = top >= 0
            else:
                used = top > 0
            hit = d == idx[:, None, None, None]
            val = paged.to_bf16(tl.where(used, _sum3(tl.where(hit, x, 0.0)), 0.0))
            tl.store(p3 + prow * KO + k, val, mask=valid)
            tl.store(p4 + prow * KO + k, tl.where(used, idx, 0).to(tl.uint8), mask=valid)
            x = tl.where(hit & used[:, None, None, None], x - val.to(tl.float32)[:, None, None, None], x)
            mag = tl.where(hit, float("-inf"), mag)
    amax = tl.max(tl.max(tl.abs(x), 3), 2)  # [R, NG]
    top = tl.math.div_rn(tl.max(amax, 1), MIN_T)  # [R]
    exp = tl.minimum(tl.maximum(_ceil_log2(tl.math.div_rn(top, 448.0)), -126), 127)
    exp = tl.where(top > 0, exp, -127)
    # 1 / the second-level scale, exactly (a power of two, normal: targets >= 0.5 keep exp <= 121), so that
    # multiplying by it rounds as dividing by the scale does
    inv_second = tl.where(exp > -127, ((127 - exp) << 23).to(tl.float32, bitcast=True), 1.0)
    xn = x * inv_second[:, None, None, None]
    amax_n = amax * inv_second[:, None]
    best_err = tl.full([R, NG], float("inf"), tl.float32)
    best_sc = tl.zeros([R, NG], tl.int32)
    best_val = tl.zeros([R, NG, NS, SUB], tl.float32)
    best_err, best_sc, best_val = _try_scale(xn, amax_n, T0, R0, best_err, best_sc, best_val)
    if NT > 1:
        best_err, best_sc, best_val = _try_scale(xn, amax_n, T1, R1, best_err, best_sc, best_val)
    if NT > 2:
        best_err, best_sc, best_val = _try_scale(xn, amax_n, T2, R2, best_err, best_sc, best_val)
    if NT > 3:
        best_err, best_sc, best_val = _try_scale(xn, amax_n, T3, R3, best_err, best_sc, best_val)
    even, odd = tl.split(tl.reshape(_e2m1_code(best_val), (R, D // 2, 2)))
    col = tl.arange(0, D // 2)
    j = tl.arange(0, NG)
    tl.store(p0 + prow[:, None] * (D // 2) + col[None, :], (even | (odd << 4)).to(tl.uint8), mask=valid[:, None])
    tl.store(p1 + prow[:, None] * NG + j[None, :], best_sc.to(tl.uint8), mask=valid[:, None])
    tl.store(p2 + prow, (exp + 127).to(tl.uint8), mask=valid)


@triton.jit
def _store_one(x_ptr, prow, off, valid, p0, p1, p2, p3, p4, R: tl.constexpr, D: tl.constexpr,
               KIND: tl.constexpr, G: tl.constexpr, KO: tl.constexpr, ZSCORE: tl.constexpr, Z,
               MIN_T: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
               NT: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr):
    if KIND == 2:
        _store_fp4(x_ptr, off, prow, valid, p0, p1, p2, p3, p4, R, D, G, KO, ZSCORE, Z, MIN_T, T0, T1, T2, T3, NT,
                   R0, R1, R2, R3)
        return
    d = tl.arange(0, D)
    x = tl.load(x_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if KIND == 0:
        if p0.dtype.element_ty == tl.bfloat16 and x.dtype != tl.bfloat16:
            x = paged.to_bf16(x.to(tl.float32))
        tl.store(p0 + prow[:, None] * D + d[None, :], x.to(p0.dtype.element_ty), mask=valid[:, None])
    elif KIND == 1:
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), 448.0)
        scale = tl.where(scale > 0, scale, 1.0)
        v = tl.math.div_rn(x, scale[:, None])
        sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80  # torch keeps the sign of -0.0
        code = _e4m3_encode(tl.abs(v)) | sign
        tl.store(p0 + prow[:, None] * D + d[None, :], code.to(tl.uint8), mask=valid[:, None])
        tl.store(p1 + prow, scale, mask=valid)


@triton.jit
def _nonfinite_rows(x_ptr, off, mask, D: tl.constexpr):
    """[R] True where the vectors at element offsets off [R] hold a NaN or an Inf (x - x is NaN exactly there)."""
    d = tl.arange(0, D)
    x = tl.load(x_ptr + off[:, None] + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    return tl.max(((x - x) != 0.0).to(tl.int32), 1) > 0


@triton.jit(do_not_specialize=("num_rows",))  # a new token count must not compile a new build
def _store_kv_kernel(
    k_ptr, v_ptr, slot_ptr, num_rows, flag_ptr, stride_k, stride_v,
    k0, k1, k2, k3, k4, v0, v1, v2, v3, v4,
    K_Z, V_Z,
    H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, FLAG: tl.constexpr,
    K_KIND: tl.constexpr, K_G: tl.constexpr, K_KO: tl.constexpr, K_ZSCORE: tl.constexpr, K_MIN_T: tl.constexpr,
    K_T0: tl.constexpr, K_T1: tl.constexpr, K_T2: tl.constexpr, K_T3: tl.constexpr, K_NT: tl.constexpr,
    K_R0: tl.constexpr, K_R1: tl.constexpr, K_R2: tl.constexpr, K_R3: tl.constexpr,
    V_KIND: tl.constexpr, V_G: tl.constexpr, V_KO: tl.constexpr, V_ZSCORE: tl.constexpr, V_MIN_T: tl.constexpr,
    V_T0: tl.constexpr, V_T1: tl.constexpr, V_T2: tl.constexpr, V_T3: tl.constexpr, V_NT: tl.constexpr,
    V_R0: tl.constexpr, V_R1: tl.constexpr, V_R2: tl.constexpr, V_R3: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of the flattened [T * H, D] input
    in_range = r < num_rows
    slot = tl.load(slot_ptr + r // H, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slot >= 0)  # negative slots (padding) are skipped
    # element offsets of each (token, head) vector: token rows may be strided (views of a fused QKV)
    k_off = (r // H).to(tl.int64) * stride_k + (r % H) * D
    v_off = (r // H).to(tl.int64) * stride_v + (r % H) * D
    if FLAG:
        # a vector with NaN/Inf in K or V is not written; its token is flagged for the runner
        bad = _nonfinite_rows(k_ptr, k_off, valid, D) | _nonfinite_rows(v_ptr, v_off, valid, D)
        tl.store(flag_ptr + r // H, 1, mask=valid & bad)
        valid = valid & ~bad
    prow = slot * H + r % H
    _store_one(k_ptr, prow, k_off, valid, k0, k1, k2, k3, k4, BLOCK_R, D, K_KIND, K_G, K_KO, K_ZSCORE, K_Z,
               K_MIN_T, K_T0, K_T1, K_T2, K_T3, K_NT, K_R0, K_R1, K_R2, K_R3)
    _store_one(v_ptr, prow, v_off, valid, v0, v1, v2, v3, v4, BLOCK_R, D, V_KIND, V_G, V_KO, V_ZSCORE, V_Z,
               V_MIN_T, V_T0, V_T1, V_T2, V_T3, V_NT, V_R0, V_R1, V_R2, V_R3)


def _target_reciprocal(target: float) -> float:
    """RN(1 / target) in float32 where target's significand is one of E4M3's (1 + m/8: 6, 5, 4.5, 4 ...), so
    that the kernel divides by it as _div_by_e4m3 does, exactly; 0.0 (an IEEE division) for any other."""
    t = torch.tensor(target, dtype=torch.float32)
    mantissa, _ = torch.frexp(t)  # t = mantissa * 2^e, mantissa in [0.5, 1)
    if float(t) != target or float(mantissa * 16) != int(mantissa * 16):
        return 0.0
    return float(torch.ones((), dtype=torch.float32) / t)


def _format_args(pages, fmt: FP4Format | None, prefix: str) -> tuple[dict, float]:
    kind = paged.page_kind(pages)
    targets = tuple(fmt.scale_targets) if kind == paged.FP4 else (6.0,)
    assert len(targets) <= 4, f"the store kernel takes at most 4 scale_targets (got {targets})"
    padded = targets + (targets[-1],) * (4 - len(targets))
    ce = paged.page_constexprs(pages, fmt, prefix)
    ce.update({f"{prefix}_ZSCORE": kind == paged.FP4 and fmt.outlier_mode == "zscore",
               f"{prefix}_MIN_T": float(min(targets)), f"{prefix}_NT": len(targets)})
    ce.update({f"{prefix}_T{i}": float(t) for i, t in enumerate(padded)})
    ce.update({f"{prefix}_R{i}": _target_reciprocal(t) for i, t in enumerate(padded)})
    return ce, float(fmt.zscore) if kind == paged.FP4 else 0.0


def check_finite_pair(key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise fp4.check_finite's ValueError if K or V holds NaN/Inf (one device sync for both)."""
    if not bool(torch.isfinite(key).all() & torch.isfinite(value).all()):
        fp4.check_finite(key)
        fp4.check_finite(value)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; negative: skip the token
    k_pages, v_pages,  # one layer's pages (paged.py)
    formats: tuple[FP4Format | None, FP4Format | None] = (None, None),
    check_finite: bool = True,
    block_r: int | None = None,  # rows per program and warps: launch_for's unless given (benchmarks)
    num_warps: int | None = None,
    nonfinite: torch.Tensor | None = None,  # [num_tokens] int32
) -> None:
    """Write K/V into their slots. With `nonfinite` (the engine's way: no device sync), a (token,
    head) vector whose K or V holds NaN/Inf is not written and nonfinite[token] is set to 1, in any
    format. Without it, quantized formats refuse NaN/Inf before writing anything (ValueError, a
    device sync) unless check_finite=False."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    for name, pages, fmt in (("k_pages", k_pages, formats[0]), ("v_pages", v_pages, formats[1])):
        _, _, h, d = paged.check_pages(pages, fmt, name)
        assert (h, d) == (num_kv_heads, head_dim), f"{name} hold {h} heads x {d}, K/V have {num_kv_heads} x {head_dim}"
    num_rows = num_tokens * num_kv_heads
    rule_r, rule_warps = launch_for(num_rows, paged.FP4 in (paged.page_kind(k_pages), paged.page_kind(v_pages)))
    block_r, num_warps = block_r or rule_r, num_warps or rule_warps
    assert paged.is_pow2(head_dim) and paged.is_pow2(block_r), f"head_dim {head_dim} and block_r must be powers of two"
    if num_tokens == 0:
        return
    if nonfinite is not None:
        assert nonfinite.shape[0] >= num_tokens and nonfinite.dtype == torch.int32 and nonfinite.is_contiguous()
    elif check_finite and {paged.page_kind(k_pages), paged.page_kind(v_pages)} & {paged.FP8, paged.FP4}:
        check_finite_pair(key, value)
    # token rows may be strided (views of a fused QKV projection); each (token, head) vector is contiguous
    key, value = (x if x.stride(2) == 1 and x.stride(1) == head_dim else x.contiguous() for x in (key, value))
    k_ce, k_z = _format_args(k_pages, formats[0], "K")
    v_ce, v_z = _format_args(v_pages, formats[1], "V")
    _store_kv_kernel[(triton.cdiv(num_rows, block_r),)](
        key, value, slot_mapping, num_rows, slot_mapping if nonfinite is None else nonfinite,
        key.stride(0), value.stride(0),
        *paged.page_args(k_pages), *paged.page_args(v_pages), k_z, v_z,
        H=num_kv_heads, D=head_dim, BLOCK_R=block_r, FLAG=nonfinite is not None, **k_ce, **v_ce,
        num_warps=num_warps, enable_fp_fusion=False,
    )


def store_kv_ref(key, value, slot_mapping, k_pages, v_pages,
                 formats: tuple[FP4Format | None, FP4Format | None] = (None, None)) -> None:
    """The torch path: quantize with app/kernels/fp4.py or fp8.py and scatter into the same pages."""
    for x, pages, fmt in ((key, k_pages, formats[0]), (value, v_pages, formats[1])):
        kind = paged.page_kind(pages)
        keep = slot_mapping >= 0
        slots, x = slot_mapping[keep], x[keep]
        if kind == paged.DENSE:
            pages.view(-1, *x.shape[1:])[slots] = x.to(pages.dtype)
            continue
        new = fp8.fp8_quantize(x) if kind == paged.FP8 else fp4.fp4_quantize(x, fmt)
        for page, part in zip(pages, new):
            if part.numel():
                page.view(-1, *part.shape[1:])[slots] = part
