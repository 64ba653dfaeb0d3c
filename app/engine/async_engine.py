"""AsyncLLMEngine: the engine stepped by a background thread, one async stream per request.

The thread owns the engine: it applies queued adds and aborts, runs `step()`, and hands each
request's outputs to that request's asyncio queue. Callers never take the engine's lock from the
event loop, so a long step never blocks a server's other coroutines. A caller that stops
consuming its stream (a client disconnect cancels it) aborts the request, and its KV blocks are
freed before the next step. No Ray here: the Ray Serve deployment wraps this class.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from dataclasses import dataclass

from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.outputs import RequestOutput
from app.engine.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError,
                               RequestTimeoutError)
from app.engine.sampling_params import SamplingParams
from app.kv_events.schema import KVEvent

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """A generate() call's end of the engine thread's deliveries."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool  # False: the first output of each choice, then only its merged final one
    first_sent: set[int]  # choices whose first output was delivered
    held: dict[int, list[RequestOutput]]  # choice -> outputs not delivered yet (stream False)


def _put_all(items: list[tuple[str, asyncio.Queue, object]]) -> None:
    for _, queue, item in items:
        queue.put_nowait(item)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | Seq[int]
    prompt_ids: list[int]
    params: SamplingParams
    block_hashes: Seq[int] | None


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        max_queued_requests: int | None = None,
        engine: LLMEngine | None = None,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
        request_timeout_s: float | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        """`max_queued_requests`: most requests waiting for their first step (None: no limit);
        beyond it `generate` raises EngineOverloadedError. `on_kv_events` is called from the engine
        thread after each step that changed the prefix cache. `request_timeout_s`: a request still
        unfinished that long after `generate` was called is aborted and its stream raises
        RequestTimeoutError (None: no deadline). `step_timeout_s`: `check_health` fails while one
        engine step has been running longer (a stuck device or worker; None: never)."""
        self.engine = engine if engine is not None else LLMEngine(config)
        self.max_queued_requests = max_queued_requests
        self.on_kv_events = on_kv_events
        self.request_timeout_s = request_timeout_s
        self.step_timeout_s = step_timeout_s
        self._deadlines: dict[str, float] = {}  # request id -> time.monotonic() deadline
        self._step_started: float | None = None  # monotonic start of the step in flight
        self._streams: dict[str, _Stream] = {}
        self._adds: deque[_Add] = deque()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self.num_steps = 0
        self.num_requests_total = 0  # requests the engine accepted
        self.snapshot: dict = self._snapshot()  # engine state after the latest step (engine thread)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- caller side (event loop) ---------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # what the replica (app/deployments/llm_server.py) reads, the same on VLLMEngine
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.num_kv_blocks

    def worker_info(self) -> list[dict]:
        return self.engine.worker_info()

    def kv_cache_snapshot_events(self) -> list:
        return self.engine.kv_cache_snapshot_events()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None or not self._thread.is_alive()

    def num_queued(self) -> int:
        return self.engine.scheduler.num_waiting + len(self._adds)

    def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(f"engine loop stopped: {self.dead_error!r}")
        started = self._step_started
        if self.step_timeout_s is not None and started is not None:
            running = time.monotonic() - started
            if running > self.step_timeout_s:
                raise EngineDeadError(f"an engine step has been running for {running:.0f} s "
                                      f"(step_timeout_s={self.step_timeout_s:g}): the engine is stuck")

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = True,
        block_hashes: Seq[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas; the last one has finished=True). With params.n > 1
        the choices' outputs interleave (RequestOutput.index), each choice finishing on its own.
        With stream False each choice gives its first output and then one final output carrying
        every delta since (the engine thread merges them: the caller's loop is not woken per step).
        block_hashes: the prompt's block hashes if the caller has them (LLMEngine._add_validated).

        Raises InvalidRequestError (nothing queued) for a bad request, EngineOverloadedError when
        the queue is full, EngineDeadError when the engine loop has failed, RequestFailedError when
        this request failed on its own (NaN/Inf in its K/V or logits). Stopping the iteration
        early (or cancelling the task consuming it) aborts the request.
        """
        self.check_health()
        params = SamplingParams() if params is None else params
        prompt_ids = self.engine.validate(prompt, params)  # raises InvalidRequestError
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.max_queued_requests is not None and self.num_queued() >= self.max_queued_requests:
            raise EngineOverloadedError(
                f"{self.num_queued()} requests are queued (max_queued_requests={self.max_queued_requests}); "
                "retry later"
            )
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._streams[request_id] = _Stream(loop, queue, stream, set(), {})
        if self.is_dead or self._stopped:  # the loop may have died or stopped after the check above:
            self._streams.pop(request_id, None)  # then nobody would ever deliver to this stream
            raise EngineDeadError(f"engine loop stopped: {self.dead_error!r}")
        timer = None
        if self.request_timeout_s is not None:
            self._deadlines[request_id] = time.monotonic() + self.request_timeout_s
            # The engine thread aborts the request at its deadline and delivers the error; this timer
            # delivers it too, for when the engine thread is stuck in a step (the first one counts).
            timer = loop.call_later(self.request_timeout_s,
                                    lambda: queue.put_nowait(self._timeout_error(request_id)))
        self._adds.append(_Add(request_id, prompt, prompt_ids, params, block_hashes))
        self._wake.set()
        num_finished, held = 0, None  # choices finished; an output read ahead of its turn
        try:
            while num_finished < params.n:
                if held is not None:
                    out, held = held, None
                else:
                    out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if not queue.empty() and not out.finished:  # a slow reader gets merged deltas
                    run = [out]
                    while not queue.empty() and not run[-1].finished:
                        nxt = queue.get_nowait()
                        if isinstance(nxt, BaseException):
                            raise nxt
                        if nxt.index != out.index:  # another choice's: yield it next
                            held = nxt
                            break
                        run.append(nxt)
                    out = merge_outputs(run)
                num_finished += out.finished
                yield out
        finally:
            if timer is not None:
                timer.cancel()
            self._streams.pop(request_id, None)
            self._deadlines.pop(request_id, None)
            if num_finished < params.n:
                self._aborts.append(request_id)
                self._wake.set()

    def _timeout_error(self, request_id: str) -> RequestTimeoutError:
        return RequestTimeoutError(f"request {request_id} ran past its deadline "
                                   f"(request_timeout_s={self.request_timeout_s:g}) and was aborted")

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason 'abort'); unknown ids are ignored."""
        self._aborts.append(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the loop, fail every open stream (EngineDeadError), then stop the engine (its
        tensor-parallel workers, if any)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        err = EngineDeadError("the engine was shut down")
        for rid in list(self._streams):
            self._deliver(rid, err)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- engine thread --------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand (request id, output or error) pairs to their streams: one wake-up of each caller's
        loop for all of them. A stream with stream=False gets its outputs' first and, merged,
        final one per choice (and any error at once)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, object]]] = {}
        for rid, item in items:
            target = self._streams.get(rid)
            if target is None:
                continue
            if isinstance(item, RequestOutput):
                i = item.index
                if not target.stream and i in target.first_sent and not item.finished:
                    target.held.setdefault(i, []).append(item)
                    continue
                target.first_sent.add(i)
                held = target.held.pop(i, None)
                if held:
                    item = merge_outputs([*held, item])
            by_loop.setdefault(target.loop, []).append((rid, target.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                self._aborts.extend(rid for rid, _, _ in batch)

    def _expire(self) -> None:
        """Abort the requests past their deadline (their streams raise RequestTimeoutError)."""
        now = time.monotonic()
        for rid in [r for r, d in list(self._deadlines.items()) if d <= now]:  # a copy: callers add and pop
            self._deadlines.pop(rid, None)
            self.engine.abort_request(rid)
            self._deliver(rid, self._timeout_error(rid))

    def _apply_queued(self) -> None:
        engine = self.engine
        while self._aborts:
            rid = self._aborts.popleft()
            for out in engine.abort_request(rid):
                self._deliver(rid, out)
        while self._adds:
            add = self._adds.popleft()
            if add.request_id not in self._streams:
                continue  # cancelled before it was queued
            try:
                engine._add_validated(add.request_id, add.prompt, add.prompt_ids, add.params, add.block_hashes)
                self.num_requests_total += 1
            except InvalidRequestError as e:
                self._deliver(add.request_id, e)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            try:
                if self._deadlines:
                    self._expire()
                self._apply_queued()
                if not engine.has_unfinished_requests():
                    self.snapshot = self._snapshot()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                self._step_started = time.monotonic()
                outputs = engine.step()
                self._step_started = None
                self.num_steps += 1
                self.snapshot = self._snapshot()  # before delivering: what a caller sees is never newer
                # a request that failed on its own gets its error, the rest go on
                self._deliver_all([(out.request_id, out if out.error is None else RequestFailedError(out.error))
                                   for out in outputs])
                events = engine.take_kv_events()
                if events and self.on_kv_events is not None:
                    self.on_kv_events(events)
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("step %d: %d outputs in %.1f ms", self.num_steps, len(outputs),
                                 1e3 * (time.perf_counter() - t0))
            except BaseException as e:  # the engine is broken: fail every stream, stop stepping
                logger.exception("engine loop failed; failing %d requests", len(self._streams))
                self.dead_error = e
                err = EngineDeadError(f"engine step failed: {e!r}")
                for rid in list(self._streams):
                    self._deliver(rid, err)
                return


    def _snapshot(self) -> dict:
        """Engine state and counters (taken in the engine thread, read from any thread)."""
        engine = self.engine
        sched = engine.scheduler
        queued = sum(s.num_tokens - s.num_scheduled_tokens for s in (*sched.running, *sched.waiting))
        return {
            **engine.stats(),
            "num_queued_tokens": queued,  # tokens still to prefill or recompute
            "num_preemptions_total": sched.num_preemptions_total,
            "num_prefix_hit_tokens_total": sched.num_prefix_hit_tokens_total,
            "num_prompt_tokens_total": sched.num_prompt_tokens_total,
            "num_steps_total": self.num_steps,
            "num_requests_total": self.num_requests_total,
        }


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """The last of consecutive outputs of one choice, with every earlier one's deltas prepended
    (in one pass: a long run of held outputs is not copied once per output)."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    last.delta_text = "".join(o.delta_text for o in outs)
    last.delta_token_ids = [t for o in outs for t in o.delta_token_ids]
    if all(o.delta_logprobs is not None for o in outs):
        last.delta_logprobs = [x for o in outs for x in o.delta_logprobs]
        last.delta_top_logprobs = [x for o in outs for x in (o.delta_top_logprobs or [])]
    if last.prompt_logprobs is None:
        last.prompt_logprobs = next((o.prompt_logprobs for o in reversed(outs) if o.prompt_logprobs is not None),
                                    None)
    return last
