"""How each tool-call format is written (the parsers of tool_parsers.py read it back).

Per format: the text of an assistant message's calls and the instructions for the model (both
used by the fallback prompt of templates without tools, tool_prompt.py), and the xgrammar
structural tags that force calls in the format (structured.py: tool_choice required, a named
function, strict tools under auto). Structural tags are xgrammar's JSON form
(`{"type": "structural_tag", "format": {...}}`, the form GrammarCompiler.compile_structural_tag
takes as a string); a call's tag begins with the format's text up to the arguments, the arguments
follow the function's parameters schema, and the tag ends with the format's closing text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from app.deployments.tool_parsers import ToolCallParserName

Format = dict[str, Any]  # an xgrammar structural-tag format


class ToolFormat(ABC):
    name: ToolCallParserName
    call_begin: str  # a call's text up to the function name
    arguments_key: str  # "arguments" or "parameters"
    call_end: str  # after the arguments object
    separator: str  # between calls
    trigger: str  # the text a call begins with, before its name
    several = ""  # how to write several calls (the fallback instructions)

    def call_prefix(self, name: str) -> str:
        return f'{self.call_begin}{json.dumps(name)}, "{self.arguments_key}": '

    def render_call(self, name: str, arguments: Any) -> str:
        return self.call_prefix(name) + json.dumps(arguments, ensure_ascii=False) + self.call_end

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        """An assistant message's calls, as the model writes them."""
        return self.separator.join(self.render_call(name, arguments) for name, arguments in calls)

    def instructions(self) -> str:
        """How to call: the exact output format (the fallback system prompt)."""
        example = self.render_calls([("<function-name>", "<arguments-object>")]).replace('"<arguments-object>"',
                                                                                        "<arguments-object>")
        return (f"To call a function, answer with the call in exactly this format, where <arguments-object> is "
                f"a JSON object that follows the function's parameters schema:\n{example}\n{self.several}")

    def call_tag(self, name: str, schema: dict[str, Any]) -> Format:
        return {"type": "tag", "begin": self.call_prefix(name),
                "content": {"type": "json_schema", "json_schema": schema}, "end": self.call_end}

    # The three constraints; `one`: parallel_tool_calls false (exactly one call, then the end)
    def required(self, tags: list[Format], one: bool) -> Format:
        """tool_choice required: the output begins with a call of one of these tools; after it,
        text (the model may end there) and more calls."""
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "at_least_one": True,
                "stop_after_first": one}

    def named(self, tag: Format) -> Format:
        """tool_choice naming a function: exactly one call of it and nothing else."""
        return tag

    def text_or_calls(self, tags: list[Format], one: bool) -> Format:
        """strict tools under auto: free text, and valid calls wherever the model begins one."""
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "at_least_one": False,
                "stop_after_first": one}


class HermesFormat(ToolFormat):
    name = "hermes"
    call_begin = '<tool_call>\n{"name": '
    arguments_key = "arguments"
    call_end = "}\n</tool_call>"
    separator = "\n"
    trigger = "<tool_call>"
    several = "Several calls: one <tool_call> block after the other."


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    call_begin = '{"name": '
    arguments_key = "parameters"
    call_end = "}"
    separator = "; "
    trigger = '{"name": '
    several = "Several calls: separate them with '; '. A call is the whole answer: no text before it."

    def text_or_calls(self, tags: list[Format], one: bool) -> Format:
        # The parser reads calls only at the start of the output: calls first, or text that never
        # begins one
        return {"type": "or", "elements": [self.required(tags, one),
                                           {"type": "any_text", "excludes": ['{"name"']}]}


class MistralFormat(ToolFormat):
    name = "mistral"
    call_begin = '{"name": '
    arguments_key = "arguments"
    call_end = "}"
    separator = ", "
    marker = trigger = "[TOOL_CALLS]"
    several = "Several calls: put them all in the one list, separated by ', '."

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return f"{self.marker}[{super().render_calls(calls)}]"

    def _block(self, content: Format) -> Format:
        return {"type": "tag", "begin": self.marker + "[", "content": content, "end": "]"}

    def required(self, tags: list[Format], one: bool) -> Format:
        """One [TOOL_CALLS] list of one or more calls, and the end."""
        return self._block({"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                            "at_least_one": True, "stop_after_first": one})

    def named(self, tag: Format) -> Format:
        return self._block(tag)

    def text_or_calls(self, tags: list[Format], one: bool) -> Format:
        return {"type": "triggered_tags", "triggers": [self.marker], "tags": [self.required(tags, one)],
                "at_least_one": False, "stop_after_first": True}


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}


def pick_format(setting: str, chat_template: str, template_takes_tools: bool) -> ToolFormat:
    """The `tool_call_parser` setting's format; "auto": the one the chat template writes (Mistral's
    [TOOL_CALLS], Hermes/Qwen's <tool_call>, Llama 3's <|python_tag|> / ipython), hermes for a
    template without tools (the fallback prompt teaches it) or one that names none of these."""
    if setting != "auto":
        return FORMATS[setting]
    if template_takes_tools:
        if "[TOOL_CALLS]" in chat_template:
            return FORMATS["mistral"]
        if "<tool_call>" in chat_template:
            return FORMATS["hermes"]
        if "<|python_tag|>" in chat_template or "ipython" in chat_template:
            return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def structural_tag(fmt: Format) -> str:
    """The structural-tag JSON the grammar engine compiles (property order kept: it is the order
    the model writes the arguments in)."""
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
