"""Async scheduling (EngineConfig.async_scheduling): step N + 1 is scheduled and launched before
step N's samples reach the host, its decode inputs taken from those samples on the device.

On the CPU a launched step has already run, but the bookkeeping is the GPU's: pending tokens,
tokens in flight, requests that finish, fail, get preempted or aborted while the next step is
launched. Every output must equal the synchronous engine's exactly (float32, stories260K), and
no KV block may leak.
"""

import pytest

from app import SamplingParams
from app.config import EngineConfig
from app.engine.engine import LLMEngine, resolve_async_scheduling
from app.engine.executor import LocalExecutor

from test_engine import PROMPTS, STORY, stories_llm


def _workload():
    """(prompt, params) pairs that exercise what async scheduling has to get right."""
    greedy = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in PROMPTS[:4]]
    return greedy + [
        ("Once upon a time", SamplingParams(temperature=0, max_tokens=200)),  # ends on its end-of-story token
        ("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"])),  # a stop string
        (PROMPTS[5], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=11)),  # seeded sampling
        (PROMPTS[6], SamplingParams(temperature=0, max_tokens=1)),  # one token
        (PROMPTS[7], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)),  # the prompt only
        (PROMPTS[3], SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1)),
        (STORY, SamplingParams(temperature=0.7, max_tokens=12, n=3, seed=5)),  # choices share the prompt
        (PROMPTS[4], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[13], ignore_eos=True)),
    ]


def _summary(out):
    """What must be equal exactly (not num_cached_tokens: async mode caches a step's blocks one step later,
    so a request admitted meanwhile may find fewer). Log-probs are compared apart: a request that stops on EOS computes one
    token more in async mode, so later steps run other batches and prompts other chunks, and the values
    move with those (float32 products round with the number of rows; with a bf16 or fp4 cache a prompt
    chunk of one token takes the decode kernel, whose rounding differs from the prefill kernel's: up to
    5e-3 on stories260K's prompt log-probs in the synchronous engine too, chunks of 7 against one)."""
    return (out.request_id, out.index, out.token_ids, out.text, out.finish_reason, out.stop_reason,
            _ids(out.top_logprobs), _prompt_ids(out.prompt_logprobs), out.prompt_logprobs is None, out.logprobs is None)


def _ids(tops):
    return None if tops is None else [None if t is None else [i for i, _ in t] for t in tops]


def _prompt_ids(prompt_logprobs):
    """The token ids of each position's entries (vLLM's shape: the prompt token, then the N best)."""
    return None if prompt_logprobs is None else [None if d is None else list(d) for d in prompt_logprobs]


def _values(out):
    vals = list(out.logprobs or []) + [e.logprob for d in (out.prompt_logprobs or []) if d for e in d.values()]
    vals += [v for t in (out.top_logprobs or []) if t for _, v in t]
    return vals


def _run(engine, workload, abort_at=None):
    """Submit everything, step to the end; abort_at: {step number: request ids} to abort then.
    Returns (final outputs by (id, index), every delta seen, preemptions observed)."""
    for i, (prompt, params) in enumerate(workload):
        engine.add_request(f"r{i}", prompt, params)
    finals, deltas, preemptions, n = {}, {}, 0, 0
    while engine.has_unfinished_requests():
        for rid in (abort_at or {}).get(n, ()):
            for out in engine.abort_request(rid):
                finals[out.request_id, out.index] = out
        n += 1
        preemptions += sum(s.num_preemptions for s in engine.scheduler.running)
        for out in engine.step():
            deltas.setdefault((out.request_id, out.index), []).extend(out.delta_token_ids)
            if out.finished:
                assert (out.request_id, out.index) not in finals, "a request finished twice"
                finals[out.request_id, out.index] = out
    return finals, deltas, preemptions


@pytest.mark.parametrize("kv", ["bf16", "fp4"])
@pytest.mark.parametrize("setting", [
    dict(),  # plenty of blocks, one-shot prefills
    dict(num_kv_blocks=16, max_num_batched_tokens=48),  # preemption and chunked prefill
    dict(block_size=4, max_num_seqs=3),  # few running at once: requests wait, blocks fill every few tokens
])
def test_async_outputs_equal_sync(stories_paths, kv, setting):
    sync = stories_llm(stories_paths, kv_cache_dtype=kv, async_scheduling=False, **setting).engine
    asyn = stories_llm(stories_paths, kv_cache_dtype=kv, async_scheduling=True, **setting).engine
    assert not sync.async_scheduling and asyn.async_scheduling
    want, want_deltas, _ = _run(sync, _workload())
    got, got_deltas, preemptions = _run(asyn, _workload())
    assert set(got) == set(want)
    for key in want:
        assert _summary(got[key]) == _summary(want[key]), key
        assert _values(got[key]) == pytest.approx(_values(want[key]), rel=1e-2, abs=1e-2), key
        assert got_deltas[key] == want_deltas[key] == want[key].token_ids, key
    if "num_kv_blocks" in setting:
        assert preemptions > 0
    for engine in (sync, asyn):
        assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
        assert not engine.scheduler.requests and engine._in_flight is None
        assert engine.kv_manager.pool.num_cached_blocks > 0  # the prefix cache kept what was computed


def test_async_aborts_while_a_step_is_in_flight(stories_paths):
    """Aborts between steps hit requests that the step in flight is computing: they finish as
    aborted, their late tokens are dropped, the others decode exactly as without the aborts."""
    workload = [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in PROMPTS]
    want, _, _ = _run(stories_llm(stories_paths, async_scheduling=False).engine, workload)
    engine = stories_llm(stories_paths, async_scheduling=True).engine
    got, deltas, _ = _run(engine, workload, abort_at={1: ["r0"], 3: ["r2", "r5"], 9: ["r7"]})
    for i in range(len(PROMPTS)):
        out = got[f"r{i}", 0]
        if i in (0, 2, 5, 7):
            assert out.finish_reason == "abort"
            assert out.token_ids == want[f"r{i}", 0].token_ids[:len(out.token_ids)]
            assert deltas.get((f"r{i}", 0), []) == out.token_ids
        else:
            assert out.token_ids == want[f"r{i}", 0].token_ids
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks and not engine.has_unfinished_requests()


def test_async_returns_each_step_one_call_later(stories_paths):
    """The first call launches and returns nothing; each later call returns the step before."""
    engine = stories_llm(stories_paths, async_scheduling=True).engine
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == []  # the prompt's step is in flight
    assert engine.has_unfinished_requests()
    seq = engine.scheduler.requests["a"]
    assert seq.num_pending_tokens == 1 and seq.num_inflight_tokens == seq.num_prompt_tokens
    (first,) = engine.step()  # the prompt's token; the first decode step is in flight
    assert len(first.delta_token_ids) == 1 and seq.num_pending_tokens == 1
    (second,) = engine.step()
    assert len(second.delta_token_ids) == 1
    # the third token ends the request by length: no step is launched for it after it is sampled
    (third,) = engine.step()
    assert third.finished and third.finish_reason == "length" and len(third.token_ids) == 3
    assert not engine.has_unfinished_requests()


def test_default_is_on_for_cuda_only_and_refused_where_unsupported():
    class NoAsync:
        supports_async = False

    assert resolve_async_scheduling(EngineConfig(device="cpu"), LocalExecutor.__new__(LocalExecutor)) is False
    assert resolve_async_scheduling(EngineConfig(device="cuda"), LocalExecutor.__new__(LocalExecutor)) is True
    assert resolve_async_scheduling(EngineConfig(device="cuda", async_scheduling=False),
                                    LocalExecutor.__new__(LocalExecutor)) is False
    assert resolve_async_scheduling(EngineConfig(device="cuda", tensor_parallel_size=2), NoAsync()) is False
    # the mp executor supports it, but tensor parallelism leaves it off unless asked for
    assert resolve_async_scheduling(EngineConfig(device="cuda", tensor_parallel_size=2),
                                    LocalExecutor.__new__(LocalExecutor)) is False
    with pytest.raises(ValueError, match="the 'ray' executor runs each step to the end"):
        resolve_async_scheduling(EngineConfig(tensor_parallel_size=2, async_scheduling=True,
                                              distributed_executor_backend="ray"), NoAsync())


def test_a_failed_step_in_async_mode_leaves_nothing_in_flight(stories_paths, monkeypatch):
    llm = stories_llm(stories_paths, async_scheduling=True)
    engine = llm.engine
    expected = stories_llm(stories_paths).generate([STORY], SamplingParams(temperature=0, max_tokens=8))[0]
    runner = engine.executor.runner
    original = runner.launch
    calls = []

    def fail_third(step):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return original(step)

    monkeypatch.setattr(runner, "launch", fail_third)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate([STORY], SamplingParams(temperature=0, max_tokens=8))
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
    monkeypatch.setattr(runner, "launch", original)
    assert llm.generate([STORY], SamplingParams(temperature=0, max_tokens=8))[0].token_ids == expected.token_ids


def test_llm_engine_accepts_the_setting(stories_paths):
    model, tok = stories_paths
    engine = LLMEngine(model=model, tokenizer=tok, async_scheduling=True)
    assert engine.async_scheduling


def test_an_id_reused_while_its_old_step_is_in_flight_gets_nothing_of_it(stories_paths):
    """Aborted with a step in flight, then the same id added again: that step's prompt log-probs and
    failure flags belong to the old request (matched by sequence, not by id)."""
    engine = stories_llm(stories_paths, async_scheduling=True).engine
    engine.add_request("r0", STORY, SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1))
    assert engine.step() == []  # the old r0's prompt step is in flight
    engine.abort_request("r0")
    engine.add_request("r0", "Once upon a time", SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (final,) = [o for o in outs if o.finished]
    want = stories_llm(stories_paths).generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=3, prompt_logprobs=1))[0]
    assert len(final.prompt_logprobs) == len(final.prompt_token_ids) == len(want.prompt_token_ids)
    assert final.token_ids == want.token_ids and _prompt_ids(final.prompt_logprobs) == _prompt_ids(want.prompt_logprobs)
    assert [e.logprob for d in final.prompt_logprobs[1:] for e in d.values()] == \
        pytest.approx([e.logprob for d in want.prompt_logprobs[1:] for e in d.values()])
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks


def test_a_failed_launch_keeps_the_step_in_flight(stories_paths, monkeypatch):
    """A launch that raises (here: the scheduler) does not throw away the step in flight, which ran:
    its tokens come with the next call, so seeded requests go on as in the synchronous engine."""
    workload = [(PROMPTS[i], SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True))
                for i in range(4)]
    want, _, _ = _run(stories_llm(stories_paths, async_scheduling=False).engine, workload)
    engine = stories_llm(stories_paths, async_scheduling=True).engine
    for i, (prompt, params) in enumerate(workload):
        engine.add_request(f"r{i}", prompt, params)
    schedule, calls = engine.scheduler.schedule, []

    def fail_fifth():
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", fail_fifth)
    finals, raised = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError:
            raised += 1
            continue
        finals.update({(o.request_id, o.index): o for o in outs if o.finished})
    assert raised == 1
    assert {k: o.token_ids for k, o in finals.items()} == {k: o.token_ids for k, o in want.items()}
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
