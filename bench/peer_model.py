r"""A small random-weight Hugging Face Llama directory that both our engine and vLLM load.

It is the peer model of the side-by-side CPU benchmark (bench/cpu_vs_vllm.py): the same
directory, so both servers run the same weights and see the same token ids. Weights are seeded
normal draws (bf16 safetensors); the tokenizer is a byte-level BPE with a 512-token vocabulary,
trained with `tokenizers` on CPython's pydoc topic texts (in every CPython), so the product
brief's load-test prompt comes to about 3,000 tokens, as a real tokenizer would give.

    python bench/peer_model.py /tmp/peer-llama

`--from-gguf FILE` writes instead the Hugging Face form of a GGUF model (weights dequantized by
transformers' GGUF reader, saved in bf16, and its tokenizer), so that vLLM's CPU build serves the
same weights our engine reads from the GGUF file (bench/cpu_vs_vllm.py --model smollm2 runs it with
vLLM's interpreter, whose environment has transformers and gguf).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=512,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", hidden_act="silu",
)
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
# A plain chat template (BOS first, as Llama 3's), so chat requests can be compared across servers.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _training_text() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))


def write_peer_model(directory: str | Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into `directory` (created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    g = torch.Generator().manual_seed(seed)
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(c["vocab_size"], h, std=1.0),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": normal(c["vocab_size"], h, std=0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": normal(nh * d, h, std=0.2),
            p + "self_attn.k_proj.weight": normal(nkv * d, h, std=0.2),
            p + "self_attn.v_proj.weight": normal(nkv * d, h),
            p + "self_attn.o_proj.weight": normal(h, nh * d),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(c, indent=1))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]}))
    write_tokenizer(directory, c["vocab_size"])
    return directory


def write_hf_from_gguf(gguf_path: str | Path, directory: str | Path) -> Path:
    """The HF directory of a GGUF model (see the module docstring); tied embeddings stay tied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, directory = Path(gguf_path), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kw = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.bfloat16, **kw)
    tied = model.config.tie_word_embeddings
    # transformers will not save_pretrained a model it read from GGUF: write its tensors and config
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=config.get("architectures") or [type(model).__name__], torch_dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-gguf", default=None, help="write the HF form of this GGUF file instead")
    args = ap.parse_args()
    if args.from_gguf:
        print(write_hf_from_gguf(args.from_gguf, args.directory))
    else:
        print(write_peer_model(args.directory, args.seed))
