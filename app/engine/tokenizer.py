"""Tokenizers behind one small interface: bytes (dummy models), llama2.c tok512.bin, Hugging Face,
GGUF metadata.

Pure Python (no torch). `load_tokenizer` picks the implementation from the path.
"""

from __future__ import annotations

import heapq
import json
import re
import struct
from abc import ABC, abstractmethod
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from app.engine.gguf_file import GGUFFile

# Used by ByteTokenizer and by any tokenizer that ships no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (its raise_exception was called) or failed to render."""


class Tokenizer(ABC):
    """What the engine and the server need from a tokenizer."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None  # the primary EOS
    eos_token_ids: frozenset[int]  # every id that ends generation; includes eos_token_id
    all_special_ids: frozenset[int]
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    bos_token: str = ""  # text passed to chat templates as bos_token / eos_token
    eos_token: str = ""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; adds BOS (and whatever else the tokenizer adds) when add_special_tokens."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token_ids; invalid UTF-8 becomes U+FFFD."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for a chat. Encode it with add_special_tokens=False if it already has BOS.
        `tools` and the messages' `tool_calls` / `tool_call_id` as Hugging Face passes them."""
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)

    @property
    def template_takes_tools(self) -> bool:
        return template_takes_tools(self.chat_template)


# ---------------------------------------------------------------------------------------------
# Chat templates (jinja2, rendered like transformers does)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


@lru_cache(maxsize=16)
def template_takes_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (a template without tool support never
    does). A template that does not parse takes none."""
    try:
        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return False


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", tools: list[dict] | None = None) -> str:
    try:
        compiled = _compile_chat_template(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, tools=tools,
                               documents=None)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}; check the messages' "
                                f"roles and order against the model's template") from e


# ---------------------------------------------------------------------------------------------
# ByteTokenizer: 0 = pad, 1 = BOS, 2 = EOS, byte b -> b + 3


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens, for dummy models. Ids >= 259 (padding of a larger vocab) decode to ''."""

    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3

    def __init__(self, vocab_size: int = 259) -> None:
        if vocab_size < 259:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 259 (3 specials + 256 bytes), "
                             f"got {vocab_size}; give the model a larger vocab")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id = self.BOS, self.EOS
        self.eos_token_ids = frozenset({self.EOS})
        self.all_special_ids = frozenset({self.PAD, self.BOS, self.EOS})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS] + ids if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        names = {self.PAD: b"<pad>", self.BOS: b"<s>", self.EOS: b"</s>"}
        out = bytearray()
        for t in token_ids:
            if self.OFFSET <= t < 259:
                out.append(t - self.OFFSET)
            elif t in names and not skip_special_tokens:
                out += names[t]
        return out.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# llama2.c tok512.bin


_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer(Tokenizer):
    """The llama2.c tokenizer file: int32 max_token_length, then per token float32 score,
    int32 length, bytes. Encodes and decodes exactly as llama2.c's run.c."""

    UNK, BOS, EOS = 0, 1, 2

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.pieces, self.scores = _read_llama2c_vocab(self.path)
        self.vocab_size = len(self.pieces)
        if self.vocab_size < 3:
            raise ValueError(f"{self.path}: only {self.vocab_size} tokens; a llama2.c tokenizer "
                             f"needs at least <unk>, BOS, EOS")
        self.ids = {}  # piece bytes -> id; the first id wins on duplicates
        for i, piece in enumerate(self.pieces):
            self.ids.setdefault(piece, i)
        if b" " not in self.ids:
            raise ValueError(f"{self.path}: the vocab has no ' ' token, which llama2.c encoding "
                             f"needs as the dummy prefix; is this a llama2.c tokenizer file?")
        self.bos_token_id, self.eos_token_id = self.BOS, self.EOS
        # run.c stops generating at BOS (TinyStories models start each story with BOS).
        self.eos_token_ids = frozenset({self.EOS, self.BOS})
        self.all_special_ids = frozenset({self.UNK, self.BOS, self.EOS})
        self.bos_token, self.eos_token = "<s>", "</s>"
        # What decode emits per id: <0xNN> pieces are raw bytes, specials show without newlines.
        self._bytes = []
        for i, piece in enumerate(self.pieces):
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                piece = bytes([int(m.group(1), 16)])
            elif i in self.all_special_ids:
                piece = piece.strip()
            self._bytes.append(piece)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        if text:
            ids.append(self.ids[b" "])  # the dummy prefix
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.ids:
                ids.append(self.ids[b])
            else:
                ids.extend(x + 3 for x in b)  # byte fallback
        ids = self._merge(ids)
        return [self.BOS] + ids if add_special_tokens else ids

    def _merge(self, ids: list[int]) -> list[int]:
        """run.c's merge loop (merge the best-scoring adjacent pair, leftmost on ties, until none
        is in the vocab) with a heap and a linked list: O(n log n) instead of O(n^2)."""
        n = len(ids)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        version = [0] * n
        heap = []  # (-score, left, left version, right, right version, merged id)

        def push(i: int) -> None:
            j = nxt[i]
            if j < n:
                merged = self.ids.get(self.pieces[ids[i]] + self.pieces[ids[j]])
                if merged is not None and self.scores[merged] > -1e10:  # run.c's best_score start
                    heapq.heappush(heap, (-self.scores[merged], i, version[i], j, version[j], merged))

        for i in range(n - 1):
            push(i)
        alive = [True] * n
        while heap:
            _, i, vi, j, vj, merged = heapq.heappop(heap)
            if not (alive[i] and alive[j] and nxt[i] == j and version[i] == vi and version[j] == vj):
                continue  # stale: one side was merged since this pair was pushed
            ids[i] = merged
            version[i] += 1
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [ids[i] for i in range(n) if alive[i]]

    @property
    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as decode emits them (the grammar engine's vocabulary, app/engine/grammar.py)."""
        return list(self._bytes)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        prev = None
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} is outside the vocab [0, {self.vocab_size})")
            piece = self._bytes[t]
            if prev == self.BOS and piece.startswith(b" "):
                piece = piece[1:]  # run.c: the piece after BOS loses its leading space
            prev = t
            if skip_special_tokens and t in self.all_special_ids:
                continue
            out += piece
        return out.decode("utf-8", errors="replace")


def _read_llama2c_vocab(path: Path) -> tuple[list[bytes], list[float]]:
    data = path.read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for a llama2.c tokenizer file ({len(data)} bytes)")
    pieces, scores, offset = [], [], 4  # skip int32 max_token_length
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"{path}: truncated at byte {offset}; expected float32 score and "
                             f"int32 length of token {len(pieces)}")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise ValueError(f"{path}: token {len(pieces)} claims {length} bytes at offset "
                             f"{offset} but the file has {len(data)}; is this a tok*.bin file?")
        pieces.append(data[offset:offset + length])
        scores.append(score)
        offset += length
    return pieces, scores


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, generation_config.json), or a tokenizer.json file beside those."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTok

        path = Path(path)
        directory = path.parent if path.is_file() else path
        tokenizer_file = path if path.is_file() else path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json; give a Hugging Face tokenizer "
                             f"directory or a tokenizer.json file")
        self.path = directory
        self._tok = _HFTok.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        gen_config = _read_json(directory / "generation_config.json")

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_content(config.get("bos_token") or special_map.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token") or special_map.get("eos_token"))
        self.bos_token_id = self._token_id(self.bos_token)
        if self.bos_token_id is None and isinstance(gen_config.get("bos_token_id"), int):
            self.bos_token_id = gen_config["bos_token_id"]
        self.eos_token_id = self._token_id(self.eos_token)
        gen_eos = gen_config.get("eos_token_id")
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else gen_eos
        if self.eos_token_id is None and gen_eos:
            self.eos_token_id = gen_eos[0]
        self.eos_token_ids = frozenset(
            gen_eos + ([self.eos_token_id] if self.eos_token_id is not None else []))
        # As transformers' LlamaTokenizerFast: explicit add_bos/eos_token replace the post-processor.
        self._add_bos = config.get("add_bos_token")
        self._add_eos = config.get("add_eos_token")
        for flag, token_id in (("add_bos_token", self.bos_token_id),
                               ("add_eos_token", self.eos_token_id)):
            if config.get(flag) and token_id is None:
                raise ValueError(f"{directory}/tokenizer_config.json: {flag} is true but that token "
                                 f"is not set or not in the vocab; fix the config")
        self.all_special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.chat_template = _pick_chat_template(directory, config.get("chat_template"))

    def _token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token) if token else None

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` (the grammar engine reads its vocabulary, app/engine/grammar.py)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast skips the character offsets that encode computes (unused here): 30%
        # less time on a 13 kB prompt, the same ids
        if not add_special_tokens or (self._add_bos is None and self._add_eos is None):
            return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        ids = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        bos = [self.bos_token_id] if self._add_bos else []
        eos = [self.eos_token_id] if self._add_eos else []
        return bos + ids + eos

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove the file") from e


def _token_content(value: str | dict | None) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


def _pick_chat_template(directory: Path, template: str | list | None) -> str:
    if isinstance(template, list):
        by_name = {t.get("name"): t.get("template") for t in template}
        if "default" not in by_name:
            raise ValueError(f"{directory}/tokenizer_config.json has chat templates "
                             f"{sorted(map(str, by_name))} but none named 'default'")
        template = by_name["default"]
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template or DEFAULT_CHAT_TEMPLATE


# ---------------------------------------------------------------------------------------------


# GGUF metadata (tokenizer.ggml.*; see gguf_file.py for the facts of the format this relies on)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2/2.5/3: digits one by one
_CONTROL, _USER_DEFINED = 3, 4  # token types


class GGUFTokenizer(Tokenizer):
    """The tokenizer a GGUF file's metadata describes, as a `tokenizers` Tokenizer."""

    def __init__(self, f: GGUFFile) -> None:
        from tokenizers import AddedToken

        kind = f.get("tokenizer.ggml.model")
        tokens = f.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{f.path} carries no tokenizer (tokenizer.ggml.tokens); pass tokenizer=<path>")
        types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            self._tok = _byte_level_bpe(f, tokens)
        elif kind == "llama":
            self._tok = _sentencepiece_bpe(f, tokens, types)
        else:
            raise ValueError(f"{f.path}: tokenizer model {kind!r} is not supported (gpt2, llama)")
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t, ty in zip(tokens, types) if ty == _CONTROL])
        self._tok.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        self.vocab_size = len(tokens)
        self.bos_token_id = f.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id = f.get("tokenizer.ggml.eos_token_id")
        self.bos_token = tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        self.eos_token = tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        eot = f.get("tokenizer.ggml.eot_token_id")
        self.eos_token_ids = frozenset(i for i in (self.eos_token_id, eot) if i is not None)
        self.all_special_ids = frozenset(i for i, ty in enumerate(types) if ty == _CONTROL)
        self._add_bos = bool(f.get("tokenizer.ggml.add_bos_token", kind == "llama")) and self.bos_token_id is not None
        self._add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False)) and self.eos_token_id is not None
        self.chat_template = f.get("tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATE

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` (the grammar engine reads its vocabulary, app/engine/grammar.py)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = ([self.bos_token_id] if self._add_bos else []) + ids + ([self.eos_token_id] if self._add_eos else [])
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _byte_level_bpe(f: GGUFFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer as Tok, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    tok = Tok(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = f.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3", "llama-v3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # "default", "gpt2" and the rest: GPT-2's split
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer as Tok, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = f.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:  # implied by the scores: every split of a token into two tokens, best-scored merges first
        scores = f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        found = []
        for token, i in vocab.items():
            for k in range(1, len(token)):
                left, right = token[:k], token[k:]
                if left in vocab and right in vocab:
                    found.append((-scores[i], vocab[left], vocab[right], left, right))
        pairs = [(left, right) for *_, left, right in sorted(found)]
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tok = Tok(models.BPE(vocab=vocab, merges=pairs, unk_token=tokens[unk] if unk is not None else None,
                         fuse_unk=True, byte_fallback=True))
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


def load_tokenizer(path: str | None, vocab_size: int | None = None) -> Tokenizer:
    """None -> ByteTokenizer; *.bin -> llama2.c; a directory with tokenizer.json (or that file) ->
    Hugging Face; *.gguf -> the tokenizer in the GGUF file's metadata. vocab_size is the model's:
    the tokenizer must not produce ids beyond it."""
    if path is None:
        return ByteTokenizer(vocab_size or 259)
    p = Path(path)
    if p.is_file() and p.suffix == ".bin":
        tokenizer: Tokenizer = Llama2cTokenizer(p)
    elif p.suffix.lower() == ".gguf":
        from app.engine.gguf_file import open_gguf

        tokenizer = GGUFTokenizer(open_gguf(p))
    elif (p.is_dir() and (p / "tokenizer.json").is_file()) or (p.is_file() and p.name == "tokenizer.json"):
        tokenizer = HFTokenizer(p)
    else:
        raise ValueError(f"cannot load a tokenizer from {path!r}: give a llama2.c tokenizer file "
                         f"(*.bin), a Hugging Face directory containing tokenizer.json, a "
                         f"tokenizer.json file, a GGUF file, or None for the byte tokenizer")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {path!r} has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab is {vocab_size}; use the tokenizer that belongs to the model")
    return tokenizer
