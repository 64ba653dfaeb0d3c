"""A model's config and tokenizer from its name or files, without its weights and without torch
(the HTTP ingress tokenizes and checks prompts against the config; only replicas load weights).

The forms of `model` are app/engine/loader.py's: a built-in name (DUMMY_MODELS), a HF directory, a
llama2.c .bin checkpoint, a .gguf file or GGUF package name.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

from app.config import EngineConfig
from app.engine.gguf_file import MODEL_PACKAGES, is_gguf, read_gguf_config, resolve_model_name
from app.engine.models.config import ModelConfig
from app.engine.tokenizer import Tokenizer, load_tokenizer

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3_COMMON = dict(vocab_size=128256, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False,
                      bos_token_id=128000, eos_token_id=[128001, 128008, 128009])

DUMMY_MODELS: dict[str, ModelConfig] = {
    # Embedded default: byte-tokenizer vocab (ids 0..258 used), llama3 rope scaling active
    # from position 64 on (original_max_position_embeddings=64).
    "tiny-llama": ModelConfig(
        vocab_size=320, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 64}, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "llama-3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, head_dim=128, **_LLAMA3_COMMON),
    "llama-3.1-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, head_dim=128, **_LLAMA3_COMMON),
    # the shapes of the other families' 8B-class models (their config.json), for dummy-weight benchmarks
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, family="qwen3"),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, family="qwen2"),
    "mistral-7b": ModelConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, family="mistral"),
}

# llama2.c "v0": 7 int32 header, then fp32 arrays (see shared/models/stories260K/README.md).
LLAMA2C_HEADER = struct.Struct("<7i")
_LLAMA2C_MAGIC = 0x616B3432  # "ak42": the later versioned export formats, not supported


def read_llama2c_config(path: Path) -> ModelConfig:
    with open(path, "rb") as f:
        header = f.read(LLAMA2C_HEADER.size)
    if len(header) < LLAMA2C_HEADER.size:
        raise ValueError(f"{path} is too short to be a llama2.c checkpoint")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = LLAMA2C_HEADER.unpack(header)
    if dim == _LLAMA2C_MAGIC:
        raise ValueError(f"{path} is a versioned llama2.c export; only the legacy 'v0' format is supported")
    return ModelConfig(
        vocab_size=abs(vocab_size), hidden_size=dim, intermediate_size=hidden_dim, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=seq_len, tie_word_embeddings=vocab_size > 0,
        bos_token_id=1, eos_token_id=2)


def model_source(model: str) -> tuple[ModelConfig, str, Path]:
    """(config, kind of its weights: "dummy" (built in), "safetensors", "llama2c" or "gguf", path of the files)."""
    if model in DUMMY_MODELS:
        return dataclasses.replace(DUMMY_MODELS[model]), "dummy", Path(model)  # a copy: callers may edit it
    path = Path(resolve_model_name(model))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text())), "safetensors", path
    if path.suffix == ".bin" and path.is_file():
        return read_llama2c_config(path), "llama2c", path
    if is_gguf(str(path)):
        return read_gguf_config(path), "gguf", path
    raise ValueError(
        f"cannot load model {model!r}: expected one of the built-in names {sorted(DUMMY_MODELS)}, "
        f"a GGUF model name {sorted(MODEL_PACKAGES)}, a directory containing config.json and *.safetensors, "
        f"a .gguf file, or a llama2.c checkpoint file ending in .bin")


def load_model_config(model: str) -> ModelConfig:
    """The config of `model` (same forms as load_model), without touching its weights."""
    return model_source(model)[0]


def resolve_tokenizer(config: EngineConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer of config (or of the model); its ids must all exist in the model's vocab."""
    if config.tokenizer is not None:
        return load_tokenizer(resolve_model_name(config.tokenizer), vocab_size=vocab_size)
    model = Path(resolve_model_name(config.model)) if config.model not in DUMMY_MODELS else Path(config.model)
    if model.is_dir() and (model / "tokenizer.json").exists():
        return load_tokenizer(str(model), vocab_size=vocab_size)
    if is_gguf(str(model)):
        return load_tokenizer(str(model), vocab_size=vocab_size)
    if config.model in DUMMY_MODELS or config.load_format == "dummy":
        return load_tokenizer(None, vocab_size=vocab_size)
    raise ValueError(f"no tokenizer found for model {config.model!r}; pass tokenizer=<path> "
                     "(a HF directory or tokenizer.json, or a llama2.c tokenizer .bin)")
