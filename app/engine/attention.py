"""Attention over a paged KV cache: the step metadata. The pure-torch reference the cache's torch path
runs (and the kernels are checked against) is app/kernels/attention_ref.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where one step's tokens go in the cache and what each sequence attends to.

    The step's tokens are flattened: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]
    of q/k/v. Its new tokens are the last query_lens[i] of its seq_lens[i] cached tokens. The
    model runner builds it once per step from its persistent buffers (the tensor fields are then
    slices of them, so a CUDA graph captured over them replays with each step's values); tests
    may pass only the lists and let the tensors be made on first use.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int32/int64: block_id * block_size + offset; < 0: not stored
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32/int64, rows padded
    seq_lens: list[int]  # [num_seqs] tokens in the cache after this step (context + new)
    query_start_loc: list[int]  # [num_seqs + 1] prefix sums of the new-token counts
    seq_lens_t: torch.Tensor | None = None  # [num_seqs] int32 on the device (None: made from seq_lens)
    query_start_loc_t: torch.Tensor | None = None  # [num_seqs + 1] int32 on the device
    # What the decode kernel sizes its KV splits for (None: max(seq_lens)). A captured decode graph
    # plans for max_model_len, so that one graph serves every length.
    plan_max_seq_len: int | None = None
    # [num_tokens] int32, or None: the store sets flag 1 for a token whose K or V holds NaN/Inf (and
    # does not write that token's vector); the runner reads the flags with the sampled tokens and
    # fails those requests. None: quantized formats raise ValueError instead (a device sync).
    nonfinite: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_seq_len(self) -> int:
        return self.plan_max_seq_len if self.plan_max_seq_len is not None else max(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def seq_lens_tensor(self) -> torch.Tensor:  # [num_seqs] int32 on block_tables' device
        if self.seq_lens_t is None:
            self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32).to(self.block_tables.device)
        return self.seq_lens_t

    @property
    def query_start_loc_tensor(self) -> torch.Tensor:  # [num_seqs + 1] int32 on block_tables' device
        if self.query_start_loc_t is None:
            self.query_start_loc_t = torch.tensor(self.query_start_loc, dtype=torch.int32).to(self.block_tables.device)
        return self.query_start_loc_t

    @property
    def query_lens(self) -> list[int]:
        qsl = self.query_start_loc
        return [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]

    def __post_init__(self) -> None:
        assert len(self.query_start_loc) == len(self.seq_lens) + 1
        assert self.query_start_loc[0] == 0
        assert self.query_start_loc[-1] == self.slot_mapping.numel()
        assert self.block_tables.shape[0] == len(self.seq_lens)
        assert all(q <= s for q, s in zip(self.query_lens, self.seq_lens))

