"""Everything that can go wrong with a request, turned into the OpenAIError the API answers with.

Validation errors (pydantic) name the parameter as OpenAI does (`messages[0].content`); engine
errors (InvalidRequestError and subclasses: their messages start with the field name) become 400s,
a full queue a 503 with Retry-After. Errors from an LLMServer replica arrive wrapped in a
RayTaskError; the cause is what is converted.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ValidationError
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from app.deployments.protocol import (BadRequestError, InternalServerError, OpenAIError, RequestTimeoutError,
                                      ServiceUnavailableError)
from app.engine import errors as engine_errors
from app.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError

_LEADING_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")
# Engine / SamplingParams field names that are request parameters (an endpoint may rename them).
_REQUEST_FIELDS = frozenset(("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs"))
_TYPE_TAGS = frozenset(("str", "int", "float", "bool", "none"))


def to_openai_error(e: BaseException, fields: dict[str, str], retry_after_s: int) -> BaseException:
    """An exception from SamplingParams or an LLMServer call -> an OpenAIError; anything else is
    returned unchanged (a 500). `fields` maps engine field names to this endpoint's parameters."""
    cause = e.cause if isinstance(e, RayTaskError) and e.cause is not None else e
    if isinstance(cause, OpenAIError):
        return cause
    message = getattr(cause, "message", None) or (str(cause.args[0]) if cause.args else str(cause))
    if isinstance(cause, InvalidRequestError):
        m = _LEADING_NAME.match(message)
        name = m.group(1) if m and m.group(1) in _REQUEST_FIELDS else None
        return BadRequestError(message, param=fields.get(name, name) if name else None)
    if isinstance(cause, (EngineOverloadedError, BackPressureError)):
        return ServiceUnavailableError(f"the server is overloaded ({message}); retry later",
                                       retry_after_s=retry_after_s)
    if isinstance(cause, RequestFailedError):
        return InternalServerError(f"the request failed: {message}")
    if isinstance(cause, engine_errors.RequestTimeoutError):
        return RequestTimeoutError(message)
    if isinstance(cause, RayActorError):  # the replica process died: Ray's text names its pid, ip, actor id
        return ServiceUnavailableError("the engine replica serving this request went away; retry later",
                                       code="engine_unavailable", retry_after_s=retry_after_s)
    if isinstance(cause, DeploymentUnavailableError):  # its replicas failed to start (DEPLOY_FAILED)
        return ServiceUnavailableError("the model's replicas are not running: their deployment failed to start "
                                       "(`serve status` and the replica logs say why); retry later",
                                       code="engine_unavailable", retry_after_s=retry_after_s)
    if isinstance(cause, EngineDeadError):
        return ServiceUnavailableError(f"the engine is unavailable ({message}); retry later",
                                       code="engine_unavailable", retry_after_s=retry_after_s)
    return e


def parse_request(schema: type[BaseModel], request):
    """A request object or a dict -> a validated `schema` (or a BadRequestError naming the param).
    Objects are validated again: model_copy(update=...) and model_construct() skip validation."""
    if isinstance(request, BaseModel):
        request = request.model_dump(warnings=False)
    try:
        return schema.model_validate(request)
    except ValidationError as e:
        raise bad_request_from(e.errors()) from None


def bad_request_from(errors: list[dict]) -> BadRequestError:
    """pydantic errors -> one BadRequestError about the first (the message counts the others)."""
    err = errors[0]
    loc = list(err.get("loc", ()))
    field = getattr((err.get("ctx") or {}).get("error"), "field", None)  # a model validator's FieldError
    param = ".".join(p for p in (dotted(loc), field) if p) or None
    kind = err.get("type")
    message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        message, param = "the request body must be a JSON object", None
    elif kind == "missing":
        message = f"missing required parameter: {param}"
    elif param and not message.startswith(param.split(".")[0].split("[")[0]):
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return BadRequestError(message, param=param)


def dotted(loc: list) -> str:
    """("messages", 0, "content") -> "messages[0].content"; stops at a union member's tag ("str",
    "list[int]", a model name), which names a type rather than a field."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper():
            break
        else:
            out += f".{part}" if out else part
    return out
