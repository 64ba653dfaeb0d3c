"""Request bodies fuzzed from the API's own JSON schemas (hypothesis-jsonschema over the pydantic
models the ingress validates with), shared by tests/test_fuzz_requests.py and bench/chaos.py.

`bodies(model_cls)` is a hypothesis strategy: schema-valid bodies (half naming the served model),
with fields added or replaced by JSON of any shape. `tool_bodies()` are chat bodies that always
carry tool and output-constraint fields, from those fields' own schemas (tools, tool_choice naming
one of them or not, assistant tool_calls and tool messages, response_format, structured_outputs,
guided_*), which whole-body generation rarely reaches. `draw(n, seed)` draws n of them (a quarter
tool bodies), alternating endpoints, outside a test, for a load generator.
"""

from __future__ import annotations

import json
import random

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from app.deployments.protocol import ChatCompletionRequest, CompletionRequest, ChatMessage
from app.deployments.protocol_tools import ChatCompletionTool, ResponseFormat, StructuredOutputsParams

MODEL = "tiny-llama"
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

# JSON of any shape, to mix in with schema-shaped bodies (wrong types, unknown fields)
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                    max_size=4), max_leaves=12)


def bodies(model_cls, model: str = MODEL):
    """Schema-valid bodies (half of them naming `model`), with random extra or replaced fields."""
    schema = from_schema(model_cls.model_json_schema())
    fields = list(model_cls.model_fields)
    return st.tuples(schema, st.booleans(), st.dictionaries(st.sampled_from(fields + ["junk"]), ANY_JSON,
                                                             max_size=2)).map(
        lambda t: {**t[0], **({"model": model} if t[1] else {}), **t[2]})


def _schema(model_cls):
    return from_schema(model_cls.model_json_schema())


@st.composite
def tool_bodies(draw, model: str = MODEL):
    """Chat bodies with tools, tool_choice, tool history and output constraints (see the docstring)."""
    tools = draw(st.lists(_schema(ChatCompletionTool), max_size=3))
    names = [t["function"]["name"] for t in tools] + ["missing_fn"]
    choice = draw(st.sampled_from(["auto", "none", "required", "named", "absent"]))
    history = [_mostly_valid(draw, m) for m in draw(st.lists(_schema(ChatMessage), min_size=1, max_size=4))]
    if draw(st.booleans()):  # a call and its result
        arguments = json.dumps(draw(st.dictionaries(st.text(max_size=5), ANY_JSON, max_size=3)))
        history += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_0", "type": "function", "function": {"name": names[0], "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_0", "content": draw(st.text(max_size=20))}]
    body = {"model": model, "messages": history, "tools": tools, "max_tokens": draw(st.integers(1, 8))}
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": draw(st.sampled_from(names))}}
    elif choice != "absent":
        body["tool_choice"] = choice
    body["parallel_tool_calls"] = draw(st.booleans())
    extra = draw(st.sampled_from(["", "", "response_format", "structured_outputs", "guided_json", "guided_regex",
                                  "guided_choice"]))
    if extra == "response_format":
        body[extra] = draw(_schema(ResponseFormat))
    elif extra == "structured_outputs":
        body[extra] = draw(_schema(StructuredOutputsParams))
    elif extra:
        body[extra] = draw(from_schema(ChatCompletionRequest.model_json_schema()["properties"][extra]))
    body["stream"] = draw(st.booleans())
    return body


def _mostly_valid(draw, message: dict) -> dict:
    """Most of the time, what the schema cannot say: a tool message has a tool_call_id, only an
    assistant carries tool_calls, whose arguments are JSON."""
    if draw(st.integers(0, 9)) == 9:  # the simplest draw (0) repairs
        return message
    message = dict(message)
    if message["role"] == "tool" and not message.get("tool_call_id"):
        message["tool_call_id"] = "call_0"
    if message["role"] != "assistant":
        message.pop("tool_calls", None)
    for call in message.get("tool_calls") or ():
        call["function"]["arguments"] = json.dumps(draw(st.dictionaries(st.text(max_size=5), ANY_JSON, max_size=3)))
    return message


def draw(n: int, seed: int = 0, model: str = MODEL) -> list[tuple[str, object]]:
    """n (path, JSON body) pairs, alternating endpoints, in a seeded order; a quarter of them are
    tool bodies."""
    num_tool = n // 4
    num_each = (n - num_tool + 1) // 2
    out: list[tuple[str, object]] = []
    for path, strategy, count in [(path, bodies(model_cls, model), num_each) for path, model_cls in ENDPOINTS.items()] \
            + [("/v1/chat/completions", tool_bodies(model), num_tool)]:
        drawn: list = []

        @settings(max_examples=max(count, 1), database=None, deadline=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(body=strategy)
        def collect(body):
            drawn.append(body)

        collect()
        out.extend((path, b) for b in drawn[:count])
    random.Random(seed).shuffle(out)
    return out[:n]
