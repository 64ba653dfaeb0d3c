"""The model runner's persistent step buffers (app/engine/input_batch.py) and decode padding.

The runner stages each step in buffers allocated once and keeps block tables on the device,
sending only appended block ids. These tests check that bookkeeping against inputs rebuilt from
scratch (the list-based construction the runner used before) on random schedules with prefix
hits, preemption and aborts; and that decode steps padded to a graph bucket (what a CUDA graph
replays) sample the same tokens as unpadded eager steps. On the CPU there are no CUDA graphs: a
stand-in replays the same padded forward eagerly over the same buffers (tests/test_engine_gpu.py
checks real graphs on a GPU).
"""

import random

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.model_runner import graph_batch_sizes


def reference_inputs(runner, step):
    """The step's inputs built from scratch from the runner's request state (plain lists)."""
    bs = runner.block_size
    ids, pos, slots, seq_lens, qsl, rows, tables = [], [], [], [], [0], [], []
    for r in step.requests:
        table = runner.requests[r.request_id].block_table
        for j, tok in enumerate(r.token_ids):
            p = r.start_pos + j
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        seq_lens.append(r.start_pos + len(r.token_ids))
        qsl.append(qsl[-1] + len(r.token_ids))
        if r.do_sample:
            rows.append(qsl[-1] - 1)
        tables.append(list(table))
    return ids, pos, slots, seq_lens, qsl, rows, tables


def check_against_reference(runner, step, inputs):
    ids, pos, slots, seq_lens, qsl, rows, tables = reference_inputs(runner, step)
    t, n = len(ids), len(seq_lens)
    assert inputs.num_tokens == t and inputs.num_seqs == n
    assert inputs.input_ids[:t].tolist() == ids
    assert inputs.positions[:t].tolist() == pos
    assert inputs.meta.slot_mapping[:t].tolist() == slots
    assert inputs.meta.seq_lens_t[:n].tolist() == seq_lens == inputs.meta.seq_lens[:n]
    assert inputs.meta.query_start_loc_t[:n + 1].tolist() == qsl == inputs.meta.query_start_loc[:n + 1]
    assert inputs.sample_rows.tolist() == rows
    for i, table in enumerate(tables):
        assert inputs.meta.block_tables[i, :len(table)].tolist() == table, f"sequence {i}"
    return t, n


def _random_workload(llm, rng, num_requests=24):
    """Prompts sharing prefixes (prefix hits), lengths across block boundaries, mixed max_tokens."""
    vocab = 250
    stems = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    prompts, params = [], []
    for _ in range(num_requests):
        p = list(rng.choice(stems)) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompts.append(p)
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True))
    return prompts, params


def _drive(llm, prompts, params, rng, abort_prob=0.0):
    """Add every request, step to completion, abort some at random; the outputs by request id."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if abort_prob and rng.random() < abort_prob:
            live = [r for r in ids if r not in done]
            for out in engine.abort_request(rng.choice(live)):
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("seed", range(4))
def test_staged_inputs_equal_inputs_built_from_scratch(seed):
    """Every step of a random schedule (prefix hits, preemption from a small cache, aborts) stages
    exactly the inputs a from-scratch construction gives, block tables included."""
    rng = random.Random(seed)
    llm = LLM(model="tiny-llama", num_kv_blocks=24, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=96)
    runner = llm.engine.executor.runner
    prepare = runner.prepare
    checked = {"steps": 0, "tokens": 0}

    def checked_prepare(step):
        inputs = prepare(step)
        t, _ = check_against_reference(runner, step, inputs)
        checked["steps"] += 1
        checked["tokens"] += t
        return inputs

    runner.prepare = checked_prepare
    prompts, params = _random_workload(llm, rng)
    _drive(llm, prompts, params, rng, abort_prob=0.1)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the cache should be small enough to preempt"
    assert llm.engine.scheduler.num_prefix_hit_tokens_total > 0
    assert checked["steps"] > 20
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
    # rows of finished requests come back when their ids reach the runner (with the next step)
    pending = set(llm.engine.executor._messages._finished)
    assert set(runner.requests) <= pending
    assert len(runner.buffers._free_rows) + len(runner.requests) == runner.buffers.table.shape[0]


class EagerReplay:
    """Stands in for a CUDA graph on the CPU: replays the padded decode forward over the buffers
    the graph would have been captured over, into the same fixed logits tensor."""

    def __init__(self, runner, size):
        self.runner = runner
        self.ids, self.pos, self.meta = runner.graph_inputs(size)
        self.logits = torch.empty(size, runner.model.config.vocab_size)
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.logits.copy_(self.runner._decode_logits(self.ids, self.pos, self.meta))


def _with_replays(llm):
    runner = llm.engine.executor.runner
    stands = {}
    for size in graph_batch_sizes(llm.engine.config.max_num_seqs):
        stands[size] = EagerReplay(runner, size)
        runner.graphs[size] = (stands[size], stands[size].logits)
    return stands


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "fp4"])
def test_padded_decode_steps_sample_what_eager_steps_sample(stories_paths, kv_cache_dtype):
    """Decode steps padded to their bucket (1, 2, 4, 8, 12 here) and run through the graph path give
    the same greedy and seeded tokens as plain eager steps, with preemption and aborts mid-run; and
    padding never writes the cache (its slot is -1)."""
    model, tokenizer = stories_paths
    kw = dict(model=model, tokenizer=tokenizer, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=40, block_size=8,
              max_num_seqs=12, max_num_batched_tokens=96)
    rng = random.Random(3)
    words = ["Once upon a time", "The little dog", "Lily and Tom", "One day, a big bear", "Tim had a red car",
             "The sun was hot", "Sue wanted to bake", "Max was sad", "A cat sat", "The bird flew"]
    prompts = [rng.choice(words) + " " + rng.choice(words) for _ in range(20)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=rng.randrange(4, 40),
                             ignore_eos=True) for i in range(20)]
    results = []
    for graphs in (False, True):
        llm = LLM(**kw)
        stands = _with_replays(llm) if graphs else {}
        done = _drive(llm, prompts, params, random.Random(7), abort_prob=0.05)
        results.append({rid: (o.token_ids, o.finish_reason) for rid, o in done.items()})
        assert llm.engine.scheduler.num_preemptions_total > 0
        if graphs:
            used = {s for s, st in stands.items() if st.replays}
            assert {1, 12} <= used and len(used) >= 4, f"buckets replayed: {sorted(used)}"
    assert results[0] == results[1]


def test_padding_rows_never_touch_the_cache():
    llm = LLM(model="tiny-llama", kv_cache_dtype="fp4", num_kv_blocks=16, max_num_seqs=8)
    runner = llm.engine.executor.runner
    before = [t.clone() for page in runner.kv_cache.pages for t in page]
    ids, pos, meta = runner.graph_inputs(8)
    assert meta.slot_mapping.tolist() == [-1] * 8 and meta.seq_lens_t.tolist() == [1] * 8
    with torch.inference_mode():
        runner._decode_logits(ids, pos, meta)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for page in runner.kv_cache.pages for t in page]))


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
