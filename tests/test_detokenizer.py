"""IncrementalDetokenizer: incremental text == full decode, stop strings, streaming deltas."""

import json
import random
from pathlib import Path

import pytest

from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer

TOK512 = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K" / "tok512.bin"

# Characters of 1 to 4 UTF-8 bytes; the tokenizers split most of the multi-byte ones.
TEXT = "Once upon a time, Lily saw a big red ball. Héllo wörld! 世界 日本語 🙂🚀 ™ end."


def _hf_byte_level(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=350, special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["Once upon a time there was a girl named Lily.",
                             "She saw a big red ball in the park."] * 3, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory)


def _hf_sentencepiece(directory):
    """Llama 2 style: '▁' for spaces, <0xNN> byte fallback, and a decoder that strips the leading
    space of the first token, so decode(a slice) is not a slice of decode(all)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(["Once upon a time there was a girl named Lily.",
                             "She saw a big red ball in the park."] * 3, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return HFTokenizer(directory)


@pytest.fixture(params=["byte", "llama2c", "hf_byte_level", "hf_sentencepiece"])
def tokenizer(request, tmp_path):
    if request.param == "byte":
        return ByteTokenizer(300)
    if request.param == "llama2c":
        if not TOK512.exists():
            pytest.skip(f"llama2.c tokenizer not found at {TOK512}")
        return Llama2cTokenizer(TOK512)
    if request.param == "hf_byte_level":
        return _hf_byte_level(tmp_path / "hf")
    tok = _hf_sentencepiece(tmp_path / "sp")
    assert tok.decode(tok.encode("a there", add_special_tokens=False)[1:]) != " there"  # slices differ
    return tok


def _run(detok, ids, chunk_sizes):
    """Feed ids in chunks; returns (deltas, index of the chunk that matched a stop or None)."""
    deltas, pos, i = [], 0, 0
    while pos < len(ids):
        n = chunk_sizes[i % len(chunk_sizes)]
        i += 1
        stop = detok.append(ids[pos:pos + n])
        pos += n
        finished = stop is not None or pos >= len(ids)
        deltas.append(detok.get_delta(finished))
        if stop is not None:
            return deltas, stop
    return deltas, None


def _random_ids(tokenizer, rng):
    if rng.random() < 0.5:  # real text, with multi-byte characters split across tokens
        start = rng.randrange(len(TEXT))
        return tokenizer.encode(TEXT[start:], add_special_tokens=False)
    ids = range(3, tokenizer.vocab_size)
    if isinstance(tokenizer, HFTokenizer) and tokenizer.decode([tokenizer.vocab_size - 1]) == "\ufffd":
        # HF's ByteFallback decoder replaces a whole run of <0xNN> tokens that is not valid
        # UTF-8, valid leading bytes included, so text already streamed can change afterwards;
        # no incremental decoder can follow that. Random ids here avoid the byte tokens.
        ids = range(3, tokenizer.vocab_size - 256)
    return [rng.choice(ids) for _ in range(rng.randint(1, 40))]


def test_incremental_text_equals_full_decode(tokenizer):
    rng = random.Random(0)
    for trial in range(150):
        ids = _random_ids(tokenizer, rng)
        chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in range(5)]
        detok = IncrementalDetokenizer(tokenizer)
        deltas, stop = _run(detok, ids, chunks)
        assert stop is None
        assert detok.output_text == tokenizer.decode(ids), (trial, ids)
        assert "".join(deltas) == detok.output_text
        assert detok.token_ids == ids


def test_split_multibyte_character_is_held_back():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = [b + 3 for b in "a世".encode("utf-8")]  # a, then 3 bytes
    assert [detok.append([i]) for i in ids[:3]] == [None] * 3
    assert detok.get_delta(False) == "a"
    assert detok.output_text == "a\ufffd"  # what decode() of these ids gives
    detok.append([ids[3]])
    assert detok.get_delta(False) == "世" and detok.output_text == "a世"


def test_special_tokens_skipped_or_kept():
    tok = ByteTokenizer()
    ids = [3 + ord("h"), 2, 3 + ord("i"), 1]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for i in ids:
            detok.append([i])
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == "h</s>i<s>"


def test_prompt_context_gives_the_first_piece_its_space():
    if not TOK512.exists():
        pytest.skip(f"llama2.c tokenizer not found at {TOK512}")
    tok = Llama2cTokenizer(TOK512)
    prompt = tok.encode("Once upon a time")
    out = tok.encode(" there was a girl", add_special_tokens=False)[1:]  # drop the dummy prefix
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    for i in out:
        detok.append([i])
    assert detok.output_text == " there was a girl"
    assert tok.decode(prompt + out) == tok.decode(prompt) + detok.output_text
    # right after BOS the first piece loses its space, as in decode(prompt + out)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1])
    detok.append(out)
    assert detok.output_text == "there was a girl"


@pytest.mark.parametrize("include,expected", [(False, " Once u"), (True, " Once upon a t")])
def test_stop_string_across_tokens(include, expected):
    if not TOK512.exists():
        pytest.skip(f"llama2.c tokenizer not found at {TOK512}")
    tok = Llama2cTokenizer(TOK512)
    ids = tok.encode("Once upon a time there", add_special_tokens=False)  # " Once" " upon" " a" ...
    detok = IncrementalDetokenizer(tok, stop=["pon a t"], include_stop_str_in_output=include)
    deltas, stop = _run(detok, ids, [1])
    assert stop == "pon a t" and detok.stop_reason == "pon a t"
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert len(deltas) == 4  # matched at " time", the fourth token
    with pytest.raises(RuntimeError, match="after stop string"):
        detok.append([ids[-1]])


def test_stop_string_with_multibyte_characters():
    tok = ByteTokenizer()
    ids = [b + 3 for b in "say 世界 twice: 世界!".encode("utf-8")]
    detok = IncrementalDetokenizer(tok, stop=["界 t"])
    deltas, stop = _run(detok, ids, [1])
    assert stop == "界 t" and detok.output_text == "say 世" == "".join(deltas)


def test_earliest_stop_string_wins_within_one_append():
    tok = ByteTokenizer()
    ids = tok.encode("a long story ends here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["ends", "story", "long story ends here"])
    assert detok.append(ids) == "long story ends here"  # starts first
    assert detok.output_text == "a " and detok.get_delta(False) == "a "


def _reference_stop(text_steps, stops, include):
    """Independent reference: the first step whose text contains a stop string, cut at the
    earliest occurrence in that text (the first listed stop on ties)."""
    for text in text_steps:
        found = [(text.find(s), k, s) for k, s in enumerate(stops) if s in text]
        if found:
            pos, _, s = min(found)
            return text[:pos + len(s)] if include else text[:pos], s
    return text_steps[-1], None


def test_stop_strings_random_against_reference():
    tok = ByteTokenizer()
    rng = random.Random(1)
    for trial in range(400):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        ids = tok.encode(text, add_special_tokens=False)
        chunks = [rng.choice([1, 1, 2, 3]) for _ in range(4)]
        steps, pos, i = [], 0, 0
        while pos < len(ids):
            pos += chunks[i % len(chunks)]
            i += 1
            steps.append(tok.decode(ids[:pos]))
        expected_text, expected_stop = _reference_stop(steps, stops, include)

        detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)
        deltas, stop = _run(detok, ids, chunks)
        assert (detok.output_text, stop) == (expected_text, expected_stop), (trial, text, stops)
        assert "".join(deltas) == detok.output_text
        # each delta was final when sent: a prefix of the final text, never a stop string's part
        streamed = ""
        for d in deltas:
            streamed += d
            assert expected_text.startswith(streamed)


def test_holdback_keeps_possible_stop_prefix():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["STOP", "xy"])
    detok.append(tok.encode("hello ST", add_special_tokens=False))
    assert detok.get_delta(False) == "hello"  # "longest stop - 1" = 3 characters held back
    detok.append(tok.encode("AR", add_special_tokens=False))
    assert detok.get_delta(False) == " S"  # "hello STAR" less its last 3 characters
    assert detok.get_delta(True) == "TAR"
    assert detok.output_text == "hello STAR"


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(ByteTokenizer(), stop=[""])
