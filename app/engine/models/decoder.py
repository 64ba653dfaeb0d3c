"""The decoder of every supported family (models/config.py FAMILIES) over a paged KV cache;
parameter names exactly as HF's (which all four families share).

One structure, with the families' differences as flags of the config: Llama 3.x (GQA, RoPE
scaling, tied or untied embeddings) and Mistral are the plain decoder; Qwen2/2.5 add a bias to the
q, k and v projections (added in the fused projection's GEMM, before RoPE); Qwen3 normalizes each
query and key head (RMSNorm over head_dim, one weight for all heads) before RoPE.

Tokens of every sequence in a step are flattened into one dimension T (see AttentionMetadata).
Each layer stores its new K/V in the cache first and then attends through the cache, so new
tokens read their own K/V back and chunked prefill computes what one-shot prefill does.

Tensor parallelism (Megatron-LM's split): rank r of tp_size holds attention heads, KV heads and
MLP columns [r * n / tp_size, (r + 1) * n / tp_size). q/k/v and gate/up are column-parallel (their
output rows are split, no communication), o_proj and down_proj row-parallel (their input columns
are split; each rank's partial sum is all-reduced), so each layer costs two all-reduces of
[T, hidden]. Embeddings, norms and lm_head are replicated: every rank computes the same hidden
states and rank 0 alone computes the logits for sampling. With tp_size 1 nothing is split and
torch.distributed is never touched.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.engine.attention import AttentionMetadata
from app.engine.models.config import ModelConfig
from app.engine.kv_cache import KVCache
from app.kernels import cpu_kernels
from app.kernels.layer_ops_ref import apply_rope, rms_norm_ref, rope_qk_ref, silu_and_mul_ref  # noqa: F401 (apply_rope: re-exported)

# Where each linear is split: column-parallel layers split their output rows (dim 0),
# row-parallel layers their input columns (dim 1). Everything else is replicated.
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


def shard_dim(name: str) -> int | None:
    """The dimension of parameter `name` (HF naming) that tensor parallelism splits; None if replicated."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _COLUMN_PARALLEL:
        return 0
    if module in _ROW_PARALLEL:
        return 1
    return None


def shard_slices(name: str, full_shape: tuple[int, ...], tp_rank: int, tp_size: int) -> tuple[slice, ...]:
    """Index of rank tp_rank's shard in the full tensor of parameter `name`: contiguous rows of
    whole heads (q/k/v rows are head-major) or MLP columns. Rank r's query heads are exactly the
    ones that read its KV heads, since both are split into tp_size equal contiguous ranges."""
    index = [slice(None)] * len(full_shape)
    dim = shard_dim(name)
    if dim is not None and tp_size > 1:
        n = full_shape[dim]
        assert n % tp_size == 0, f"{name}: dim {dim} of size {n} does not split into {tp_size} shards"
        step = n // tp_size
        index[dim] = slice(tp_rank * step, (tp_rank + 1) * step)
    return tuple(index)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum of x over the tensor-parallel ranks (the default process group), in place."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32, on CPU
    """Inverse frequencies with the rope scaling applied (the formulas of HF / Llama 3.1)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # not meta, even under init
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    factor = rs["factor"]
    if rs["rope_type"] == "linear":
        return inv_freq / factor
    low, high, old_len = rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (> old_len / low) are slowed down by `factor`, short ones (< old_len / high)
    # kept, and the band between interpolated smoothly.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim // 2] float32
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


CPU_GEMM_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). On the CPU in bf16/fp16 the rows are padded to a multiple of CPU_GEMM_ROWS:
    oneDNN builds (JIT-compiles) a kernel per new shape, about 2 ms, which a step's varying token
    count would otherwise pay at every projection (docs/history.md, the CPU section)."""
    rows = x.shape[0]
    # Only where the reduction is a multiple of 32: with a tail (e.g. stories260K's 172), oneDNN's
    # bf16 kernels let a NaN in one token's row reach a neighbour's output at some row counts (64
    # among them, which padding would make every step's), so the wrong request would fail.
    if x.device.type != "cpu" or x.dtype == torch.float32 or rows % CPU_GEMM_ROWS == 0 or x.shape[1] % 32:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(-(-rows // CPU_GEMM_ROWS) * CPU_GEMM_ROWS, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


def _cpu_ops(x: torch.Tensor) -> bool:
    """The CPU extension's fused layer ops (app/kernels/cpu_kernels.py) for CPU tensors where it
    builds (APP_CPU_KERNELS=0 turns it off), the torch references otherwise."""
    return x.device.type == "cpu" and cpu_kernels.available()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.use_kernels = False  # app/kernels/layer_ops.py's fused kernel (CUDA)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, hidden] -> its norm; with residual: (norm(x + residual), x + residual)."""
        if self.use_kernels:
            from app.kernels.layer_ops import rms_norm

            y, h = rms_norm(x, self.weight, self.eps, residual)
        elif _cpu_ops(x):
            y, h = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        else:
            y, h = rms_norm_ref(x, self.weight, self.eps, residual)
        return y if residual is None else (y, h)


class Attention(nn.Module):
    """This rank's heads: num_attention_heads / tp_size query heads and their KV heads.

    q/k/v keep their HF parameters; after `fuse_projections` they are views of one [q + 2 kv,
    hidden] weight (and one bias, for qkv_bias families) and the layer runs one GEMM for all three.
    With qk_norm (Qwen3) q_norm / k_norm ([head_dim], replicated on every rank) normalize each query
    and key head of the projection before RoPE.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None, tp_size: int = 1) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp_size = tp_size
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        h, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(h, q_size, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, kv_size, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, h, bias=False, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_weight: torch.Tensor | None = None  # [q + 2 kv, hidden], set by fuse_projections
        self.qkv_bias: torch.Tensor | None = None  # [q + 2 kv] where the family has one
        self.use_kernels = False

    def fuse_projections(self) -> None:
        self.qkv_weight, self.qkv_bias = _fuse(self.q_proj, self.k_proj, self.v_proj)

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """RMSNorm each query head with q_norm and each key head with k_norm, in place in qkv
        [T, (H + 2K) * D] (as HF's Qwen3: on the projection, before RoPE). The RMSNorm modules run
        the layer-op kernels on rows of head_dim ([T * heads, D] copies of the strided heads)."""
        T = qkv.shape[0]
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :H * D].reshape(T * H, D))  # [T * H, D]
        k = self.k_norm(qkv[:, H * D:(H + K) * D].reshape(T * K, D))  # [T * K, D]
        qkv[:, :H * D] = q.view(T, H * D)
        qkv[:, H * D:(H + K) * D] = k.view(T, K * D)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [T, (H + 2K) * D], the bias added
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        if self.use_kernels:
            from app.kernels.layer_ops import rope_qk

            q, k = rope_qk(qkv, cos, sin, H, K)  # [T, H, D], [T, K, D]
        elif _cpu_ops(qkv):
            q, k = cpu_kernels.rope_qk(qkv, cos, sin, H, K)
        else:
            q, k = rope_qk_ref(qkv, cos, sin, H, K)
        v = qkv[:, (H + K) * D:].view(T, K, D)  # [T, K, D], rows strided
        kv_cache.store(self.layer_idx, k, v, meta.slot_mapping, meta.nonfinite)
        o = kv_cache.attention(self.layer_idx, q, meta, self.scale)  # [T, heads, head_dim]
        return all_reduce(linear(o.reshape(T, H * D), self.o_proj.weight), self.tp_size)  # [T, hidden]


class MLP(nn.Module):
    """This rank's intermediate_size / tp_size MLP columns (gate and up fused like q/k/v)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        h, i = config.hidden_size, config.intermediate_size // tp_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)
        self.gate_up_weight: torch.Tensor | None = None  # [2 i, hidden], set by fuse_projections
        self.use_kernels = False

    def fuse_projections(self) -> None:
        self.gate_up_weight, _ = _fuse(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_weight is not None:
            gate_up = linear(x, self.gate_up_weight)  # [T, 2 i]
        else:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        if self.use_kernels:
            from app.kernels.layer_ops import silu_and_mul

            act = silu_and_mul(gate_up)
        elif _cpu_ops(gate_up):
            act = cpu_kernels.silu_and_mul(gate_up)
        else:
            act = silu_and_mul_ref(gate_up)
        return all_reduce(linear(act, self.down_proj.weight), self.tp_size)


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight holding the linears' weights stacked by rows, and one bias likewise (None when they
    have none); each linear's weight and bias become views of their rows (so loaders that copy_ into
    the HF names fill the fused tensors)."""
    def stack(attr: str) -> torch.Tensor:
        fused = torch.cat([getattr(lin, attr).detach() for lin in linears], dim=0)
        row = 0
        for lin in linears:
            n = getattr(lin, attr).shape[0]
            setattr(lin, attr, nn.Parameter(fused[row:row + n], requires_grad=getattr(lin, attr).requires_grad))
            row += n
        return fused

    return stack("weight"), (stack("bias") if linears[0].bias is not None else None)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None, tp_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, tp_size)

    def forward(self, h, residual, cos, sin, kv_cache: KVCache, meta: AttentionMetadata):
        """(h, residual) -> (h', residual'): the residual stream is residual + h, summed inside the
        next norm (h + residual in the activation dtype, as a plain add would)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual  # [T, hidden] each


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp_size: int = 1) -> None:
        super().__init__()
        # The weight passed in: nn.Embedding's own init (normal_), on the meta device the loader builds
        # under, runs torch's Python reference, which imports torch._dynamo (1.1 s with bytecode caches,
        # 3.4 s on an H100 machine without them: a third of a warm replica start). The loader fills it.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, tp_size)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # A plain attribute, not a buffer: absent from state dicts, never cast by .to(dtype),
        # untouched by meta init; moved once to the device of the first positions it meets.
        self.inv_freq = rope_inv_freq(config)  # [head_dim // 2] float32

    def forward(self, input_ids, positions, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions)  # [T, head_dim] float32 each
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm(h, residual)[0]


class CausalLM(nn.Module):
    """The whole model (tp_size 1) or rank tp_rank's shard of it; see the module docstring."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        config.check_tensor_parallel(tp_size)
        assert 0 <= tp_rank < tp_size, f"tp_rank {tp_rank} out of range for tp_size {tp_size}"
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = DecoderModel(config, dtype, tp_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up into one weight each (call before loading weights: the HF-named
        parameters become views of the fused ones, which the loaders fill)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def use_layer_kernels(self, enabled: bool) -> None:
        """Run RMSNorm, RoPE and SiLU-and-mul as app/kernels/layer_ops.py's kernels (CUDA, or the
        Triton interpreter in tests; head_dim a power of two), else in torch."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.use_kernels = enabled

    def tie_weights(self) -> None:
        """Share embed_tokens' weight with lm_head when tied (call again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return linear(hidden, self.lm_head.weight).float()

    def full_shape(self, name: str) -> tuple[int, ...]:
        """Shape of parameter `name` in the unsharded model."""
        shape = list(self.get_parameter(name).shape)
        dim = shard_dim(name)
        if dim is not None:
            shape[dim] *= self.tp_size
        return tuple(shape)

    def shard_slices(self, name: str) -> tuple[slice, ...]:
        """Index of this rank's shard of parameter `name` in the full tensor."""
        return shard_slices(name, self.full_shape(name), self.tp_rank, self.tp_size)
