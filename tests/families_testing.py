"""Small random models of each supported family, built with transformers' own classes and saved as
HF directories (save_pretrained) or written as GGUF in llama.cpp's names (not a test module)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

from app.engine.models.config import FAMILIES, ModelConfig

from tools_testing import HERMES_TEMPLATE

FAMILY_NAMES = list(FAMILIES)  # llama, qwen2, qwen3, mistral
VOCAB = 416  # the test tokenizer's ~400 tokens fit
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_config(family: str, tie: bool = False) -> ModelConfig:
    """Hidden 64, 2 layers, 4 query and 2 KV heads; per family what its real models have: llama3 rope
    scaling (llama), rope_theta 1e6 (qwen, mistral), an explicit head_dim unlike hidden / heads (qwen3)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=tie, bos_token_id=0,
                  eos_token_id=1, family=family)
    if family == "llama":
        return ModelConfig(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5, **common)
    if family == "qwen3":
        return ModelConfig(head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6, **common)
    return ModelConfig(rope_theta=1000000.0, rms_norm_eps=1e-6 if family == "qwen2" else 1e-5, **common)


def hf_class(family: str):
    return getattr(transformers, FAMILIES[family].hf_architecture)


def random_hf_model(config: ModelConfig, seed: int = 0):
    """transformers' model of config's family in float32 (eager attention), every parameter random:
    weights N(0, 0.3^2)-ish, biases N(0, 0.5^2), norms (q/k norms too) uniform in [0.5, 1.5]."""
    cls = hf_class(config.family)
    hf_config = cls.config_class(**config.to_hf(), initializer_range=0.3)
    torch.manual_seed(seed)
    hf = cls._from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return hf.eval()


def save_hf_dir(directory: Path, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                max_shard_size: str | None = None):
    """A HF directory of a random model of config (weights in `dtype`, sharded if max_shard_size), with a
    tokenizer.json and, for Qwen families, a template that renders tools and writes <tool_call>.
    Returns the float32 transformers model holding exactly the saved (rounded) weights."""
    from test_tokenizer import build_hf_tokenizer

    hf = random_hf_model(config, seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype).float())
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    # (hf.to(dtype) would round its RoPE frequencies, a buffer, too)
    hf.save_pretrained(directory, state_dict={k: v.to(dtype) for k, v in hf.state_dict().items()}, **kw)
    template = HERMES_TEMPLATE if config.family.startswith("qwen") else None
    tokenizer_config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    if template is not None:
        tokenizer_config["chat_template"] = template
    tok = build_hf_tokenizer(directory, config=tokenizer_config)
    assert tok.get_vocab_size() <= config.vocab_size
    return hf


def half_to_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion permutation of a "llama" file's attn_q / attn_k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small byte-level BPE: the 256 byte symbols (GPT-2's alphabet), a few
    merges ("12" among them, which tells apart pre-tokenizers that split digits one by one), filler
    tokens, then the control tokens <|start|> and <|end|> as the last two ids."""
    byte_symbols = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + \
        [chr(c) for c in range(174, 256)] + [chr(c) for c in range(256, 256 + 68)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "1 2"]
    tokens = byte_symbols + [m.replace(" ", "") for m in merges]
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens) - 2)] + ["<|start|>", "<|end|>"]
    return tokens, merges


GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # llama.cpp's


def write_gguf(path: Path, hf, config: ModelConfig) -> None:
    """hf's weights (float32) as llama.cpp's converter writes them: its architecture for the family,
    tensor names from gguf-py's own name map, q/k rows permuted for "llama" files, the metadata keys
    our reader and transformers' read; a byte-level BPE vocabulary of config.vocab_size tokens."""
    import gguf

    arch = GGUF_ARCH[config.family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    tokens, merges = byte_level_vocab(config.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(config.vocab_size - 2)
    w.add_eos_token_id(config.vocab_size - 1)
    for key, tensor in hf.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        arr = tensor.float().numpy()
        if arch == "llama" and key.endswith("q_proj.weight"):
            arr = half_to_interleaved(arr, config.num_attention_heads)
        elif arch == "llama" and key.endswith("k_proj.weight"):
            arr = half_to_interleaved(arr, config.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_config_json(directory: Path, hf_config: dict) -> Path:
    """A directory holding only config.json (what a config check reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    return directory
