"""The FP4 and FP8 KV formats (app/kernels/fp4.py, fp8.py) and the fp8/fp4 KV caches built on them."""

import math

import pytest
import torch

from app.config import FP4Config
from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCacheSpec, create_kv_cache, kv_bytes_per_token
from app.kernels.fp4 import (
    E2M1_VALUES,
    FP4Format,
    e2m1_decode,
    e2m1_encode,
    fp4_dequantize,
    fp4_quantize,
    hadamard_rotation,
    pack_nibbles,
    unpack_nibbles,
)
from app.kernels.fp8 import fp8_dequantize, fp8_quantize


def e2m1_nearest_even(v: float) -> float:
    """Independent reference: nearest grid value, ties to the even code index, saturating."""
    a = min(abs(v), 6.0)
    dist = [abs(a - g) for g in E2M1_VALUES]
    best = min(dist)
    idx = [i for i, d in enumerate(dist) if d == best]
    code = idx[0] if len(idx) == 1 else [i for i in idx if i % 2 == 0][0]
    return math.copysign(E2M1_VALUES[code], v) if E2M1_VALUES[code] else 0.0


def test_e2m1_grid_ties_and_saturation():
    grid = [s * g for g in E2M1_VALUES for s in (1, -1)]
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    probes = grid + mids + [-m for m in mids] + [0.1, 0.3, 0.74, 2.49, 2.51, 5.01, 6.5, 7.0, 1e9, -1e9]
    x = torch.tensor(probes)
    got = e2m1_decode(e2m1_encode(x)).tolist()
    assert got == [e2m1_nearest_even(v) for v in probes]
    # Spelled out: ties go to the even code, beyond 6 saturates.
    assert e2m1_decode(e2m1_encode(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0]))).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert e2m1_encode(torch.tensor([-0.1])).item() == 0  # no negative zero code
    assert e2m1_encode(torch.tensor([-6.0])).item() == 0b1111


def test_nibble_packing():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    rand = torch.randint(0, 16, (7, 32), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(rand)), rand)


def test_error_within_half_grid_step_of_the_group_scale():
    """|x - x_hat| <= max(ds, 6 (s - ds)): rounding on the E2M1 grid moves a value by at most one
    scale unit (the widest gap, 4..6, is 2 units); saturation loses at most 6 (s - ds) when E4M3
    rounded the scale s = amax/6 down to ds."""
    torch.manual_seed(0)
    x = torch.randn(256, 64) * torch.logspace(-3, 3, 256)[:, None]
    fmt = FP4Format(group_size=16)
    q = fp4_quantize(x, fmt)
    x_hat = fp4_dequantize(q, fmt)
    s = x.view(256, 4, 16).abs().amax(-1) / 6
    ds = q.scales.float() * torch.exp2(q.scale_exp.float() - 127)[:, None]
    bound = torch.maximum(ds, 6 * (s - ds).clamp(min=0))
    err = (x - x_hat).abs().view(256, 4, 16)
    assert (err <= bound[..., None] * (1 + 1e-6)).all()
    # Relative RMS error of Gaussian data: about 9.5% (E2M1 has 3 magnitude bits per group).
    rel = (x - x_hat).norm(dim=-1) / x.norm(dim=-1)
    assert rel.mean() < 0.11


def test_group_scales_are_never_e4m3_subnormals():
    """A group under 2^-6 / 448 of the vector's largest gets the scale 2^-6 (E4M3's smallest normal),
    so kernels decode scales with one integer multiply-add; its values still round within one scale
    unit, and zero groups stay exactly zero."""
    torch.manual_seed(3)
    x = torch.randn(64, 128)
    x[:, 32:64] *= torch.logspace(-12, 0, 64)[:, None]
    x[::8, 96:] = 0.0
    fmt = FP4Format(group_size=32, outliers=2, scale_targets=(6.0, 5.0, 4.5, 4.0))
    q = fp4_quantize(x, fmt)
    bits = q.scales.view(torch.uint8).int()
    assert ((bits >> 3) & 0xF).min() >= 1  # exponent field: never subnormal (or zero)
    x_hat = fp4_dequantize(q, fmt)
    ds = q.scales.float() * torch.exp2(q.scale_exp.float() - 127)[:, None]
    err = (x - x_hat).abs().view(64, 4, 32).amax(-1)
    assert (err[:, 1] <= ds[:, 1] * (1 + 1e-6)).all()
    assert (x_hat[::8, 96:] == 0).all()
    assert ((x - x_hat).norm(dim=-1) / x.norm(dim=-1)).max() < 0.15


@pytest.mark.parametrize("fmt", [FP4Format(), FP4Format(group_size=32, outliers=2, scale_targets=(6.0, 5.0, 4.5, 4.0))])
def test_second_level_scale_keeps_any_magnitude(fmt):
    torch.manual_seed(1)
    base = torch.randn(64, 128)
    errors = []
    for mag in (1e-20, 1e-6, 1.0, 1e6, 1e30):
        x = base * mag
        x_hat = fp4_dequantize(fp4_quantize(x, fmt), fmt)
        errors.append(((x - x_hat).norm() / x.norm()).item())
    assert max(errors) - min(errors) < 1e-3, errors  # the same relative error at every scale


def test_group_is_gcd_of_group_size_and_head_dim():
    fmt = FP4Format(group_size=32, outliers=1)
    assert [fmt.group(d) for d in (8, 48, 80, 96, 128)] == [8, 16, 16, 32, 32]
    torch.manual_seed(7)
    x = torch.randn(20, 80)
    q = fp4_quantize(x, fmt)
    assert q.scales.shape == (20, 5)
    assert ((fp4_dequantize(q, fmt) - x).norm() / x.norm()) < 0.11
    wide = FP4Format()  # no outlier slots: any even head_dim, even beyond uint8 indices
    y = torch.randn(3, 512)
    assert ((fp4_dequantize(fp4_quantize(y, wide), wide) - y).norm() / y.norm()) < 0.11
    with pytest.raises(ValueError, match="with outlier slots head_dim must be <= 256"):
        fp4_quantize(y, fmt)


def test_zeros_and_non_finite():
    fmt = FP4Format(outliers=2)
    x = torch.zeros(3, 32)
    x[1, 16:] = torch.randn(16)  # one group zero, one not
    q = fp4_quantize(x, fmt)
    x_hat = fp4_dequantize(q, fmt)
    assert torch.equal(x_hat[0], torch.zeros(32)) and torch.equal(x_hat[1, :16], torch.zeros(16))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.randn(2, 32)
        y[1, 5] = bad
        with pytest.raises(ValueError, match=r"non-finite value in K/V at index \[1, 5\]"):
            fp4_quantize(y, fmt)
        with pytest.raises(ValueError, match="non-finite"):
            fp8_quantize(y)


def test_outliers_are_kept_exactly_and_spare_their_group():
    torch.manual_seed(2)
    x = torch.randn(100, 128)
    x[:, 37] = 500.0 * torch.sign(torch.randn(100))
    plain, kept = FP4Format(), FP4Format(outliers=1)
    x_plain = fp4_dequantize(fp4_quantize(x, plain), plain)
    q = fp4_quantize(x, kept)
    x_kept = fp4_dequantize(q, kept)
    assert (q.out_idx[:, 0] == 37).all()
    assert torch.equal(x_kept[:, 37], x[:, 37].bfloat16().float())
    group = [i for i in range(32, 48) if i != 37]  # the outlier's neighbours: crushed without retention
    err_plain = (x_plain[:, group] - x[:, group]).norm() / x[:, group].norm()
    err_kept = (x_kept[:, group] - x[:, group]).norm() / x[:, group].norm()
    assert err_plain > 0.9 and err_kept < 0.12


def test_zscore_mode_keeps_only_real_outliers():
    x = torch.full((2, 64), 0.5)
    x[0, ::2] = -0.5
    x[0, 3], x[0, 50] = 40.0, -30.0
    fmt = FP4Format(outliers=4, outlier_mode="zscore", zscore=3.0)
    q = fp4_quantize(x, fmt)
    assert sorted(q.out_idx[0][q.out_vals[0] != 0].tolist()) == [3, 50]
    assert (q.out_vals[1] == 0).all()  # a constant vector has no outliers
    x_hat = fp4_dequantize(q, fmt)
    assert x_hat[0, 3] == 40.0 and x_hat[0, 50] == -30.0
    # +-0.5 sit on the grid (6 x amax/6); only E4M3's rounding of the scale (<= 2^-4) moves them.
    assert torch.allclose(x_hat, x, rtol=2**-4, atol=0)


def test_rotation_is_orthogonal_fixed_and_round_trips():
    r = hadamard_rotation(128)
    assert torch.allclose(r @ r.T, torch.eye(128), atol=1e-6)
    assert torch.equal(r, hadamard_rotation(128))
    torch.manual_seed(3)
    x = torch.randn(50, 128)
    x[:, 5] += 40  # a massive channel: rotated, it spreads evenly over all 128 dims
    assert (x @ r).abs().max() < 8
    fmt = FP4Format(rotate=True)
    x_hat = fp4_dequantize(fp4_quantize(x, fmt, r), fmt, r)
    assert ((x_hat - x).norm(dim=-1) / x.norm(dim=-1)).max() < 0.12


def test_fp8_per_token_head():
    torch.manual_seed(4)
    x = torch.randn(10, 4, 128) * 3
    values, scale = fp8_quantize(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (10, 4)
    x_hat = fp8_dequantize(values, scale)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for values in its normal range.
    normal = x.abs() >= scale[..., None] * 2**-6
    assert ((x_hat - x).abs() <= x.abs() * 2**-4 + 1e-7)[normal].all()


def spec(head_dim=128, heads=2, layers=1, block_size=4):
    return KVCacheSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
                       compute_dtype=torch.float32)


def test_bytes_per_token_and_capacity_at_head_dim_128():
    s = spec(heads=1)
    default = FP4Config().formats()
    bf16 = kv_bytes_per_token("bf16", s)
    fp4 = kv_bytes_per_token("fp4", s, default)
    assert bf16 == 512 and kv_bytes_per_token("fp8", s) == 264
    assert fp4 <= 150 and bf16 / fp4 >= 3.4
    # The allocated arrays are exactly what the accounting says.
    cache = create_kv_cache("fp4", s, 10, "cpu", default)
    allocated = sum(t.numel() * t.element_size() for page in cache.pages for t in page)
    assert allocated == fp4 * 10 * s.block_size


@pytest.mark.parametrize("fp4_cfg", [FP4Config(), FP4Config(rotate=True, value_outliers=1), FP4Config(key_outliers=0)])
def test_cache_attention_matches_reference_on_dequantized_pages(fp4_cfg):
    """The cache's attention (rotated basis when rotating) equals plain attention over the
    dequantized pages, and a failed store (NaN) leaves the pages untouched."""
    from app.kernels.attention_ref import causal_attention_ref

    torch.manual_seed(5)
    s = spec(head_dim=64, heads=2, block_size=4)
    cache = create_kv_cache("fp4", s, 8, "cpu", fp4_cfg.formats())
    k, v = torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    slots = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 0, 1])  # blocks 2, 5, 0
    cache.store(0, k, v, slots)
    q = torch.randn(3, 4, 64)
    meta = AttentionMetadata(slot_mapping=slots[7:], block_tables=torch.tensor([[2, 5, 0]]), seq_lens=[10],
                             query_start_loc=[0, 3])
    out = cache.attention(0, q, meta, 0.125)
    kk, vv = cache.read_blocks(0, torch.tensor([2, 5, 0]))
    ref = causal_attention_ref(q, kk.flatten(0, 1)[:10], vv.flatten(0, 1)[:10], 0.125)
    assert torch.allclose(out, ref, atol=1e-5)
    assert (kk.flatten(0, 1)[:10] - k).norm() / k.norm() < 0.12
    before = [t.clone() for page in cache.pages for t in page]
    bad_v = v.clone()
    bad_v[3, 1, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        cache.store(0, k, bad_v, slots)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for page in cache.pages for t in page]))


def test_zscore_threshold_that_can_never_fire_is_rejected():
    with pytest.raises(ValueError, match=r"zscore \(3.0\) must be below sqrt\(head_dim - 1\) = 2.65"):
        fp4_quantize(torch.randn(2, 8), FP4Format(group_size=8, outliers=2, outlier_mode="zscore", zscore=3.0))


def test_scale_search_never_increases_a_groups_error():
    torch.manual_seed(6)
    x = torch.randn(500, 64) * torch.rand(500, 1) * 10
    plain, search = FP4Format(), FP4Format(scale_targets=(6.0, 5.0, 4.5, 4.0))
    e_plain = (fp4_dequantize(fp4_quantize(x, plain), plain) - x).view(500, 4, 16).square().sum(-1)
    e_search = (fp4_dequantize(fp4_quantize(x, search), search) - x).view(500, 4, 16).square().sum(-1)
    assert (e_search <= e_plain + 1e-9).all()
    assert e_search.sum() < 0.9 * e_plain.sum()  # on Gaussian groups it saves over 10% of the MSE


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"fp4": {"key_group_size": 3}}, "group sizes must be even"),
    ({"fp4": {"scale_targets": ()}}, "scale_targets must be one or more values"),
    ({"fp4": {"scale_targets": (7.0,)}}, "scale_targets must be one or more values"),
    ({"fp4": {"key_outliers": 17}}, "key_outliers"),
])
def test_bad_kv_settings_fail_before_anything_loads(kwargs, match):
    from pydantic import ValidationError

    from app.config import EngineConfig

    with pytest.raises(ValidationError, match=match):
        EngineConfig(**kwargs)


def test_e2m1_boundaries_on_the_quotient_are_boundaries_on_the_product():
    """For every e4m3 scale the store can pick (normal, >= 2^-6) and every E2M1 rounding boundary b,
    fl(x / s) > b exactly when x > b s (and >= alike), b s being exact: the CPU store's AVX2 loop
    codes |x| by comparing it with b s instead of dividing (app/kernels/cpu_kernels.cpp,
    group_codes). Checked on the float32 neighbours of b s, where the two could part."""
    scales = torch.arange(0x08, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2^-6 .. 448
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ge = torch.tensor([False, True, False, True, False, True, False])
    s, b = scales[:, None, None], bounds[None, :, None]
    edge = (b * s).expand(-1, -1, 9).contiguous()  # exact products
    assert torch.equal(edge[..., :1].double(), b.double() * s.double())
    x = edge.clone()
    for k in range(4):  # 4 ulps below and above
        x[..., 3 - k] = torch.nextafter(x[..., 4 - k], torch.tensor(0.0))
        x[..., 5 + k] = torch.nextafter(x[..., 4 + k], torch.tensor(math.inf))
    q = x / s
    on_quotient = torch.where(ge[None, :, None], q >= b, q > b)
    on_product = torch.where(ge[None, :, None], x >= edge, x > edge)
    assert torch.equal(on_quotient, on_product)
