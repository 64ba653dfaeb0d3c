"""What the engine returns per request (no torch: the HTTP ingress and Ray handles pass these on)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # With SamplingParams.prompt_logprobs, once the whole prompt is computed (the first output
    # after that, and the final one): per prompt token its log-prob given the ones before (None
    # for the first) and its N best alternatives.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
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
