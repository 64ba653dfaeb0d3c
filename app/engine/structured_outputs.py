"""What a request's output must match (structured outputs), and the check of a spec on its own.

`StructuredOutputs` names its fields as vLLM's StructuredOutputsParams does; exactly one is set.
`check_structured_outputs` is the part of validation that needs no tokenizer: it parses the spec
with xgrammar (the grammar engine, app/engine/grammar.py) and refuses what is invalid or what
xgrammar would silently not enforce, so that a bad spec is an InvalidRequestError (HTTP 400)
before the request is queued anywhere. The engine compiles the spec against its tokenizer later,
off its loop.

xgrammar's loose spots (where it would let through what JSON or the schema forbids) are worked
around in app/engine/xgrammar_fixes.py. Pure Python at import (the HTTP ingress imports it). The
first call of check_structured_outputs imports xgrammar, and with it torch and transformers (about
1.8 s of CPU, once per process).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from functools import lru_cache

from app.engine.errors import InvalidRequestError
from app.engine.xgrammar_fixes import schema_for_xgrammar, strict_json_strings

# A spec is parsed on the caller's thread and compiled on one of the engine's two compile threads:
# its size is bounded. Compile time grows faster than the schema: an object of 1,000 optional
# properties (49 kB) compiles in 3 s against a 320-token vocabulary, 2,000 (98 kB) in 48 s.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 4096

# JSON schema keywords xgrammar 0.2 parses but does not enforce: an output it allows may not
# validate against the schema, so a schema holding them is refused (each one measured in
# tests/test_structured_outputs.py). Also refused: `uniqueItems: true`, `allOf` of more than one
# schema (xgrammar then allows any JSON value), and `multipleOf` except on an integer type with an
# integer divisor. `oneOf` is enforced as `anyOf` where xgrammar cannot
# prove its branches disjoint (a discriminated union with `const` tags is disjoint): accepted.
UNSUPPORTED_JSON_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                             "contains", "minContains", "maxContains")
# Keywords whose value is a schema, a list of schemas or a map of name -> schema: the walk follows
# them and nothing else (so a property named "not" is not taken for the keyword).
_SCHEMA_VALUED = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "not",
                  "if", "then", "else", "contains", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

_XGR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:\d+: (Check failed: \(.*?\) is false: )?")

# Whitespace: JSON outputs are laid out as json.dumps does ("a": 1, "b": 2), one line, no free
# whitespace (xgrammar's any_whitespace=False; vLLM's disable_any_whitespace). A small model given
# free whitespace may spend its tokens on it.
JSON_ANY_WHITESPACE = False


class StructuredOutputsError(InvalidRequestError):
    """A structured-outputs spec is invalid or not supported; the message names the field."""


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's StructuredOutputsParams names). Exactly one of:"""

    # a JSON schema, serialized (json.dumps(schema)); keep the client's key order: outputs list an
    # object's properties in the order the schema does (sort_keys=True would put "arguments" before "name")
    json: str | None = None
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF in xgrammar's dialect (GBNF-like), root rule `root`
    structural_tag: str | None = None  # xgrammar structural tag JSON (begin/schema/end triggers), for tool calls

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if _is_set(getattr(self, f.name))]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self))
            raise StructuredOutputsError(
                f"structured_outputs must set exactly one of {names} (got {', '.join(given) or 'none'})")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise StructuredOutputsError(f"structured_outputs.{name} must be a string (got {type(value).__name__})")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputsError(
                f"structured_outputs.json_object must be a bool (got {self.json_object!r:.80})")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputsError("structured_outputs.choice must be a tuple of strings "
                                             f"(got {self.choice!r:.200})")
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise StructuredOutputsError(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings "
                                             f"(got {len(self.choice)})")

    @property
    def kind(self) -> str:
        """The field that is set."""
        return next(f.name for f in fields(self) if _is_set(getattr(self, f.name)))


def _is_set(value) -> bool:
    return value is not None and value is not False


def check_structured_outputs(so: StructuredOutputs) -> None:
    """Raise StructuredOutputsError (an InvalidRequestError) unless xgrammar can enforce `so`: a
    JSON schema that parses, is an object and uses only keywords xgrammar enforces; a regex, an
    EBNF grammar (root rule `root`) or a structural tag that xgrammar parses. Tokenizer-independent
    and cached per spec."""
    if not isinstance(so, StructuredOutputs):
        raise StructuredOutputsError(f"structured_outputs must be a StructuredOutputs (got {type(so).__name__})")
    size = sum(len(v) for v in (so.json, so.regex, so.grammar, so.structural_tag) if v) + sum(map(len, so.choice or ()))
    if size > MAX_SPEC_CHARS:
        raise StructuredOutputsError(f"structured_outputs.{so.kind} is {size} characters; at most {MAX_SPEC_CHARS} "
                                     "are accepted")
    _check_cached(so)


@lru_cache(maxsize=1024)
def _check_cached(so: StructuredOutputs) -> None:
    to_grammar(so)


def to_grammar(so: StructuredOutputs):
    """The xgrammar Grammar of a spec (raises StructuredOutputsError). The engine compiles it
    against its tokenizer (app/engine/grammar.py)."""
    import xgrammar as xgr

    kind = so.kind
    try:
        if kind == "json":
            schema = _parse_json(so.json, "json")
            if not isinstance(schema, dict):
                raise StructuredOutputsError("structured_outputs.json must be a JSON schema object "
                                             f"(got {type(schema).__name__})")
            bad = sorted(_unsupported_keywords(schema))
            if bad:
                raise StructuredOutputsError(
                    f"structured_outputs.json uses {', '.join(bad)}, which the grammar engine (xgrammar) does not "
                    "enforce; remove them or express the constraint with enum, anyOf, pattern or bounds")
            return _json_schema_grammar(schema)
        if kind == "json_object":
            # strict_mode off: {"type": "object"} then allows any properties
            return strict_json_strings(xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=JSON_ANY_WHITESPACE, strict_mode=False))
        if kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(so.grammar)
        return _structural_tag_grammar(so.structural_tag)
    except StructuredOutputsError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors (InvalidJSONError is a ValueError)
        raise StructuredOutputsError(f"structured_outputs.{kind} is invalid: {_xgr_message(e)}") from None


def _structural_tag_grammar(spec: str):
    """xgrammar's structural tag: its current form ({"type": "structural_tag", "format": ...}) or
    the begin/schema/end form with triggers ({"structures": [...], "triggers": [...]}), as vLLM
    takes both."""
    import xgrammar as xgr

    tag = _parse_json(spec, "structural_tag")
    if isinstance(tag, dict) and "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list) or not structures or not triggers:
            raise StructuredOutputsError("structured_outputs.structural_tag: 'structures' and 'triggers' must be "
                                         "non-empty lists")
        items = []
        for s in structures:
            if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
                raise StructuredOutputsError("structured_outputs.structural_tag: each structure needs 'begin', "
                                             "'schema' and 'end'")
            if not isinstance(s["schema"], dict):
                raise StructuredOutputsError("structured_outputs.structural_tag: a structure's 'schema' must be "
                                             "a JSON schema object")
            bad = sorted(_unsupported_keywords(s["schema"]))
            if bad:
                raise StructuredOutputsError(f"structured_outputs.structural_tag: a schema uses {', '.join(bad)}, "
                                             "which the grammar engine (xgrammar) does not enforce")
            schema = json.dumps(schema_for_xgrammar(s["schema"]))
            items.append(xgr.StructuralTagItem(begin=s["begin"], schema=schema, end=s["end"]))
        return strict_json_strings(xgr.Grammar.from_structural_tag(items, triggers))
    return strict_json_strings(xgr.Grammar.from_structural_tag(spec))


def xgrammar_json_schema(so: StructuredOutputs) -> str:
    """The JSON schema of `so` as the engine hands it to xgrammar (formats as exact patterns:
    app/engine/xgrammar_fixes.py): what the vLLM backend passes vLLM, so both enforce the same."""
    return json.dumps(schema_for_xgrammar(json.loads(so.json)))


def _json_schema_grammar(schema: dict):
    import xgrammar as xgr

    return strict_json_strings(xgr.Grammar.from_json_schema(
        json.dumps(schema_for_xgrammar(schema)), any_whitespace=JSON_ANY_WHITESPACE, strict_mode=True))


def _parse_json(text: str, field: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StructuredOutputsError(f"structured_outputs.{field} is not valid JSON: {e}") from None


def _unsupported_keywords(schema) -> set[str]:
    """What a schema and its subschemas use that xgrammar does not enforce (see UNSUPPORTED_JSON_KEYWORDS)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.update(k for k in UNSUPPORTED_JSON_KEYWORDS if k in node)
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.add("allOf (of more than one schema)")
        if "multipleOf" in node and not (node.get("type") == "integer" and _is_int(node["multipleOf"])):
            found.add("multipleOf (other than an integer divisor of an integer)")
        stack.extend(node[k] for k in _SCHEMA_VALUED if isinstance(node.get(k), dict))
        for k in _SCHEMA_LISTS:
            if isinstance(node.get(k), list):
                stack.extend(node[k])
        if isinstance(node.get("items"), list):  # draft 4-7 tuple form
            stack.extend(node["items"])
        for k in _SCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                stack.extend(node[k].values())
    return found


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _xgr_message(e: BaseException) -> str:
    """xgrammar's error text without its log prefix ('[17:20:50] /project/cpp/x.cc:94: ')."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_LOG_PREFIX.sub("", text)
