"""fp8 flash-decoding in Gluon: E4M3 pages read straight into the tensor cores' operand layout.

The fp8 KV format (fp8.py) stores a (token, KV head) vector as 128 E4M3 bytes and one float32 scale.
E4M3 is exact in fp16, and the hardware widens two E4M3 bytes to an fp16 pair in one instruction
(cvt.rn.f16x2.e4m3x2), so the only work between the loaded bytes and the MMAs is that conversion
and, for the values, one byte permute per two pairs. The kernel is decode_fp4_gluon's structure
with fp8's operands (its docstring explains the orientation, the warps and the softmax):

- Orientation. S^T [tokens, query heads] = K Q^T (tokens are mma.m16n8k16's M, the GQA group its N,
  padded to 8) and O^T [head_dim, heads] = V^T P^T.
- The K operand. A thread (lane 4 g + t) holds, for rows (tokens) g and g + 8, the k pairs
  16 j + 8 hh + 2 t + (0, 1) of each of the 8 k steps: 32 values per row. Which head dimension sits
  at which k is free as long as Q^T is permuted alike, so thread t takes bytes 32 t .. 32 t + 31 of
  the row (two 16-byte loads): k = 16 j + 8 hh + 2 t + x is head dimension 32 t + 4 j + 2 hh + x,
  and each 32-bit word widens to the k step's two pairs as it is.
- The V operand. V^T's k is the token, so a pair is two tokens' same byte. Thread (g, t) takes bytes
  16 g .. 16 g + 15 (one 16-byte load) of tokens 2 t, 2 t + 1, 2 t + 8, 2 t + 9; a prmt interleaves two
  tokens' words byte by byte before each widening. Row 16 i + 8 hr + g of V^T is head dimension
  16 g + 2 i + hr (the output rows are permuted back when stored, as in the fp4 kernel).
- Scales. A key's scale multiplies its scores (with the softmax scale and the query's power of two:
  the query goes to fp16 times a power of two, _query_scale). A value's scale joins its score as
  log2(scale), so the probabilities reach the PV MMA weighted by it and at most 1 (exact to fp16's
  11 bits relative to the largest term whatever the values' magnitudes); the sums take it back.
- Loads. No shared memory: each warp loads its 16 tokens of a 64-token tile into registers, the loads
  of the next PREFETCH (1 or 2) whole tiles issued before the current one is attended, so they fly while
  it computes (prefetch_for picks the build per launch). The partial tile, if any, is attended first.
- fp8 keys with fp4 values (V_FP4, kv_cache_dtype fp8-fp4): the values go through decode_fp4_gluon's value
  operand and fp16 map (its V_LOAD, group scales and the per-vector exponent folded into the softmax max);
  decode_attention takes it by the rule while FP8_FP4_GLUON (on).

Scope: head_dim 128, at most 8 query heads per KV head, pages of a multiple of 16 tokens, E4M3 arrays
16-byte aligned (the 16-byte loads), fp4 value codes 8-byte aligned, scales 4-byte aligned, fp4 values
in groups of 32 without slots; decode_attention runs the Triton fp8 kernel (fp8 values) or the generic
kernel (fp4 values) otherwise (`unsupported` says why). Gluon does not run under the interpreter: the CPU tests
check the launcher's choices, tests/test_kernels_fp8_gluon.py checks the kernel against the reference
on a GPU, experiments/kernel_sass.py compiles it for sm_90 on any machine.
"""

from __future__ import annotations

import torch

from app.kernels import decode_fp4_gluon, fp4, paged
from app.kernels.decode_fp4_gluon import AVAILABLE, N_HEADS, TW, W

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from app.kernels.decode_fp4_gluon import (_as_f16_pairs, _masked_load, _query_scale, _tile_base, load_index,
                                              program_split, store_output)
    from app.kernels.decode_fp4_gluon import _value_operand as _fp4_value_operand

# One word of E4M3 bytes ($2) -> fp16 pairs of bytes (0, 1) ($0) and (2, 3) ($1).
_K8_PTX = """
{
  .reg .b16 x0, x1;
  mov.b32 {x0, x1}, $2;
  cvt.rn.f16x2.e4m3x2 $0, x0;
  cvt.rn.f16x2.e4m3x2 $1, x1;
}
"""

# Words of the same 4 bytes of tokens a ($4) and b ($5) -> fp16 pairs (a, b) of byte 0 ($0), 1 ($1),
# 2 ($2) and 3 ($3): prmt 0x5140 makes the word a0 b0 a1 b1, 0x7362 a2 b2 a3 b3.
_V8_PTX = """
{
  .reg .b32 x;
  .reg .b16 x0, x1;
  prmt.b32 x, $4, $5, 0x5140;
  mov.b32 {x0, x1}, x;
  cvt.rn.f16x2.e4m3x2 $0, x0;
  cvt.rn.f16x2.e4m3x2 $1, x1;
  prmt.b32 x, $4, $5, 0x7362;
  mov.b32 {x0, x1}, x;
  cvt.rn.f16x2.e4m3x2 $2, x0;
  cvt.rn.f16x2.e4m3x2 $3, x1;
}
"""


def layouts() -> dict:
    """The kernel's layouts (warp tiles of TW = 16 tokens); lane = 4 g + t as in mma.m16n8k16."""
    lin = decode_fp4_gluon._linear
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    return dict(
        MMA=mma,
        A_OP=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B_OP=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        # K words [W, 16 tokens, 4 (t), 8 words]: thread (g, t) holds bytes 32 t.. of tokens g, g + 8
        K_LOAD=lin([[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 8, 0, 0]],
                   [[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], [W, TW, 4, 8]),
        # V words of the first token of each pair [W, 8 pairs, 8 (g), 4 words]: thread (g, t) holds bytes
        # 16 g.. of tokens 2 t and 2 t + 8 (the pair's second token is the next row)
        V_LOAD=lin([[0, 0, 0, 1], [0, 0, 0, 2], [0, 4, 0, 0]],
                   [[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]], [W, TW // 2, 8, 4]),
        # fp4 values (V_FP4): decode_fp4_gluon's V code words [W, 8 pairs, 8 (g), 2 words], bytes 8 g.. of
        # tokens 2 t and 2 t + 8
        V4_LOAD=decode_fp4_gluon.layouts()["V_LOAD"],
    )


if AVAILABLE:
    _K8_PTX_C: gl.constexpr = gl.constexpr(_K8_PTX)
    _V8_PTX_C: gl.constexpr = gl.constexpr(_V8_PTX)

    @gluon.jit
    def _key_operand(kw, A_OP: gl.constexpr):
        """K words [W, TW, 4 (t), 8 (j)] -> K [W, TW, 128] fp16 in the A-operand layout, k = 16 j + 8 hh + 2 t + x
        holding head dimension 32 t + 4 j + 2 hh + x."""
        WN: gl.constexpr = kw.shape[0]
        R: gl.constexpr = kw.shape[1]
        lo, hi = gl.inline_asm_elementwise(_K8_PTX_C, "=r,=r,r", [kw], dtype=(gl.int32, gl.int32), is_pure=True,
                                           pack=1)
        k = gl.join(_as_f16_pairs(lo), _as_f16_pairs(hi))  # [W, TW, t, j, x, hh]
        k = gl.permute(k, [0, 1, 3, 5, 2, 4])  # [W, TW, j, hh, t, x]
        return gl.convert_layout(gl.reshape(k, [WN, R, 128]), A_OP, assert_trivial=True)

    @gluon.jit
    def _value_operand(ca, cb, A_OP: gl.constexpr):
        """V words of tokens 2 p and 2 p + 1 [W, TW/2, 8 (g), 4 (w)] -> V^T [W, 128, TW] fp16 in the A-operand
        layout: row 16 i + 8 hr + g holds head dimension 16 g + 2 i + hr (byte c = 4 w + 2 ib + hr of the
        thread's 16, i = 2 w + ib), column the token."""
        WN: gl.constexpr = ca.shape[0]
        P2: gl.constexpr = ca.shape[1]
        b0, b1, b2, b3 = gl.inline_asm_elementwise(_V8_PTX_C, "=r,=r,=r,=r,r,r", [ca, cb],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
        v = gl.join(gl.join(_as_f16_pairs(b0), _as_f16_pairs(b1)), gl.join(_as_f16_pairs(b2), _as_f16_pairs(b3)))
        # [W, p, g, w, y, hr, ib]: byte 4 w + 2 ib + hr of token 2 p + y
        v = gl.reshape(v, [WN, P2 // 4, 4, 8, 4, 2, 2, 2])  # p = 4 z + t
        v = gl.permute(v, [0, 4, 7, 6, 3, 1, 2, 5])  # [W, w, ib, hr, g, z, t, y]
        return gl.convert_layout(gl.reshape(v, [WN, 128, 2 * P2]), A_OP, assert_trivial=True)

    @gluon.jit
    def _load_tile(n0, end, bt_row, h, pages, idx, BS: gl.constexpr, H: gl.constexpr, TW: gl.constexpr,
                   OFF64: gl.constexpr, MASKED: gl.constexpr, V_FP4: gl.constexpr):
        """One tile's words and scales into registers: K words [W, TW, 4, 8] (K_LOAD), key scales [W, TW] (rows
        of S^T), V words of each pair's two tokens [W, TW/2, 8, 4] (V_LOAD) and the value scales [W, TW] (sa, sb
        repeat them). V_FP4 (fp4 values): V code words [W, TW/2, 8, 2] (decode_fp4_gluon's V_LOAD), the
        values' scale_exp bytes [W, TW] in place of their scales, and their group scale bits sa, sb [W, TW/2, 8].
        MASKED: tokens at or past `end` load zeros (scale 1)."""
        D: gl.constexpr = 128
        i32: gl.constexpr = gl.pointer_type(gl.int32)
        kv, ksc, v0, v1, v2 = pages
        w_k, r_k, off_k, w_s, r_s, w_v, p_v, off_v, off_vs = idx
        base_k = _tile_base(bt_row, n0 + TW * w_k, end, BS, H, h, OFF64, MASKED)  # [W, 1, 1]
        mk = gl.expand_dims(n0 + TW * w_k + r_k < end, 3)  # [W, TW, 1, 1]
        kw = _masked_load(kv.to(i32) + gl.expand_dims(base_k * (D // 4), 3) + off_k, mk, MASKED)
        base_s = _tile_base(bt_row, n0 + TW * w_s, end, BS, H, h, OFF64, MASKED)  # [W, 1]
        rows_s = base_s + r_s * H
        ms = n0 + TW * w_s + r_s < end  # [W, TW]
        if MASKED:
            ks = gl.load(ksc + rows_s, mask=ms, other=1.0)
        else:
            ks = gl.load(ksc + rows_s)
        if V_FP4:
            vs = _masked_load(v2 + rows_s, ms, MASKED).to(gl.int32)  # scale_exp
            ROW: gl.constexpr = D // 8  # words of a code row
        else:
            if MASKED:
                vs = gl.load(v1 + rows_s, mask=ms, other=1.0)
            else:
                vs = gl.load(v1 + rows_s)
            ROW: gl.constexpr = D // 4
        base_v = _tile_base(bt_row, n0 + TW * w_v, end, BS, H, h, OFF64, MASKED)  # [W, 1, 1]
        pa = v0.to(i32) + gl.expand_dims(base_v * ROW, 3) + off_v
        mva = n0 + TW * w_v + 2 * p_v < end  # [W, TW/2, 1]
        mvb = n0 + TW * w_v + 2 * p_v + 1 < end
        ca = _masked_load(pa, gl.expand_dims(mva, 3), MASKED)
        cb = _masked_load(pa + H * ROW, gl.expand_dims(mvb, 3), MASKED)
        if V_FP4:  # a token's 4 group scale bytes; lane group g reads group g // 2
            psa = v1 + base_v * 4 + off_vs
            sa = _masked_load(psa, mva, MASKED).to(gl.int32)
            sb = _masked_load(psa + H * 4, mvb, MASKED).to(gl.int32)
        else:
            sa = vs
            sb = vs
        return kw, ks, vs, ca, cb, sa, sb

    @gluon.jit
    def _attend_tile(n0, end, m_i, l_i, acc, qt, k_factor, kw, ks, vs, ca, cb, sa, sb, w_s, r_s, TW: gl.constexpr,
                     MASKED: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V_FP4: gl.constexpr):
        """One tile (_load_tile's registers): each warp's 16 tokens n0 + TW w + r with its own online softmax (base 2)
        state: m_i [W, NH], per-thread partial sums l_i [W, TW, NH], O^T acc [W, D, NH]. m_i is the running max of
        score + log2 of the token's value factor (fp8: its scale; fp4: 2^(scale_exp - 121), decode_fp4_gluon's
        fp16 map, whose V operand is value x 2^-6 x group scale)."""
        s = mma_v2(_key_operand(kw, A_OP), qt, gl.zeros_like(l_i))
        s = s * gl.expand_dims(ks * k_factor, 2)
        if V_FP4:
            evc = gl.minimum(vs, 246)
            s = s + gl.expand_dims((evc | 0x4B000000).to(gl.float32, bitcast=True) - (8388608.0 + 121.0), 2)
            inv_fv = ((248 - evc) << 23).to(gl.float32, bitcast=True)  # 2^(121 - scale_exp)
        else:
            fv = gl.maximum(vs, 1e-30)
            s = s + gl.expand_dims(gl.log2(fv), 2)
        if MASKED:
            s = gl.where(gl.expand_dims(n0 + TW * w_s + r_s < end, 2), s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a column with no token yet
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = m_new
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))  # probability x the value's factor, at most 1
        if V_FP4:
            l_i = l_i * gl.expand_dims(alpha, 1) + p * gl.expand_dims(inv_fv, 2)
        else:
            l_i = l_i * gl.expand_dims(alpha, 1) + p / gl.expand_dims(fv, 2)
        pt = gl.convert_layout(p.to(gl.float16), B_OP)
        if V_FP4:
            vt = _fp4_value_operand(ca, cb, sa, sb, A_OP, True)
        else:
            vt = _value_operand(ca, cb, A_OP)
        acc = mma_v2(vt, pt, acc * gl.expand_dims(alpha, 1))
        return m_new, l_i, acc

    @gluon.jit(do_not_specialize=("split_size", "num_splits"))  # as decode_attention.SPLIT_ARGS
    def _decode_fp8_gluon_kernel(
        q_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        k_vals, k_scale, v0, v1, v2,
        block_tables_ptr, seq_lens_ptr,
        sm_scale_log2, stride_q_seq, stride_q_head, stride_bt, split_size, num_splits,
        H: gl.constexpr, GROUP: gl.constexpr, BS: gl.constexpr, SPLIT: gl.constexpr, TW: gl.constexpr,
        MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr,
        OFF64: gl.constexpr, PREFETCH: gl.constexpr, V_FP4: gl.constexpr,
    ):
        """v0, v1, v2: the values' E4M3 array, scales and (unused) scales again; V_FP4: their fp4 codes, group
        scales and scale_exp (V_LOAD then decode_fp4_gluon's)."""
        gl.static_assert(PREFETCH >= 0 and PREFETCH <= 2, "PREFETCH: whole tiles in flight ahead, 0-2")
        D: gl.constexpr = 128
        WN: gl.constexpr = 4
        NH: gl.constexpr = 8
        h = gl.program_id(0)
        b = gl.program_id(1)
        sp = gl.program_id(2)
        start, end = program_split(seq_lens_ptr, b, sp, split_size, num_splits, WN * TW)
        bt_row = block_tables_ptr + b.to(gl.int64) * stride_bt
        q_base = q_ptr + b.to(gl.int64) * stride_q_seq + (h * GROUP) * stride_q_head
        tile = WN * TW
        full_end = start + (gl.maximum(end - start, 0) // tile) * tile

        # index vectors in each layout
        S_ROW: gl.constexpr = gl.SliceLayout(2, MMA)  # [WN, TW] rows of S^T
        w_s = gl.expand_dims(gl.arange(0, WN, layout=gl.SliceLayout(1, S_ROW)), 1)
        r_s = gl.expand_dims(gl.arange(0, TW, layout=gl.SliceLayout(0, S_ROW)), 0)
        w_k, r_k, t_k, j_k = load_index(K_LOAD)  # warp, token, thread t's 32 bytes, word
        w_v, p_v, g_v, c_v = load_index(V_LOAD)  # warp, token pair, lane group g's bytes, word
        CW: gl.constexpr = V_LOAD.shape[3]  # words per lane group and token: 4 (fp8), 2 (fp4 values)
        off_k = gl.expand_dims(r_k * (H * (D // 4)) + 8 * t_k, 3) + j_k  # words within a tile's row block
        if V_FP4:  # code rows of 16 words; a token's 4 group scale bytes, lane group g reads group g // 2
            off_v = gl.expand_dims(2 * p_v * (H * (D // 8)) + CW * g_v, 3) + c_v  # token 2 pair, bytes 8 g..
            off_vs = 2 * p_v * (H * 4) + g_v // 2
        else:
            off_v = gl.expand_dims(2 * p_v * (H * (D // 4)) + CW * g_v, 3) + c_v  # token 2 pair, bytes 16 g..
            off_vs = p_v
        idx = (w_k, r_k, off_k, w_s, r_s, w_v, p_v, off_v, off_vs)
        pages = (k_vals, k_scale, v0, v1, v2)

        # The first PREFETCH whole tiles' loads (masked: none past the whole tiles) go out before the query is read
        if PREFETCH >= 1:
            kw, ks, vs, ca, cb, sa, sb = _load_tile(start, full_end, bt_row, h, pages, idx, BS, H, TW, OFF64, True, V_FP4)
        if PREFETCH == 2:
            kw1, ks1, vs1, ca1, cb1, sa1, sb1 = _load_tile(start + tile, full_end, bt_row, h, pages, idx, BS, H, TW, OFF64, True,
                                                           V_FP4)

        # Q^T [WN, 128, NH] as the B operand (every warp the whole query), k permuted as _key_operand's:
        # dim = 32 t + 4 j + 2 hh + x for k = 16 j + 8 hh + 2 t + x; in fp16 times _query_scale's power of two f
        # (computed from a [D, heads] load, a thread per dimension)
        QL: gl.constexpr = gl.BlockedLayout([1, NH], [32, 1], [WN, 1], [1, 0])
        dq = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, QL)), 1)
        nq2 = gl.expand_dims(gl.arange(0, NH, layout=gl.SliceLayout(0, QL)), 0)
        qv = gl.load(q_base + nq2 * stride_q_head + dq, mask=(nq2 < GROUP) & (dq >= 0), other=0.0).to(gl.float32)
        f = _query_scale(qv)
        kq = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_OP)))
        nq = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_OP)))
        dim_k = 32 * ((kq >> 1) & 3) + 4 * (kq >> 4) + 2 * ((kq >> 3) & 1) + (kq & 1)
        wq = gl.arange(0, WN, layout=gl.SliceLayout(1, gl.SliceLayout(2, B_OP)))
        q_off = (gl.expand_dims(gl.expand_dims(dim_k, 0), 2) + gl.expand_dims(gl.expand_dims(nq * stride_q_head, 0), 1)
                 + gl.expand_dims(gl.expand_dims(wq * 0, 1), 2))
        q_mask = gl.expand_dims(gl.expand_dims(nq < GROUP, 0), 1) & (q_off >= 0)
        qf = gl.load(q_base + q_off, mask=q_mask, other=0.0)
        qt = (qf.to(gl.float32) * f).to(gl.float16)
        k_factor = sm_scale_log2 / f

        m_i = gl.full([WN, NH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.zeros([WN, TW, NH], gl.float32, layout=MMA)  # per-thread partial sums, reduced at the end
        acc = gl.zeros([WN, D, NH], gl.float32, layout=MMA)  # O^T per warp
        if full_end < end:  # the partial tile first: every later tile is whole, unmasked
            t = _load_tile(full_end, end, bt_row, h, pages, idx, BS, H, TW, OFF64, True, V_FP4)
            m_i, l_i, acc = _attend_tile(full_end, end, m_i, l_i, acc, qt, k_factor, t[0], t[1], t[2], t[3], t[4], t[5],
                                         t[6], w_s, r_s, TW, True, A_OP, B_OP, V_FP4)
        if PREFETCH == 2:
            # tiles n0 and n0 + tile are in registers (or in flight); tile n0 + 2 tile's loads go out before n0 is attended
            for n0 in range(start, full_end - 2 * tile, tile):
                t = _load_tile(n0 + 2 * tile, end, bt_row, h, pages, idx, BS, H, TW, OFF64, False, V_FP4)
                m_i, l_i, acc = _attend_tile(n0, end, m_i, l_i, acc, qt, k_factor, kw, ks, vs, ca, cb, sa, sb, w_s, r_s,
                                             TW, False, A_OP, B_OP, V_FP4)
                kw, ks, vs, ca, cb, sa, sb = kw1, ks1, vs1, ca1, cb1, sa1, sb1
                kw1, ks1, vs1, ca1, cb1, sa1, sb1 = t[0], t[1], t[2], t[3], t[4], t[5], t[6]
            if full_end - start >= 2 * tile:  # the last two whole tiles
                m_i, l_i, acc = _attend_tile(full_end - 2 * tile, end, m_i, l_i, acc, qt, k_factor, kw, ks, vs, ca, cb,
                                             sa, sb, w_s, r_s, TW, False, A_OP, B_OP, V_FP4)
                m_i, l_i, acc = _attend_tile(full_end - tile, end, m_i, l_i, acc, qt, k_factor, kw1, ks1, vs1, ca1, cb1,
                                             sa1, sb1, w_s, r_s, TW, False, A_OP, B_OP, V_FP4)
            elif full_end > start:  # the only whole tile
                m_i, l_i, acc = _attend_tile(start, end, m_i, l_i, acc, qt, k_factor, kw, ks, vs, ca, cb, sa, sb, w_s,
                                             r_s, TW, False, A_OP, B_OP, V_FP4)
        elif PREFETCH == 1:
            # tile n0 is in registers; tile n0 + tile's loads go out before it is attended
            for n0 in range(start, full_end - tile, tile):
                t = _load_tile(n0 + tile, end, bt_row, h, pages, idx, BS, H, TW, OFF64, False, V_FP4)
                m_i, l_i, acc = _attend_tile(n0, end, m_i, l_i, acc, qt, k_factor, kw, ks, vs, ca, cb, sa, sb, w_s, r_s,
                                             TW, False, A_OP, B_OP, V_FP4)
                kw, ks, vs, ca, cb, sa, sb = t[0], t[1], t[2], t[3], t[4], t[5], t[6]
            if full_end > start:
                m_i, l_i, acc = _attend_tile(full_end - tile, end, m_i, l_i, acc, qt, k_factor, kw, ks, vs, ca, cb, sa, sb,
                                             w_s, r_s, TW, False, A_OP, B_OP, V_FP4)
        else:
            for n0 in range(start, full_end, tile):
                t = _load_tile(n0, end, bt_row, h, pages, idx, BS, H, TW, OFF64, False, V_FP4)
                m_i, l_i, acc = _attend_tile(n0, end, m_i, l_i, acc, qt, k_factor, t[0], t[1], t[2], t[3], t[4], t[5],
                                             t[6], w_s, r_s, TW, False, A_OP, B_OP, V_FP4)

        # merge the warps' states
        l_w = gl.sum(l_i, 1)  # [WN, NH]
        m_all = gl.max(m_i, 0)  # [NH]
        m_all_use = gl.where(m_all == float("-inf"), 0.0, m_all)
        wgt = gl.exp2(m_i - gl.expand_dims(m_all_use, 0))  # [WN, NH]
        l_tot = gl.sum(l_w * wgt, 0)  # [NH]
        empty = l_tot == 0.0  # an empty split (past this sequence's end) writes lse -inf and zeros
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_tot))
        o = gl.sum(acc * gl.expand_dims(wgt * gl.expand_dims(inv, 0), 1), 0)  # [D, NH]
        store_output(o, m_all, l_tot, empty, out_ptr, part_o_ptr, part_lse_ptr, b, h, sp, num_splits, H, GROUP, SPLIT)


def fp4_values(v_pages) -> bool:
    """Whether V pages are fp4 (kv_cache_dtype fp8-fp4: fp8 keys, fp4 values), else fp8."""
    return isinstance(v_pages, fp4.FP4Tensor)


def unsupported(query, k_pages, v_pages, block_size: int, v_format=None) -> str | None:
    """Why this kernel cannot run a decode (None: it can). Its scope: fp8 K pages with fp8 V pages or fp4 V pages
    in groups of 32 without outlier slots (v_format, their FP4Format), head_dim 128, at most 8 query heads per KV
    head, pages of a multiple of the warp tile, E4M3 arrays 16-byte, fp4 codes 8-byte and scales 4-byte aligned
    (the vector loads); Gluon, on CUDA sm_89+ (the E4M3 conversion)."""
    k_vals, k_scale = k_pages
    num_kv_heads, head_dim = k_vals.shape[2], query.shape[-1]
    if head_dim != 128:
        return f"head_dim {head_dim} (needs 128)"
    if query.shape[1] // num_kv_heads > N_HEADS:
        return f"more than {N_HEADS} query heads per KV head"
    if block_size % TW:
        return f"block_size {block_size} not a multiple of {TW}"
    if fp4_values(v_pages):
        if v_format is None or v_format.group(head_dim) != 32 or v_format.outliers:
            return "fp4 values other than groups of 32 without outlier slots"
        if v_pages.codes.data_ptr() % 8:
            return "fp4 value codes not 8-byte aligned (read by 8-byte loads)"
        if k_vals.data_ptr() % 16:
            return "E4M3 arrays not 16-byte aligned (read by 16-byte loads)"
        if k_scale.data_ptr() % 4:
            return "scales not 4-byte aligned"
    else:
        v_vals, v_scale = v_pages
        if k_vals.data_ptr() % 16 or v_vals.data_ptr() % 16:
            return "E4M3 arrays not 16-byte aligned (read by 16-byte loads)"
        if k_scale.data_ptr() % 4 or v_scale.data_ptr() % 4:
            return "scales not 4-byte aligned"
    return decode_fp4_gluon.runtime_unsupported(query.device, (8, 9), "cvt.f16x2.e4m3x2 needs sm_89+")


def _value_args(v_pages) -> tuple:
    """The kernel's three value pointers: (E4M3 values, scales, scales) or fp4's (codes, group scales as bytes,
    scale_exp)."""
    if fp4_values(v_pages):
        return v_pages.codes, v_pages.scales.view(torch.uint8), v_pages.scale_exp
    return v_pages[0], v_pages[1], v_pages[1]


# Whole tiles in flight ahead of the one attended (the PREFETCH build): 1 unless a launch's programs all fit on the
# SMs at once (at most PREFETCH_2_PROGRAMS_PER_SM each), where 2 (each program is a chain of memory round
# trips there, with nothing else on its SM to overlap them; the build takes ~190 registers, 2 programs per SM).
# 0 (each tile loaded where it is attended, ~100 registers) is a DecodeOptions choice for measurements. On an H100
# (bench/RESULTS.md, "The fp8 kernel's builds") the rule's build was the fastest or within 1% in each of 10 rows:
# 2 ahead 0-4% faster than 1 at the smallest launches, 1 ahead 1.14x faster than 2 at 8B batch 8; 0 ahead up to
# 1.45x slower than either.
PREFETCH = 1
PREFETCH_2_PROGRAMS_PER_SM = 2
PLAN_PROGRAMS_PER_SM = 4  # as decode_fp4_gluon's: programs per SM that the split plan counts at most
_LAYOUTS: dict = {}
_RESOURCES: dict = {}


def prefetch_for(programs: int, sms: int) -> int:
    """The PREFETCH build for a launch of `programs` programs on `sms` SMs (the rule above)."""
    return 2 if programs <= PREFETCH_2_PROGRAMS_PER_SM * sms else PREFETCH


def constexprs(query, k_pages, v_pages, prefetch: int = PREFETCH) -> dict:
    """A build's constexprs and launch options for this decode."""
    if not _LAYOUTS:
        _LAYOUTS.update(layouts())
    k_vals, v_main = k_pages[0], _value_args(v_pages)[0]
    num_kv_heads = k_vals.shape[2]
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2 whole tiles ahead (got {prefetch!r})")
    v4 = fp4_values(v_pages)
    return dict(H=num_kv_heads, GROUP=query.shape[1] // num_kv_heads, BS=k_vals.shape[1], TW=TW,
                OFF64=max(k_vals.numel(), v_main.numel()) >= 2 ** 31, PREFETCH=prefetch, V_FP4=v4, num_warps=W,
                **{k: v for k, v in _LAYOUTS.items() if k not in ("V_LOAD", "V4_LOAD")},
                V_LOAD=_LAYOUTS["V4_LOAD" if v4 else "V_LOAD"])


def programs_per_sm(query, k_pages, v_pages, block_tables, seq_lens, const: dict) -> int:
    """Programs of this build resident per SM (at most PLAN_PROGRAMS_PER_SM), from its compiled registers,
    compiled once per build: it sets the split count, so that the grid fills whole waves."""
    key = (query.device, query.dtype, block_tables.dtype, seq_lens.dtype,
           *(const.get(k) for k in ("H", "GROUP", "BS", "OFF64", "PREFETCH", "V_FP4", "maxnreg")))
    if key not in _RESOURCES:
        part = torch.empty(1, dtype=torch.float32, device=query.device)
        kernel = _decode_fp8_gluon_kernel.warmup(
            query, query, part, part, *k_pages, *_value_args(v_pages), block_tables, seq_lens, 1.0, query.stride(0),
            query.stride(1), block_tables.stride(0), 128, 2, SPLIT=True, grid=(1,), **const)
        kernel._init_handles()
        regs = -(-kernel.n_regs // 8) * 8  # allocated in steps of 8 per thread
        _RESOURCES[key] = max(1, min(PLAN_PROGRAMS_PER_SM, 65536 // (regs * 32 * W)))
    return _RESOURCES[key]


def launch(query, k_pages, v_pages, block_tables, seq_lens, sm_scale_log2: float, out, part_o, part_lse,
           split_size: int, num_splits: int, const: dict) -> None:
    """Launch over (KV head, sequence, split); split_size (a multiple of W * TW) is the longest split."""
    _decode_fp8_gluon_kernel[(k_pages[0].shape[2], query.shape[0], num_splits)](
        query, out, part_o, part_lse, *k_pages, *_value_args(v_pages), block_tables, seq_lens, sm_scale_log2, query.stride(0),
        query.stride(1), block_tables.stride(0), split_size, num_splits, SPLIT=num_splits > 1, **const)
