"""The kernel path of the paged KV cache (what CUDA runs) against its torch path (what CPU runs).

The same steps go through two caches, one with use_kernels forced on (Triton interpreted on CPU),
one with it off: a ragged prefill, a step of decodes (split-KV decode kernel) and a mixed step
(its decodes through the decode kernel, its chunks through the prefill kernel over a dense scratch
for quantized pages). Stored pages agree (up to outlier ties), and attention over the same pages agrees
to float32 rounding: both paths read the pages' exact values and keep float32 through the PV product.
"""

import pytest
import torch

from app.engine.kv_cache import KVCacheSpec, create_kv_cache
from app.kernels.attention_ref import dequantize_pages
from app.kernels.fp4 import FP4Format
from kernels_testing import DEFAULT_FP4, interpreted, paged_step, rel_err

ROTATED = tuple(FP4Format(group_size=fmt.group_size, outliers=fmt.outliers, rotate=True,
                          scale_targets=fmt.scale_targets) for fmt in DEFAULT_FP4)
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, compute_dtype=torch.bfloat16)
NUM_HEADS = 8


@pytest.mark.parametrize("kv,formats", [("bf16", None), ("fp8", None), ("fp4", DEFAULT_FP4), ("fp4", ROTATED),
                                        ("fp8-fp4", (None, DEFAULT_FP4[1]))],
                         ids=["bf16", "fp8", "fp4", "fp4-rotated", "fp8-fp4"])
@interpreted
def test_kernel_path_matches_torch_path(kv, formats):
    caches = [create_kv_cache(kv, SPEC, 16, "cpu", formats) for _ in range(2)]
    assert not caches[0].kernels_enabled()  # CPU: the torch path unless forced
    caches[0].use_kernels, caches[1].use_kernels = True, False
    caches[1].use_cpu_kernels = False  # the torch reference, not the CPU extension
    gen = torch.Generator().manual_seed(0)
    tables = [[3, 7, 1], [0], [12, 4, 9, 2]]
    computed = [0, 0, 0]
    used = torch.tensor(sorted(b for t in tables for b in t))
    for new in ([20, 5, 33], [1, 1, 1], [7, 1, 1]):  # ragged prefill, decodes (split-KV kernel), mixed
        meta, q, k, v = paged_step(tables, computed, new, SPEC, NUM_HEADS, gen,
                                   keys=lambda t: torch.randn(t, SPEC.num_kv_heads, SPEC.head_dim, generator=gen) * 3)
        for cache in caches:
            cache.store(1, k, v, meta.slot_mapping)
        # store: the same pages, but where bf16 K/V hold equal magnitudes among outlier candidates
        # (torch.topk's choice among ties is unspecified; the kernel keeps the lowest index)
        for i, (got, want) in enumerate(zip(caches[0].layer_pages(1), caches[1].layer_pages(1))):
            fmt = formats[i] if formats else None
            got, want = dequantize_pages(got, fmt)[used], dequantize_pages(want, fmt)[used]
            assert (got == want).float().mean() > 0.98 and rel_err(got, want) < 3e-2
        # attention over the same pages: the kernels compute what the torch path computes, to float32
        # rounding before the bf16 output
        kernel_cache = create_kv_cache(kv, SPEC, 16, "cpu", formats)
        kernel_cache.use_kernels = True
        kernel_cache.scratch_tokens = 2 * SPEC.block_size  # the prefill chunks go in several scratch groups
        if kv == "bf16":
            kernel_cache.k_cache, kernel_cache.v_cache = caches[1].k_cache, caches[1].v_cache
        else:
            kernel_cache.pages = caches[1].pages
        got = kernel_cache.attention(1, q, meta, SPEC.head_dim ** -0.5)
        want = caches[1].attention(1, q, meta, SPEC.head_dim ** -0.5)
        # fp8 prefill chunks read a scratch that rounds each e4m3 value x its float32 scale to bf16
        # (2^-9 relative, against the format's own 2^-4); fp4's codes x power-of-two scales are bf16
        # numbers, so its scratch is exact
        assert rel_err(got, want) < (1e-2 if kv.startswith("fp8") and max(new) > 1 else 2e-4)
        computed = [c + n for c, n in zip(computed, new)]


def test_kernel_problems_name_the_reason():
    small = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, compute_dtype=torch.bfloat16)
    assert "head_dim 16" in create_kv_cache("fp4", small, 2, "cpu").kernel_problem()
    fp32 = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, compute_dtype=torch.float32)
    assert "float32" in create_kv_cache("fp8", fp32, 2, "cpu").kernel_problem()
    assert create_kv_cache("fp4", SPEC, 2, "cpu").kernel_problem() is None


@pytest.mark.parametrize("kv,formats", [("bf16", None), ("fp8", None), ("fp4", DEFAULT_FP4), ("fp4", ROTATED),
                                        ("fp8-fp4", (None, DEFAULT_FP4[1]))],
                         ids=["bf16", "fp8", "fp4", "fp4-rotated", "fp8-fp4"])
@interpreted
def test_warm_kernels_launch_the_builds_and_write_nothing(kv, formats, monkeypatch):
    """KVCache.warm_kernels (start-up on CUDA: every store and decode build compiled before serving)
    launches the store and decode kernels for real, here interpreted, and leaves every page as it was;
    its stores reach the kernel as the engine's do (a rotated fp4 cache hands it float32), with few
    and with many rows per program."""
    from app.kernels import paged, store_kv

    monkeypatch.setattr(store_kv, "WIDE_ROWS", 64)  # the wide store's launch in fewer interpreted rows
    cache = create_kv_cache(kv, SPEC, 8, "cpu", formats)
    cache.use_kernels = True
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(20, SPEC.num_kv_heads, SPEC.head_dim, generator=gen) for _ in range(2))
    cache.store(0, k.bfloat16(), v.bfloat16(), torch.arange(20) + 16)
    tensors = [t for pages in cache.layer_pages(0) for t in paged.page_args(pages)]
    before = [t.clone() for t in tensors]
    launched, real_store = [], store_kv.store_kv

    def recording(key, *args, **kwargs):
        launched.append((key.dtype, key.shape[0] * key.shape[1] > store_kv.WIDE_ROWS))
        return real_store(key, *args, **kwargs)

    monkeypatch.setattr(store_kv, "store_kv", recording)
    cache.warm_kernels(NUM_HEADS, max_blocks_per_seq=4)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, before))
    warmed, launched[:] = set(launched), []
    cache.store(1, k.bfloat16(), v.bfloat16(), torch.arange(20) + 16)  # a decode-sized and a prefill-sized
    cache.store(1, k.repeat(4, 1, 1).bfloat16(), v.repeat(4, 1, 1).bfloat16(), torch.arange(80) + 16)  # store
    assert set(launched) == warmed and len(warmed) == 2, (launched, warmed)
