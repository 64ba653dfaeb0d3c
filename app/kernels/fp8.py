"""The FP8 KV format in pure torch (the 8-bit baseline, vLLM's fp8_per_token_head): one vector of
head_dim values (one token, one KV head) is stored as E4M3 values scaled so that its largest
magnitude maps to 448, and that float32 scale. The CPU path and the reference for the kernels."""

from __future__ import annotations

import torch

from app.kernels.fp4 import E4M3_MAX, check_finite

FP8_BYTES_PER_VECTOR_EXTRA = 4  # the float32 scale


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (e4m3 values [..., head_dim], float32 scale [...]); amax maps to 448."""
    check_finite(x)
    x = x.float()
    scale = x.abs().amax(-1) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale[..., None]).to(torch.float8_e4m3fn), scale


def fp8_dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(values, scale) as fp8_quantize returns them -> [..., head_dim] float32."""
    return values.float() * scale[..., None]
