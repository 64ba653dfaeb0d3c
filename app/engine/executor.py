"""Executors: where the engine's model steps run.

The engine hands each scheduled step to an Executor, which turns it into a compact StepMessage
(see model_runner.py) and runs it on every tensor-parallel rank:

- LocalExecutor (tensor_parallel_size 1): one ModelRunner in the engine's process; neither Ray
  nor torch.distributed is imported.
- RayExecutor (app/engine/ray_executor.py, tensor_parallel_size > 1): one Ray actor per rank on the
  bundles of a placement group; imported only when asked for (engine.create_executor picks, so
  this module never imports ray_executor.py, which subclasses Executor).

Both speak the same messages, so tensor_parallel_size 1 exercises the same worker code as TP.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from app.config import EngineConfig
from app.engine.model_runner import GrammarMask, ModelRunner, ScheduledRequest, StepMessage, StepResult
from app.engine.sampler import SamplerOutput
from app.engine.scheduler import SchedulerOutput
from app.engine.sequence import Sequence


@dataclass(slots=True)
class LaunchedStep:
    """A step started by Executor.launch: its message, the sequences that sample in it (in the order
    of its rows), and what the executor needs to collect it."""

    message: StepMessage
    sampling: list[Sequence]
    handle: object
    timing: dict = field(default_factory=dict)  # rank 0's split of this step (Executor.last_timing)


class StepMessageBuilder:
    """Driver side of the step protocol: remembers what each rank already knows of a request.

    A request is sent whole (params + whole block table) the first time and after a preemption;
    afterwards only its new tokens and the blocks appended since. Ids of finished requests that
    ranks have seen go out with the next step. A step that fails makes every request go whole
    next time, so a rank that applied part of it cannot drift from the driver.
    """

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (num_preemptions, blocks sent)
        self._finished: list[str] = []

    def build(self, sched: SchedulerOutput) -> tuple[StepMessage, list[Sequence]]:
        """The message of one step, and the sequences that sample, in the order of its rows."""
        requests, sampling = [], []
        for seq, num_new in sched.scheduled:
            start = seq.num_scheduled_tokens  # after the tokens of a step still in flight
            end = start + num_new
            sent = self._sent.get(seq.request_id)
            whole = sent is None or sent[0] != seq.num_preemptions
            table = seq.block_table
            block_ids = table if whole else table[sent[1]:]
            do_sample = seq.step_samples(num_new)
            num_prompt = seq.num_prompt_tokens
            targets = None
            if seq.sampling_params.prompt_logprobs is not None and start + 1 < num_prompt:
                targets = seq.token_slice(start + 1, min(end + 1, num_prompt))
            requests.append(ScheduledRequest(
                request_id=seq.request_id,
                token_ids=seq.token_slice(start, end),
                start_pos=start,
                block_ids=list(block_ids),
                params=seq.sampling_params if whole else None,
                do_sample=do_sample,
                prompt_targets=targets,
            ))
            self._sent[seq.request_id] = (seq.num_preemptions, len(table))
            if do_sample:
                sampling.append(seq)
        finished, self._finished = self._finished, []
        return StepMessage(requests, finished), sampling

    def failed(self, message: StepMessage) -> None:
        """The step of `message` raised: resend every request whole; keep its finished ids."""
        self._finished[:0] = message.finished_request_ids
        self._sent = {rid: (-1, 0) for rid in self._sent}

    def release(self, request_id: str) -> None:
        """The request finished: ranks drop its state with the next step (if they ever saw it)."""
        if self._sent.pop(request_id, None) is not None:
            self._finished.append(request_id)


class Executor(ABC):
    """Runs steps on the tensor-parallel ranks. Not thread-safe: the engine calls it under its lock."""

    num_kv_blocks: int  # KV blocks of every rank's cache (the same block ids on every rank)

    def __init__(self) -> None:
        self._messages = StepMessageBuilder()

    def launch(self, sched: SchedulerOutput, grammar: GrammarMask | None = None,
               defer_sample: bool = False) -> LaunchedStep:
        """Start one scheduled step; collect() waits for it. Executors that cannot run a step in the
        background (supports_async False) run it here. grammar: structured outputs' mask of the
        step's sampling rows (rank 0 applies it). defer_sample: run the forward only; sample() then
        launches the sampling (async scheduling: its mask needs the step in flight's tokens)."""
        message, sampling = self._messages.build(sched)
        message.grammar, message.defer_sample = grammar, defer_sample
        try:
            handle = self._launch(message)
        except BaseException:
            self._messages.failed(message)
            raise
        return LaunchedStep(message, sampling, handle, dict(self.last_timing))

    def collect(self, step: LaunchedStep) -> tuple[list[Sequence], SamplerOutput]:
        """Wait for a launched step: the sequences that sampled a token and what they sampled."""
        sampling = step.sampling
        try:
            out = self._collect(step.handle)
        except BaseException:
            self._messages.failed(step.message)
            raise
        if not sampling:  # nothing sampled, but requests may have failed (non-finite K/V) or scored prompt tokens
            return [], SamplerOutput([], None, None, failed=out.failed if out is not None else {},
                                     prompt_logprobs=out.prompt_logprobs if out is not None else {})
        assert out is not None and len(out.token_ids) == len(sampling)
        return sampling, out

    def sample(self, step: LaunchedStep, grammar: GrammarMask | None) -> None:
        """Launch the sampling of a step launched with defer_sample (before any later launch),
        its constrained rows masked by `grammar`, on rank 0."""
        assert step.message.defer_sample
        try:
            self._sample(grammar)
        except BaseException:
            self._messages.failed(step.message)
            raise
        step.timing = dict(self.last_timing)

    def _sample(self, grammar: GrammarMask | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs steps to the end: it never defers sampling")

    def abandon(self, step: LaunchedStep) -> None:
        """A launched step will not be collected (a step failed): every rank gets its requests whole
        next time."""
        self._messages.failed(step.message)

    def release(self, request_id: str) -> None:
        """Forget a finished (or aborted) request on every rank."""
        self._messages.release(request_id)

    @property
    def last_timing(self) -> dict:
        """Rank 0's split of the latest step (prepare_s, forward_s, sample_s, graph), where known."""
        return {}

    # Whether _launch can return before the device has run the step (the engine then schedules the
    # next step while this one runs: EngineConfig.async_scheduling), and whether the engine does so
    # (set by the engine; an executor may launch differently then).
    supports_async = False
    pipelined = False

    def _launch(self, message: StepMessage):
        """Start the message on every rank; what _collect takes. By default it runs to the end here."""
        return self._execute(message)

    def _collect(self, handle) -> SamplerOutput | None:
        """Rank 0's sampler output of a launched message."""
        return handle

    @abstractmethod
    def _execute(self, message: StepMessage) -> SamplerOutput | None:
        """Run the message on every rank; rank 0's sampler output."""

    @abstractmethod
    def worker_info(self) -> list[dict]:
        """Per rank: where it runs (rank, pid, node, GPU ids, device)."""

    def shutdown(self) -> None:
        """Release workers and their resources (idempotent)."""


class LocalExecutor(Executor):
    """tensor_parallel_size 1: the model in the engine's process."""

    supports_async = True

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int) -> None:
        super().__init__()
        self.runner = ModelRunner(config, vocab_size, max_model_len=max_model_len)
        self.num_kv_blocks = self.runner.num_kv_blocks_fit(max_model_len)
        self.runner.allocate_kv_cache(self.num_kv_blocks)

    def _execute(self, message: StepMessage) -> SamplerOutput | None:
        return self.runner.execute(message)

    def _launch(self, message: StepMessage) -> StepResult:
        return self.runner.launch(message)

    def _collect(self, handle: StepResult) -> SamplerOutput | None:
        return handle.result()

    def _sample(self, grammar: GrammarMask | None) -> None:
        self.runner.sample(grammar)

    @property
    def last_timing(self) -> dict:
        return self.runner.last_timing

    def worker_info(self) -> list[dict]:
        return [{"rank": 0, "pid": os.getpid(), "device": str(self.runner.device),
                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}]
