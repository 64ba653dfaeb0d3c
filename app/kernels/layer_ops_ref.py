"""Torch references of app/kernels/layer_ops.py: the Llama model's torch path (no Triton needed)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE: x [T, heads, head_dim], cos/sin [T, head_dim] float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def rms_norm_ref(x, weight, eps, residual=None):
    """The torch path's RMSNorm (app/engine/models/decoder.py RMSNorm) with the residual add first."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y, (x if residual is not None else None)


def rope_qk_ref(qkv, cos, sin, num_heads, num_kv_heads):
    """The torch path: llama.apply_rope on the query and key parts of the fused projection."""
    T, D = qkv.shape[0], cos.shape[1]
    q = qkv[:, : num_heads * D].reshape(T, num_heads, D)
    k = qkv[:, num_heads * D: (num_heads + num_kv_heads) * D].reshape(T, num_kv_heads, D)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def silu_and_mul_ref(x):
    """The torch path: F.silu(gate) * up, rounded to x's dtype in between as torch does."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
