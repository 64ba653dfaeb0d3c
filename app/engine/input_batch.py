"""A model runner's persistent step inputs: allocated once, written in place every step.

Each array lives twice: a host staging tensor (pinned on CUDA, filled through a numpy view) and a
device tensor at a fixed address that one non-blocking copy per array fills. Fixed addresses are
what lets a CUDA graph captured over slices of them replay with each step's values; pinned
staging is what keeps the copies from synchronizing the host with the device (a copy from
pageable memory does). On the CPU the two are the same tensor.

Block tables stay on the device: every request the runner knows holds a row of `table`
[rows, max_blocks_per_seq]. A step sends only the block ids appended since the previous step
(a whole row for a new or preempted request) as (flat index, block id) pairs that one scatter
writes, then gathers its sequences' rows into `block_tables` [num_seqs, max_blocks_per_seq].
"""

from __future__ import annotations

import numpy as np
import torch


class _Staged:
    """One array: host staging (numpy view `np`) and its device twin `dev`."""

    __slots__ = ("host", "np", "dev")

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, fill: int = 0) -> None:
        pin = device.type == "cuda"
        self.host = torch.full((n,), fill, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else self.host.to(device)

    def upload(self, n: int) -> torch.Tensor:
        """The first n entries on the device (a non-blocking copy from pinned memory on CUDA)."""
        if self.dev is not self.host and n:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class InputBuffers:
    """Step inputs for at most max_num_tokens tokens of max_num_seqs sequences (see module doc)."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        T, S = max_num_tokens, max_num_seqs
        self.input_ids = _Staged(T, torch.int64, device)  # [T]
        self.positions = _Staged(T, torch.int64, device)  # [T]
        self.slot_mapping = _Staged(T, torch.int64, device, fill=-1)  # [T]; -1: not stored
        self.token_seq = _Staged(T, torch.int64, device)  # [T] the step's sequence index of each token
        self.seq_lens = _Staged(S, torch.int32, device, fill=1)  # [S]
        self.query_start_loc = _Staged(S + 1, torch.int32, device)  # [S + 1]
        self.row_ids = _Staged(S, torch.int64, device)  # [S] each sequence's row of `table`
        self.sample_rows = _Staged(S, torch.int64, device)  # [<= S] token rows that sample
        # async scheduling: input rows whose token is one the previous step sampled on the device, and
        # that token's row in its samples
        self.pending_dst = _Staged(S, torch.int64, device)
        self.pending_src = _Staged(S, torch.int64, device)
        self.nonfinite = torch.zeros(T, dtype=torch.int32, device=device)  # [T] flags the KV store sets
        self.block_tables = torch.zeros(S, max_blocks_per_seq, dtype=torch.int32, device=device)  # [S, B]
        self.table = torch.zeros(S, max_blocks_per_seq, dtype=torch.int32, device=device)  # [rows, B], grows
        self._free_rows: list[int] = list(range(S - 1, -1, -1))
        self._upd_idx = _Staged(0, torch.int64, device)
        self._upd_val = _Staged(0, torch.int32, device)
        self._idx: list[int] = []  # pending table writes: flat index -> block id
        self._val: list[int] = []
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    # -- block table rows ------------------------------------------------------------------------
    def take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            grown = torch.zeros(max(2 * old, self.max_num_seqs), self.max_blocks_per_seq, dtype=torch.int32,
                                device=self.device)
            grown[:old] = self.table
            self.table = grown
            self._free_rows = list(range(grown.shape[0] - 1, old - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        """Queue table[row, start:start + len(block_ids)] = block_ids for the next upload."""
        if start + len(block_ids) > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {start + len(block_ids)} blocks exceeds max_blocks_per_seq "
                             f"({self.max_blocks_per_seq}, from max_model_len)")
        base = row * self.max_blocks_per_seq + start
        self._idx.extend(range(base, base + len(block_ids)))
        self._val.extend(block_ids)

    def discard_pending(self) -> None:
        """Drop queued table writes (once uploaded, or when a step's staging failed: its requests
        come back whole)."""
        self._idx.clear()
        self._val.clear()

    # -- one step --------------------------------------------------------------------------------
    def wait_staging_free(self) -> None:
        """Block until the previous step's copies have read the pinned staging (before refilling it)."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self, num_tokens: int, num_seqs: int, num_samples: int,
               pending: tuple[list[int], list[int], torch.Tensor] | None = None) -> None:
        """Copy the staged step (and the pending table writes) to the device, then gather the step's
        block-table rows. num_tokens / num_seqs include any padding the host staged. pending: (input
        rows, rows of `samples`, samples): input_ids[rows] = samples[their rows], on the device (the
        previous step's tokens, not yet known to the host)."""
        if self._idx:
            n = len(self._idx)
            if n > self._upd_idx.host.shape[0]:
                self._upd_idx = _Staged(2 * n, torch.int64, self.device)
                self._upd_val = _Staged(2 * n, torch.int32, self.device)
            self._upd_idx.np[:n] = self._idx
            self._upd_val.np[:n] = self._val
            self.table.view(-1).scatter_(0, self._upd_idx.upload(n), self._upd_val.upload(n))
            self.discard_pending()  # written
        for staged in (self.input_ids, self.positions, self.slot_mapping, self.token_seq):
            staged.upload(num_tokens)
        self.seq_lens.upload(num_seqs)
        self.query_start_loc.upload(num_seqs + 1)
        self.sample_rows.upload(num_samples)
        torch.index_select(self.table, 0, self.row_ids.upload(num_seqs), out=self.block_tables[:num_seqs])
        if pending is not None:
            dst, src, samples = pending
            n = len(dst)
            self.pending_dst.np[:n] = dst
            self.pending_src.np[:n] = src
            self.input_ids.dev.index_copy_(0, self.pending_dst.upload(n),
                                           samples.index_select(0, self.pending_src.upload(n)))
        if self._copied is not None:
            self._copied.record()

    def stage_padding(self, num_tokens: int, num_seqs: int, padded_seqs: int) -> None:
        """Decode padding: sequences num_seqs..padded_seqs-1 get one token that is not stored (slot -1),
        attend to one cached token of row 0's first block and are never sampled."""
        n, p = num_seqs, padded_seqs
        self.input_ids.np[num_tokens:num_tokens + p - n] = 0
        self.positions.np[num_tokens:num_tokens + p - n] = 0
        self.slot_mapping.np[num_tokens:num_tokens + p - n] = -1
        self.token_seq.np[num_tokens:num_tokens + p - n] = np.arange(n, p)
        self.seq_lens.np[n:p] = 1
        self.query_start_loc.np[n + 1:p + 1] = np.arange(num_tokens + 1, num_tokens + 1 + p - n)
        self.row_ids.np[n:p] = 0
