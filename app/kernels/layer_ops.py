"""The small per-token ops of a Llama layer, one launch each: RMSNorm (with the residual add folded
in), rotary embedding of the fused QKV projection, SiLU-and-mul. Their torch references (the model's
torch path) are in layer_ops_ref.py.

They round where the torch path (app/engine/models/decoder.py) rounds: the residual sum in the
activation dtype (bit for bit), the normalized row cast to it before the weight multiplies, RoPE in
float32 (bit for bit), SiLU in float32 cast before the multiply. A row's sum of squares is summed in
another order, and on CUDA Triton's division and exp are not torch's, so RMSNorm and SiLU may differ
from torch by one bf16 ulp now and then. On a
decode step these were ~40 launches per layer and 2.7 ms of an 11.9 ms Llama-3.1-8B step at batch
64 on an H200 (docs/history.md); fused they are three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.paged import cast_out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, n, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + c, mask=mask, other=0.0)
        x = cast_out(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)  # rounded like a torch add
        tl.store(res_out_ptr + row * n + c, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = cast_out(xf * inv, x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * n + c, cast_out(y, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, hidden] (rows may be strided), weight [hidden]. With residual: h = x + residual, returns
    (rms_norm(h), h); else (rms_norm(x), None). Outputs are new contiguous tensors in x's dtype."""
    T, n = x.shape
    assert weight.shape == (n,) and x.stride(1) == 1, f"x {tuple(x.shape)} / weight {tuple(weight.shape)}"
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    if T:
        _rms_norm_kernel[(T,)](x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
                               residual.stride(0) if residual is not None else 0, n, eps,
                               HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
                               num_warps=4 if n <= 2048 else 8)
    return out, (res_out if residual is not None else None)


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_t, HQ: tl.constexpr, HK: tl.constexpr,
                 D: tl.constexpr):
    """Program (token, head) over the first HQ + HK heads of a [T, HQ + 2 HK, D] row: rotate-half RoPE
    in float32; query heads go to q [T, HQ, D], key heads to k [T, HK, D]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    base = qkv_ptr + t * stride_t + h * D
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    c1 = tl.load(cos_ptr + t * D + i)
    c2 = tl.load(cos_ptr + t * D + HALF + i)
    s1 = tl.load(sin_ptr + t * D + i)
    s2 = tl.load(sin_ptr + t * D + HALF + i)
    o1 = x1 * c1 + (-x2) * s1
    o2 = x2 * c2 + x1 * s2
    if h < HQ:
        dst = q_ptr + (t * HQ + h) * D
    else:
        dst = k_ptr + (t * HK + (h - HQ)) * D
    tl.store(dst + i, cast_out(o1, q_ptr.dtype.element_ty))
    tl.store(dst + HALF + i, cast_out(o2, q_ptr.dtype.element_ty))


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (num_heads + 2 num_kv_heads) * D] (the fused projection; rows may be strided), cos/sin
    [T, D] float32 -> (q [T, num_heads, D], k [T, num_kv_heads, D]) rotated, contiguous, qkv's dtype."""
    T, width = qkv.shape
    D = cos.shape[1]
    assert width == (num_heads + 2 * num_kv_heads) * D and qkv.stride(1) == 1
    assert cos.shape == sin.shape == (T, D) and cos.dtype == sin.dtype == torch.float32
    assert cos.is_contiguous() and sin.is_contiguous() and D % 2 == 0 and triton.next_power_of_2(D) == D
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        _rope_kernel[(T, num_heads + num_kv_heads)](qkv, cos, sin, q, k, qkv.stride(0), HQ=num_heads, HK=num_kv_heads,
                                                    D=D, num_warps=1, enable_fp_fusion=False)
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n
    g = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + c, mask=mask, other=0.0)
    s = cast_out(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + c, cast_out(s.to(tl.float32) * u.to(tl.float32), out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 n] (gate | up, the fused projection) -> silu(gate) * up [T, n], x's dtype."""
    T, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    n = width // 2
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block, num_warps=4)
    return out
