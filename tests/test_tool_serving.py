"""Tool calls in chat responses through OpenAIServing (the handle API's operations) on a scripted
replica that answers with a given text in given pieces: the message's shape (tool_calls, content,
finish_reason), the streamed deltas' shape, and streamed == non-streamed for every way the
replica cuts the text; tool_choice none parses nothing; the prompt a replica gets carries the
tools. The scripted replica stands in for the engine only (no constraint is involved here)."""

import asyncio
import json

import pytest

from app.deployments.protocol import ChatCompletionResponse, ChatCompletionStreamResponse
from app.deployments.serving import OpenAIServing
from app.deployments.tool_formats import FORMATS
from tests.tools_testing import CALCULATOR, LOOKUP, ScriptedLLMServer

CALC = FORMATS["hermes"].render_call("calculator", {"expression": "2+2"})
LOOK = FORMATS["hermes"].render_call("lookup", {"key": "kv"})
OUTPUT = f"I will compute it.\n{CALC}\n{LOOK}\n"
BODY = {"model": "tiny-llama", "messages": [{"role": "user", "content": "2+2? And kv?"}],
        "tools": [CALCULATOR, LOOKUP]}


def run(serving, body):
    async def go():
        return [item async for item in serving.chat(body)]

    return asyncio.run(go())


def serving_for(text, pieces=None, finish_reason="stop", **config):
    server = ScriptedLLMServer(text, pieces, finish_reason)
    return OpenAIServing(server, config), server


def test_a_response_with_calls():
    serving, _ = serving_for(OUTPUT)
    [resp] = run(serving, BODY)
    assert isinstance(resp, ChatCompletionResponse)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "I will compute it."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("function", "calculator", {"expression": "2+2"}), ("function", "lookup", {"key": "kv"})]
    assert all(c.id.startswith("call_") and len(c.id) > 12 for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == 2
    data = resp.model_dump(mode="json")["choices"][0]["message"]
    assert data["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "2+2"}'}


def test_a_response_without_calls_is_plain():
    serving, _ = serving_for("It is 4.")
    [resp] = run(serving, BODY)
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content == "It is 4."
    assert "tool_calls" not in resp.model_dump(mode="json")["choices"][0]["message"]
    serving, _ = serving_for(CALC, finish_reason="length")  # out of tokens: the reason stays
    assert run(serving, BODY)[0].choices[0].finish_reason == "length"


def test_tool_choice_none_parses_nothing_and_offers_nothing():
    serving, server = serving_for(OUTPUT)
    [resp] = run(serving, {**BODY, "tool_choice": "none"})
    assert resp.choices[0].message.content == OUTPUT and resp.choices[0].finish_reason == "stop"
    prompt = serving.tokenizer.decode(server.requests[0].prompt_token_ids)
    assert "calculator" not in prompt


def test_the_prompt_carries_the_tools_and_the_history():
    """tiny-llama's default template takes no tools: the fallback system message."""
    serving, server = serving_for("ok")
    history = [{"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_9", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "kv"}'}}]},
               {"role": "tool", "tool_call_id": "call_9", "content": "the KV cache"}]
    run(serving, {**BODY, "messages": BODY["messages"] + history})
    prompt = serving.tokenizer.decode(server.requests[0].prompt_token_ids)
    assert prompt.startswith("<|system|>\n# Tools")
    assert json.dumps(CALCULATOR) in prompt and "<tool_call>" in prompt
    assert f"<|assistant|>\n{LOOK}\n<|user|>\n<tool_response>\nthe KV cache\n</tool_response>\n<|assistant|>\n" in prompt


def accumulate(chunks):
    """What a client makes of a stream: per choice, content, calls [name, arguments] and finish_reason."""
    out = {}
    for chunk in chunks:
        assert isinstance(chunk, ChatCompletionStreamResponse)
        for choice in chunk.choices:
            acc = out.setdefault(choice.index, {"content": "", "calls": [], "finish_reason": None, "role": None})
            delta = choice.delta
            acc["role"] = acc["role"] or delta.role
            acc["content"] += delta.content or ""
            for tc in delta.tool_calls or ():
                if tc.id is not None:
                    assert tc.index == len(acc["calls"]) and tc.type == "function"
                    assert tc.function.name and tc.function.arguments == ""
                    acc["calls"].append([tc.function.name, ""])
                else:
                    assert tc.function.name is None
                    acc["calls"][tc.index][1] += tc.function.arguments
            if choice.finish_reason is not None:
                assert acc["finish_reason"] is None
                acc["finish_reason"] = choice.finish_reason
    return out


@pytest.mark.parametrize("pieces", [[1], [2], [3], [5, 1], [7, 2, 11], [10_000]])
@pytest.mark.parametrize("n", [1, 2])
def test_the_stream_adds_up_to_the_response_for_any_cut(pieces, n):
    serving, _ = serving_for(OUTPUT, pieces)
    [resp] = run(serving, {**BODY, "n": n})
    chunks = run(serving, {**BODY, "n": n, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    streamed = accumulate(chunks[:-1])
    for choice in resp.choices:
        got = streamed[choice.index]
        assert got["role"] == "assistant" and got["finish_reason"] == choice.finish_reason == "tool_calls"
        assert got["content"] == choice.message.content
        assert got["calls"] == [[c.function.name, c.function.arguments] for c in choice.message.tool_calls]


def test_stream_chunks_serialize_as_openai_sends_them():
    serving, _ = serving_for(CALC, [4])
    chunks = run(serving, {**BODY, "stream": True})
    deltas = [json.loads(c.model_dump_json())["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [[{"index": 0, "id": calls[0][0]["id"], "type": "function",
                       "function": {"name": "calculator", "arguments": ""}}],
                     [{"index": 0, "function": {"arguments": '{"expression": "2+2"}'}}]]
    assert json.loads(chunks[-1].model_dump_json())["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_returns_one_call_streamed_or_not():
    serving, _ = serving_for(OUTPUT, [3])
    body = {**BODY, "parallel_tool_calls": False}
    [resp] = run(serving, body)
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["calculator"]
    assert accumulate(run(serving, {**body, "stream": True}))[0]["calls"] == [["calculator",
                                                                               '{"expression": "2+2"}']]


def test_the_parser_setting_applies():
    text = '{"name": "lookup", "parameters": {"key": "fp4"}}'
    serving, _ = serving_for(text, tool_call_parser="llama3_json")
    [resp] = run(serving, BODY)
    assert resp.choices[0].message.tool_calls[0].function.arguments == '{"key": "fp4"}'
    serving, _ = serving_for(text)  # hermes: that is content
    assert run(serving, BODY)[0].choices[0].message.content == text
