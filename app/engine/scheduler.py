"""Continuous batching with chunked prefill, vLLM-v1 style. Pure Python.

There is no prefill phase and no decode phase: each step gives every request
num_tokens - num_computed_tokens more tokens, running requests first, then waiting ones, within
max_num_batched_tokens tokens and max_num_seqs requests. A long prompt simply gets a chunk per
step. When blocks run out the newest running request is preempted: its blocks are freed (they
stay in the prefix cache until evicted) and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from app.engine.errors import InvalidRequestError
from app.engine.kv_cache_manager import KVCacheManager, cdiv
from app.engine.sequence import Sequence, SequenceStatus


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit in the KV cache or the model's context."""


def check_prompt_ids(ids: list, vocab_size: int) -> None:
    """Raise InvalidRequestError unless ids is a non-empty list of token ids in [0, vocab_size).
    Pure: the ingress runs the same check before a request reaches a replica."""
    if not ids:
        raise InvalidRequestError("prompt must not be empty")
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return  # the common case at C speed (a 3k-token prompt: ~0.1 ms instead of ~0.5)
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}) (got {bad[:5]})")


def check_request_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_kv_blocks: int,
                       block_size: int) -> None:
    """Raise RequestTooLargeError unless prompt + max_tokens fits max_model_len and the whole KV
    cache. Pure: the ingress runs the same check before a request reaches a replica."""
    if num_prompt_tokens >= max_model_len:
        raise RequestTooLargeError(
            f"prompt is {num_prompt_tokens} tokens, longer than max_model_len ({max_model_len}) "
            "allows with at least one output token; shorten the prompt"
        )
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestTooLargeError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len ({max_model_len}); shorten the prompt or lower max_tokens"
        )
    # The last sampled token is never fed back, so its K/V is never stored.
    blocks = cdiv(total - 1, block_size)
    if blocks > num_kv_blocks:
        raise RequestTooLargeError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks "
            f"but the cache has {num_kv_blocks}; lower max_tokens or give the KV cache more memory"
        )


@dataclass(slots=True)
class SchedulerOutput:
    # (sequence, number of its tokens to compute this step), in batch order
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        assert max_num_batched_tokens >= 1 and max_num_seqs >= 1
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Counters since start, for metrics.
        self.num_preemptions_total = 0
        self.num_prefix_hit_tokens_total = 0  # prompt tokens served by the prefix cache
        self.num_prompt_tokens_total = 0  # prompt tokens of requests scheduled for the first time
        # hold a waiting request whose next uncached prompt block a running one is computing (see
        # _inflight_blocks); off only for A/B measurements (bench/shared_prefix.py)
        self.share_inflight_prefixes = True
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self.check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError unless prompt + max_tokens fits the context and the cache."""
        check_request_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.kv.pool.num_blocks,
                           self.block_size)

    def finish_requests(self, request_ids: Iterable[str], status: SequenceStatus) -> list[Sequence]:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        assert status.finished
        finished = []
        for rid in request_ids:
            seq = self.requests.pop(rid, None)
            if seq is None:
                continue
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self.kv.free(seq)
            seq.status = status
            finished.append(seq)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and self._ends_with_pending(seq):
                i += 1  # it finishes (length) when the step in flight returns its token: nothing to compute
                continue
            num_new = min(seq.num_tokens - seq.num_scheduled_tokens, budget)
            assert num_new > 0
            while self.kv.allocate_slots(seq, num_new) is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq preempted itself: nothing after it is left to schedule

        if not out.preempted and self.waiting:
            inflight = self._inflight_blocks()
            j = 0  # waiting requests are admitted in order; one held for an in-flight prefix is stepped over
            while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[j]
                if seq.awaiting_grammar:  # its grammar is compiling: it waits, the others go on
                    j += 1
                    continue
                hits, num_hit_tokens = self.kv.get_computed_blocks(seq)
                if self._awaits_inflight(seq, num_hit_tokens, inflight):
                    j += 1
                    continue
                num_new = min(seq.num_tokens - num_hit_tokens, budget)
                if self.kv.allocate_slots(seq, num_new, hits) is None:
                    break
                del self.waiting[j]
                self._add_inflight(seq, num_hit_tokens, inflight)
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = num_hit_tokens
                    self.num_prefix_hit_tokens_total += num_hit_tokens
                    self.num_prompt_tokens_total += seq.num_prompt_tokens
                seq.num_computed_tokens = num_hit_tokens
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append((seq, num_new))
                budget -= num_new
        return out

    # -- prompts that share a prefix being computed --------------------------------------------
    # A waiting request whose next uncached block is one a running request is computing right now
    # (the same prompt prefix: a shared system prompt, the choices of an n > 1 request, a swarm's
    # common context) waits for it instead of computing the same blocks again, and takes them from
    # the prefix cache once they are full and cached. It never waits on itself or on a request that
    # is not running, so it cannot starve.
    def _inflight_blocks(self) -> dict:
        """Block hash -> the running request still to compute that full prompt block."""
        if not self.kv.enable_prefix_caching or not self.share_inflight_prefixes:
            return {}
        inflight: dict = {}
        for seq in self.running:
            self._add_inflight(seq, seq.num_computed_tokens, inflight)
        return inflight

    def _add_inflight(self, seq: Sequence, num_computed: int, inflight: dict) -> None:
        """Record seq's full prompt blocks from token num_computed on as being computed by seq."""
        bs = self.block_size
        first, end = num_computed // bs, seq.num_prompt_tokens // bs
        if first >= end or not self.kv.enable_prefix_caching or not self.share_inflight_prefixes \
                or seq.sampling_params.prompt_logprobs is not None:
            return  # nothing left to compute, or blocks that will never be cached for others
        hashes = seq.update_block_hashes(bs)
        for i in range(first, min(end, len(hashes))):
            inflight.setdefault(hashes[i], seq)

    def _awaits_inflight(self, seq: Sequence, num_hit_tokens: int, inflight: dict) -> bool:
        if not inflight or seq.sampling_params.prompt_logprobs is not None:
            return False  # a prompt-logprobs request computes its whole prompt anyway
        k = num_hit_tokens // self.block_size  # its first block not found in the cache
        if k >= (seq.num_tokens - 1) // self.block_size:  # no full block left that a hit could serve
            return False
        owner = inflight.get(seq.update_block_hashes(self.block_size)[k])
        return owner is not None and owner is not seq

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_inflight_tokens = 0  # a step in flight still computes them, into blocks it no longer holds
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def on_launched(self, out: SchedulerOutput, sampling: Iterable[Sequence]) -> list[int]:
        """The step `out` has been launched: its tokens are in flight and `sampling` (the sequences
        that sample in it) each have one pending token, so that the next schedule() can start where
        this step ends. Returns each scheduled sequence's preemption count, for update_from_output."""
        for seq, num_new in out.scheduled:
            seq.num_inflight_tokens += num_new
        for seq in sampling:
            seq.num_pending_tokens += 1
        return [seq.num_preemptions for seq, _ in out.scheduled]

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           launched_preemptions: list[int] | None = None,
                           sampling: Iterable[Sequence] | None = None) -> list[Sequence]:
        """The step `out` (launched with on_launched) has run: advance its requests; append the tokens
        sampled; finish on EOS, stop ids, length.

        `sampled` maps request id -> token for the requests that keep a token from this step (every
        request of `sampling` but those with max_tokens 0 and those finished meanwhile). A request
        finished since the launch (aborted, stopped by its previous token, failed) is skipped; one
        preempted since (launched_preemptions differs) keeps its token but not the step's K/V, whose
        blocks it gave up. Returns the requests that finished in this step (their blocks are freed).
        Without launched_preemptions the step is taken as launched just now (on_launched is called
        here; the requests whose step reaches their last token sample).
        """
        if launched_preemptions is None:
            sampling = [seq for seq, n in out.scheduled if seq.step_samples(n)]
            launched_preemptions = self.on_launched(out, sampling)
        finished = []
        samplers = {seq.request_id for seq in sampling}
        for (seq, num_new), preemptions in zip(out.scheduled, launched_preemptions):
            if seq.is_finished:
                continue
            if seq.num_preemptions == preemptions:
                seq.num_inflight_tokens -= num_new
                seq.num_computed_tokens += num_new
                self.kv.cache_computed_blocks(seq)
            if seq.request_id not in samplers:
                continue  # a prefill chunk that did not reach the end of the prompt
            seq.num_pending_tokens -= 1
            token = sampled.get(seq.request_id)
            if token is None:
                if seq.sampling_params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                    finished.extend(self.finish_requests([seq.request_id], SequenceStatus.FINISHED_LENGTH))
                continue
            assert seq.num_computed_tokens == seq.num_known_tokens or seq.num_preemptions != preemptions
            seq.append_token(token)
            status = self._stop_status(seq, token)
            if status is not None:
                finished.extend(self.finish_requests([seq.request_id], status))
        return finished

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """Its pending tokens take it to max_tokens or max_model_len: it finishes when they land."""
        return seq.num_output_tokens + seq.num_pending_tokens >= seq.sampling_params.max_tokens \
            or seq.num_tokens >= self.max_model_len

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens or seq.num_known_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None
