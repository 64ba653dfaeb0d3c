"""NaN/Inf in one request's K/V or logits fails that request only (no device sync in the store).

The store flags the tokens whose K or V is not finite (and does not write them); the runner reads
the flags with the sampled tokens and the engine finishes those requests with finish_reason
"error". A poisoned embedding row stands for a request whose activations overflow.
"""

import pytest
import torch

from app import LLM, SamplingParams
from app.kernels.store_kv import store_kv
from tests.kernels_testing import page_bits, random_pages

WORDS = ["Once upon a time", "The little dog", "Lily and Tom"]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["fp4", "fp8", "fp32"])
def test_nonfinite_kv_fails_only_its_request(stories_paths, kv_cache_dtype, async_scheduling):
    model, tokenizer = stories_paths
    llm = LLM(model=model, tokenizer=tokenizer, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, max_num_seqs=8,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [llm.tokenizer.encode(w) for w in WORDS]
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    used = {t for ids in prompts + alone for t in ids}
    poison = next(t for t in range(llm.engine.vocab_size - 1, 0, -1) if t not in used)
    m = llm.engine.model
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())  # untie: poison the input only
    with torch.no_grad():
        m.model.embed_tokens.weight[poison] = float("nan")
    outs = llm.generate(prompts + [prompts[0][:2] + [poison] + prompts[1]], params)
    assert [o.token_ids for o in outs[:3]] == alone
    assert [o.finish_reason for o in outs] == ["length"] * 3 + ["error"]
    assert outs[3].error == "non-finite (NaN/Inf) values in its keys/values"
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
    # the engine goes on serving
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


def test_store_kernel_flags_and_skips_nonfinite_vectors():
    """Under the interpreter: with flags, the kernel writes the finite tokens as without them, leaves
    the non-finite (token, head) vectors' slots untouched, flags exactly those tokens, raises nothing."""
    k_pages, v_pages, formats = random_pages("fp4", 4, 16, 2, 64)
    before = [t.clone() for t in page_bits(k_pages) + page_bits(v_pages)]
    ref_k, ref_v, _ = random_pages("fp4", 4, 16, 2, 64)
    torch.manual_seed(0)
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([3, 9, 17, 40, 41])
    value[1, 0, 7] = float("nan")
    key[3, 1, 0] = float("inf")
    flags = torch.zeros(8, dtype=torch.int32)
    store_kv(key, value, slots, k_pages, v_pages, formats, nonfinite=flags)
    assert flags.tolist() == [0, 1, 0, 1, 0, 0, 0, 0]
    good = torch.tensor([0, 2, 4])
    store_kv(key[good], value[good], slots[good], ref_k, ref_v, formats)
    rows = lambda t: t.view(4 * 16, 2, -1)  # [slot, head, bytes]
    for got, ref, old in zip(page_bits(k_pages) + page_bits(v_pages), page_bits(ref_k) + page_bits(ref_v), before):
        got, ref, old = rows(got), rows(ref), rows(old)
        assert torch.equal(got[slots[good]], ref[slots[good]])
        assert torch.equal(got[9, 0], old[9, 0]) and torch.equal(got[40, 1], old[40, 1])


def test_a_failed_request_is_a_500_request_failed_and_a_typed_error_over_the_async_engine(stories_paths):
    """How the failure reaches callers: AsyncLLMEngine raises RequestFailedError in that request's
    stream only (the other stream finishes); the serving layer maps it to an OpenAI 500 error."""
    import asyncio

    from app.deployments.errors import to_openai_error
    from app.engine.async_engine import AsyncLLMEngine
    from app.engine.errors import RequestFailedError

    model, tokenizer = stories_paths
    engine = AsyncLLMEngine(engine=LLM(model=model, tokenizer=tokenizer, kv_cache_dtype="fp4", num_kv_blocks=64).engine)
    try:
        llm_engine = engine.engine
        m = llm_engine.model
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
        poison = llm_engine.vocab_size - 1
        with torch.no_grad():
            m.model.embed_tokens.weight[poison] = float("nan")
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        good = llm_engine.tokenizer.encode("Once upon a time")

        async def consume(prompt):
            outs = [o async for o in engine.generate(prompt, params)]
            return outs[-1]

        async def both():
            return await asyncio.gather(consume(good), consume(good[:2] + [poison]), return_exceptions=True)

        ok, failed = asyncio.run(both())
        assert ok.finish_reason == "length" and len(ok.token_ids) == 8
        assert isinstance(failed, RequestFailedError) and "non-finite" in str(failed)
        assert not engine.is_dead
        err = to_openai_error(failed, {}, 1)
        assert err.status_code == 500 and err.code == "request_failed"
    finally:
        engine.shutdown()


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done():
    """Any exception mid-stream (not only the mapped ones) becomes an OpenAI error event, then [DONE]."""
    import asyncio
    import json

    from app.deployments.ingress import _sse_events
    from app.deployments.protocol import ErrorInfo

    async def items():
        yield ErrorInfo(message="first", type="x")
        raise KeyError("boom")

    async def main():
        return [e async for e in _sse_events(ErrorInfo(message="zero", type="x"), items())]

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 4
    error = json.loads(events[2][len("data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and "boom" in error["message"]


def test_nonfinite_kv_in_a_prefill_chunk_that_samples_nothing_fails_the_request(stories_paths):
    """A step where no request samples (chunked prefill) still reports its failed requests: the
    request fails there, before the blocks it could not write are cached."""
    model, tokenizer = stories_paths
    llm = LLM(model=model, tokenizer=tokenizer, kv_cache_dtype="fp32", num_kv_blocks=64,
              max_num_batched_tokens=16, block_size=4)
    m = llm.engine.model
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    poison = llm.engine.vocab_size - 1
    with torch.no_grad():
        m.model.embed_tokens.weight[poison] = float("nan")
    prompt = [poison] + llm.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play")
    assert len(prompt) > 16  # the first 16-token chunk samples nothing
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out.finish_reason == "error" and "non-finite" in out.error and out.token_ids == []
    assert llm.engine.kv_manager.pool.num_cached_blocks == 0  # none of its blocks entered the prefix cache
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
