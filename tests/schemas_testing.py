"""JSON schemas for the structured-outputs tests (tests/test_structured_outputs.py): what agents and
their tools send. Nested objects, arrays with item bounds, enums and consts, required and optional
properties, string formats, patterns and lengths, numbers and integers with bounds, anyOf, oneOf
with const tags, $ref with $defs, recursion, nullable types. Each schema is one the grammar engine
enforces completely (check_structured_outputs accepts it), so every output must validate.

SCHEMAS bound every string, number, array and recursion (maxLength, bounds, maxItems, a depth
spelled out): they run on the random-weight dummy model too, which under greedy decoding repeats
one character inside an unbounded string to the token budget ('"kkkk...', measured), since nothing
in its weights prefers the closing quote. OPEN_SCHEMAS leave them open, as most tool schemas do: they
run on SmolLM2 (greedy and sampled) and on the dummy model sampled.
"""

WEATHER = {  # a typical tool call's arguments
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}

TREE = {  # recursion through $ref to itself: nothing bounds its depth (SELF_RECURSIVE)
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["name", "children"],
        }
    },
    "$ref": "#/$defs/node",
}

SCHEMAS: list[tuple[str, dict]] = [
    ("string", {"type": "string", "maxLength": 16}),
    ("integer", {"type": "integer", "minimum": -1000, "maximum": 1000}),
    ("number", {"type": "number", "minimum": -100, "maximum": 100}),
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("enum_strings", {"enum": ["red", "green", "blue"]}),
    ("enum_mixed", {"enum": [1, "two", None, True]}),
    ("const", {"const": "fixed-value"}),
    ("integer_range", {"type": "integer", "minimum": 10, "maximum": 99}),
    ("integer_exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}),
    ("integer_negative", {"type": "integer", "minimum": -50, "maximum": -1}),
    ("integer_multiple", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("number_range", {"type": "number", "minimum": 0, "maximum": 1}),
    ("number_exclusive", {"type": "number", "exclusiveMinimum": -1.5, "exclusiveMaximum": 2.5}),
    ("string_length", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("string_pattern_code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
    ("string_pattern_word", {"type": "string", "pattern": "^[a-z]{1,12}$"}),
    ("string_pattern_email", {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}),
    ("string_date", {"type": "string", "format": "date"}),
    ("string_datetime", {"type": "string", "format": "date-time"}),
    ("string_time", {"type": "string", "format": "time"}),
    ("string_uuid", {"type": "string", "format": "uuid"}),
    ("string_ipv4", {"type": "string", "format": "ipv4"}),
    ("nullable_string", {"type": ["string", "null"], "maxLength": 20}),
    ("weather_tool", WEATHER),
    ("person", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 150}},
        "required": ["name", "age"]}),
    ("all_optional", {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"},
                       "c": {"type": "string", "maxLength": 5}}}),
    ("empty_object", {"type": "object", "properties": {}, "additionalProperties": False}),
    ("flags", {
        "type": "object",
        "properties": {k: {"type": "boolean"} for k in ("verbose", "dry_run", "force", "recursive")},
        "required": ["verbose", "dry_run", "force", "recursive"]}),
    ("nested_address", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
        },
        "required": ["name", "address"]}),
    ("deeply_nested", {
        "type": "object",
        "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "object", "properties": {
            "l3": {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["value"]}}, "required": ["l3"]}}, "required": ["l2"]}},
        "required": ["l1"]}),
    ("array_integers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 6}),
    ("array_bounds", {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 4}),
    ("array_exact", {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}),
    ("array_enum", {"type": "array", "items": {"enum": ["low", "mid", "high"]}, "minItems": 1, "maxItems": 5}),
    ("array_objects", {
        "type": "array", "maxItems": 3, "minItems": 1,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                                   "done": {"type": "boolean"}}, "required": ["id", "done"]}}),
    ("tuple", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10},
                                                {"type": "integer", "minimum": 0, "maximum": 9},
                                                {"type": "boolean"}], "items": False}),
    ("matrix", {"type": "array", "maxItems": 3, "minItems": 1,
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                          "minItems": 2, "maxItems": 2}}),
    ("any_of_scalar", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 5},
                                 {"type": "null"}]}),
    ("any_of_objects", {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 10}},
         "required": ["circle"]},
        {"type": "object", "properties": {"square": {"type": "number", "minimum": 0, "maximum": 10}},
         "required": ["square"]}]}),
    ("one_of_tagged", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"]}]}),
    ("ref_defs", {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 640},
                                                             "y": {"type": "integer", "minimum": 0, "maximum": 480}},
                            "required": ["x", "y"]}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]}),
    ("ref_definitions", {
        "definitions": {"color": {"enum": ["cyan", "magenta", "yellow"]}},
        "type": "array", "items": {"$ref": "#/definitions/color"}, "maxItems": 3}),
    ("recursive_depth_3", {  # a tree three levels deep at most: each level's children are the next level's nodes
        "$defs": {
            "leaf": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
                     "additionalProperties": False},
            "level2": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 8},
                "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}}, "required": ["name"]},
            "level1": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 8},
                "children": {"type": "array", "items": {"$ref": "#/$defs/level2"}, "maxItems": 2}}, "required": ["name"]}},
        "$ref": "#/$defs/level1"}),
    ("recursive_depth_2", {  # a recursion limit spelled out: a comment may have replies, which have none
        "$defs": {
            "reply": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 16}},
                      "required": ["text"], "additionalProperties": False},
            "comment": {"type": "object", "properties": {
                "text": {"type": "string", "maxLength": 16},
                "replies": {"type": "array", "items": {"$ref": "#/$defs/reply"}, "maxItems": 2}},
                "required": ["text", "replies"]}},
        "$ref": "#/$defs/comment"}),
    ("additional_typed", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                          "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
                          "propertyNames": {"maxLength": 6}, "maxProperties": 3, "required": ["id"]}),
    ("map_of_strings", {"type": "object", "additionalProperties": {"type": "string", "maxLength": 8},
                        "propertyNames": {"pattern": "^[a-z]{1,6}$"}, "maxProperties": 3}),
    ("tool_call", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather", "search", "calculator"]},
            "arguments": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
                          "required": ["query"]}},
        "required": ["name", "arguments"]}),
    ("tool_calls_list", {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "properties": {
            "name": {"const": "calculator"},
            "arguments": {"type": "object", "properties": {
                "op": {"enum": ["add", "sub", "mul", "div"]}, "a": {"type": "number", "minimum": -1e6, "maximum": 1e6},
                "b": {"type": "number", "minimum": -1e6, "maximum": 1e6}},
                "required": ["op", "a", "b"]}},
            "required": ["name", "arguments"]}}),
    ("event", {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "format": "date"},
                       "attendees": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}@example\\.com$"},
                                     "maxItems": 3},
                       "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title", "date", "priority"]}),
    ("product", {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^SKU[0-9]{6}$"},
                       "price": {"type": "number", "minimum": 0, "maximum": 10000},
                       "currency": {"const": "EUR"}, "in_stock": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}},
        "required": ["sku", "price", "currency", "in_stock"]}),
    ("nullable_fields", {
        "type": "object",
        "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 10},
                       "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 100}, {"type": "null"}]}},
        "required": ["middle_name", "score"]}),
    ("classification", {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "confidence"], "additionalProperties": False}),
    ("coordinates", {
        "type": "object",
        "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                       "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"]}),
    ("step_plan", {
        "type": "object",
        "properties": {"goal": {"type": "string", "maxLength": 40},
                       "steps": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "object", "properties": {
                                     "n": {"type": "integer", "minimum": 1, "maximum": 3},
                                     "action": {"type": "string", "maxLength": 30}}, "required": ["n", "action"]}}},
        "required": ["goal", "steps"]}),
    ("all_of_one", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["a"]}]}),
    ("key_value_pairs", {"type": "array", "maxItems": 3,
                         "items": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 6},
                                                                    {"type": "integer", "minimum": 0, "maximum": 99}],
                                   "items": False}}),
    ("rgb", {"type": "object", "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255}
                                              for c in ("r", "g", "b")}, "required": ["r", "g", "b"]}),
    ("semver", {"type": "string", "pattern": "^(0|[1-9][0-9]?)\\.(0|[1-9][0-9]?)\\.(0|[1-9][0-9]?)$"}),
]

# Self-recursion: a model may nest as deep as it likes (SmolLM2 nests {"name": "node", "children": [...]}
# to any token budget), so it runs on the dummy model sampled, where each level may close.
SELF_RECURSIVE: list[tuple[str, dict]] = [
    ("recursive_tree", TREE),
    ("linked_list", {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["value", "next"]}),
]

# (name, schema, prompt): a real model told what to write closes what the schema leaves open
OPEN_SCHEMAS: list[tuple[str, dict, str]] = [
    ("open_string", {"type": "string"}, "Name one color. Reply with a JSON string."),
    ("open_integer", {"type": "integer"}, "How many legs does a spider have? Reply with a JSON number."),
    ("open_number", {"type": "number"}, "What is pi rounded to two decimals? Reply with a JSON number."),
    ("open_email", {"type": "string", "format": "email"},
     "What is the email address of the help desk, help at example.com? Reply with a JSON string."),
    ("open_uri", {"type": "string", "format": "uri"},
     "What is the address of the home page of example.com? Reply with a JSON string."),
    ("open_pattern", {"type": "string", "pattern": "^[a-z]+$"}, "Name one fruit in lowercase. Reply with a JSON string."),
    ("open_weather_tool", {**WEATHER, "properties": {**WEATHER["properties"], "location": {"type": "string"}}},
     "Get the weather in Paris, France, in celsius, for 3 days. Reply with the tool's JSON arguments."),
    ("open_summary", {"type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"},
                                                       "keywords": {"type": "array", "items": {"type": "string"}}},
                      "required": ["title", "summary", "keywords"]},
     "Summarize in one short sentence, with a title and three keywords: The cat sat on the mat all day. Reply in JSON."),
]

assert len(SCHEMAS) >= 50
assert len({e[0] for e in SCHEMAS + OPEN_SCHEMAS + SELF_RECURSIVE}) == \
    len(SCHEMAS) + len(OPEN_SCHEMAS) + len(SELF_RECURSIVE)
