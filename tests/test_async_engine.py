"""AsyncLLMEngine: streams equal offline generation; cancellation aborts and frees blocks."""

import asyncio

import pytest

from app.engine.async_engine import AsyncLLMEngine
from app.engine.engine import LLMEngine
from app.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from app.engine.sampling_params import SamplingParams
from app.llm import LLM

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]


@pytest.fixture
def engine(stories_paths):
    model, tok = stories_paths
    eng = AsyncLLMEngine(engine=LLMEngine(model=model, tokenizer=tok, num_kv_blocks=64))
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, params, request_id=None, stream=True):
    outs = [o async for o in eng.generate(prompt, params, request_id=request_id, stream=stream)]
    return outs


def test_concurrent_streams_match_offline(engine, stories_paths):
    model, tok = stories_paths
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.text for o in LLM(model=model, tokenizer=tok).generate(PROMPTS, params)]

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params) for p in PROMPTS))

    for outs, text in zip(asyncio.run(main()), expected):
        assert "".join(o.delta_text for o in outs) == text
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[-1].token_ids == [t for o in outs for t in o.delta_token_ids]


def test_unstreamed_requests_get_first_and_merged_final_outputs(engine):
    """stream=False (a non-streaming HTTP request): per choice, the first output and one final output
    carrying every later delta (merged in the engine thread), the same tokens, text and logprobs as
    streaming; a streaming request running beside them still gets one output per token."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, n=2, logprobs=1, ignore_eos=True)

    async def main():
        return await asyncio.gather(_collect(engine, PROMPTS[0], params, stream=False),
                                    _collect(engine, PROMPTS[0], params, stream=True))

    unstreamed, streamed = asyncio.run(main())
    assert len(streamed) == 2 * 24
    for index in (0, 1):
        mine = [o for o in unstreamed if o.index == index]
        theirs = [o for o in streamed if o.index == index]
        assert len(mine) == 2 and not mine[0].finished and mine[1].finished, mine
        assert [t for o in mine for t in o.delta_token_ids] == [t for o in theirs for t in o.delta_token_ids]
        assert "".join(o.delta_text for o in mine) == "".join(o.delta_text for o in theirs) == mine[1].text
        assert [x for o in mine for x in o.delta_logprobs] == pytest.approx(mine[1].logprobs)
        assert mine[1].token_ids == theirs[-1].token_ids


def test_cancel_aborts_and_frees_blocks(engine):
    free = engine.engine.kv_manager.num_free_blocks

    async def main():
        agen = engine.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=200))
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()  # what a disconnected client's cancelled stream does
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        # then the engine keeps serving
        return await _collect(engine, "One day", SamplingParams(temperature=0, max_tokens=5))

    outs = asyncio.run(main())
    assert outs[-1].finished
    assert not engine.engine.has_unfinished_requests()
    # freed blocks stay in the prefix cache but count as free
    assert engine.engine.kv_manager.num_free_blocks == free


def test_task_cancel_aborts(engine):
    async def main():
        async def consume():
            async for _ in engine.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=500)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_bad_request_raises_and_changes_nothing(engine):
    async def main():
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await _collect(engine, "hi", SamplingParams(max_tokens=100_000))
        with pytest.raises(InvalidRequestError, match="empty"):
            await _collect(engine, "", SamplingParams())
        agen = engine.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=50), request_id="dup")
        first = await agen.__anext__()
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _collect(engine, "hi", SamplingParams(), request_id="dup")
        rest = [o async for o in agen]
        return [first, *rest]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.num_queued() == 0


def test_overload_refuses_beyond_queue(stories_paths):
    model, tok = stories_paths
    eng = AsyncLLMEngine(engine=LLMEngine(model=model, tokenizer=tok, num_kv_blocks=64, max_num_seqs=1),
                         max_queued_requests=1)
    try:
        async def main():
            params = SamplingParams(temperature=0, max_tokens=40)
            running = eng.generate("Once upon a time", params)
            await running.__anext__()  # running, so it is no longer queued
            queued = asyncio.create_task(_collect(eng, "One day", params))
            await asyncio.sleep(0)  # let it queue
            with pytest.raises(EngineOverloadedError, match="max_queued_requests=1"):
                await _collect(eng, "The dog", params)
            rest = [o async for o in running]
            return rest[-1], (await queued)[-1]

        a, b = asyncio.run(main())
        assert a.finished and b.finished
    finally:
        eng.shutdown()


def test_failed_step_fails_streams_and_health(stories_paths):
    model, tok = stories_paths
    inner = LLMEngine(model=model, tokenizer=tok, num_kv_blocks=64)
    eng = AsyncLLMEngine(engine=inner)

    def broken_step():
        raise RuntimeError("device lost")

    inner.step = broken_step
    try:
        async def main():
            with pytest.raises(EngineDeadError, match="device lost"):
                await _collect(eng, "Once upon a time", SamplingParams(max_tokens=5))

        asyncio.run(main())
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown()


# -- no hangs: deadlines, shutdown, a stuck step, a seed no generator takes ----------------------
def _stories_engine(stories_paths, **kw):
    model, tok = stories_paths
    return AsyncLLMEngine(engine=LLMEngine(model=model, tokenizer=tok, num_kv_blocks=64), **kw)


def test_a_request_past_its_deadline_is_aborted_and_its_blocks_freed(stories_paths):
    from app.engine.errors import RequestTimeoutError

    eng = _stories_engine(stories_paths, request_timeout_s=0.3)
    try:
        free = eng.engine.kv_manager.num_free_blocks
        real_step = eng.engine.step

        def slow_step():  # each step takes 0.1 s: 200 tokens cannot finish in 0.3 s
            import time

            time.sleep(0.1)
            return real_step()

        eng.engine.step = slow_step
        with pytest.raises(RequestTimeoutError, match="deadline"):
            asyncio.run(_collect(eng, "Once upon a time", SamplingParams(temperature=0, max_tokens=200)))
        eng.engine.step = real_step
        for _ in range(100):
            if not eng.engine.has_unfinished_requests():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert eng.engine.kv_manager.num_free_blocks == free and not eng.is_dead
        outs = asyncio.run(_collect(eng, "One day", SamplingParams(temperature=0, max_tokens=4)))
        assert outs[-1].finish_reason == "length"
    finally:
        eng.shutdown()


def test_a_deadline_holds_even_when_the_engine_thread_is_stuck(stories_paths):
    """The caller's own timer ends the stream: a step that never returns cannot hang a client."""
    import threading

    from app.engine.errors import RequestTimeoutError

    eng = _stories_engine(stories_paths, request_timeout_s=0.3, step_timeout_s=0.2)
    release = threading.Event()
    real_step = eng.engine.step
    eng.engine.step = lambda: (release.wait(10), real_step())[1]
    try:
        with pytest.raises(RequestTimeoutError):
            asyncio.run(_collect(eng, "Once upon a time", SamplingParams(max_tokens=4)))
        # the watchdog: a step running past step_timeout_s fails the health check
        with pytest.raises(EngineDeadError, match="step_timeout_s"):
            eng.check_health()
    finally:
        release.set()
        eng.engine.step = real_step
        eng.shutdown()


def test_shutdown_fails_open_streams(stories_paths):
    eng = _stories_engine(stories_paths)

    async def main():
        agen = eng.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        await anext(agen)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in agen:
                pass

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(eng, "One day", SamplingParams(max_tokens=2)))


def test_a_seed_no_generator_takes_fails_only_its_request(stories_paths):
    """Validation refuses seeds past 64 bits; if one got through anyway (here: set after validation),
    the runner fails that request alone instead of the engine loop."""
    from app.engine.errors import RequestFailedError
    from app.engine.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="64-bit"):
        SamplingParams(seed=2 ** 64)
    eng = _stories_engine(stories_paths)
    try:
        bad = SamplingParams(temperature=0.7, max_tokens=8)
        bad.seed = 2 ** 64
        good = SamplingParams(temperature=0, max_tokens=8)

        async def main():
            return await asyncio.gather(_collect(eng, "Once upon a time", bad), _collect(eng, "One day", good),
                                        return_exceptions=True)

        failed, ok = asyncio.run(main())
        assert isinstance(failed, RequestFailedError) and "seed" in str(failed)
        assert ok[-1].finish_reason == "length" and not eng.is_dead
    finally:
        eng.shutdown()


def test_caller_block_hashes_are_used_and_wrong_ones_change_no_output(engine, monkeypatch):
    """The ingress passes the prompt's block hashes (it computed them to route): the engine uses them
    instead of hashing again, and hashes that do not belong to the prompt (another prompt's, the
    wrong count) cost prefix-cache hits at most, never a wrong token, theirs or anyone else's."""
    from app.kv_events.block_hash import hash_request_tokens

    bs = engine.engine.kv_manager.block_size
    ids_a = engine.engine.tokenizer.encode("Once upon a time, there was a little girl named Lily. " * 6)
    ids_b = engine.engine.tokenizer.encode("One day, a big red dog ran into the park to play with a ball. " * 6)
    assert len(ids_a) >= 3 * bs and len(ids_b) >= 3 * bs
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def text(prompt, **kw):
        outs = asyncio.run(_collect_kw(engine, prompt, params, **kw))
        return "".join(o.delta_text for o in outs), outs[0].num_cached_tokens

    alone_a, _ = text(ids_a)
    alone_b, _ = text(ids_b)
    hashes_a = hash_request_tokens(ids_a, bs)
    # the right hashes: the same text, and the next request with that prompt hits the cache
    assert text(ids_a, block_hashes=hashes_a)[0] == alone_a
    again, cached = text(ids_a, block_hashes=hashes_a)
    assert again == alone_a and cached >= bs
    # used: the engine does not hash a prompt whose hashes it was given
    import app.engine.sequence as sequence

    calls = []
    monkeypatch.setattr(sequence, "hash_request_tokens", lambda *a, **k: calls.append(1) or hash_request_tokens(*a, **k))
    one = SamplingParams(temperature=0, max_tokens=1)
    asyncio.run(_collect_kw(engine, ids_a, one, block_hashes=hashes_a))
    assert calls == []
    asyncio.run(_collect_kw(engine, ids_a, one))
    assert calls == [1]
    # b's prompt under a's hashes (a lying caller): b's own text; then a and b as before
    lying = (hashes_a * 2)[:len(ids_b) // bs]
    assert text(ids_b, block_hashes=lying)[0] == alone_b
    assert text(ids_a)[0] == alone_a
    assert text(ids_b)[0] == alone_b
    # the wrong count is ignored
    assert text(ids_b, block_hashes=[1, 2])[0] == alone_b


async def _collect_kw(eng, prompt, params, **kw):
    return [o async for o in eng.generate(prompt, params, **kw)]
