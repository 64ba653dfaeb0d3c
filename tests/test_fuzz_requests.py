"""Fuzzed request bodies, generated from the API's own JSON schemas (hypothesis-jsonschema), through
the handle API's operations (OpenAIServing, what the HTTP routes call) on a fake LLMServer: every
body gets either a response or an OpenAIError with a 4xx status; nothing else escapes, no 5xx. The
fake stands in for the replica only (tests/test_handle_serving.py); the engine's side of bad
input is tested in test_engine.py, test_async_engine.py and test_http_errors.py.

Tool calling and output constraints get their own bodies (bench/request_fuzz.py's tool_bodies:
tools, tool_choice, tool history, response_format, structured_outputs, guided_*), answered by a
replica that writes tool calls (tests/tools_testing.py): a constraint the engine's check
(check_structured_outputs) refuses is a 400, one it accepts reaches the replica."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings

from app.deployments.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from app.deployments.serving import OpenAIServing
from bench.request_fuzz import bodies, tool_bodies
from tests.test_handle_serving import BLOCK_SIZE, FakeLLMServer
from tests.tools_testing import ScriptedLLMServer

def _run(serving, operation, body) -> None:
    async def consume():
        return [item async for item in operation(body)]

    try:
        items = asyncio.run(consume())
    except OpenAIError as e:
        assert 400 <= e.status_code < 500, (e.status_code, e.message, body)
        assert e.message
        return
    assert items, body


@pytest.fixture(scope="module")
def serving():
    return OpenAIServing(FakeLLMServer(), {"engine": {"block_size": BLOCK_SIZE}})


@pytest.fixture(scope="module")
def tool_serving():
    calls = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\ntext <tool_call>{"bad"'
    return OpenAIServing(ScriptedLLMServer(calls, [3, 1, 5]), {})


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies(CompletionRequest))
def test_fuzzed_completion_bodies_get_a_response_or_a_4xx(serving, body):
    _run(serving, serving.completions, body)


@FUZZ
@given(body=bodies(ChatCompletionRequest))
def test_fuzzed_chat_bodies_get_a_response_or_a_4xx(serving, body):
    _run(serving, serving.chat, body)


@FUZZ
@given(body=tool_bodies())
def test_fuzzed_tool_bodies_get_a_response_or_a_4xx(tool_serving, body):
    _run(tool_serving, tool_serving.chat, body)
