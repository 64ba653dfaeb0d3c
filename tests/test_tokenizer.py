"""Tokenizers: byte, llama2.c tok512.bin (against a transliteration of run.c), Hugging Face
(against transformers), chat templates and load_tokenizer dispatch."""

import json
import random
import struct
from datetime import datetime
from pathlib import Path

import pytest

from app.engine.tokenizer import (
    DEFAULT_CHAT_TEMPLATE, ByteTokenizer, ChatTemplateError, HFTokenizer, Llama2cTokenizer,
    load_tokenizer)

TOK512 = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K" / "tok512.bin"
needs_tok512 = pytest.mark.skipif(not TOK512.exists(), reason=f"llama2.c tokenizer not found at {TOK512}")

TEXTS = ["Once upon a time", "Hello, 世界! ™ é\n\tx", "  two leading spaces", "emoji 🙂🚀 end",
         "a", "Lily said: \"Don't!\" (42%)", "ñandú über Ærø", ""]


# ---------------------------------------------------------------------------------------------
# ByteTokenizer


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer(300)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [1] + [b + 3 for b in text.encode("utf-8")]
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode([1, 3 + ord("h"), 3 + ord("i"), 2], skip_special_tokens=False) == "<s>hi</s>"
    assert tok.decode([0, 1, 3 + ord("h"), 2, 259, 299]) == "h"  # ids >= 259 decode to nothing
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, frozenset({2}))
    assert tok.all_special_ids == frozenset({0, 1, 2})


def test_byte_decode_of_invalid_utf8_is_replaced():
    tok = ByteTokenizer()
    for raw in (b"\xff", b"ab\xe4\xb8", b"\xe4\xb8\xadx\x80y", b"\xf0\x9f\x99", bytes(range(256))):
        assert tok.decode([b + 3 for b in raw]) == raw.decode("utf-8", errors="replace")


def test_byte_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size >= 259.*got 100"):
        ByteTokenizer(100)


def test_default_chat_template():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tok = ByteTokenizer()
    assert tok.apply_chat_template(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == \
        "<|system|>\nBe brief.\n<|user|>\nHi\n"


# ---------------------------------------------------------------------------------------------
# llama2.c


def _write_llama2c(path, pieces_scores):
    data = struct.pack("<i", max(len(p) for p, _ in pieces_scores))
    for piece, score in pieces_scores:
        data += struct.pack("<fi", score, len(piece)) + piece
    path.write_bytes(data)


def _tiny_vocab():
    """<unk>, BOS, EOS, 256 byte tokens (ids 3..258), then a few pieces with hand-picked scores."""
    vocab = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
    vocab += [(f"<0x{b:02X}>".encode(), 0.0) for b in range(256)]
    vocab += [(b" ", 0.0), (b"a", 0.0), (b"b", 0.0), (b"c", 0.0),  # 259 260 261 262
              (b"ab", -1.0), (b"bc", -0.5), (b" a", -2.0), (b"abc", -3.0),  # 263 264 265 266
              (b"ba", -1.0), ("é".encode(), 0.0)]  # 267 268
    return vocab


@pytest.mark.parametrize("text,expected", [
    # " ", a, b, c: best merge is "bc" (-0.5), then " a" (-2) beats "abc" (-3): " a" + "bc"
    ("abc", [1, 265, 264]),
    # " ", a, b, a: "ab" and "ba" tie at -1; run.c takes the leftmost pair
    ("aba", [1, 259, 263, 260]),
    # "ab" (-1) merges before " a" (-2) could: " ", "ab", " ", "c"
    ("ab c", [1, 259, 263, 259, 262]),
    # a multi-byte character in the vocab is one token; one that is not falls back to its bytes
    ("é", [1, 259, 268]),
    ("ñx", [1, 259, 0xC3 + 3, 0xB1 + 3, ord("x") + 3]),
    ("", [1]),
])
def test_llama2c_merges_on_hand_made_vocab(tmp_path, text, expected):
    _write_llama2c(tmp_path / "tiny.bin", _tiny_vocab())
    tok = Llama2cTokenizer(tmp_path / "tiny.bin")
    assert tok.vocab_size == 269
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == expected[1:]
    assert tok.decode(expected) == text


def test_llama2c_decode_rules(tmp_path):
    _write_llama2c(tmp_path / "tiny.bin", _tiny_vocab())
    tok = Llama2cTokenizer(tmp_path / "tiny.bin")
    assert tok.decode([265, 264]) == " abc"  # no BOS: the leading space stays
    assert tok.decode([1, 265, 264]) == "abc"  # the piece after BOS loses it
    assert tok.decode([1, 265, 264, 2], skip_special_tokens=False) == "<s>abc</s>"
    assert tok.decode([259, 0xE4 + 3, 0xB8 + 3, 0xAD + 3]) == " 中"  # <0xNN> pieces are bytes
    assert tok.decode([0xE4 + 3, 0xB8 + 3]) == "\ufffd"


def _runc_encode(pieces, scores, text):
    """Transliteration of llama2.c run.c encode() (bos=1, eos=0): O(n^2), strict > on scores."""
    lookup = {}
    for i, p in enumerate(pieces):
        lookup.setdefault(p, i)
    tokens = [1]
    if text:
        tokens.append(lookup[b" "])
    for ch in text:
        b = ch.encode("utf-8")
        tokens.extend([lookup[b]] if b in lookup else [x + 3 for x in b])
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(1, len(tokens) - 1):  # run.c also pairs BOS: no "<s>..." piece merges
            merged = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if merged is not None and scores[merged] > best_score:
                best_score, best_id, best_idx = scores[merged], merged, i
        if best_idx == -1:
            return tokens
        tokens[best_idx:best_idx + 2] = [best_id]


@needs_tok512
def test_llama2c_tok512_matches_runc_and_round_trips():
    tok = Llama2cTokenizer(TOK512)
    assert tok.vocab_size == 512 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({1, 2})  # run.c also stops at BOS
    ids = tok.encode("Once upon a time")
    assert ids[0] == 1
    assert [tok.pieces[i] for i in ids[1:]] == [b" Once", b" upon", b" a", b" time"]
    assert tok.decode(ids) == "Once upon a time"
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,!?'\nLSOTé世🙂™"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
                     for _ in range(200)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == _runc_encode(tok.pieces, tok.scores, text), text
        assert tok.decode(ids) == text


def test_llama2c_bad_file(tmp_path):
    (tmp_path / "bad.bin").write_bytes(struct.pack("<ifi", 5, 0.0, 100) + b"abc")
    with pytest.raises(ValueError, match="claims 100 bytes"):
        Llama2cTokenizer(tmp_path / "bad.bin")


# ---------------------------------------------------------------------------------------------
# Hugging Face

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
SENTENCES = ["Once upon a time there was a little girl named Lily.",
             "She loved to play outside in the park with her friends.",
             "Héllo wörld, 世界 says hi! 123 456"] * 3

LLAMA31_STYLE_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant roles are supported, got " + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def build_hf_tokenizer(directory, post_processor=True, config=None, generation_config=None):
    """A real byte-level BPE tokenizer.json trained on a few sentences, plus config files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return tok


@pytest.fixture
def llama3_dir(tmp_path):
    d = tmp_path / "llama3"
    config = {"bos_token": "<|begin_of_text|>",
              "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False,
                            "rstrip": False, "normalized": False, "single_word": False, "special": True},
              "chat_template": LLAMA31_STYLE_TEMPLATE}
    build_hf_tokenizer(d, config=config, generation_config={"eos_token_id": [1, 4]})
    return d


HF_TEXTS = ["Once upon a time", "Lily loved the park.", "unseen wörds 日本語 🙂", "",
            "text with <|eot_id|> inside", "  spaces\n\nnewlines\t"]


def test_hf_encode_matches_transformers_and_round_trips(llama3_dir):
    from transformers import PreTrainedTokenizerFast

    tok = HFTokenizer(llama3_dir)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(llama3_dir / "tokenizer.json"))
    for text in HF_TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        assert ids[0] == tok.bos_token_id == 0
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text.replace("<|eot_id|>", "")  # specials skipped
        assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_hf_special_ids(llama3_dir):
    tok = HFTokenizer(llama3_dir)
    assert tok.eos_token_id == 4  # <|eot_id|> from tokenizer_config (a dict with "content")
    assert tok.eos_token_ids == frozenset({1, 4})  # plus generation_config's list
    assert tok.all_special_ids == frozenset(range(5))
    assert tok.vocab_size == len(json.loads((llama3_dir / "tokenizer.json").read_text())["model"]["vocab"])


def test_hf_chat_template_renders_exactly_like_transformers(llama3_dir):
    from transformers import PreTrainedTokenizerFast

    tok = HFTokenizer(llama3_dir)
    msgs = [{"role": "system", "content": " Be terse. "}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    before = datetime.now().strftime("%d %b %Y")
    text = tok.apply_chat_template(msgs)
    after = datetime.now().strftime("%d %b %Y")
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = ("<|begin_of_text|>" + h.format("system") + "Today Date: {date}\n\nBe terse.<|eot_id|>"
                + h.format("user") + "Hi!<|eot_id|>" + h.format("assistant") + "Hello.<|eot_id|>"
                + h.format("user") + "Bye<|eot_id|>" + h.format("assistant"))
    assert text in {expected.format(date=before), expected.format(date=after)}
    reference = PreTrainedTokenizerFast.from_pretrained(str(llama3_dir))
    ref_text = reference.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref_text or before != after
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert no_prompt == text[:-len(h.format("assistant"))]
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.eos_token_id) == 4


def test_hf_chat_template_raise_exception(llama3_dir):
    tok = HFTokenizer(llama3_dir)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"}]
    with pytest.raises(ChatTemplateError, match="rejected.*Only user and assistant .* got tool"):
        tok.apply_chat_template(msgs)


def test_hf_add_bos_token_and_template_fallbacks(tmp_path):
    d = tmp_path / "plain"
    build_hf_tokenizer(d, post_processor=False,
                       config={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                               "add_bos_token": True,
                               "chat_template": [
                                   {"name": "tool_use", "template": "TOOLS"},
                                   {"name": "default", "template": "{{ messages[0]['content'] }}!"}]})
    tok = HFTokenizer(d)
    plain = tok.encode("Once upon", add_special_tokens=False)
    assert 0 not in plain
    assert tok.encode("Once upon") == [0] + plain
    assert tok.eos_token_ids == frozenset({1})
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"

    d2 = tmp_path / "no_template"
    build_hf_tokenizer(d2, config={"bos_token": "<|begin_of_text|>"})
    tok2 = HFTokenizer(d2 / "tokenizer.json")  # the file form finds its directory's configs
    assert tok2.chat_template == DEFAULT_CHAT_TEMPLATE
    assert tok2.eos_token_id is None and tok2.eos_token_ids == frozenset()
    assert tok2.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"


# ---------------------------------------------------------------------------------------------
# load_tokenizer


def test_load_tokenizer_dispatch(tmp_path, llama3_dir):
    assert isinstance(load_tokenizer(None), ByteTokenizer) and load_tokenizer(None).vocab_size == 259
    assert load_tokenizer(None, vocab_size=512).vocab_size == 512
    _write_llama2c(tmp_path / "tiny.bin", _tiny_vocab())
    assert isinstance(load_tokenizer(str(tmp_path / "tiny.bin")), Llama2cTokenizer)
    assert isinstance(load_tokenizer(str(llama3_dir)), HFTokenizer)
    assert isinstance(load_tokenizer(str(llama3_dir / "tokenizer.json")), HFTokenizer)
    with pytest.raises(ValueError, match="has 269 tokens but the model's vocab is 100"):
        load_tokenizer(str(tmp_path / "tiny.bin"), vocab_size=100)


@pytest.mark.parametrize("name", ["empty_dir", "missing.bin"])
def test_load_tokenizer_rejects_unknown_paths(tmp_path, name):
    path = tmp_path / name
    if name == "empty_dir":
        path.mkdir()
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(path))
    assert str(path) in str(err.value) and "tokenizer.json" in str(err.value) and "*.bin" in str(err.value)


def test_load_tokenizer_names_a_broken_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a readable GGUF file") as err:
        load_tokenizer(str(path))
    assert str(path) in str(err.value)
