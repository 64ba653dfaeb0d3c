"""ModelConfig: a model's family, shape and RoPE, checked on construction. No torch, so that
processes which only read a model's config (the HTTP ingress) do not load it.

Every supported family runs on one decoder (models/decoder.py): pre-norm RMSNorm blocks, GQA
attention with rotate-half RoPE, a SiLU-gated MLP, HF's parameter names. The families differ in
the few flags of FAMILIES: Qwen2's bias on the q, k and v projections, Qwen3's RMSNorm over each
query and key head before RoPE. What none of them has here (sliding windows, biases on o_proj or
the MLP, other activations) is refused by `from_hf` with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ROPE_TYPES = ("llama3", "linear")
_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",)}


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # HF config.json model_type
    models: str  # what it covers, for messages
    hf_architecture: str  # transformers' class
    qkv_bias: bool  # a bias on q_proj, k_proj and v_proj (not o_proj)
    qk_norm: bool  # RMSNorm over head_dim on each query and key head, before RoPE


FAMILIES = {f.name: f for f in (
    Family("llama", "Llama 2 and 3.x, SmolLM2, TinyLlama", "LlamaForCausalLM", False, False),
    Family("qwen2", "Qwen2, Qwen2.5", "Qwen2ForCausalLM", True, False),
    Family("qwen3", "Qwen3 dense", "Qwen3ForCausalLM", False, True),
    Family("mistral", "Mistral 7B v0.2/v0.3 and others without a sliding window", "MistralForCausalLM", False, False),
)}


def supported_families() -> str:
    """The families for error messages: 'llama (Llama 2 and 3.x, ...), qwen2 (...), ...'."""
    return ", ".join(f"{f.name} ({f.models})" for f in FAMILIES.values())


@dataclass(slots=True)
class ModelConfig:
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
    family: str = "llama"  # a key of FAMILIES

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not supported; supported: {supported_families()}")
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

    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.family].qk_norm

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """From a HF config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`) of a
        supported family; ValueError naming what is not supported otherwise."""
        family = _hf_family(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (got {hf['hidden_act']!r})")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported: the MLP projections here have no biases")
        if family != "qwen2" and hf.get("attention_bias"):  # qwen2's q/k/v biases need no flag
            raise ValueError(f"attention_bias=True is not supported for {family}: it adds biases to q/k/v and "
                             f"o_proj; of attention biases only Qwen2's (q/k/v) are implemented")
        _check_no_sliding_window(hf, family)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or (128 if family == "qwen3" else None)  # transformers' Qwen3 default
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta), rope_scaling=rope or None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), family=family,
        )

    def to_hf(self) -> dict:
        """A config.json dict that transformers' config class of the family accepts (legacy rope keys,
        read by 4.x and 5.x), with the flags that select this implementation's variant."""
        d = asdict(self)
        family = d.pop("family")
        hf = {"architectures": [FAMILIES[family].hf_architecture], "model_type": family, **d, "hidden_act": "silu"}
        if family != "qwen2":
            hf["attention_bias"] = False
        if family == "llama":
            hf["mlp_bias"] = False
        if family in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = False
        if family == "mistral":
            hf["sliding_window"] = None
        return hf

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size + 2 * h
        per_layer += (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + lm_head


def _hf_family(hf: dict) -> str:
    """The family of a config.json: its model_type, or (without one) its architecture."""
    model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
    if model_type in FAMILIES:
        return model_type
    if model_type is None:
        for f in FAMILIES.values():
            if f.hf_architecture in architectures:
                return f.name
    raise ValueError(f"model_type {model_type!r} (architectures {architectures}) is not supported; supported "
                     f"families (config.json model_type): {supported_families()}")


def _check_no_sliding_window(hf: dict, family: str) -> None:
    """ValueError if some layer attends over a sliding window shorter than the model's context
    (attention here is always over the whole context). transformers' defaults: Mistral's window is
    4096 unless config.json says null; Qwen2/3 slide only with use_sliding_window, in layers from
    max_window_layers on."""
    max_pos = hf.get("max_position_embeddings", 2048)
    if family == "mistral":
        window = hf.get("sliding_window", 4096)
        sliding = window is not None
    elif family in ("qwen2", "qwen3"):
        window = hf.get("sliding_window", 4096)
        sliding = bool(hf.get("use_sliding_window")) and window is not None and \
            hf.get("max_window_layers", 28) < hf["num_hidden_layers"]
    else:
        window, sliding = hf.get("sliding_window"), False
    layer_types = hf.get("layer_types") or []
    if "sliding_attention" in layer_types:
        sliding = window is not None
    if sliding and window < max_pos:
        raise ValueError(f"sliding-window attention (sliding_window={window} < max_position_embeddings={max_pos}) "
                         f"is not supported: attention here always covers the whole context. Use a model "
                         f"without one (e.g. Mistral-7B v0.2/v0.3, whose config.json has sliding_window null)")


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
