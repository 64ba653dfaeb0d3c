"""Memory accounting: the engine sizes its KV cache from a budget, per format."""

import json

import pytest

from app import LLM, SamplingParams
from app.config import EngineConfig
from app.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def head_dim_128_model(tmp_path_factory):
    """A one-layer dummy Llama with Llama-3's head_dim of 128 (random weights)."""
    d = tmp_path_factory.mktemp("hd128")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def engine(model, kv, **kw):
    return LLMEngine(EngineConfig(model=model, load_format="dummy", kv_cache_dtype=kv, max_num_seqs=4096,
                                  kv_cache_memory="64MiB", **kw))


def test_same_budget_holds_3_4x_more_tokens_in_fp4(head_dim_128_model):
    bf16, fp8, fp4 = (engine(head_dim_128_model, kv) for kv in ("bf16", "fp8", "fp4"))
    # 2 layers x 1 KV head: bf16 512 B per layer, fp8 264, fp4 (K 64+4+1+4x3, V 64+4+1) 150.
    assert (bf16.kv_bytes_per_token, fp8.kv_bytes_per_token, fp4.kv_bytes_per_token) == (1024, 528, 300)
    assert fp4.num_kv_blocks / bf16.num_kv_blocks >= 3.4
    assert bf16.num_kv_blocks == (64 << 20) // (1024 * 16)
    for e in (bf16, fp8, fp4):
        allocated = sum(t.numel() * t.element_size() for t in _tensors(e.kv_cache))
        assert allocated == e.num_kv_blocks * 16 * e.kv_bytes_per_token <= 64 << 20


def _tensors(cache):
    if hasattr(cache, "k_cache"):
        return cache.k_cache + cache.v_cache
    return [t for page in cache.pages for t in page]


def test_fp4_engine_generates_on_head_dim_128(head_dim_128_model):
    llm = LLM(model=head_dim_128_model, load_format="dummy", kv_cache_dtype="fp4", num_kv_blocks=64)
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    assert llm.engine.kv_manager.num_free_blocks == 64


def test_fp4_settings_the_model_cannot_use_fail_before_weights_load(tmp_path, stories_paths):
    """head_dim 512 leaves uint8 outlier indices no room; the error comes before the (here
    missing) safetensors are looked for."""
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 1024, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="with outlier slots head_dim must be <= 256"):
        LLMEngine(EngineConfig(model=str(tmp_path), tokenizer=stories_paths[1], kv_cache_dtype="fp4"))


def test_the_prefill_scratch_is_counted_in_the_gpu_budget():
    """Quantized formats on CUDA reserve a dense prefill scratch (K and V, the compute dtype) for
    max(65536, max_model_len) tokens beside their blocks; fit_num_kv_blocks takes it out of the budget
    derived from gpu_memory_utilization. Dense formats and the CPU reserve none."""
    import torch

    from app.engine.kv_cache import KVCacheSpec, scratch_bytes

    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, compute_dtype=torch.bfloat16)
    per_token = 2 * 8 * 128 * 2
    assert scratch_bytes("fp4", spec, "cuda", 32768) == 65536 * per_token
    assert scratch_bytes("fp8", spec, "cuda", 131072) == 131072 * per_token
    assert scratch_bytes("fp4", spec, "cuda", 100001) == 100016 * per_token  # whole blocks
    assert scratch_bytes("bf16", spec, "cuda", 32768) == 0
    assert scratch_bytes("fp4", spec, "cpu", 32768) == 0


def test_engines_sharing_a_gpu_size_their_kv_from_their_share():
    """gpu_fraction f: the budget is f x gpu_memory_utilization x total minus this engine's own
    allocations, whatever the other engines on the GPU hold. Two 8B-sized engines at 0.45 of an
    80 GiB GPU, started one after the other: together they stay within 0.9 x 0.9 of it, and the
    second gets as much as the first. Without the fraction, the first would take 0.9 of the GPU
    and leave the second nothing."""
    gib = 2**30
    total, weights, context = 80 * gib, 16 * gib, gib // 2
    shared = EngineConfig(device="cuda", gpu_fraction=0.45)
    from app.engine.model_runner import gpu_kv_budget

    # the first engine: its weights and context are all that is in use
    free = total - weights - context
    first = gpu_kv_budget(shared, free, total, own_bytes=weights)
    assert first == int(total * 0.45 * 0.9) - weights
    # the second: the first engine's weights, KV and context are in use too, and not counted against it
    free -= first + weights + context
    second = gpu_kv_budget(shared, free, total, own_bytes=weights)
    assert second == first > 0
    assert 2 * (weights + first) <= total * 0.9 * 0.9
    assert gpu_kv_budget(shared, free, total, own_bytes=weights, workspace_bytes=gib) == first - gib
    # the whole-GPU rule counts everything in use: the first takes 0.9 of the GPU, the second goes without
    owner = EngineConfig(device="cuda")
    whole_first = gpu_kv_budget(owner, total - weights - context, total, own_bytes=weights)
    assert whole_first == int(total * 0.9) - weights - context
    assert gpu_kv_budget(owner, total - 2 * (weights + context) - whole_first, total, own_bytes=weights) < 0
