"""Request and response schemas of tool calling and structured outputs (protocol.py uses them).

OpenAI's fields (`tools`, `tool_choice`, `parallel_tool_calls`, `response_format`, assistant
`tool_calls` and `tool` messages in the history) and vLLM's extensions (`structured_outputs`,
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`). Shapes are checked here;
what they mean for the output is app/deployments/structured.py's.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

# OpenAI's rule for function and schema names
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def check_name(v: str, what: str) -> str:
    if not NAME.fullmatch(v):
        raise ValueError(f"{what} must be 1 to 64 letters, digits, '_' or '-' (got {v!r:.80})")
    return v


def check_object_schema(v: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    if v is not None and v.get("type", "object") != "object":
        raise ValueError(f"{what} must be the JSON schema of an object, with \"type\": \"object\" "
                         f"(got \"type\": {json.dumps(v.get('type'))[:40]})")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# -- tools -----------------------------------------------------------------------------------


class FunctionDefinition(_Strict):
    name: str = Field(description="1 to 64 letters, digits, '_' or '-'; unique among the request's tools.",
                      json_schema_extra={"pattern": NAME.pattern})
    description: str | None = Field(None, description="What the function does, for the model.")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments (an object). "
                                              "Absent: the function takes no arguments.")
    strict: bool | None = Field(None, description="Enforce the parameters schema with the grammar engine under "
                                "tool_choice auto too (required and named choices always are).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "a function name")

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v):
        return check_object_schema(v, "parameters")

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class ChatCompletionTool(_Strict):
    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates take it (Hugging Face's `tools=`)."""
        function: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        function["parameters"] = self.function.parameters_schema()
        return {"type": "function", "function": function}


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="The arguments as a JSON object, in text.")


class ToolCall(_Strict):
    """A call in an assistant message (history) and in a response (id `call_<random>`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class HistoryFunctionCall(FunctionCall):
    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, v: str) -> str:
        try:
            json.loads(v)
        except ValueError as e:
            raise ValueError(f"arguments must be JSON text (got {v!r:.60}: {e})") from None
        return v


class HistoryToolCall(ToolCall):
    """A call in an assistant message of the history: its arguments must be JSON."""

    function: HistoryFunctionCall

    def template_dict(self) -> dict[str, Any]:
        """The call as chat templates take it: arguments parsed (Hugging Face's convention)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


# -- structured outputs ----------------------------------------------------------------------


class JsonSchemaResponseFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(description="1 to 64 letters, digits, '_' or '-'.", json_schema_extra={"pattern": NAME.pattern})
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output follows "
                                           "(absent: any JSON object).")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "json_schema.name")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: no constraint; json_object: a JSON object; json_schema: JSON that follows json_schema.schema.")
    json_schema: JsonSchemaResponseFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (or its text).")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's dialect, root rule `root`).")
    json_object: bool | None = Field(None, description="true: any JSON object.")


# -- responses -------------------------------------------------------------------------------


def _without_none(data: dict) -> dict:
    return {k: v for k, v in data.items() if v is not None}


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return _without_none(handler(self))


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first has index, id, type, function.name and arguments "";
    the next ones index and a fragment of function.arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return _without_none(handler(self))
