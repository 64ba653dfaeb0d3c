"""OpenAI-compatible request and response schemas, and the typed errors of the API.

The same pydantic objects travel over HTTP (as JSON) and over a Ray Serve handle (pickled).
Requests validate types strictly (no "5" for an integer, no true for a number); value ranges
(max_tokens >= 1, temperature >= 0, ...) are checked once, by SamplingParams, whose message
names the field. Fields of the OpenAI API this server does not implement are accepted at their
default and refused with a 400 otherwise; unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from app.deployments.protocol_tools import (
    ChatCompletionTool,
    DeltaToolCall,
    HistoryToolCall,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsParams,
    ToolCall,
    ToolChoice,
)
from app.engine.sampling_params import MAX_N

# -- errors --------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error the API answers with `{"error": {"message", "type", "param", "code"}}`.

    Raised by the ingress's handle methods too, so a Python caller can catch it (through a
    handle it arrives as a RayTaskError that is also an instance of this class, with the same
    attributes). Attributes are set per instance (subclasses only change the defaults) so that
    they survive that wrapping.
    """

    _defaults: dict = {}

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message)
        fields = {"status_code": 400, "type": "invalid_request_error", "param": None, "code": None,
                  "retry_after_s": None, **self._defaults, **kwargs}
        self.message = message
        self.status_code: int = fields.pop("status_code")
        self.type: str = fields.pop("type")
        self.param: str | None = fields.pop("param")
        self.code: str | None = fields.pop("code")
        self.retry_after_s: int | None = fields.pop("retry_after_s")  # sent as Retry-After (503)
        if fields:
            raise TypeError(f"unknown OpenAIError fields: {sorted(fields)}")

    def __reduce__(self):
        kwargs = dict(status_code=self.status_code, type=self.type, param=self.param, code=self.code,
                      retry_after_s=self.retry_after_s)
        return _rebuild_error, (type(self), self.message, kwargs)

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


def _rebuild_error(cls, message: str, kwargs: dict) -> OpenAIError:
    return cls(message, **kwargs)


class BadRequestError(OpenAIError):
    """400: the request is invalid (`param` names the field)."""


class ModelNotFoundError(OpenAIError):
    """404: the request names a model this server does not serve."""

    _defaults = {"status_code": 404, "param": "model", "code": "model_not_found"}


class AuthenticationError(OpenAIError):
    """401: no API key, or not one of the configured keys."""

    _defaults = {"status_code": 401, "code": "invalid_api_key"}


class ServiceUnavailableError(OpenAIError):
    """503: the engine's queue is full (or the engine is restarting); retry after `retry_after_s`."""

    _defaults = {"status_code": 503, "type": "server_error", "code": "overloaded"}


class InternalServerError(OpenAIError):
    """The request failed inside the engine on its own (the server and other requests are fine)."""

    _defaults = {"status_code": 500, "type": "server_error", "code": "request_failed"}


class RequestTimeoutError(OpenAIError):
    """504: the request ran past its deadline (request_timeout_s) and was aborted."""

    _defaults = {"status_code": 504, "type": "server_error", "code": "timeout"}


class RequestTooLargeError(OpenAIError):
    """413: the request body is larger than max_request_body_bytes."""

    _defaults = {"status_code": 413, "code": "request_too_large"}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests ------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices).")


class _SamplingFields(BaseModel):
    """What completions and chat share. Unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(description="The served model id (GET /v1/models).")
    temperature: float | None = Field(None, description="0 = greedy. Default 1.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1]. Default 1.")
    top_k: int | None = Field(None, description="Extension: sample among the k most likely tokens (-1: all).")
    seed: int | None = Field(None, description="Makes sampling reproducible for this request.")
    stop: str | list[str] | None = Field(None, description="Stop strings (left out of the output).")
    n: int = Field(1, ge=1, le=MAX_N, description=f"Choices per request (1 to {MAX_N}); they share the prompt's KV "
                   "blocks, and choice i samples with seed + i when seed is set.")
    stream: bool = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="End-user id; also the session id when x-session-id is absent.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    presence_penalty: float = Field(0.0, description="Not supported; must be 0.")
    frequency_penalty: float = Field(0.0, description="Not supported; must be 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be absent.")
    # Output constraints (at most one per request; structured.py maps them to the grammar engine)
    response_format: ResponseFormat | None = Field(None, description="text, json_object, or json_schema with "
                                                   "a schema the output follows.")
    structured_outputs: StructuredOutputsParams | None = Field(None, description="vLLM's extension: one of "
                                                               "json, regex, choice, grammar, json_object.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="vLLM's older name of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="vLLM's older name of structured_outputs.grammar.")

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise FieldError(name, f"{name} is not supported (got {getattr(self, name)}); leave it at 0")
        if self.logit_bias:
            raise FieldError("logit_bias", "logit_bias is not supported; leave it out")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class FieldError(ValueError):
    """A model-level validation error that names its field, relative to the model that raises it
    (errors.bad_request_from puts the model's location in front: messages[2].tool_call_id)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] = Field(description="One prompt: text, or a list of token ids.")
    max_tokens: int = Field(16, description="Most tokens to generate (>= 0; 0 with echo: the prompt only, "
                            "e.g. to score it). Default 16, as OpenAI's.")
    logprobs: int | None = Field(None, description="Log-probabilities of the sampled token and this many "
                                 "alternatives (0-20); with echo, of the prompt's tokens too.")
    echo: bool = Field(False, description="Return the prompt before the completion (and, with logprobs, the "
                       "prompt tokens' log-probabilities, the first one null), as OpenAI's and vLLM's servers do.")
    suffix: str | None = Field(None, description="Not supported; must be absent.")
    best_of: int | None = Field(None, description="Not supported beyond 1.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise ValueError(f"got a batch of {len(v)} prompts; send one prompt (a string or a list of "
                                 "token ids) per request")
            v = v[0]  # a batch of one is that prompt
        if v == "" or v == []:
            raise ValueError("prompt must not be empty")
        if not isinstance(v, str) and not (isinstance(v, list) and all(_is_int(t) for t in v)):
            raise ValueError(f"prompt must be a string or a list of integer token ids (got {_short(v)})")
        return v

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported; leave it out")
        if self.best_of not in (None, 1):
            raise FieldError("best_of", f"best_of must be 1 (got {self.best_of})")
        return self


class TextContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = Field(None, description="An assistant message's calls (its "
                                                     "content may be null).")
    tool_call_id: str | None = Field(None, description="A tool message: the id of the call it answers.")

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("tool_call_id", "a tool message needs tool_call_id: the id of the assistant's call "
                             "it answers")
        if self.tool_calls and self.role != "assistant":  # (some clients send [] on every message)
            raise FieldError("tool_calls", f"only assistant messages carry tool_calls (this one is {self.role!r})")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" and not isinstance(part, TextContentPart):
                    raise ValueError(f"only text content parts are supported (got {kind!r})")
        elif v is not None and not isinstance(v, str):
            raise ValueError(f"content must be a string or a list of text parts (got {_short(v)})")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. The chat template of the model's tokenizer makes the prompt."""

    messages: list[ChatMessage] = Field(description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, description="Most tokens to generate (>= 1). Default: "
                                              "what the context leaves after the prompt.")
    max_tokens: int | None = Field(None, description="Deprecated name of max_completion_tokens (which wins).")
    logprobs: bool = Field(False, description="Return the sampled tokens' log-probabilities.")
    top_logprobs: int | None = Field(None, description="Alternatives per token (0-20); needs logprobs.")
    tools: list[ChatCompletionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, or "
                                           '{"type": "function", "function": {"name": ...}}.')
    parallel_tool_calls: bool = Field(True, description="false: at most one call per message.")

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools_consistent(self):
        names: dict[str, int] = {}
        for i, tool in enumerate(self.tools or ()):
            name = tool.function.name
            if name in names:
                raise FieldError(f"tools[{i}].function.name", f"tools[{names[name]}] and tools[{i}] are both named "
                                 f"{name!r}; give each tool its own name")
            names[name] = i
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise FieldError("tool_choice", f"tool_choice {_short(_choice_text(choice))} needs tools; send the "
                             "functions in tools, or leave tool_choice out")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names the function {choice.function.name!r}, which is not "
                             f"among the tools ({', '.join(map(repr, names))})")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_messages(self) -> list[dict]:
        """The messages as chat templates take them (Hugging Face's shape): text content; an
        assistant's tool_calls with their arguments parsed; a tool message's tool_call_id."""
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls is not None:
                d["tool_calls"] = [call.template_dict() for call in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


def _choice_text(choice) -> str:
    return choice if isinstance(choice, str) else f"{{function: {choice.function.name}}}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


# -- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"


class _Response(BaseModel):
    """What every response and stream chunk starts with (stream chunks of one request share the id)."""

    id: str
    created: int = Field(default_factory=_now)
    model: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    """One SSE chunk; with include_usage every chunk has usage null but the last (choices [])."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class _ToolCallsOmittedWhenNone(BaseModel):
    """A message whose tool_calls field is left out of the JSON when None (OpenAI's shape)."""

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatResponseMessage(_ToolCallsOmittedWhenNone):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the message is tool calls only
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_ToolCallsOmittedWhenNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None  # left out of the JSON when None


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "app"
    root: str | None = Field(None, description="What the engine loaded (model path or built-in name).")
    max_model_len: int = Field(description="Longest prompt + output in tokens, as vLLM reports it.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
