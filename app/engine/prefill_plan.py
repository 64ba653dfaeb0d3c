"""How a step that is not decode-only runs attention on the GPU kernels, planned once per step (every
layer reuses the plan; KVCache._attend_kernels carries it out).

- **Decode rows of a mixed step** (sequences with one new token, beside prefill chunks) run the
  split-KV decode kernel, as in a decode-only step. The prefill kernel skips them: it would give each
  one a single program per KV head walking the whole context alone.
- **Prefill sequences over quantized pages** (fp8, fp4) run in two passes. Their blocks (the cached
  context and the chunk's own tokens, which the layer stored before attending) are dequantized once
  per layer into a dense scratch of the compute dtype (app/kernels/dequantize_blocks.py), and the
  prefill kernel attends over the scratch exactly as it does over bf16 pages (dequantizing inside the
  attention kernel repeated it for every block of query rows of a sequence: 16-64 of them for a
  2k-token chunk). A token still sees every key through the cache format, so chunked, one-shot,
  prefix-hit and recomputed prefills agree up to the scratch's one rounding to the compute dtype
  (exact for fp4; fp8 value x scale rounds once, where a one-token chunk, through the decode kernel,
  does not). Sequences go in groups of consecutive sequences whose blocks fit `scratch_blocks`; one
  longer than that goes alone (the engine reserves a scratch for max_model_len,
  KVCache.reserve_scratch, so none is; elsewhere the scratch grows to it).

Each sequence's scratch blocks are consecutive: sequence i of a group owns blocks seq_off[i] ..
seq_off[i] + cdiv(seq_len_i, block_size) - 1. The plan is built on the host from the step's lengths
(no device sync) and uploaded in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.engine.kv_cache_manager import cdiv

# Dense scratch per group of prefill sequences, in tokens: 64k tokens of K and V in bf16 are 268 MB at
# 8 KV heads x 128 (Llama-3.1-8B, or 70B at TP 1) and 34 MB at one KV head (70B at TP 8).
SCRATCH_TOKENS = 65536


@dataclass(slots=True)
class DecodeRows:
    rows: torch.Tensor  # [nd] int64: query rows of the step's one-token sequences
    seqs: torch.Tensor  # [nd] int64: their sequence indices
    max_seq_len: int


@dataclass(slots=True)
class ScratchGroup:
    first: int  # sequences first .. end - 1 of the step
    end: int
    row_start: int  # their query rows
    row_end: int
    num_blocks: int  # scratch blocks the group uses
    prog_seq: torch.Tensor  # [P] int32: per block to dequantize, its sequence (counted from first)
    prog_blk: torch.Tensor  # [P] int32: and its block index within the sequence
    seq_off: torch.Tensor  # [end - first] int32: each sequence's first scratch block
    tables: torch.Tensor  # [end - first, max blocks] int32: the scratch's block tables


@dataclass(slots=True)
class PrefillPlan:
    decodes: DecodeRows | None  # None: no one-token sequence in the step
    groups: list[ScratchGroup]  # empty for dense pages


def plan_prefill(seq_lens: list[int], query_start_loc: list[int], block_size: int, quantized: bool,
                 scratch_blocks: int, device: torch.device) -> PrefillPlan:
    """The plan of one step. quantized: the pages need the scratch."""
    bs = block_size
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    one = np.flatnonzero(q_lens == 1)
    arrays: list[np.ndarray] = []  # uploaded together, then sliced
    if len(one) and len(one) < len(lens):
        arrays += [qsl[one], one]
    groups_host = []
    if quantized:
        pre = np.flatnonzero(q_lens > 1)
        nb = -(-lens // bs)  # blocks of each sequence
        i = 0
        while i < len(pre):  # groups of consecutive prefill sequences that fit the scratch
            j, used = i + 1, int(nb[pre[i]])
            while j < len(pre) and used + nb[pre[j]] <= scratch_blocks:
                used += int(nb[pre[j]])
                j += 1
            groups_host.append(pre[i:j])
            i = j
        for members in groups_host:
            first, end = int(members[0]), int(members[-1]) + 1
            n = end - first
            counts = np.zeros(n, dtype=np.int64)
            counts[members - first] = nb[members]
            seq_off = np.concatenate(([0], np.cumsum(counts)[:-1]))
            prog_seq = np.repeat(members - first, nb[members])  # every block of every member
            prog_blk = np.concatenate([np.arange(c) for c in nb[members]])
            width = max(1, int(counts.max()))
            tables = seq_off[:, None] + np.arange(width)[None, :]
            arrays += [prog_seq, prog_blk, seq_off, tables.ravel()]
    if not arrays:
        return PrefillPlan(None, [])
    sizes = [len(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64))
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    parts = iter(torch.split(flat, sizes))
    decodes = None
    if len(one) and len(one) < len(lens):
        decodes = DecodeRows(next(parts), next(parts), int(lens[one].max()))
    groups = []
    for members in groups_host:
        first, end = int(members[0]), int(members[-1]) + 1
        prog_seq, prog_blk, seq_off, tables = (next(parts).to(torch.int32) for _ in range(4))
        groups.append(ScratchGroup(first, end, int(qsl[first]), int(qsl[end]), int(nb[members].sum()),
                                   prog_seq, prog_blk, seq_off, tables.view(end - first, -1)))
    return PrefillPlan(decodes, groups)
