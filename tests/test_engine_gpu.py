"""CUDA-graph decode on a GPU: replaying the captured graphs gives the tokens eager steps give.

Skipped without CUDA (CI has none); run on the GPU machine with
`TRITON_INTERPRET=0 python3 -m pytest -q tests/test_engine_gpu.py`. The model is stories260K
copied exactly into head_dim-128 shapes (app/engine/widen.py), so greedy tokens have the trained
model's margins and the kernels (Gluon fp4 decode included) serve the cache.
"""

import dataclasses
import json
import random

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.loader import load_model
from app.engine.model_source import DUMMY_MODELS
from app.engine.models.config import ModelConfig
from app.engine.model_runner import graph_batch_sizes
from app.engine.widen import copy_widened, widen_config
from app.kernels import decode_fp4_gluon, paged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or paged.interpreting(),
                                reason="needs CUDA (and TRITON_INTERPRET unset)")

SHAPES = {
    "small": ModelConfig(vocab_size=1, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "8B": dataclasses.replace(DUMMY_MODELS["llama-3.1-8b"]),
}
WORDS = ["Once upon a time", "The little dog", "Lily and Tom", "One day, a big bear", "Tim had a red car",
         "The sun was hot", "Sue wanted to bake", "Max was sad", "A cat sat", "The bird flew"]


def _widened(stories_paths, tmp_path, shape, dtype="bfloat16", **kw):
    model_path, tokenizer = stories_paths
    small, small_config = load_model(model_path)
    (tmp_path / "config.json").write_text(json.dumps(widen_config(small_config, SHAPES[shape]).to_hf()))
    llm = LLM(model=str(tmp_path), load_format="dummy", tokenizer=tokenizer, device="cuda", dtype=dtype, **kw)
    copy_widened(small, llm.engine.model)
    return llm


class _Counted:
    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def replay(self):
        self.replays += 1
        self.graph.replay()


def _count_replays(runner, eager: bool) -> dict:
    """The runner's decode graphs (none when eager), each wrapped to count its replays: size -> _Counted."""
    assert bool(runner.graphs) != eager, runner.graphs_disabled_reason
    counted = {}
    for size, (graph, logits) in list(runner.graphs.items()):
        counted[size] = _Counted(graph)
        runner.graphs[size] = (counted[size], logits)
    return counted


def _run(llm, prompts, params, abort_at):
    """Step to completion; abort request abort_at[k] after step k. Outputs by request id."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason)
        if step in abort_at:
            for out in engine.abort_request(abort_at[step]):
                done[out.request_id] = (out.token_ids, out.finish_reason)
        step += 1
    return done


# the fp4 layout the Gluon kernel's KG8 build reads: key groups of 8 without key outlier slots
KG8 = {"key_group_size": 8, "key_outliers": 0}


@pytest.mark.parametrize("shape", ["small", "8B"])
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp4", "fp4-kg8"])
def test_graph_replay_equals_eager(stories_paths, tmp_path, shape, kv_cache_dtype, monkeypatch):
    """Greedy and seeded tokens with decode graphs equal enforce_eager's, every bucket replayed,
    with preemption (a small cache) and aborts mid-run; fp4-kg8 is fp4 with key groups of 8 and no key
    slots, which the Gluon kernel serves with its KG8 build."""
    rng = random.Random(0)
    prompts = [rng.choice(WORDS) + " " + rng.choice(WORDS) for _ in range(24)]
    params = [SamplingParams(temperature=0 if i % 4 else 0.7, seed=i, max_tokens=rng.randrange(8, 64),
                             ignore_eos=True) for i in range(24)]
    abort_at = {6: "r3", 20: "r10"}
    fp4 = KG8 if kv_cache_dtype == "fp4-kg8" else {}
    kg8_launched = []  # KG8 of every Gluon decode launch (eager steps and graph captures)
    launch_run = decode_fp4_gluon.Launch.run

    def observed_run(self, *args, **kwargs):
        kg8_launched.append(self.constexprs["KG8"])
        return launch_run(self, *args, **kwargs)

    monkeypatch.setattr(decode_fp4_gluon.Launch, "run", observed_run)
    kw = dict(kv_cache_dtype=kv_cache_dtype.split("-")[0], fp4=fp4, max_num_seqs=16, num_kv_blocks=20, block_size=16,
              max_model_len=256, enable_prefix_caching=True,
              async_scheduling=False)  # its schedule replays every bucket; async: the test below
    results = {}
    for eager in (True, False):
        llm = _widened(stories_paths, tmp_path, shape, enforce_eager=eager, **kw)
        runner = llm.engine.executor.runner
        counted = _count_replays(runner, eager)
        results[eager] = _run(llm, prompts, params, abort_at)
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
        if not eager:
            assert sorted(counted) == graph_batch_sizes(16)
            assert all(c.replays for c in counted.values()), {s: c.replays for s, c in counted.items()}
        del llm, runner
        torch.cuda.empty_cache()
    assert results[True] == results[False]
    if kv_cache_dtype.startswith("fp4"):  # head_dim 128: the Gluon kernel decoded, KG8 exactly for fp4-kg8
        assert kg8_launched and set(kg8_launched) == {kv_cache_dtype == "fp4-kg8"}, set(kg8_launched)


@torch.no_grad()
def _as_family(model, family: str) -> None:
    """Give the widened model (zero heads beyond stories260K's) its family's extra weights.

    qwen2: random q/k/v biases on the heads the small model does not use (query heads whose o_proj
    columns are zero, KV heads only they read): they flow through RoPE, the cache and attention but
    not into the output, so the model still computes stories260K. qwen3: q/k norm weights 1 (the copy
    zeroed them); this changes the function (each head normalized), so its margins are not the trained
    model's."""
    c = model.config
    D, G = c.head_dim, c.num_attention_heads // c.num_key_value_heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer in model.model.layers:
        attn = layer.self_attn
        if family == "qwen2":
            o = attn.o_proj.weight.view(c.hidden_size, c.num_attention_heads, D)
            idle_q = [h for h in range(c.num_attention_heads) if not o[:, h].any()]
            idle_kv = [k for k in range(c.num_key_value_heads) if all(k * G + i in idle_q for i in range(G))]
            assert idle_q and idle_kv
            for proj, heads in ((attn.q_proj, idle_q), (attn.k_proj, idle_kv), (attn.v_proj, idle_kv)):
                for h in heads:
                    proj.bias[h * D:(h + 1) * D] = torch.randn(D, device="cuda", generator=gen).to(proj.bias.dtype)
        elif family == "qwen3":
            attn.q_norm.weight.fill_(1.0)
            attn.k_norm.weight.fill_(1.0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp4"])
def test_graph_replay_equals_eager_for_each_family(stories_paths, tmp_path, family, kv_cache_dtype):
    """Each family's layers (Qwen2's biased fused projection, Qwen3's per-head q/k RMSNorm kernel
    before RoPE) captured in decode graphs give the eager path's greedy tokens: exactly where the model
    still computes stories260K (llama, mistral, qwen2); for qwen3, whose normalized heads have no trained
    margins, two runs part, if at all, only at a near-tie (each run's token the other's second choice)."""
    rng = random.Random(4)
    prompts = [rng.choice(WORDS) + " " + rng.choice(WORDS) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    shape = dataclasses.replace(SHAPES["small"], family=family)
    model_path, tokenizer = stories_paths
    small, small_config = load_model(model_path)
    (tmp_path / "config.json").write_text(json.dumps(widen_config(small_config, shape).to_hf()))
    results = {}
    for eager in (True, False):
        llm = LLM(model=str(tmp_path), load_format="dummy", tokenizer=tokenizer, device="cuda", dtype="bfloat16",
                  kv_cache_dtype=kv_cache_dtype, max_num_seqs=16, num_kv_blocks=256, max_model_len=256,
                  enforce_eager=eager, async_scheduling=False)
        model = llm.engine.model
        assert model.config.family == family and model.model.layers[0].self_attn.use_kernels
        copy_widened(small, model)
        _as_family(model, family)
        runner = llm.engine.executor.runner
        counted = _count_replays(runner, eager)
        results[eager] = llm.generate(prompts, params)
        if not eager:
            assert any(c.replays for c in counted.values())
        del llm, runner, model
        torch.cuda.empty_cache()
    if family == "qwen3":
        for x, y in zip(results[True], results[False]):
            _assert_parts_at_near_tie(x, y)
    else:
        assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]


def test_nonfinite_kv_fails_one_request_on_gpu(stories_paths, tmp_path):
    """A NaN in one request's K/V (a poisoned embedding row of its prompt) fails that request with
    finish_reason 'error' through the store kernel's flags; the others, batched with it and then
    decoded by graph replay, give the tokens they give alone; no block leaks."""
    llm = _widened(stories_paths, tmp_path, "small", kv_cache_dtype="fp4", max_num_seqs=8, num_kv_blocks=64,
                   max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [llm.tokenizer.encode(w) for w in WORDS[:3]]
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    # a token neither the prompts nor their continuations use, so only the poisoned request meets it
    used = {t for ids in prompts + alone for t in ids}
    poison = next(t for t in range(llm.engine.vocab_size - 1, 0, -1) if t not in used)
    model = llm.engine.model
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie: only its input
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    runner = llm.engine.executor.runner
    runner.graphs = {}
    runner.capture_graphs()  # graphs hold the old lm_head weight's address
    outs = llm.generate(prompts + [prompts[0][:2] + [poison] + prompts[1]], params)
    assert [o.token_ids for o in outs[:3]] == alone
    assert outs[3].finish_reason == "error" and "non-finite" in outs[3].error
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks


def test_kv_cache_beyond_the_gpu_share_fails_start_with_the_settings_named(stories_paths, tmp_path):
    """A KV cache larger than the engine's share of the GPU (gpu_fraction caps its allocator) fails
    the engine's start with KVCacheAllocationError naming the settings that size the cache, not a
    hang or a bare CUDA out-of-memory; the memory it took is given back."""
    from app.engine.model_runner import KVCacheAllocationError

    import gc

    gc.collect()  # what earlier tests' engines left to collect: the share caps this whole process
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    # room for the model (~0.2 GiB) beyond what the process holds, not for 4 GiB of KV
    share = (torch.cuda.memory_reserved() + 1.5 * 2**30) / torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(KVCacheAllocationError, match="kv_cache_memory") as info:
        _widened(stories_paths, tmp_path, "small", kv_cache_dtype="fp4", gpu_fraction=share, kv_cache_memory="4GiB",
                 max_num_seqs=256, max_model_len=512)
    assert "OutOfMemoryError" in str(info.value) and "max_num_seqs" in str(info.value)
    del info
    gc.collect()
    assert torch.cuda.memory_allocated() - before < 2**28  # not the weights or a partial cache left behind
    torch.cuda.set_per_process_memory_fraction(1.0)


def _async_and_sync(stories_paths, tmp_path, prompts, params, **kw):
    """Outputs of the same requests without and with async scheduling (decode graphs in both)."""
    results = {}
    for mode in (False, True):
        llm = _widened(stories_paths, tmp_path, "small", async_scheduling=mode, **kw)
        assert llm.engine.async_scheduling == mode and llm.engine.executor.runner.graphs
        outs = llm.generate(prompts, params)
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
        results[mode] = (outs, llm.engine.scheduler.num_preemptions_total)
        del llm
        torch.cuda.empty_cache()
    return results


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp4"])
def test_async_scheduling_equals_sync_on_gpu(stories_paths, tmp_path, kv_cache_dtype):
    """Async scheduling (the default on CUDA: step N + 1 launched before step N's tokens reach the
    host, its decode inputs filled in on the device, then replayed from a graph) gives the
    synchronous engine's tokens, greedy and seeded, when both run the same batches: every request
    admitted at once, each ending by length (known when scheduling, so no step is launched past it)."""
    rng = random.Random(1)
    prompts = [rng.choice(WORDS) + " " + rng.choice(WORDS) for _ in range(24)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=rng.randrange(4, 120),
                             ignore_eos=True) for i in range(24)]
    results = _async_and_sync(stories_paths, tmp_path, prompts, params, kv_cache_dtype=kv_cache_dtype,
                              max_num_seqs=32, num_kv_blocks=512, max_model_len=256)
    assert [o.token_ids for o in results[True][0]] == [o.token_ids for o in results[False][0]]


def test_async_scheduling_with_stops_and_preemption_on_gpu(stories_paths, tmp_path):
    """Requests that stop on their end-of-story token or a stop string (async mode computes one step
    more for them, whose token is dropped) and preemption (a small cache): the synchronous engine's
    greedy tokens, bf16 KV, up to a near-tie. The two modes run different batches (preemptions fall
    on other steps, so a preempted request's tokens are recomputed by a prefill in one mode where the
    other decoded them), and half-precision rounding of those paths moves log-probabilities by a few
    hundredths of a nat: on an H100, 9 of 24 continuations parted in bf16 (at every commit back to
    5d9999d, with and without the start-up warm-up), fp16 parted too, and the CPU in float32 gives
    equal tokens. So a continuation may part from the other mode's only where both runs' tokens are
    within 0.1 nats of each other's best (_assert_parts_at_near_tie), and most must not part at all.
    Seeded sampling through async steps is compared exactly where the batches are the same
    (test_async_scheduling_equals_sync_on_gpu)."""
    rng = random.Random(2)
    prompts = ["Once upon a time" if i % 5 == 0 else rng.choice(WORDS) + " " + rng.choice(WORDS) for i in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(4, 200), logprobs=2,
                             stop=["Lily"] if i % 5 == 0 else None) for i in range(24)]
    results = _async_and_sync(stories_paths, tmp_path, prompts, params, kv_cache_dtype="bf16", max_num_seqs=16,
                              num_kv_blocks=24, max_model_len=256)
    for mode in (False, True):
        outs, preemptions = results[mode]
        assert preemptions > 0 and {o.finish_reason for o in outs} == {"stop", "length"}
    same = 0
    for x, y in zip(results[True][0], results[False][0]):
        _assert_parts_at_near_tie(x, y)
        if x.token_ids == y.token_ids:
            assert (x.finish_reason, x.text) == (y.finish_reason, y.text)
            same += 1
    assert same >= 0.6 * len(prompts), same


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8", "fp4"])
def test_chunked_prefill_equals_one_shot_on_gpu(stories_paths, tmp_path, kv_cache_dtype):
    """The GPU prefill path (app/engine/prefill_plan.py) gives a chunked prompt (chunks of 48 tokens
    over its cached context, mixed with other requests' decodes) the log-probabilities and greedy
    tokens a one-shot prefill of it alone gives. Both read the context through the same pages, so
    only rounding separates them (GEMMs of other sizes; fp8/fp4 split plans that follow the batch):
    every prompt log-probability within 0.05 nats, and where two greedy continuations part, they
    part at a near-tie: each run's token is the other's second choice, less than 0.1 nats behind."""
    rng = random.Random(3)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 24))) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0, logprobs=2)
    common = dict(kv_cache_dtype=kv_cache_dtype, max_num_seqs=16, num_kv_blocks=512, max_model_len=512,
                  enable_prefix_caching=False)
    llm = _widened(stories_paths, tmp_path, "small", max_num_batched_tokens=4096, **common)
    alone = [llm.generate([p], params)[0] for p in prompts]
    del llm
    torch.cuda.empty_cache()
    llm = _widened(stories_paths, tmp_path, "small", max_num_batched_tokens=48, **common)
    chunked = llm.generate(prompts, params)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
    del llm
    torch.cuda.empty_cache()
    assert max(len(o.prompt_token_ids) for o in alone) > 96  # prompts of several chunks
    worst = max(abs(a[t].logprob - b[t].logprob) for x, y in zip(alone, chunked)
                for t, a, b in zip(x.prompt_token_ids[1:], x.prompt_logprobs[1:], y.prompt_logprobs[1:]))
    assert worst < 0.05, worst
    for x, y in zip(alone, chunked):
        _assert_parts_at_near_tie(x, y)
    same = sum(x.token_ids == y.token_ids for x, y in zip(alone, chunked))
    assert same >= 0.75 * len(prompts), same


def _assert_parts_at_near_tie(x, y, gap=0.1):
    """Two greedy continuations of one prompt are equal, or equal up to a position where each run's token
    is (one of) its best and the other run's token is among its two best, within `gap` nats (a
    rounding-sized near-tie; at an exact tie the greedy pick and the top-logprob order may name either).
    Equal up to the shorter one's end is not enough: that one stopped where the other went on."""
    i = next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), None)
    if i is None:  # no token parts them: then neither may stop where the other goes on
        assert len(x.token_ids) == len(y.token_ids), (x.token_ids, y.token_ids)
        return
    for own, other in ((x, y), (y, x)):
        top = dict(own.top_logprobs[i][:2])
        best = max(top.values())
        assert own.token_ids[i] in top and other.token_ids[i] in top, (i, own.top_logprobs[i], other.token_ids[i])
        assert best - top[own.token_ids[i]] < 1e-6 and best - top[other.token_ids[i]] < gap, (i, own.top_logprobs[i])


_SERVING_SHAPES = r"""
import json, random, sys
from app import LLM, SamplingParams
llm = LLM(model="llama-3.1-8b", load_format="dummy", device="cuda", kv_cache_dtype=sys.argv[1],
          kv_cache_memory="2GiB", max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=2048,
          **json.loads(sys.argv[2]))
engine, rng = llm.engine, random.Random(0)
before = engine.stats()["kernel_compiles_total"]
shared = [rng.randrange(100, 30000) for _ in range(1024)]
# arrivals while others decode (mixed steps of every size), prefix hits on a shared 1k prefix, chunked
# prompts up to 6k tokens (long splits), a batch of one and of many decodes
waves = [[rng.choice([8, 40, 300, 1500, 3000, 6000]) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
step = n = 0
for wave in waves:
    for length in wave:
        ids = (shared if rng.random() < 0.5 else []) + [rng.randrange(100, 30000) for _ in range(length)]
        engine.add_request(f"r{n}", ids, SamplingParams(max_tokens=rng.randrange(1, 80), ignore_eos=True)); n += 1
    for _ in range(rng.randrange(1, 40)):
        engine.step(); step += 1
while engine.has_unfinished_requests():
    engine.step(); step += 1
s = engine.stats()
print(json.dumps({"requests": n, "steps": step, "serving": s["kernel_compiles_serving_total"],
                  "start_up": before, "free": s["num_free_kv_blocks"] == s["num_kv_blocks"]}))
"""


@pytest.mark.parametrize("kv_cache_dtype,extra", [("bf16", {}), ("fp8", {}), ("fp4", {}), ("fp8-fp4", {}),
                                                  ("fp4", {"fp4": {"rotate": True}})],
                         ids=["bf16", "fp8", "fp4", "fp8-fp4", "fp4-rotated"])
def test_no_kernel_compiles_while_serving(kv_cache_dtype, extra):
    """A fresh process (Triton's in-memory caches empty; its disk cache loads count as compiles too)
    starts an 8B-shaped engine (each KV format; fp4 rotated too, whose store gets float32) and serves
    a varied load: prompts from 8 to 7k tokens arriving while others decode, prefix hits, chunked
    prefill. Every kernel build that load launches was compiled at start-up (the decode graphs,
    KVCache.warm_kernels, the warm-up requests): none while serving."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SERVING_SHAPES, kv_cache_dtype, json.dumps(extra)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["start_up"] > 0 and result["free"], result
    assert result["serving"] == 0, (result, [line for line in done.stderr.splitlines() if "while serving" in line])
