"""What the engine returns per request (no torch: the HTTP ingress and Ray handles pass these on)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position, as vLLM's `vllm.logprobs.Logprob`."""

    logprob: float
    rank: int | None = None  # 1 + how many tokens of the vocabulary are more likely (ties count as more)
    decoded_token: str | None = None


# Per prompt token (None for the first, which has no context): {token id: Logprob} holding the
# prompt token itself first and the N most likely tokens at that position (N + 1 entries, or N when
# the prompt token is among them), as vLLM's RequestOutput.prompt_logprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced; the delta fields hold what is new since its previous output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all text so far (cut at a matched stop string)
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    stop_reason: int | str | None  # the stop string or stop token id that finished it, if any
    num_cached_tokens: int
    # Complete lists on the final output only (None before), so streaming stays O(tokens):
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None  # when SamplingParams.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None
    # With SamplingParams.prompt_logprobs=N, once the whole prompt is computed (the first output
    # after that, and the final one): vLLM's shape, see PromptLogprobs.
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None  # why the request failed (finish_reason "error"); others are unaffected
    metrics: RequestMetrics | None = None  # on the final output
    index: int = 0  # which choice of an n > 1 request; each choice finishes on its own


@dataclass(slots=True)
class RequestMetrics:
    """A request's timeline from the engine's own clock (time.perf_counter)."""

    arrival_time: float
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was produced

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


def prompt_logprobs_dicts(
    prompt_token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    ranks: Sequence[int | None],
    top: Sequence[list[tuple[int, float]] | None] | None,
    decode: Callable[[int], str],
) -> PromptLogprobs:
    """PromptLogprobs from the engine's per-position lists: each prompt token's log-prob and rank
    (None at position 0) and, with N > 0, the N best (id, log-prob) by position; `decode` gives
    each token's text (one token decoded alone, as vLLM does)."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = decode(token_id)
        return texts[token_id]

    out: PromptLogprobs = []
    for i, (token_id, logprob, rank) in enumerate(zip(prompt_token_ids, logprobs, ranks)):
        if logprob is None:
            out.append(None)
            continue
        position = {token_id: Logprob(logprob, rank, text(token_id))}
        for j, (t, lp) in enumerate((top[i] if top is not None else None) or ()):
            position[t] = Logprob(lp, j + 1, text(t))  # the prompt token keeps its place, takes this rank
        out.append(position)
    return out
