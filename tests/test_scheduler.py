"""Scheduler step by step: schedule(), then update_from_output() with chosen tokens.

No model runs here: the scheduler only needs to be told which token each request sampled.
"""

import random
from collections import Counter

import pytest

from app.engine.kv_cache_manager import KVCacheManager
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import RequestTooLargeError, Scheduler
from app.engine.sequence import Sequence, SequenceStatus

EOS = 2


def make(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_model_len=256, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, budget, max_seqs, max_model_len, eos_token_ids=[EOS])


def req(rid, n, max_tokens=4, start=10, **kw):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **kw))


def step(s, token=7):
    out = s.schedule()
    sampled = {seq.request_id: token for seq, n in out.scheduled if seq.num_computed_tokens + n == seq.num_tokens}
    finished = s.update_from_output(out, sampled)
    return [(seq.request_id, n) for seq, n in out.scheduled], [x.request_id for x in out.preempted], finished


def test_chunked_prefill_then_decode():
    s = make(budget=4)
    a = req("a", 10)
    s.add_request(a)
    assert step(s)[0] == [("a", 4)] and a.block_table == [0] and a.output_token_ids == []
    assert step(s)[0] == [("a", 4)] and a.block_table == [0, 1]
    assert step(s)[0] == [("a", 2)] and a.block_table == [0, 1, 2]
    assert a.output_token_ids == [7] and a.num_computed_tokens == 10
    assert step(s)[0] == [("a", 1)] and a.num_computed_tokens == 11


def test_a_request_awaiting_its_grammar_is_stepped_over():
    """Structured outputs: while its grammar compiles a request waits; the requests behind it are
    admitted, and it is once the flag drops."""
    s = make()
    a, b = req("a", 3, start=100), req("b", 3, start=200)
    a.awaiting_grammar = True
    s.add_request(a)
    s.add_request(b)
    assert step(s)[0] == [("b", 3)] and a.block_table == [] and s.num_waiting == 1
    a.awaiting_grammar = False
    assert step(s)[0] == [("b", 1), ("a", 3)]


def test_running_first_then_waiting_within_budget_and_max_num_seqs():
    s = make(budget=5, max_seqs=2)
    a, b, c = req("a", 3, start=100), req("b", 9, start=200), req("c", 2, start=300)
    s.add_request(a)
    assert step(s)[0] == [("a", 3)]
    s.add_request(b)
    s.add_request(c)
    # a decodes (1 token), b gets the rest of the budget; c waits: max_num_seqs is 2.
    assert step(s)[0] == [("a", 1), ("b", 4)]
    assert step(s)[0] == [("a", 1), ("b", 4)]
    sched, _, finished = step(s)  # a samples its 4th token (max_tokens) and leaves
    assert sched == [("a", 1), ("b", 1)] and [x.request_id for x in finished] == ["a"]
    assert step(s)[0] == [("b", 1), ("c", 2)]


def test_stop_conditions():
    s = make()
    a, b, c = req("a", 3), req("b", 3, stop_token_ids=[9]), req("c", 3, ignore_eos=True, max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    finished = s.update_from_output(out, {"a": EOS, "b": 9, "c": EOS})
    assert [x.request_id for x in finished] == ["a", "b"]
    assert a.status == b.status == SequenceStatus.FINISHED_STOPPED and a.status.finish_reason == "stop"
    out = s.schedule()
    assert s.update_from_output(out, {"c": EOS}) == [c]
    assert c.status == SequenceStatus.FINISHED_LENGTH and c.output_token_ids == [EOS, EOS]
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests()


def test_preempts_newest_and_recomputes_from_its_cached_prefix():
    s = make(num_blocks=4, block_size=2, max_model_len=64)
    a, b = req("a", 4, max_tokens=3, start=10), req("b", 3, max_tokens=4, start=20)
    s.add_request(a)
    s.add_request(b)
    assert step(s)[0] == [("a", 4), ("b", 3)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    # a needs a third block for its 5th token: none free, so b (newest) is preempted.
    sched, preempted, _ = step(s)
    assert preempted == ["b"] and sched == [("a", 1)]
    assert b.status == SequenceStatus.PREEMPTED and b.block_table == [] and b.num_computed_tokens == 0
    assert a.block_table == [0, 1, 3]  # b's tail block (3) was freed first, so reused first
    assert list(s.waiting) == [b]
    # a runs on; b waits while it cannot fit.
    sched, _, finished = step(s)
    assert sched == [("a", 1)] and finished == [a]
    # b resumes: its first block (tokens 20, 21) is still cached in block 2.
    sched, _, _ = step(s)
    assert sched == [("b", 2)] and b.block_table[0] == 2 and b.num_preemptions == 1
    assert b.num_cached_tokens == 0  # counts hits of the first schedule only


def test_preempted_request_preempts_itself_when_alone_among_newer():
    s = make(num_blocks=3, block_size=2)
    a, b = req("a", 2, max_tokens=3, start=10), req("b", 2, max_tokens=3, start=20)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a, b hold blocks 0 and 1 (full), one block free
    sched, preempted, _ = step(s)  # both need a new block; a takes the last one, b preempts itself
    assert sched == [("a", 1)] and preempted == ["b"]


def test_too_large_requests_are_rejected_with_clear_errors():
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(RequestTooLargeError, match=r"max_model_len \(32\)"):
        s.add_request(req("a", 30, max_tokens=3))
    with pytest.raises(RequestTooLargeError, match="needs 5 KV blocks but the cache has 4"):
        s.add_request(req("b", 10, max_tokens=8))
    s.add_request(req("c", 10, max_tokens=7))  # 16 tokens stored at most: exactly 4 blocks
    assert [x.request_id for x in s.waiting] == ["c"]


def test_abort_frees_blocks_everywhere():
    s = make(num_blocks=8, block_size=2, budget=4)
    a, b = req("a", 6), req("b", 2)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests(["a", "b", "unknown"], SequenceStatus.FINISHED_ABORTED)
    assert a.status == SequenceStatus.FINISHED_ABORTED and s.kv.num_free_blocks == 8
    assert not s.running and not s.waiting


def check_invariants(s: Scheduler) -> None:
    refs = Counter(b for seq in s.running for b in seq.block_table)
    for block in s.kv.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0)
    assert s.kv.num_free_blocks == sum(1 for b in s.kv.pool.blocks if b.ref_cnt == 0)
    for seq in s.waiting:
        assert seq.block_table == []
    for seq in s.running:
        assert len(seq.block_table) * s.block_size >= seq.num_computed_tokens


@pytest.mark.parametrize("caching", [True, False])
def test_soak_random_requests_and_aborts_leak_no_block(caching):
    rng = random.Random(1234)
    s = make(num_blocks=40, block_size=4, budget=24, max_seqs=6, max_model_len=96, caching=caching)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    added = done = preemptions = 0
    for it in range(4000):
        if rng.random() < 0.5 and added < 2500:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(0, 20))]
            params = SamplingParams(max_tokens=rng.randrange(1, 40))
            try:
                s.add_request(Sequence(f"r{added}", prompt[:50] or [3], params))
            except RequestTooLargeError:
                pass
            added += 1
        if s.requests and rng.random() < 0.1:
            rid = rng.choice(list(s.requests))
            done += len(s.finish_requests([rid], SequenceStatus.FINISHED_ABORTED))
        out = s.schedule()
        preemptions += len(out.preempted)
        sampled = {
            seq.request_id: rng.choice([EOS] + list(range(5, 40)))
            for seq, n in out.scheduled
            if seq.num_computed_tokens + n == seq.num_tokens
        }
        done += len(s.update_from_output(out, sampled))
        check_invariants(s)
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = {seq.request_id: 5 for seq, n in out.scheduled if seq.num_computed_tokens + n == seq.num_tokens}
        done += len(s.update_from_output(out, sampled))
    assert added > 1500 and done > 1500 and preemptions > 50, (added, done, preemptions)
    assert s.kv.num_free_blocks == 40
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
