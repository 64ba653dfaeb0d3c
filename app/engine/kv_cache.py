"""Paged KV cache: one fixed-size page array per layer, indexed by block id.

A block holds `block_size` tokens of one layer. Every format keeps all arrays of a block
(values, and for quantized formats codes, scales, outliers) under the same block id, so the
block pool hands out ids without knowing the format. `create_kv_cache` picks the class by its
`kv_cache_dtype` name; `kv_bytes_per_token` gives the exact bytes each format allocates.
Quantized formats choose fp8 or fp4 per side (QuantizedKVCache): fp8, fp4, and fp8-fp4 (fp8 keys,
fp4 values).

`attention` runs the Triton kernels (app/kernels/) on CUDA, the CPU extension
(app/kernels/cpu_kernels.py) on the CPU where it builds, and the torch reference path otherwise;
`store` runs the Triton kernels on CUDA and torch elsewhere. `KVCache.kernels_enabled` and
`KVCache.cpu_kernels_enabled` are the places that choose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import importlib.util

import torch

from app.config import FP4Config
from app.engine.attention import AttentionMetadata
from app.engine.kv_cache_manager import cdiv
from app.engine.prefill_plan import SCRATCH_TOKENS
from app.kernels import fp4, fp8
from app.kernels.attention_ref import causal_attention_ref, decode_attention_ref

# Cascade decoding on the CPU: decodes sharing at least this many prefix tokens attend to them together.
CASCADE_MIN_TOKENS = 256


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
        self.use_kernels: bool | None = None  # None: decided by kernels_enabled() on first use
        self.use_cpu_kernels: bool | None = None  # None: decided by cpu_kernels_enabled() on first use
        self.check_finite = True  # quantized formats refuse NaN/Inf before writing (a device sync)
        # Cascade decoding on the CPU (see _shared_prefixes); 0 turns it off.
        self.cascade_min_tokens = CASCADE_MIN_TOKENS
        self._cascade_step: tuple[AttentionMetadata, list] | None = None  # (the step's metadata, its groups)
        # GPU prefill over quantized pages (app/engine/prefill_plan.py): the step's plan and the scratch
        self.scratch_tokens = SCRATCH_TOKENS
        self._prefill_step: tuple | None = None  # (the step's metadata, its PrefillPlan)
        self._decode_rows_step: tuple | None = None  # (the step's metadata, its decode rows' tables, lengths)
        self._scratch_pages: tuple[torch.Tensor, torch.Tensor] | None = None

    def kernels_enabled(self) -> bool:
        """The one place that picks the path: Triton kernels on CUDA when they support this cache's
        shapes and dtypes, the torch reference otherwise. Setting `use_kernels` overrides it (tests
        run the kernels on CPU under TRITON_INTERPRET=1)."""
        if self.use_kernels is None:
            self.use_kernels = self.device.type == "cuda" and self.kernel_problem() is None
        return self.use_kernels

    def cpu_kernels_enabled(self) -> bool:
        """The CPU extension's attention on CPU caches where it builds (app/kernels/cpu_kernels.py);
        setting `use_cpu_kernels` overrides it (False: the torch reference)."""
        if self.use_cpu_kernels is None:
            from app.kernels import cpu_kernels

            self.use_cpu_kernels = self.device.type == "cpu" and cpu_kernels.available()
        return self.use_cpu_kernels

    def kernel_problem(self) -> str | None:
        """Why the kernels cannot serve this cache, or None."""
        d = self.spec.head_dim
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if d & (d - 1) or not 32 <= d <= 256:
            return f"head_dim {d} is not a power of two in [32, 256]"
        if self.spec.compute_dtype not in (torch.bfloat16, torch.float16):
            return f"compute dtype {self.spec.compute_dtype} (kernels take bf16/fp16 queries)"
        return None

    @abstractmethod
    def layer_pages(self, layer: int):
        """(K pages, V pages) of one layer in the kernels' forms (app/kernels/paged.py)."""

    kernel_formats: tuple = (None, None)  # (K, V) FP4Format for fp4 pages

    def store(
        self,
        layer: int,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0: skip the token
        nonfinite: torch.Tensor | None = None,  # [>= num_tokens] int32 flags (AttentionMetadata.nonfinite)
    ) -> None:
        """Write (quantizing if the format does) the new tokens' K/V into their slots. With
        `nonfinite`, tokens whose K or V holds NaN/Inf are flagged there and not written (no device
        sync on the kernel path); without it, quantized formats raise ValueError on them."""
        if self.kernels_enabled():
            from app.kernels.store_kv import store_kv

            store_kv(key, value, slot_mapping, *self.layer_pages(layer), self.kernel_formats, self.check_finite,
                     nonfinite=nonfinite)
            return
        keep = slot_mapping >= 0
        if nonfinite is not None:
            finite = ~self._nonfinite(key, value)
            nonfinite[: len(finite)] |= (~finite).to(nonfinite.dtype)
            keep &= finite
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        self._store_ref(layer, key, value, slot_mapping.long())

    def _nonfinite(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """[N] bool: tokens whose K or V holds NaN/Inf."""
        if self.cpu_kernels_enabled():
            from app.kernels import cpu_kernels

            return cpu_kernels.nonfinite_tokens(key, value)
        return ~(torch.isfinite(key).flatten(1).all(1) & torch.isfinite(value).flatten(1).all(1))

    def _refuse_nonfinite(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """ValueError naming the first token whose K or V holds NaN/Inf (before anything is written)."""
        bad = self._nonfinite(key, value).nonzero()
        if len(bad):
            raise ValueError(f"non-finite value in K/V of token {bad[0].item()}: refusing to store it in the KV cache")

    @abstractmethod
    def _store_ref(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The torch path of `store`."""

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
        if self.kernels_enabled():
            return self._attend_kernels(layer, query, meta, scale)
        if self.cpu_kernels_enabled():
            return self._attend_cpu(layer, query, meta, scale)
        return self._attend(layer, query, meta, scale, self.read_exact)

    def read_exact(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads: the pages' exact values (quantized formats dequantize to float32,
        as the kernels do in registers, rather than rounding to the compute dtype)."""
        return self.read_blocks(layer, block_ids)

    def warm_kernels(self, num_heads: int, max_blocks_per_seq: int) -> None:
        """Compile, before serving, every build of the store and decode kernels that this cache's
        launches can pick: writes nothing. The store through this cache's own store() (whatever it
        does before the kernel, e.g. fp4's rotation in float32), once with few (token, KV head) rows
        and once with more than store_kv.WIDE_ROWS, over tokens whose slots are all -1; the decode
        kernels by decode_attention.warm_builds. The decode graphs' capture covers only their own
        builds; the prefill paths are warmed by the engine's warm-up requests (LLMEngine._warm_up)."""
        if not self.kernels_enabled():
            return
        from app.kernels import decode_attention, store_kv

        s, dtype = self.spec, self.spec.compute_dtype
        for num_tokens in (1, store_kv.WIDE_ROWS // s.num_kv_heads + 1):
            kv = torch.zeros(num_tokens, s.num_kv_heads, s.head_dim, dtype=dtype, device=self.device)
            slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)
            self.store(0, kv, kv, slots, nonfinite=torch.zeros(num_tokens, dtype=torch.int32, device=self.device))
        k_pages, v_pages = self.layer_pages(0)
        decode_attention.warm_builds(num_heads, k_pages, v_pages, self.kernel_formats, dtype, max_blocks_per_seq)

    def _attend_kernels(self, layer, query, meta, scale) -> torch.Tensor:
        """A step of decodes only runs split-KV flash-decoding. Any other step runs the plan of
        app/engine/prefill_plan.py: its one-token rows through the decode kernel, its prefill chunks
        through the prefill kernel, over the pages themselves (dense) or over a dense scratch into
        which their blocks are dequantized once per layer (fp8, fp4)."""
        from app.kernels import paged
        from app.kernels.decode_attention import decode_attention
        from app.kernels.dequantize_blocks import dequantize_blocks
        from app.kernels.prefill_attention import prefill_attention

        k_pages, v_pages = self.layer_pages(layer)
        formats = self.kernel_formats
        if meta.max_query_len == 1:  # a decode-only step
            return decode_attention(query, k_pages, v_pages, meta.block_tables, meta.seq_lens_tensor, scale,
                                    meta.max_seq_len, formats)
        dense = paged.page_kind(k_pages) == paged.DENSE
        plan = self._prefill_plan(meta, not dense, query.device)
        out = torch.empty_like(query)
        dec = plan.decodes
        if dec is not None:
            tables, lens = self._decode_rows_inputs(meta, dec)
            o = decode_attention(query.index_select(0, dec.rows), k_pages, v_pages, tables, lens, scale,
                                 dec.max_seq_len, formats)
            out.index_copy_(0, dec.rows, o)
        seq_lens, qsl = meta.seq_lens_tensor, meta.query_start_loc_tensor
        if dense:
            return prefill_attention(query, k_pages, v_pages, meta.block_tables, seq_lens, qsl, scale, formats,
                                     out=out, skip_decodes=dec is not None)
        for g in plan.groups:
            sk, sv = self._scratch(g.num_blocks, query.dtype)
            tables = meta.block_tables[g.first:g.end]
            dequantize_blocks(k_pages, formats[0], tables, g.prog_seq, g.prog_blk, g.seq_off, sk)
            dequantize_blocks(v_pages, formats[1], tables, g.prog_seq, g.prog_blk, g.seq_off, sv)
            prefill_attention(query, sk, sv, g.tables, seq_lens[g.first:g.end], qsl[g.first:g.end + 1], scale,
                              out=out, skip_decodes=True, num_rows=g.row_end - g.row_start)
        return out

    def _decode_rows_inputs(self, meta, dec) -> tuple[torch.Tensor, torch.Tensor]:
        """The block tables and lengths of a mixed step's decode rows, gathered on the first layer's call."""
        cached = self._decode_rows_step
        if cached is None or cached[0] is not meta:
            cached = self._decode_rows_step = (meta, meta.block_tables.index_select(0, dec.seqs),
                                               meta.seq_lens_tensor.index_select(0, dec.seqs))
        return cached[1], cached[2]

    def _prefill_plan(self, meta, quantized: bool, device):
        """The step's PrefillPlan, built on the first layer's call and reused by the others."""
        from app.engine.prefill_plan import plan_prefill

        cached = self._prefill_step
        if cached is not None and cached[0] is meta:
            return cached[1]
        plan = plan_prefill(meta.seq_lens, meta.query_start_loc, self.spec.block_size, quantized,
                            cdiv(self.scratch_tokens, self.spec.block_size), device)
        self._prefill_step = (meta, plan)
        return plan

    def reserve_scratch(self, max_model_len: int) -> None:
        """Quantized formats: allocate the prefill scratch now, sized for max_model_len (at least
        SCRATCH_TOKENS), so that no sequence outgrows it while serving (scratch_bytes counts it in
        the memory budget)."""
        if self.name in _SCRATCH_FORMATS:
            self.scratch_tokens = scratch_tokens(max_model_len)
            self._scratch(cdiv(self.scratch_tokens, self.spec.block_size), self.spec.compute_dtype)

    def _scratch(self, num_blocks: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V scratch pages of at least num_blocks blocks (allocated on first use, grown to
        the largest need, never shrunk): [blocks, block_size, num_kv_heads, head_dim] each."""
        have = self._scratch_pages
        if have is None or have[0].shape[0] < num_blocks or have[0].dtype != dtype:
            have = self._scratch_pages = None  # the old pair is freed before the larger one is allocated
            s = self.spec
            shape = (max(num_blocks, cdiv(self.scratch_tokens, s.block_size)), s.block_size, s.num_kv_heads,
                     s.head_dim)
            self._scratch_pages = have = (torch.empty(shape, dtype=dtype, device=self.device),
                                          torch.empty(shape, dtype=dtype, device=self.device))
        return have

    def _shared_prefixes(self, meta, query_lens: list[int], seq_lens: list[int]) -> list[tuple[list[int], int]]:
        """Groups of sequences, decodes and prefill chunks alike, whose block tables start with the
        same full blocks before their first new token (prefix-cache hits on one prompt): [(sequences,
        shared blocks)], each with >= 2 sequences sharing >= cascade_min_tokens tokens. Computed once
        per step (every layer reuses it)."""
        if self.cascade_min_tokens <= 0:
            return []
        if self._cascade_step is not None and self._cascade_step[0] is meta:
            return self._cascade_step[1]
        bs = self.spec.block_size

        def cached_blocks(i):  # full blocks before the sequence's first new token
            return (seq_lens[i] - query_lens[i]) // bs

        min_blocks = -(-self.cascade_min_tokens // bs)
        seqs = [i for i, n in enumerate(query_lens) if n >= 1 and cached_blocks(i) >= min_blocks]
        groups = []
        if len(seqs) >= 2:
            tables = meta.block_tables[seqs]
            by_first: dict[int, list[int]] = {}
            for j, b in enumerate(tables[:, 0].tolist()):
                by_first.setdefault(b, []).append(j)
            for js in by_first.values():
                groups += self._split_by_shared_blocks([seqs[j] for j in js], tables[js],
                                                       [cached_blocks(seqs[j]) for j in js], min_blocks)
        self._cascade_step = (meta, groups)
        return groups

    @staticmethod
    def _split_by_shared_blocks(seqs: list[int], tables: torch.Tensor, caps: list[int], min_blocks: int
                                ) -> list[tuple[list[int], int]]:
        """Sequences whose tables start alike, split so that one that shares little does not cut the
        others' shared part (a newcomer sharing a 256-token system prompt with 200 decodes on one
        3,247-token prompt would make their group's prefix 16 blocks instead of 202): the anchor is
        the one with the most cached blocks, its group those sharing the longest prefix any other
        shares with it (capped by their own cached blocks); the rest are split the same way. A
        group's members then read a shorter prefix they share with the rest once more, alone."""
        groups = []
        left = list(range(len(seqs)))
        while len(left) >= 2:
            anchor = max(left, key=lambda j: caps[j])
            width = caps[anchor]
            same = (tables[left, :width] == tables[anchor, :width]).int().cumprod(1).sum(1).tolist()
            lcp = {j: min(n, caps[j]) for n, j in zip(same, left)}
            longest = max(lcp[j] for j in left if j != anchor)
            if longest < min_blocks:  # the anchor shares too little with all of them: the others may still group
                left.remove(anchor)
                continue
            groups.append(([seqs[j] for j in left if lcp[j] >= longest], longest))
            left = [j for j in left if lcp[j] < longest]
        return groups

    def _attend_cpu(self, layer, query, meta, scale) -> torch.Tensor:
        """The CPU extension: decodes in one fused call, each prefill chunk over its blocks gathered
        once (dequantized into the compute dtype) by the extension's or torch's flash kernel.

        Cascade attention (bf16 on CPUs with AVX512-BF16, and float32): sequences that share prefix
        blocks before their new tokens (decodes, and prefill chunks of prompts that hit one cached
        prompt) attend to them together, the prefix gathered (dequantized) once and all their query
        rows run through the prefill kernel as one matrix product; each then attends to its own
        remaining tokens (a decode through the decode kernel, a prefill chunk causally) and the two
        halves merge by log-sum-exp. Without it every sequence re-reads (and, quantized,
        re-dequantizes and repacks) the shared prompt in every layer of every step: 250 agents
        sending one 3,247-token prompt at once did so 128 times per prefill step."""
        from app.kernels import cpu_kernels

        out = torch.empty_like(query)
        k_pages, v_pages = self.layer_pages(layer)
        k_fmt, v_fmt = self.kernel_formats
        bs = self.spec.block_size
        seq_lens_t = meta.seq_lens_tensor
        seq_lens, qsl = seq_lens_t.tolist(), meta.query_start_loc_tensor.tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
        done = [False] * len(seq_lens)

        def dense(block_ids, num_tokens=None):  # the blocks' K and V gathered (dequantized), cut to num_tokens
            k = cpu_kernels.gather(k_pages, k_fmt, block_ids, query.dtype)
            v = cpu_kernels.gather(v_pages, v_fmt, block_ids, query.dtype)
            return (k, v) if num_tokens is None else (k[:num_tokens], v[:num_tokens])

        if cpu_kernels.has_prefix_attention(query):
            for members, shared in self._shared_prefixes(meta, query_lens, seq_lens):
                starts = [0]  # each member's first row in q
                for i in members:
                    starts.append(starts[-1] + query_lens[i])
                rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in members])
                q = query[rows]
                out_pre, lse_pre = cpu_kernels.prefix_attention(q, *dense(meta.block_tables[members[0], :shared]), scale)
                out_own = torch.empty(q.shape, dtype=torch.float32)
                lse_own = torch.empty(q.shape[:2], dtype=torch.float32)
                decodes = [j for j, i in enumerate(members) if query_lens[i] == 1]
                if decodes:
                    seqs = [members[j] for j in decodes]
                    own_lens = torch.tensor([seq_lens[i] - shared * bs for i in seqs])
                    cpu_kernels.decode(q, k_pages, v_pages, self.kernel_formats, meta.block_tables[seqs][:, shared:],
                                       own_lens, torch.tensor([starts[j] for j in decodes]), scale, out_own, lse_own)
                for j, i in enumerate(members):
                    if query_lens[i] == 1:
                        continue
                    k, v = dense(meta.block_tables[i, shared:cdiv(seq_lens[i], bs)], seq_lens[i] - shared * bs)
                    a, b = starts[j], starts[j + 1]
                    out_own[a:b], lse_own[a:b] = cpu_kernels.prefill(q[a:b], k, v, scale, with_lse=True)
                out[rows] = cpu_kernels.merge_attention(out_pre, lse_pre, out_own, lse_own).to(query.dtype)
                for i in members:
                    done[i] = True
        rows = [qsl[i] if query_lens[i] == 1 and not done[i] else -1 for i in range(len(seq_lens))]
        if any(r >= 0 for r in rows):
            cpu_kernels.decode(query, k_pages, v_pages, self.kernel_formats, meta.block_tables, seq_lens_t,
                               torch.tensor(rows), scale, out)
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end - start <= 1 or done[i]:
                continue  # a decode (done above), nothing, or cascaded
            k, v = dense(meta.block_tables[i, : cdiv(seq_len, bs)], seq_len)
            out[start:end] = cpu_kernels.prefill(query[start:end], k, v, scale)
        return out

    def _attend(self, layer, query, meta, scale, read_blocks) -> torch.Tensor:
        """Torch reference over pages that `read_blocks(layer, ids)` returns (read_exact: float32).

        Sequences with one new token (decodes) are batched into one padded gather; the others
        (prefill chunks) run one by one.
        """
        out = torch.empty_like(query)
        bs = self.spec.block_size
        # The device tensors are what a replayed step holds (the lists are the capture's); reading
        # them syncs, which the torch path may: it never runs inside a CUDA graph.
        seq_lens, qsl = meta.seq_lens_tensor.tolist(), meta.query_start_loc_tensor.tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        if decodes:
            rows = [qsl[i] for i in decodes]
            lens = [seq_lens[i] for i in decodes]
            num_blocks = cdiv(max(lens), bs)
            tables = meta.block_tables[decodes, :num_blocks]  # [d, num_blocks]
            k, v = read_blocks(layer, tables.flatten())  # [d * num_blocks, bs, kvh, hd]
            read = torch.arange(k.shape[0], device=query.device).view(tables.shape)  # tables' blocks in k, v
            lens_t = torch.tensor(lens, device=query.device)
            out[rows] = decode_attention_ref(query[rows], k, v, read, lens_t, scale).to(query.dtype)
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
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

    def kernel_problem(self) -> str | None:
        if self.dtype != self.spec.compute_dtype:
            return f"{self.name} pages with {self.spec.compute_dtype} compute"
        return super().kernel_problem()

    def layer_pages(self, layer):
        return self.k_cache[layer], self.v_cache[layer]

    def _store_ref(self, layer, key, value, slot_mapping) -> None:
        s = self.spec
        self.k_cache[layer].view(-1, s.num_kv_heads, s.head_dim)[slot_mapping] = key.to(self.dtype)
        self.v_cache[layer].view(-1, s.num_kv_heads, s.head_dim)[slot_mapping] = value.to(self.dtype)

    def read_blocks(self, layer, block_ids):
        dt = self.spec.compute_dtype
        return self.k_cache[layer][block_ids].to(dt), self.v_cache[layer][block_ids].to(dt)


SideFormats = tuple[fp4.FP4Format | None, fp4.FP4Format | None]  # (K, V): None stores that side as fp8
FP4Formats = tuple[fp4.FP4Format, fp4.FP4Format]  # (K, V)
DEFAULT_FP4_FORMATS: FP4Formats = FP4Config().formats()


def side_bytes_per_vector(fmt: fp4.FP4Format | None, head_dim: int) -> int:
    """Bytes of one (token, KV head) vector of one side: fp8 (fmt None) or fp4 in format fmt."""
    return head_dim + fp8.FP8_BYTES_PER_VECTOR_EXTRA if fmt is None else fmt.bytes_per_vector(head_dim)


def _side_pages(spec: KVCacheSpec, num_blocks: int, device: torch.device, fmt: fp4.FP4Format | None):
    """One layer's pages of one side, zeroed, in app/kernels/paged.py's form: fp8 (fmt None) or fp4."""
    page = (num_blocks, spec.block_size, spec.num_kv_heads)
    d = spec.head_dim
    if fmt is None:
        return (torch.zeros(*page, d, dtype=torch.float8_e4m3fn, device=device),  # values
                torch.zeros(page, dtype=torch.float32, device=device))  # scale
    return fp4.FP4Tensor(
        codes=torch.zeros(*page, d // 2, dtype=torch.uint8, device=device),
        scales=torch.zeros(*page, d // fmt.group(d), dtype=torch.float8_e4m3fn, device=device),
        scale_exp=torch.zeros(page, dtype=torch.uint8, device=device),
        out_vals=torch.zeros(*page, fmt.outliers, dtype=torch.bfloat16, device=device),
        out_idx=torch.zeros(*page, fmt.outliers, dtype=torch.uint8, device=device),
    )


class QuantizedKVCache(KVCache):
    """fp8 or fp4 pages for each of K and V. `formats` (K, V) says per side: None stores it as fp8 E4M3
    with one float32 scale per (token, KV head) vector (app/kernels/fp8.py), an FP4Format as fp4
    (app/kernels/fp4.py). pages[2 * layer] holds K and pages[2 * layer + 1] V, each in its side's form
    (app/kernels/paged.py: the kernels branch on each side's page kind). The subclasses name a
    combination: `side_formats` picks the sides from config.fp4's (K, V) formats."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device, fp4_formats: FP4Formats = DEFAULT_FP4_FORMATS):
        super().__init__(spec, num_blocks, device)
        self.formats: SideFormats = self.side_formats(fp4_formats)
        for fmt in self.formats:
            if fmt is not None:
                fmt.check(spec.head_dim)
        rotated = [fmt is not None and fmt.rotate for fmt in self.formats]
        if any(rotated) and not all(rotated):
            raise ValueError("the fp4 rotation turns K and V together (queries and outputs alike): both sides "
                             f"must be fp4 with rotate set ({self.name!r} has {self.formats})")
        self.rotation = fp4.hadamard_rotation(spec.head_dim, self.device) if all(rotated) else None
        self.pages = [_side_pages(spec, num_blocks, self.device, fmt)
                      for _ in range(spec.num_layers) for fmt in self.formats]

    @staticmethod
    @abstractmethod
    def side_formats(fp4_formats: FP4Formats) -> SideFormats:
        """(K, V) side formats of this combination, from config.fp4's (K, V) fp4 formats."""

    @classmethod
    def bytes_per_token_per_layer(cls, spec: KVCacheSpec, fp4_formats: FP4Formats = DEFAULT_FP4_FORMATS) -> int:
        return spec.num_kv_heads * sum(side_bytes_per_vector(f, spec.head_dim) for f in cls.side_formats(fp4_formats))

    @property
    def kernel_formats(self):
        return self.formats

    def kernel_problem(self) -> str | None:
        if any(fmt is not None and len(fmt.scale_targets) > 4 for fmt in self.formats):
            return "more than 4 fp4 scale_targets"
        return super().kernel_problem()

    def layer_pages(self, layer):
        return self.pages[2 * layer], self.pages[2 * layer + 1]

    def store(self, layer, key, value, slot_mapping, nonfinite=None) -> None:
        if self.rotation is not None and self.kernels_enabled():  # the rotation stays in torch
            key, value = key.float() @ self.rotation, value.float() @ self.rotation
        super().store(layer, key, value, slot_mapping, nonfinite)

    def _store_ref(self, layer, key, value, slot_mapping) -> None:
        if self.cpu_kernels_enabled() and all(f is None or f.outlier_mode == "topk" for f in self.formats):
            from app.kernels import cpu_kernels

            self._refuse_nonfinite(key, value)  # both checked before any write
            for i, (x, fmt) in enumerate(zip((key, value), self.formats)):
                pages = self.pages[2 * layer + i]
                if fmt is None:
                    cpu_kernels.store_fp8(x, slot_mapping, *pages)
                    continue
                if self.rotation is not None:
                    x = x.float() @ self.rotation
                cpu_kernels.store_fp4(x, slot_mapping, pages, fmt)
            return
        quantized = [fp8.fp8_quantize(x) if fmt is None else fp4.fp4_quantize(x, fmt, self.rotation)
                     for x, fmt in zip((key, value), self.formats)]
        for i, q in enumerate(quantized):  # both checked (NaN/Inf) before any write
            for page, new in zip(self.pages[2 * layer + i], q):
                if new.numel():  # outlier arrays are empty without outlier slots
                    page.view(-1, *new.shape[1:])[slot_mapping] = new

    def _read(self, layer, block_ids, rotated: bool):  # float32
        rotation = None if rotated else self.rotation
        out = []
        for i, fmt in enumerate(self.formats):
            blocks = [page[block_ids] for page in self.pages[2 * layer + i]]
            out.append(fp8.fp8_dequantize(*blocks) if fmt is None
                       else fp4.fp4_dequantize(fp4.FP4Tensor(*blocks), fmt, rotation))
        return out[0], out[1]

    def read_blocks(self, layer, block_ids):
        dt = self.spec.compute_dtype
        k, v = self._read(layer, block_ids, rotated=False)
        return k.to(dt), v.to(dt)

    def read_exact(self, layer, block_ids):
        return self._read(layer, block_ids, rotated=False)

    def attention(self, layer, query, meta, scale):
        if self.rotation is None:
            return super().attention(layer, query, meta, scale)
        # Attend in the rotated basis: q R . k R = q . k, and P (V R) R^T = P V.
        q = (query.float() @ self.rotation).to(query.dtype)
        if self.kernels_enabled():
            out = self._attend_kernels(layer, q, meta, scale)
        elif self.cpu_kernels_enabled():
            out = self._attend_cpu(layer, q, meta, scale)  # the pages hold the rotated basis
        else:
            out = self._attend(layer, q, meta, scale, lambda lyr, ids: self._read(lyr, ids, rotated=True))
        return (out.float() @ self.rotation.T).to(query.dtype)


class FP8KVCache(QuantizedKVCache):
    """FP8 E4M3 with one float32 scale per token and KV head (vLLM's fp8_per_token_head)."""

    name = "fp8"

    @staticmethod
    def side_formats(fp4_formats):
        return None, None


class FP4KVCache(QuantizedKVCache):
    """FP4 E2M1 codes with E4M3 group scales, an E8M0 second-level scale, outlier slots and an
    optional Hadamard rotation (app/kernels/fp4.py), in config.fp4's K and V formats."""

    name = "fp4"

    @staticmethod
    def side_formats(fp4_formats):
        return fp4_formats


class FP8KeysFP4ValuesKVCache(QuantizedKVCache):
    """Keys as FP8KVCache stores them, values as FP4KVCache stores values (config.fp4's value format):
    keys carry most of fp4's loss (bench/RESULTS.md, "KV quality"), so this trades some of fp4's
    capacity for accuracy. config.fp4's key options do not apply; its rotation (K and V together)
    cannot."""

    name = "fp8-fp4"

    @staticmethod
    def side_formats(fp4_formats):
        return None, fp4_formats[1]


_QUANTIZED = {cls.name: cls for cls in (FP8KVCache, FP4KVCache, FP8KeysFP4ValuesKVCache)}
KV_CACHE_DTYPES = ("auto", *_DENSE_DTYPES, *_QUANTIZED)


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (got {kv_cache_dtype!r})")
    if kv_cache_dtype == "auto":
        return _DENSE_NAMES[compute_dtype]
    return kv_cache_dtype


def kv_fp4_formats(kv_cache_dtype: str, fp4_formats: FP4Formats | None = None) -> list[fp4.FP4Format]:
    """The fp4 formats a cache of this kv_cache_dtype stores (those whose head_dim must check out):
    none for dense and fp8, K and V for fp4, V for fp8-fp4."""
    cls = _QUANTIZED.get(kv_cache_dtype)
    if cls is None:
        return []
    return [fmt for fmt in cls.side_formats(fp4_formats or DEFAULT_FP4_FORMATS) if fmt is not None]


def kv_bytes_per_token(kv_cache_dtype: str, spec: KVCacheSpec, fp4_formats: FP4Formats | None = None) -> int:
    """Bytes of KV cache one token needs across all layers in the given format (metadata included)."""
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    if name in _QUANTIZED:
        per_layer = _QUANTIZED[name].bytes_per_token_per_layer(spec, fp4_formats or DEFAULT_FP4_FORMATS)
    else:
        per_layer = DenseKVCache.bytes_per_token_per_layer(spec, _DENSE_DTYPES[name])
    return per_layer * spec.num_layers


_SCRATCH_FORMATS = tuple(_QUANTIZED)  # their prefill reads a dense scratch (app/engine/prefill_plan.py)


def scratch_tokens(max_model_len: int) -> int:
    return max(SCRATCH_TOKENS, max_model_len)


def scratch_bytes(kv_cache_dtype: str, spec: KVCacheSpec, device, max_model_len: int) -> int:
    """Bytes of the dense prefill scratch (K and V pages of the compute dtype) that a quantized cache on
    CUDA allocates beside its blocks (KVCache.reserve_scratch); 0 for dense formats and on the CPU."""
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    if torch.device(device).type != "cuda" or name not in _SCRATCH_FORMATS:
        return 0
    tokens = cdiv(scratch_tokens(max_model_len), spec.block_size) * spec.block_size
    return 2 * tokens * spec.num_kv_heads * spec.head_dim * spec.compute_dtype.itemsize


def create_kv_cache(
    kv_cache_dtype: str, spec: KVCacheSpec, num_blocks: int, device, fp4_formats: FP4Formats | None = None
) -> KVCache:
    name = resolve_kv_cache_dtype(kv_cache_dtype, spec.compute_dtype)
    if name in _QUANTIZED:
        return _QUANTIZED[name](spec, num_blocks, device, fp4_formats or DEFAULT_FP4_FORMATS)
    return DenseKVCache(spec, num_blocks, device, _DENSE_DTYPES[name])
