"""Torch references of app/kernels' attention (decode_attention.py, prefill_attention.py): float32
attention over dequantized pages. The engine's torch path (app/engine/kv_cache.py) runs them and the
kernels are checked against them; no Triton needed."""

from __future__ import annotations

import math

import torch

from app.kernels import fp4, fp8


def dequantize_pages(pages, fmt: fp4.FP4Format | None) -> torch.Tensor:
    """Pages (app/kernels/paged.py's forms: a dense tensor, fp8 (values, scale) or an fp4 FP4Tensor) ->
    float32 [num_blocks, block_size, H, D] (fp4 stays in its stored basis: no rotation)."""
    if isinstance(pages, fp4.FP4Tensor):
        return fp4.fp4_dequantize(pages, fmt)
    if isinstance(pages, tuple):
        return fp8.fp8_dequantize(*pages)
    return pages.float()


def causal_attention_ref(
    query: torch.Tensor,  # [num_q, num_heads, head_dim]
    key: torch.Tensor,  # [num_k, num_kv_heads, head_dim]; query j sits at position num_k - num_q + j
    value: torch.Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [num_q, num_heads, head_dim] float32
    num_q, num_heads, _ = query.shape
    num_k, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.float().view(num_q, num_kv_heads, group, -1)
    scores = torch.einsum("qhgd,khd->hgqk", q, key.float()) * scale  # [kvh, group, num_q, num_k]
    q_pos = torch.arange(num_k - num_q, num_k, device=query.device)
    k_pos = torch.arange(num_k, device=query.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, value.float())
    return out.reshape(num_q, num_heads, -1)


def decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
    k_pages, v_pages,  # [num_blocks, block_size, num_kv_heads, head_dim] in any form dequantize_pages takes
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs] (each >= 1): cached tokens, the new one included
    scale: float,
    formats: tuple[fp4.FP4Format | None, fp4.FP4Format | None] = (None, None),
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] float32
    """Float32 attention of each sequence's new token over its cached tokens: the pages dequantized,
    every sequence's blocks gathered into one batch padded to the longest, the padding masked."""
    k_all = dequantize_pages(k_pages, formats[0])
    v_all = dequantize_pages(v_pages, formats[1])
    num_seqs, num_heads, _ = query.shape
    bs, num_kv_heads = k_all.shape[1], k_all.shape[2]
    blocks = block_tables[:, : math.ceil(int(seq_lens.max()) / bs)].long()
    key = k_all[blocks].flatten(1, 2)  # [num_seqs, max_len, num_kv_heads, head_dim]
    value = v_all[blocks].flatten(1, 2)
    max_len = key.shape[1]
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, -1)
    scores = torch.einsum("bhgd,bkhd->bhgk", q, key) * scale  # [b, kvh, group, max_len]
    pad = torch.arange(max_len, device=query.device)[None, :] >= seq_lens[:, None]  # [b, max_len]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, value)
    return out.reshape(num_seqs, num_heads, -1)


def prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_pages, v_pages,  # as decode_attention_ref's
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    formats: tuple[fp4.FP4Format | None, fp4.FP4Format | None] = (None, None),
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float32
    """Float32 causal attention over the dequantized pages, one sequence at a time."""
    k_all = dequantize_pages(k_pages, formats[0])
    v_all = dequantize_pages(v_pages, formats[1])
    bs = k_all.shape[1]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        if qsl[i + 1] == qsl[i]:
            continue
        blocks = block_tables[i, : math.ceil(n / bs)].long()
        k = k_all[blocks].flatten(0, 1)[:n]
        v = v_all[blocks].flatten(0, 1)[:n]
        out[qsl[i] : qsl[i + 1]] = causal_attention_ref(query[qsl[i] : qsl[i + 1]], k, v, scale)
    return out


def dequantize_blocks_ref(pages, fmt, block_tables, prog_seq, prog_blk, seq_off, out) -> torch.Tensor:
    """dequantize_blocks (app/kernels/dequantize_blocks.py) in torch: the listed blocks, float32 values
    rounded once to out's dtype."""
    src = block_tables[prog_seq.long(), prog_blk.long()].long()
    out[(seq_off[prog_seq.long()] + prog_blk).long()] = dequantize_pages(pages, fmt)[src].to(out.dtype)
    return out
