"""A small trained Llama copied exactly into larger shapes (a check aid for kernels and benchmarks).

Random weights at Llama-3.1-8B shapes make greedy decoding chaotic: the top two logits of a random
model are close, so bf16 rounding alone changes the tokens, and an end-to-end comparison of two
attention paths says nothing. A trained model has clear margins, but the one available offline
(stories260K: head_dim 8, 64 hidden) is far from the shapes the kernels are built for.

`widen_config` and `copy_widened` put the small model inside a big model's shapes so that the big
model computes the small one's function; only rounding differs:

- hidden units and MLP columns beyond the small model's are zero (the vocabulary is the small one's);
- a small head's dimension i sits at big dimension i * r in each RoPE half (r = big / small
  head_dim), where the big model's RoPE has the same frequency (same theta and scaling), and the
  query rows are scaled by sqrt(r) so the big softmax scale head_dim**-0.5 gives the small one's;
- small KV head j is big KV head j, and small query head j * g + i (g query heads per KV head) is
  big query head j * G + i; the other heads have zero weights;
- RMSNorm means are taken over more (zero) units, so the norm weights are scaled by
  sqrt(small hidden / big hidden) and eps by small hidden / big hidden;
- the small layers sit spread over the big stack (`layer_map`); the layers between have zero
  weights, so they add nothing to the residual, but their attention still runs (on zero K/V).

Every scale is a power of two when the ratios are powers of four, so the copy is exact in bf16.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from app.engine.models.config import ModelConfig
from app.engine.models.decoder import CausalLM


def widen_config(small: ModelConfig, big: ModelConfig) -> ModelConfig:
    """big's shapes (hidden, heads, head_dim, MLP, layers) carrying small's vocabulary, RoPE,
    special tokens and tying, with eps rescaled. ValueError if small does not fit in big."""
    problems = []
    for what in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "head_dim"):
        if getattr(big, what) < getattr(small, what):
            problems.append(f"{what} {getattr(big, what)} < {getattr(small, what)}")
    if big.head_dim % small.head_dim:
        problems.append(f"head_dim {big.head_dim} is not a multiple of {small.head_dim}")
    g_small = small.num_attention_heads // small.num_key_value_heads
    g_big = big.num_attention_heads // big.num_key_value_heads
    if g_big < g_small:
        problems.append(f"{g_big} query heads per KV head < {g_small}")
    if problems:
        raise ValueError("the small model does not fit in the big shapes: " + "; ".join(problems))
    return dataclasses.replace(
        big, vocab_size=small.vocab_size, rope_theta=small.rope_theta, rope_scaling=small.rope_scaling,
        rms_norm_eps=small.rms_norm_eps * small.hidden_size / big.hidden_size,
        max_position_embeddings=small.max_position_embeddings, tie_word_embeddings=small.tie_word_embeddings,
        bos_token_id=small.bos_token_id, eos_token_id=small.eos_token_id)


def layer_map(small_layers: int, big_layers: int) -> list[int]:
    """The big layer that holds each small layer, spread evenly (0 first)."""
    return [i * big_layers // small_layers for i in range(small_layers)]


def head_dims(small: int, big: int) -> torch.Tensor:
    """The big dimension of each small head dimension: i -> i * r within each rotate-half RoPE half,
    which keeps each pair's frequency theta ** (-2 i / small) = theta ** (-2 i r / big)."""
    r, half = big // small, torch.arange(small // 2)
    return torch.cat((half * r, half * r + big // 2))


@torch.no_grad()
def copy_widened(small: CausalLM, big: CausalLM) -> None:
    """Overwrite big's weights (tp_size 1, config from widen_config) with small's, widened."""
    s, b = small.config, big.config
    need = "big must be an unsharded model built from widen_config(small.config, ...)"
    try:
        expected = widen_config(s, b)
    except ValueError as e:
        raise ValueError(f"{need}: {e}") from None
    if big.tp_size != 1 or b != expected:
        raise ValueError(need)
    sw = {n: p.detach().to(device="cpu", dtype=torch.float32) for n, p in small.named_parameters()}
    h, d, D = s.hidden_size, s.head_dim, b.head_dim
    g_s = s.num_attention_heads // s.num_key_value_heads
    g_b = b.num_attention_heads // b.num_key_value_heads
    dims = head_dims(d, D)
    norm_scale = math.sqrt(h / b.hidden_size)
    q_scale = math.sqrt(D / d)  # big scale D**-0.5 times q_scale is the small scale d**-0.5

    def rows(head_map: list[int]) -> torch.Tensor:
        """Big row (or column) of each small head row, heads in small order."""
        return torch.cat([hb * D + dims for hb in head_map])

    q_heads = [(hs // g_s) * g_b + hs % g_s for hs in range(s.num_attention_heads)]
    q_rows, kv_rows = rows(q_heads), rows(list(range(s.num_key_value_heads)))
    bp = dict(big.named_parameters())

    def put(name: str, index: tuple, value: torch.Tensor) -> None:
        bp[name][index] = value.to(bp[name].dtype).to(bp[name].device)

    for p in bp.values():
        p.zero_()
    put("model.embed_tokens.weight", (slice(None), slice(0, h)), sw["model.embed_tokens.weight"])
    if not s.tie_word_embeddings:
        put("lm_head.weight", (slice(None), slice(0, h)), sw["lm_head.weight"])
    put("model.norm.weight", (slice(0, h),), sw["model.norm.weight"] * norm_scale)
    hs, inter = slice(0, h), slice(0, s.intermediate_size)
    device = bp["model.embed_tokens.weight"].device
    q_rows, kv_rows = q_rows.to(device), kv_rows.to(device)
    for i, j in enumerate(layer_map(s.num_hidden_layers, b.num_hidden_layers)):
        src, dst = f"model.layers.{i}.", f"model.layers.{j}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(dst + norm + ".weight", (hs,), sw[src + norm + ".weight"] * norm_scale)
        put(dst + "self_attn.q_proj.weight", (q_rows, hs), sw[src + "self_attn.q_proj.weight"] * q_scale)
        put(dst + "self_attn.k_proj.weight", (kv_rows, hs), sw[src + "self_attn.k_proj.weight"])
        put(dst + "self_attn.v_proj.weight", (kv_rows, hs), sw[src + "self_attn.v_proj.weight"])
        put(dst + "self_attn.o_proj.weight", (hs, q_rows), sw[src + "self_attn.o_proj.weight"])
        for proj in ("gate_proj", "up_proj"):
            put(dst + f"mlp.{proj}.weight", (inter, hs), sw[src + f"mlp.{proj}.weight"])
        put(dst + "mlp.down_proj.weight", (hs, inter), sw[src + "mlp.down_proj.weight"])
