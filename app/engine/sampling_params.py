"""Sampling parameters of one request. Pure Python; validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from app.engine.errors import InvalidRequestError
from app.engine.structured_outputs import StructuredOutputs


# Seeds are 64-bit signed integers (what torch generators and the OpenAI API take).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
# Stop strings are matched on the engine thread after every token: their number and length are bounded.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 128  # choices per request (OpenAI's limit)


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    temperature 0 means greedy. top_k -1 (or 0) and top_p 1.0 disable those filters. seed makes
    sampling reproducible per request, independent of what else is in the batch. Generation stops
    at max_tokens, at EOS (unless ignore_eos), at any of stop_token_ids, or when the text contains
    one of stop (the stop string itself is left out of the text unless include_stop_str_in_output).
    logprobs=N returns the sampled token's log-probability and the N most likely alternatives.
    prompt_logprobs=N returns, for every prompt token after the first, its log-probability given
    the tokens before it and the N most likely alternatives, as vLLM does (RequestOutput.prompt_logprobs:
    per token None or {token id: Logprob}; such a request computes its whole prompt: prefix-cache
    hits are not used for it). max_tokens=0 computes the prompt only. structured_outputs constrains
    the output to a JSON schema, a regex, a choice or a grammar (app/engine/structured_outputs.py);
    the request finishes ("stop") when the grammar is complete, whatever ignore_eos says.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # OpenAI clients send null for "none" and a bare string for one stop string.
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        _check(isinstance(self.stop, (list, tuple)), f"stop must be a string or a list of strings (got {self.stop!r})")
        _check(isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of token ids (got {self.stop_token_ids!r})")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0,
               f"max_tokens must be an integer >= 0 (got {self.max_tokens!r})")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        _check(_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1)),
               f"top_k must be -1 or 0 (disabled) or an integer >= 1 (got {self.top_k!r})")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1] (got {self.top_p!r})")
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               f"seed must be a 64-bit signed integer in [{SEED_MIN}, {SEED_MAX}] or None (got {self.seed!r})")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop must hold at most {MAX_STOP_STRINGS} strings (got {len(self.stop)})")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings (got {self.stop!r:.200})")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
               f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters "
               f"(got one of {max(map(len, self.stop), default=0)})")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers "
               f"(got {self.stop_token_ids!r:.200})")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be None or an integer in [0, 20] (got {self.logprobs!r})")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}] (got {self.n!r})")
        _check(self.seed is None or self.seed + self.n - 1 <= SEED_MAX,
               f"seed + n - 1 must be at most {SEED_MAX} (choice i samples with seed + i; got seed {self.seed}, "
               f"n {self.n})")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be None or an integer in [0, 20] (got {self.prompt_logprobs!r})")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               f"structured_outputs must be None or a StructuredOutputs (got {type(self.structured_outputs).__name__})")

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n > 1 request: one choice, its own seed."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SamplingParamsError(message)
