"""TP=2 on CPU (gloo; two Ray actors, or two worker processes of the mp executor) against TP=1: same greedy tokens, same seeded samples,
logprobs within float32 noise, on the dummy model, stories260K and a model of each family, through chunked prefill,
prefix-cache hits and preemption. Plus: the KV heads are split (each rank holds half the bytes
per token), workers follow the caller's placement group, and a dead worker is an engine error.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from app import LLM, SamplingParams
from app.engine.errors import EngineDeadError
from app.engine.placement import PLACEMENT_STRATEGY, placement_bundles

from families_testing import FAMILY_NAMES, save_hf_dir, tiny_config
from tp_testing import ReplicaStandIn, run_in_placement_group

STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked to play with his "
         "ball in the park every day. One day, Tim saw a little cat under a tree.")
TURN_2 = " The cat was sad because it was lost. Tim wanted to help the cat find its home."
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=7, logprobs=0)
# TP sums each row-parallel product as two partial sums plus an all-reduce: float32 noise
# (~1e-7 relative), which is all the difference with fp32 KV. A quantized cache rounds K/V, and an
# element within that noise of a rounding boundary rounds the other way; bf16's fine steps put
# many elements near one. Measured on stories260K with TP=1 alone, weights scaled by 1 + 1e-7 * N(0, 1):
# bf16 KV logprobs move by up to 0.006 (sampled token) and 0.055 (top-5), fp32 KV by 1e-5. So the
# tight bound is for fp32 KV; quantized formats get the bound that noise alone needs. Greedy
# tokens must be identical in every format.
LOGPROB_ATOL = {"fp32": 1e-4, "bf16": 0.1, "fp4": 0.1}


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def model_kwargs(name, stories_paths):
    """float32 compute: TP sums partial products in another order, exact only where no rounding to
    bf16 sits between them."""
    if name == "tiny":
        return dict(model="tiny-llama", dtype="float32")
    model, tok = stories_paths
    return dict(model=model, tokenizer=tok, dtype="float32")


def run_workload(llm):
    """A batch of different lengths in 16-token chunks, then a second turn that hits the prefix
    cache, alongside a seeded sampled request."""
    first = llm.generate([STORY, STORY[:40], STORY[:9]], [GREEDY, GREEDY, SEEDED])
    second = llm.generate([STORY + TURN_2, STORY[:40]], [GREEDY, SEEDED])
    return first + second


def assert_same_outputs(tp1, tp2, atol):
    for a, b in zip(tp1, tp2, strict=True):
        assert a.token_ids == b.token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < atol
        for top_a, top_b in zip(a.top_logprobs, b.top_logprobs):
            assert [v for _, v in top_a] == pytest.approx([v for _, v in top_b], abs=atol)


@pytest.mark.parametrize("backend, model, kv", [
    ("ray", "tiny", "bf16"), ("ray", "stories", "fp32"), ("ray", "stories", "fp4"), ("mp", "tiny", "fp4"),
    ("mp", "stories", "bf16"), ("mp", "stories", "fp4")])
def test_tp2_matches_tp1(stories_paths, backend, model, kv):
    config = dict(model_kwargs(model, stories_paths), kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=16,
                  kv_cache_memory="1MiB")
    tp1 = LLM(**config)
    expected = run_workload(tp1)
    tp2 = LLM(tensor_parallel_size=2, distributed_executor_backend=backend, **config)
    try:
        got = run_workload(tp2)
        info = tp2.engine.worker_info()
        # Each rank holds half the KV heads: the same per-rank budget holds twice the blocks.
        assert abs(tp2.engine.num_kv_blocks - 2 * tp1.engine.num_kv_blocks) <= 1
    finally:
        tp2.engine.shutdown()
    assert_same_outputs(expected, got, LOGPROB_ATOL[kv])
    assert got[3].num_cached_tokens >= len(tp1.tokenizer.encode(STORY)) - 4  # the second turn hit the cache
    assert [i["rank"] for i in info] == [0, 1] and len({i["pid"] for i in info} | {os.getpid()}) == 3
    assert {i["device"] for i in info} == {"cpu"}
    if backend == "ray":
        assert all(i["gpu_ids"] == [] for i in info)
        assert len({i["node_id"] for i in info}) == 1 and [i["bundle_index"] for i in info] == [0, 1]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tp2_matches_tp1_for_each_family(tmp_path, family):
    """Each family's model (a transformers save_pretrained directory) under TP=2 (mp executor): the
    TP=1 tokens and logprobs through chunked prefill and a prefix hit. Qwen2's q/k/v biases are split
    with their rows, Qwen3's q/k norms (per head_dim) replicated."""
    save_hf_dir(tmp_path, tiny_config(family, tie=family == "qwen2"), seed=3)
    config = dict(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", block_size=4,
                  max_num_batched_tokens=16, kv_cache_memory="1MiB")
    tp1 = LLM(**config)
    expected = run_workload(tp1)
    tp2 = LLM(tensor_parallel_size=2, distributed_executor_backend="mp", **config)
    try:
        got = run_workload(tp2)
    finally:
        tp2.engine.shutdown()
    assert_same_outputs(expected, got, LOGPROB_ATOL["fp32"])
    assert got[3].num_cached_tokens >= len(tp1.tokenizer.encode(STORY)) - 4


@pytest.mark.parametrize("backend", ["ray", "mp"])
def test_tp2_preemption_matches_tp1(stories_paths, backend):
    config = dict(model_kwargs("stories", stories_paths), block_size=4, max_num_batched_tokens=32, num_kv_blocks=40)
    prompts = [STORY[: 30 + 20 * i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tp1 = LLM(**config)
    expected = [o.token_ids for o in tp1.generate(prompts, params)]
    assert tp1.engine.scheduler.num_preemptions_total > 0
    tp2 = LLM(tensor_parallel_size=2, distributed_executor_backend=backend, **config)
    try:
        got = [o.token_ids for o in tp2.generate(prompts, params)]
        assert tp2.engine.scheduler.num_preemptions_total == tp1.engine.scheduler.num_preemptions_total
    finally:
        tp2.engine.shutdown()
    assert got == expected


@pytest.mark.parametrize("kv", ["fp32", "fp4"])
def test_tp2_mp_with_async_scheduling_matches_tp1(stories_paths, kv):
    """Async scheduling with the mp executor: each rank launches step N + 1 before it answers step N,
    and the other ranks take step N's samples from rank 0 by a broadcast. The tokens of the
    synchronous TP=1 engine: chunked prefill, prefix hits and seeded sampling (run_workload), then
    requests that stop (end of story, a stop string) while others run, and preemption."""
    config = dict(model_kwargs("stories", stories_paths), kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=16,
                  num_kv_blocks=40)
    prompts = ["Once upon a time"] * 2 + [STORY[: 30 + 20 * i] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=150), SamplingParams(temperature=0, max_tokens=40, stop=["Lily"])]
    params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4
    tp1 = LLM(**config)
    expected = run_workload(tp1)
    expected_more = [(o.token_ids, o.finish_reason) for o in tp1.generate(prompts, params)]
    assert tp1.engine.scheduler.num_preemptions_total > 0
    assert {r for _, r in expected_more} == {"stop", "length"}
    tp2 = LLM(tensor_parallel_size=2, distributed_executor_backend="mp", async_scheduling=True, **config)
    try:
        assert tp2.engine.async_scheduling
        got = run_workload(tp2)
        got_more = [(o.token_ids, o.finish_reason) for o in tp2.generate(prompts, params)]
        assert tp2.engine.kv_manager.num_free_blocks == tp2.engine.num_kv_blocks
    finally:
        tp2.engine.shutdown()
    assert_same_outputs(expected, got, LOGPROB_ATOL[kv])
    assert got_more == expected_more


# with async scheduling in the slow tier (CI time; 17 s): a dead worker under it fails the same
# way, and test_tp2_mp_with_async_scheduling_matches_tp1 keeps async scheduling on mp covered
@pytest.mark.parametrize("backend, async_scheduling",
                         [("ray", False), ("mp", False), pytest.param("mp", True, marks=pytest.mark.slow)])
def test_a_dead_worker_is_an_engine_error_not_a_hang(backend, async_scheduling):
    llm = LLM(model="tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend,
              async_scheduling=async_scheduling)
    engine = llm.engine
    try:
        engine.add_request("r", "hello", SamplingParams(max_tokens=50))
        engine.step()
        if backend == "ray":
            ray.kill(engine.executor.group.workers[1])
        else:
            os.kill(engine.worker_info()[1]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        # (async: the next launch may find rank 1's pipe closed before any answer is due)
        with pytest.raises(EngineDeadError, match="rank 1 ((failed|died) in execute|is gone)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 30
        with pytest.raises(EngineDeadError, match="workers are stopped"):
            engine.step()
    finally:
        engine.shutdown()
    # The next engine starts cleanly.
    again = LLM(model="tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend)
    try:
        assert len(again.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    finally:
        again.engine.shutdown()


@pytest.mark.parametrize("backend", ["ray", "mp"])
def test_a_hung_worker_fails_the_engine_within_execute_timeout_s(backend):
    """Rank 1 frozen (SIGSTOP) mid-run: rank 0 waits in its all-reduce and neither answers; the
    step raises EngineDeadError after execute_timeout_s, not after the collective's 10 minutes."""
    llm = LLM(model="tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend, execute_timeout_s=3)
    engine = llm.engine
    pid = engine.worker_info()[1]["pid"]
    try:
        engine.add_request("r", "hello", SamplingParams(max_tokens=50))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"did not answer execute\(\) within 3 s.*execute_timeout_s"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 15
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        engine.shutdown()


def test_workers_run_on_the_callers_placement_group():
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(placement_bundles(2, 0.1, gpu=False, driver_cpus=0.1), strategy=PLACEMENT_STRATEGY)
    ray.get(pg.ready(), timeout=30)
    try:
        tokens, info = run_in_placement_group(pg, model="tiny-llama", tensor_parallel_size=2,
                                              distributed_executor_backend="ray")
    finally:
        remove_placement_group(pg)
    assert [i["placement_group_id"] for i in info] == [pg.id.hex()] * 2
    assert [i["bundle_index"] for i in info] == [0, 1]
    assert tokens == LLM(model="tiny-llama").generate(["hello"], SamplingParams(temperature=0, max_tokens=8))[0].token_ids


def test_mp_workers_start_inside_a_ray_actor():
    """As in a Ray Serve replica: the engine in a Ray actor spawns its worker processes (the
    actor's main module must not run again in them) and gives TP=1's tokens."""
    expected = LLM(model="tiny-llama").generate("hello", SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    replica = ReplicaStandIn.remote(model="tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert ray.get(replica.generate.remote("hello", 6), timeout=120) == expected
        info = ray.get(replica.worker_info.remote())
        assert [i["rank"] for i in info] == [0, 1]
    finally:
        ray.get(replica.shutdown.remote())
        ray.kill(replica)
