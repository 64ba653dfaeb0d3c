"""store_kv (Triton, interpreted on CPU) against the torch path that defines the bits.

fp4 and fp8 must write the same bytes as app/kernels/fp4.py and fp8.py into every page array; slots the step
does not own (and padding slots, -1) must keep their poison.
"""

import pytest
import torch
import triton
import triton.language as tl

from app.kernels import fp4
from app.kernels.attention_ref import dequantize_pages
from app.kernels.store_kv import _e2m1_code, _e2m1_round, store_kv, store_kv_ref
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
    for pages_got, pages_want in zip(got[:2], want[:2]):
        for a, b in zip(page_bits(pages_got), page_bits(pages_want)):
            assert torch.equal(a, b)



@pytest.mark.parametrize("name", ["fp4", "fp4-zscore", "fp4-kg8"])
@pytest.mark.parametrize("block_r,num_warps", [(1, 1), (4, 1), (2, 2)])
@interpreted
def test_every_store_build_writes_the_reference_bits(name, block_r, num_warps):
    """The builds launch_for picks on a GPU (the interpreter takes the widest): one vector per one-warp
    program (decode steps), four (prefill chunks), and one that spreads a program's vectors over two warps."""
    key, value, slots = _case(19, 2, 128, 5, 16, torch.bfloat16, seed=3)
    got = _stored(name, key, value, slots, 5, 16, kernel=True, block_r=block_r, num_warps=num_warps)
    want = _stored(name, key, value, slots, 5, 16, kernel=False)
    for pages_got, pages_want in zip(got[:2], want[:2]):
        for a, b in zip(page_bits(pages_got), page_bits(pages_want)):
            assert torch.equal(a, b)

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
