"""Shared cases for the kernel tests: random paged caches in every format, block tables, poison.

The kernel tests run Triton under TRITON_INTERPRET=1 (set in conftest.py before any kernel module
is imported) on CPU tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from app.config import FP4Config
from app.kernels import paged
from app.kernels.fp4 import FP4Format

DEFAULT_FP4 = FP4Config().formats()  # K: groups of 32, 4 outlier slots; V: groups of 32; scale search
FORMATS = {
    "bf16": ("bf16", (None, None)),
    "fp8": ("fp8", (None, None)),
    "fp4": ("fp4", DEFAULT_FP4),
    "fp4-plain": ("fp4", (FP4Format(), FP4Format())),  # NVFP4-like: groups of 16, no outliers, amax -> 6
    "fp4-zscore": ("fp4", (FP4Format(group_size=32, outliers=3, outlier_mode="zscore", zscore=2.5,
                                     scale_targets=(6.0, 4.0)),
                           FP4Format(group_size=16, outliers=1))),
    # key groups of 8 without slots: the layout the Gluon kernel's KG8 build reads (81 B per key vector)
    "fp4-kg8": ("fp4", (FP4Format(group_size=8), FP4Format(group_size=32))),
    # kv_cache_dtype fp8-fp4: fp8 keys, fp4 values in the default value format
    "fp8-fp4": ("fp8-fp4", (None, DEFAULT_FP4[1])),
}


def side_kinds(kind: str) -> tuple[str, str]:
    """The page kinds (K, V) of a FORMATS kind: "fp8-fp4" -> ("fp8", "fp4"), "fp4" -> ("fp4", "fp4")."""
    k, _, v = kind.partition("-")
    return k, v or k


def keys_like_llama(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian vectors with a few massive channels (the structure outlier slots are for)."""
    x = torch.randn(*shape, generator=gen)
    d = shape[-1]
    channels = torch.randperm(d, generator=gen)[:3]
    x[..., channels] *= 12.0
    return x * torch.exp(0.3 * torch.randn(*shape[:-1], 1, generator=gen))  # per-vector magnitude


def random_pages(name: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, seed: int = 0):
    """(k_pages, v_pages, formats) holding random K/V quantized by the torch reference."""
    kind, formats = FORMATS[name]
    k_kind, v_kind = side_kinds(kind)
    gen = torch.Generator().manual_seed(seed)
    k = keys_like_llama(num_blocks, block_size, num_kv_heads, head_dim, gen=gen)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return paged.quantize_pages(k, k_kind, formats[0]), paged.quantize_pages(v, v_kind, formats[1]), formats


def block_tables(seq_lens: list[int], block_size: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Shuffled, disjoint pages for each sequence: ([num_seqs, max_blocks] int32 padded with 0, num_blocks)."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n
    return table, num_blocks


def pages_to(pages, device):
    """One side's pages (dense tensor, fp8 (values, scale) or FP4Tensor) moved to `device`, same type."""
    if isinstance(pages, torch.Tensor):
        return pages.to(device)
    moved = [t.to(device) for t in pages]
    return type(pages)(*moved) if hasattr(pages, "_fields") else tuple(moved)


def cuda_fp4_pages(seq_lens, kv_heads, block_size, formats, seed, v_mult=1.0):
    """(block table, K pages, V pages) on the GPU: Llama-like keys and normal values (x v_mult)
    quantized to fp4 with `formats`, blocks shuffled (block_tables)."""
    table, num_blocks = block_tables(seq_lens, block_size, seed)
    gen = torch.Generator().manual_seed(seed)
    k = keys_like_llama(num_blocks, block_size, kv_heads, 128, gen=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, 128, generator=gen) * v_mult
    kp, vp = (paged.quantize_pages(x, "fp4", f) for x, f in zip((k, v), formats))
    return table.cuda(), pages_to(kp, "cuda"), pages_to(vp, "cuda")


# Triton kernels on CPU tensors run through Triton's interpreter (conftest sets TRITON_INTERPRET=1 unless it is set)
interpreted = pytest.mark.skipif(not paged.interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output: an element was never written"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def worst_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error over (sequence, query head): one bad split or tile of one long
    sequence shows here, where a norm over the whole batch would average it away."""
    assert not out.isnan().any(), "NaN in the output: an element was never written"
    diff = (out.float() - ref.float()).norm(dim=-1)
    return (diff / ref.float().norm(dim=-1).clamp_min(1e-6)).max().item()


def poison(pages):
    """Fill every page array with a bit pattern no kernel writes (NaN for floating dense pages)."""
    if isinstance(pages, torch.Tensor):
        return pages.fill_(float("nan"))
    for t in pages:
        t.view(torch.uint8).fill_(0xA5)
    return pages


def page_bits(pages) -> list[torch.Tensor]:
    arrays = [pages] if isinstance(pages, torch.Tensor) else list(pages)
    return [t.contiguous().view(torch.uint8) for t in arrays]


def paged_step(tables, computed, new, spec, num_heads, gen, keys=None):
    """AttentionMetadata and random q/k/v for an engine step giving new[i] tokens to sequence i,
    whose pages are tables[i] and whose first computed[i] tokens are cached. `keys(t)` makes K
    (default: keys_like_llama); q, k, v come in spec.compute_dtype."""
    from app.engine.attention import AttentionMetadata

    bs = spec.block_size
    slots, seq_lens, qsl = [], [], [0]
    for table, start, n in zip(tables, computed, new):
        pos = torch.arange(start, start + n)
        slots.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=block_tables, seq_lens=seq_lens,
                             query_start_loc=qsl)
    t, dt = qsl[-1], spec.compute_dtype
    q = torch.randn(t, num_heads, spec.head_dim, generator=gen).to(dt)
    k = (keys(t) if keys is not None else keys_like_llama(t, spec.num_kv_heads, spec.head_dim, gen=gen)).to(dt)
    v = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=gen).to(dt)
    return meta, q, k, v
