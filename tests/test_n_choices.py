"""n > 1 in the engine: choice i is the request with seed + i, the choices after the first take
the prompt's full blocks from the prefix cache, an abort ends them all, no block leaks."""

import asyncio

import pytest

from app.engine.async_engine import AsyncLLMEngine
from app.engine.kv_cache_manager import KVCacheManager
from app.engine.sampling_params import SEED_MAX, SamplingParams, SamplingParamsError
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.llm import LLM

PROMPT = list(range(3, 60))  # 57 tokens: 3 full blocks of 16


def _engine(**kw) -> LLM:
    return LLM(model="tiny-llama", kv_cache_dtype="fp32", dtype="float32", num_kv_blocks=64, block_size=16, **kw)


def test_choice_i_is_the_request_seeded_with_seed_plus_i():
    llm = _engine()
    outs = llm.generate(PROMPT, SamplingParams(n=3, seed=11, max_tokens=8, temperature=1.0))
    assert [o.index for o in outs] == [0, 1, 2]
    singles = [llm.generate(PROMPT, SamplingParams(seed=11 + i, max_tokens=8, temperature=1.0))[0]
               for i in range(3)]
    assert [o.token_ids for o in outs] == [s.token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds, different samples
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks


def test_choices_share_the_prompt_blocks():
    llm = _engine()
    outs = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=5, temperature=0))
    assert len({tuple(o.token_ids) for o in outs}) == 1  # greedy: the same answer four times
    # The first computed the prompt; the others found its 3 full blocks (48 tokens) cached.
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48, 48]
    assert llm.engine.scheduler.num_prefix_hit_tokens_total == 3 * 48


def test_prompt_logprobs_choices_compute_their_own_prompt():
    outs = _engine().generate(PROMPT, SamplingParams(n=2, max_tokens=2, temperature=0, prompt_logprobs=1))
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    first, second = ([d[t].logprob for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])] for o in outs)
    assert first == pytest.approx(second, abs=1e-5)


def test_abort_ends_every_choice_and_frees_their_blocks():
    llm = _engine()
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    outs = engine.abort_request("r")
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.request_id == "r" and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=1))  # the id is free again


def test_duplicate_id_of_an_n_request_changes_nothing():
    engine = _engine().engine
    engine.add_request("r", PROMPT, SamplingParams(n=2))
    from app.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("r", PROMPT, SamplingParams(n=3))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("r", PROMPT)
    assert len(engine.scheduler.requests) == 2


def test_a_request_waits_for_a_prefix_in_flight_without_blocking_the_queue():
    """b has a's prompt: it is held while a computes it (x, queued after b, goes ahead), then finds
    a's full blocks in the prefix cache. The same holds for the choices of an n > 1 request."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)
    a, b = (Sequence(rid, list(range(20)), SamplingParams()) for rid in "ab")
    x = Sequence("x", [1, 2, 3], SamplingParams())
    for s in (a, b, x):
        sched.add_request(s)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 20), ("x", 3)]
    sched.update_from_output(out, {"a": 7, "x": 8})
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("x", 1), ("b", 4)]
    assert b.num_cached_tokens == 16  # 4 of its 5 blocks came from a (the last token is always computed)


def test_no_wait_without_prefix_caching_or_for_prompt_logprobs():
    for caching, params in ((False, SamplingParams()), (True, SamplingParams(prompt_logprobs=0))):
        kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=caching)
        sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)
        for rid in "ab":
            sched.add_request(Sequence(rid, list(range(20)), params))
        assert [(s.request_id, n) for s, n in sched.schedule().scheduled] == [("a", 20), ("b", 20)]


def test_async_generate_streams_every_choice():
    async def run():
        engine = AsyncLLMEngine(engine=_engine().engine)
        try:
            seen: dict[int, list[int]] = {0: [], 1: []}
            finished = []
            async for out in engine.generate(PROMPT, SamplingParams(n=2, seed=3, max_tokens=6, ignore_eos=True)):
                seen[out.index] += out.delta_token_ids
                if out.finished:
                    finished.append(out.index)
            return seen, finished
        finally:
            engine.shutdown()

    seen, finished = asyncio.run(run())
    assert sorted(finished) == [0, 1] and all(len(v) == 6 for v in seen.values())
    single = _engine().generate(PROMPT, SamplingParams(seed=4, max_tokens=6, ignore_eos=True))[0]
    assert seen[1] == single.token_ids


@pytest.mark.parametrize("kw, match", [
    (dict(n=0), "n must be"), (dict(n=129), "n must be"), (dict(n=2.0), "n must be"),
    (dict(n=2, seed=SEED_MAX), "seed \\+ n - 1"),
])
def test_bad_n(kw, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)
