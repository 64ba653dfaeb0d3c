"""The shared decoder (CausalLM) as a Llama over the paged cache against transformers'
LlamaForCausalLM (eager, float32). The other families: tests/test_model_families.py."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCacheSpec, create_kv_cache
from app.engine.models.config import ModelConfig
from app.engine.models.decoder import CausalLM

ATOL, RTOL = 1e-4, 1e-4  # fp32 vs fp32: only summation order differs
BLOCK_SIZE = 4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def make_config(tie: bool, rope_scaling: dict | None = LLAMA3_ROPE) -> ModelConfig:
    # head_dim 16, theta 500000, original length 64: wavelengths 6.3 (kept), 32.5 (smoothed), >= 168 (scaled)
    return ModelConfig(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=rope_scaling, max_position_embeddings=256,
                       tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)


def make_pair(config: ModelConfig, seed: int = 0):
    """Our model and HF's with identical random weights, scaled so attention is far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    ours = CausalLM(config).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                std = 0.5 if "embed" in name else 1.5 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    hf_config = transformers.LlamaConfig(**config.to_hf())
    hf = transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    hf.load_state_dict(ours.state_dict(), strict=True)
    return ours, hf.eval()


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    return hf(torch.tensor([tokens])).logits[0].float()


class PagedRun:
    """Runs our model over a paged cache; each sequence owns shuffled, non-contiguous blocks."""

    def __init__(self, model: CausalLM, num_seqs: int, max_len: int, seed: int = 0):
        c = model.config
        blocks_per_seq = math.ceil(max_len / BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq + 1
        spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, BLOCK_SIZE, torch.float32)
        self.kv_cache = create_kv_cache("fp32", spec, num_blocks, "cpu")
        ids = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
        self.block_tables = torch.tensor(ids[: num_seqs * blocks_per_seq]).view(num_seqs, blocks_per_seq)
        self.model = model
        self.num_computed = [0] * num_seqs

    @torch.no_grad()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """new_tokens: seq index -> its tokens this step; returns seq index -> logits [n, vocab]."""
        seqs = sorted(new_tokens)
        input_ids, positions, slots, seq_lens, qsl = [], [], [], [], [0]
        for s in seqs:
            start = self.num_computed[s]
            for j, tok in enumerate(new_tokens[s]):
                pos = start + j
                input_ids.append(tok)
                positions.append(pos)
                slots.append(int(self.block_tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            self.num_computed[s] += len(new_tokens[s])
            seq_lens.append(self.num_computed[s])
            qsl.append(qsl[-1] + len(new_tokens[s]))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=self.block_tables[seqs],
                                 seq_lens=seq_lens, query_start_loc=qsl)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_cache, meta)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and hidden.shape == (len(input_ids), self.model.config.hidden_size)
        return {s: logits[qsl[i]:qsl[i + 1]] for i, s in enumerate(seqs)}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_matches_hf_prefill_decode_and_chunked(tie: bool) -> None:
    config = make_config(tie)
    ours, hf = make_pair(config)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 33)]

    # (a) one prefill forward for three sequences of different lengths
    run = PagedRun(ours, num_seqs=3, max_len=40)
    out = run.step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out[i], hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)

    # (b) four decode steps, one greedy token per sequence, against HF on the extended sequences
    seqs = [list(p) for p in prompts]
    for _ in range(4):
        for i in range(3):
            seqs[i].append(int(out[i][-1].argmax()))
        out = run.step({i: [seqs[i][-1]] for i in range(3)})
        for i in range(3):
            torch.testing.assert_close(out[i][0], hf_logits(hf, seqs[i])[-1], atol=ATOL, rtol=RTOL)

    # (c) chunked prefill (chunks of 7) of the longest prompt equals one-shot prefill
    one_shot = PagedRun(ours, num_seqs=1, max_len=40, seed=2).step({0: prompts[2]})[0]
    chunked_run = PagedRun(ours, num_seqs=1, max_len=40, seed=3)
    chunked = torch.cat([chunked_run.step({0: prompts[2][i:i + 7]})[0] for i in range(0, 33, 7)])
    torch.testing.assert_close(chunked, one_shot, atol=ATOL, rtol=RTOL)


def test_linear_rope_scaling_matches_hf() -> None:
    config = make_config(tie=False, rope_scaling={"type": "linear", "factor": 4.0})
    ours, hf = make_pair(config, seed=5)
    prompts = [list(range(3, 40)), list(range(100, 111))]
    out = PagedRun(ours, num_seqs=2, max_len=40).step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out[i], hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


def test_rope_scaling_is_visible_in_logits() -> None:
    """Guards the tests above: the scaling changes logits far beyond the tolerance used."""
    prompt = list(range(3, 40))
    scaled = hf_logits(make_pair(make_config(tie=False))[1], prompt)
    plain = hf_logits(make_pair(make_config(tie=False, rope_scaling=None))[1], prompt)
    assert (scaled - plain).abs().max() > 100 * ATOL


def test_config_hf_round_trip() -> None:
    config = make_config(tie=True)
    assert ModelConfig.from_hf(config.to_hf()) == config
    # transformers 5.x writes rope_parameters (rope_theta inside); 4.x wrote rope_theta + rope_scaling
    assert ModelConfig.from_hf(transformers.LlamaConfig(**config.to_hf()).to_dict()) == config
    legacy = {**config.to_hf(), "rope_scaling": {**LLAMA3_ROPE, "type": "llama3"}}
    assert ModelConfig.from_hf(legacy) == config


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "'gpt2'.*not supported.*llama.*qwen2.*qwen3.*mistral"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
])
def test_from_hf_rejects_unsupported(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**make_config(tie=False).to_hf(), **change})
