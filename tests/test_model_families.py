"""Every supported family (llama, qwen2, qwen3, mistral) from a HF directory saved by transformers'
own save_pretrained, against transformers' model of the same weights (float32, eager): logits on
prefill and 16 greedy decode steps within 1e-3 through the loader and the paged cache (with the C++
CPU ops and with the torch references), and greedy tokens, log-probs and prefix-cache hits through
the engine (LLM). Exact-token equivalences with quantized KV per family; the configs refused with
their reasons; the tool-call format a Qwen template picks; the 8B-class benchmark presets.
GGUF files of each family: tests/test_gguf.py; TP=2 vs TP=1: tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from app import LLM, SamplingParams
from app.config import EngineConfig
from app.deployments.tool_formats import pick_format
from app.engine.loader import load_model
from app.engine.model_source import DUMMY_MODELS, resolve_tokenizer
from app.engine.models.config import ModelConfig
from app.engine.models.decoder import CausalLM
from app.kernels import cpu_kernels

from families_testing import FAMILY_NAMES, hf_class, save_hf_dir, tiny_config, write_config_json
from test_llama_model import PagedRun, hf_logits

ATOL = RTOL = 1e-3
DECODE_STEPS = 16
# how each family's directory is saved: between them a sharded one, tied embeddings, bf16 and fp16 weights
SAVES = {"llama": dict(tie=True, max_shard_size="40KB"), "qwen2": dict(tie=True, dtype=torch.bfloat16),
         "qwen3": dict(tie=False), "mistral": dict(tie=False, dtype=torch.float16)}


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request, tmp_path_factory):
    name, save = request.param, dict(SAVES[request.param])
    config = tiny_config(name, tie=save.pop("tie"))
    path = tmp_path_factory.mktemp(name)
    hf = save_hf_dir(path, config, seed=FAMILY_NAMES.index(name), **save)
    return SimpleNamespace(name=name, path=path, config=config, hf=hf)


def test_directories_are_saved_as_described(family):
    files = sorted(p.name for p in family.path.glob("*.safetensors"))
    assert len(files) > 2 if family.name == "llama" else files == ["model.safetensors"]
    assert (family.path / "model.safetensors.index.json").is_file() == (family.name == "llama")
    from safetensors import safe_open

    with safe_open(family.path / files[0], framework="pt") as f:
        dtype = f.get_tensor(next(iter(f.keys()))).dtype
    assert dtype == SAVES[family.name].get("dtype", torch.float32)


@pytest.mark.parametrize("cpu_ops", [True, False], ids=["cpu-kernels", "torch"])
def test_logits_match_transformers_on_prefill_and_decode(family, cpu_ops, monkeypatch):
    if not cpu_ops:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif not cpu_kernels.available():
        pytest.skip(f"the CPU extension does not build here: {cpu_kernels.problem()}")
    model, config = load_model(str(family.path), dtype=torch.float32)
    assert config == family.config == ModelConfig.from_hf(family.hf.config.to_dict())
    prompt = torch.randint(0, config.vocab_size, (21,), generator=torch.Generator().manual_seed(7)).tolist()
    run = PagedRun(model, num_seqs=1, max_len=len(prompt) + DECODE_STEPS + 1)
    logits = run.step({0: prompt})[0]
    torch.testing.assert_close(logits, hf_logits(family.hf, prompt), atol=ATOL, rtol=RTOL)
    seq = list(prompt)
    for _ in range(DECODE_STEPS):
        seq.append(int(logits[-1].argmax()))
        logits = run.step({0: [seq[-1]]})[0]
        expected = hf_logits(family.hf, seq)[-1]
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=RTOL)
        assert int(logits[0].argmax()) == int(expected.argmax())  # the next greedy token is transformers'
    # transformers' own greedy decoding (its KV cache) gives the same tokens
    with torch.no_grad():
        generated = family.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=DECODE_STEPS,
                                       min_new_tokens=DECODE_STEPS, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert generated[:len(seq)] == seq


def test_gpu_layer_kernels_match_transformers(family):
    """The GPU path's ops (app/kernels/layer_ops.py: RMSNorm, also on the q/k heads of Qwen3, RoPE on
    the fused projection with Qwen2's bias added in its GEMM, SiLU-and-mul) under the Triton
    interpreter on CPU tensors: prefill and 4 decode steps within 1e-3 of transformers."""
    model, config = load_model(str(family.path), dtype=torch.float32)
    model.use_layer_kernels(True)
    assert config.head_dim & (config.head_dim - 1) == 0  # what the loader asks of the kernels on CUDA
    prompt = list(range(3, 14))
    run = PagedRun(model, num_seqs=1, max_len=len(prompt) + 5)
    logits = run.step({0: prompt})[0]
    torch.testing.assert_close(logits, hf_logits(family.hf, prompt), atol=ATOL, rtol=RTOL)
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(logits[-1].argmax()))
        logits = run.step({0: [seq[-1]]})[0]
        torch.testing.assert_close(logits[0], hf_logits(family.hf, seq)[-1], atol=ATOL, rtol=RTOL)


def _hf_logprobs(hf, token_ids: list[int], vocab: int) -> torch.Tensor:  # [len, vocab]
    """log-softmax over the tokenizer's ids (the engine samples only ids its tokenizer knows)."""
    return torch.log_softmax(hf_logits(hf, token_ids)[:, :vocab], dim=-1)


def _assert_matches_hf(hf, out, vocab: int) -> None:
    """Greedy tokens are transformers' argmax; prompt and sampled log-probs within ATOL of its own."""
    full = out.prompt_token_ids + out.token_ids
    ref = _hf_logprobs(hf, full, vocab)
    n = len(out.prompt_token_ids)
    assert out.token_ids == ref[n - 1:-1].argmax(-1).tolist()
    if out.prompt_logprobs is not None:
        prompt_lp = [d[t].logprob for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
        expected = ref[:n - 1].gather(1, torch.tensor(out.prompt_token_ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(prompt_lp), expected, atol=ATOL, rtol=0)
    sampled = ref[n - 1:-1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), sampled, atol=ATOL, rtol=0)
    for top, row in zip(out.top_logprobs, ref[n - 1:-1]):
        torch.testing.assert_close(torch.tensor([v for _, v in top]), row.topk(len(top)).values, atol=ATOL, rtol=0)


def test_engine_tokens_and_logprobs_match_transformers(family):
    """Through the engine: chunked prefill (budget 16, blocks of 4), 16 greedy steps, then a second
    turn that extends the first prompt and finds its blocks in the prefix cache."""
    llm = LLM(model=str(family.path), dtype="float32", kv_cache_dtype="fp32", block_size=4,
              max_num_batched_tokens=16, num_kv_blocks=64)
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True, logprobs=3, prompt_logprobs=0)
    first = llm.generate(["Once upon a time there was a little girl named Lily. She loved",
                          "Héllo wörld, 世界 says hi! 123 456"], params)
    for out in first:
        assert out.num_cached_tokens == 0 and len(out.token_ids) == DECODE_STEPS
        _assert_matches_hf(family.hf, out, vocab)
    again = first[0].prompt_token_ids + first[0].token_ids + llm.tokenizer.encode(" the park", False)
    # (a request for prompt log-probs computes its whole prompt: this one asks for none)
    second = llm.generate(again, dataclasses.replace(params, prompt_logprobs=None))[0]
    assert second.num_cached_tokens >= 28
    _assert_matches_hf(family.hf, second, vocab)


@pytest.mark.parametrize("kv", ["bf16", "fp4"])
def test_quantized_kv_chunked_and_prefix_hit_equal_one_shot(family, kv):
    """Exact tokens per family with a quantized cache (float32 compute): chunked prefill (budget 7)
    and prefix-cache hits give what one-shot prefill of each prompt alone gives."""
    text = "Once upon a time there was a little girl named Lily. She loved to play outside in the park"
    prompts = [text[:n] for n in (20, 45, len(text))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(model=str(family.path), dtype="float32", kv_cache_dtype=kv, block_size=4, num_kv_blocks=96)
    one_shot = LLM(**common, enable_prefix_caching=False, max_num_batched_tokens=4096)
    reference = [one_shot.generate([p], greedy)[0].token_ids for p in prompts]
    chunked = LLM(**common, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert [o.token_ids for o in chunked.generate(prompts, greedy)] == reference
    cached = LLM(**common, max_num_batched_tokens=4096)
    cached.generate([prompts[-1]], greedy)
    hits = [cached.generate([p], greedy)[0] for p in prompts]
    assert [o.token_ids for o in hits] == reference and all(o.num_cached_tokens >= 4 for o in hits)


# -- what is refused -------------------------------------------------------------------------------
SUPPORTED = r"supported families.*llama.*qwen2.*qwen3.*mistral"


@pytest.mark.parametrize("model_type, architecture", [("gpt2", "GPT2LMHeadModel"),
                                                      ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                                      ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                                      ("gemma2", "Gemma2ForCausalLM")])
def test_another_family_gets_one_error_naming_the_supported_ones(tmp_path, model_type, architecture):
    hf = {**tiny_config("qwen2").to_hf(), "model_type": model_type, "architectures": [architecture]}
    path = str(write_config_json(tmp_path, hf))
    for attempt in (lambda: load_model(path), lambda: load_model(path, load_format="dummy"), lambda: LLM(model=path)):
        with pytest.raises(ValueError, match=f"model_type '{model_type}'.*not supported; {SUPPORTED}"):
            attempt()


def _mistral(**change) -> dict:
    hf = {**tiny_config("mistral").to_hf(), "max_position_embeddings": 32768, **change}
    return {k: v for k, v in hf.items() if v != "absent"}


@pytest.mark.parametrize("hf, refused", [
    (_mistral(sliding_window=4096), True),  # Mistral-7B-v0.1
    (_mistral(sliding_window="absent"), True),  # transformers' default window is 4096
    (_mistral(sliding_window=None), False),  # v0.2 / v0.3
    (_mistral(sliding_window=32768), False),  # a window of the whole context slides nothing
    ({**tiny_config("qwen2").to_hf(), "use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 1},
     True),
    ({**tiny_config("qwen2").to_hf(), "use_sliding_window": False, "sliding_window": 1024}, False),  # Qwen2.5's
    ({**tiny_config("qwen3").to_hf(), "layer_types": ["full_attention", "sliding_attention"],
      "sliding_window": 512}, True),
], ids=["mistral-v0.1", "mistral-default", "mistral-null", "mistral-whole", "qwen2-sliding", "qwen2.5",
        "qwen3-layer-types"])
def test_a_sliding_window_is_refused(tmp_path, hf, refused):
    path = str(write_config_json(tmp_path, hf))
    if refused:
        with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=\d+ < "
                                             r"max_position_embeddings=\d+\) is not supported"):
            load_model(path, load_format="dummy")
    else:
        assert load_model(path, load_format="dummy")[1].family == hf["model_type"]


@pytest.mark.parametrize("family_name, change, message", [
    ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported for qwen3"),
    ("mistral", {"attention_bias": True}, "attention_bias=True is not supported for mistral"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
])
def test_variants_without_an_implementation_are_refused(family_name, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**tiny_config(family_name).to_hf(), **change})


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_config_round_trips_through_transformers(family_name):
    config = tiny_config(family_name, tie=family_name == "qwen2")
    cls = hf_class(family_name)
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert ModelConfig.from_hf(cls.config_class(**config.to_hf()).to_dict()) == config
    if family_name == "qwen3":  # transformers' Qwen3 head_dim default (128), not hidden / heads
        hf = {k: v for k, v in config.to_hf().items() if k != "head_dim"}
        assert ModelConfig.from_hf(hf).head_dim == 128


# -- tool calls --------------------------------------------------------------------------------------
def test_a_qwen_template_picks_the_hermes_tool_format(family):
    """tool_call_parser "auto" reads the chat template: the Qwen directories' template renders tools
    and writes <tool_call>, so calls are Hermes-style."""
    tok = resolve_tokenizer(EngineConfig(model=str(family.path)), family.config.vocab_size)
    fmt = pick_format("auto", tok.chat_template, tok.template_takes_tools)
    if family.name.startswith("qwen"):
        assert tok.template_takes_tools and fmt.name == "hermes"
        rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                           tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        assert "<tools>" in rendered and '"name": "f"' in rendered


# -- the benchmark presets ---------------------------------------------------------------------------
PRESETS = {  # name: (family, hidden, layers, heads, kv heads, head_dim, intermediate, vocab, rope_theta, tied)
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 128, 14336, 128256, 500000.0, False),
    "qwen3-8b": ("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, 1000000.0, False),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, 1000000.0, False),
    "mistral-7b": ("mistral", 4096, 32, 32, 8, 128, 14336, 32768, 1000000.0, False),
}
PARAMS_B = {"llama-3.1-8b": 8.03, "qwen3-8b": 8.19, "qwen2.5-7b": 7.62, "mistral-7b": 7.25}  # model cards


@pytest.mark.parametrize("name", list(PRESETS))
def test_8b_class_presets_have_the_real_shapes_and_build(name):
    """bench/engine_gpu.py --model NAME: the preset has the real model's shapes and parameter count,
    and a tiny model of its family builds with transformers' parameter names and shapes."""
    c = DUMMY_MODELS[name]
    assert (c.family, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == PRESETS[name]
    assert c.num_params / 1e9 == pytest.approx(PARAMS_B[name], abs=0.01)
    tiny = dataclasses.replace(c, vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ours = CausalLM(tiny)
    theirs = hf_class(c.family)(hf_class(c.family).config_class(**tiny.to_hf()))
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(theirs)
    assert sum(p.numel() for p in ours.parameters()) == tiny.num_params
