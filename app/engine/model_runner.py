"""Turns a scheduled step into model inputs, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCache
from app.engine.sampler import Sampler, SamplerOutput
from app.engine.scheduler import SchedulerOutput
from app.engine.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampled sequence's last token
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # ids the tokenizer knows; logits beyond are never sampled
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = torch.device(device)
        self.sampler = Sampler()

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions, slots = [], []
        seq_lens, query_start_loc = [], [0]
        sample_rows, sample_seqs = [], []
        max_blocks = max(len(seq.block_table) for seq, _ in sched.scheduled)
        block_tables = torch.zeros(len(sched.scheduled), max_blocks, dtype=torch.int64)
        for i, (seq, num_new) in enumerate(sched.scheduled):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids.extend(seq.token_slice(start, end))
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            block_tables[i, : len(table)] = table
            pos = torch.arange(start, end, dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_new)
            if end == seq.num_tokens:
                sample_rows.append(query_start_loc[-1] - 1)
                sample_seqs.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            meta=meta,
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, generators: dict[str, torch.Generator]
    ) -> tuple[list[Sequence], SamplerOutput]:
        """Run one step; returns the sequences that sampled a token and what they sampled."""
        inputs = self.prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if not inputs.sample_rows:
            return [], SamplerOutput([], None, None)
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])[:, : self.vocab_size]  # [num_sampled, vocab] float32
        seqs = inputs.sample_seqs
        out = self.sampler(
            logits,
            [s.sampling_params for s in seqs],
            [generators.get(s.request_id) for s in seqs],
        )
        return seqs, out
