"""app/kernels/layer_ops.py under the Triton interpreter against its torch references.

The kernels round where the torch path rounds, so in float32 they agree to float32 rounding and in
bf16 to one bf16 ulp (the row's sum of squares is summed in another order, so RMSNorm's
normalized value may round one ulp apart before the weight multiplies and rounds again; RoPE's
products are not fused into FMAs on either side)."""

import pytest
import torch

from app.kernels.layer_ops import rms_norm, rope_qk, silu_and_mul
from app.kernels.layer_ops_ref import rms_norm_ref, rope_qk_ref, silu_and_mul_ref
from app.kernels.store_kv import store_kv
from tests.kernels_testing import interpreted, page_bits, random_pages

CASES = [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)]  # (dtype, relative bound per element)


def _close(a, b, rel):
    assert a.dtype == b.dtype and a.shape == b.shape
    err = (a.float() - b.float()).abs()
    assert (err <= rel * b.float().abs() + 1e-6).all(), f"max err {err.max()}"


@pytest.mark.parametrize("dtype,rel", CASES)
@pytest.mark.parametrize("hidden", [64, 96])
@interpreted
def test_rms_norm_with_and_without_residual(dtype, rel, hidden):
    torch.manual_seed(0)
    x = torch.randn(7, hidden + 5).to(dtype)[:, :hidden]  # strided rows
    res = torch.randn(7, hidden).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    y, none = rms_norm(x, w, 1e-5)
    y_ref, _ = rms_norm_ref(x, w, 1e-5)
    assert none is None
    _close(y, y_ref, rel)
    (y, h), (y_ref, h_ref) = rms_norm(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(h, h_ref), "the residual sum rounds exactly like a torch add"
    _close(y, y_ref, rel)


@pytest.mark.parametrize("dtype,rel", CASES)
@interpreted
def test_rope_on_the_fused_projection(dtype, rel):
    torch.manual_seed(1)
    T, H, K, D = 5, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * K) * D + 8).to(dtype)[:, :(H + 2 * K) * D]
    ang = torch.rand(T, D // 2) * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    (q, k), (q_ref, k_ref) = rope_qk(qkv, cos, sin, H, K), rope_qk_ref(qkv, cos, sin, H, K)
    assert q.is_contiguous() and k.is_contiguous()
    _close(q, q_ref, rel)
    _close(k, k_ref, rel)


@pytest.mark.parametrize("dtype,rel", CASES)
@pytest.mark.parametrize("n", [48, 1500])  # one block and several (1024 each), a ragged end
@interpreted
def test_silu_and_mul(dtype, rel, n):
    torch.manual_seed(2)
    x = (3 * torch.randn(6, 2 * n)).to(dtype)
    _close(silu_and_mul(x), silu_and_mul_ref(x), rel)


@interpreted
def test_store_reads_strided_token_rows():
    """K/V as views of a fused [T, (H + 2K) * D] projection store exactly what contiguous copies store."""
    torch.manual_seed(3)
    T, K, D = 6, 2, 64
    qkv = torch.randn(T, (4 + 2 * K) * D)
    k, v = qkv[:, 4 * D: 6 * D].view(T, K, D), qkv[:, 6 * D:].view(T, K, D)
    slots = torch.tensor([1, 5, 6, 20, 33, 40])
    a_k, a_v, formats = random_pages("fp4", 4, 16, K, D)
    b_k, b_v, _ = random_pages("fp4", 4, 16, K, D)
    store_kv(k, v, slots, a_k, a_v, formats, nonfinite=torch.zeros(T, dtype=torch.int32))
    store_kv(k.contiguous(), v.contiguous(), slots, b_k, b_v, formats)
    assert all(torch.equal(x, y) for x, y in zip(page_bits(a_k) + page_bits(a_v), page_bits(b_k) + page_bits(b_v)))


# 40 s under the interpreter on the 2-core CI machine: the slow tier. The default suite keeps each
# kernel against its reference (above); on a GPU tests/test_engine_gpu.py runs the same model compiled.
@pytest.mark.slow
def test_widened_model_with_layer_kernels_decodes_like_the_small_one(stories_paths, tmp_path):
    """The model with its fused projections and the three kernels (interpreted) on: stories260K widened
    to head_dim 32 gives the small model's greedy tokens (float32)."""
    from tests.test_widen import PROMPTS, _widened_llm

    from app import LLM, SamplingParams

    model_path, tokenizer = stories_paths
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = [o.token_ids for o in LLM(model=model_path, tokenizer=tokenizer).generate(PROMPTS[:2], params)]
    llm = _widened_llm(stories_paths, tmp_path)
    llm.engine.model.use_layer_kernels(True)
    assert llm.engine.model.model.layers[0].self_attn.qkv_weight is not None
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == small
