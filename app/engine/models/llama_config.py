"""LlamaConfig: a Llama model's shape and RoPE, checked on construction. No torch, so that
processes which only read a model's config (the HTTP ingress) do not load it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

ROPE_TYPES = ("llama3", "linear")
_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",)}


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE (got {self.head_dim})")
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError unless every rank of tp_size gets whole KV heads and equal MLP shards."""
        if tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1 (got {tp_size})")
        for what, n in (("num_key_value_heads", self.num_key_value_heads),
                        ("num_attention_heads", self.num_attention_heads),
                        ("intermediate_size", self.intermediate_size)):
            if n % tp_size:
                ok = [d for d in range(1, self.num_key_value_heads + 1)
                      if self.num_key_value_heads % d == 0 and self.intermediate_size % d == 0]
                raise ValueError(f"tensor_parallel_size {tp_size} must divide {what} ({n}): each worker holds "
                                 f"an equal share of the heads and MLP columns; this model allows "
                                 f"tensor_parallel_size in {ok}")

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """From a HF config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in (hf.get("architectures") or []):
            raise ValueError(f"only Llama checkpoints are supported (model_type {hf.get('model_type')!r}, "
                             f"architectures {hf.get('architectures')}); expected model_type 'llama'")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{flag}=True is not supported: this Llama implementation has no biases")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (got {hf['hidden_act']!r})")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim"), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta), rope_scaling=rope or None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        )

    def to_hf(self) -> dict:
        """A config.json dict that transformers' LlamaConfig accepts (legacy rope keys, read by 4.x and 5.x)."""
        d = asdict(self)
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **d,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size + 2 * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + lm_head


def _normalize_rope_scaling(rope: dict | None) -> dict | None:
    """{"rope_type": t, <t's keys>} or None; HF's legacy "type" key is accepted."""
    if not rope:
        return None
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None)
    rope.pop("type", None)
    rope.pop("rope_theta", None)
    if rope_type in (None, "default"):
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {list(ROPE_TYPES)} or none)")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in rope]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} is missing {missing}")
    return {"rope_type": rope_type, **{k: rope[k] for k in _ROPE_KEYS[rope_type]}}
