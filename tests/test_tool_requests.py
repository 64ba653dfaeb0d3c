"""Tool calling and structured outputs at the ingress, before any engine: which request fields are
accepted, what StructuredOutputs each maps to (app/deployments/structured.py), the structural tags
that force tool calls (compiled and run by xgrammar's matcher here: what they accept parses back to
the calls), and the 400s that name the field, through OpenAIServing (the handle API's operations)
on a scripted replica that must never be called for them. What needs the engine's grammar
(constrained generation, its check of schemas, regexes and grammars) is in test_tools_e2e.py."""

import asyncio
import json

import pytest
from pydantic import BaseModel

from app.deployments.protocol import BadRequestError, ChatCompletionRequest, CompletionRequest
from app.deployments.errors import parse_request
from app.deployments.serving import OpenAIServing
from app.deployments.structured import Constraint, request_constraint
from app.deployments.tool_formats import FORMATS, pick_format
from app.deployments.tool_parsers import make_parser, parse_message
from app.engine.tokenizer import DEFAULT_CHAT_TEMPLATE
from tests.tools_testing import CALCULATOR, HERMES_TEMPLATE, LOOKUP, ScriptedLLMServer

MODEL = "tiny-llama"
USER = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": MODEL, "messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": MODEL, "prompt": "Answer:", **fields})


HERMES = FORMATS["hermes"]


@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("response_format", "json_object", True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}},
     Constraint("response_format", "json", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     Constraint("response_format", "json_object", True)),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("structured_outputs.json", "json",
                                                          json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, Constraint("structured_outputs.json", "json",
                                                                      json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Constraint("structured_outputs.regex", "regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint("structured_outputs.choice", "choice", ("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"+'}}, Constraint("structured_outputs.grammar", "grammar",
                                                                     'root ::= "a"+')),
    ({"structured_outputs": {"json_object": True}}, Constraint("structured_outputs.json_object", "json_object", True)),
    ({"guided_json": SCHEMA}, Constraint("guided_json", "json", json.dumps(SCHEMA))),
    ({"guided_regex": "a|b"}, Constraint("guided_regex", "regex", "a|b")),
    ({"guided_choice": ["a", "b"]}, Constraint("guided_choice", "choice", ("a", "b"))),
    ({"guided_grammar": 'root ::= "x"'}, Constraint("guided_grammar", "grammar", 'root ::= "x"')),
])
def test_output_constraints_map_to_one_structured_outputs_field(fields, expected):
    assert request_constraint(chat(**fields), HERMES) == expected
    assert request_constraint(completion(**fields)) == expected  # completions take the same fields


def test_the_openai_clients_parse_helper_request_is_accepted():
    """client.chat.completions.parse(response_format=Model) sends the model's strict schema
    (openai's own conversion, $defs and all) as json_schema with strict: true."""
    from openai.lib._parsing._completions import type_to_response_format_param

    class Step(BaseModel):
        explanation: str
        output: str

    class Plan(BaseModel):
        steps: list[Step]
        final_answer: str

    response_format = type_to_response_format_param(Plan)
    request = chat(response_format=response_format)
    c = request_constraint(request, HERMES)
    assert c.kind == "json" and json.loads(c.value) == response_format["json_schema"]["schema"]
    # the handle API revalidates objects: the aliased `schema` survives the round trip
    assert request_constraint(parse_request(ChatCompletionRequest, request), HERMES) == c


def test_tools_without_a_forcing_choice_add_no_constraint():
    assert request_constraint(chat(tools=[CALCULATOR]), HERMES) is None  # auto
    assert request_constraint(chat(tools=[CALCULATOR], tool_choice="none"), HERMES) is None
    strict = {**CALCULATOR, "function": {**CALCULATOR["function"], "strict": True}}
    assert request_constraint(chat(tools=[strict], tool_choice="none"), HERMES) is None


# -- structural tags, run by xgrammar's matcher ----------------------------------------------

def tool_tag(fmt, tool_choice, tools, parallel=True):
    request = chat(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel)
    c = request_constraint(request, FORMATS[fmt])
    assert c.kind == "structural_tag" and json.loads(c.value)["type"] == "structural_tag"
    return c


@pytest.fixture(scope="module")
def matcher_for():
    """A function: structural tag JSON -> a fresh matcher over a byte vocabulary (+ a stop token)."""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"], vocab_type=xgr.VocabType.RAW,
                             stop_token_ids=[256])
    compiler = xgr.GrammarCompiler(info)

    def make(structural_tag: str):
        return xgr.GrammarMatcher(compiler.compile_structural_tag(structural_tag))

    return make


def accepts(matcher_for, c: Constraint, text: str) -> bool:
    """The constrained model can write `text` and then stop."""
    m = matcher_for(c.value)
    return m.accept_string(text) and m.accept_token(256)


def calls_text(fmt, *calls):
    return FORMATS[fmt].render_calls(list(calls))


FMTS = ["hermes", "llama3_json", "mistral"]
CALC = ("calculator", {"expression": "2+2"})
LOOK = ("lookup", {"key": "kv"})


@pytest.mark.parametrize("fmt", FMTS)
def test_required_forces_a_call_first_and_schema_valid_calls(matcher_for, fmt):
    c = tool_tag(fmt, "required", [CALCULATOR, LOOKUP])
    assert c.param == "tool_choice"
    for calls in ([CALC], [LOOK, CALC]):
        good = calls_text(fmt, *calls)
        assert accepts(matcher_for, c, good), good
        parsed = parse_message(make_parser(fmt), good).tool_calls
        assert [(t.name, json.loads(t.arguments)) for t in parsed] == calls  # what it forces parses back
    for bad in ("", "4", "Sure. " + calls_text(fmt, CALC), calls_text(fmt, ("lookup", {"key": "nope"})),
                calls_text(fmt, ("calculator", {"expression": 4})), calls_text(fmt, ("other", {}))):
        assert not accepts(matcher_for, c, bad), bad
    if fmt != "mistral":  # after the calls the model may write text and end (mistral: its list ends it)
        assert accepts(matcher_for, c, calls_text(fmt, CALC) + "\nDone.")
        assert parse_message(make_parser(fmt), calls_text(fmt, CALC) + "\nDone.").content == "Done."
    one = tool_tag(fmt, "required", [CALCULATOR, LOOKUP], parallel=False)
    assert accepts(matcher_for, one, calls_text(fmt, LOOK))
    assert not accepts(matcher_for, one, calls_text(fmt, LOOK, CALC))


@pytest.mark.parametrize("fmt", FMTS)
def test_a_named_function_forces_exactly_one_call_of_it(matcher_for, fmt):
    c = tool_tag(fmt, {"type": "function", "function": {"name": "lookup"}}, [CALCULATOR, LOOKUP])
    assert c.param == "tool_choice"
    assert accepts(matcher_for, c, calls_text(fmt, LOOK))
    for bad in (calls_text(fmt, CALC), calls_text(fmt, LOOK, LOOK), "text"):
        assert not accepts(matcher_for, c, bad), bad


@pytest.mark.parametrize("fmt", FMTS)
def test_strict_tools_under_auto_allow_text_or_valid_calls(matcher_for, fmt):
    strict = {**LOOKUP, "function": {**LOOKUP["function"], "strict": True}}
    c = tool_tag(fmt, "auto", [CALCULATOR, strict])
    assert c.param == "tools"
    assert accepts(matcher_for, c, "The answer is 4.")
    assert accepts(matcher_for, c, calls_text(fmt, LOOK))
    assert accepts(matcher_for, c, calls_text(fmt, ("calculator", {"anything": [1]})))  # not strict: any object
    assert not accepts(matcher_for, c, calls_text(fmt, ("lookup", {"key": "nope"})))
    if fmt == "hermes":
        assert accepts(matcher_for, c, "Let me look. " + calls_text(fmt, LOOK))


def test_tag_schemas_keep_their_property_order_and_name_each_tool():
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}]
    c = tool_tag("hermes", "required", tools)
    tag = json.loads(c.value)["format"]["tags"][0]
    assert tag["begin"] == '<tool_call>\n{"name": "f", "arguments": ' and tag["end"] == "}\n</tool_call>"
    assert list(tag["content"]["json_schema"]["properties"]) == ["b", "a"]  # the order the model writes them
    assert c.tool_schemas == (("tools[0].function.parameters", json.dumps(SCHEMA)),)


def test_the_parser_setting_auto_follows_the_chat_template():
    assert pick_format("auto", HERMES_TEMPLATE, True).name == "hermes"
    assert pick_format("auto", DEFAULT_CHAT_TEMPLATE, False).name == "hermes"  # the fallback's format
    assert pick_format("auto", "{{ tools }}[TOOL_CALLS]", True).name == "mistral"
    assert pick_format("auto", "{{ tools }}<|python_tag|>", True).name == "llama3_json"
    assert pick_format("mistral", HERMES_TEMPLATE, True).name == "mistral"


# -- 400s naming the field ---------------------------------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
NAMED_X = {"type": "function", "function": {"name": "x"}}


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "xml"}}, "response_format.type", ["json_schema"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["needs json_schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", ["'a b'"]),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", ["missing"]),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name", ["1 to 64"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", ["object"]),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ["function"]),
    ({"tools": [CALCULATOR, LOOKUP, CALCULATOR]}, "tools[2].function.name", ["tools[0] and tools[2]", "calculator"]),
    ({"tools": [CALCULATOR], "tool_choice": NAMED_X}, "tool_choice", ["'x'", "'calculator'"]),
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"tool_choice": NAMED_X}, "tool_choice", ["needs tools"]),
    ({"tools": [CALCULATOR], "tool_choice": "always"}, "tool_choice", ["'auto'"]),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "content": "4"}]}, "messages[2].tool_call_id", ["tool_call_id"]),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "calculator", "arguments": "{'expression': 1}"}}]}]},
     "messages[1].tool_calls[0].function.arguments", ["JSON"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls",
     ["only assistant"]),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}]},
     "messages[1].tool_calls[0].id", ["missing"]),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", ["response_format and "]),
    ({"tools": [CALCULATOR], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     ["response_format and tool_choice"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one", "got 2"]),
    ({"structured_outputs": {}}, "structured_outputs", ["exactly one", "got 0"]),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", ["got 0"]),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", ["Extra inputs"]),
    ({"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
    ({"guided_json": "[1, 2]"}, "guided_json", ["JSON object"]),
    ({"guided_choice": []}, "guided_choice", ["at least one"]),
    ({"guided_regex": ""}, "guided_regex", ["empty"]),
])
def test_bad_tool_and_format_fields_get_a_400_naming_the_field(body, param, words):
    server = ScriptedLLMServer()
    serving = OpenAIServing(server, {})

    async def run():
        return [item async for item in serving.chat({"model": MODEL, "messages": USER, **body})]

    with pytest.raises(BadRequestError) as e:
        asyncio.run(run())
    assert e.value.param == param, e.value.message
    assert all(w in e.value.message for w in words), e.value.message
    assert server.requests == []


def test_completions_refuse_two_constraints_too():
    serving = OpenAIServing(ScriptedLLMServer(), {})

    async def run():
        return [item async for item in serving.completions(
            {"model": MODEL, "prompt": "x", "guided_choice": ["a"], "structured_outputs": {"regex": "a"}})]

    with pytest.raises(BadRequestError) as e:
        asyncio.run(run())
    assert e.value.param == "guided_choice"
