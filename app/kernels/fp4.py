"""The FP4 KV format in pure torch: the CPU path and the reference for the Triton kernels.

One vector x of head_dim values (one token, one KV head) is stored as
  codes      [head_dim / 2] uint8     E2M1 codes (sign bit 3, magnitude 0, .5, 1, 1.5, 2, 3, 4, 6),
                                      two per byte: element 2i in the low nibble, 2i+1 in the high
  scales     [head_dim / G] e4m3      one per group of G = gcd(group_size, head_dim) values (NVFP4
                                      uses 16; head_dim 80 with group_size 32 gets groups of 16);
                                      never an E4M3 subnormal: a scale below 2^-6 is raised to 2^-6
                                      (such a group is under 1/28000 of the vector's largest one), so
                                      decoders turn a scale into bf16 with one integer multiply-add
  scale_exp  []             uint8     second-level scale 2^(scale_exp - 127) (E8M0, as MX formats),
                                      a power of two that keeps every group scale <= 448: E4M3's
                                      range never clips, whatever the vector's magnitude
  out_vals   [k]            bf16      outlier retention: the k largest-magnitude entries, kept
  out_idx    [k]            uint8     in bf16 with their index and left out of the group scales
                                      (their bf16 rounding residue stays in the codes); unused
                                      slots hold value 0 at index 0, and dequantization adds them
Optionally the vector is first multiplied by a fixed randomized Hadamard matrix R (orthogonal):
K is stored rotated and queries are rotated alike (q R . k R = q . k); V is stored rotated and
the attention output is rotated back (P (V R) R^T = P V).

Quantization rounds to nearest, ties to even, as the hardware's cvt to e2m1 and e4m3 do.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose even neighbour is the upper one
ROTATION_SEED = 0x5EED  # fixed: a cache written by one process is read by another


@dataclass(frozen=True, slots=True)
class FP4Format:
    """How vectors are quantized. outliers: slots per vector (fixed, so pages keep their size)."""

    group_size: int = 16
    outliers: int = 0
    outlier_mode: Literal["topk", "zscore"] = "topk"
    zscore: float = 3.0  # zscore mode: only entries with |x - mean| > zscore * std, at most `outliers`
    rotate: bool = False
    # Values of the E2M1 grid a group's amax may be mapped to; per group the one with the lowest
    # squared error wins (6 alone is plain NVFP4 scaling; (6, 4) is "four over six").
    scale_targets: tuple[float, ...] = (6.0,)

    def group(self, head_dim: int) -> int:
        return math.gcd(self.group_size, head_dim)

    def bytes_per_vector(self, head_dim: int) -> int:
        return head_dim // 2 + head_dim // self.group(head_dim) + 1 + 3 * self.outliers

    def check(self, head_dim: int) -> None:
        if head_dim % 2 or self.group(head_dim) % 2:
            raise ValueError(f"fp4 needs an even head_dim and an even group (got head_dim {head_dim}, "
                             f"group gcd({self.group_size}, {head_dim}) = {self.group(head_dim)})")
        if not 0 <= self.outliers <= min(head_dim, 16):
            raise ValueError(f"fp4 outliers must be in [0, {min(head_dim, 16)}] (got {self.outliers})")
        if self.outliers and head_dim > 256:
            raise ValueError(f"fp4 outlier indices are uint8: with outlier slots head_dim must be <= 256 "
                             f"(got {head_dim})")
        if self.outliers and self.outlier_mode == "zscore" and self.zscore >= math.sqrt(head_dim - 1):
            raise ValueError(f"fp4 zscore ({self.zscore}) must be below sqrt(head_dim - 1) = {math.sqrt(head_dim - 1):.2f}: "
                             "no entry of a vector can lie further from its mean, so no outlier would ever be kept")
        if not self.scale_targets or not all(0.5 <= t <= E2M1_MAX for t in self.scale_targets):
            raise ValueError(f"fp4 scale_targets must be values in [0.5, 6] (got {self.scale_targets})")
        if self.rotate and head_dim & (head_dim - 1):
            raise ValueError(f"fp4 rotation needs a power-of-two head_dim (got {head_dim})")


class FP4Tensor(NamedTuple):
    codes: torch.Tensor  # [..., head_dim // 2] uint8
    scales: torch.Tensor  # [..., head_dim // G] float8_e4m3fn
    scale_exp: torch.Tensor  # [...] uint8
    out_vals: torch.Tensor  # [..., k] bfloat16
    out_idx: torch.Tensor  # [..., k] uint8


# -- E2M1 --------------------------------------------------------------------------------------
@functools.cache
def _constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit codes (uint8 0..15), round to nearest even, saturating at +-6."""
    a = x.abs().float()
    mid = _constant(_E2M1_MIDPOINTS, x.device)
    code = torch.bucketize(a, mid)  # a == midpoint goes to the lower code
    for m in _TIES_UP:
        code += a == m
    sign = (x < 0) & (code > 0)
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = _constant(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes 0..15 -> [..., n] bytes (even index in the low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# -- rotation ----------------------------------------------------------------------------------
def hadamard_rotation(dim: int, device: torch.device | str = "cpu", seed: int = ROTATION_SEED) -> torch.Tensor:
    """[dim, dim] float32 orthogonal: Sylvester Hadamard / sqrt(dim), rows with random signs."""
    assert dim > 0 and dim & (dim - 1) == 0, f"dim must be a power of two (got {dim})"
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    gen = torch.Generator().manual_seed(seed + dim)
    signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
    return (signs[:, None] * h / math.sqrt(dim)).to(device)


# -- quantize / dequantize ---------------------------------------------------------------------
def check_finite(x: torch.Tensor, what: str = "K/V") -> None:
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(f"non-finite value in {what} at index {bad}: refusing to store it in the KV cache")


def _select_outliers(x: torch.Tensor, fmt: FP4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [..., k] and indices [..., k] of the retained entries (unused slots: value 0, index 0)."""
    mag = x.abs()
    if fmt.outlier_mode == "zscore":
        mean, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True, correction=0)
        mag = torch.where((x - mean).abs() > fmt.zscore * std, mag, torch.full_like(mag, -1.0))
    # Among equal magnitudes the lower index first (a stable sort; topk leaves ties unspecified),
    # as the store kernels select them.
    top, idx = mag.sort(dim=-1, descending=True, stable=True)
    top, idx = top[..., : fmt.outliers], idx[..., : fmt.outliers]
    used = top >= 0
    if fmt.outlier_mode == "topk":
        used &= top > 0
    idx = torch.where(used, idx, torch.zeros_like(idx))
    vals = torch.where(used, x.gather(-1, idx), torch.zeros_like(top))
    return vals, idx


def fp4_quantize(x: torch.Tensor, fmt: FP4Format, rotation: torch.Tensor | None = None) -> FP4Tensor:
    """x [..., head_dim] (any float dtype) -> FP4Tensor. Raises ValueError on NaN/Inf."""
    head_dim = x.shape[-1]
    fmt.check(head_dim)
    check_finite(x)
    x = x.float()
    if fmt.rotate:
        assert rotation is not None, "fmt.rotate needs the rotation matrix"
        x = x @ rotation
    if fmt.outliers:
        # Take the bf16-rounded kept values out of x (scatter_add: unused slots subtract 0 at index
        # 0, and may share that index with a used slot); what remains there is the rounding residue.
        out_vals, out_idx = _select_outliers(x, fmt)
        out_vals = out_vals.to(torch.bfloat16)
        x = x.scatter_add(-1, out_idx, -out_vals.float())
    else:
        out_vals = x.new_zeros(*x.shape[:-1], 0, dtype=torch.bfloat16)
        out_idx = x.new_zeros(*x.shape[:-1], 0, dtype=torch.long)
    g = fmt.group(head_dim)
    groups = x.view(*x.shape[:-1], head_dim // g, g)
    amax = groups.abs().amax(-1)  # [..., head_dim // g]
    # The second-level scale leaves room for the largest candidate scale (amax / smallest target).
    top = amax.amax(-1) / min(fmt.scale_targets)  # [...]
    exp = torch.ceil(torch.log2(top / E4M3_MAX)).clamp(-126, 127)
    exp = torch.where(top > 0, exp, torch.full_like(exp, -127))
    second = torch.exp2(exp)[..., None]  # [..., 1]
    # Work in units of the second-level scale (a power of two: exact), so that errors squared
    # neither overflow nor underflow whatever the vector's magnitude.
    groups_n = groups / second[..., None]
    amax_n = amax / second
    best = None
    for target in fmt.scale_targets:
        # Map the group's amax to `target` on the E2M1 grid; keep, per group, the lowest error.
        scales = (amax_n / target).clamp(min=E4M3_MIN_NORMAL).to(torch.float8_e4m3fn)
        decoded = scales.float()
        safe = torch.where(decoded > 0, decoded, torch.ones_like(decoded))[..., None]
        codes = e2m1_encode(groups_n / safe)
        err = (e2m1_decode(codes) * safe - groups_n).square().sum(-1)  # [..., head_dim // g]
        if best is None:
            best = [scales, codes, err]
            continue
        better = err < best[2]
        best[0] = torch.where(better, scales, best[0])
        best[1] = torch.where(better[..., None], codes, best[1])
        best[2] = torch.minimum(err, best[2])
    scales, codes = best[0], best[1].view(*x.shape[:-1], head_dim)
    return FP4Tensor(
        codes=pack_nibbles(codes),
        scales=scales,
        scale_exp=(exp + 127).to(torch.uint8),
        out_vals=out_vals,
        out_idx=out_idx.to(torch.uint8),
    )


def fp4_dequantize(q: FP4Tensor, fmt: FP4Format, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """FP4Tensor -> [..., head_dim] float32. With `rotation`, rotated back to the original basis;
    without it, a rotated format stays in the rotated basis (what attention over rotated q uses)."""
    codes = unpack_nibbles(q.codes)
    head_dim = codes.shape[-1]
    g = fmt.group(head_dim)
    second = torch.exp2(q.scale_exp.float() - 127)
    scale = q.scales.float() * second[..., None]  # [..., head_dim // g]
    x = (e2m1_decode(codes).view(*codes.shape[:-1], head_dim // g, g) * scale[..., None]).flatten(-2)
    if q.out_vals.shape[-1]:
        x = x.scatter_add(-1, q.out_idx.long(), q.out_vals.float())
    if rotation is not None and fmt.rotate:
        x = x @ rotation.T
    return x
