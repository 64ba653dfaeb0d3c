"""load_model: HF safetensors directories, llama2.c checkpoints and dummy weights, each checked
against an independent forward (transformers, or llama2.c's own convention in numpy)."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCacheSpec, create_kv_cache
from app.engine.loader import load_model
from app.engine.model_source import DUMMY_MODELS
from app.engine.models.config import ModelConfig
from app.engine.models.decoder import CausalLM

ATOL, RTOL = 1e-4, 1e-4  # fp32 model vs fp32 (HF) or fp64 (numpy) reference
STORIES_BIN = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K" / "stories260K.bin"


@torch.no_grad()
def our_logits(model: CausalLM, tokens: list[int], block_size: int = 4) -> torch.Tensor:
    """One-sequence prefill over a paged fp32 cache with blocks in reverse order: [len, vocab]."""
    c, n = model.config, len(tokens)
    num_blocks = math.ceil(n / block_size)
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, torch.float32)
    cache = create_kv_cache("fp32", spec, num_blocks + 1, "cpu")
    block_table = torch.arange(num_blocks, 0, -1)  # [num_blocks]
    pos = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=block_table[pos // block_size] * block_size + pos % block_size,
                             block_tables=block_table[None], seq_lens=[n], query_start_loc=[0, n])
    return model.compute_logits(model(torch.tensor(tokens), pos, cache, meta))


def random_hf_model(tie: bool) -> transformers.LlamaForCausalLM:
    config = ModelConfig(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                         tie_word_embeddings=tie)
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**config.to_hf(), initializer_range=0.3)
    hf = transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return hf.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_sharded_safetensors_directory(tmp_path: Path, tie: bool) -> None:
    hf = random_hf_model(tie)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, config = load_model(str(tmp_path))
    assert config.tie_word_embeddings == tie and config == ModelConfig.from_hf(hf.config.to_dict())
    tokens = [1, 17, 99, 4, 23, 142, 8, 61, 5, 77, 31]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(our_logits(model, tokens), expected, atol=ATOL, rtol=RTOL)


def test_hf_directory_errors(tmp_path: Path) -> None:
    hf = random_hf_model(tie=False)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected keys \['model.layers.0.self_attn.q_proj.bias'\]"):
        load_model(str(tmp_path))
    # load_format="dummy" needs only config.json
    model, config = load_model(str(tmp_path), load_format="dummy")
    assert config.num_hidden_layers == 3 and model.model.norm.weight.eq(1).all()
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        load_model(str(tmp_path))


def test_bad_path_names_it_and_the_accepted_forms(tmp_path: Path) -> None:
    for bad in [str(tmp_path / "nope"), str(tmp_path), "llama-9b"]:
        with pytest.raises(ValueError, match="tiny-llama") as err:
            load_model(bad)
        assert repr(bad) in str(err.value) and "config.json" in str(err.value) and ".bin" in str(err.value)
    with pytest.raises(ValueError, match="load_format"):
        load_model("tiny-llama", load_format="pt")


def llama2c_reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama2.c's run.c forward in float64 numpy, reading the .bin directly: interleaved-pair RoPE
    on the unpermuted weights. Returns [len, vocab]."""
    raw = path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared, vocab = vocab > 0, abs(vocab)
    hs = dim // n_heads
    kv_dim = n_kv * hs
    w = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
    o = 0

    def take(*shape):
        nonlocal o
        n = int(np.prod(shape))
        o += n
        return w[o - n:o].reshape(shape)

    emb, rms_att = take(vocab, dim), take(n_layers, dim)
    wq, wk, wv = take(n_layers, dim, dim), take(n_layers, kv_dim, dim), take(n_layers, kv_dim, dim)
    wo, rms_ffn = take(n_layers, dim, dim), take(n_layers, dim)
    w1, w2, w3 = take(n_layers, hidden, dim), take(n_layers, dim, hidden), take(n_layers, hidden, dim)
    rms_final = take(dim)
    take(2, seq_len, hs // 2)  # legacy RoPE tables
    wcls = emb if shared else take(vocab, dim)
    assert o == w.size

    def rmsnorm(x, g):
        return g * x / np.sqrt(np.mean(x * x) + 1e-5)

    def rope(vec, pos):  # rotate pairs (2i, 2i+1) of each head
        vec = vec.copy()
        for i in range(0, vec.size, 2):
            angle = pos * 10000.0 ** (-(i % hs) / hs)
            c, s = math.cos(angle), math.sin(angle)
            vec[i], vec[i + 1] = vec[i] * c - vec[i + 1] * s, vec[i] * s + vec[i + 1] * c
        return vec

    keys = [[] for _ in range(n_layers)]
    values = [[] for _ in range(n_layers)]
    out = []
    for pos, tok in enumerate(tokens):
        x = emb[tok].copy()
        for layer in range(n_layers):
            xb = rmsnorm(x, rms_att[layer])
            q = rope(wq[layer] @ xb, pos)
            keys[layer].append(rope(wk[layer] @ xb, pos))
            values[layer].append(wv[layer] @ xb)
            att_out = np.zeros(dim)
            for h in range(n_heads):
                kvh = h // (n_heads // n_kv)
                k = np.stack([kk[kvh * hs:(kvh + 1) * hs] for kk in keys[layer]])  # [pos + 1, hs]
                v = np.stack([vv[kvh * hs:(kvh + 1) * hs] for vv in values[layer]])
                scores = k @ q[h * hs:(h + 1) * hs] / math.sqrt(hs)
                p = np.exp(scores - scores.max())
                att_out[h * hs:(h + 1) * hs] = (p / p.sum()) @ v
            x = x + wo[layer] @ att_out
            xb = rmsnorm(x, rms_ffn[layer])
            a = w1[layer] @ xb
            x = x + w2[layer] @ (a / (1 + np.exp(-a)) * (w3[layer] @ xb))
        out.append(wcls @ rmsnorm(x, rms_final))
    return np.stack(out)


@pytest.mark.skipif(not STORIES_BIN.is_file(), reason=f"{STORIES_BIN} not present")
def test_llama2c_stories260k_matches_reference() -> None:
    model, config = load_model(str(STORIES_BIN))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (64, 5, 8, 4, 512, True)
    tokens = [1, 403, 407, 261, 378, 275, 261, 266]
    expected = torch.from_numpy(llama2c_reference_logits(STORIES_BIN, tokens)).float()
    torch.testing.assert_close(our_logits(model, tokens), expected, atol=ATOL, rtol=RTOL)


def write_llama2c(path: Path, shared: bool, seed: int) -> None:
    """A random llama2.c v0 checkpoint: GQA 4:2, head_dim 8; norms near 1, linears ~ 2/sqrt(fan_in)."""
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = 32, 48, 2, 4, 2, 40, 16
    hs, kv_dim = dim // n_heads, n_kv * dim // n_heads
    rng = np.random.default_rng(seed)

    def norm(*shape):
        return rng.uniform(0.5, 1.5, shape)

    def linear(*shape):
        return rng.normal(0.0, 2 / math.sqrt(shape[-1]), shape)

    arrays = [linear(vocab, dim), norm(n_layers, dim), linear(n_layers, dim, dim), linear(n_layers, kv_dim, dim),
              linear(n_layers, kv_dim, dim), linear(n_layers, dim, dim), norm(n_layers, dim),
              linear(n_layers, hidden, dim), linear(n_layers, dim, hidden), linear(n_layers, hidden, dim),
              norm(dim), rng.normal(size=(2, seq_len, hs // 2))] + ([] if shared else [linear(vocab, dim)])
    header = struct.pack("<7i", dim, hidden, n_layers, n_heads, n_kv, vocab if shared else -vocab, seq_len)
    path.write_bytes(header + b"".join(a.astype("<f4").tobytes() for a in arrays))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_classifier", "own_classifier"])
def test_llama2c_round_trip(tmp_path: Path, shared: bool) -> None:
    path = tmp_path / "tiny.bin"
    write_llama2c(path, shared, seed=int(shared))
    model, config = load_model(str(path))
    assert config.tie_word_embeddings == shared and config.max_position_embeddings == 16
    tokens = [1, 5, 39, 12, 12, 0, 7, 30, 2, 11, 25]
    expected = torch.from_numpy(llama2c_reference_logits(path, tokens)).float()
    torch.testing.assert_close(our_logits(model, tokens), expected, atol=ATOL, rtol=RTOL)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        load_model(str(path))


def test_dummy_models_are_seeded_and_need_no_files() -> None:
    a, config = load_model("tiny-llama", seed=0)
    b, _ = load_model("tiny-llama", seed=0)
    c, _ = load_model("tiny-llama", seed=1)
    assert config == DUMMY_MODELS["tiny-llama"] and config is not DUMMY_MODELS["tiny-llama"]
    assert a.lm_head.weight is a.model.embed_tokens.weight
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert abs(sa["model.embed_tokens.weight"].std().item() - 0.02) < 0.002
    assert sa["model.norm.weight"].eq(1).all()
    logits = our_logits(a, [1, 72, 101, 108, 108, 111])
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    assert len({int(t) for t in logits.argmax(-1)}) > 1  # different positions predict different tokens


def test_dummy_dtype_and_big_shapes_on_meta() -> None:
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.inv_freq.dtype == torch.float32
    ref, _ = load_model("tiny-llama")
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight.float(),
                               ref.model.layers[0].mlp.up_proj.weight, atol=1e-3, rtol=1e-2)
    for name, num_params in [("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496)]:
        big, config = load_model(name, device="meta", dtype=torch.bfloat16)
        assert sum(p.numel() for p in big.parameters()) == config.num_params == num_params
        assert config.to_hf()["rope_scaling"]["original_max_position_embeddings"] == 8192
