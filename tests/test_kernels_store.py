"""store_kv (Triton, interpreted on CPU) against the torch path that defines the bits.

fp4 and fp8 must write the same bytes as app/kernels/fp4.py and fp8.py into every page array; slots the step
does not own (and padding slots, -1) must keep their poison.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from app.kernels import fp4, paged
from app.kernels.attention_ref import dequantize_pages
from app.kernels.fp4 import FP4Format
from app.kernels.store_kv import (_div_by_e4m3, _e2m1_code, _e2m1_round, _e4m3_reciprocal, _target_reciprocal, store_kv,
                                  store_kv_ref)
from kernels_testing import FORMATS, interpreted, keys_like_llama, page_bits, poison, random_pages


def _stored(name, key, value, slots, num_blocks, block_size, kernel: bool, **launch):
    num_kv_heads, head_dim = key.shape[1:]
    k_pages, v_pages, formats = random_pages(name, num_blocks, block_size, num_kv_heads, head_dim)
    poison(k_pages), poison(v_pages)
    if kernel:
        store_kv(key, value, slots, k_pages, v_pages, formats, **launch)
    else:
        store_kv_ref(key, value, slots, k_pages, v_pages, formats)
    return k_pages, v_pages, formats


def _assert_same_bits(got, want):
    """Every page array of K and V pages (got, want) holds the same bytes."""
    for pages_got, pages_want in zip(got, want):
        for a, b in zip(page_bits(pages_got), page_bits(pages_want)):
            assert torch.equal(a, b)


def _case(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(num_tokens, 1, 1).uniform_(-3, 3, generator=gen)  # 1e-3 .. 1e3
    key = keys_like_llama(num_tokens, num_kv_heads, head_dim, gen=gen) * magnitude
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value[::5, :, :32] *= 1e-7  # groups far below the vector's largest: their scales are raised to 2^-6
    key[::7, :, -32:] *= 1e-7
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # a padding token: written nowhere
    return key.to(dtype), value.to(dtype), slots


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 1)])
@interpreted
def test_store_writes_the_reference_bits(name, head_dim, block_size):
    num_blocks = 64 // block_size + 3
    key, value, slots = _case(37, 2, head_dim, num_blocks, block_size, torch.float32)
    got = _stored(name, key, value, slots, num_blocks, block_size, kernel=True)
    want = _stored(name, key, value, slots, num_blocks, block_size, kernel=False)
    _assert_same_bits(got[:2], want[:2])


@pytest.mark.parametrize("name", ["fp4", "fp4-zscore", "fp4-kg8"])
@pytest.mark.parametrize("block_r,num_warps", [(1, 1), (4, 1), (2, 2)])
@interpreted
def test_every_store_build_writes_the_reference_bits(name, block_r, num_warps):
    """The builds launch_for picks on a GPU (the interpreter takes the widest): one vector per one-warp
    program (decode steps), four (prefill chunks), and one that spreads a program's vectors over two warps."""
    key, value, slots = _case(19, 2, 128, 5, 16, torch.bfloat16, seed=3)
    got = _stored(name, key, value, slots, 5, 16, kernel=True, block_r=block_r, num_warps=num_warps)
    want = _stored(name, key, value, slots, 5, 16, kernel=False)
    _assert_same_bits(got[:2], want[:2])


def _rows(pages, slots):
    """The vectors of the given slots (the rest of the pages holds poison)."""
    if isinstance(pages, torch.Tensor):
        return pages.flatten(0, 1)[slots]
    rows = [t.flatten(0, 1)[slots] for t in pages]
    return tuple(rows) if type(pages) is tuple else type(pages)(*rows)


@pytest.mark.parametrize("name", ["fp4", "fp8"])
@interpreted
def test_store_from_bf16_matches_the_reference(name):
    """The engine stores bf16 K/V, where equal magnitudes happen: among outlier candidates of equal
    magnitude the kernel and the reference both take the lowest index first, so every vector
    dequantizes to the same values."""
    key, value, slots = _case(64, 4, 128, 8, 16, torch.bfloat16, seed=3)
    got = _stored(name, key, value, slots, 8, 16, kernel=True)
    want = _stored(name, key, value, slots, 8, 16, kernel=False)
    written = slots[slots >= 0]
    for i in range(2):
        a = dequantize_pages(_rows(got[i], written), got[2][i])
        b = dequantize_pages(_rows(want[i], written), want[2][i])
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_store_refuses_non_finite_and_writes_nothing():
    key, value, slots = _case(5, 2, 64, 4, 16, torch.float32)
    value[3, 1, 7] = float("nan")
    k_pages, v_pages, formats = random_pages("fp4", 4, 16, 2, 64)
    before = [t.clone() for t in page_bits(k_pages) + page_bits(v_pages)]
    with pytest.raises(ValueError, match=r"non-finite value in K/V at index \[3, 1, 7\]"):
        store_kv(key, value, slots, k_pages, v_pages, formats)
    assert all(torch.equal(a, b) for a, b in zip(before, page_bits(k_pages) + page_bits(v_pages)))


def test_store_checks_its_inputs():
    key, value, slots = _case(4, 2, 64, 4, 16, torch.float32)
    k_pages, v_pages, formats = random_pages("fp4", 4, 16, 2, 64)
    with pytest.raises(AssertionError, match="fp4 pages need their FP4Format"):
        store_kv(key, value, slots, k_pages, v_pages)
    with pytest.raises(AssertionError, match="hold 2 heads x 64, K/V have 2 x 32"):
        store_kv(key[..., :32], value[..., :32], slots, k_pages, v_pages, formats)


@triton.jit
def _round_and_code_kernel(x_ptr, val_ptr, code_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    v = _e2m1_round(tl.load(x_ptr + i, mask=mask, other=0.0))
    tl.store(val_ptr + i, v, mask=mask)
    tl.store(code_ptr + i, _e2m1_code(v), mask=mask)


def _edge_floats() -> torch.Tensor:
    """Every E2M1 value and midpoint, their float32 neighbours within 3 ulps, the binades' edges, values far
    past 6, subnormals and zeros, both signs, and a log-uniform sweep of 1e-8 .. 1e8."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0,
                           12.0, 16.0, 1e30, 3.0e38, 1e-45, 1e-40, 1.17549435e-38])
    bits = points.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    near = near[near.isfinite() & (near >= 0)]
    sweep = 10 ** torch.linspace(-8, 8, 20001)
    x = torch.cat([near, sweep])
    return torch.cat([x, -x])


@interpreted
def test_e2m1_rounding_gives_the_reference_codes():
    """The store's add-and-subtract rounding to the E2M1 grid against fp4.e2m1_encode / e2m1_decode, which
    define the codes: the value and the code of every float32 near the grid's points and edges."""
    x = _edge_floats()
    val, code = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int32)
    _round_and_code_kernel[(triton.cdiv(x.numel(), 1024),)](x, val, code, x.numel(), BLOCK=1024)
    want = fp4.e2m1_encode(x)
    assert torch.equal(code, want.to(torch.int32)), x[code != want.to(torch.int32)][:8]
    assert torch.equal(val.abs(), fp4.e2m1_decode(want).abs())


def test_markstein_division_by_e4m3_significands_is_exact():
    """The store divides by a candidate scale (an E4M3 value) as x * r + one correction by the remainder, with
    r = RN(1 / s): for every float32 significand of x and each of E4M3's 8 significands this equals IEEE x / s.
    Emulated in float64: the products are exact there, the remainder must be exact in float32, and no sum may
    land on a float32 midpoint (where rounding twice could differ from an fma's once)."""
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(127 << 23)).view(np.float32)  # [1, 2)
    for m in range(8):
        s = np.float32(1 + m / 8)
        r = np.float32(1) / s
        y = x * r
        rem64 = x.astype(np.float64) - np.float64(s) * y.astype(np.float64)
        rem = rem64.astype(np.float32)
        assert np.array_equal(rem.astype(np.float64), rem64), f"remainder not exact at significand {s}"
        q64 = y.astype(np.float64) + rem.astype(np.float64) * np.float64(r)
        q = q64.astype(np.float32)
        for step in (np.inf, -np.inf):
            other = np.nextafter(q, np.float32(step)).astype(np.float64)
            assert not np.any(q64 == (q.astype(np.float64) + other) / 2), f"a midpoint at significand {s}"
        assert np.array_equal(q, x / s), f"differs from x / s at significand {s}"


@triton.jit
def _divide_kernel(x_ptr, sc_ptr, q_ptr, v_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=1.0)
    sc = tl.load(sc_ptr + i, mask=mask, other=56)
    q = _div_by_e4m3(x, paged.e4m3_to_f32(sc), _e4m3_reciprocal(sc))
    tl.store(q_ptr + i, q, mask=mask)
    tl.store(v_ptr + i, _e2m1_round(q), mask=mask)


@interpreted
def test_store_division_matches_ieee_for_every_scale_code():
    """_div_by_e4m3 with _e4m3_reciprocal's table against IEEE division, over every normal E4M3 scale code (the
    candidate scales are clamped to >= 2^-6) and values of every magnitude the store meets: equal for values
    from 2^-100 up, and rounded onto the E2M1 grid equal everywhere."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(4096, generator=gen) + 1) * torch.exp2(torch.randint(-140, 12, (4096,), generator=gen).float())
    x = torch.cat([x, -x, torch.tensor([0.0, 1.0, 1.5, 448.0 * 6, 2.0 ** -126])])
    codes = torch.arange(8, 127, dtype=torch.int32)  # 2^-6 .. 448
    xs, cs = torch.broadcast_tensors(x[:, None], codes[None, :])
    xs, cs = xs.contiguous().flatten(), cs.contiguous().flatten()
    q, v = torch.empty_like(xs), torch.empty_like(xs)
    _divide_kernel[(triton.cdiv(xs.numel(), 4096),)](xs, cs, q, v, xs.numel(), BLOCK=4096)
    ieee = xs / cs.to(torch.uint8).view(torch.float8_e4m3fn).float()
    normal = xs.abs() >= 2.0 ** -100  # below, the remainder may underflow: the quotient is then < 2^-92
    assert torch.equal(q[normal], ieee[normal])
    want = fp4.e2m1_decode(fp4.e2m1_encode(ieee))
    assert torch.equal(v.abs(), want.abs())
    assert torch.equal(v[v != 0] < 0, ieee[v != 0] < 0)


@interpreted
def test_scale_targets_off_the_e4m3_grid_write_the_reference_bits():
    """Targets whose significand is an E4M3 one (the default 6, 5, 4.5, 4) are divided by through their
    reciprocal; others (4.25, 3.3) through an IEEE division: both write the reference's bits."""
    formats = (FP4Format(group_size=32, outliers=4, scale_targets=(6.0, 4.25, 3.3)),
               FP4Format(group_size=16, scale_targets=(5.5, 4.25)))
    assert [_target_reciprocal(t) > 0 for t in (6.0, 5.0, 4.5, 4.0, 5.5, 4.25, 3.3)] == [True] * 5 + [False] * 2
    key, value, slots = _case(11, 2, 64, 4, 16, torch.float32, seed=7)
    pages = []
    for store in (store_kv, store_kv_ref):
        kp, vp = (paged.quantize_pages(torch.zeros(4, 16, 2, 64), "fp4", f) for f in formats)
        poison(kp), poison(vp)
        store(key, value, slots, kp, vp, formats)
        pages.append((kp, vp))
    _assert_same_bits(*pages)
