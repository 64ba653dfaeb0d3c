"""Request bodies fuzzed from the API's own JSON schemas (hypothesis-jsonschema over the pydantic
models the ingress validates with), shared by tests/test_fuzz_requests.py and bench/chaos.py.

`bodies(model_cls)` is a hypothesis strategy: schema-valid bodies (half naming the served model),
with fields added or replaced by JSON of any shape. `draw(n, seed)` draws n of them per endpoint,
outside a test, for a load generator.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from app.deployments.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "tiny-llama"
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

# JSON of any shape, to mix in with schema-shaped bodies (wrong types, unknown fields)
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                    max_size=4), max_leaves=12)


def bodies(model_cls, model: str = MODEL):
    """Schema-valid bodies (half of them naming `model`), with random extra or replaced fields."""
    schema = from_schema(model_cls.model_json_schema())
    fields = list(model_cls.model_fields)
    return st.tuples(schema, st.booleans(), st.dictionaries(st.sampled_from(fields + ["junk"]), ANY_JSON,
                                                             max_size=2)).map(
        lambda t: {**t[0], **({"model": model} if t[1] else {}), **t[2]})


def draw(n: int, seed: int = 0, model: str = MODEL) -> list[tuple[str, object]]:
    """n (path, JSON body) pairs, alternating endpoints, in a seeded order."""
    out: list[tuple[str, object]] = []
    for path, model_cls in ENDPOINTS.items():
        drawn: list = []

        @settings(max_examples=(n + 1) // 2, database=None, deadline=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(body=bodies(model_cls, model))
        def collect(body):
            drawn.append(body)

        collect()
        out.extend((path, b) for b in drawn[: (n + 1) // 2])
    random.Random(seed).shuffle(out)
    return out[:n]
