"""State of one request inside the engine. Pure Python."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from app.engine.sampling_params import SamplingParams
from app.kv_events.block_hash import BlockHash, hash_request_tokens


# A token that a step in flight is sampling: its id is not known on the host yet (async scheduling).
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; it recomputes from its cached prefix
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed on its own (non-finite K/V or logits); other requests run on

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED,
                        SequenceStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(slots=True, eq=False)
class Sequence:
    """One request: its tokens, how many have KV in the cache, and the blocks holding them.

    Tokens [0, num_computed_tokens) have their K/V in the blocks of block_table. The scheduler
    gives the request num_tokens - num_computed_tokens more each step, within its budget.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks of all tokens
    # Async scheduling (engine.py): tokens a launched step is computing (their K/V not yet counted in
    # num_computed_tokens), and tokens it will sample (not yet known: PENDING_TOKEN in token_slice).
    num_inflight_tokens: int = 0
    num_pending_tokens: int = 0
    # Structured outputs: its grammar is still compiling (app/engine/grammar.py); the scheduler
    # leaves it waiting, and schedules the requests behind it.
    awaiting_grammar: bool = False

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a sequence needs at least one prompt token"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still pending (sampled by a step in flight) included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids are known."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or being computed: where the next step of this sequence starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    def step_samples(self, num_new: int) -> bool:
        """A step scheduling num_new more tokens of it reaches its last token, so the step samples
        its next one (the one rule for the step message's rows and the scheduler's bookkeeping)."""
        return self.num_scheduled_tokens + num_new == self.num_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end); a pending token reads as PENDING_TOKEN (the model runner takes it
        from the previous step's samples on the device)."""
        known = self.num_known_tokens
        if end > known:
            head = self.token_slice(start, known) if start < known else []
            return head + [PENDING_TOKEN] * (end - max(start, known))
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend block_hashes over every full block of the current tokens; returns them all."""
        num_full = self.num_known_tokens // block_size
        i = len(self.block_hashes)
        if num_full > i:  # all the new blocks in one pass (a prompt's: packed once, about half the time per block)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes += hash_request_tokens(self.token_slice(i * block_size, num_full * block_size),
                                                     block_size, parent_hash=parent)
        return self.block_hashes

    @property
    def is_finished(self) -> bool:
        return self.status.finished
