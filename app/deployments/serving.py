"""The OpenAI operations behind both APIs: `completions`, `chat` and `models` of OpenAIServing.

Per request: validate (pydantic, protocol.py), map the output constraint (response_format,
structured_outputs, guided_*, tool_choice: structured.py) and have the engine check it, apply the
chat template (with the tools: tool_prompt.py), tokenize, hash the
prompt's full blocks (the KV-aware router reads them), take the session id (the caller's, else
the `user` field), stream from an LLMServer replica and build the OpenAI responses. `completions`
and `chat` are async generators: a non-streaming request yields one response, a streaming one its
chunks; with tools, the output is parsed for calls (tool_calls.py). Refusals are OpenAIErrors. Stopping an iteration early (a client that goes away) cancels
the LLMServer stream, so the engine aborts the request and frees its KV blocks.

No HTTP here: OpenAIIngress (ingress.py) is this class plus the FastAPI routes, and tests can run
it on a fake LLMServer handle.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing

from ray.serve.handle import DeploymentHandle

from app.config import ServerConfig
from app.deployments.errors import parse_request, to_openai_error
from app.serving_types import GenerateRequest, ModelInfo
from app.deployments.metrics import IngressMetrics
from app.deployments.structured import Constraint, request_constraint, structured_outputs
from app.deployments.tool_calls import (ToolCallStream, finish_reason, max_calls, parses_tools,
                                        response_message)
from app.deployments.tool_formats import pick_format
from app.deployments.tool_parsers import make_parser
from app.deployments.tool_prompt import template_inputs
from app.deployments.protocol import (
    BadRequestError,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    ModelNotFoundError,
    OpenAIError,
    TopLogprob,
    UsageInfo,
    new_id,
)
from app.kv_events.block_hash import hash_request_tokens
from app.engine.outputs import RequestOutput
from app.engine.errors import InvalidRequestError
from app.engine.scheduler import check_prompt_ids, check_request_fits
from app.engine.model_source import load_model_config, resolve_tokenizer
from app.engine.sampling_params import SamplingParams
from app.engine.tokenizer import ChatTemplateError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class PromptCache:
    """Token ids and block hashes of recent prompt texts, least recently used out first.

    Tokenizing runs in Python on the ingress's event loop (1.2 ms for a 3k-token prompt on a 2-core
    VM), hashing its blocks 0.2 ms more; a prompt text sent again (the same request fanned out to
    many agents, retries, n-way sampling as separate requests) costs a lookup instead. Exact text
    only: both are pure functions of (text, add_special_tokens) for a given tokenizer and block size.
    Bounded by entries and by the tokens held."""

    def __init__(self, encode, block_size: int, max_entries: int = 256, max_tokens: int = 1 << 20) -> None:
        """encode(text, add_special_tokens=...) -> token ids: the tokenizer's."""
        self.encode, self.block_size = encode, block_size
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._entries: OrderedDict[tuple[str, bool], tuple[array, tuple[int, ...]]] = OrderedDict()
        self._num_tokens = 0
        self.hits = self.misses = 0

    def get(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """(token ids, block hashes) of text: copies the caller may change."""
        key = (text, add_special_tokens)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0].tolist(), list(entry[1])
        self.misses += 1
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        hashes = hash_request_tokens(ids, self.block_size)
        if len(ids) <= self.max_tokens:
            self._entries[key] = (array("q", ids), tuple(hashes))
            self._num_tokens += len(ids)
            while len(self._entries) > self.max_entries or self._num_tokens > self.max_tokens:
                self._num_tokens -= len(self._entries.popitem(last=False)[1][0])
        return ids, hashes


class OpenAIServing:
    def __init__(self, llm_server: DeploymentHandle, config: ServerConfig | dict) -> None:
        """`llm_server`: a handle to the LLMServer deployment (or anything with its `generate`,
        `model_info` and `get_stats` methods behind `.options(stream=True)` / `.remote()`)."""
        self.config = config = ServerConfig.model_validate(config)
        self.llm_server = llm_server
        self.model_id = config.served_model_id
        self.tokenizer = resolve_tokenizer(config.engine, load_model_config(config.engine.model).vocab_size)
        self.tool_format = pick_format(config.tool_call_parser, self.tokenizer.chat_template,
                                       self.tokenizer.template_takes_tools)
        self.metrics = IngressMetrics()
        self._info: ModelInfo | None = None
        # (token ids, block hashes) of prompt texts, the recent ones cached
        self._prompts = PromptCache(self.tokenizer.encode, config.engine.block_size)

    # -- the handle API (the HTTP routes of OpenAIIngress call these) --------------------------------------------
    async def models(self) -> ModelList:
        try:
            info = await self._model_info()
        except Exception as e:  # no replica answers (e.g. 503: they failed to start)
            raise to_openai_error(e, {}, self.config.retry_after_s) from None
        return ModelList(data=[ModelCard(id=self.model_id, root=self.config.engine.model,
                                         max_model_len=info.max_model_len)])

    async def completions(self, request: CompletionRequest | dict, session_id: str | None = None
                          ) -> AsyncIterator[CompletionResponse | CompletionStreamResponse]:
        """Yields one CompletionResponse, or (stream=True) CompletionStreamResponse chunks."""
        async for item in self._counted(COMPLETIONS, self._completions(request, session_id)):
            yield item

    async def chat(self, request: ChatCompletionRequest | dict, session_id: str | None = None
                   ) -> AsyncIterator[ChatCompletionResponse | ChatCompletionStreamResponse]:
        """Yields one ChatCompletionResponse, or (stream=True) ChatCompletionStreamResponse chunks."""
        async for item in self._counted(CHAT, self._chat(request, session_id)):
            yield item

    # -- operations -----------------------------------------------------------------------------
    async def _completions(self, request, session_id):
        request = parse_request(CompletionRequest, request)
        self._check_model(request.model)
        constraint = request_constraint(request)
        text = request.prompt if isinstance(request.prompt, str) else None
        prompt_ids, hashes = self._prompts.get(text) if text is not None else (list(request.prompt), None)
        fields: dict[str, str] = {}
        params = sampling_params(request, request.max_tokens, request.logprobs, fields,
                                 prompt_logprobs=request.logprobs if request.echo else None,
                                 structured_outputs=await _checked(constraint))
        async for item in self._respond(COMPLETIONS, request, prompt_ids, params, session_id, fields, text, hashes):
            yield item

    async def _completion_items(self, request: CompletionRequest, rid: str, outputs):
        if not request.stream:
            finals = await final_outputs(outputs, request.n)
            choices = []
            for final in finals:
                echo_text, echo_logprobs = self._echo(request, final)
                logprobs = self._completion_logprobs(final.token_ids, final.logprobs, final.top_logprobs,
                                                     len(echo_text), echo_logprobs)
                choices.append(CompletionChoice(index=final.index, text=echo_text + final.text,
                                                finish_reason=final.finish_reason, logprobs=logprobs))
            yield CompletionResponse(id=rid, model=self.model_id, usage=_usage(finals), choices=choices)
            return
        offsets: dict[int, int] = {}  # choice -> offset of its next token in its text (logprobs.text_offset)
        finals: dict[int, RequestOutput] = {}
        async for out in outputs:
            i = out.index
            if out.delta_text or out.delta_token_ids or out.finished:
                first = i not in offsets
                echo_text, echo_logprobs = self._echo(request, out) if first else ("", None)
                logprobs = self._completion_logprobs(out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs,
                                                     offsets.get(i, 0) + len(echo_text), echo_logprobs)
                offsets[i] = offsets.get(i, 0) + len(echo_text)
                if logprobs is not None and logprobs.tokens:
                    offsets[i] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                yield CompletionStreamResponse(id=rid, model=self.model_id, choices=[
                    CompletionChoice(index=i, text=echo_text + out.delta_text, logprobs=logprobs,
                                     finish_reason=out.finish_reason)])
            if out.finished:
                finals[i] = out
                if len(finals) == request.n and request.include_usage:
                    yield CompletionStreamResponse(id=rid, model=self.model_id, choices=[],
                                                   usage=_usage(list(finals.values())))

    async def _chat(self, request, session_id):
        request = parse_request(ChatCompletionRequest, request)
        self._check_model(request.model)
        constraint = request_constraint(request, self.tool_format)
        messages, tools = template_inputs(request, self.tool_format, self.tokenizer.template_takes_tools)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except ChatTemplateError as e:
            raise BadRequestError(str(e), param="messages") from None
        bos = self.tokenizer.bos_token
        prompt_ids, hashes = self._prompts.get(text, add_special_tokens=not (bos and text.startswith(bos)))
        fields = {"prompt": "messages", "logprobs": "top_logprobs"}
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            fields["max_tokens"] = "max_completion_tokens"
        elif request.max_tokens is not None:
            max_tokens = request.max_tokens
        else:  # as vLLM: what the context leaves (the engine refuses a prompt that leaves nothing)
            max_tokens = max(1, (await self._model_info()).max_model_len - len(prompt_ids))
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, max_tokens, num_logprobs, fields,
                                 structured_outputs=await _checked(constraint))
        async for item in self._respond(CHAT, request, prompt_ids, params, session_id, fields, text, hashes):
            yield item

    async def _chat_items(self, request: ChatCompletionRequest, rid: str, outputs):
        if parses_tools(request):
            async for item in self._tool_chat_items(request, rid, outputs):
                yield item
            return
        if not request.stream:
            finals = await final_outputs(outputs, request.n)
            yield ChatCompletionResponse(id=rid, model=self.model_id, usage=_usage(finals), choices=[
                ChatCompletionChoice(index=f.index, message=ChatResponseMessage(content=f.text),
                                     finish_reason=f.finish_reason,
                                     logprobs=self._chat_logprobs(f.token_ids, f.logprobs, f.top_logprobs))
                for f in finals])
            return
        started: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        async for out in outputs:
            i = out.index
            if i not in started:  # each choice's role first, as OpenAI sends it
                started.add(i)
                yield ChatCompletionStreamResponse(id=rid, model=self.model_id, choices=[
                    ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            if out.delta_text or out.delta_token_ids or out.finished:
                logprobs = self._chat_logprobs(out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs)
                yield ChatCompletionStreamResponse(id=rid, model=self.model_id, choices=[
                    ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=out.delta_text), logprobs=logprobs,
                                               finish_reason=out.finish_reason)])
            if out.finished:
                finals[i] = out
                if len(finals) == request.n and request.include_usage:
                    yield ChatCompletionStreamResponse(id=rid, model=self.model_id, choices=[],
                                                       usage=_usage(list(finals.values())))

    async def _tool_chat_items(self, request: ChatCompletionRequest, rid: str, outputs):
        """_chat_items of a request whose output is parsed for tool calls (tool_calls.py)."""
        limit = max_calls(request)
        if not request.stream:
            finals = await final_outputs(outputs, request.n)
            choices = []
            for f in finals:
                message = response_message(make_parser(self.tool_format.name), f.text, limit)
                choices.append(ChatCompletionChoice(
                    index=f.index, message=message, finish_reason=finish_reason(f.finish_reason, len(message.tool_calls or ())),
                    logprobs=self._chat_logprobs(f.token_ids, f.logprobs, f.top_logprobs)))
            yield ChatCompletionResponse(id=rid, model=self.model_id, usage=_usage(finals), choices=choices)
            return
        streams: dict[int, ToolCallStream] = {}
        finals: dict[int, RequestOutput] = {}
        async for out in outputs:
            i = out.index
            if i not in streams:  # each choice's role first, as OpenAI sends it
                streams[i] = ToolCallStream(make_parser(self.tool_format.name), limit)
                yield ChatCompletionStreamResponse(id=rid, model=self.model_id, choices=[
                    ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            deltas = streams[i].deltas(out.delta_text, out.finished)
            logprobs = self._chat_logprobs(out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs)
            if not deltas and (logprobs is not None or out.finished):
                deltas = [DeltaMessage()]
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                yield ChatCompletionStreamResponse(id=rid, model=self.model_id, choices=[ChatCompletionStreamChoice(
                    index=i, delta=delta, logprobs=logprobs if k == 0 else None,
                    finish_reason=finish_reason(out.finish_reason, streams[i].num_calls) if last else None)])
            if out.finished:
                finals[i] = out
                if len(finals) == request.n and request.include_usage:
                    yield ChatCompletionStreamResponse(id=rid, model=self.model_id, choices=[],
                                                       usage=_usage(list(finals.values())))

    async def _respond(self, endpoint: str, request, prompt_ids: list[int], params: SamplingParams,
                       session_id: str | None, fields: dict[str, str], prompt_text: str | None,
                       block_hashes: list[int] | None):
        """Generate, and turn the engine's outputs into this endpoint's responses or chunks."""
        rid = new_id("cmpl" if endpoint == COMPLETIONS else "chatcmpl")
        outputs = self._generate(endpoint, rid, prompt_ids, params, session_id or request.user, fields, prompt_text,
                                 block_hashes,
                                 bool(request.stream))
        make_items = self._completion_items if endpoint == COMPLETIONS else self._chat_items
        async with aclosing(outputs):  # closing it early cancels the engine's stream
            async for item in make_items(request, rid, outputs):
                yield item

    async def _generate(self, endpoint: str, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        session_id: str | None, fields: dict[str, str], prompt_text: str | None,
                        block_hashes: list[int] | None, stream: bool
                        ) -> AsyncIterator[RequestOutput]:
        """Stream from an LLMServer replica (stream False: the first and final outputs only); its
        errors become OpenAIErrors (before the first output).
        Closing this early (or cancelling its task) cancels the replica's stream: the engine aborts."""
        # ids from our tokenizer (prompt_text set) are in the vocabulary: the engine refuses a
        # tokenizer larger than its model at start; ids a caller sent are checked
        await self._admit(prompt_ids, params, fields, check_ids=prompt_text is None)
        if block_hashes is None:
            block_hashes = hash_request_tokens(prompt_ids, self.config.engine.block_size)
        generate_request = GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params,
            session_id=session_id, block_hashes=block_hashes, stream=stream)
        m = self.metrics
        t0 = time.perf_counter()
        t_first = None
        num_tokens = [0] * params.n  # per choice
        num_finished = 0
        finished = False
        stream = None
        try:
            stream = self.llm_server.options(stream=True).generate.remote(generate_request)
            async for out in stream:
                if t_first is None:  # the prompt has been processed
                    t_first = time.perf_counter()
                    m.time_to_first_token.labels(endpoint).observe(t_first - t0)
                    m.prompt_tokens.inc(len(prompt_ids))
                    m.cached_tokens.inc(out.num_cached_tokens)
                # a final output carries every token (the deltas before it may not all have come)
                count = (len(out.token_ids) if out.finished and out.token_ids is not None
                         else num_tokens[out.index] + len(out.delta_token_ids))
                m.generation_tokens.inc(count - num_tokens[out.index])
                num_tokens[out.index] = count
                num_finished += out.finished
                if num_finished == params.n:
                    finished = True
                    if max(num_tokens) > 1:  # the choices decode side by side: time per token of the longest
                        m.time_per_output_token.labels(endpoint).observe(
                            (time.perf_counter() - t_first) / (max(num_tokens) - 1))
                out.prompt, out.prompt_token_ids = prompt_text, prompt_ids  # a replica does not send them back
                yield out
        except Exception as e:
            raise to_openai_error(e, fields, self.config.retry_after_s) from e
        finally:
            if stream is not None and not finished:
                _cancel(stream)

    async def _counted(self, endpoint: str, items: AsyncIterator) -> AsyncIterator:
        """Count the request by its outcome: 200, an OpenAIError's status, 499 (caller gone), 500."""
        status = 500
        try:
            async with aclosing(items):
                async for item in items:
                    yield item
            status = 200
        except OpenAIError as e:
            status = e.status_code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        finally:
            self.metrics.count_request(endpoint, status)

    # -- helpers --------------------------------------------------------------------------------
    async def _admit(self, prompt_ids: list[int], params: SamplingParams, fields: dict[str, str],
                     check_ids: bool = True) -> None:
        """Refuse here, before any replica, what a replica would refuse: an empty prompt, token ids
        outside the vocabulary, a prompt + max_tokens beyond max_model_len or the whole KV cache."""
        try:
            info = await self._model_info()  # a busy replica may refuse even this call (503)
            if check_ids or not prompt_ids:  # (an empty text without BOS is refused as empty)
                check_prompt_ids(prompt_ids, info.vocab_size)
            check_request_fits(len(prompt_ids), params.max_tokens, info.max_model_len, info.num_kv_blocks,
                               info.block_size)
        except Exception as e:
            raise to_openai_error(e, fields, self.config.retry_after_s) from None

    async def _model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.llm_server.model_info.remote()
        return self._info

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ModelNotFoundError(f"model {model!r} does not exist; this server serves {self.model_id!r} "
                                     "(see GET /v1/models)")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _echo(self, request: CompletionRequest, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """With echo: the prompt's text, and (with logprobs) its tokens' log-probabilities as OpenAI's
        completions API gives them (the first token's null, each top dict holding the token itself)."""
        if not request.echo:
            return "", None
        text = request.prompt if isinstance(request.prompt, str) else self.tokenizer.decode(
            out.prompt_token_ids, skip_special_tokens=False)
        if request.logprobs is None or out.prompt_logprobs is None:
            return text, None
        lp = CompletionLogprobs()
        offset = 0
        for token_id, position in zip(out.prompt_token_ids, out.prompt_logprobs):
            token = self._token_text(token_id)
            lp.tokens.append(token)
            if position is None:  # the first token
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                logprob = position[token_id].logprob
                lp.token_logprobs.append(logprob)
                # the `logprobs` best by rank (the prompt token's entry ranks beyond them unless it is one)
                top = sorted((e.rank, t, e.logprob) for t, e in position.items()
                             if e.rank is not None and e.rank <= request.logprobs)
                alternatives = {self._token_text(t): v for _, t, v in top}
                alternatives.setdefault(token, logprob)
                lp.top_logprobs.append(alternatives)
            lp.text_offset.append(offset)
            offset += len(token)
        return text, lp

    def _completion_logprobs(self, token_ids, logprobs, top_logprobs, offset: int,
                             head: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        """The completion's token logprobs (text offsets from `offset`), after `head`'s (the echoed
        prompt's) when given."""
        if logprobs is None or token_ids is None:
            return head
        out = head.model_copy(deep=True) if head is not None else CompletionLogprobs()
        for token_id, logprob, top in zip(token_ids, logprobs, top_logprobs):
            token = self._token_text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append({self._token_text(t): lp for t, lp in top})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _chat_logprobs(self, token_ids, logprobs, top_logprobs) -> ChatChoiceLogprobs | None:
        if logprobs is None or token_ids is None:
            return None
        content = []
        for token_id, logprob, top in zip(token_ids, logprobs, top_logprobs):
            token = self._token_text(token_id)
            alternatives = []
            for t, lp in top:
                s = self._token_text(t)
                alternatives.append(TopLogprob(token=s, logprob=lp, bytes=list(s.encode())))
            content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()),
                                            top_logprobs=alternatives))
        return ChatChoiceLogprobs(content=content)


async def _checked(constraint: Constraint | None):
    """The engine's StructuredOutputs for the request's constraint, checked off the event loop (a
    schema that is slow to check delays only its own request); None when unconstrained."""
    if constraint is None:
        return None
    return await asyncio.to_thread(structured_outputs, constraint)


def sampling_params(request, max_tokens: int, logprobs: int | None, fields: dict[str, str],
                    prompt_logprobs: int | None = None, structured_outputs=None) -> SamplingParams:
    """The request's SamplingParams (OpenAI's defaults); a bad value -> BadRequestError naming it.
    `structured_outputs`: the engine's StructuredOutputs (None: unconstrained)."""
    try:
        return SamplingParams(
            prompt_logprobs=prompt_logprobs,
            n=request.n,
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k is None else request.top_k,
            seed=request.seed,
            stop=request.stop,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            structured_outputs=structured_outputs,
        )
    except InvalidRequestError as e:
        raise to_openai_error(e, fields, retry_after_s=0) from None


async def last_item(outputs: AsyncIterator):
    """The last item of a stream (None when it is empty)."""
    last = None
    async for item in outputs:
        last = item
    return last


async def final_outputs(outputs: AsyncIterator[RequestOutput], n: int) -> list[RequestOutput]:
    """The final output of each of a request's n choices, by index (a final RequestOutput carries
    the complete text, ids and logprobs)."""
    finals = {}
    async for out in outputs:
        if out.finished:
            finals[out.index] = out
    if len(finals) != n:
        raise RuntimeError(f"the replica's stream ended with {len(finals)} of {n} choices finished")
    return [finals[i] for i in range(n)]


def _cancel(stream) -> None:
    """Cancel an LLMServer stream (the replica aborts the request). cancel() re-raises the error of
    a call that already failed (e.g. BackPressureError); that call needs no cancelling."""
    try:
        stream.cancel()
    except Exception:
        pass


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    """Usage of a request from its choices' final outputs: the prompt once, every choice's
    completion tokens; cached tokens are the first choice's (what the prompt found in the cache)."""
    first = min(finals, key=lambda f: f.index)
    return UsageInfo.of(len(first.prompt_token_ids), sum(len(f.token_ids or ()) for f in finals),
                        first.num_cached_tokens)
