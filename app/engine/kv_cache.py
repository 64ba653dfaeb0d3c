"""Paged KV cache: one fixed-size page array per layer, indexed by block id.

A block holds `block_size` tokens of one layer. Every format keeps all arrays of a block
(values, and for quantized formats codes, scales, outliers) under the same block id, so the
block pool hands out ids without knowing the format. Formats register in KV_CACHE_FORMATS;
`create_kv_cache` picks one by its `kv_cache_dtype` name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from app.engine.attention import AttentionMetadata, causal_attention_ref, decode_attention_ref


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

    @classmethod
    @abstractmethod
    def bytes_per_token_per_layer(cls, spec: KVCacheSpec) -> int:
        """Bytes one token occupies in one layer, K and V together, metadata included."""

    @classmethod
    def bytes_per_token(cls, spec: KVCacheSpec) -> int:
        return cls.bytes_per_token_per_layer(spec) * spec.num_layers

    @classmethod
    def num_blocks_for_budget(cls, spec: KVCacheSpec, budget_bytes: int) -> int:
        return budget_bytes // (cls.bytes_per_token(spec) * spec.block_size)

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
        """Each sequence's new tokens attend causally to its cached tokens (themselves included).

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
            num_blocks = math.ceil(max(lens) / bs)
            tables = meta.block_tables[decodes, :num_blocks]  # [d, num_blocks]
            k, v = self.read_blocks(layer, tables.flatten())  # [d * num_blocks, bs, kvh, hd]
            k = k.view(len(decodes), num_blocks * bs, *k.shape[2:])
            v = v.view(len(decodes), num_blocks * bs, *v.shape[2:])
            seq_lens = torch.tensor(lens, device=query.device)
            out[rows] = decode_attention_ref(query[rows], k, v, seq_lens, scale).to(query.dtype)
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if end - start <= 1:
                continue  # a decode (done above) or nothing
            block_ids = meta.block_tables[i, : math.ceil(seq_len / bs)]
            k, v = self.read_blocks(layer, block_ids)
            k = k.flatten(0, 1)[:seq_len]
            v = v.flatten(0, 1)[:seq_len]
            out[start:end] = causal_attention_ref(query[start:end], k, v, scale).to(query.dtype)
        return out


_DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DenseKVCache(KVCache):
    """Unquantized pages in bf16, fp16 or fp32 ("auto" = the model's compute dtype)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device, dtype: torch.dtype) -> None:
        super().__init__(spec, num_blocks, device)
        self.dtype = dtype
        self.name = {v: k for k, v in _DENSE_DTYPES.items()}[dtype]
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


KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32")


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (got {kv_cache_dtype!r})")
    if kv_cache_dtype == "auto":
        return {v: k for k, v in _DENSE_DTYPES.items()}[compute_dtype]
    return kv_cache_dtype


def kv_bytes_per_token(kv_cache_dtype: str, spec: KVCacheSpec) -> int:
    """Bytes of KV cache one token needs across all layers in the given format."""
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    return DenseKVCache.bytes_per_token_per_layer(spec, _DENSE_DTYPES[name]) * spec.num_layers


def create_kv_cache(kv_cache_dtype: str, spec: KVCacheSpec, num_blocks: int, device) -> KVCache:
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    return DenseKVCache(spec, num_blocks, device, _DENSE_DTYPES[name])
