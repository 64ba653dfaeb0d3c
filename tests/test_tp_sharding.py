"""Tensor-parallel sharding and the driver's step messages, without Ray.

Each rank's weights must be exactly its slice of the full model, whatever the loader; the step
protocol must send only new tokens and new blocks once a rank knows a request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app import LLM, SamplingParams
from app.engine.engine import LLMEngine
from app.engine.loader import load_model
from app.engine.models.decoder import shard_dim
from app.engine.placement import placement_bundles

from conftest import STORIES_MODEL
from families_testing import save_hf_dir, tiny_config


def assert_shards_of(full, path: str, tp_size: int) -> None:
    full_params = dict(full.named_parameters())
    for rank in range(tp_size):
        shard, _ = load_model(path, tp_rank=rank, tp_size=tp_size)
        for name, p in shard.named_parameters():
            expected = full_params[name][shard.shard_slices(name)]
            assert p.shape == expected.shape and torch.equal(p, expected), (name, rank)
            dim = shard_dim(name)
            if dim is not None:
                assert p.shape[dim] * tp_size == full_params[name].shape[dim]
        attn = shard.model.layers[0].self_attn
        assert attn.num_kv_heads * tp_size == full.config.num_key_value_heads


@pytest.mark.parametrize("tp_size", [2, 4])
def test_llama2c_shards_are_slices_of_the_full_model(stories_paths, tp_size):
    full, _ = load_model(str(STORIES_MODEL))
    assert_shards_of(full, str(STORIES_MODEL), tp_size)


def test_dummy_shards_are_slices_of_the_same_full_model():
    full, _ = load_model("tiny-llama", seed=3)
    for rank in range(2):
        shard, _ = load_model("tiny-llama", seed=3, tp_rank=rank, tp_size=2)
        full_params = dict(full.named_parameters())
        for name, p in shard.named_parameters():
            assert torch.equal(p, full_params[name][shard.shard_slices(name)]), name
        assert shard.lm_head.weight is shard.model.embed_tokens.weight  # replicated, still tied


@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_shards_are_slices_of_the_full_model(tmp_path: Path, tie: bool):
    full, config = load_model("tiny-llama", seed=1)
    config.tie_word_embeddings = tie
    tensors = {k: v.clone().contiguous() for k, v in full.state_dict().items()}
    if tie:
        tensors.pop("lm_head.weight")
    else:
        tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[1::2]}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    reloaded, _ = load_model(str(tmp_path))
    assert_shards_of(reloaded, str(tmp_path), 2)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_bias_and_qk_norm_shards(tmp_path: Path, family: str):
    """Qwen2's q/k/v biases are split with their weights' rows (whole heads); Qwen3's q/k norm weights
    ([head_dim], the same for every head) are whole on every rank."""
    save_hf_dir(tmp_path, tiny_config(family))
    full, _ = load_model(str(tmp_path))
    assert_shards_of(full, str(tmp_path), 2)
    names = dict(full.named_parameters())
    if family == "qwen2":
        assert shard_dim("model.layers.0.self_attn.k_proj.bias") == 0
        assert names["model.layers.0.self_attn.k_proj.bias"].shape == (2 * 16,)
    else:
        assert shard_dim("model.layers.0.self_attn.q_norm.weight") is None
        assert names["model.layers.0.self_attn.k_norm.weight"].shape == (32,)


def test_tp_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide num_key_value_heads \(2\).*\[1, 2\]"):
        LLMEngine(model="tiny-llama", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="must divide"):
        load_model("tiny-llama", tp_rank=0, tp_size=3)


def test_placement_bundles():
    assert placement_bundles(2, 1.0, gpu=True, driver_cpus=0.5) == [{"GPU": 1.0, "CPU": 1.5}, {"GPU": 1.0, "CPU": 1.0}]
    assert placement_bundles(3, 0.1, gpu=False) == [{"CPU": 0.1}] * 3
    assert placement_bundles(1, 0.0, gpu=True) == [{"GPU": 1.0}]
    with pytest.raises(ValueError, match="cpus_per_worker > 0"):
        placement_bundles(2, 0.0, gpu=False)


def test_step_messages_send_only_new_tokens_and_blocks(stories_paths):
    """Chunked prefill, decode, a preemption and a finished request, as the ranks see them."""
    model, tok = stories_paths
    llm = LLM(model=model, tokenizer=tok, block_size=4, max_num_batched_tokens=8, num_kv_blocks=24)
    engine = llm.engine
    runner = engine.executor.runner
    messages = []
    launch = engine.executor._launch  # every step's message goes through it
    engine.executor._launch = lambda m: messages.append(m) or launch(m)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", list(range(1, 30)), params)  # 29 tokens: 4 chunks of <= 8
    engine.add_request("b", list(range(100, 110)), params)
    seen_blocks: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        engine.step()
        m = messages[-1]
        for r in m.requests:
            seq = engine.scheduler.requests.get(r.request_id)
            if r.params is not None:  # a first sight or a resume: the whole table
                seen_blocks[r.request_id] = list(r.block_ids)
            else:
                seen_blocks[r.request_id] += r.block_ids
                assert len(r.block_ids) <= 2
            if seq is not None:
                assert seen_blocks[r.request_id] == seq.block_table
            assert len(r.token_ids) <= 8
    assert engine.scheduler.num_preemptions_total > 0  # 24 blocks of 4 cannot hold both to the end
    first = [m for m in messages if any(r.request_id == "a" for r in m.requests)]
    assert first[0].requests[0].params == params and first[0].requests[0].start_pos == 0
    prompt_len = {"a": 29, "b": 10}
    decodes = [r for m in messages for r in m.requests if r.params is None and r.start_pos >= prompt_len[r.request_id]]
    assert len(decodes) > 40 and all(len(r.token_ids) == 1 and r.do_sample for r in decodes)
    resumed = [r for m in messages[1:] for r in m.requests if r.params is not None and r.start_pos > 0]
    assert resumed  # the preempted request came back whole (its prefix hit skips recomputation)
    assert set(runner.requests) == {"a", "b"} - set(sum((m.finished_request_ids for m in messages), []))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert {"a", "b"} <= set(sum((m.finished_request_ids for m in messages), []))
    assert "a" not in runner.requests and "b" not in runner.requests and not runner.generators


def test_a_reused_request_id_gets_a_fresh_generator():
    """Ranks drop a finished request's generator before they see a new request with its id."""
    engine = LLMEngine(model="tiny-llama")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)

    def run(request_id):
        engine.add_request(request_id, "hello", params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs[-1].token_ids

    assert run("x") == run("x") == run("y")
