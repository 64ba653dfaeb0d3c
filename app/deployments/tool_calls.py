"""Parsed tool calls -> the chat response's message, or its stream's deltas (OpenAI's shapes).

Non-streamed: `message.tool_calls` ([{id: "call_<random>", type: "function", function: {name,
arguments}}]), `content` the text outside the calls (null when there is none), finish_reason
"tool_calls" when calls were made and the output ended on its own ("length" stays "length").

Streamed: per call, a first delta `{index, id, type: "function", function: {name, arguments: ""}}`,
then `{index, function: {arguments}}` with the arguments (a call is emitted once complete and
valid, so there is one fragment); content deltas carry only text outside calls. The parser is the
same one over the same text, so the deltas add up to the non-streamed message, whatever the
chunking. With parallel_tool_calls false only the first call counts, in both.
"""

from __future__ import annotations

import uuid

from app.deployments.protocol import ChatCompletionRequest, ChatResponseMessage, DeltaMessage
from app.deployments.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from app.deployments.tool_parsers import ParsedToolCall, ToolCallParser, parse_message


def parses_tools(request) -> bool:
    """Whether the request's output is parsed for tool calls (tools offered, tool_choice not none)."""
    return isinstance(request, ChatCompletionRequest) and bool(request.tools) and \
        request.effective_tool_choice != "none"


def max_calls(request: ChatCompletionRequest) -> int | None:
    return None if request.parallel_tool_calls else 1


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and reason == "stop" else reason


def response_message(parser: ToolCallParser, text: str, limit: int | None) -> ChatResponseMessage:
    parsed = parse_message(parser, text, limit)
    calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    return ChatResponseMessage(content=parsed.content, tool_calls=calls or None)


class ToolCallStream:
    """One choice's stream: text deltas in, DeltaMessages out."""

    def __init__(self, parser: ToolCallParser, limit: int | None) -> None:
        self.parser = parser
        self.limit = limit
        self.num_calls = 0

    def deltas(self, text: str, finished: bool) -> list[DeltaMessage]:
        events = self.parser.feed(text)
        if finished:
            events += self.parser.finish()
        out: list[DeltaMessage] = []
        for event in events:
            if isinstance(event, str):
                if out and out[-1].tool_calls is None:
                    out[-1].content += event
                else:
                    out.append(DeltaMessage(content=event))
            elif self.limit is None or self.num_calls < self.limit:
                out += self._call(event)
        return out

    def _call(self, call: ParsedToolCall) -> list[DeltaMessage]:
        index = self.num_calls
        self.num_calls += 1
        return [DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=new_call_id(), type="function",
                                                       function=DeltaFunctionCall(name=call.name, arguments=""))]),
                DeltaMessage(tool_calls=[DeltaToolCall(index=index,
                                                       function=DeltaFunctionCall(arguments=call.arguments))])]

