"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.outputs import RequestOutput
from app.engine.errors import InvalidRequestError
from app.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class LLM:
    """An engine driven to completion in the caller's thread.

    >>> llm = LLM(model="../shared/models/stories260K/stories260K.bin",
    ...           tokenizer="../shared/models/stories260K/tok512.bin")
    >>> llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40))[0].text

    Keyword arguments are EngineConfig fields (see app/config.py). Outputs are RequestOutput
    (app/engine/outputs.py), `prompt_logprobs` in vLLM's shape.
    """

    def __init__(self, model: str = "tiny-llama", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        log_every_s: float = 10.0,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order (a prompt whose
        params have n > 1 gives its n choices in a row, by index).

        All prompts are validated before any is queued, so an invalid one changes nothing.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; pass one or one each"
                )
            params = [p or SamplingParams() for p in sampling_params]
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        engine = self.engine
        prompt_ids = [engine.validate(prompt, p) for prompt, p in zip(prompts, params)]
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, ids, p in zip(request_ids, prompts, prompt_ids, params):
                engine._add_validated(rid, prompt, ids, p)
            return self._run(request_ids, [p.n for p in params], log_every_s)
        except BaseException:
            engine.abort_request(request_ids)
            raise

    def _run(self, request_ids: list[str], choices: list[int], log_every_s: float) -> list[RequestOutput]:
        finished: dict[tuple[str, int], RequestOutput] = {}
        total = sum(choices)
        start = last_log = time.monotonic()
        while len(finished) < total:
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id, out.index] = out
            now = time.monotonic()
            if now - last_log >= log_every_s:
                last_log = now
                logger.info("generate: %d/%d sequences finished after %.0f s", len(finished), total, now - start)
        return [finished[rid, i] for rid, n in zip(request_ids, choices) for i in range(n)]
