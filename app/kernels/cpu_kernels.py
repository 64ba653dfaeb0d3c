"""The CPU path's kernels: paged attention without rebuilding the context every step, K/V stores,
fused layer ops.

The operations of a small C++ extension (cpu_kernels.cpp, compiled with the machine's C++
compiler on first use and cached by torch.utils.cpp_extension under ~/.cache/torch_extensions):

- decode: one new token per sequence attends to its pages; dense, fp8 and fp4 pages are read and
  dequantized inside one loop per (sequence, KV head) with an online softmax, in float32.
- prefill chunks: the sequence's blocks are dequantized once into the compute dtype (`gather`);
  in bf16 on CPUs with AVX512-BF16 attention runs in the extension's flash loop (`prefill_bf16`),
  otherwise in torch's fused CPU flash-attention kernel, split in two calls, the chunk's own keys
  causally and the earlier keys in full, merged by their log-sum-exp (a single call with a
  bottom-right causal mask takes the kernel's slower masked path).
- store: new K/V quantized to fp4 / fp8 as app/kernels/fp4.py / fp8.py do (topk outliers), written to
  their slots; `nonfinite_tokens` finds the tokens whose K or V holds NaN/Inf in one pass.
- layer ops: RMSNorm (residual added first), RoPE on the fused q/k projection, SiLU-and-mul, one
  pass each, rounding where app/kernels/layer_ops_ref.py rounds (sums may differ in order).

`available()` is False, with the reason logged once, where the extension cannot be built (no
compiler); the KV cache then keeps the torch reference path (app/kernels/attention_ref.py), which
stays the ground truth the tests compare against.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from app.kernels import fp4

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_lock = threading.Lock()
_module = None
_error: str | None = None
DENSE, FP8, FP4 = 0, 1, 2
# The extension's compiler flags (experiments/cpu_store_ab.py builds another revision's source with the same).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load():
    """The compiled extension, or None (with the reason in `problem()`)."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if os.environ.get("APP_CPU_KERNELS", "1") == "0":
            _error = "disabled by APP_CPU_KERNELS=0"
            return None
        try:
            from torch.utils.cpp_extension import load as build

            # -march=native: the build is keyed by the source and this CPU's flags, so a cache
            # directory shared by machines of different CPUs never runs code built for another.
            key = hashlib.sha1(_SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode())
            name = f"app_cpu_kernels_{key.hexdigest()[:12]}"
            logger.info("building the CPU kernels extension %s (once per machine, about a minute)", name)
            _module = build(name=name, sources=[str(_SOURCE)], verbose=False, extra_cflags=CFLAGS,
                            extra_ldflags=LDFLAGS)
        except Exception as e:  # no compiler, no ninja, a build error: keep the torch path
            lines = [ln for ln in str(e).splitlines() if ln.strip()] or [""]
            _error = f"{type(e).__name__}: {next((ln for ln in lines if 'error' in ln), lines[-1]).strip()}"
            logger.warning("CPU kernels extension unavailable (%s); using the torch reference path", _error)
        return _module


def available() -> bool:
    return load() is not None


def problem() -> str | None:
    load()
    return _error


def _page_args(pages, fmt: fp4.FP4Format | None) -> tuple[int, list[torch.Tensor], int]:
    if isinstance(pages, fp4.FP4Tensor):
        d = 2 * pages.codes.shape[-1]
        return FP4, list(pages), fmt.group(d)
    if isinstance(pages, tuple):
        return FP8, list(pages), 0
    return DENSE, [pages], 0


_NO_LSE = torch.empty(0)


def decode(query: torch.Tensor, k_pages, v_pages, formats, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           rows: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
    """out[rows[i]] = attention of query[rows[i]] over sequence i's first seq_lens[i] tokens
    (block_tables[i]); sequences with rows[i] < 0 are skipped. out may be float32 for a bf16 query;
    lse (float32 [T, H]), when given, gets each row's log-sum-exp of scores (for merge_attention)."""
    kk, kt, kg = _page_args(k_pages, formats[0])
    vk, vt, vg = _page_args(v_pages, formats[1])
    load().decode(out, query.contiguous(), kk, kt, kg, vk, vt, vg, block_tables, seq_lens.long(), rows.long(), scale,
                  _NO_LSE if lse is None else lse)


def gather(pages, fmt, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[len(block_ids) * block_size, H, D] of `dtype`: the blocks' K or V, dequantized."""
    kind, tensors, group = _page_args(pages, fmt)
    _, bs, h = tensors[0].shape[:3]
    d = 2 * tensors[0].shape[3] if kind == FP4 else tensors[0].shape[3]
    out = torch.empty(block_ids.numel() * bs, h, d, dtype=dtype)
    load().gather(out, kind, tensors, group, block_ids.long().contiguous())
    return out


def store_fp4(x: torch.Tensor, slots: torch.Tensor, pages: fp4.FP4Tensor, fmt: fp4.FP4Format) -> None:
    """Quantize x [N, H, D] (finite; topk outliers) as fp4.fp4_quantize does, into pages at slots [N]."""
    load().store_fp4(x.float().contiguous(), slots.long().contiguous(), list(pages), fmt.group(x.shape[-1]),
                     list(fmt.scale_targets))


def store_fp8(x: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize x [N, H, D] (finite) as fp8.fp8_quantize does, into values/scale at slots [N]."""
    load().store_fp8(x.float().contiguous(), slots.long().contiguous(), values, scale)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
PAD = 64  # prefill attention lengths in bf16/fp16 are multiples of this (see prefill)


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """[n, KVH, D] -> [1, KVH * group, n, D] for torch's flash kernel (each KV head repeated for its
    `group` query heads)."""
    x = x.transpose(0, 1)
    if group > 1:
        x = x.repeat_interleave(group, dim=0)
    return x.unsqueeze(0)


def prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, with_lse: bool = False):
    """query [nq, H, D] at the last nq of key/value's [nk, KVH, D] positions, causal; -> [nq, H, D]
    in the query's dtype, or with_lse: (out [nq, H, D] float32, lse [nq, H] float32), for merging
    with attention over other keys (the own-tokens half of a cascaded prefill chunk).

    In bf16, where the CPU has AVX512-BF16 and head_dim is a multiple of 64 (up to 256), the
    extension's own flash loop (`prefill_bf16`: bf16 pair dot products accumulated in float32, 2.4x
    torch's kernel on a Zen 4 core). Otherwise torch's flash kernel:
    Two calls of torch's flash kernel merged by log-sum-exp: the earlier keys in full and the
    chunk's own keys causally. In bf16/fp16 every length is a multiple of PAD (oneDNN compiles a
    kernel per new shape; padded shapes repeat): the earlier keys are cut at a multiple of PAD,
    the E keys after the cut join the causal call with E dummy queries in front (so that query i
    sits at key E + i), and both calls get dummy rows at the end (causality hides the extra keys;
    the extra queries are dropped).
    """
    nq, heads, head_dim = query.shape
    nk, kv_heads, _ = key.shape
    if query.dtype == torch.bfloat16 and head_dim % 64 == 0 and head_dim <= 256 and load().has_prefill_bf16():
        if with_lse:
            out = torch.empty(query.shape, dtype=torch.float32)
            lse = torch.empty(query.shape[:2], dtype=torch.float32)
        else:
            out, lse = torch.empty_like(query), _NO_LSE
        load().prefill_bf16(out, query.contiguous(), key.contiguous(), value.contiguous(), scale, True, lse)
        return (out, lse) if with_lse else out
    group = heads // kv_heads
    pad = PAD if query.dtype != torch.float32 else 1

    def padded(x, front, total):  # [1, H, n, D] -> [1, H, total, D], zeros around
        if front == 0 and x.shape[2] == total:
            return x
        out = x.new_zeros(*x.shape[:2], total, x.shape[3])
        out[:, :, front:front + x.shape[2]] = x
        return out

    q, k, v = _heads_first(query, 1), _heads_first(key, group), _heads_first(value, group)
    cut = (nk - nq) // pad * pad  # earlier keys attended in full
    extra = nk - nq - cut  # earlier keys after the cut: they join the causal call
    n_own = -(-(extra + nq) // pad) * pad
    own, own_lse = _flash(padded(q, extra, n_own), padded(k[:, :, cut:], 0, n_own), padded(v[:, :, cut:], 0, n_own),
                          0.0, True, scale=scale)
    own, own_lse = own[:, :, extra:extra + nq], own_lse[:, :, extra:extra + nq].float()
    if cut:
        n_q = -(-nq // pad) * pad
        prev, prev_lse = _flash(padded(q, 0, n_q), k[:, :, :cut], v[:, :, :cut], 0.0, False, scale=scale)
        prev, prev_lse = prev[:, :, :nq], prev_lse[:, :, :nq].float()
        own, own_lse = _merge(own.float(), own_lse, prev.float(), prev_lse)
    if with_lse:
        return own[0].transpose(0, 1).float(), own_lse[0].transpose(0, 1).contiguous()
    return own[0].transpose(0, 1).to(query.dtype)


def has_prefix_attention(query: torch.Tensor) -> bool:
    """Whether prefix_attention runs for this query: bf16 with head_dim a multiple of 64 up to 256 on
    a CPU with AVX512-BF16 (the extension's loop), or float32 (torch's flash kernel; the compute
    dtype on CPUs without native bf16)."""
    if query.dtype == torch.float32:
        return True
    d = query.shape[-1]
    return query.dtype == torch.bfloat16 and d % 64 == 0 and d <= 256 and load().has_prefill_bf16()


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
    """Every row of query [n, H, D] attends to all of key/value [nk, KVH, D] (the query's dtype), no
    mask: -> (out [n, H, D] float32, lse [n, H] float32). The shared-prefix half of cascade attention.
    bf16: the extension's loop; float32: torch's flash kernel, which returns the log-sum-exp too."""
    if query.dtype == torch.float32:
        group = query.shape[1] // key.shape[1]
        out, lse = _flash(_heads_first(query, 1), _heads_first(key, group), _heads_first(value, group), 0.0, False,
                          scale=scale)
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)
    out = torch.empty(query.shape, dtype=torch.float32)
    lse = torch.empty(query.shape[:2], dtype=torch.float32)
    load().prefill_bf16(out, query.contiguous(), key.contiguous(), value.contiguous(), scale, False, lse)
    return out, lse


def _merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) over the union of two disjoint key sets from each set's (out [..., D], lse [...])."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = (lse_a - m).exp(), (lse_b - m).exp()
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], m + (wa + wb).log()


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's (out [n, H, D], lse [n, H])."""
    return _merge(out_a, lse_a, out_b, lse_b)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """As layer_ops_ref.rms_norm_ref: (norm(x [+ residual]), x + residual or None)."""
    y, h = load().rms_norm(x.contiguous(), weight.contiguous(), eps,
                           residual.contiguous() if residual is not None else None)
    return y, (h if residual is not None else None)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int):
    """As layer_ops_ref.rope_qk_ref: q [T, H, D] and k [T, K, D] from the fused projection."""
    q, k = load().rope_qk(qkv.contiguous(), cos.contiguous(), sin.contiguous(), num_heads, num_kv_heads)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As layer_ops_ref.silu_and_mul_ref: silu(gate) * up of x = [gate | up]."""
    return load().silu_and_mul(x.contiguous())


def nonfinite_tokens(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[N] bool: the tokens whose K or V vector (any of its heads) holds NaN/Inf."""
    return load().nonfinite_tokens(key, value)
