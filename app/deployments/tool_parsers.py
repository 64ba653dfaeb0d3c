"""Tool calls parsed out of a model's text, incrementally: one state machine per format.

A parser takes the generated text in pieces (`feed`, then `finish` once the output is complete)
and returns events: content text (what is outside the calls) and complete calls. It decides a
piece of text only once no later text can change the decision, so the events do not depend on
how the text was cut: any chunking gives the same content and the same calls as the whole text
in one piece (tests/test_tool_parsers.py checks this over random chunkings). A call is emitted
only once it is complete and its JSON is valid, so a client never sees a call that the final
message does not have; a block that turns out malformed is content, as written.

Formats (the `tool_call_parser` setting):

- hermes (Hermes, Qwen 2.5, the fallback for templates without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, text around them.
  A block left open when the output ends is a call if its JSON is a complete call.
- llama3_json (Llama 3.1/3.2): the whole output is `<|python_tag|>`? then one or more
  `{"name": ..., "parameters": {...}}` separated by `;`. Text after the calls is content; an
  output that does not start with a valid call is content.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, text before it. The marker is a
  special token that the detokenizer skips, so an array of calls at the very start of the output
  counts as if the marker were there.

Whitespace around calls is dropped at the start and at the end of the content (a model's newline
before `<tool_call>` is not content) and kept between two pieces of content; everything else is
content verbatim. Calls take
"arguments" or "parameters" (an object, or a string holding one; absent: {}); the arguments are
returned as compact JSON text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

ToolCallParserName = Literal["hermes", "llama3_json", "mistral"]


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


Event = str | ParsedToolCall  # content text, or a complete call


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str | None  # None when the output is calls only
    tool_calls: list[ParsedToolCall]


class ToolCallParser(ABC):
    """Incremental: `feed` each new piece of text, `finish` once at the end."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events decided by the text so far."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The remaining events, now that the output is complete."""


def parse_message(parser: ToolCallParser, text: str, max_calls: int | None = None) -> ParsedMessage:
    """A whole output at once (the non-streamed response): what a stream of it adds up to."""
    return collect_events(parser.feed(text) + parser.finish(), max_calls)


def collect_events(events: list[Event], max_calls: int | None = None) -> ParsedMessage:
    calls = [e for e in events if isinstance(e, ParsedToolCall)][:max_calls]
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedMessage(None if calls and not content else content, calls)


def make_parser(name: ToolCallParserName) -> ToolCallParser:
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}[name]()


# -- helpers ---------------------------------------------------------------------------------


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """Strict JSON (no NaN/Infinity); None when it is not JSON (or nests too deep to parse)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def call_from_object(obj) -> ParsedToolCall | None:
    """{"name": str, "arguments" | "parameters": object or JSON text of one} -> a call; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class JsonScanner:
    """Finds where the JSON object or array that starts at text[start] ends, over text that
    grows: `scan(text)` returns the index just past its closing bracket, or None while it is open.
    Brackets inside strings do not count; whether the text is valid JSON is for json.loads to say."""

    def __init__(self, text: str, start: int) -> None:
        self.open = text[start]
        assert self.open in "{[", self.open
        self.close = "}" if self.open == "{" else "]"
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == self.open:
                self.depth += 1
            elif c == self.close:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


# -- marked blocks (hermes, mistral) ---------------------------------------------------------


class _MarkedBlocks(ToolCallParser):
    """Content, and blocks that start with `marker`: a valid block is calls, an invalid one is
    content as written. Whitespace around calls (before a block, after one) waits in _gap and is
    kept only between two pieces of content."""

    marker: str
    bare_block_at_start = False  # mistral: a block at the start may lack its (skipped) marker

    def __init__(self) -> None:
        self._buf = ""  # text not decided yet
        self._in_block = False  # _buf starts with a block (at its marker, or a bare one)
        self._marker_len = 0  # of the current block: len(marker), or 0 for a bare block
        self._held_ws = ""  # whitespace before the current block
        self._after_call = False  # whitespace that follows a call goes to _gap
        self._gap = ""  # whitespace around calls since the last content: kept only between content
        self._has_content = False
        self._at_start = self.bare_block_at_start

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    @abstractmethod
    def _block_end(self, final: bool) -> int | None:
        """Where the block that _buf starts with ends (None: not known yet)."""

    @abstractmethod
    def _block_calls(self, body: str) -> list[ParsedToolCall] | None:
        """The calls of a block's text after its marker; None if it is not valid."""

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._in_block:
                end = self._block_end(final)
                if end is None:
                    return out
                block, self._buf = self._buf[:end], self._buf[end:]
                calls = self._block_calls(block[self._marker_len:])
                if calls is None:
                    self._content(out, self._held_ws + block)
                else:
                    self._gap += self._held_ws
                    out.extend(calls)
                self._after_call = calls is not None
                self._held_ws, self._in_block = "", False
                continue
            if self._after_call:
                stripped = self._buf.lstrip()
                self._gap += self._buf[:len(self._buf) - len(stripped)]
                self._buf = stripped
                if not self._buf:
                    return out
                self._after_call = False
            if self._at_start:
                stripped = self._buf.lstrip()
                may_be_marker = self.marker.startswith(stripped[:len(self.marker)])
                if may_be_marker and len(stripped) < len(self.marker) and not final:
                    return out  # empty, or a beginning of the marker
                self._at_start = False
                if stripped.startswith("[") and not stripped.startswith(self.marker):
                    self._held_ws = self._buf[:len(self._buf) - len(stripped)]
                    self._buf, self._in_block, self._marker_len = stripped, True, 0
                    self._start_block()
                    continue
            i = self._buf.find(self.marker)
            if i >= 0:
                text = self._buf[:i]
                content = text.rstrip()
                self._content(out, content)
                self._held_ws = text[len(content):]
                self._buf, self._in_block, self._marker_len = self._buf[i:], True, len(self.marker)
                self._start_block()
                continue
            if final:
                self._content(out, self._buf)
                self._buf = ""
                return out
            keep = _held_suffix(self._buf, self.marker)
            content = self._buf[:len(self._buf) - keep].rstrip()
            self._content(out, content)
            self._buf = self._buf[len(content):]
            return out

    def _content(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self._has_content:
            text = self._gap + text
        out.append(text)
        self._gap, self._has_content = "", True

    def _start_block(self) -> None:
        """A block begins at _buf[0]."""


class HermesParser(_MarkedBlocks):
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _start_block(self) -> None:
        self._searched = len(self.marker)

    def _block_end(self, final: bool) -> int | None:
        j = self._buf.find(self.end_marker, self._searched)
        if j >= 0:
            return j + len(self.end_marker)
        self._searched = max(self._searched, len(self._buf) - len(self.end_marker) + 1)
        return len(self._buf) if final else None

    def _block_calls(self, body: str) -> list[ParsedToolCall] | None:
        body = body.removesuffix(self.end_marker)
        call = call_from_object(_loads(body))
        return None if call is None else [call]


class MistralParser(_MarkedBlocks):
    marker = "[TOOL_CALLS]"
    bare_block_at_start = True

    def _start_block(self) -> None:
        self._scanner: JsonScanner | None = None

    def _block_end(self, final: bool) -> int | None:
        if self._scanner is None:
            rest = self._buf[self._marker_len:]
            p = len(self._buf) - len(rest.lstrip())
            if p == len(self._buf):
                return len(self._buf) if final else None
            if self._buf[p] != "[":
                return p  # the marker is not followed by an array: content
            self._scanner = JsonScanner(self._buf, p)
        end = self._scanner.scan(self._buf)
        if end is None and final:
            return len(self._buf)
        return end

    def _block_calls(self, body: str) -> list[ParsedToolCall] | None:
        items = _loads(body)
        if not isinstance(items, list) or not items:
            return None
        calls = [call_from_object(item) for item in items]
        return None if any(c is None for c in calls) else calls


# -- llama 3 JSON ----------------------------------------------------------------------------


class Llama3JsonParser(ToolCallParser):
    """`<|python_tag|>`? then calls separated by `;`, at the start of the output; the text from
    the first thing that is not a valid call on is content (all of it when no call came first)."""

    python_tag = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> object <-> separator -> text
        self._num_calls = 0
        self._obj_start = 0
        self._scanner: JsonScanner | None = None

    def feed(self, text: str) -> list[Event]:
        if self._state == "text":
            return [text] if text else []
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        if self._state == "text":
            return []
        return self._run(final=True)

    def _to_text(self, start: int) -> list[Event]:
        text, self._buf, self._state = self._buf[start:], "", "text"
        return [text] if text else []

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            buf = self._buf
            if self._state == "start":
                p = len(buf) - len(buf.lstrip())
                if buf.startswith(self.python_tag, p):
                    rest = buf[p + len(self.python_tag):]
                    p = len(buf) - len(rest.lstrip())
                elif self.python_tag.startswith(buf[p:]) and not final:
                    return out  # empty or a beginning of the tag: wait
                if p == len(buf):
                    return out + self._to_text(0) if final else out
                if buf[p] != "{":
                    return out + self._to_text(0)
                self._begin_object(p)
            elif self._state == "separator":
                p = self._obj_start
                while p < len(buf) and (buf[p].isspace() or buf[p] == ";"):
                    p += 1
                if p == len(buf):
                    if final:
                        self._buf = ""
                        return out
                    self._obj_start = p
                    return out
                if buf[p] != "{":
                    return out + self._to_text(p)
                self._begin_object(p)
            else:  # object
                end = self._scanner.scan(buf)
                call = call_from_object(_loads(buf[self._obj_start:end])) if end is not None else None
                if call is None:
                    if end is None and not final:
                        return out
                    return out + self._to_text(self._obj_start if self._num_calls else 0)
                out.append(call)
                self._num_calls += 1
                self._obj_start, self._state = end, "separator"

    def _begin_object(self, p: int) -> None:
        self._obj_start, self._state, self._scanner = p, "object", JsonScanner(self._buf, p)
