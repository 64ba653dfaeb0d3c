"""The tool-call parsers (app/deployments/tool_parsers.py): exact results on many outputs, and the
streaming property: for every chunking of an output, the streamed events add up to the output
parsed in one piece (content and calls), which for hermes also equals an independent regex-based
parser. Outputs are drawn from pieces that break parsers: well-formed calls, several calls, text
before / between / after, malformed JSON, truncated and unclosed blocks, markers alone, markers
and brackets split across chunks, brackets inside JSON strings."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.deployments.tool_calls import ToolCallStream
from app.deployments.tool_formats import FORMATS
from app.deployments.tool_parsers import (
    ParsedMessage,
    ParsedToolCall,
    call_from_object,
    collect_events,
    make_parser,
    parse_message,
)

PARSERS = ["hermes", "llama3_json", "mistral"]


def call(name, **args):
    return ParsedToolCall(name, json.dumps(args))


def parse(name, text, max_calls=None):
    return parse_message(make_parser(name), text, max_calls)


def streamed(name, text, cuts, max_calls=None):
    parser = make_parser(name)
    events, start = [], 0
    for cut in sorted(cuts) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    return collect_events(events + parser.finish(), max_calls)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
WEATHER = call("get_weather", city="Paris", unit="C")


@pytest.mark.parametrize("text,content,calls", [
    (HERMES_CALL, None, [WEATHER]),
    ("Let me look.\n\n" + HERMES_CALL, "Let me look.", [WEATHER]),
    (HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo"), None,
     [WEATHER, call("get_weather", city="Oslo", unit="C")]),
    ("A\n" + HERMES_CALL + "\nB ", "A\n\nB ", [WEATHER]),  # whitespace around calls kept between content
    ("plain answer", "plain answer", []),
    ("  spaced \n", "  spaced \n", []),
    ("", "", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "f"}</tool_call>', None, [call("f")]),  # no arguments: {}
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [call("f", a=1)]),  # as a string
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', '<tool_call>{"name": "", "arguments": {}}</tool_call>',
     []),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": "</tool"}}', None, [call("f", a="</tool")]),  # unclosed, valid
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', '<tool_call>\n{"name": "f", "arguments": {"a": 1', []),
    ("x </tool_call> y", "x </tool_call> y", []),
    ("<tool_", "<tool_", []),
    ('<tool_call>{"name": "f", "parameters": {"b": true}}</tool_call>', None, [call("f", b=True)]),
])
def test_hermes(text, content, calls):
    assert parse("hermes", text) == ParsedMessage(content, calls)


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'


@pytest.mark.parametrize("text,content,calls", [
    (LLAMA_CALL, None, [WEATHER]),
    ("<|python_tag|>" + LLAMA_CALL, None, [WEATHER]),
    ("\n " + LLAMA_CALL + " ;\n" + LLAMA_CALL.replace("Paris", "Oslo") + ";", None,
     [WEATHER, call("get_weather", city="Oslo", unit="C")]),
    (LLAMA_CALL + "\nThat is all.", "That is all.", [WEATHER]),
    (LLAMA_CALL + '; {"name": 3}', '{"name": 3}', [WEATHER]),
    ("It is sunny. " + LLAMA_CALL, "It is sunny. " + LLAMA_CALL, []),  # calls only at the start
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('{"name": "f", "parameters": {"a": "}{"}}', None, [call("f", a="}{")]),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    ("  ", "  ", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|python", "<|python", []),
])
def test_llama3_json(text, content, calls):
    assert parse("llama3_json", text) == ParsedMessage(content, calls)


MISTRAL_CALLS = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                 '{"name": "f", "arguments": {}}]')


@pytest.mark.parametrize("text,content,calls", [
    (MISTRAL_CALLS, None, [WEATHER, call("f")]),
    ("Checking. " + MISTRAL_CALLS + " Done.", "Checking.  Done.", [WEATHER, call("f")]),
    (MISTRAL_CALLS.removeprefix("[TOOL_CALLS]"), None, [WEATHER, call("f")]),  # the special token was skipped
    (" " + MISTRAL_CALLS.removeprefix("[TOOL_CALLS]"), None, [WEATHER, call("f")]),
    ("[link](https://example.com)", "[link](https://example.com)", []),
    ("[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}', '[TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}', []),
    ("x [TOOL_CALL", "x [TOOL_CALL", []),
])
def test_mistral(text, content, calls):
    assert parse("mistral", text) == ParsedMessage(content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call_in_both_modes():
    text = HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo")
    assert parse("hermes", text, max_calls=1) == ParsedMessage(None, [WEATHER])
    stream = ToolCallStream(make_parser("hermes"), 1)
    deltas = [d for ch in text for d in stream.deltas(ch, False)] + stream.deltas("", True)
    assert [tc.function.name for d in deltas for tc in d.tool_calls or () if tc.id] == ["get_weather"]


def test_arguments_are_compact_json_objects():
    c = call_from_object({"name": "f", "arguments": {"b": [1, 2], "a": "é"}})
    assert c == ParsedToolCall("f", '{"b": [1, 2], "a": "é"}') and json.loads(c.arguments) == {"b": [1, 2], "a": "é"}
    assert call_from_object({"name": "f", "arguments": "not json"}) is None
    deep = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError: not a call, no crash
    assert parse("hermes", f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>').tool_calls == []


# -- the streaming property ------------------------------------------------------------------

NAMES = st.sampled_from(["get_weather", "f", "lookup-2", "calc_x"])
JSON_LEAF = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(
    alphabet=st.sampled_from('ab "\\{}[]<>/;,:\n\tée_'), max_size=8)
ARGS = st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=5),
                       st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(alphabet="abc", max_size=3), inner, max_size=3),
                                    max_leaves=6), max_size=3)
WS = st.sampled_from(["", "", " ", "\n", "\n\n", " \n "])
TEXT = st.lists(st.sampled_from(list("ab .,!\n ") + ["<", ">", "{", "}", "[", "]", '"', ";", "/", "<tool",
                                                     "</tool_call", "[TOOL", '{"name"', "<|python"]),
                max_size=8).map("".join)


def rendered_call(fmt, name, args, ws):
    text = FORMATS[fmt].render_call(name, args)
    if fmt == "hermes":  # the model's own whitespace inside the block
        text = text.replace("<tool_call>\n", "<tool_call>" + ws).replace("\n</tool_call>", ws + "</tool_call>")
    return text


@st.composite
def outputs(draw, fmt):
    """A model output in `fmt`'s style: a start, then pieces."""
    pieces = []
    if fmt == "llama3_json":  # calls count only at the start: start with one most of the time
        pieces.append(draw(st.sampled_from(["", "", "<|python_tag|>", " ", "Sure. "])))
        if draw(st.booleans()):
            pieces.append(rendered_call(fmt, draw(NAMES), draw(ARGS), ""))
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["call", "call", "text", "ws", "broken", "truncated", "marker"]))
        name, args, ws = draw(NAMES), draw(ARGS), draw(WS)
        good = rendered_call(fmt, name, args, ws)
        if fmt == "mistral" and kind in ("call", "broken", "truncated"):
            calls = [good] + [rendered_call(fmt, draw(NAMES), draw(ARGS), "")
                              for _ in range(draw(st.integers(0, 2)))]
            good = "[TOOL_CALLS][" + ", ".join(calls) + "]"
        if fmt == "llama3_json" and kind in ("call", "broken", "truncated") and pieces:
            good = draw(st.sampled_from(["; ", ";", "\n", " ; "])) + good
        if kind == "call":
            pieces.append(good)
        elif kind == "text":
            pieces.append(draw(TEXT))
        elif kind == "ws":
            pieces.append(ws or " ")
        elif kind == "broken":  # one character dropped or doubled
            i = draw(st.integers(0, len(good) - 1))
            pieces.append(good[:i] + draw(st.sampled_from(["", good[i] * 2, '"', "}"])) + good[i + 1:])
        elif kind == "truncated":
            pieces.append(good[:draw(st.integers(1, len(good)))])
        else:
            pieces.append(draw(st.sampled_from(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"])))
    return "".join(pieces)


def cuts_of(text):
    return st.lists(st.integers(0, len(text)), max_size=min(len(text), 40), unique=True)


PROPERTY = settings(max_examples=400, deadline=None)


def reference_hermes(text: str) -> ParsedMessage:
    """hermes by regular expressions: a block runs from <tool_call> to the next </tool_call> (or the
    end); whitespace around calls is dropped unless it lies between two pieces of content."""
    items = []  # text pieces (str) and calls
    for k, part in enumerate(re.split(r"(<tool_call>.*?(?:</tool_call>|\Z))", text, flags=re.S)):
        c = None
        if k % 2:
            try:
                obj = json.loads(part[len("<tool_call>"):].removesuffix("</tool_call>"),
                                 parse_constant=lambda s: 1 / 0)
            except (ValueError, ZeroDivisionError, RecursionError):
                obj = None
            c = call_from_object(obj)
        if c is not None:
            items.append(c)
        elif items and isinstance(items[-1], str):
            items[-1] += part
        else:
            items.append(part)
    content, gap, calls = "", "", []
    for k, item in enumerate(items):
        if isinstance(item, ParsedToolCall):
            calls.append(item)
            continue
        before = k > 0
        after = k + 1 < len(items)
        core = item
        if before:
            stripped = core.lstrip()
            gap += core[:len(core) - len(stripped)]
            core = stripped
        if after:
            trailing = core[len(core.rstrip()):]
            core = core.rstrip()
        if core:
            content += (gap if content else "") + core
            gap = ""
        if after:
            gap += trailing
    return ParsedMessage(None if calls and not content else content, calls)


@PROPERTY
@given(data=st.data())
def test_hermes_streamed_equals_whole_equals_reference(data):
    text = data.draw(outputs("hermes"))
    whole = parse("hermes", text)
    assert whole == reference_hermes(text), text
    assert streamed("hermes", text, data.draw(cuts_of(text))) == whole, text
    assert all(isinstance(json.loads(c.arguments), dict) for c in whole.tool_calls)


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
@PROPERTY
@given(data=st.data())
def test_streamed_equals_whole(fmt, data):
    text = data.draw(outputs(fmt))
    whole = parse(fmt, text)
    assert streamed(fmt, text, data.draw(cuts_of(text))) == whole, text
    assert all(isinstance(json.loads(c.arguments), dict) for c in whole.tool_calls)


@pytest.mark.parametrize("fmt", PARSERS)
@PROPERTY
@given(data=st.data())
def test_the_stream_of_deltas_adds_up_to_the_message(fmt, data):
    """What a client receives: OpenAI deltas (first {index, id, type, name, arguments ""}, then the
    arguments), accumulated by index, equal the non-streamed message, for any chunking."""
    from app.deployments.tool_calls import response_message

    text = data.draw(outputs(fmt))
    limit = data.draw(st.sampled_from([None, 1]))
    stream = ToolCallStream(make_parser(fmt), limit)
    cuts, start, deltas = sorted(data.draw(cuts_of(text))) + [len(text)], 0, []
    for k, cut in enumerate(cuts):
        deltas += stream.deltas(text[start:cut], k == len(cuts) - 1)
        start = cut
    content, calls = "", {}
    for d in deltas:
        content += d.content or ""
        for tc in d.tool_calls or ():
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                calls[tc.index][1] += tc.function.arguments
    message = response_message(make_parser(fmt), text, limit)
    assert content == (message.content or "")
    assert [tuple(calls[i]) for i in range(len(calls))] == [(c.function.name, c.function.arguments)
                                                            for c in message.tool_calls or ()]


def test_every_format_parses_back_what_it_renders():
    for fmt in PARSERS:
        calls = [("calc", {"expression": "2 * (3 + 4)"}), ("lookup", {"key": "paris", "n": [1, {"a": None}]})]
        text = FORMATS[fmt].render_calls(calls)
        assert parse(fmt, text) == ParsedMessage(None, [ParsedToolCall(n, json.dumps(a)) for n, a in calls]), fmt


def test_a_long_call_fed_token_by_token_is_linear():
    """A 60 kB argument fed a few characters at a time: the scanners resume where they stopped."""
    import time

    big = {"data": "x" * 60_000}
    for fmt in PARSERS:
        text = FORMATS[fmt].render_calls([("f", big)])
        start = time.perf_counter()
        parser = make_parser(fmt)
        events = [e for i in range(0, len(text), 3) for e in parser.feed(text[i:i + 3])] + parser.finish()
        assert collect_events(events).tool_calls == [ParsedToolCall("f", json.dumps(big))]
        assert time.perf_counter() - start < 2.0, fmt

