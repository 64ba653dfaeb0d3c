"""Paged KV cache: one fixed-size page array per layer, indexed by block id.

A block holds `block_size` tokens of one layer. Every format keeps all arrays of a block
(values, and for quantized formats codes, scales, outliers) under the same block id, so the
block pool hands out ids without knowing the format. `create_kv_cache` picks the class by its
`kv_cache_dtype` name; `kv_bytes_per_token` gives the exact bytes each format allocates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from app.config import FP4Config
from app.engine.attention import AttentionMetadata, causal_attention_ref, decode_attention_ref
from app.engine.kv_cache_manager import cdiv
from app.kernels import fp4


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    compute_dtype: torch.dtype  # dtype of q/k/v entering the cache and of what reads return


class KVCache(ABC):
    """Base of all formats: store new K/V by slot, read pages back dequantized, attend."""

    name: str = ""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        assert num_blocks >= 1, f"num_blocks must be >= 1 (got {num_blocks})"
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)

    @abstractmethod
    def store(
        self,
        layer: int,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Write (quantizing if the format does) the new tokens' K/V into their slots."""

    @abstractmethod
    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, each [n, block_size, num_kv_heads, head_dim], compute dtype."""

    def attention(
        self,
        layer: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Each sequence's new tokens attend causally to its cached tokens (themselves included)."""
        return self._attend(layer, query, meta, scale, self.read_blocks)

    def _attend(self, layer, query, meta, scale, read_blocks) -> torch.Tensor:
        """Torch reference over pages that `read_blocks(layer, ids)` returns.

        Sequences with one new token (decodes) are batched into one padded gather; the others
        (prefill chunks) run one by one.
        """
        out = torch.empty_like(query)
        bs = self.spec.block_size
        query_lens = meta.query_lens
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        if decodes:
            rows = [meta.query_start_loc[i] for i in decodes]
            lens = [meta.seq_lens[i] for i in decodes]
            num_blocks = cdiv(max(lens), bs)
            tables = meta.block_tables[decodes, :num_blocks]  # [d, num_blocks]
            k, v = read_blocks(layer, tables.flatten())  # [d * num_blocks, bs, kvh, hd]
            k = k.view(len(decodes), num_blocks * bs, *k.shape[2:])
            v = v.view(len(decodes), num_blocks * bs, *v.shape[2:])
            seq_lens = torch.tensor(lens, device=query.device)
            out[rows] = decode_attention_ref(query[rows], k, v, seq_lens, scale).to(query.dtype)
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if end - start <= 1:
                continue  # a decode (done above) or nothing
            block_ids = meta.block_tables[i, : cdiv(seq_len, bs)]
            k, v = read_blocks(layer, block_ids)
            k = k.flatten(0, 1)[:seq_len]
            v = v.flatten(0, 1)[:seq_len]
            out[start:end] = causal_attention_ref(query[start:end], k, v, scale).to(query.dtype)
        return out


_DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DENSE_NAMES = {v: k for k, v in _DENSE_DTYPES.items()}


class DenseKVCache(KVCache):
    """Unquantized pages in bf16, fp16 or fp32 ("auto" = the model's compute dtype)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device, dtype: torch.dtype) -> None:
        super().__init__(spec, num_blocks, device)
        self.dtype = dtype
        self.name = _DENSE_NAMES[dtype]
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # per layer: k, v [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]

    @classmethod
    def bytes_per_token_per_layer(cls, spec: KVCacheSpec, dtype: torch.dtype | None = None) -> int:
        itemsize = (dtype or spec.compute_dtype).itemsize
        return 2 * spec.num_kv_heads * spec.head_dim * itemsize

    def store(self, layer, key, value, slot_mapping) -> None:
        s = self.spec
        self.k_cache[layer].view(-1, s.num_kv_heads, s.head_dim)[slot_mapping] = key.to(self.dtype)
        self.v_cache[layer].view(-1, s.num_kv_heads, s.head_dim)[slot_mapping] = value.to(self.dtype)

    def read_blocks(self, layer, block_ids):
        dt = self.spec.compute_dtype
        return self.k_cache[layer][block_ids].to(dt), self.v_cache[layer][block_ids].to(dt)


class FP8KVCache(KVCache):
    """FP8 E4M3 with one float32 scale per token and KV head (vLLM's fp8_per_token_head)."""

    name = "fp8"

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device) -> None:
        super().__init__(spec, num_blocks, device)
        page = (num_blocks, spec.block_size, spec.num_kv_heads)
        # pages[2 * layer] holds K, pages[2 * layer + 1] holds V: (values, scale)
        self.pages = [
            (
                torch.zeros(*page, spec.head_dim, dtype=torch.float8_e4m3fn, device=self.device),
                torch.zeros(page, dtype=torch.float32, device=self.device),
            )
            for _ in range(2 * spec.num_layers)
        ]

    @classmethod
    def bytes_per_token_per_layer(cls, spec: KVCacheSpec) -> int:
        return 2 * spec.num_kv_heads * (spec.head_dim + fp4.FP8_BYTES_PER_VECTOR_EXTRA)

    def store(self, layer, key, value, slot_mapping) -> None:
        quantized = [fp4.fp8_quantize(key), fp4.fp8_quantize(value)]  # both checked before any write
        for i, (values, scale) in enumerate(quantized):
            page_values, page_scale = self.pages[2 * layer + i]
            page_values.view(-1, *values.shape[1:])[slot_mapping] = values
            page_scale.view(-1, scale.shape[1])[slot_mapping] = scale

    def read_blocks(self, layer, block_ids):
        dt = self.spec.compute_dtype
        k, v = (fp4.fp8_dequantize(values[block_ids], scale[block_ids]).to(dt)
                for values, scale in self.pages[2 * layer : 2 * layer + 2])
        return k, v


class FP4KVCache(KVCache):
    """FP4 E2M1 codes with E4M3 group scales, an E8M0 second-level scale, outlier slots and an
    optional Hadamard rotation (app/kernels/fp4.py); one set of arrays per layer for K and for V."""

    name = "fp4"

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device, formats: tuple[fp4.FP4Format, fp4.FP4Format]):
        super().__init__(spec, num_blocks, device)
        self.formats = formats
        for fmt in formats:
            fmt.check(spec.head_dim)
        assert formats[0].rotate == formats[1].rotate, "K and V are rotated together"
        self.rotation = fp4.hadamard_rotation(spec.head_dim, self.device) if formats[0].rotate else None
        d, h = spec.head_dim, spec.num_kv_heads
        page = (num_blocks, spec.block_size, h)
        # pages[2 * layer] holds K, pages[2 * layer + 1] holds V; every array is indexed by block id
        self.pages = []
        for _ in range(spec.num_layers):
            for fmt in formats:
                self.pages.append(fp4.FP4Tensor(
                    codes=torch.zeros(*page, d // 2, dtype=torch.uint8, device=self.device),
                    scales=torch.zeros(*page, d // fmt.group(d), dtype=torch.float8_e4m3fn, device=self.device),
                    scale_exp=torch.zeros(page, dtype=torch.uint8, device=self.device),
                    out_vals=torch.zeros(*page, fmt.outliers, dtype=torch.bfloat16, device=self.device),
                    out_idx=torch.zeros(*page, fmt.outliers, dtype=torch.uint8, device=self.device),
                ))

    @classmethod
    def bytes_per_token_per_layer(cls, spec: KVCacheSpec, formats: tuple[fp4.FP4Format, fp4.FP4Format]) -> int:
        return spec.num_kv_heads * sum(fmt.bytes_per_vector(spec.head_dim) for fmt in formats)

    def store(self, layer, key, value, slot_mapping) -> None:
        quantized = [fp4.fp4_quantize(x, fmt, self.rotation) for x, fmt in zip((key, value), self.formats)]
        for i, q in enumerate(quantized):  # both checked (NaN/Inf) before any write
            for page, new in zip(self.pages[2 * layer + i], q):
                if new.numel():  # outlier arrays are empty without outlier slots
                    page.view(-1, *new.shape[1:])[slot_mapping] = new

    def _read(self, layer, block_ids, rotated: bool):
        dt = self.spec.compute_dtype
        rotation = None if rotated else self.rotation
        out = []
        for i in range(2):
            q = fp4.FP4Tensor(*(page[block_ids] for page in self.pages[2 * layer + i]))
            out.append(fp4.fp4_dequantize(q, self.formats[i], rotation).to(dt))
        return out[0], out[1]

    def read_blocks(self, layer, block_ids):
        return self._read(layer, block_ids, rotated=False)

    def attention(self, layer, query, meta, scale):
        if self.rotation is None:
            return super().attention(layer, query, meta, scale)
        # Attend in the rotated basis: q R . k R = q . k, and P (V R) R^T = P V.
        q = (query.float() @ self.rotation).to(query.dtype)
        out = self._attend(layer, q, meta, scale, lambda lyr, ids: self._read(lyr, ids, rotated=True))
        return (out.float() @ self.rotation.T).to(query.dtype)


KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "fp4")


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (got {kv_cache_dtype!r})")
    if kv_cache_dtype == "auto":
        return _DENSE_NAMES[compute_dtype]
    return kv_cache_dtype


FP4Formats = tuple[fp4.FP4Format, fp4.FP4Format]  # (K, V)
DEFAULT_FP4_FORMATS: FP4Formats = FP4Config().formats()


def kv_bytes_per_token(kv_cache_dtype: str, spec: KVCacheSpec, fp4_formats: FP4Formats | None = None) -> int:
    """Bytes of KV cache one token needs across all layers in the given format (metadata included)."""
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    if name == "fp4":
        per_layer = FP4KVCache.bytes_per_token_per_layer(spec, fp4_formats or DEFAULT_FP4_FORMATS)
    elif name == "fp8":
        per_layer = FP8KVCache.bytes_per_token_per_layer(spec)
    else:
        per_layer = DenseKVCache.bytes_per_token_per_layer(spec, _DENSE_DTYPES[name])
    return per_layer * spec.num_layers


def create_kv_cache(
    kv_cache_dtype: str, spec: KVCacheSpec, num_blocks: int, device, fp4_formats: FP4Formats | None = None
) -> KVCache:
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    if name == "fp4":
        return FP4KVCache(spec, num_blocks, device, fp4_formats or DEFAULT_FP4_FORMATS)
    if name == "fp8":
        return FP8KVCache(spec, num_blocks, device)
    return DenseKVCache(spec, num_blocks, device, _DENSE_DTYPES[name])
