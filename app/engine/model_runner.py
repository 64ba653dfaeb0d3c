"""One tensor-parallel rank: its model shard, its KV cache shard, and the requests it has seen.

The driver (app/engine/executor.py) sends each step as a StepMessage: per scheduled request only
its new token ids, their start position, the blocks appended to its block table and whether it
samples. The runner keeps each request's block table and sampling params (and, on rank 0, its
seeded generator) from one step to the next, until the request id comes back as finished. With
tp_size 1 this is the whole model in the engine's process.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from app.config import EngineConfig
from app.engine.attention import AttentionMetadata
from app.engine.errors import KVCacheAllocationError
from app.engine.input_batch import InputBuffers
from app.engine.kv_cache import KVCache, KVCacheSpec, create_kv_cache, kv_bytes_per_token, scratch_bytes
from app.engine.kv_cache_manager import cdiv
from app.engine.loader import load_model
from app.engine.sampler import PendingSample, Sampler, SamplerOutput
from app.engine.sampling_params import SamplingParams
from app.engine.sequence import PENDING_TOKEN

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_MEMORY = 1 << 30


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16
    extension), from the kernel's CPU flags; False where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (Linux: the affinity mask, each CPU's
    package and core id from sysfs, so SMT siblings count once, as torch's own default does);
    the logical count where the topology is not readable."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as pkg, open(topology + "core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def cpu_threads(config: EngineConfig) -> int:
    """Torch threads of one worker's CPU compute: config.cpu_threads, else the physical cores this
    process may run on shared among the tensor-parallel ranks (inside Ray, OMP_NUM_THREADS is the
    actor's CPU reservation, often a fraction, so torch's own default would be one thread)."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    return max(1, physical_cores() // config.tensor_parallel_size)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on GPUs and on CPUs with native bf16 (cpu_has_bf16), float32 on other CPUs."""
    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or cpu_has_bf16() else torch.float32
    return _DTYPES[dtype]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step, as the driver sends it to every rank."""

    request_id: str
    # the tokens whose K/V this step computes; PENDING_TOKEN: the token this request sampled in the
    # previous step, still on the device (async scheduling; only as a one-token row)
    token_ids: list[int]
    start_pos: int  # position of token_ids[0] (the request's num_computed_tokens)
    block_ids: list[int]  # appended to its block table; the whole table when params is set
    # Set when a rank first sees the request and again after a preemption: the rank (re)starts
    # its block table from block_ids. None: the rank knows the request; block_ids extend its table.
    params: SamplingParams | None
    do_sample: bool  # this step reaches the request's last token: sample its next one
    # With prompt_logprobs: the prompt tokens that follow this step's leading tokens (the row of
    # position p scores the token at p + 1), for the rows that have one; None otherwise.
    prompt_targets: list[int] | None = None


@dataclass(slots=True)
class GrammarMask:
    """Structured outputs' token bitmask of one step, for rank 0's sampler (app/engine/grammar.py
    fills it): which tokens each constrained row may pick."""

    rows: list[int]  # the constrained rows, as indices among the step's sampling requests
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the CPU: bit j of a row allows token j


@dataclass(slots=True)
class StepMessage:
    requests: list[ScheduledRequest]
    finished_request_ids: list[str]  # drop their state (block table, params, generator) first
    grammar: GrammarMask | None = None  # rank 0 masks these rows' logits before it samples
    # Run the forward and keep the logits; the sampling waits for ModelRunner.sample(mask) (async
    # scheduling with structured outputs: the mask needs the previous step's tokens on the host).
    defer_sample: bool = False


@dataclass(slots=True)
class _CachedRequest:
    """A request as a rank keeps it between steps (vLLM's CachedRequestState); the engine's own
    record of a request is engine.py's _RequestState."""

    block_table: list[int]
    params: SamplingParams
    row: int  # its row of the device block table (InputBuffers.table)
    num_synced: int = 0  # leading block ids of block_table already written to that row


class StepResult:
    """A launched step's result on its way to the host (ModelRunner.launch); result() waits for it.
    A step launched with defer_sample has no sample until ModelRunner.sample() gives it one."""

    def __init__(self, sample: PendingSample | None = None, finish=None, deferred: bool = False) -> None:
        self._sample, self._finish, self.deferred = sample, finish, deferred

    def result(self) -> SamplerOutput | None:
        if self._sample is None and self.deferred:  # its sampling never ran (a step failed meanwhile)
            return SamplerOutput([], None, None)
        return None if self._sample is None else self._finish(self._sample.result())


@dataclass(slots=True)
class StepInputs:
    num_tokens: int  # the step's tokens (padding excluded)
    num_seqs: int
    graph_size: int | None  # the captured decode graph to replay (its batch size), or None: eager
    input_ids: torch.Tensor  # [num_tokens (+ padding)] int64, a slice of the persistent buffer
    positions: torch.Tensor  # [num_tokens (+ padding)] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_samples] int64 on the device: row of each sampling request's last token
    sample_request_ids: list[str]


class _MaskStaging:
    """Pinned host and device buffers of a step's grammar bitmask (CUDA only)."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        self.bits_host = torch.empty(rows, words, dtype=torch.int32, pin_memory=True)
        self.rows_host = torch.empty(rows, dtype=torch.int64, pin_memory=True)
        self.bits = torch.empty(rows, words, dtype=torch.int32, device=device)  # [rows, words]
        self.rows = torch.empty(rows, dtype=torch.int64, device=device)  # [rows]
        self._copied = torch.cuda.Event()
        self._copied.record()

    def upload(self, rows: list[int], bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(rows)
        self._copied.synchronize()  # the previous step's copies have read the staging
        self.bits_host[:k].copy_(bitmask)
        self.rows_host.numpy()[:k] = rows
        self.bits[:k].copy_(self.bits_host[:k], non_blocking=True)
        self.rows[:k].copy_(self.rows_host[:k], non_blocking=True)
        self._copied.record()
        return self.rows[:k], self.bits[:k]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then multiples of 16, and max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def gpu_kv_budget(config: EngineConfig, free: int, total: int, own_bytes: int, workspace_bytes: int = 0) -> int:
    """KV bytes an engine may allocate on a GPU with `free` of `total` bytes free, its torch allocator
    holding `own_bytes` (weights and all), beside workspace_bytes of other cache arrays.

    The engine owns the GPU (gpu_fraction null): gpu_memory_utilization x total minus everything in
    use (its own allocations, its CUDA context, anyone else's). It shares the GPU (gpu_fraction f):
    f x gpu_memory_utilization x total minus its own allocations only, since the other engines'
    memory is theirs: two engines at 0.45 then stay within 0.9 x 0.9 of the GPU together, whichever
    starts first, where the whole-GPU rule would hand the first one 0.9 of it. The rest of the share,
    (1 - gpu_memory_utilization) x f x total, is left for activations, CUDA graphs and the context."""
    if config.gpu_fraction is None:
        return int(total * config.gpu_memory_utilization) - (total - free) - workspace_bytes
    return int(total * config.gpu_fraction * config.gpu_memory_utilization) - own_bytes - workspace_bytes


def fit_num_kv_blocks(config: EngineConfig, kv_bytes_per_token: int, device: torch.device,
                      max_model_len: int, workspace_bytes: int = 0) -> int:
    """KV blocks of kv_bytes_per_token-byte tokens that fit this rank's budget: config.num_kv_blocks;
    else kv_cache_memory; on GPU gpu_kv_budget (workspace_bytes: what the cache allocates beside its
    blocks, the prefill scratch of quantized formats); on CPU 1 GiB. A number derived from memory is
    capped at what max_num_seqs requests of max_model_len tokens use."""
    c = config
    if c.num_kv_blocks is not None:
        return c.num_kv_blocks
    if c.kv_cache_memory is not None:
        budget = int(c.kv_cache_memory)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(c, free, total, torch.cuda.memory_reserved(device), workspace_bytes)
    else:
        budget = CPU_DEFAULT_KV_MEMORY
    num_blocks = budget // (kv_bytes_per_token * c.block_size)
    if num_blocks < 1:
        raise ValueError(f"KV cache memory budget {budget} B is too small for one block "
                         f"({kv_bytes_per_token * c.block_size} B); raise kv_cache_memory (or on a GPU "
                         "gpu_memory_utilization, gpu_fraction)")
    return min(num_blocks, c.max_num_seqs * cdiv(max_model_len, c.block_size))


class ModelRunner:
    """Rank tp_rank of tp_size: loads its shard, holds its KV heads' cache, runs steps.

    Only rank 0 computes logits and samples; `execute` returns None on the other ranks. Rows of
    requests without a seed share one generator seeded from config.seed.

    A step costs what its device work costs: its inputs are staged in persistent buffers
    (input_batch.py) and copied without a sync; decode-only steps on CUDA replay a CUDA graph
    captured per batch-size bucket (graph_batch_sizes), padded to the bucket; the only sync is
    the read of the sampled tokens, which carries each request's non-finite flags with it (NaN/Inf
    in its K/V or logits fail that request, not the step).
    """

    def __init__(self, config: EngineConfig, vocab_size: int, tp_rank: int = 0, tp_size: int = 1,
                 device: torch.device | str | None = None, max_model_len: int | None = None) -> None:
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device if device is not None else config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(config))
            logger.info("rank %d computes with %d CPU threads", tp_rank, torch.get_num_threads())
        if self.device.type == "cuda" and config.gpu_fraction is not None:
            # a share of a GPU: past it this engine's allocations fail here, not its neighbours'
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()  # "cuda": current
            torch.cuda.set_per_process_memory_fraction(config.gpu_fraction, index)
        self.vocab_size = vocab_size  # ids the tokenizer knows; logits beyond are never sampled
        # seconds each start-up phase took (the engine logs them once it is ready)
        self.startup_s: dict[str, float] = {}
        t0 = time.perf_counter()
        self.model, mc = load_model(config.model, device=self.device, dtype=self.dtype,
                                    load_format=config.load_format, seed=config.seed,
                                    tp_rank=tp_rank, tp_size=tp_size)
        self.startup_s["model"] = time.perf_counter() - t0
        self.max_model_len = max_model_len or config.max_model_len or mc.max_position_embeddings
        self.num_heads = mc.num_attention_heads // tp_size  # this rank's query heads
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
        self.buffers: InputBuffers | None = None
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed)) if tp_rank == 0 else None
        self.requests: dict[str, _CachedRequest] = {}
        self.generators: dict[str, torch.Generator] = {}  # rank 0: requests with a seed
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, logits)
        self.graphs_disabled_reason: str | None = None
        self._setup_failed: dict[str, str] = {}  # request id -> why its state could not be set up
        # the last launched step's samples on the device, and each sampling request's row in them: a
        # step launched before that one is collected takes its PENDING_TOKEN inputs from there
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # rank 0, a step launched with defer_sample: (its result, logits, request ids, extra) until sample()
        self._deferred: tuple | None = None
        self._mask_staging: _MaskStaging | None = None  # structured outputs' bitmask on its way to the device
        # Per-step phase times (seconds) of the latest step; with sync_timings the device is
        # synchronized between phases so that they are exact (benchmarks only: it costs overlap).
        self.sync_timings = False
        self.last_timing: dict = {}

    def _allocation_failure(self, num_blocks: int, error: BaseException) -> str:
        c = self.config
        size = num_blocks * c.block_size * self.kv_bytes_per_token
        where = "GPU" if self.device.type == "cuda" else "host"
        fix = ("lower engine.gpu_memory_utilization or set a smaller engine.kv_cache_memory (other processes may "
               "hold memory on this GPU)" if self.device.type == "cuda" and c.kv_cache_memory is None
               and c.num_kv_blocks is None else "lower engine.kv_cache_memory or engine.num_kv_blocks")
        return (f"could not allocate the KV cache on {self.device}: {num_blocks} blocks of {c.block_size} tokens x "
                f"{self.kv_bytes_per_token} bytes per token ({c.kv_cache_dtype}) = {size / 2**30:.2f} GiB of {where} "
                f"memory; {fix}, or max_num_seqs / max_model_len (the cache never holds more than max_num_seqs "
                f"full-length requests). {type(error).__name__}: {str(error)[:200]}")

    def num_kv_blocks_fit(self, max_model_len: int) -> int:
        return fit_num_kv_blocks(self.config, self.kv_bytes_per_token, self.device, max_model_len,
                                 scratch_bytes(self.config.kv_cache_dtype, self.kv_spec, self.device, max_model_len))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and the step buffers, then capture the decode graphs (CUDA). Raises
        KVCacheAllocationError, naming the settings that size the cache, if the memory is not there."""
        c = self.config
        t0 = time.perf_counter()
        try:
            self.kv_cache = create_kv_cache(c.kv_cache_dtype, self.kv_spec, num_blocks, self.device, self.fp4_formats)
            self.buffers = InputBuffers(max(c.max_num_batched_tokens, c.max_num_seqs), c.max_num_seqs,
                                        cdiv(self.max_model_len, c.block_size), self.device)
            if self.device.type == "cuda" and self.kv_cache.kernels_enabled():
                self.kv_cache.reserve_scratch(self.max_model_len)  # claimed now, within the budget above
        except (MemoryError, RuntimeError) as e:  # the CPU allocator's failure is a plain RuntimeError
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in str(e):
                raise
            self.kv_cache = self.buffers = None
            raise KVCacheAllocationError(self._allocation_failure(num_blocks, e)) from e
        self.startup_s["kv_cache"] = time.perf_counter() - t0
        if self.device.type == "cuda" and c.warms_up("cuda"):
            t0 = time.perf_counter()  # the kernel builds the graphs and the warm-up requests do not launch
            self.kv_cache.warm_kernels(self.num_heads, self.buffers.max_blocks_per_seq)
            self.startup_s["kernels"] = time.perf_counter() - t0
        if self.device.type == "cpu":
            # Build (first use on this machine, ~35 s) or load the CPU extension now, while the
            # engine starts, not inside the first request's deadline.
            t0 = time.perf_counter()
            self.kv_cache.cpu_kernels_enabled()
            self.startup_s["cpu_kernels"] = time.perf_counter() - t0
        self.graphs_disabled_reason = self._graphs_problem()
        if self.graphs_disabled_reason is None:
            t0 = time.perf_counter()
            self.capture_graphs()
            self.startup_s["cuda_graphs"] = time.perf_counter() - t0
        elif self.device.type == "cuda":
            logger.info("decode steps run eager (no CUDA graphs): %s", self.graphs_disabled_reason)

    def _graphs_problem(self) -> str | None:
        if self.device.type != "cuda":
            return "not on CUDA"
        if self.config.enforce_eager:
            return "enforce_eager is set"
        if self.tp_size > 1:
            import torch.distributed as dist

            if dist.get_backend() != "nccl":  # every rank captures its graphs, all-reduces inside them
                return f"tensor_parallel_size > 1 over {dist.get_backend()} (graphs capture NCCL collectives only)"
        if not self.kv_cache.kernels_enabled():
            return f"the KV cache runs its torch path ({self.kv_cache.kernel_problem()}), which syncs"
        return None

    # -- requests ------------------------------------------------------------------------------
    def _update_requests(self, step: StepMessage) -> None:
        buf = self.buffers
        for rid in step.finished_request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                buf.free_row(state.row)
            self.generators.pop(rid, None)
        for r in step.requests:
            if r.params is not None:
                old = self.requests.get(r.request_id)
                row = old.row if old is not None else buf.take_row()
                self.requests[r.request_id] = _CachedRequest(list(r.block_ids), r.params, row)
                if self.sampler is not None and r.params.seed is not None and r.request_id not in self.generators:
                    try:  # a request's own fault: it fails, the step and the other requests go on
                        self.generators[r.request_id] = torch.Generator(self.device).manual_seed(r.params.seed)
                    except (RuntimeError, ValueError, OverflowError) as e:
                        self._setup_failed[r.request_id] = f"its seed {r.params.seed!r} cannot seed a generator ({e})"
            else:
                self.requests[r.request_id].block_table.extend(r.block_ids)

    # -- inputs --------------------------------------------------------------------------------
    def prepare(self, step: StepMessage) -> StepInputs:
        """Stage the step in the persistent buffers and copy them to the device (no sync)."""
        buf = self.buffers
        bs = self.block_size
        buf.wait_staging_free()
        ids, pos, slots, tok_seq = buf.input_ids.np, buf.positions.np, buf.slot_mapping.np, buf.token_seq.np
        rows_np = buf.row_ids.np
        seq_lens, qsl = [], [0]
        sample_rows, sample_ids = [], []
        pending_dst, pending_src = [], []  # input rows whose token the previous step sampled on the device
        t = 0
        for i, r in enumerate(step.requests):
            state = self.requests[r.request_id]
            table = state.block_table
            if len(table) > state.num_synced:
                buf.write_blocks(state.row, state.num_synced, table[state.num_synced:])
                state.num_synced = len(table)
            n, start = len(r.token_ids), r.start_pos
            if n == 1:
                tok = r.token_ids[0]
                if tok == PENDING_TOKEN:
                    src = self._prev_rows.get(r.request_id)
                    if src is None:
                        raise RuntimeError(f"request {r.request_id} has a pending input token but did not sample "
                                           "in the previous step launched on this runner")
                    pending_dst.append(t)
                    pending_src.append(src)
                    tok = 0
                ids[t] = tok
                pos[t] = start
                slots[t] = table[start // bs] * bs + start % bs
                tok_seq[t] = i
            else:
                if PENDING_TOKEN in r.token_ids:
                    raise RuntimeError(f"request {r.request_id}: a pending input token in a {n}-token row")
                p = np.arange(start, start + n)
                ids[t:t + n] = r.token_ids
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(table)[p // bs] * bs + p % bs
                tok_seq[t:t + n] = i
            t += n
            seq_lens.append(start + n)
            qsl.append(t)
            rows_np[i] = state.row
            if r.do_sample:
                sample_rows.append(t - 1)
                sample_ids.append(r.request_id)
        num_seqs = len(step.requests)
        buf.seq_lens.np[:num_seqs] = seq_lens
        buf.query_start_loc.np[:num_seqs + 1] = qsl
        buf.sample_rows.np[:len(sample_rows)] = sample_rows
        graph_size = None
        if self.graphs and t == num_seqs and not any(r.prompt_targets for r in step.requests):
            # decode-shaped (one token per sequence), and no row scores a prompt token
            graph_size = next((b for b in self.graphs if b >= num_seqs), None)
        padded = graph_size or num_seqs
        if padded > num_seqs:
            buf.stage_padding(t, num_seqs, padded)
        num_tokens = t + padded - num_seqs
        pending = (pending_dst, pending_src, self._previous_samples()) if pending_dst else None
        buf.upload(num_tokens, padded, len(sample_rows), pending)
        meta = self._meta(num_tokens, padded, graph_size is not None)
        return StepInputs(t, num_seqs, graph_size, buf.input_ids.dev[:num_tokens], buf.positions.dev[:num_tokens],
                          meta, buf.sample_rows.dev[:len(sample_rows)], sample_ids)

    def _previous_samples(self) -> torch.Tensor:
        """The previous step's samples on this rank's device. Rank 0 sampled them; under tensor
        parallelism it broadcasts them (every rank gets the same step, so every rank calls this)."""
        if self.tp_size == 1:
            return self._prev_tokens
        import torch.distributed as dist

        samples = self._prev_tokens if self.tp_rank == 0 else \
            torch.empty(len(self._prev_rows), dtype=torch.int64, device=self.device)
        dist.broadcast(samples, src=0)
        return samples

    def _meta(self, num_tokens: int, num_seqs: int, graph: bool) -> AttentionMetadata:
        """The step's metadata over the staged buffers (padding included, as stage_padding wrote it)."""
        buf = self.buffers
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping.dev[:num_tokens],
            block_tables=buf.block_tables[:num_seqs],
            seq_lens=buf.seq_lens.np[:num_seqs].tolist(),
            query_start_loc=buf.query_start_loc.np[:num_seqs + 1].tolist(),
            seq_lens_t=buf.seq_lens.dev[:num_seqs],
            query_start_loc_t=buf.query_start_loc.dev[:num_seqs + 1],
            plan_max_seq_len=self.max_model_len if graph else None,
            nonfinite=buf.nonfinite[:num_tokens],
        )

    @property
    def block_size(self) -> int:
        return self.kv_spec.block_size

    # -- CUDA graphs ---------------------------------------------------------------------------
    def _decode_logits(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The whole decode forward, as a graph captures it: flags cleared, logits of every row."""
        meta.nonfinite.zero_()
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden)  # [num_seqs, vocab] float32

    def graph_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) a decode graph of `size` sequences is captured over:
        slices of the persistent buffers, staged as padding (one unstored token per sequence)."""
        buf = self.buffers
        buf.stage_padding(0, 0, size)
        buf.upload(size, size, 0)
        return buf.input_ids.dev[:size], buf.positions.dev[:size], self._meta(size, size, graph=True)

    def capture_graphs(self) -> None:
        """Capture one decode graph per batch size in graph_batch_sizes (largest first, one memory
        pool), each after an eager warm-up run that compiles its kernels outside the capture."""
        start = time.perf_counter()
        pool = None
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        with torch.inference_mode():
            for size in reversed(sizes):
                ids, pos, meta = self.graph_inputs(size)
                self._decode_logits(ids, pos, meta)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_logits(ids, pos, meta)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.graphs = dict(sorted(self.graphs.items()))
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(sizes), sizes,
                    time.perf_counter() - start)

    def _prompt_logprobs(self, step: StepMessage, hidden: torch.Tensor) -> dict:
        """request id -> (start position, log-prob of each target prompt token, its rank (1 + the
        tokens at least as likely besides it, as vLLM counts), its N best (id, log-prob) or None
        when N is 0) for the requests scoring prompt tokens this step."""
        out, offset = {}, 0
        for r in step.requests:
            targets = r.prompt_targets
            if targets:
                rows = hidden[offset: offset + len(targets)]
                logp = torch.log_softmax(self.model.compute_logits(rows)[:, : self.vocab_size].float(), dim=-1)
                tgt = torch.tensor(targets, device=logp.device)
                chosen_t = logp.gather(1, tgt[:, None])  # [len(targets), 1]
                ranks = (logp >= chosen_t).sum(dim=-1).tolist()
                chosen = chosen_t[:, 0].tolist()
                k = self.requests[r.request_id].params.prompt_logprobs
                top = None
                if k:
                    vals, ids = logp.topk(k, dim=-1)
                    top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
                out[r.request_id] = (r.start_pos, chosen, ranks, top)
            offset += len(r.token_ids)
        return out

    # -- one step ------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.sync_timings and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, step: StepMessage) -> SamplerOutput | None:
        """Run one step on this rank; rank 0 returns what the sampling requests sampled, in order,
        and the requests whose K/V or logits were not finite (SamplerOutput.failed)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepMessage) -> StepResult:
        """execute() without waiting for the device: the step's kernels are queued and its samples
        are on their way to the host (on CUDA; on the CPU the step has run). A later step may take
        its input tokens from these samples (PENDING_TOKEN) before result() is called."""
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        self._deferred = None  # a deferred step never sampled was abandoned: its requests come back whole
        self._update_requests(step)
        if not step.requests:
            return StepResult()
        t0 = time.perf_counter()
        try:
            inputs = self.prepare(step)
        except BaseException:
            self.buffers.discard_pending()  # the driver resends every request whole after a failed step
            raise
        self._sync()
        t1 = time.perf_counter()
        if inputs.graph_size is not None:
            graph, logits_all = self.graphs[inputs.graph_size]
            graph.replay()
            logits = logits_all.index_select(0, inputs.sample_rows)
        else:
            meta = inputs.meta
            meta.nonfinite.zero_()
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, meta)
            logits = None
            if self.sampler is not None and inputs.sample_request_ids:
                logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        self._sync()
        t2 = time.perf_counter()
        self.last_timing = {"prepare_s": t1 - t0, "forward_s": t2 - t1, "sample_s": 0.0,
                            "graph": inputs.graph_size is not None}
        rids = inputs.sample_request_ids
        self._prev_rows = {rid: i for i, rid in enumerate(rids)}  # every rank: the next step may read them
        if self.sampler is None:
            return StepResult()
        # per sequence: did any of its tokens store a NaN/Inf vector
        seq_bad = torch.zeros(inputs.num_seqs, dtype=torch.int64, device=self.device)
        seq_bad.index_add_(0, self.buffers.token_seq.dev[:inputs.num_tokens],
                           inputs.meta.nonfinite[:inputs.num_tokens].long())
        pending = None
        if rids:
            logits = logits[:, : self.vocab_size]  # [num_sampled, vocab] float32
            logits_bad = (~torch.isfinite(logits).all(dim=-1)).long()  # before any grammar mask's -inf
            extra = torch.cat((seq_bad, logits_bad))
            if not step.defer_sample:
                pending = self._sample(logits, rids, extra, step.grammar)
        else:
            pending = PendingSample.of_extra(seq_bad)
        prompt_logprobs = {}
        if inputs.graph_size is None and any(r.prompt_targets for r in step.requests):
            prompt_logprobs = self._prompt_logprobs(step, hidden)
        failed = dict(self._setup_failed)
        self._setup_failed.clear()
        num_seqs = inputs.num_seqs

        def finish(out: SamplerOutput) -> SamplerOutput:
            out.prompt_logprobs = prompt_logprobs
            flags = out.extra
            out.failed = failed
            out.failed |= {r.request_id: "non-finite (NaN/Inf) values in its keys/values" for r, bad
                           in zip(step.requests, flags[:num_seqs]) if bad}
            for rid, bad in zip(rids, flags[num_seqs:]):
                if bad and rid not in out.failed:
                    out.failed[rid] = "non-finite (NaN/Inf) logits"
            return out

        self._sync()
        self.last_timing["sample_s"] = time.perf_counter() - t2
        if pending is None:  # deferred: sample() launches it
            result = StepResult(None, finish, deferred=True)
            self._deferred = (result, logits, rids, extra)
            return result
        return StepResult(pending, finish)

    def _sample(self, logits: torch.Tensor, rids: list[str], extra: torch.Tensor,
                grammar: GrammarMask | None) -> PendingSample:
        mask = self._upload_mask(grammar) if grammar is not None and grammar.rows else None
        pending = self.sampler(logits, [self.requests[rid].params for rid in rids],
                               [self.generators.get(rid) for rid in rids], extra=extra, defer=True, mask=mask)
        self._prev_tokens = pending.token_ids
        return pending

    @torch.inference_mode()
    def sample(self, grammar: GrammarMask | None) -> None:
        """Rank 0: launch the sampling of the step launched with defer_sample, its constrained rows
        masked by `grammar` (no sync: its result() waits for the samples as any step's does). The
        next step may take its pending input tokens from these samples."""
        assert self._deferred is not None, "sample() follows a launch with defer_sample"
        result, logits, rids, extra = self._deferred
        self._deferred = None
        t0 = time.perf_counter()
        result._sample = self._sample(logits, rids, extra, grammar)
        self.last_timing["sample_s"] = self.last_timing.get("sample_s", 0.0) + time.perf_counter() - t0

    def _upload_mask(self, grammar: GrammarMask) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [k] int64, bitmask [k, words] int32) on the device: on CUDA through pinned staging
        and non-blocking copies (no sync; the staging is refilled only once its copy ran)."""
        k = len(grammar.rows)
        if self.device.type == "cpu":
            return torch.tensor(grammar.rows, dtype=torch.int64), grammar.bitmask
        staging = self._mask_staging
        if staging is None or staging.bits_host.shape[0] < k or staging.bits_host.shape[1] != grammar.bitmask.shape[1]:
            staging = self._mask_staging = _MaskStaging(max(k, self.config.max_num_seqs), grammar.bitmask.shape[1],
                                                        self.device)
        return staging.upload(grammar.rows, grammar.bitmask)
