"""fp4 flash-decoding in Gluon: the unpack written against the tensor cores' register layout.

The Triton kernel (_decode_fp4_kernel) leaves the layouts to the compiler, which loads code bytes in
a coalesced layout, moves them through shared memory into the MMA operand layout and runs the
softmax over 16 padded query rows. Here every tensor has an explicit layout (Gluon, Triton's
layout-level language), chosen so that nothing moves between threads except the probabilities:

- Orientation. Scores are computed transposed, S^T [tokens, query heads] = K Q^T, so tokens are the
  MMA's M (16 per warp tile) and the query heads its N (8: a whole GQA group of Llama-3 8B or 70B,
  padded from 4 to 8 at most instead of to 16). The output is O^T [head_dim, heads] = V^T P^T.
- The K operand. mma.m16n8k16 gives each thread, per row, the k pairs (2t, 2t+1) and (2t+8, 2t+9)
  of each 16-wide k step. Which head dimension sits at which k is free as long as Q^T is permuted
  alike, so thread t takes bytes 16t..16t+15 of the row's 64 code bytes (one 16-byte load), and a
  k pair is one nibble of two adjacent bytes: the PTX unpack's output registers go to the tensor
  cores as they are. With groups of 32 the thread's 32 values share one E4M3 scale; with key groups
  of 8 (KG8, a format without key outlier slots that spends their bytes on scales: 81 bytes per key
  vector either way) each of its 4 code words has its own, the token's 16 scale bytes one 16-byte copy.
- The V operand. V^T's k is the token, so a pair is two tokens' same nibble. The rows (head
  dimensions) are free again: lane group g takes bytes 8g..8g+7 of each token (one 8-byte load),
  and one prmt pairs two tokens' bytes before the same unpack. The output rows are permuted back
  when stored.
- Warps. Each of the 4 warps walks its own 16 tokens of every 64-token tile with its own online
  softmax (max, sum, O^T); the four states merge once at the end. The probabilities change from
  the MMA result layout to the operand layout within a warp (shuffles). Whole tiles run without
  masks, the last one with them.
- Tile pairs (PAIR). With at most 4 query heads per KV head (Llama-3 8B), half of the MMA's 8
  columns are padding, and so is half of the softmax, the key outlier slots' arithmetic and O^T's
  rescale, which run on those columns. Paired, a warp's 16 tokens of two tiles share one pass: the
  scores of tile A in columns 0-3 and of tile B in columns 4-7 (two MMA chains against the query
  placed in both halves, one select), each column its own online softmax state, O^T += V_A^T P_A^T +
  V_B^T P_B^T with each tile's probabilities in its own columns; the states of columns c and c + 4
  merge at the end (a lane shuffle: in mma.m16n8's layout they sit in lanes t and t ^ 2). A lane
  takes its half's per-token words (scales, exponents, outlier slots) with one select (_lane_half).
  Loop instructions per (token, KV head) 37.7 -> 30.05 at the 8B shape (Triton 3.6). The ring then
  holds two pairs, so a pair's copies fly while the pair before is attended (one tile pair ahead,
  where single tiles have two to three): splits of fewer than PAIR_MIN_TILES whole tiles keep single
  tiles, chosen per program from its own length (docs/history.md, the fp4 kernel's fifteenth step); a
  launch whose planned splits are all shorter runs the single-tile build (Launch.constexprs_for). A pair
  waits on one barrier: with Triton < 3.9 each array of a set takes the pair's two tiles as one copy
  (_copy_pair; two copies into one allocation made Triton 3.6's Membar pass put a second barrier
  between them, as it does not tell an allocation's stages apart; 3.9 does, and copies tile by tile),
  which needs K codes (and KG8's key scale rows) 16-byte and V codes and key outlier values 8-byte
  aligned (else single tiles).
  Triton 3.9 cannot fit the paired kernel with key slots in PAIR_MAXNREG registers (it spills):
  Launch then runs single tiles (_settle_pair).
- Code-to-number maps, two ways (F16). bf16: paged._FP4_UNPACK_BODY's shifts and masks put each code
  into bf16 bits and one bf16x2 multiply per pair applies the group scale (and the bias). fp16: a code
  (s, e1 e0, m) placed as the byte s.00e1e0.m00 is E4M3 for its value x 2^-6, so shifts and masks
  make E4M3 words of 4 codes (7 instructions per 8 codes), the hardware's cvt.f16x2.e4m3x2 widens two
  codes at a time and an fp16x2 multiply applies the scale; the query goes to fp16 scaled by a power
  of two, and the probabilities to fp16 with each token's value exponent folded into the softmax max
  (so they are at most 1 whatever the values' magnitudes). Fewer instructions, longer dependency
  chains; fp16 is the default (F16_DEFAULT), whatever the batch, so that a sequence's result does not
  depend on the batch it runs in.
- Loads, two ways (STAGES). 0: each tile's words are loaded into registers where they are used; the
  loop has no shared memory and no barrier. 4: a ring of 4 tiles in shared memory that cp.async
  fills 3 tiles ahead of the one attended, 2 still in flight when it is read (39 KiB per program);
  the loop reads its tile from shared memory, with one barrier per tile, and attends the partial
  tile first so that every copy in the loop is unmasked. The ring is the default (measured faster in
  27 of 32 rows). It is two allocations (even and odd tiles, STAGES / 2 each) and the loop is
  unrolled over an even and an odd tile, so a tile's reads and the copies issued beside them touch
  different allocations: with one allocation indexed by a dynamic stage the compiler added a second
  barrier per tile before the copies. Order within a program (ncu on the H200 named what waited):
  the ring's first copies go out before the query is read, so its loads overlap theirs; in the loop
  a tile's key outlier gathers (global loads from the transposed query, L1 evict-last) are issued
  before that step's copies (of the tile 3 ahead) and the copies before the softmax and PV product,
  because gathers queued behind copies were the loop's most stalled wait.
- Pages. A warp tile's 16 tokens share a page, so a thread reads one block-table entry per tile
  and layout (three: K, scores, V) and addresses its tokens as base row + r x num_kv_heads.

Scope: head_dim 128, K groups of 32 with 0 or 4 key outlier slots (the engine's default format has 4)
or K groups of 8 without (KG8, on the cp.async ring only), V groups of 32 without slots, at most 8 query
heads per KV head, pages of a multiple of 16 tokens; decode_attention runs the Triton kernels otherwise
(`unsupported` says why). Gluon does not run
under the interpreter: tests/test_kernels_gluon.py compiles it for sm_90 on any machine and checks
it against the reference on a GPU; bench/kernel_timings.py times it, experiments/kernel_sass.py counts its loop.
"""

from __future__ import annotations

import re

import torch

from app.kernels import paged

try:  # Gluon ships with Triton >= 3.5; without it decode_attention uses the Triton kernels
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.runtime.jit import constexpr_function

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6
    # cp.async: async_copy_global_to_shared in Triton 3.6, async_load from 3.7 (the old name then raises)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _commit_group = async_copy.commit_group
    _wait_group = async_copy.wait_group

    @constexpr_function
    def _pair_layout(layout):
        """A copy layout [W, ...] (a DistributedLinearLayout) -> the same with a leading dim of 2 (a pair's
        two tiles) held in each thread's registers after the layout's own register bases."""
        def z(b):
            return [0] + list(b)
        return gl.DistributedLinearLayout(reg_bases=[z(b) for b in layout.reg_bases] + [[1] + [0] * len(layout.shape)],
                                          lane_bases=[z(b) for b in layout.lane_bases],
                                          warp_bases=[z(b) for b in layout.warp_bases], block_bases=[],
                                          shape=[2] + list(layout.shape))

    @constexpr_function
    def _pair_first(rank):
        """The permutation that moves the last of rank + 1 dims (gl.join's) to the front."""
        return [rank] + list(range(rank))

    @constexpr_function
    def _last_dim(rank, n):
        """A per-dim hint of rank dims: n on the last, 1 elsewhere (as constexprs, what the hints take)."""
        return [gl.constexpr(1)] * (rank - 1) + [gl.constexpr(n)]

    @constexpr_function
    def _key_scale_rows(shape, tw):
        """Which key scales a ring set's array of shape `shape` holds (_ring_set): 3 a word per token, 4 key
        groups of 8, 5 key groups of 16 (_pair_sources' KSR)."""
        dims = [getattr(d, "value", d) for d in shape]
        if len(dims) == 4:
            return 4
        return 5 if dims[2] == 4 * getattr(tw, "value", tw) else 3

    @constexpr_function
    def _row_major(rank):
        """An unswizzled row-major shared layout of rank dims."""
        return gl.SwizzledSharedLayout(1, 1, 1, list(range(rank - 1, -1, -1)))

    @constexpr_function
    def _dims(dims, extra=0):
        """A shape as one constexpr (what a jit function cannot build from a list and pass on): dims (a shape or
        a tuple of dims) and extra if not 0."""
        out = [getattr(d, "value", d) for d in dims] + [getattr(extra, "value", extra)]
        return [d for d in out if d]

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton 3.9's name; 3.6 has _reinterpret

        @gluon.jit
        def _view(buf, shape: gl.constexpr, layout: gl.constexpr):
            return buf.reinterpret(buf.dtype, shape, layout)
    else:

        @gluon.jit
        def _view(buf, shape: gl.constexpr, layout: gl.constexpr):
            return buf._reinterpret(buf.dtype, shape, layout)

    @gluon.jit
    def _reinterpret(buf, layout: gl.constexpr):
        """buf in another shared layout, same shape."""
        return _view(buf, _dims(buf.shape), layout)

    @gluon.jit
    def _reshaped(buf, d0: gl.constexpr, d1: gl.constexpr, d2: gl.constexpr, d3: gl.constexpr = 0):
        """An unswizzled row-major array viewed as [d0, d1, d2] (or [.., d3]) in the same row-major order."""
        shape: gl.constexpr = _dims((d0, d1, d2), d3)
        return _view(buf, shape, _row_major(len(shape)))

    AVAILABLE = True
    # A pair's two tiles as one copy per array (_copy_pair) where the Membar pass would put a barrier between
    # two copies into one allocation: Triton 3.6 does (one barrier per pair more, measured on the H200);
    # 3.9 does not, and there the joined copy only costs (65 loop instructions more at the 8B shape without
    # key slots). Versions between are untested and take the joined copy.
    ONE_COPY_PER_PAIR = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) < (3, 9)
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False
    ONE_COPY_PER_PAIR = False

W = 4  # warps per program
TW = 16  # tokens per warp tile: the MMA's M for the scores, its K for the PV product
N_HEADS = 8  # MMA N: query heads per KV head, padded

# One word of E2M1 code bytes of each of two tokens (a: $8, b: $9) and their group scales as one
# bf16x2 word ($10: bf16_scales) -> eight bf16x2 pairs (token a, token b) of one nibble of one byte:
# $0 lo(byte 0), $1 lo(1), $2 hi(0), $3 hi(1), $4 lo(2), $5 lo(3), $6 hi(2), $7 hi(3). Two prmts
# interleave the tokens' bytes; each interleaved word then goes through paged._FP4_UNPACK_BODY, with
# one bf16x2 scale for all.


def _pair_unpack(word: str, lo0: str, lo1: str, hi0: str, hi1: str) -> str:
    """paged._FP4_UNPACK_BODY reading `word` and writing (lo0, lo1, hi0, hi1), scaled by $10."""
    names = {"$4": word, "$0": lo0, "$1": lo1, "$2": hi0, "$3": hi1, "SCALE01": "$10", "SCALE23": "$10"}
    return re.sub(r"\$\d|SCALE01|SCALE23", lambda m: names[m.group(0)], paged._FP4_UNPACK_BODY)


_V_UNPACK_PTX = ("""
{
  .reg .b32 z, y, t, u, w0, w1;
  mov.b32 z, 0;
  prmt.b32 w0, $8, $9, 0x5140;
  prmt.b32 w1, $8, $9, 0x7362;"""
                 + _pair_unpack("w0", "$0", "$1", "$2", "$3") + _pair_unpack("w1", "$4", "$5", "$6", "$7") + "}\n")

# One word of code bytes of one token ($4) and its bf16x2 scale word ($5) -> (low nibbles of bytes
# 0, 1), (2, 3) as $0, $1 and the high nibbles as $2, $3 (paged._FP4_UNPACK_BODY).
_K_UNPACK_PTX = paged._FP4_UNPACK_PTX.value.replace("$6", "$5")


# F16 (fp16 MMAs), keys: one word of code bytes ($4) and the group scale as an fp16x2 word ($5) ->
# the registers _K_UNPACK_PTX writes, in fp16. A code (s, e1 e0, m) placed as the byte s.00e1e0.m00 is
# E4M3 for its E2M1 value x 2^-6 (the subnormal 0.5 too), so two shifts and masks per 4 codes make E4M3
# words of the low and the high nibbles, the hardware's cvt.f16x2.e4m3x2 widens two bytes at a time,
# and the scale multiplies: code x 2^-6 x scale, exact in fp16 (at most 6 x 448 x 2^-6, at least
# 0.5 x 2^-6 x 2^-6).
_E4M3_OF_WORD = """
  shl.b32 t, {w}, 2; shl.b32 s, {w}, 4; and.b32 t, t, 0x1C1C1C1C; and.b32 s, s, 0x80808080; or.b32 {lo}, t, s;
  shr.b32 t, {w}, 2; and.b32 s, {w}, 0x80808080; and.b32 t, t, 0x1C1C1C1C; or.b32 {hi}, t, s;"""


def _f16_pair(x: str, out0: str, out1: str, scale: str) -> str:
    """The two fp16x2 words of E4M3 word `x` (bytes 0, 1 and 2, 3), times `scale`."""
    return f"""
  mov.b32 {{x0, x1}}, {x};
  cvt.rn.f16x2.e4m3x2 t, x0; mul.rn.f16x2 {out0}, t, {scale};
  cvt.rn.f16x2.e4m3x2 t, x1; mul.rn.f16x2 {out1}, t, {scale};"""


_K16_UNPACK_PTX = ("""
{
  .reg .b32 t, s, lo, hi;
  .reg .b16 x0, x1;""" + _E4M3_OF_WORD.format(w="$4", lo="lo", hi="hi") + _f16_pair("lo", "$0", "$1", "$5")
                   + _f16_pair("hi", "$2", "$3", "$5") + "\n}\n")

# F16, values: code words of tokens a ($8) and b ($9) and their scales as one fp16x2
# word ($10) -> the 8 registers _V_UNPACK_PTX writes, in fp16: each word to E4M3 as in _K16_UNPACK_PTX,
# then one prmt pairs the two tokens' bytes before each widening.
_V16_UNPACK_PTX = ("""
{
  .reg .b32 t, s, la, ha, lb, hb, x;
  .reg .b16 x0, x1;""" + _E4M3_OF_WORD.format(w="$8", lo="la", hi="ha") + _E4M3_OF_WORD.format(w="$9", lo="lb", hi="hb")
                   + "\n  prmt.b32 x, la, lb, 0x5140;" + _f16_pair("x", "$0", "$1", "$10")
                   + "\n  prmt.b32 x, ha, hb, 0x5140;" + _f16_pair("x", "$2", "$3", "$10")
                   + "\n  prmt.b32 x, la, lb, 0x7362;" + _f16_pair("x", "$4", "$5", "$10")
                   + "\n  prmt.b32 x, ha, hb, 0x7362;" + _f16_pair("x", "$6", "$7", "$10") + "\n}\n")


def _linear(reg, lane, shape):
    """A linear layout over [W, ...] with the warps on dim 0 and the given register and lane bases."""
    warps = [[1] + [0] * (len(shape) - 1), [2] + [0] * (len(shape) - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warps, block_bases=[], shape=shape)


def layouts() -> dict:
    """The kernel's layouts (warp tiles of TW = 16 tokens); lane = 4 g + t as in mma.m16n8k16."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    return dict(
        MMA=mma,
        A_OP=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B_OP=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        # K code words [W, 16 tokens, 4 (t), 4 words]: thread (g, t) holds bytes 16t.. of tokens g, g+8
        K_LOAD=_linear([[0, 0, 0, 1], [0, 0, 0, 2], [0, 8, 0, 0]],
                       [[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], [W, TW, 4, 4]),
        # V code words of the first token of each pair [W, 8 pairs, 8 (g), 2 words]: thread (g, t)
        # holds bytes 8g.. of tokens 2t and 2t + 8 (the second token of a pair is the next row)
        V_LOAD=_linear([[0, 0, 0, 1], [0, 4, 0, 0]],
                       [[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]], [W, TW // 2, 8, 2]),
        # cp.async of one word per token [W, TW] (lanes 16-31 repeat 0-15), and of the 2 words of a
        # token's key outlier values [W, TW, 2]
        COPY_ROW=_linear([], [[0, 1], [0, 2], [0, 4], [0, 8], [0, 0]], [W, TW]),
        COPY_ROW2=_linear([[0, 0, 1]], [[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 0, 0]], [W, TW, 2]),
        # the rows of S^T (tokens g, g + 8 of lane 4 g + t) with the 2 outlier value words
        S_ROW2=_linear([[0, 0, 1], [0, 8, 0]], [[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [W, TW, 2]),
        # the V scale words of tokens (2 pair, 2 pair + 1) [W, TW/2, 2] where V_LOAD holds their codes
        V_SCALE2=_linear([[0, 0, 1], [0, 4, 0]], [[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
                         [W, TW // 2, 2]),
    )


if AVAILABLE:

    @gluon.jit
    def _as_bf16_pairs(x):
        """int32 words [...] -> bf16 [..., 2], each word's low and high half: a register reinterpreted
        (Triton has no bitcast that splits an element), so the unpack's words reach the MMA as they are."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(x, x)], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _as_f16_pairs(x):
        """_as_bf16_pairs for fp16 halves."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(x, x)], dtype=gl.float16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _unpack_k(codes, scale, F16: gl.constexpr):
        """codes [W, TW, 4, 4] int32 (bytes 16t + 4w..), bf16x2 scale words [W, TW, 4] (bf16_scales; key groups
        of 8: [W, TW, 4, 4], one per code word) ->
        K [W, TW, 128] bf16 in the A-operand layout, k = 16 j + 8 h + 2 t + x holding head dimension
        32 t + 4 j + 2 x + h (value x scale x 2^-8). F16: fp16x2 scale words (f16_scales) -> K in fp16,
        value x scale x 2^-6 (_K16_UNPACK_PTX)."""
        WN: gl.constexpr = codes.shape[0]
        TW: gl.constexpr = codes.shape[1]
        SR: gl.constexpr = len(scale.shape)
        if SR == 4:  # key groups of 8: one scale per code word
            sw = scale
        else:
            sw = gl.expand_dims(scale, 3).broadcast_to(codes.shape)
        # byte 4w + 2q + e of the thread's 16: nibble of word w, pair q, element e
        if F16:
            lo01, lo23, hi01, hi23 = gl.inline_asm_elementwise(
                _K16_UNPACK_PTX_C, "=r,=r,=r,=r,r,r", [codes, sw], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                is_pure=True, pack=1)
            lo = gl.join(_as_f16_pairs(lo01), _as_f16_pairs(lo23))
            hi = gl.join(_as_f16_pairs(hi01), _as_f16_pairs(hi23))
        else:
            lo01, lo23, hi01, hi23 = gl.inline_asm_elementwise(
                _K_UNPACK_PTX_C, "=r,=r,=r,=r,r,r", [codes, sw], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                is_pure=True, pack=1)
            lo = gl.join(_as_bf16_pairs(lo01), _as_bf16_pairs(lo23))  # [W, TW, 4 t, 4 w, 2 e, 2 q]
            hi = gl.join(_as_bf16_pairs(hi01), _as_bf16_pairs(hi23))
        k = gl.join(lo, hi)  # [W, TW, t, w, e, q, nibble]
        k = gl.permute(k, [0, 1, 3, 5, 6, 2, 4])  # [W, TW, w, q, nibble, t, e]: j = 2 w + q, x = e
        return gl.reshape(k, [WN, TW, 128])

    @gluon.jit
    def bf16_scales(sbits_a, sbits_b):
        """E4M3 scale bits (never subnormal: fp4.py) of two tokens -> one bf16x2 word (scale x 2^118 each),
        the unpack's scale operand: bits x 16 + 0x7700 puts E4M3's fields into bf16's and adds 238 to
        the exponent (paged._FP4_UNPACK_SCALEBITS_PTX)."""
        a = sbits_a.to(gl.int32) * 16 + 0x7700
        b = sbits_b.to(gl.int32) * 16 + 0x7700
        return a | (b << 16)

    @gluon.jit
    def f16_scales(sbits_a, sbits_b):
        """E4M3 scale bits (never subnormal) of two tokens -> one fp16x2 word of the scales themselves:
        bits x 128 puts E4M3's fields into fp16's, and 0x2000 = 8 << 10 adds the bias difference 15 - 7."""
        a = sbits_a.to(gl.int32) * 128 + 0x2000
        b = sbits_b.to(gl.int32) * 128 + 0x2000
        return a | (b << 16)

    @gluon.jit
    def _unpack_v(ca, cb, scale, F16: gl.constexpr):
        """V code words of tokens 2p and 2p+1 [W, TW/2, 8 (g), 2] int32 with their bf16x2 scales
        [W, TW/2, 8] -> V^T [W, 128, TW] bf16 in the A-operand layout: row 16 i + 8 h + g holds head
        dimension 16 g + 2 i + h, column the token. F16: fp16x2 scales (f16_scales) -> fp16, value x
        scale x 2^-6 (_V16_UNPACK_PTX)."""
        WN: gl.constexpr = ca.shape[0]
        P2: gl.constexpr = ca.shape[1]
        TW: gl.constexpr = 2 * P2
        sw = gl.expand_dims(scale, 3).broadcast_to(ca.shape)
        # l_c (h_c): low (high) nibbles of byte c = 2q + p of the word, tokens (2 pair, 2 pair + 1)
        if F16:
            l0, l1, h0, h1, l2, l3, h2, h3 = gl.inline_asm_elementwise(
                _V16_UNPACK_PTX_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [ca, cb, sw],
                dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
                is_pure=True, pack=1)
            lo = gl.join(gl.join(_as_f16_pairs(l0), _as_f16_pairs(l1)), gl.join(_as_f16_pairs(l2), _as_f16_pairs(l3)))
            hi = gl.join(gl.join(_as_f16_pairs(h0), _as_f16_pairs(h1)), gl.join(_as_f16_pairs(h2), _as_f16_pairs(h3)))
        else:
            l0, l1, h0, h1, l2, l3, h2, h3 = gl.inline_asm_elementwise(
                _V_UNPACK_PTX_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [ca, cb, sw],
                dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
                is_pure=True, pack=1)
            lo = gl.join(gl.join(_as_bf16_pairs(l0), _as_bf16_pairs(l1)),
                         gl.join(_as_bf16_pairs(l2), _as_bf16_pairs(l3)))
            hi = gl.join(gl.join(_as_bf16_pairs(h0), _as_bf16_pairs(h1)),
                         gl.join(_as_bf16_pairs(h2), _as_bf16_pairs(h3)))
        v = gl.join(lo, hi)  # [W, pair, g, w, y, p, q, nibble]: byte 4w + 2q + p of token 2 pair + y
        v = gl.reshape(v, [WN, P2 // 4, 4, 8, 2, 2, 2, 2, 2])  # pair = 4 qq + t
        v = gl.permute(v, [0, 4, 7, 6, 8, 3, 1, 2, 5])  # [W, w, q, p, nibble, g, qq, t, y]
        return gl.reshape(v, [WN, 128, TW])

    _ONE_COPY_PER_PAIR: gl.constexpr = gl.constexpr(ONE_COPY_PER_PAIR)
    _V_UNPACK_PTX_C: gl.constexpr = gl.constexpr(_V_UNPACK_PTX)
    _K_UNPACK_PTX_C: gl.constexpr = gl.constexpr(_K_UNPACK_PTX)
    _K16_UNPACK_PTX_C: gl.constexpr = gl.constexpr(_K16_UNPACK_PTX)
    _V16_UNPACK_PTX_C: gl.constexpr = gl.constexpr(_V16_UNPACK_PTX)

    @gluon.jit
    def _tile_base(bt_row, n_w, end, BS: gl.constexpr, H: gl.constexpr, h, OFF64: gl.constexpr,
                   MASKED: gl.constexpr):
        """Row (slot * H + head) of token n_w, the first of a warp tile: pages hold whole tiles (BS a
        multiple of TW), so the tile's token r sits at row base + r * H. int32 unless OFF64."""
        if MASKED:
            blk = gl.load(bt_row + n_w // BS, mask=n_w < end, other=0)
        else:
            blk = gl.load(bt_row + n_w // BS)
        if OFF64:
            blk = blk.to(gl.int64)
        else:
            blk = blk.to(gl.int32)
        return (blk * BS + n_w % BS) * H + h

    @gluon.jit
    def _outlier_queries(qt_cols, col_mask, iw, mask, GROUP: gl.constexpr, MASKED: gl.constexpr,
                         K_KO: gl.constexpr):
        """The query entries the 4 key outlier slots of each token multiply: q[head, out_idx] x
        sm_scale_log2 [W, TW, NH] float32 per slot, gathered from the query transposed (qt_cols: [D,
        GROUP] at this thread's columns, so one 64-bit load gathers two heads; two 32-bit loads when
        GROUP is odd). iw: the slots' 4 index bytes as one word. Issued as soon as a tile's index words
        are read, before the ring's next copies, so that the gathers do not queue behind them. Without
        key slots (K_KO = 0) nothing is loaded (qt_cols is then not a scratch buffer)."""
        if K_KO == 4:
            EL: gl.constexpr = "evict_last"  # the query stays in L1 while the tiles stream past
            if MASKED:
                m3 = col_mask & gl.expand_dims(mask, 2)
            else:
                m3 = col_mask & gl.expand_dims(mask | True, 2)
            q0 = gl.load(qt_cols + gl.expand_dims((iw & 255) * GROUP, 2), mask=m3, other=0.0, eviction_policy=EL)
            q1 = gl.load(qt_cols + gl.expand_dims(((iw >> 8) & 255) * GROUP, 2), mask=m3, other=0.0,
                         eviction_policy=EL)
            q2 = gl.load(qt_cols + gl.expand_dims(((iw >> 16) & 255) * GROUP, 2), mask=m3, other=0.0,
                         eviction_policy=EL)
            q3 = gl.load(qt_cols + gl.expand_dims(((iw >> 24) & 255) * GROUP, 2), mask=m3, other=0.0,
                         eviction_policy=EL)
        else:  # never read
            q0 = iw
            q1 = iw
            q2 = iw
            q3 = iw
        return q0, q1, q2, q3

    @gluon.jit
    def _key_outliers(s, qo, vw0, vw1):
        """s [W, TW, NH] + sum over the 4 slots of out_val x q[head, out_idx] x sm_scale_log2, in float32;
        qo: _outlier_queries' gathers, vw0/vw1: the slots' bf16 values two per word."""
        q0, q1, q2, q3 = qo
        s = s + gl.expand_dims((vw0 << 16).to(gl.float32, bitcast=True), 2) * q0
        s = s + gl.expand_dims((vw0 & -65536).to(gl.float32, bitcast=True), 2) * q1
        s = s + gl.expand_dims((vw1 << 16).to(gl.float32, bitcast=True), 2) * q2
        s = s + gl.expand_dims((vw1 & -65536).to(gl.float32, bitcast=True), 2) * q3
        return s

    @gluon.jit
    def _query_scale(qv):
        """The power of two F that brings the query's largest element to [2^13, 2^14) in fp16: no overflow,
        nothing below fp16's normal range but elements 2^-27 of the largest. The largest comes from the
        [D, heads] load qv (a thread's 8 values, shuffles within a warp, one exchange across warps), not from
        the B operand, where every warp holds the whole query and would reduce all of it (~200 shuffles)."""
        amax = gl.max(gl.max(gl.abs(qv), 1), 0)
        return (gl.minimum(gl.maximum(267 - (amax.to(gl.int32, bitcast=True) >> 23), 1), 254) << 23).to(
            gl.float32, bitcast=True)  # 2^(13 - floor(log2 amax))

    @gluon.jit
    def _pow2_scale(e):
        """paged.pow2_scale in Gluon (which cannot call Triton's jit functions): second-level exponent
        bits -> 2^(scale_exp - 127 + 8), the factor the unpacked tiles leave out."""
        return ((gl.minimum(e, 246) + 8) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _masked_load(ptr, mask, MASKED: gl.constexpr):
        if MASKED:
            return gl.load(ptr, mask=mask, other=0)
        else:
            return gl.load(ptr)

    @gluon.jit
    def _load_tile(n0, end, bt_row, h, pages, lidx, BS: gl.constexpr, H: gl.constexpr, TW: gl.constexpr,
                   K_KO: gl.constexpr, OFF64: gl.constexpr, MASKED: gl.constexpr):
        """One tile's codes, scales and outlier slots from global memory into registers (STAGES = 0),
        as int32 in the layouts _attend_tile takes: kc [W, TW, 4, 4] K words, ks [W, TW, 4] K scale bits,
        ek, ev [W, TW] exponent bits, iw, vw0, vw1 [W, TW] outlier words, ca, cb [W, TW/2, 8, 2] V words of
        a pair's two tokens, sa, sb [W, TW/2, 8] their V scale bits."""
        D: gl.constexpr = 128
        NG: gl.constexpr = 4
        k0, k1, k2, k3, k4, v0, v1, v2 = pages
        w_k, r_k, w_s, r_s, w_v, p_v, off_kc, off_ks, off_vc, off_vs = lidx
        base_k = _tile_base(bt_row, n0 + TW * w_k, end, BS, H, h, OFF64, MASKED)  # [W, 1, 1]
        mk = n0 + TW * w_k + r_k < end  # [W, TW, 1]
        kc = _masked_load(k0.to(gl.pointer_type(gl.int32)) + gl.expand_dims(base_k * (D // 8), 3) + off_kc,
                          gl.expand_dims(mk, 3), MASKED)
        ks = _masked_load(k1 + base_k * NG + off_ks, mk, MASKED).to(gl.int32)
        base_s = _tile_base(bt_row, n0 + TW * w_s, end, BS, H, h, OFF64, MASKED)  # [W, 1]: S^T's rows
        ms = n0 + TW * w_s + r_s < end  # [W, TW]
        rows_s = base_s + r_s * H
        ek = _masked_load(k2 + rows_s, ms, MASKED).to(gl.int32)
        if K_KO == 4:
            iw = _masked_load((k4 + rows_s * 4).to(gl.pointer_type(gl.int32)), ms, MASKED)
            vw0 = _masked_load((k3 + rows_s * 4).to(gl.pointer_type(gl.int32)), ms, MASKED)
            vw1 = _masked_load((k3 + rows_s * 4 + 2).to(gl.pointer_type(gl.int32)), ms, MASKED)
        else:
            iw = ek
            vw0 = ek
            vw1 = ek
        ev = _masked_load(v2 + rows_s, ms, MASKED).to(gl.int32)
        base_v = _tile_base(bt_row, n0 + TW * w_v, end, BS, H, h, OFF64, MASKED)  # [W, 1, 1]
        mva = n0 + TW * w_v + 2 * p_v < end  # [W, TW/2, 1]
        mvb = n0 + TW * w_v + 2 * p_v + 1 < end
        pa = v0.to(gl.pointer_type(gl.int32)) + gl.expand_dims(base_v * (D // 8), 3) + off_vc
        ca = _masked_load(pa, gl.expand_dims(mva, 3), MASKED)
        cb = _masked_load(pa + H * (D // 8), gl.expand_dims(mvb, 3), MASKED)
        psa = v1 + base_v * NG + off_vs
        sa = _masked_load(psa, mva, MASKED).to(gl.int32)
        sb = _masked_load(psa + H * NG, mvb, MASKED).to(gl.int32)
        return kc, ks, ek, iw, vw0, vw1, ev, ca, cb, sa, sb

    @gluon.jit
    def _copy_rows(n0, end, bt_row, h, pages, cidx, BS: gl.constexpr, H: gl.constexpr, TW: gl.constexpr,
                   OFF64: gl.constexpr, MASKED: gl.constexpr):
        """Where one tile's words come from: the K code pointers [W, TW, 4, 4] (K_LOAD), the token rows
        [W, TW] (COPY_ROW: one word per token), the V code pointers of each pair's first token [W, TW/2,
        8, 2] (V_LOAD), and their masks (MASKED: tokens at or past `end` masked; else all true)."""
        D: gl.constexpr = 128
        i32: gl.constexpr = gl.pointer_type(gl.int32)
        k0, k1, k2, k3, k4, v0, v1, v2 = pages
        w_k, r_k, w_c, r_c, w_c2, r_c2, e_c2, w_v, p_v, off_kc, off_vc = cidx
        base_k = _tile_base(bt_row, n0 + TW * w_k, end, BS, H, h, OFF64, MASKED)  # [W, 1, 1]
        pk = k0.to(i32) + gl.expand_dims(base_k * (D // 8), 3) + off_kc
        rows_c = _tile_base(bt_row, n0 + TW * w_c, end, BS, H, h, OFF64, MASKED) + r_c * H  # [W, TW]
        base_v = _tile_base(bt_row, n0 + TW * w_v, end, BS, H, h, OFF64, MASKED)  # [W, 1, 1]
        pa = v0.to(i32) + gl.expand_dims(base_v * (D // 8), 3) + off_vc
        if MASKED:
            mk = n0 + TW * w_k + r_k < end  # [W, TW, 1]
            mc = n0 + TW * w_c + r_c < end  # [W, TW]
            mva = n0 + TW * w_v + 2 * p_v < end  # [W, TW/2, 1]
            mvb = n0 + TW * w_v + 2 * p_v + 1 < end
        else:
            mk = r_k >= 0
            mc = r_c >= 0
            mva = p_v >= 0
            mvb = p_v >= 0
        return pk, gl.expand_dims(mk, 3), rows_c, mc, pa, gl.expand_dims(mva, 3), gl.expand_dims(mvb, 3)

    @gluon.jit
    def _copy_rows2(n0, end, bt_row, h, cidx, BS: gl.constexpr, H: gl.constexpr, TW: gl.constexpr,
                    OFF64: gl.constexpr, MASKED: gl.constexpr):
        """The word offsets [W, TW, 2] (COPY_ROW2) of each token's 2 key outlier value words, and their mask."""
        w_k, r_k, w_c, r_c, w_c2, r_c2, e_c2, w_v, p_v, off_kc, off_vc = cidx
        rows_c2 = _tile_base(bt_row, n0 + TW * w_c2, end, BS, H, h, OFF64, MASKED) + r_c2 * H  # [W, TW, 1]
        if MASKED:
            mc2 = n0 + TW * w_c2 + r_c2 < end
        else:
            mc2 = r_c2 >= 0
        return rows_c2 * 2 + e_c2, mc2

    @gluon.jit
    def _copy_rows4(n0, end, bt_row, h, BS: gl.constexpr, H: gl.constexpr, TW: gl.constexpr, OFF64: gl.constexpr,
                    MASKED: gl.constexpr, G16: gl.constexpr = False):
        """Key groups of 8: the word offsets [W, TW, 4] of each token's 16 key scale bytes (one 16-byte copy per
        token, lanes 16-31 repeating 0-15), and their mask. G16 (key groups of 16, 8 scale bytes): word e of the
        row is the token's scale word e // 2 (four 4-byte copies per token), so that word t holds thread t's
        scales as with groups of 8 (_read_k)."""
        L4: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2]], lane_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 0, 0]],
            warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, TW, 4])
        S2: gl.constexpr = gl.SliceLayout(2, L4)
        w4 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, S2)), 1), 2)
        r4 = gl.expand_dims(gl.expand_dims(gl.arange(0, TW, layout=gl.SliceLayout(0, S2)), 0), 2)
        e4 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L4))), 0), 1)
        rows4 = _tile_base(bt_row, n0 + TW * w4, end, BS, H, h, OFF64, MASKED) + r4 * H  # [W, TW, 1]
        if MASKED:
            m4 = (n0 + TW * w4 + r4 < end) & (e4 >= 0)
        else:
            m4 = (r4 >= 0) & (e4 >= 0)
        if G16:
            return rows4 * 2 + (e4 >> 1), m4
        return rows4 * 4 + e4, m4

    @gluon.jit
    def _issue_tile(bufs, stage, n0, end, bt_row, h, pages, cidx, BS: gl.constexpr, H: gl.constexpr,
                    TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr, MASKED: gl.constexpr):
        """Start copying one tile into stage `stage` of `bufs`, one of the ring's two allocations (cp.async,
        STAGES > 0).
        cp.async moves 4, 8 or 16 bytes, so byte arrays travel as the aligned word that holds the byte
        (_read_tile picks it out): a token's 4 K or V scale bytes are one word (with key groups of 8 its
        16 K scale bytes are 4 words, one 16-byte copy: _copy_rows4; with groups of 16 its 2 scale words
        each fill two of the row's 4), an exponent byte is
        byte (row & 3) of word row >> 2. Per-token words are copied once per token (COPY_ROW), not
        once per thread that reads them. MASKED (the partial tile, which the ring attends first): tokens
        at or past `end` copy zeros. (The outlier value rows are computed after the first copies: computed
        with the others, Triton 3.9 took 134 registers at the 8B shape.)"""
        D: gl.constexpr = 128
        i32: gl.constexpr = gl.pointer_type(gl.int32)
        bkc, bks, bek, biw, bvw, bev, bca, bcb, bsv = bufs
        k0, k1, k2, k3, k4, v0, v1, v2 = pages
        pk, mk, rows_c, mc, pa, mva, mvb = _copy_rows(n0, end, bt_row, h, pages, cidx, BS, H, TW, OFF64, MASKED)
        _async_load(bkc.index(stage), pk, mk)
        KR: gl.constexpr = _key_scale_rows(bks.shape, TW)
        if KR == 4:  # key groups of 8: a token's 16 scale bytes, 4 words
            words4, m4 = _copy_rows4(n0, end, bt_row, h, BS, H, TW, OFF64, MASKED)
            _async_load(bks.index(stage), k1.to(i32) + words4, m4)
        elif KR == 5:  # key groups of 16: a token's 8 scale bytes, each word twice
            words4, m4 = _copy_rows4(n0, end, bt_row, h, BS, H, TW, OFF64, MASKED, True)
            _async_load(_reshaped(bks.index(stage), bks.shape[1], TW, 4), k1.to(i32) + words4, m4)
        else:
            _async_load(bks.index(stage), k1.to(i32) + rows_c, mc)  # a token's 4 scale bytes: one word
        _async_load(bek.index(stage), k2.to(i32) + (rows_c >> 2), mc)
        if K_KO == 4:
            _async_load(biw.index(stage), k4.to(i32) + rows_c, mc)
            words2, mc2 = _copy_rows2(n0, end, bt_row, h, cidx, BS, H, TW, OFF64, MASKED)
            _async_load(bvw.index(stage), k3.to(i32) + words2, mc2)
        _async_load(bev.index(stage), v2.to(i32) + (rows_c >> 2), mc)
        _async_load(bca.index(stage), pa, mva)
        _async_load(bcb.index(stage), pa + H * (D // 8), mvb)
        _async_load(bsv.index(stage), v1.to(i32) + rows_c, mc)

    @gluon.jit
    def _pair_sources(n0, bt_row, h, pages, cidx, BS: gl.constexpr, H: gl.constexpr, TW: gl.constexpr,
                      K_KO: gl.constexpr, OFF64: gl.constexpr, KSR: gl.constexpr):
        """A whole tile's source pointers, one per array of a ring set (_ring_set's order; K_KO == 0: the
        outlier arrays' entries repeat the exponent's and are never copied). KSR: the rank of the set's key
        scale array (3: a word per token; 4: key groups of 8; 5: of 16)."""
        D: gl.constexpr = 128
        i32: gl.constexpr = gl.pointer_type(gl.int32)
        k0, k1, k2, k3, k4, v0, v1, v2 = pages
        # whole tiles (MASKED False): no end to mask at, n0 stands in for it
        pk, mk, rows_c, mc, pa, mva, mvb = _copy_rows(n0, n0, bt_row, h, pages, cidx, BS, H, TW, OFF64, False)
        ek = k2.to(i32) + (rows_c >> 2)
        if K_KO == 4:
            words2, mc2 = _copy_rows2(n0, n0, bt_row, h, cidx, BS, H, TW, OFF64, False)
            iw = k4.to(i32) + rows_c
            vw = k3.to(i32) + words2
        else:
            iw = ek
            vw = ek
        if KSR > 3:  # key groups of 8 or 16: a scale word per thread t
            words4, m4 = _copy_rows4(n0, n0, bt_row, h, BS, H, TW, OFF64, False, KSR == 5)
            pks = k1.to(i32) + words4
        else:
            pks = k1.to(i32) + rows_c
        return (pk, pks, ek, iw, vw, v2.to(i32) + (rows_c >> 2), pa, pa + H * (D // 8),
                v1.to(i32) + rows_c)

    @gluon.jit
    def _copy_pair(buf, a, b, RESTATE: gl.constexpr = True):
        """Copy two tiles' words (pointers a, b [W, ...], whole tiles, no mask) into stages 0 and 1 of one of
        a set's arrays (buf [2, W, ...]) as one cp.async operation on the whole array, so that each array
        takes one copy per pair: two copies into one allocation (stage 0, then stage 1) made Triton 3.6's
        Membar pass put a barrier between them. The pointers' alignment and contiguity, which the join
        hides from the compiler, are restated (a K or V code row's 4 or 2 words start 16- or 8-byte
        aligned, as do a token's 2 outlier value words, on pages that Launch checked: _pair_copies_aligned),
        so the copies keep their 16- and 8-byte width. RESTATE False: nothing restated (key groups of 16's scale
        rows, whose words are not contiguous in global memory)."""
        R: gl.constexpr = len(a.shape)
        PL: gl.constexpr = _pair_layout(a.type.layout)
        x = gl.permute(gl.join(a, b), _pair_first(R).value)
        if R > 2 and RESTATE:  # R == 2: one word per token, nothing contiguous to restate
            C: gl.constexpr = a.shape[R - 1]  # words per thread and row
            x = gl.max_contiguous(gl.multiple_of(x, _last_dim(R + 1, 4 * C).value), _last_dim(R + 1, C).value)
        dst = _reinterpret(buf, _row_major(R + 1))
        _async_load(dst, gl.convert_layout(x, PL, assert_trivial=True))

    @gluon.jit
    def _read_rows(bufs, stage, shifts, S_ROW: gl.constexpr, S_ROW2: gl.constexpr, K_KO: gl.constexpr):
        """_read_tile's per-token words: key exponent, outlier index and value words, value exponent."""
        bkc, bks, bek, biw, bvw, bev, bca, bcb, bsv = bufs
        sh_k, sh_s, sh_v = shifts
        ek = (bek.index(stage).load(S_ROW) >> sh_s) & 255
        if K_KO == 4:
            iw = biw.index(stage).load(S_ROW)
            vw0, vw1 = gl.split(bvw.index(stage).load(S_ROW2))
            vw0 = gl.convert_layout(vw0, S_ROW, assert_trivial=True)
            vw1 = gl.convert_layout(vw1, S_ROW, assert_trivial=True)
        else:
            iw = ek
            vw0 = ek
            vw1 = ek
        ev = (bev.index(stage).load(S_ROW) >> sh_s) & 255
        return ek, iw, vw0, vw1, ev

    @gluon.jit
    def _read_k(bufs, stage, shifts, K_LOAD: gl.constexpr):
        """_read_tile's key codes and key scale bits."""
        bkc, bks, bek, biw, bvw, bev, bca, bcb, bsv = bufs
        sh_k, sh_s, sh_v = shifts
        kc = bkc.index(stage).load(K_LOAD)
        KL3: gl.constexpr = gl.SliceLayout(3, K_LOAD)
        KR: gl.constexpr = _key_scale_rows(bks.shape, bkc.shape[2])
        if KR > 3:  # code word w of thread t (K_LOAD's last dim)
            bw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, K_LOAD))))
            bw = gl.expand_dims(gl.expand_dims(gl.expand_dims(bw, 0), 1), 2)  # [1, 1, 1, 4]
        if KR == 4:  # key groups of 8: word t holds the scale bytes of code words 0-3 of thread t
            ks = (gl.expand_dims(bks.index(stage).load(KL3), 3) >> (8 * bw)) & 255
        elif KR == 5:  # key groups of 16: word t holds scale bytes 4 (t // 2).. (_copy_rows4), and code word w of
            # thread t (dims 32 t + 8 w..) is in group 2 t + w // 2: byte 2 (t % 2) + w // 2 of the word
            bt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, KL3)))
            bt = gl.expand_dims(gl.expand_dims(gl.expand_dims(bt, 0), 1), 3)  # [1, 1, 4, 1]
            words = _reshaped(bks.index(stage), bks.shape[1], bks.shape[2] // 4, 4).load(KL3)
            ks = (gl.expand_dims(words, 3) >> (16 * (bt & 1) + 8 * (bw >> 1))) & 255
        else:
            ks = (gl.expand_dims(bks.index(stage).load(gl.SliceLayout(2, KL3)), 2) >> sh_k) & 255
        return kc, ks

    @gluon.jit
    def _read_v(bufs, stage, shifts, V_LOAD: gl.constexpr, V_SCALE2: gl.constexpr):
        """_read_tile's value codes and value scale bits."""
        bkc, bks, bek, biw, bvw, bev, bca, bcb, bsv = bufs
        sh_k, sh_s, sh_v = shifts
        WN: gl.constexpr = bkc.shape[1]
        TW: gl.constexpr = bkc.shape[2]
        ca = bca.index(stage).load(V_LOAD)
        cb = bcb.index(stage).load(V_LOAD)
        sa, sb = gl.split(bsv.index(stage).reshape([WN, TW // 2, 2]).load(V_SCALE2))
        VS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, V_LOAD))
        sa = (gl.expand_dims(gl.convert_layout(sa, VS, assert_trivial=True), 2) >> sh_v) & 255
        sb = (gl.expand_dims(gl.convert_layout(sb, VS, assert_trivial=True), 2) >> sh_v) & 255
        return ca, cb, sa, sb

    @gluon.jit
    def _issue_pair(bufs, q, n_pairs, start, end, bt_row, h, pages, cidx, BS: gl.constexpr, H: gl.constexpr,
                    TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr):
        """Whole tiles 2q and 2q + 1, if pair q exists, into bufs' stages 0 and 1: one copy per array
        (_copy_pair) or, with a Triton that adds no barrier between two, one per array and tile."""
        if q < n_pairs:
            n1 = start + (2 * q) * (4 * TW)
            if _ONE_COPY_PER_PAIR:
                KSR: gl.constexpr = _key_scale_rows(bufs[1].shape, TW)
                a = _pair_sources(n1, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, KSR)
                b = _pair_sources(n1 + 4 * TW, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, KSR)
                for i in gl.static_range(9):
                    if i == 1 and KSR == 5:  # key groups of 16: the scale rows as [2, W, TW, 4] words
                        _copy_pair(_reshaped(bufs[1], 2, bufs[1].shape[1], TW, 4), a[1], b[1], False)
                    elif K_KO == 4 or (i != 3 and i != 4):
                        _copy_pair(bufs[i], a[i], b[i])
            else:
                _issue_tile(bufs, 0, n1, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, False)
                _issue_tile(bufs, 1, n1 + 4 * TW, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, False)

    @gluon.jit
    def _read_tile(bufs, stage, shifts, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, S_ROW: gl.constexpr,
                   S_ROW2: gl.constexpr, V_SCALE2: gl.constexpr, K_KO: gl.constexpr):
        """A tile copied by _issue_tile, from shared memory into _load_tile's registers; shifts: the bit
        offsets (sh_k, sh_s, sh_v) of the bytes within their words, loop-invariant since pages and tiles
        start at multiples of 4 rows."""
        kc, ks = _read_k(bufs, stage, shifts, K_LOAD)
        ek, iw, vw0, vw1, ev = _read_rows(bufs, stage, shifts, S_ROW, S_ROW2, K_KO)
        ca, cb, sa, sb = _read_v(bufs, stage, shifts, V_LOAD, V_SCALE2)
        return kc, ks, ek, iw, vw0, vw1, ev, ca, cb, sa, sb

    @gluon.jit
    def _attend_tile(n0, end, m_i, l_i, acc, qt, qo, tile, w_s, r_s, sm_scale_log2, TW: gl.constexpr,
                     K_KO: gl.constexpr, MASKED: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                     F16: gl.constexpr):
        """One tile (_load_tile's registers): tokens n0 + TW w + r for each warp w, its own online softmax
        state (m_i [W, NH], per-thread partial sums l_i [W, TW, NH], O^T acc [W, D, NH]). MASKED: tokens
        at or past `end` may be in the tile (the partial one), else every score is taken as is. qo: the
        tile's _outlier_queries (K_KO = 4). sm_scale_log2: the factor the unpacked keys and qt leave out of
        the scores (F16: including 1 / the power of two qt carries). F16: m_i is the running max of score +
        log2 of the token's value factor, see _tile_update."""
        s = _tile_scores(qt, qo, tile, l_i, sm_scale_log2, K_KO, A_OP, F16)
        return _tile_update(n0, end, m_i, l_i, acc, s, tile, w_s, r_s, TW, MASKED, A_OP, B_OP, F16)

    @gluon.jit
    def _key_operand(kc, ks, A_OP: gl.constexpr, F16: gl.constexpr):
        """A tile's key codes and scale bits (_read_k / _load_tile) -> K as the scores' MMA A operand."""
        if F16:
            return gl.convert_layout(_unpack_k(kc, f16_scales(ks, ks), True), A_OP, assert_trivial=True)
        else:
            return gl.convert_layout(_unpack_k(kc, bf16_scales(ks, ks), False), A_OP, assert_trivial=True)

    @gluon.jit
    def _value_operand(ca, cb, sa, sb, A_OP: gl.constexpr, F16: gl.constexpr):
        """A tile's value codes and scale bits (_read_v / _load_tile) -> V^T as the PV MMA's A operand."""
        if F16:
            return gl.convert_layout(_unpack_v(ca, cb, f16_scales(sa, sb), True), A_OP, assert_trivial=True)
        else:
            return gl.convert_layout(_unpack_v(ca, cb, bf16_scales(sa, sb), False), A_OP, assert_trivial=True)

    @gluon.jit
    def _tile_scores(qt, qo, tile, l_i, sm_scale_log2, K_KO: gl.constexpr, A_OP: gl.constexpr, F16: gl.constexpr):
        """_attend_tile's first half: the tile's scores S^T = K Q^T x the keys' factors, outliers added."""
        kc, ks, ek, iw, vw0, vw1, ev, ca, cb, sa, sb = tile
        s = mma_v2(_key_operand(kc, ks, A_OP, F16), qt, gl.zeros_like(l_i))
        fk = _pow2_scale(ek) * sm_scale_log2
        s = s * gl.expand_dims(fk, 2)
        if K_KO == 4:
            s = _key_outliers(s, qo, vw0, vw1)
        return s

    @gluon.jit
    def _softmax_update(m_i, l_i, s, ms, ev, MASKED: gl.constexpr, B_OP: gl.constexpr, F16: gl.constexpr):
        """The online softmax over scores s [W, TW, NH], base 2, per warp and column (MASKED: rows where ms
        is false left out): the new running max, the sums l_i, the old state's rescale alpha and the
        probabilities as the PV MMA's B operand (ev: the tokens' value exponent bits)."""
        if F16:
            # V^T in fp16 is value x 2^-6 x scale (exact), so a token's probability goes to the MMA as
            # p x 2^(scale_exp - 121) in fp16, and fp16's range holds that only near 1: the exponent joins the
            # score (s + scale_exp - 121, the max taken over that), so the operand is at most 1 and exact to
            # fp16's 11 bits relative to the largest term whatever the values' magnitudes; the sums l_i
            # take the probabilities back by 2^(121 - scale_exp).
            evc = gl.minimum(ev, 246)
            e_log2 = (evc | 0x4B000000).to(gl.float32, bitcast=True) - (8388608.0 + 121.0)  # exact
            s = s + gl.expand_dims(e_log2, 2)
            inv_fv = ((248 - evc) << 23).to(gl.float32, bitcast=True)  # 2^(121 - scale_exp)
        if MASKED:
            s = gl.where(gl.expand_dims(ms, 2), s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a column with no token yet
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = m_new
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
        if F16:
            l_i = l_i * gl.expand_dims(alpha, 1) + p * gl.expand_dims(inv_fv, 2)
            pt = gl.convert_layout(p.to(gl.float16), B_OP)
        else:
            l_i = l_i * gl.expand_dims(alpha, 1) + p
            fv = _pow2_scale(ev)
            pt = gl.convert_layout((p * gl.expand_dims(fv, 2)).to(gl.bfloat16), B_OP)
        return m_new, l_i, alpha, pt

    @gluon.jit
    def _tile_update(n0, end, m_i, l_i, acc, s, tile, w_s, r_s, TW: gl.constexpr, MASKED: gl.constexpr,
                     A_OP: gl.constexpr, B_OP: gl.constexpr, F16: gl.constexpr):
        """_attend_tile's second half: the online softmax over the scores s and O^T += V^T P^T."""
        kc, ks, ek, iw, vw0, vw1, ev, ca, cb, sa, sb = tile
        ms = n0 + TW * w_s + r_s < end  # [W, TW]
        m_new, l_i, alpha, pt = _softmax_update(m_i, l_i, s, ms, ev, MASKED, B_OP, F16)
        # V -> O^T += V^T P^T; V^T's columns are token pairs (2 pair, 2 pair + 1)
        acc = mma_v2(_value_operand(ca, cb, sa, sb, A_OP, F16), pt, acc * gl.expand_dims(alpha, 1))
        return m_new, l_i, acc

    @gluon.jit
    def _ring_set(NS: gl.constexpr, WN: gl.constexpr, TW: gl.constexpr, K_KO: gl.constexpr, KG8: gl.constexpr,
                  KG16: gl.constexpr):
        """One of the ring's two allocations: NS stages of a tile's arrays, unswizzled and row-major (the
        leading dim is the stage), as the tuple _issue_tile and _read_tile take. The key scales' shape says
        their format: [NS, W, TW] a word per token, [NS, W, TW, 4] key groups of 8, [NS, W, 4 TW] of 16."""
        SL3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SL4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        SL5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        bkc = gl.allocate_shared_memory(gl.int32, [NS, WN, TW, 4, 4], SL5)
        if KG8:
            bks = gl.allocate_shared_memory(gl.int32, [NS, WN, TW, 4], SL4)
        elif KG16:  # [NS, WN, TW, 4] as [.., 4 TW]: its rank tells the builds apart, and views split its last dim
            bks = gl.allocate_shared_memory(gl.int32, [NS, WN, 4 * TW], SL3)
        else:
            bks = gl.allocate_shared_memory(gl.int32, [NS, WN, TW], SL3)
        bek = gl.allocate_shared_memory(gl.int32, [NS, WN, TW], SL3)
        if K_KO == 4:
            biw = gl.allocate_shared_memory(gl.int32, [NS, WN, TW], SL3)
            bvw = gl.allocate_shared_memory(gl.int32, [NS, WN, TW, 2], SL4)
        else:  # never read
            biw = bek
            bvw = bek
        bev = gl.allocate_shared_memory(gl.int32, [NS, WN, TW], SL3)
        bca = gl.allocate_shared_memory(gl.int32, [NS, WN, TW // 2, 8, 2], SL5)
        bcb = gl.allocate_shared_memory(gl.int32, [NS, WN, TW // 2, 8, 2], SL5)
        bsv = gl.allocate_shared_memory(gl.int32, [NS, WN, TW], SL3)
        return (bkc, bks, bek, biw, bvw, bev, bca, bcb, bsv)

    @gluon.jit
    def _issue_whole(bufs, j, n_whole, start, end, bt_row, h, pages, cidx, BS: gl.constexpr, H: gl.constexpr,
                     TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr, STAGES: gl.constexpr):
        """Whole tile j (tokens start + j x tile ..), if there is one, into its slot of the ring: stage
        (j // 2) % (STAGES // 2) of `bufs`, which must be set j % 2 (the caller's choice: a set is an
        allocation, picked at compile time)."""
        if j < n_whole:
            _issue_tile(bufs, (j // 2) % (STAGES // 2), start + j * (4 * TW), end, bt_row, h, pages, cidx, BS, H, TW,
                        K_KO, OFF64, False)

    @gluon.jit
    def _ring_step(j, m_i, l_i, acc, read_set, write_set, step, BS: gl.constexpr, H: gl.constexpr,
                   GROUP: gl.constexpr, TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr,
                   STAGES: gl.constexpr, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, S_ROW: gl.constexpr,
                   S_ROW2: gl.constexpr, V_SCALE2: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                   F16: gl.constexpr):
        """Whole tile j of the ring (in read_set; the tile STAGES - 1 ahead goes to write_set, the other
        allocation): wait for it, read it, issue its outlier gathers, its scores, then the copy ahead,
        then softmax and PV. Gathers issued after a tile's copies waited behind them (the first use of a
        gather was the loop's most stalled instruction, ncu)."""
        start, end, n_whole, bt_row, h, pages, cidx, shifts, qt, qt_cols, col_mask, w_s, r_s, k_factor = step
        NS: gl.constexpr = STAGES // 2
        tile = 4 * TW
        _wait_group(STAGES - 2)  # tile j has landed
        _barrier()  # ... for every thread, and every thread is done with the stage the copy below refills
        data = _read_tile(read_set, (j // 2) % NS, shifts, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, K_KO)
        n0 = start + j * tile
        qo = _outlier_queries(qt_cols, col_mask, data[3], r_s >= 0, GROUP, False, K_KO)
        s = _tile_scores(qt, qo, data, l_i, k_factor, K_KO, A_OP, F16)
        _issue_whole(write_set, j + STAGES - 1, n_whole, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64,
                     STAGES)
        _commit_group()
        return _tile_update(n0, end, m_i, l_i, acc, s, data, w_s, r_s, TW, False, A_OP, B_OP, F16)

    @gluon.jit
    def _lane_half(like):
        """mma.m16n8's column half of this lane (t >= 2 holds score columns 4-7: lane bit 1) as int32 0/1,
        shaped like `like` (int32 rows [W, TW] of S^T). Triton takes a row tensor as equal in the lanes
        that share a row; this one differs by lane on purpose, and is only used to pick per thread
        (gl.where) a row value of the tile pair's first or second tile before it is broadcast into the
        thread's own columns."""
        return gl.inline_asm_elementwise("{ .reg .u32 l; mov.u32 l, %laneid; bfe.u32 $0, l, 1, 1; }", "=r,r",
                                         [like], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _partner(x):
        """The value of column c ^ 4 in this thread's column c (float32, any layout whose columns follow
        mma.m16n8's: lane 4 g + t holds columns 2 t, 2 t + 1): a butterfly shuffle across lane bit 1."""
        return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _pair_keys(bufs, stage, shifts, qt, l_i, K_LOAD: gl.constexpr, A_OP: gl.constexpr, F16: gl.constexpr):
        """A paired tile's scores S^T = K Q^T (stage 0: tile A, 1: tile B), unscaled: read, unpack, MMA."""
        kc, ks = _read_k(bufs, stage, shifts, K_LOAD)
        return mma_v2(_key_operand(kc, ks, A_OP, F16), qt, gl.zeros_like(l_i))

    @gluon.jit
    def _pair_values(bufs, stage, shifts, pt, acc, V_LOAD: gl.constexpr, V_SCALE2: gl.constexpr, A_OP: gl.constexpr,
                     F16: gl.constexpr):
        """acc + V^T pt for a paired tile (stage 0: tile A, 1: tile B; pt: its probabilities in its columns,
        zeros in the other half): read, unpack, MMA."""
        ca, cb, sa, sb = _read_v(bufs, stage, shifts, V_LOAD, V_SCALE2)
        return mma_v2(_value_operand(ca, cb, sa, sb, A_OP, F16), pt, acc)

    @gluon.jit
    def _pair_attend(nA, endA, nB, endB, m_i, l_i, acc, bufs, step, next_pair, n_pairs, issue_set,
                     BS: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, TW: gl.constexpr, K_KO: gl.constexpr,
                     OFF64: gl.constexpr, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, S_ROW: gl.constexpr,
                     S_ROW2: gl.constexpr, V_SCALE2: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                     F16: gl.constexpr, MASKED: gl.constexpr, ISSUE: gl.constexpr):
        """Two tiles in one pass (GROUP <= 4: the query heads fill half of the MMA's 8 columns): the
        scores of tile A (tokens nA + TW w + r, bufs stage 0) in columns 0-3 and of tile B (nB.., stage
        1) in columns 4-7, each column its own online softmax state, so the softmax, the key outlier
        slots and O^T's rescale run once for both tiles on columns that were padding. S^T comes from one
        MMA chain per tile (the query in both column halves), O^T += V_A^T P_A^T + V_B^T P_B^T with each
        tile's probabilities in its own columns (zeros in the other half). Per-token words reach a
        thread for its own half (_lane_half). MASKED: tokens at or past endA / endB are masked out.
        ISSUE: after the scores, the copies of pair next_pair (if < n_pairs) go to issue_set."""
        start, end, bt_row, h, pages, cidx, shifts, qt, qt_cols, col_mask, w_s, r_s, k_factor, hi = step
        rA = _read_rows(bufs, 0, shifts, S_ROW, S_ROW2, K_KO)
        rB = _read_rows(bufs, 1, shifts, S_ROW, S_ROW2, K_KO)
        sel = hi != 0
        ek = gl.where(sel, rB[0], rA[0])
        iw = gl.where(sel, rB[1], rA[1])
        vw0 = gl.where(sel, rB[2], rA[2])
        vw1 = gl.where(sel, rB[3], rA[3])
        ev = gl.where(sel, rB[4], rA[4])
        if MASKED:
            ms = gl.where(sel, nB + TW * w_s + r_s < endB, nA + TW * w_s + r_s < endA)
        else:
            ms = r_s >= 0
        qo = _outlier_queries(qt_cols, col_mask, iw, ms, GROUP, MASKED, K_KO)
        sA = _pair_keys(bufs, 0, shifts, qt, l_i, K_LOAD, A_OP, F16)
        sB = _pair_keys(bufs, 1, shifts, qt, l_i, K_LOAD, A_OP, F16)
        s = gl.where(gl.expand_dims(sel, 2), sB, sA)
        if ISSUE:
            _issue_pair(issue_set, next_pair, n_pairs, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64)
            _commit_group()
        fk = _pow2_scale(ek) * k_factor
        s = s * gl.expand_dims(fk, 2)
        if K_KO == 4:
            s = _key_outliers(s, qo, vw0, vw1)
        m_new, l_i, alpha, pt = _softmax_update(m_i, l_i, s, ms, ev, MASKED, B_OP, F16)
        NH: gl.constexpr = pt.shape[2]
        n_b = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_OP)))
        first = gl.expand_dims(gl.expand_dims(n_b < NH // 2, 0), 1)  # [1, 1, NH]: tile A's columns
        zero = gl.zeros_like(pt)
        acc = _pair_values(bufs, 0, shifts, gl.where(first, pt, zero), acc * gl.expand_dims(alpha, 1), V_LOAD,
                           V_SCALE2, A_OP, F16)
        acc = _pair_values(bufs, 1, shifts, gl.where(first, zero, pt), acc, V_LOAD, V_SCALE2, A_OP, F16)
        return m_new, l_i, acc

    @gluon.jit
    def _pair_step(q, m_i, l_i, acc, read_set, write_set, n_pairs, step, BS: gl.constexpr, H: gl.constexpr,
                   GROUP: gl.constexpr, TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr,
                   K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, S_ROW: gl.constexpr, S_ROW2: gl.constexpr,
                   V_SCALE2: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, F16: gl.constexpr,
                   ISSUE: gl.constexpr):
        """Whole tiles 2q and 2q + 1 (read_set's two stages): wait for them, every thread past the
        previous pair, then attend them while pair q + 1 (ISSUE: if there is one) is copied into write_set."""
        start = step[0]
        end = step[1]
        tile = 4 * TW
        _wait_group(0)  # pair q has landed (the only copies in flight)
        _barrier()  # ... for every thread, and every thread is done with write_set (pair q - 1)
        n0 = start + (2 * q) * tile
        return _pair_attend(n0, end, n0 + tile, end, m_i, l_i, acc, read_set, step, q + 1, n_pairs, write_set,
                            BS, H, GROUP, TW, K_KO, OFF64, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP,
                            F16, False, ISSUE)

    @gluon.jit
    def _ring_issue_first(set0, set1, has_part, n_whole, start, end, full_end, bt_row, h, pages, cidx, BS: gl.constexpr,
                          H: gl.constexpr, TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr,
                          STAGES: gl.constexpr):
        """The ring's first copies (single tiles): the partial tile, if any, into whole tile STAGES - 1's slot,
        then whole tiles 0 .. STAGES - 3, one commit group each (the partial tile's empty without one)."""
        if has_part:
            _issue_tile(set1, STAGES // 2 - 1, full_end, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, True)
        _commit_group()
        for j in gl.static_range(STAGES - 2):
            if j % 2 == 0:
                _issue_whole(set0, j, n_whole, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, STAGES)
            else:
                _issue_whole(set1, j, n_whole, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, STAGES)
            _commit_group()

    @gluon.jit
    def _ring_loop(m_i, l_i, acc, set0, set1, has_part, full_end, step, BS: gl.constexpr, H: gl.constexpr,
                   GROUP: gl.constexpr, TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr,
                   STAGES: gl.constexpr, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, S_ROW: gl.constexpr,
                   S_ROW2: gl.constexpr, V_SCALE2: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                   F16: gl.constexpr):
        """The ring's tiles one at a time after _ring_issue_first: the partial tile first, then the whole
        ones, tile j + STAGES - 1 copied while tile j is attended."""
        start, end, n_whole, bt_row, h, pages, cidx, shifts, qt, qt_cols, col_mask, w_s, r_s, k_factor = step
        if has_part:
            _wait_group(STAGES - 2)  # the partial tile has landed
            _barrier()  # ... for every thread
            data = _read_tile(set1, STAGES // 2 - 1, shifts, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, K_KO)
            qo = _outlier_queries(qt_cols, col_mask, data[3], full_end + TW * w_s + r_s < end, GROUP, True, K_KO)
            m_i, l_i, acc = _attend_tile(full_end, end, m_i, l_i, acc, qt, qo, data, w_s, r_s, k_factor, TW, K_KO,
                                         True, A_OP, B_OP, F16)
        # whole tile STAGES - 2, into set (STAGES - 2) % 2 = 0
        _issue_whole(set0, STAGES - 2, n_whole, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, STAGES)
        _commit_group()
        for j in range(0, n_whole - 1, 2):  # two whole tiles: even from set 0, odd from set 1
            m_i, l_i, acc = _ring_step(j, m_i, l_i, acc, set0, set1, step, BS, H, GROUP, TW, K_KO, OFF64, STAGES,
                                       K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16)
            m_i, l_i, acc = _ring_step(j + 1, m_i, l_i, acc, set1, set0, step, BS, H, GROUP, TW, K_KO, OFF64,
                                       STAGES, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16)
        if n_whole % 2 == 1:  # the last whole tile, even
            m_i, l_i, acc = _ring_step(n_whole - 1, m_i, l_i, acc, set0, set1, step, BS, H, GROUP, TW, K_KO, OFF64,
                                       STAGES, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16)
        _wait_group(0)
        return m_i, l_i, acc

    @gluon.jit
    def _pair_plan(has_part, n_whole, start, end, full_end, tile):
        """Tile pairs: (pairs of whole tiles, whether a masked first pass runs, its first tile's start nA,
        the lone last whole tile's start, and the end of its tokens taken by that pass). The first pass
        takes the partial tile, or the lone last whole tile of an odd count, and, when there are both,
        that whole tile too (else its second tile is empty)."""
        odd = (n_whole % 2) == 1
        last_whole = start + (n_whole - 1) * tile
        part_i = has_part.to(gl.int32)
        nA = full_end * part_i + last_whole * (1 - part_i)
        endB = last_whole + (end - last_whole) * (has_part & odd).to(gl.int32)
        return n_whole // 2, has_part | odd, nA, last_whole, endB

    @gluon.jit
    def _pair_issue_first(set0, set1, pp, start, end, bt_row, h, pages, cidx, BS: gl.constexpr, H: gl.constexpr,
                          TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr):
        """Tile pairs' first copies: the masked first pass (_pair_plan) into set 1, pair 0 into set 0."""
        n_pairs, extra, nA, last_whole, endB = pp
        if extra:
            _issue_tile(set1, 0, nA, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, True)
            _issue_tile(set1, 1, last_whole, endB, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64, True)
        _commit_group()
        _issue_pair(set0, 0, n_pairs, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64)
        _commit_group()

    @gluon.jit
    def _pair_loop(m_i, l_i, acc, set0, set1, pp, step, BS: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr,
                   TW: gl.constexpr, K_KO: gl.constexpr, OFF64: gl.constexpr, K_LOAD: gl.constexpr,
                   V_LOAD: gl.constexpr, S_ROW: gl.constexpr, S_ROW2: gl.constexpr, V_SCALE2: gl.constexpr,
                   A_OP: gl.constexpr, B_OP: gl.constexpr, F16: gl.constexpr):
        """Tile pairs after _pair_issue_first: the masked first pass, then pair q from set q % 2 while pair
        q + 1 is copied into the other set."""
        n_pairs, extra, nA, last_whole, endB = pp
        end = step[1]
        if extra:
            _wait_group(1)  # the first pass's tiles have landed
            _barrier()  # ... for every thread
            m_i, l_i, acc = _pair_attend(nA, end, last_whole, endB, m_i, l_i, acc, set1, step, 0, 0, set1, BS, H,
                                         GROUP, TW, K_KO, OFF64, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP,
                                         F16, True, False)
        for q in range(0, n_pairs - 1, 2):  # two pairs: set 0, then set 1
            m_i, l_i, acc = _pair_step(q, m_i, l_i, acc, set0, set1, n_pairs, step, BS, H, GROUP, TW, K_KO, OFF64,
                                       K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16, True)
            m_i, l_i, acc = _pair_step(q + 1, m_i, l_i, acc, set1, set0, n_pairs, step, BS, H, GROUP, TW, K_KO,
                                       OFF64, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16, True)
        if n_pairs % 2 == 1:  # the last pair, from set 0, nothing to copy
            m_i, l_i, acc = _pair_step(n_pairs - 1, m_i, l_i, acc, set0, set1, n_pairs, step, BS, H, GROUP, TW, K_KO,
                                       OFF64, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16, False)
        _wait_group(0)
        return m_i, l_i, acc

    @gluon.jit
    def program_split(seq_lens_ptr, b, sp, split_size, num_splits, TILE: gl.constexpr):
        """(start, end) of this program's tokens: sequence b's own length in num_splits splits of whole tiles,
        none longer than the plan's split_size. A sequence shorter than the plan (a decode graph plans for
        max_model_len, or a short one beside long ones) spreads over as many of its splits as it has tiles for,
        on shorter splits, not a few full splits and the rest empty. int32 (the engine passes int64 lengths;
        the ring indexes stages by int32)."""
        seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
        tiles = gl.minimum(split_size // TILE, ((seq_len + num_splits - 1) // num_splits + (TILE - 1)) // TILE)
        split = tiles * TILE  # written as a product so that the compiler knows it is whole tiles
        start = sp * split
        return start, gl.minimum(seq_len, start + split)

    @gluon.jit
    def load_index(LOAD: gl.constexpr):
        """Index vectors of a [W, N1, N2, N3] load layout (K_LOAD, V_LOAD), each broadcastable against the others:
        the warp [W, 1, 1] and dims 1 [1, N1, 1] and 2 [1, 1, N2] in its first three dims' layout, and dim 3 (the
        words) [1, 1, 1, N3] in LOAD."""
        L3: gl.constexpr = gl.SliceLayout(3, LOAD)
        w = gl.expand_dims(gl.expand_dims(gl.arange(0, LOAD.shape[0], layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1), 2)
        a = gl.expand_dims(gl.expand_dims(gl.arange(0, LOAD.shape[1], layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2)
        c = gl.expand_dims(gl.expand_dims(gl.arange(0, LOAD.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
        e = gl.arange(0, LOAD.shape[3], layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LOAD))))
        return w, a, c, gl.expand_dims(gl.expand_dims(gl.expand_dims(e, 0), 1), 2)

    @gluon.jit
    def store_output(o, m_all, l_tot, empty, out_ptr, part_o_ptr, part_lse_ptr, b, h, sp, num_splits, H: gl.constexpr,
                     GROUP: gl.constexpr, SPLIT: gl.constexpr):
        """A program's normalized O^T [D, NH] (row 16 i + 8 hr + g holding head dimension 16 g + 2 i + hr, the
        values' operand order) into the output (SPLIT False) or into its split's partial output and log-sum-exp
        m_all + log2(l_tot) (-inf where empty); columns past GROUP are padding, not stored."""
        D: gl.constexpr = o.shape[0]
        NH: gl.constexpr = o.shape[1]
        OL: gl.constexpr = o.type.layout
        mrow = gl.arange(0, D, layout=gl.SliceLayout(1, OL))
        dim_o = 16 * (mrow & 7) + 2 * (mrow >> 4) + ((mrow >> 3) & 1)
        n_o = gl.arange(0, NH, layout=gl.SliceLayout(0, OL))
        heads = h * GROUP + n_o
        o_mask = gl.expand_dims(n_o < GROUP, 0) & gl.expand_dims(mrow >= 0, 1)
        if not SPLIT:
            o_ptr = out_ptr + gl.expand_dims((b * (H * GROUP) + heads).to(gl.int64) * D, 0) + gl.expand_dims(dim_o, 1)
            gl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            part = (b * (H * GROUP) + heads).to(gl.int64) * num_splits + sp  # [NH]
            gl.store(part_o_ptr + gl.expand_dims(part * D, 0) + gl.expand_dims(dim_o, 1), o, mask=o_mask)
            LL: gl.constexpr = l_tot.type.layout
            lse = gl.where(empty, float("-inf"), m_all + gl.log2(gl.where(empty, 1.0, l_tot)))
            n_l = gl.arange(0, NH, layout=LL)
            part_l = (b * (H * GROUP) + h * GROUP + n_l).to(gl.int64) * num_splits + sp
            gl.store(part_lse_ptr + part_l, lse, mask=n_l < GROUP)

    @gluon.jit(do_not_specialize=("split_size", "num_splits"))  # as decode_attention.SPLIT_ARGS
    def _decode_fp4_gluon_kernel(
        q_ptr, qt_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        k0, k1, k2, k3, k4, v0, v1, v2,
        block_tables_ptr, seq_lens_ptr,
        sm_scale_log2, stride_q_seq, stride_q_head, stride_bt, split_size, num_splits,
        H: gl.constexpr, GROUP: gl.constexpr, BS: gl.constexpr, K_KO: gl.constexpr, SPLIT: gl.constexpr,
        TW: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
        K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, COPY_ROW: gl.constexpr, COPY_ROW2: gl.constexpr,
        S_ROW2: gl.constexpr, V_SCALE2: gl.constexpr, OFF64: gl.constexpr, STAGES: gl.constexpr,
        F16: gl.constexpr, PAIR: gl.constexpr, KG8: gl.constexpr, QVEC: gl.constexpr, KG16: gl.constexpr = False,
    ):
        D: gl.constexpr = 128
        WN: gl.constexpr = 4
        NG: gl.constexpr = 4  # groups of 32 per vector
        gl.static_assert(PAIR == 0 or STAGES == 4, "tile pairs need the 4-tile ring (pair_min_tiles)")
        gl.static_assert(not KG8 or (STAGES > 0 and K_KO == 0), "key groups of 8: the ring, no key slots")
        gl.static_assert(not KG16 or STAGES > 0, "key groups of 16: the ring")
        NH: gl.constexpr = 8
        h = gl.program_id(0)
        b = gl.program_id(1)
        sp = gl.program_id(2)
        start, end = program_split(seq_lens_ptr, b, sp, split_size, num_splits, WN * TW)
        bt_row = block_tables_ptr + b.to(gl.int64) * stride_bt
        q_base = q_ptr + b.to(gl.int64) * stride_q_seq + (h * GROUP) * stride_q_head
        qt_base = qt_ptr + (b * H + h).to(gl.int64) * (D * GROUP)  # query x sm_scale_log2 transposed, [D, GROUP]

        # index vectors in each layout
        S_ROW: gl.constexpr = gl.SliceLayout(2, MMA)  # [WN, TW] rows of S^T
        w_s = gl.expand_dims(gl.arange(0, WN, layout=gl.SliceLayout(1, S_ROW)), 1)
        r_s = gl.expand_dims(gl.arange(0, TW, layout=gl.SliceLayout(0, S_ROW)), 0)
        n_s = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        n_s3 = gl.expand_dims(gl.expand_dims(n_s, 0), 1)  # [1, 1, NH]
        if PAIR > 0:  # columns c and c + 4 are query head c (of two tiles, when paired)
            qt_cols = qt_base + n_s3 % 4
        else:
            qt_cols = qt_base + n_s3
        w_k, r_k, t_k, b_k = load_index(K_LOAD)  # warp, token, thread t's 16 bytes, word
        w_v, p_v, g_v, b_v = load_index(V_LOAD)  # warp, token pair, lane group g's 8 bytes, word
        off_kc = gl.expand_dims(r_k * (H * (D // 8)) + 4 * t_k, 3) + b_k  # [1, TW, 4, 4] words within a tile
        off_vc = gl.expand_dims(2 * p_v * (H * (D // 8)) + 2 * g_v, 3) + b_v  # token 2 pair, bytes 8g.. (words)
        tile = WN * TW
        full_end = start + (gl.maximum(end - start, 0) // tile) * tile
        pages = (k0, k1, k2, k3, k4, v0, v1, v2)

        if STAGES > 0:
            # The ring's first copies go out before the query is read: at small batch a program is a
            # chain of memory round trips (sequence length, block table, pages), and the query's own
            # loads and reductions below now overlap the pages' flight instead of preceding it.
            # The ring is two allocations, even and odd whole tiles, STAGES // 2 stages each, and the loop
            # is unrolled by two, so that a tile's reads and the copies issued beside them are in
            # different allocations: within one allocation indexed by a dynamic stage the compiler added
            # a second barrier per tile before the copies (7% of the stall samples, ncu), not knowing
            # that the loop's barrier already orders them. Whole tile j sits in set j % 2, stage
            # (j // 2) % (STAGES // 2); the partial tile (attended first) in whole tile STAGES - 1's slot.
            # Tile pairs: set q % 2 holds whole tiles 2q (stage 0) and 2q + 1 (stage 1), attended as pair q
            set0 = _ring_set(STAGES // 2, WN, TW, K_KO, KG8, KG16)
            set1 = _ring_set(STAGES // 2, WN, TW, K_KO, KG8, KG16)
            shifts = (8 * t_k, ((r_s * H + h) & 3) * 8, 8 * (g_v // 2))
            w_c = gl.expand_dims(gl.arange(0, WN, layout=gl.SliceLayout(1, COPY_ROW)), 1)
            r_c = gl.expand_dims(gl.arange(0, TW, layout=gl.SliceLayout(0, COPY_ROW)), 0)
            C2: gl.constexpr = gl.SliceLayout(2, COPY_ROW2)
            w_c2 = gl.expand_dims(gl.expand_dims(gl.arange(0, WN, layout=gl.SliceLayout(1, C2)), 1), 2)
            r_c2 = gl.expand_dims(gl.expand_dims(gl.arange(0, TW, layout=gl.SliceLayout(0, C2)), 0), 2)
            e_c2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY_ROW2)))
            e_c2 = gl.expand_dims(gl.expand_dims(e_c2, 0), 1)  # [1, 1, 2]
            cidx = (w_k, r_k, w_c, r_c, w_c2, r_c2, e_c2, w_v, p_v, off_kc, off_vc)
            # The order of tiles does not matter to the softmax, so the partial tile (if any) goes first and
            # the loop's copies and tiles are all whole, unmasked ones. Commit groups: the partial tile's
            # (empty without one), whole tiles 0 .. STAGES - 3 here, whole tile STAGES - 2 after the
            # partial tile, then one per loop step.
            has_part = full_end < end
            n_whole = (full_end - start) // tile
            if PAIR > 0:
                # Tile pairs where the split has at least PAIR whole tiles (shorter ones keep the deeper ring of
                # single tiles, measured faster there): each sequence's choice depends on its length only.
                use_pair = n_whole >= PAIR
                pp = _pair_plan(has_part, n_whole, start, end, full_end, tile)
                if use_pair:
                    _pair_issue_first(set0, set1, pp, start, end, bt_row, h, pages, cidx, BS, H, TW, K_KO, OFF64)
                else:
                    _ring_issue_first(set0, set1, has_part, n_whole, start, end, full_end, bt_row, h, pages, cidx, BS,
                                      H, TW, K_KO, OFF64, STAGES)
            else:
                _ring_issue_first(set0, set1, has_part, n_whole, start, end, full_end, bt_row, h, pages, cidx, BS, H,
                                  TW, K_KO, OFF64, STAGES)

        # The query as [D, heads] (a thread per dimension, coalesced: the scratch and the scale below;
        # the B operand further down loads it again, every warp the whole query). The key outlier slots
        # gather q[head, idx] for two heads with one 64-bit load from the query transposed: every program
        # of this (sequence, KV head) writes the same float32 values to its slot of the scratch buffer, and
        # the barrier makes this program's writes visible to its warps.
        QL: gl.constexpr = gl.BlockedLayout([1, NH], [32, 1], [WN, 1], [1, 0])
        dq = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, QL)), 1)
        nq2 = gl.expand_dims(gl.arange(0, NH, layout=gl.SliceLayout(0, QL)), 0)
        qm = (nq2 < GROUP) & (dq >= 0)
        qv = gl.load(q_base + nq2 * stride_q_head + dq, mask=qm, other=0.0).to(gl.float32)
        if K_KO > 0:
            gl.store(qt_base + dq * GROUP + nq2, qv * sm_scale_log2, mask=qm)
            _barrier()
        # Q^T [WN, 128, NH] as the B operand (every warp the whole query), k permuted as _unpack_k's:
        # dim = 32 t + 4 j + 2 x + hh for k = 16 j + 8 hh + 2 t + x. Tile pairs: the query in both column
        # halves (head c in columns c and c + 4). fp16 maps: the query in fp16 (11 significant bits, bf16's 8
        # exact) times _query_scale's power of two F; the keys come out as value x 2^-6 x scale and
        # _pow2_scale leaves 2^8 out, hence k_factor's 2^(6 - 8) / F.
        if PAIR > 0:
            QC: gl.constexpr = 4
        else:
            QC: gl.constexpr = NH
        if F16 and QVEC:
            # Lane 4 g + t holds dimensions 32 t .. 32 t + 31 of column g: 64 contiguous bytes, loaded as
            # four 16-byte loads and put in k order by a reshape and permute that move no data between
            # threads (QUERY_VECTOR below). No mask: a padding column repeats a head of the group (columns
            # are independent throughout: scores, softmax state, output, which is stored for real heads only).
            QV: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, NH, 4], [WN, 1, 1], [2, 1, 0])  # [WN, NH, D]
            nv = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(2, QV)))
            dv = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, QV)))
            wv = gl.arange(0, WN, layout=gl.SliceLayout(1, gl.SliceLayout(2, QV)))
            q_off = (gl.expand_dims(gl.expand_dims(wv * 0, 1), 2) + gl.expand_dims(gl.expand_dims(dv, 0), 1)
                     + gl.expand_dims(gl.expand_dims(gl.minimum(nv % QC, GROUP - 1) * stride_q_head, 0), 2))
            f = _query_scale(qv)
            qf = gl.load(q_base + q_off)
            qf = gl.reshape((qf.to(gl.float32) * f).to(gl.float16), [WN, NH, 4, 8, 2, 2])  # [w, g, t, j, x, hh]
            qf = gl.reshape(gl.permute(qf, [0, 3, 5, 2, 4, 1]), [WN, D, NH])  # [w, j, hh, t, x, g] = [w, k, g]
            qt = gl.convert_layout(qf, B_OP, assert_trivial=True)
        else:
            # two-byte loads in the operand's own layout: with bf16 maps (the loads above took 164-168
            # registers there, Triton 3.6) and where Launch found the build above over 128 registers
            kq = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_OP)))
            nq = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_OP)))
            dim_k = 32 * ((kq >> 1) & 3) + 4 * (kq >> 4) + 2 * (kq & 1) + ((kq >> 3) & 1)
            q_head = nq % QC
            if PAIR > 0:
                q_cols = (q_head < GROUP) & ((nq < 4) | use_pair)
            else:
                q_cols = q_head < GROUP
            q_off = gl.expand_dims(gl.expand_dims(dim_k, 0), 2) + gl.expand_dims(gl.expand_dims(q_head * stride_q_head, 0), 1)
            q_mask = gl.expand_dims(gl.expand_dims(q_cols, 0), 1)
            wq = gl.arange(0, WN, layout=gl.SliceLayout(1, gl.SliceLayout(2, B_OP)))
            q_off = q_off + gl.expand_dims(gl.expand_dims(wq * 0, 1), 2)
            qf = gl.load(q_base + q_off, mask=q_mask & (q_off >= 0), other=0.0)
            if F16:
                f = _query_scale(qv)
                qt = (qf.to(gl.float32) * f).to(gl.float16)
            else:
                qt = qf.to(gl.bfloat16)
        if F16:
            k_factor = sm_scale_log2 * 0.25 / f
        else:
            k_factor = sm_scale_log2

        m_i = gl.full([WN, NH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.zeros([WN, TW, NH], gl.float32, layout=MMA)  # per-thread partial sums, reduced at the end
        acc = gl.zeros([WN, D, NH], gl.float32, layout=MMA)  # O^T per warp
        if PAIR > 0:
            col_mask = (n_s3 % 4 < GROUP) & ((n_s3 < 4) | use_pair)
        else:
            col_mask = n_s3 < GROUP
        if STAGES == 0:  # loads straight into registers, where they are used
            off_ks = r_k * (H * NG) + t_k  # group t of 4
            off_vs = 2 * p_v * (H * NG) + g_v // 2
            lidx = (w_k, r_k, w_s, r_s, w_v, p_v, off_kc, off_ks, off_vc, off_vs)
            for n0 in range(start, full_end, tile):  # whole tiles: no masks
                data = _load_tile(n0, end, bt_row, h, pages, lidx, BS, H, TW, K_KO, OFF64, False)
                qo = _outlier_queries(qt_cols, col_mask, data[3], r_s >= 0, GROUP, False, K_KO)
                m_i, l_i, acc = _attend_tile(n0, end, m_i, l_i, acc, qt, qo, data, w_s, r_s, k_factor,
                                             TW, K_KO, False, A_OP, B_OP, F16)
            if full_end < end:  # the last, partial tile
                data = _load_tile(full_end, end, bt_row, h, pages, lidx, BS, H, TW, K_KO, OFF64, True)
                qo = _outlier_queries(qt_cols, col_mask, data[3], full_end + TW * w_s + r_s < end, GROUP, True,
                                      K_KO)
                m_i, l_i, acc = _attend_tile(full_end, end, m_i, l_i, acc, qt, qo, data, w_s, r_s, k_factor,
                                             TW, K_KO, True, A_OP, B_OP, F16)
        elif PAIR > 0:
            if use_pair:
                pstep = (start, end, bt_row, h, pages, cidx, shifts, qt, qt_cols, col_mask, w_s, r_s, k_factor,
                         _lane_half(w_s * 0 + r_s))
                m_i, l_i, acc = _pair_loop(m_i, l_i, acc, set0, set1, pp, pstep, BS, H, GROUP, TW, K_KO, OFF64, K_LOAD,
                                           V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16)
            else:
                step = (start, end, n_whole, bt_row, h, pages, cidx, shifts, qt, qt_cols, col_mask, w_s, r_s, k_factor)
                m_i, l_i, acc = _ring_loop(m_i, l_i, acc, set0, set1, has_part, full_end, step, BS, H, GROUP, TW, K_KO,
                                           OFF64, STAGES, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16)
        else:
            step = (start, end, n_whole, bt_row, h, pages, cidx, shifts, qt, qt_cols, col_mask, w_s, r_s, k_factor)
            m_i, l_i, acc = _ring_loop(m_i, l_i, acc, set0, set1, has_part, full_end, step, BS, H, GROUP, TW, K_KO,
                                       OFF64, STAGES, K_LOAD, V_LOAD, S_ROW, S_ROW2, V_SCALE2, A_OP, B_OP, F16)

        # merge the warps' states
        l_w = gl.sum(l_i, 1)  # [WN, NH]
        m_all = gl.max(m_i, 0)  # [NH]
        if PAIR > 0:  # paired: columns c and c + 4 are two states of head c
            m_all = gl.where(use_pair, gl.maximum(m_all, _partner(m_all)), m_all)
        m_all_use = gl.where(m_all == float("-inf"), 0.0, m_all)
        wgt = gl.exp2(m_i - gl.expand_dims(m_all_use, 0))  # [WN, NH]
        l_tot = gl.sum(l_w * wgt, 0)  # [NH]
        if PAIR > 0:
            l_tot = gl.where(use_pair, l_tot + _partner(l_tot), l_tot)
        empty = l_tot == 0.0  # an empty split (past this sequence's end) writes lse -inf and zeros
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_tot))
        o = gl.sum(acc * gl.expand_dims(wgt * gl.expand_dims(inv, 0), 1), 0)  # [D, NH]
        if PAIR > 0:
            o = gl.where(use_pair, o + _partner(o), o)
        store_output(o, m_all, l_tot, empty, out_ptr, part_o_ptr, part_lse_ptr, b, h, sp, num_splits, H, GROUP, SPLIT)


def unsupported(query, k_pages, v_pages, formats, block_size: int, num_stages: int | None = None) -> str | None:
    """Why this kernel cannot run a decode (None: it can). Its scope: head_dim 128, K groups of 32 with 0
    or 4 key outlier slots or K groups of 8 without (on the cp.async ring: num_stages not 0), K groups of 16
    with 0 or 4 slots on the ring while KEY_GROUPS_OF_16, V groups of 32 without slots, at most 8 query heads
    per KV head, pages of a multiple of the warp tile, page arrays aligned to 4 bytes; Gluon, on CUDA sm_80+."""
    num_kv_heads, head_dim = k_pages.codes.shape[2], query.shape[-1]
    if head_dim != 128:
        return f"head_dim {head_dim} (needs 128)"
    if formats[0].group(head_dim) == 16 and not KEY_GROUPS_OF_16:
        return "key groups of 16 (the KG16 build is off: KEY_GROUPS_OF_16)"
    if formats[0].group(head_dim) not in (8, 16, 32) or formats[1].group(head_dim) != 32:
        return "groups other than 32 (or 8 or 16 for keys)"
    if formats[0].group(head_dim) == 16 and num_stages == 0:
        return "key groups of 16 run on the cp.async ring only (num_stages > 0)"
    if formats[1].outliers:
        return "value outlier slots"
    if formats[0].group(head_dim) == 8 and formats[0].outliers:
        return "key groups of 8 with key outlier slots"
    if formats[0].group(head_dim) == 8 and num_stages == 0:
        return "key groups of 8 run on the cp.async ring only (num_stages > 0)"
    if formats[0].outliers not in (0, 4):
        return "key outlier slots other than 0 or 4"
    if query.shape[1] // num_kv_heads > N_HEADS:
        return f"more than {N_HEADS} query heads per KV head"
    if block_size % TW:
        return f"block_size {block_size} not a multiple of {TW}"
    if any(t.data_ptr() % 4 for t in (k_pages.codes, v_pages.codes, k_pages.out_vals, k_pages.out_idx,
                                      k_pages.scales, v_pages.scales, k_pages.scale_exp, v_pages.scale_exp)):
        return "page arrays not 4-byte aligned (codes, scales, exponents and outlier slots are read as 32-bit words)"
    return runtime_unsupported(query.device, (8, 0), "mma.m16n8k16 needs sm_80+")


def runtime_unsupported(device: torch.device, capability: tuple[int, int], why_older: str) -> str | None:
    """Why a Gluon kernel cannot run on `device` (None: it can): no Gluon in this Triton, not CUDA (or Triton
    interpreting), or a GPU older than `capability` (`why_older`). Both Gluon kernels' `unsupported` end here."""
    if not AVAILABLE:
        return "this Triton has no Gluon"
    if device.type != "cuda" or paged.interpreting():
        return "Gluon kernels run on CUDA, not on CPU or under TRITON_INTERPRET"
    if torch.cuda.get_device_capability(device) < capability:
        return why_older
    return None


def pair_min_tiles(group: int, stages: int, pair: int | None = None) -> int:
    """The kernel's PAIR for a launch: the fewest whole tiles in a split that takes tile pairs (pair, else
    PAIR_MIN_TILES), or 0 (never): pairs need padding columns (at most N_HEADS // 2 query heads per KV head)
    and the 4-tile ring (two pairs)."""
    return (PAIR_MIN_TILES if pair is None else pair) if group <= N_HEADS // 2 and stages == 4 else 0


def _pair_copies_aligned(k_pages, v_pages) -> bool:
    """Whether _copy_pair's alignment (restated to the compiler, which cannot see it through the join) holds:
    K codes (and key groups of 8's scale rows) from 16-byte, V codes and key outlier values from 8-byte
    boundaries (rows are whole multiples of those). `unsupported` asks only for 4 bytes: other pages take
    single tiles."""
    return (k_pages.codes.data_ptr() % 16 == 0 and v_pages.codes.data_ptr() % 8 == 0
            and k_pages.out_vals.data_ptr() % 8 == 0
            and (not _key_groups_of_8(k_pages) or k_pages.scales.data_ptr() % 16 == 0))


def _key_groups_of_8(k_pages) -> bool:
    """Whether K pages hold key groups of 8 (16 scale bytes per head_dim-128 vector): the KG8 build."""
    return k_pages.scales.shape[-1] == 16


def _key_groups_of_16(k_pages) -> bool:
    """Whether K pages hold key groups of 16 (8 scale bytes per head_dim-128 vector): the KG16 build."""
    return k_pages.scales.shape[-1] == 8


class Launch:
    """One decode's arguments for _decode_fp4_gluon_kernel, built once: programs_per_sm() compiles it
    (cached) to size the splits from its registers, run() launches it."""

    def __init__(self, query, k_pages, v_pages, block_tables, seq_lens, sm_scale_log2: float, k_outliers: int,
                 maxnreg: int | None = None, stages: int | None = None, fp16: bool | None = None,
                 pair: int | None = None):
        num_seqs, num_heads, _ = query.shape
        _, bs, num_kv_heads, _ = k_pages.codes.shape
        group = num_heads // num_kv_heads
        stages = STAGES if stages is None else stages
        if stages != 0 and (stages < 4 or stages & (stages - 1)):
            # the ring is two allocations of stages / 2 tiles (even and odd tiles); with one tile each
            # Triton 3.6 fails to compile the kernel
            raise ValueError(f"num_stages for the Gluon fp4 kernel must be 0 (loads into registers) or a power of "
                             f"two >= 4 (tiles in its cp.async ring), got {stages}")
        # scratch for the query x sm_scale_log2 transposed (the kernel writes it: the key outlier slots'
        # gathers read two heads at once there)
        q_t = query
        if k_outliers:
            q_t = torch.empty(num_seqs, num_kv_heads, query.shape[2], group, dtype=torch.float32, device=query.device)
        self.query, self.q_t = query, q_t
        self.pages = (k_pages.codes, k_pages.scales.view(k_pages.codes.dtype), k_pages.scale_exp, k_pages.out_vals,
                      k_pages.out_idx, v_pages.codes, v_pages.scales.view(v_pages.codes.dtype), v_pages.scale_exp)
        self.rest = (block_tables, seq_lens, sm_scale_log2, query.stride(0), query.stride(1), block_tables.stride(0))
        self.grid_hb = (num_kv_heads, num_seqs)
        # tile pairs (pair: the fewest whole tiles in a split that takes them, 0 never): at most 4 query
        # heads per KV head (the columns they use), the 4-tile ring (two pairs)
        pair = pair_min_tiles(group, stages, pair)
        if pair and ONE_COPY_PER_PAIR and not _pair_copies_aligned(k_pages, v_pages):
            pair = 0
        self._single_maxnreg = maxnreg  # the cap without pairs
        if pair and maxnreg is None:
            maxnreg = PAIR_MAXNREG
        self._pair_settled = False
        kg8 = _key_groups_of_8(k_pages)  # unsupported() allows them without key slots, on the ring
        if kg8 and stages == 0:
            raise ValueError("key groups of 8 run on the cp.async ring only (num_stages > 0)")
        if kg8 and k_outliers:
            raise ValueError("key groups of 8 run without key outlier slots")
        kg16 = _key_groups_of_16(k_pages)
        if kg16 and stages == 0:
            raise ValueError("key groups of 16 run on the cp.async ring only (num_stages > 0)")
        self.constexprs = dict(
            H=num_kv_heads, GROUP=group, BS=bs, K_KO=k_outliers, TW=TW, KG8=kg8, KG16=kg16,
            OFF64=max(k_pages.codes.numel(), v_pages.codes.numel()) >= 2 ** 31, **_layouts_cached(),
            STAGES=stages, F16=F16_DEFAULT if fp16 is None else fp16,
            PAIR=pair, QVEC=QUERY_VECTOR,
            num_warps=W, **({"maxnreg": maxnreg} if maxnreg else {}))

    def _key(self) -> tuple:
        return (self.query.device, self.query.dtype, self.rest[0].dtype, self.rest[1].dtype,
                tuple(sorted(self.constexprs.items())))

    def _compiled(self) -> tuple[int, int, int]:
        """(registers per thread, shared memory bytes per program, spilled bytes per thread) of this
        launch's kernel as it stands, compiled once per configuration."""
        key = self._key()
        if key not in _RESOURCES:
            part = torch.empty(1, dtype=torch.float32, device=self.query.device)
            kernel = _decode_fp4_gluon_kernel.warmup(
                self.query, self.q_t, self.query, part, part, *self.pages, *self.rest, 128, 2, SPLIT=True,
                grid=(1,), **self.constexprs)
            kernel._init_handles()
            _RESOURCES[key] = kernel.n_regs, kernel.metadata.shared, kernel.n_spills
        return _RESOURCES[key]

    def _settle_pair(self) -> None:
        """The build to run, the first of these that the compiler fits: tile pairs with the query's
        vector loads (QVEC), tile pairs with its two-byte loads, single tiles with vector loads, single
        tiles with two-byte loads. Tile pairs fit where they spill nothing at PAIR_MAXNREG registers (Triton 3.9
        spills 56-64 bytes per thread; 3.6, measured on the H200, none at the default PAIR, 128 bytes with pair=1
        and bf16 maps); vector loads where query_vector_fits (bf16 maps always load the query two bytes at a
        time). Compiles each candidate once per configuration, on the first launch or resources() call; the
        checks read the split build (SPLIT=True), whose loop is the one-split build's."""
        if self._pair_settled:
            return
        self._pair_settled = True
        pair, single = self.constexprs["PAIR"], {k: v for k, v in self.constexprs.items() if k != "maxnreg"}
        if self._single_maxnreg:
            single["maxnreg"] = self._single_maxnreg
        loads = (True, False) if self.constexprs["QVEC"] and self.constexprs["F16"] else (False,)
        builds = [dict(self.constexprs, QVEC=q) for q in loads] if pair else []
        builds += [dict(single, PAIR=0, QVEC=q) for q in loads]
        for build in builds:
            self.constexprs = build
            n_regs, _, n_spills = self._compiled()
            if (not build["PAIR"] or n_spills == 0) and (not build["QVEC"] or query_vector_fits(n_regs, n_spills)):
                return

    def resources(self) -> tuple[int, int]:
        """(registers per thread, shared memory bytes per program) of this launch's kernel, compiled
        once per configuration."""
        self._settle_pair()
        return self._compiled()[:2]

    def programs_per_sm(self) -> int:
        """Programs of this kernel resident per SM, from its compiled registers and shared memory
        (resources(): it sets the split count, so the grid fills whole waves)."""
        self._settle_pair()
        key = self._key()
        if key not in _PROGRAMS_PER_SM:
            n_regs, shared = self.resources()
            regs = -(-n_regs // 8) * 8  # allocated in steps of 8 per thread
            # Resident programs, but at most 4 for planning: whole waves of 5 x 132 slots made the split
            # rule ask for many short splits (103 of 320 tokens for 70B at 32k, batch 32), up to 65%
            # slower, and the 96-register variant that fits 5 was slower in every row measured
            # (docs/history.md, the fp4 kernel's third pass).
            # The cp.async ring takes shared memory too: 4 stages are 39 KiB per program.
            props = torch.cuda.get_device_properties(self.query.device)
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 164 << 10)  # else sm_80's, the least
            by_smem = smem_sm // (shared + 1024)  # 1 KiB per program is the system's
            _PROGRAMS_PER_SM[key] = max(1, min(PLAN_PROGRAMS_PER_SM, 65536 // (regs * 32 * W), by_smem))
        return _PROGRAMS_PER_SM[key]

    def constexprs_for(self, split_size: int) -> dict:
        """The build a launch with this longest split runs: where no split can reach PAIR whole tiles, the
        single-tile kernel (the paired kernel's other branch without it: measured 1-2% faster there,
        docs/history.md, the fp4 kernel's sixteenth step), under the paired kernel's register cap, which the
        split plan was made for (uncapped, Triton 3.6 takes 132-137 registers at 3 query heads per KV head,
        3 programs per SM; capped at 128 it spills nothing at 1-4). Either build pairs a split exactly when
        it has PAIR whole tiles, so a sequence's result does not depend on which one ran."""
        pair = self.constexprs["PAIR"]
        if not pair or split_size // (W * TW) >= pair:
            return self.constexprs
        # The query's loads (QVEC) are the paired build's, not checked again for this one: on Triton 3.6 it
        # fits with vector loads wherever the paired build does (128 / 127 registers, no spill: default,
        # key groups of 8, 64-bit offsets; compiled with experiments/kernel_sass.py's compiler).
        return dict(self.constexprs, PAIR=0)

    def run(self, out, part_o, part_lse, split_size: int, num_splits: int) -> None:
        """Launch over (KV head, sequence, split); split_size (a multiple of W * TW) is the longest
        split, each sequence's length is split num_splits ways in whole tiles."""
        self._settle_pair()
        _decode_fp4_gluon_kernel[(*self.grid_hb, num_splits)](
            self.query, self.q_t, out, part_o, part_lse, *self.pages, *self.rest, split_size, num_splits,
            SPLIT=num_splits > 1, **self.constexprs_for(split_size))


PLAN_PROGRAMS_PER_SM = 4
# Tiles in the cp.async ring, a power of 2 >= 4: two allocations of STAGES / 2 (0: each tile loaded into
# registers where it is used). On the H200 the ring was faster than loads into registers in 12 of 16
# rows for the 8B shape (0.97-1.16x) and 15 of 16 for 70B at TP 8 (0.98-1.10x); docs/history.md,
# docs/history.md, the fp4 kernel's fourth pass.
STAGES = 4
# Key groups of 16 (8 key scale bytes per head_dim-128 vector, with 0 or 4 key outlier slots: the accuracy
# option of bench/RESULTS.md "KV quality", +0.041 nats per token on SmolLM2 against the default's +0.051) on
# this kernel, the KG16 build: its scale rows copied as key groups of 8's are (_copy_rows4), each thread's two
# scales picked out of its word (_read_k). It compiles for sm_90 (Triton 3.6 and 3.9) but has not run on a GPU
# yet: until tests/test_kernels_gluon.py's KG16 tests pass there, those pages keep the Triton fp4 kernel.
KEY_GROUPS_OF_16 = False
# Keys and values through fp16 MMAs, the codes widened by the hardware's E4M3 -> fp16 conversion
# (_K16_UNPACK_PTX, _V16_UNPACK_PTX: 36.6 loop instructions per (token, KV head) for the 8B shape), or
# through bf16 MMAs on bf16 bit arithmetic (paged._FP4_UNPACK_BODY: 38.6). On the H200 fp16 was 1-8%
# faster for the 8B shape from 8k tokens and batch 8 and for 70B at TP 8 at batch 128, and 1-5% slower
# at batch 1, for 70B up to batch 32 and at 1k tokens (docs/history.md, the fp4 kernel's fifth pass). It
# is the default for every batch: choosing by batch size made a sequence's rounding depend on the
# batch it ran in (a CUDA-graph bucket against the eager batch; tests/test_engine_gpu.py found it).
# Launch's fp16 (decode_attention's) forces either.
F16_DEFAULT = True
# Tile pairs (two tiles per pass in the padding columns, at most 4 query heads per KV head) for splits of at
# least this many whole tiles (64 tokens each); shorter ones run single tiles. On the H200, 8B shape: 1.02-1.06x
# at batch 8-32, 8k-32k, with splits of 16-256 tiles; with pairs at every length, splits of 3-8 tiles were
# 0.955-0.983x (one pair ahead in the ring against two to three single tiles); docs/history.md, the fp4
# kernel's fifteenth step. Launch's pair (decode_attention's) overrides it, 0 never pairs.
PAIR_MIN_TILES = 16
# The paired kernel takes 161-168 registers uncapped (3 programs per SM); at 128 (4 per SM, as the single-tile
# kernel) Triton 3.6 spills nothing at the default PAIR (128 bytes with pair=1 and bf16 maps), 3.9 spills 56-64
# bytes per thread (experiments/kernel_sass.py), and Launch then runs single tiles (_settle_pair).
PAIR_MAXNREG = 128
# The query's MMA operand by four 16-byte loads per thread (QVEC) instead of 32 two-byte loads: on the H200
# (Triton 3.6) 1.04-1.07x at 70B-TP8 shapes, 1.02-1.03x at batch 1 and 8B 8k batch 8, 0.99-1.01x at 8B
# from 8k batch 32 and 32k batch 8, outputs bit-equal (docs/history.md, the fp4 kernel's twenty-first step).
# Where a build with them takes more than 128 registers or spills, Launch takes the two-byte loads: Triton
# 3.9, key groups of 8 at 70B-TP8 shapes (148 registers) and 8B single tiles (8 bytes); Triton 3.6, no
# default build, but the 8B pairs with key groups of 8 and 64-bit offsets (8 bytes).
QUERY_VECTOR = True


def query_vector_fits(n_regs: int, n_spills: int) -> bool:
    """Whether a build with the query's vector loads keeps 4 programs per SM (at most 128 registers,
    nothing spilled); Launch falls back to the two-byte loads otherwise."""
    return n_regs <= 128 and n_spills == 0


_PROGRAMS_PER_SM: dict = {}
_RESOURCES: dict = {}
_LAYOUTS: dict = {}


def _layouts_cached() -> dict:
    if not _LAYOUTS:
        _LAYOUTS.update(layouts())
    return _LAYOUTS
