"""Build a model (models/decoder.py, any family of models/config.py) from a name, a HF safetensors
directory, a GGUF file or a llama2.c checkpoint.

Accepted forms of `model`:
- a name in DUMMY_MODELS: random weights, no files needed ("tiny-llama" is the embedded default);
- a directory with config.json of a supported family: *.safetensors weights (one file, or sharded
  with model.safetensors.index.json; any float dtype, cast on load), or random weights with
  load_format="dummy";
- a path ending in .bin: a llama2.c "v0" checkpoint (e.g. shared/models/stories260K);
- a path ending in .gguf, or a name in gguf_file.MODEL_PACKAGES (smollm2-135m-instruct): a GGUF
  file, dequantized on load (read by app/engine/gguf_file.py).

The model is built on the meta device and materialized directly on `device` in `dtype`, so an
8B model never exists in fp32 on the CPU.

With tp_size > 1 the module is rank tp_rank's shard (see models/decoder.py) and each loader reads
only that shard of each weight: a slice of the safetensors entry (safe_open's get_slice) or of the
memory-mapped llama2.c file. Dummy weights are drawn at the full shape from the same seeded
generator and then sliced, so every tp_size yields shards of the same full model.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from app.engine.gguf_file import hf_weight_name, open_gguf
from app.engine.model_source import LLAMA2C_HEADER, model_source
from app.engine.models.config import ModelConfig
from app.engine.models.decoder import CausalLM

LOAD_FORMATS = ("auto", "dummy")
INIT_STD = 0.02  # linears, biases and embeddings; norms are 1
DEVICE_INIT_MIN_PARAMS = 10**9  # above this, random weights are generated on the target device


def load_model(
    model: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[CausalLM, ModelConfig]:
    """The model (eval mode, on `device` in `dtype`), or its shard tp_rank of tp_size, and its
    (full) config; see the module docstring."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)} (got {load_format!r})")
    config, kind, path = model_source(model)
    load = {"dummy": None, "safetensors": _load_safetensors_dir, "llama2c": _load_llama2c, "gguf": _load_gguf}[kind]
    device = torch.device(device)
    with torch.device("meta"):
        module = CausalLM(config, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)
    module = module.to_empty(device=device)
    # q/k/v and gate/up as one weight each (their HF names stay, as views the loaders fill); the
    # small per-token ops as fused kernels where they run (CUDA, a power-of-two head_dim)
    module.fuse_projections()
    module.use_layer_kernels(device.type == "cuda" and importlib.util.find_spec("triton") is not None
                             and config.head_dim & (config.head_dim - 1) == 0)
    module.tie_weights()
    with torch.no_grad():
        if load is None or load_format == "dummy":
            init_random_weights(module, seed)
        else:
            load(module, path)
    return module.eval(), config


def init_random_weights(model: CausalLM, seed: int) -> None:
    """Normal(0, INIT_STD) linears and embeddings, norms 1, deterministic for a seed.

    Each parameter is drawn at its full (unsharded) shape and the model's shard is copied out, so
    a tensor-parallel rank holds exactly its slice of the tp_size=1 model. Models up to
    DEVICE_INIT_MIN_PARAMS are generated on the CPU in float32 and then copied, so they are
    identical on every device. Larger ones (the 8B/70B benchmark shapes) are generated on the
    target device in the parameter's dtype with that device's generator: seeded, but only
    reproducible per device.
    """
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    on_device = model.config.num_params > DEVICE_INIT_MIN_PARAMS
    gen = torch.Generator(device=device if on_device else "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if on_device:
                full = torch.empty(model.full_shape(name), dtype=p.dtype, device=device)
            else:
                full = torch.empty(model.full_shape(name), dtype=torch.float32)
            p.copy_(full.normal_(0.0, INIT_STD, generator=gen)[model.shard_slices(name)])


def _load_safetensors_dir(model: CausalLM, path: Path) -> None:
    """Stream tensors one by one into the parameters, casting to their dtype and device."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}; pass load_format='dummy' for random weights")
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away
    loaded, unexpected = set(), []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                if key == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # some tied checkpoints store the shared weight twice
                if key not in params:
                    unexpected.append(key)
                    continue
                entry = f.get_slice(key)  # reads nothing until indexed
                shape, expected = tuple(entry.get_shape()), model.full_shape(key)
                if shape != expected:
                    raise ValueError(f"{file.name}: {key} has shape {shape}, the model expects {expected}")
                params[key].copy_(entry[model.shard_slices(key)])
                loaded.add(key)
    check_all_loaded(f"checkpoint {path}", params, loaded, unexpected)


def check_all_loaded(source: str, params: dict, loaded: set, unexpected: list) -> None:
    """ValueError unless a checkpoint filled every parameter and held nothing else."""
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(f"{source} does not match the model's config: missing keys {missing}, "
                         f"unexpected keys {sorted(unexpected)}")


def interleaved_to_half_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Permute the rows of wq/wk ([num_heads * head_dim, in]) per head so that the pair
    (2i, 2i+1) that llama2.c rotates lands at (i, i + head_dim/2), which HF's rotate-half rotates
    (the permutation of HF's convert_llama_weights_to_hf.py)."""
    out_dim, in_dim = w.shape
    return w.view(num_heads, out_dim // num_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _load_llama2c(model: CausalLM, path: Path) -> None:
    c = model.config
    dim, hidden, n_layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv_dim, head_dim = c.num_key_value_heads * c.head_dim, c.head_dim
    data = np.memmap(path, dtype="<f4", mode="r", offset=LLAMA2C_HEADER.size)
    offset = 0

    def take(*shape: int) -> np.ndarray:
        """The next array of the file, as a memory-mapped view (read when copied)."""
        nonlocal offset
        n = int(np.prod(shape))
        if offset + n > data.size:
            raise ValueError(f"{path} is truncated: the header promises more weights than the file holds")
        view = data[offset:offset + n].reshape(shape)
        offset += n
        return view

    def load(name: str, array: np.ndarray) -> None:
        """Copy this rank's shard of `array` into parameter `name` (reading only that shard)."""
        shard = torch.from_numpy(np.array(array[model.shard_slices(name)]))
        if name.endswith("self_attn.q_proj.weight"):  # whole heads: the permutation is per head
            shard = interleaved_to_half_rope(shard, c.num_attention_heads // model.tp_size)
        elif name.endswith("self_attn.k_proj.weight"):
            shard = interleaved_to_half_rope(shard, c.num_key_value_heads // model.tp_size)
        model.get_parameter(name).copy_(shard)

    load("model.embed_tokens.weight", take(vocab, dim))
    for name, shape in [("input_layernorm", (dim,)), ("self_attn.q_proj", (dim, dim)),
                        ("self_attn.k_proj", (kv_dim, dim)), ("self_attn.v_proj", (kv_dim, dim)),
                        ("self_attn.o_proj", (dim, dim)), ("post_attention_layernorm", (dim,)),
                        ("mlp.gate_proj", (hidden, dim)), ("mlp.down_proj", (dim, hidden)),
                        ("mlp.up_proj", (hidden, dim))]:
        for i in range(n_layers):
            load(f"model.layers.{i}.{name}.weight", take(*shape))
    load("model.norm.weight", take(dim))
    take(2, c.max_position_embeddings, head_dim // 2)  # legacy freq_cis_real / freq_cis_imag, unused
    if not c.tie_word_embeddings:
        load("lm_head.weight", take(vocab, dim))
    if offset != data.size:
        raise ValueError(f"{path} has {data.size - offset} float32 values beyond the weights its header describes")


def _load_gguf(model: CausalLM, path: Path) -> None:
    """Every weight of a GGUF file into `model` (or this rank's shard of it), dequantized to float32
    and copied in the model's dtype, with a progress bar on stderr."""
    from tqdm import tqdm

    f = open_gguf(path)
    c = model.config
    params = dict(model.named_parameters())
    loaded, unexpected = set(), []
    for name in tqdm(f.tensors, desc=f"loading {f.path.name}", unit="tensor", file=sys.stderr,
                     mininterval=1.0, leave=False):
        key = hf_weight_name(name)
        if key is None or (key == "lm_head.weight" and c.tie_word_embeddings):
            unexpected.append(name)
            continue
        if key not in params:
            unexpected.append(name)
            continue
        w = torch.from_numpy(f.array(name))
        expected = model.full_shape(key)
        if tuple(w.shape) != tuple(expected):
            raise ValueError(f"{f.path}: {name} has shape {tuple(w.shape)}, the model expects {expected}")
        if f.rope_interleaved and key.endswith("self_attn.q_proj.weight"):
            w = interleaved_to_half_rope(w, c.num_attention_heads)
        elif f.rope_interleaved and key.endswith("self_attn.k_proj.weight"):
            w = interleaved_to_half_rope(w, c.num_key_value_heads)
        params[key].copy_(w[model.shard_slices(key)])
        loaded.add(key)
    check_all_loaded(str(f.path), params, loaded, unexpected)
