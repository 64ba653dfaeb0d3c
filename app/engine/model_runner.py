"""One tensor-parallel rank: its model shard, its KV cache shard, and the requests it has seen.

The driver (app/engine/executor.py) sends each step as a StepMessage: per scheduled request only
its new token ids, their start position, the blocks appended to its block table and whether it
samples. The runner keeps each request's block table and sampling params (and, on rank 0, its
seeded generator) from one step to the next, until the request id comes back as finished. With
tp_size 1 this is the whole model in the engine's process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.config import EngineConfig
from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCache, KVCacheSpec, create_kv_cache, kv_bytes_per_token
from app.engine.kv_cache_manager import cdiv
from app.engine.loader import load_model
from app.engine.sampler import Sampler, SamplerOutput
from app.engine.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_MEMORY = 1 << 30


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[dtype]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step, as the driver sends it to every rank."""

    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    start_pos: int  # position of token_ids[0] (the request's num_computed_tokens)
    block_ids: list[int]  # appended to its block table; the whole table when params is set
    # Set when a rank first sees the request and again after a preemption: the rank (re)starts
    # its block table from block_ids. None: the rank knows the request; block_ids extend its table.
    params: SamplingParams | None
    do_sample: bool  # this step reaches the request's last token: sample its next one


@dataclass(slots=True)
class StepMessage:
    requests: list[ScheduledRequest]
    finished_request_ids: list[str]  # drop their state (block table, params, generator) first


@dataclass(slots=True)
class _RequestState:
    block_table: list[int]
    params: SamplingParams


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampling request's last token
    sample_request_ids: list[str]


def fit_num_kv_blocks(config: EngineConfig, kv_bytes_per_token: int, device: torch.device,
                      max_model_len: int) -> int:
    """KV blocks of kv_bytes_per_token-byte tokens that fit this rank's budget: config.num_kv_blocks;
    else kv_cache_memory; on GPU gpu_memory_utilization x total - used; on CPU 1 GiB. A number
    derived from memory is capped at what max_num_seqs requests of max_model_len tokens use."""
    c = config
    if c.num_kv_blocks is not None:
        return c.num_kv_blocks
    if c.kv_cache_memory is not None:
        budget = int(c.kv_cache_memory)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * c.gpu_memory_utilization) - (total - free)
    else:
        budget = CPU_DEFAULT_KV_MEMORY
    num_blocks = budget // (kv_bytes_per_token * c.block_size)
    if num_blocks < 1:
        raise ValueError(f"KV cache memory budget {budget} B is too small for one block "
                         f"({kv_bytes_per_token * c.block_size} B); raise kv_cache_memory")
    return min(num_blocks, c.max_num_seqs * cdiv(max_model_len, c.block_size))


class ModelRunner:
    """Rank tp_rank of tp_size: loads its shard, holds its KV heads' cache, runs steps.

    Only rank 0 computes logits and samples; `execute` returns None on the other ranks. Rows of
    requests without a seed share one generator seeded from config.seed.
    """

    def __init__(self, config: EngineConfig, vocab_size: int, tp_rank: int = 0, tp_size: int = 1,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device if device is not None else config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.vocab_size = vocab_size  # ids the tokenizer knows; logits beyond are never sampled
        self.model, mc = load_model(config.model, device=self.device, dtype=self.dtype,
                                    load_format=config.load_format, seed=config.seed,
                                    tp_rank=tp_rank, tp_size=tp_size)
        self.kv_spec = KVCacheSpec(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads // tp_size,  # this rank's KV heads only
            head_dim=mc.head_dim,
            block_size=config.block_size,
            compute_dtype=self.dtype,
        )
        self.fp4_formats = config.fp4.formats()
        self.kv_bytes_per_token = kv_bytes_per_token(config.kv_cache_dtype, self.kv_spec, self.fp4_formats)
        self.kv_cache: KVCache | None = None
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed)) if tp_rank == 0 else None
        self.requests: dict[str, _RequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # rank 0: requests with a seed

    def num_kv_blocks_fit(self, max_model_len: int) -> int:
        return fit_num_kv_blocks(self.config, self.kv_bytes_per_token, self.device, max_model_len)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = create_kv_cache(self.config.kv_cache_dtype, self.kv_spec, num_blocks, self.device,
                                        self.fp4_formats)

    def _update_requests(self, step: StepMessage) -> None:
        for rid in step.finished_request_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for r in step.requests:
            if r.params is not None:
                self.requests[r.request_id] = _RequestState(list(r.block_ids), r.params)
                if self.sampler is not None and r.params.seed is not None and r.request_id not in self.generators:
                    self.generators[r.request_id] = torch.Generator(self.device).manual_seed(r.params.seed)
            else:
                self.requests[r.request_id].block_table.extend(r.block_ids)

    def prepare(self, step: StepMessage) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions, slots = [], []
        seq_lens, query_start_loc = [], [0]
        sample_rows, sample_ids = [], []
        tables = [self.requests[r.request_id].block_table for r in step.requests]
        block_tables = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
        for i, (r, table) in enumerate(zip(step.requests, tables)):
            start, end = r.start_pos, r.start_pos + len(r.token_ids)
            input_ids.extend(r.token_ids)
            table = torch.tensor(table, dtype=torch.int64)
            block_tables[i, : len(table)] = table
            pos = torch.arange(start, end, dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + len(r.token_ids))
            if r.do_sample:
                sample_rows.append(query_start_loc[-1] - 1)
                sample_ids.append(r.request_id)
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
            sample_request_ids=sample_ids,
        )

    @property
    def block_size(self) -> int:
        return self.kv_spec.block_size

    @torch.inference_mode()
    def execute(self, step: StepMessage) -> SamplerOutput | None:
        """Run one step on this rank; rank 0 returns what the sampling requests sampled, in order."""
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        self._update_requests(step)
        if not step.requests:
            return None
        inputs = self.prepare(step)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if self.sampler is None:
            return None
        if not inputs.sample_rows:
            return SamplerOutput([], None, None)
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])[:, : self.vocab_size]  # [num_sampled, vocab] float32
        rids = inputs.sample_request_ids
        return self.sampler(
            logits,
            [self.requests[rid].params for rid in rids],
            [self.generators.get(rid) for rid in rids],
        )
