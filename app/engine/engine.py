"""LLMEngine: requests in, one scheduled model step at a time, outputs out. No Ray, no asyncio."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from app.config import EngineConfig
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.errors import InvalidRequestError
from app.engine.executor import Executor, LaunchedStep, LocalExecutor
from app.engine.grammar import StructuredOutputManager, check_tokenizer
from app.engine.kv_cache import KVCacheSpec, kv_bytes_per_token, kv_fp4_formats
from app.engine.kv_cache_manager import KVCacheManager, cdiv
from app.engine.model_runner import GrammarMask, resolve_dtype
from app.engine.model_source import load_model_config, resolve_tokenizer
from app.engine.outputs import RequestMetrics, RequestOutput, prompt_logprobs_dicts
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler, SchedulerOutput, check_prompt_ids
from app.engine.sequence import Sequence, SequenceStatus
from app.engine.setting_checks import check_settings
from app.engine.structured_outputs import check_structured_outputs
from app.kernels import compile_log
from app.kv_events.schema import KVEvent

logger = logging.getLogger(__name__)

MAX_PENDING_KV_EVENTS = 100_000
# With nothing to run but requests whose grammar is compiling, a step waits this long for a compile
# (instead of returning at once and being called again in a busy loop).
GRAMMAR_WAIT_S = 0.05


@dataclass(slots=True, eq=False)
class _StepInFlight:
    """The engine's record of a launched step until it is collected: what the scheduler and the
    executor each returned at launch, and when."""

    sched: SchedulerOutput
    step: LaunchedStep  # the executor's
    preemptions: list[int]  # Scheduler.on_launched's
    t_schedule: float  # when its scheduling started (perf_counter)
    t_launch: float  # when its launch started
    deferred: bool = False  # launched with defer_sample: _sample_deferred launches its sampling
    context_tokens: int = 0  # tokens whose K/V the step's attention reads (with step_timings only)


@dataclass(slots=True, eq=False)
class _RequestState:
    """The engine's record of one sequence: its detokenizer, metrics, logprobs and what was sent."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    num_sent_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = field(default=None)
    prompt_logprobs: list[float | None] | None = None  # filled by position as prompt chunks compute
    prompt_ranks: list[int | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprobs_sent: bool = False
    error: str | None = None
    request_id: str = ""  # the caller's id (the sequence's own id differs for choices of n > 1)
    index: int = 0


def warmup_prompts(block_size: int, vocab_size: int) -> tuple[list[int], list[int]]:
    """The start-up warm-up's two prompts (LLMEngine._warm_up). Triton specializes a kernel on each
    integer argument being 1 or a multiple of 16, so the steps cover both: the first prompt has a
    multiple of 16 tokens (at least two full blocks), the second shares its first two blocks and
    adds block_size + 2 tokens, which with the first's decode row make an odd step (for a block size
    of 16)."""
    first = [(7 * i + 3) % vocab_size for i in range(16 * cdiv(2 * block_size + 1, 16))]
    second = first[: 2 * block_size] + [(5 * i + 11) % vocab_size for i in range(block_size + 2)]
    return first, second


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        t_start = time.perf_counter()
        if config.backend != "native":
            raise ValueError(f"LLMEngine is the native backend; engine.backend {config.backend!r} runs in an "
                             "LLMServer replica (app/engine/vllm_engine.py)")
        check_settings(config)  # what build_app checks too: the offline API refuses the same settings
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Everything that can be refused is checked before the weights load.
        self.model_config = mc = load_model_config(config.model)
        mc.check_tensor_parallel(config.tensor_parallel_size)
        self.tokenizer = resolve_tokenizer(config, mc.vocab_size)
        fp4_formats = config.fp4.formats()
        for fmt in kv_fp4_formats(config.kv_cache_dtype, fp4_formats):  # fp4: K and V; fp8-fp4: V
            fmt.check(mc.head_dim)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # The whole model's KV (all ranks together); each rank holds num_kv_heads / tp of it.
        self.kv_spec = KVCacheSpec(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            compute_dtype=self.dtype,
        )
        self.kv_bytes_per_token = kv_bytes_per_token(config.kv_cache_dtype, self.kv_spec, fp4_formats)
        # Sample only ids the tokenizer knows (a model's vocab may be padded beyond it).
        self.vocab_size = self.tokenizer.vocab_size
        # Triton compiles from here on are counted (CUDA: the graph capture compiles the decode builds;
        # one after start-up stalls a step and is logged as a warning).
        self.compile_log = compile_log.install() if self.device.type == "cuda" else None
        if self.compile_log is not None:  # one recorder per process: this engine reports what it adds
            self.compile_log.mark_starting()
            self._compiles_before = self.compile_log.stats()
        # Loads the model (its shards on tensor-parallel workers) and allocates the KV cache.
        t_executor = time.perf_counter()
        self.executor = create_executor(config, self.vocab_size, self.max_model_len)
        executor_s = time.perf_counter() - t_executor
        self.num_kv_blocks = self.executor.num_kv_blocks
        # The model and cache objects when they live in this process (tensor_parallel_size 1).
        runner = getattr(self.executor, "runner", None)
        self.model = runner.model if runner is not None else None
        self.kv_cache = runner.kv_cache if runner is not None else None
        self.kv_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        eos = set(self.tokenizer.eos_token_ids)
        eos.update(e for e in _as_list(mc.eos_token_id) if e is not None)
        self.scheduler = Scheduler(
            self.kv_manager, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len, eos
        )
        # structured outputs: grammars compiled off the loop, a matcher per constrained sequence
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(eos))
        self._awaiting_grammar: dict[str, Sequence] = {}  # sequences whose grammar is compiling
        self.async_scheduling = self.executor.pipelined = resolve_async_scheduling(config, self.executor)
        self._in_flight: _StepInFlight | None = None  # async scheduling: the step launched, not yet collected
        self._undelivered: list[RequestOutput] = []  # collected when a launch failed: the next step() returns them
        self._requests: dict[str, _RequestState] = {}  # by sequence id
        self._choices: dict[str, list[str]] = {}  # request id of an n > 1 request -> its sequence ids
        # step(), add_request() and abort_request() may be called from different threads (an
        # async server steps in a worker thread); an abort waits for the step in flight.
        self._lock = threading.RLock()
        # Events wait here until take_kv_events() drains them (the async engine does every step); a
        # user of the offline API that never drains loses the oldest beyond MAX_PENDING_KV_EVENTS.
        self._kv_events: deque[KVEvent] = deque()
        self.num_kv_events_dropped = 0
        self.kv_manager.pool.subscribe(self._record_kv_event)
        self.peak_num_running = 0
        self.num_first_tokens_total = 0
        self.time_to_first_token_s_total = 0.0
        # Per-step records for benchmarks: set to a list and every step that runs the model appends
        # {schedule_s, prepare_s, forward_s, sample_s, output_s, total_s, num_seqs, num_tokens,
        # context_tokens (K/V tokens its attention reads, its own included), decode_only, graph, start,
        # end}; with sync_step_timings the device is synchronized between
        # phases so that the split is exact (slower), else only total_s, start and end are. With async
        # scheduling a step's [start, end] overlaps the next step's: the time a step adds is the gap
        # between its end and the previous step's.
        self.step_timings: list[dict] | None = None
        self.sync_step_timings = False
        # Seconds of each start-up phase: the executor's (model load, KV cache, CUDA graphs where it
        # runs in this process, else its whole start as "workers"), the checks and tokenizer before.
        phases = dict(runner.startup_s) if runner is not None else {"workers": executor_s}
        if config.warms_up(self.device.type):
            t_warmup = time.perf_counter()
            try:
                self._warm_up()
            except BaseException:  # the engine never starts: its workers must not outlive it
                self.shutdown()
                raise
            phases["warmup"] = time.perf_counter() - t_warmup
        self.startup_s = {"config_and_tokenizer": t_executor - t_start, **phases,
                          "total": time.perf_counter() - t_start}
        logger.info(
            "engine ready in %.1f s (%s): model=%s tensor_parallel_size=%d kv_cache_dtype=%s blocks=%d x %d tokens "
            "(%.1f MiB, %d B/token over all ranks)",
            self.startup_s["total"], ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items() if k != "total"),
            config.model, config.tensor_parallel_size, config.kv_cache_dtype, self.num_kv_blocks, config.block_size,
            self.num_kv_blocks * config.block_size * self.kv_bytes_per_token / 2**20, self.kv_bytes_per_token,
        )
        if self.compile_log is not None:
            self.compile_log.mark_serving()

    def _warm_up(self) -> None:
        """The paths a first user would compile (EngineConfig.warmup): a prefill of a multiple of 16
        tokens, then a request whose prompt starts with the first's two full blocks (a prefix-cache hit, read
        back through the quantized formats' dequantize path) arriving while the first decodes (a
        mixed step: prefill and decode rows in one forward, the decode rows through the eager decode
        kernel), then decode steps. Afterwards nothing of it remains: blocks freed, prefix cache
        emptied, KV events dropped, counters back to where they were."""
        bs = self.kv_manager.block_size
        first, second = warmup_prompts(bs, self.vocab_size)
        if (max(len(first), len(second)) + 4 > self.max_model_len
                or cdiv(len(first) + 4, bs) + cdiv(len(second) + 4, bs) > self.num_kv_blocks):
            logger.info("no start-up warm-up: max_model_len %d or %d KV blocks are too small for it",
                        self.max_model_len, self.num_kv_blocks)
            return
        counters = (self.scheduler.num_prompt_tokens_total, self.scheduler.num_prefix_hit_tokens_total,
                    self.scheduler.num_preemptions_total)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        self.add_request("warmup-0", first, params)
        self.step()
        self.add_request("warmup-1", second, params)
        while self.has_unfinished_requests():
            self.step()
        if self.kv_manager.reset_prefix_cache():
            with self._lock:
                self._kv_events.clear()
        else:  # cannot happen with every request finished; then its blocks' events stay true
            logger.warning("start-up warm-up: its blocks stay in the prefix cache (some still in use)")
        (self.scheduler.num_prompt_tokens_total, self.scheduler.num_prefix_hit_tokens_total,
         self.scheduler.num_preemptions_total) = counters
        self.num_first_tokens_total, self.time_to_first_token_s_total, self.peak_num_running = 0, 0.0, 0
        self.num_kv_events_dropped = 0

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        """Prompt text or ids -> validated token ids (raises InvalidRequestError)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"prompt must be a string or a list of token ids (got {type(prompt).__name__})")
        ids = list(prompt)
        check_prompt_ids(ids, self.vocab_size)
        return ids

    def validate(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> list[int]:
        """Check a request without queueing it; returns its prompt token ids.

        Raises InvalidRequestError naming what is wrong; changes nothing.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        prompt_ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
            check_tokenizer(self.tokenizer)
        return prompt_ids

    def add_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Raises InvalidRequestError (and changes nothing) if it is invalid."""
        params = SamplingParams() if params is None else params
        self._add_validated(request_id, prompt, self.validate(prompt, params), params)

    def _add_validated(
        self, request_id: str, prompt: str | Seq[int], prompt_ids: list[int], params: SamplingParams,
        block_hashes: Seq[int] | None = None,
    ) -> None:
        """add_request for a prompt that validate() accepted. With params.n > 1, one sequence per
        choice ("<request_id>#<i>"), their outputs under request_id with their index.

        block_hashes: the prompt's full blocks' hashes as the caller computed them (the ingress does,
        to route), so that the engine thread does not hash the prompt again; used only when there is
        one per full block. A wrong value cannot return wrong KV: the prefix cache matches blocks in
        order from the first and compares each block's tokens, so a run of hits is a run of equal
        tokens; a wrong hash costs misses and mislabelled KV events (routing), nothing else."""
        if block_hashes is not None and len(block_hashes) != len(prompt_ids) // self.kv_manager.block_size:
            block_hashes = None
        if params.n == 1:
            self._add_sequence(request_id, 0, request_id, prompt, prompt_ids, params, block_hashes)
            return
        with self._lock:
            if request_id in self._requests or request_id in self._choices:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            ids = []
            try:  # the scheduler holds choices 1.. until choice 0 has computed the prompt's full blocks
                for i in range(params.n):
                    ids.append(f"{request_id}#{i}")
                    self._add_sequence(ids[-1], i, request_id, prompt, prompt_ids, params.choice(i), block_hashes)
            except BaseException:
                self.scheduler.finish_requests(ids, SequenceStatus.FINISHED_ABORTED)
                for sid in ids:
                    self._requests.pop(sid, None)
                raise
            self._choices[request_id] = ids

    def _add_sequence(self, seq_id: str, index: int, request_id: str, prompt: str | Seq[int],
                      prompt_ids: list[int], params: SamplingParams, block_hashes: Seq[int] | None = None) -> None:
        seq = Sequence(seq_id, prompt_ids, params)
        if block_hashes:
            seq.block_hashes = list(block_hashes)
        detok = IncrementalDetokenizer(
            self.tokenizer,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            prompt_token_ids=prompt_ids,
        )
        state = _RequestState(seq, prompt if isinstance(prompt, str) else None, detok,
                              RequestMetrics(time.perf_counter()), request_id=request_id, index=index)
        if params.logprobs is not None:
            state.logprobs, state.top_logprobs = [], []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_ids)
            state.prompt_ranks = [None] * len(prompt_ids)
            state.prompt_top_logprobs = [None] * len(prompt_ids)
        with self._lock:
            if seq_id in self._choices:
                raise InvalidRequestError(f"request id {seq_id!r} is already in use")
            self.scheduler.add_request(seq)  # raises (changing nothing) on a duplicate id
            self._requests[seq_id] = state
            if params.structured_outputs is not None and not self.structured.add(seq_id, params.structured_outputs):
                seq.awaiting_grammar = True  # compiling: the scheduler leaves it waiting until _poll_grammars
                self._awaiting_grammar[seq_id] = seq

    def abort_request(self, request_ids: str | Seq[str]) -> list[RequestOutput]:
        """Stop requests and free their blocks (after the step in flight, if any); unknown or
        finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        with self._lock:
            seq_ids = [sid for rid in request_ids for sid in self._choices.get(rid, (rid,))]
            finished = self.scheduler.finish_requests(seq_ids, SequenceStatus.FINISHED_ABORTED)
            # outputs of theirs that a failed launch left for the next step() come first
            ids = set(request_ids)
            earlier = [o for o in self._undelivered if o.request_id in ids]
            self._undelivered = [o for o in self._undelivered if o.request_id not in ids]
            return earlier + [self._finish(s.request_id) for s in finished]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step in flight whose outputs step() has still to return."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._undelivered)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs of requests with new tokens or finished.

        A request whose K/V or logits were not finite this step finishes with finish_reason
        "error" (RequestOutput.error says why); its new blocks never enter the prefix cache, and
        every other request goes on.

        With async scheduling (EngineConfig.async_scheduling) a call launches step N + 1 before it
        waits for step N, whose outputs it returns: the host schedules, stages and detokenizes while
        the device computes. Step N + 1 is scheduled as if every request of step N went on, with
        its sampled token as a pending input the device fills in; a request that step N finishes
        (EOS, a stop string) has computed one token more than it needed, which is dropped.
        """
        with self._lock:
            try:
                launched = self._launch()
            except BaseException:
                self._keep_in_flight_outputs()
                raise
            try:
                if not self.async_scheduling:
                    previous = launched
                else:
                    previous, self._in_flight = self._in_flight, launched
                collected = self._collect(previous) if previous is not None else []
                if launched is not None and launched.deferred:
                    self._sample_deferred(launched)
            except BaseException:
                self._drop_in_flight()
                raise
            outputs, self._undelivered = self._undelivered + collected, []
            return outputs

    def _keep_in_flight_outputs(self) -> None:
        """A launch failed: the step in flight ran, so collect it (its outputs come with the next
        call) rather than make its requests recompute it (a seeded request's generator has moved on)."""
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            return
        try:
            self._undelivered += self._collect(previous)
        except BaseException:  # noqa: BLE001 - the launch's error is the one raised
            logger.exception("collecting the step in flight after a failed launch failed too")
            self._drop_in_flight()

    def _launch(self) -> _StepInFlight | None:
        """Schedule a step and launch it (None: nothing to run).

        Structured outputs: the step's constrained rows are masked by their grammars. With a step in
        flight (async scheduling) a mask needs that step's tokens, so this step is launched with
        defer_sample (the forward only) and step() launches its sampling once the step in flight is
        collected (_sample_deferred); otherwise the mask goes with the launch."""
        t0 = time.perf_counter()
        if self._awaiting_grammar:
            self._poll_grammars()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._awaiting_grammar and self._in_flight is None:
                self.structured.wait(GRAMMAR_WAIT_S)  # only compiles to wait for: not a busy loop
            return None
        self.peak_num_running = max(self.peak_num_running, self.scheduler.num_running)
        runner = getattr(self.executor, "runner", None)  # None with tensor parallelism (no synced split)
        if self.step_timings is not None and runner is not None:
            runner.sync_timings = self.sync_step_timings
        grammar, defer = None, False
        if self.structured:
            sampling = [seq for seq, n in sched.scheduled if seq.step_samples(n)]  # the executor's rows
            if any(seq.request_id in self.structured for seq in sampling):
                defer = self.async_scheduling and self._in_flight is not None
                grammar = None if defer else self._grammar_mask(sampling)
        # each sequence's context as its attention reads it: the tokens scheduled before this step and its own
        ctx = sum(seq.num_scheduled_tokens + n for seq, n in sched.scheduled) if self.step_timings is not None else 0
        t1 = time.perf_counter()
        step = self.executor.launch(sched, grammar, defer)
        return _StepInFlight(sched, step, self.scheduler.on_launched(sched, step.sampling), t0, t1, defer, ctx)

    # -- structured outputs ----------------------------------------------------------------------
    def _poll_grammars(self) -> None:
        """Sequences whose grammar compiled become schedulable; those whose compile failed finish
        with finish_reason "error" (their outputs come with this step's)."""
        ready, failed = self.structured.poll(list(self._awaiting_grammar))
        for sid in (*ready, *failed):
            self._awaiting_grammar.pop(sid).awaiting_grammar = False
        if failed:
            self._undelivered += self._fail_requests(failed)

    def _grammar_mask(self, sampling: list[Sequence]) -> GrammarMask | None:
        """The bitmask of the constrained rows among a step's sampling sequences (row order), from
        their matchers as they are now; rows of requests finished or gone since (whose tokens are
        dropped) go unmasked."""
        rows = []
        for i, seq in enumerate(sampling):
            state = self._requests.get(seq.request_id)
            if state is not None and state.seq is seq and not seq.is_finished and seq.request_id in self.structured:
                rows.append((i, seq.request_id))
        filled = self.structured.fill_mask(rows) if rows else None
        return GrammarMask(*filled) if filled is not None else None

    def _sample_deferred(self, launched: _StepInFlight) -> None:
        """Launch the sampling of a step launched with defer_sample, now that the step before it is
        collected and its tokens have advanced the matchers."""
        self.executor.sample(launched.step, self._grammar_mask(launched.step.sampling))

    def _accept_tokens(self, sampled: dict[str, int], finished: set[str]) -> None:
        """Advance the matchers with the tokens this step appended. A grammar that ended (on a stop
        token) finishes its request ("stop", also under ignore_eos); a token the grammar rejects
        fails it (it cannot happen with the mask applied; a guard)."""
        for rid, token in sampled.items():
            if rid not in self.structured or rid in finished:  # finished by EOS, a stop token or length
                continue
            verdict = self.structured.accept(rid, token)
            if verdict is None:
                continue
            seq = self._requests[rid].seq
            if verdict == "terminated":
                self.scheduler.finish_requests([rid], SequenceStatus.FINISHED_STOPPED)
                seq.stop_reason = token
            else:
                self._requests[rid].error = f"structured outputs: the grammar rejected token {token}"
                logger.warning("request %s failed: %s", rid, self._requests[rid].error)
                self.scheduler.finish_requests([rid], SequenceStatus.FINISHED_ERROR)
            finished.add(rid)

    def _drop_in_flight(self) -> None:
        """After a failed step: forget the step in flight, if any (its requests recompute what it
        computed; every rank gets them whole next time)."""
        if self._in_flight is not None:
            self.executor.abandon(self._in_flight.step)
            self._in_flight = None
        for seq in self.scheduler.requests.values():
            seq.num_inflight_tokens = seq.num_pending_tokens = 0

    def _collect(self, launched: _StepInFlight) -> list[RequestOutput]:
        """Wait for a launched step and turn its samples into outputs."""
        sched = launched.sched
        sampled_seqs, out = self.executor.collect(launched.step)
        t2 = time.perf_counter()
        # by sequence, not by id: an id aborted while this step ran may name a new request by now
        in_step = {seq.request_id: seq for seq, _ in sched.scheduled}
        ours = {rid for rid, seq in in_step.items() if rid in self._requests and self._requests[rid].seq is seq}
        failed = self._fail_requests({rid: why for rid, why in out.failed.items() if rid in ours})
        for rid, (start, lps, ranks, tops) in out.prompt_logprobs.items():
            state = self._requests.get(rid)
            if rid not in ours or rid in out.failed:
                continue
            # by position: a preempted request that recomputes its prompt writes the same slots
            state.prompt_logprobs[start + 1: start + 1 + len(lps)] = lps
            state.prompt_ranks[start + 1: start + 1 + len(ranks)] = ranks
            if tops is not None:
                state.prompt_top_logprobs[start + 1: start + 1 + len(tops)] = tops
        sampled = {}
        for i, seq in enumerate(sampled_seqs):
            if seq.request_id in out.failed or seq.sampling_params.max_tokens == 0 or seq.is_finished:
                continue  # max_tokens 0: the prompt only (the scheduler finishes it); or finished meanwhile
            sampled[seq.request_id] = out.token_ids[i]
            state = self._requests[seq.request_id]
            if state.logprobs is not None:
                state.logprobs.append(out.logprobs[i])
                state.top_logprobs.append(out.top_logprobs[i])
        finished = {s.request_id for s in self.scheduler.update_from_output(sched, sampled, launched.preemptions,
                                                                            launched.step.sampling)}
        if self.structured:
            self._accept_tokens(sampled, finished)
        outputs = failed
        for rid in sampled:
            state = self._requests[rid]
            if not state.metrics.token_times:  # its first token: the engine's own time to first token
                self.num_first_tokens_total += 1
                self.time_to_first_token_s_total += t2 - state.metrics.arrival_time
            state.metrics.token_times.append(t2)
            stop = state.detokenizer.append([sampled[rid]])
            if stop is not None:
                # A stop string wins over a length limit reached by the same token.
                if rid not in finished:
                    self.scheduler.finish_requests([rid], SequenceStatus.FINISHED_STOPPED)
                    finished.add(rid)
                state.seq.status = SequenceStatus.FINISHED_STOPPED
                state.seq.stop_reason = stop
            outputs.append(self._finish(rid) if rid in finished else self._make_output(state))
        outputs += [self._finish(rid) for rid in finished if rid not in sampled]  # max_tokens 0
        if self.step_timings is not None:
            t3 = time.perf_counter()
            rt = launched.step.timing
            t0, t1 = launched.t_schedule, launched.t_launch
            self.step_timings.append({
                "start": t0, "schedule_s": t1 - t0, "prepare_s": rt.get("prepare_s", 0.0),
                "forward_s": rt.get("forward_s", 0.0), "sample_s": rt.get("sample_s", 0.0),
                "output_s": t3 - t2, "total_s": t3 - t0, "end": t3, "num_seqs": len(sched.scheduled),
                "num_tokens": sum(n for _, n in sched.scheduled), "context_tokens": launched.context_tokens,
                "decode_only": all(n == 1 for _, n in sched.scheduled), "graph": rt.get("graph", False)})
        return outputs

    def _fail_requests(self, failed: dict[str, str]) -> list[RequestOutput]:
        """Finish the requests the step failed (status error) before their blocks are cached (the
        scheduler then skips them: finished); `failed` holds this step's live requests only."""
        if not failed:
            return []
        for rid, why in failed.items():
            self._requests[rid].error = why
            logger.warning("request %s failed: %s", rid, why)
        self.scheduler.finish_requests(list(failed), SequenceStatus.FINISHED_ERROR)
        return [self._finish(rid) for rid in failed]

    def _finish(self, seq_id: str) -> RequestOutput:
        self.executor.release(seq_id)
        self.structured.remove(seq_id)
        awaiting = self._awaiting_grammar.pop(seq_id, None)
        if awaiting is not None:
            awaiting.awaiting_grammar = False
        state = self._requests.pop(seq_id)
        choices = self._choices.get(state.request_id)
        if choices is not None and not any(sid in self._requests for sid in choices):
            del self._choices[state.request_id]
        return self._make_output(state)

    def _token_text(self, token_id: int) -> str:
        """A token decoded alone (Logprob.decoded_token), as vLLM does."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, state: _RequestState) -> RequestOutput:
        seq = state.seq
        finished = seq.is_finished
        start, state.num_sent_tokens = state.num_sent_tokens, seq.num_output_tokens
        out = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            index=state.index,
            text=state.detokenizer.output_text,
            delta_text=state.detokenizer.get_delta(finished),
            delta_token_ids=seq.output_token_ids[start:],
            finished=finished,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            error=state.error,
        )
        if state.logprobs is not None:
            out.delta_logprobs = state.logprobs[start:]
            out.delta_top_logprobs = state.top_logprobs[start:]
        if state.prompt_logprobs is not None and (finished or not state.prompt_logprobs_sent) \
                and seq.num_computed_tokens >= seq.num_prompt_tokens and state.error is None:
            state.prompt_logprobs_sent = True
            top = state.prompt_top_logprobs if seq.sampling_params.prompt_logprobs else None
            out.prompt_logprobs = prompt_logprobs_dicts(seq.prompt_token_ids, state.prompt_logprobs,
                                                        state.prompt_ranks, top, self._token_text)
        if finished:
            state.metrics.finished_time = time.perf_counter()
            out.metrics = state.metrics
            out.token_ids = seq.output_token_ids
            out.logprobs, out.top_logprobs = state.logprobs, state.top_logprobs
        return out

    # -- KV events and stats -------------------------------------------------------------------
    def _record_kv_event(self, event: KVEvent) -> None:
        if len(self._kv_events) >= MAX_PENDING_KV_EVENTS:
            self._kv_events.popleft()
            if not self.num_kv_events_dropped:
                logger.warning("KV events are not being read (take_kv_events); dropping the oldest beyond %d",
                               MAX_PENDING_KV_EVENTS)
            self.num_kv_events_dropped += 1
        self._kv_events.append(event)

    def take_kv_events(self) -> list[KVEvent]:
        """KV events since the last call, oldest first (at most MAX_PENDING_KV_EVENTS)."""
        events = list(self._kv_events)
        self._kv_events.clear()
        return events

    def kv_cache_snapshot_events(self) -> list[KVEvent]:
        """The prefix cache now, as KV events (AllBlocksCleared, then BlockStored per block), for a
        consumer that lost track (the router's index after a restart). Safe from another thread."""
        with self._lock:
            return self.kv_manager.pool.snapshot_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def worker_info(self) -> list[dict]:
        """Where each tensor-parallel rank runs (rank, pid, node, GPU ids, device)."""
        return self.executor.worker_info()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); the engine is unusable after."""
        self.structured.shutdown()
        self.executor.shutdown()

    def stats(self) -> dict:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_kv_blocks": self.kv_manager.num_free_blocks,
            "kv_cache_usage": self.kv_manager.usage,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "peak_num_running": self.peak_num_running,
            # sums over requests since start (arrival in the engine to first token), for means
            "num_first_tokens_total": self.num_first_tokens_total,
            "time_to_first_token_s_total": self.time_to_first_token_s_total,
            # Triton compiles in this process (CUDA), all and those after start-up (each stalled a step)
            **({k: v - self._compiles_before[k] for k, v in self.compile_log.stats().items()}
               if self.compile_log is not None else {}),
        }


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def resolve_async_scheduling(config: EngineConfig, executor: Executor) -> bool:
    """EngineConfig.async_scheduling, its default (None) resolved: on where the device runs steps in
    the background (CUDA) with tensor_parallel_size 1; off on the CPU, where a step runs in the
    caller's thread and overlapping would only delay each output by a step, and off by default with
    tensor parallelism (the mp executor supports it; not measured on GPUs yet)."""
    if config.async_scheduling is None:
        return executor.supports_async and torch.device(config.device).type == "cuda" \
            and config.tensor_parallel_size == 1
    if config.async_scheduling and not executor.supports_async:
        raise ValueError(f"async_scheduling needs an executor that launches steps in the background: the "
                         f"'{config.distributed_executor_backend}' executor runs each step to the end (use "
                         "distributed_executor_backend 'mp'), or leave it unset")
    return config.async_scheduling


def create_executor(config: EngineConfig, vocab_size: int, max_model_len: int) -> Executor:
    """LocalExecutor for tensor_parallel_size 1, else a MultiprocExecutor or a RayExecutor as
    distributed_executor_backend says (Ray is imported only for the latter)."""
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, vocab_size, max_model_len)
    if config.distributed_executor_backend == "mp":
        from app.engine.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, vocab_size, max_model_len)
    from app.engine.ray_executor import RayExecutor  # imports Ray

    return RayExecutor(config, vocab_size, max_model_len)
