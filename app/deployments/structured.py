"""A request's output constraint: its fields -> one StructuredOutputs for the grammar engine.

At most one field may constrain a request's output:

| field | StructuredOutputs |
|---|---|
| `response_format` `{"type": "text"}` | none |
| `response_format` `{"type": "json_object"}` | `json_object=True` |
| `response_format` `{"type": "json_schema", "json_schema": {"schema": S}}` | `json=dumps(S)` (no schema: `json_object`) |
| `structured_outputs.json` / `guided_json` (a schema, or its text) | `json=dumps(S)` |
| `structured_outputs.regex` / `guided_regex` | `regex` |
| `structured_outputs.choice` / `guided_choice` | `choice` (a tuple) |
| `structured_outputs.grammar` / `guided_grammar` | `grammar` |
| `structured_outputs.json_object: true` | `json_object=True` |
| `tool_choice` `required` or a named function, strict tools under `auto` | `structural_tag` (tool_formats.py) |

The engine's check_structured_outputs then refuses what it cannot compile; the BadRequestError
names the field the constraint came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.deployments.protocol import BadRequestError, ChatCompletionRequest, NamedToolChoice
from app.deployments.protocol_tools import StructuredOutputsParams
from app.deployments.tool_formats import ToolFormat, structural_tag
from app.engine.errors import InvalidRequestError

ANY_OBJECT = {"type": "object"}  # the arguments of a tool that is not strict, where a grammar covers it


@dataclass(frozen=True, slots=True)
class Constraint:
    param: str  # the request field it comes from (a refusal names it)
    kind: str  # the StructuredOutputs field: json, json_object, regex, choice, grammar, structural_tag
    value: str | bool | tuple[str, ...]
    tool_schemas: tuple[tuple[str, str], ...] = ()  # structural_tag: (param, schema JSON) of each tool in it


def request_constraint(request, tool_format: ToolFormat | None = None) -> Constraint | None:
    """The request's one constraint (None: unconstrained); two at once -> BadRequestError."""
    found = [c for c in (*_output_constraints(request), _tool_constraint(request, tool_format)) if c is not None]
    if len(found) > 1:
        a, b = found[0].param, found[1].param
        raise BadRequestError(f"{a} and {b} both constrain the output; a request takes one of response_format, "
                              "structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar and "
                              "tool_choice required / a named function / strict tools", param=b)
    return found[0] if found else None


def _output_constraints(request) -> list[Constraint | None]:
    out = [_response_format(request)]
    if request.structured_outputs is not None:
        out.append(_structured_outputs(request.structured_outputs))
    out.append(_json("guided_json", request.guided_json))
    out.append(_text("guided_regex", "regex", request.guided_regex))
    out.append(_choice("guided_choice", request.guided_choice))
    out.append(_text("guided_grammar", "grammar", request.guided_grammar))
    return out


def _response_format(request) -> Constraint | None:
    rf = request.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object" or rf.json_schema.schema_ is None:
        return Constraint("response_format", "json_object", True)
    return _json("response_format", rf.json_schema.schema_)


def _structured_outputs(so: StructuredOutputsParams) -> Constraint:
    param = "structured_outputs"
    given = [c for c in (_json(f"{param}.json", so.json_),
                         _text(f"{param}.regex", "regex", so.regex),
                         _choice(f"{param}.choice", so.choice),
                         _text(f"{param}.grammar", "grammar", so.grammar),
                         Constraint(f"{param}.json_object", "json_object", True) if so.json_object else None)
             if c is not None]
    if len(given) != 1:
        raise BadRequestError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                              f"json_object (got {len(given)})", param=param)
    return given[0]


def _json(param: str, schema) -> Constraint | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise BadRequestError(f"{param} is not valid JSON ({e}); send a JSON schema", param=param) from None
    if not isinstance(schema, dict):
        raise BadRequestError(f"{param} must be a JSON schema: a JSON object (got {type(schema).__name__})",
                              param=param)
    return Constraint(param, "json", json.dumps(schema))


def _text(param: str, kind: str, value: str | None) -> Constraint | None:
    if value is None:
        return None
    if not value:
        raise BadRequestError(f"{param} must not be empty", param=param)
    return Constraint(param, kind, value)


def _choice(param: str, choices: list[str] | None) -> Constraint | None:
    if choices is None:
        return None
    if not choices:
        raise BadRequestError(f"{param} must list at least one string", param=param)
    return Constraint(param, "choice", tuple(choices))


def _tool_constraint(request, fmt: ToolFormat | None) -> Constraint | None:
    """tool_choice required: the output begins with a call of one of the tools (then text and
    more calls may follow; with parallel_tool_calls false it ends after the call); a named
    function: exactly one call of it; auto with strict tools: text, and calls whose arguments
    follow the strict tools' schemas (the other tools': any object). The arguments of every call
    the constraint covers follow their tool's parameters schema."""
    if not isinstance(request, ChatCompletionRequest) or not request.tools:
        return None
    choice = request.effective_tool_choice
    one = not request.parallel_tool_calls
    tools = list(enumerate(request.tools))
    if choice == "none" or (choice == "auto" and not any(t.function.strict for _, t in tools)):
        return None
    assert fmt is not None, "a request with tools needs the tool-call format"
    if isinstance(choice, NamedToolChoice):
        tools = [(i, t) for i, t in tools if t.function.name == choice.function.name]
    schemas = [(i, t.function.name, t.function.parameters_schema() if choice != "auto" or t.function.strict
                else ANY_OBJECT) for i, t in tools]
    tags = [fmt.call_tag(name, schema) for _, name, schema in schemas]
    if isinstance(choice, NamedToolChoice):
        tag, param = fmt.named(tags[0]), "tool_choice"
    elif choice == "required":
        tag, param = fmt.required(tags, one), "tool_choice"
    else:
        tag, param = fmt.text_or_calls(tags, one), "tools"
    checked = tuple((f"tools[{i}].function.parameters", json.dumps(schema))
                    for i, _, schema in schemas if schema is not ANY_OBJECT)
    return Constraint(param, "structural_tag", structural_tag(tag), checked)


def structured_outputs(constraint: Constraint):
    """The engine's StructuredOutputs for `constraint`, checked by the engine: one it refuses is a
    BadRequestError naming the field (for tools, the first tool whose schema it refuses).
    Blocking (the check may compile a grammar): call it off the event loop."""
    from app.engine.structured_outputs import StructuredOutputs, check_structured_outputs

    try:
        so = StructuredOutputs(**{constraint.kind: constraint.value})
        check_structured_outputs(so)
        return so
    except InvalidRequestError as e:
        param = constraint.param
        for tool_param, schema in constraint.tool_schemas:
            try:
                check_structured_outputs(StructuredOutputs(json=schema))
            except InvalidRequestError as tool_error:
                param, e = tool_param, tool_error
                break
        raise BadRequestError(f"{param}: {e}", param=param) from None
