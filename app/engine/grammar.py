"""Structured outputs in the engine: grammars compiled against the tokenizer, one matcher per
sequence, each step's token bitmask (xgrammar: compile 5-8 ms for a tool schema on a 49k vocab,
a mask row in ~2 us; llguidance's rows took 18 us, the cost that counts at batch 32).

- `GrammarCompiler`: a spec (StructuredOutputs) -> xgrammar CompiledGrammar, in a small thread
  pool (xgrammar releases the GIL while it compiles), so a slow schema never holds up the engine
  loop; an LRU of compiled grammars by spec (the same spec is compiled once per engine).
- `StructuredOutputManager`: the engine's per-sequence matchers. A sequence whose grammar is still
  compiling waits (Sequence.awaiting_grammar: the scheduler steps over it); `fill_mask` writes one
  bitmask row per constrained row of a step; `accept` advances a matcher with the token sampled.

xgrammar is imported on first use (it imports torch and transformers).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from app.engine.structured_outputs import StructuredOutputs, StructuredOutputsError, to_grammar
from app.engine.tokenizer import ByteTokenizer, GGUFTokenizer, HFTokenizer, Llama2cTokenizer, Tokenizer

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2


def tokenizer_supported(tokenizer: Tokenizer) -> bool:
    return isinstance(tokenizer, (ByteTokenizer, Llama2cTokenizer, HFTokenizer, GGUFTokenizer))


def check_tokenizer(tokenizer: Tokenizer) -> None:
    if not tokenizer_supported(tokenizer):
        raise StructuredOutputsError(
            f"structured outputs need a tokenizer whose vocabulary the grammar engine can read (a Hugging Face "
            f"tokenizer.json, a GGUF file's, llama2.c's or the byte tokenizer); this engine's is a "
            f"{type(tokenizer).__name__}")


def xgrammar_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's TokenizerInfo of one of our tokenizers: each id's text as its vocabulary spells
    it, the vocabulary's encoding (raw bytes, byte-level BPE or byte-fallback sentencepiece) and the
    ids that end generation. Special tokens get no text, so no grammar matches them (their text is
    not what decode() emits)."""
    import xgrammar as xgr

    check_tokenizer(tokenizer)
    specials = set(tokenizer.all_special_ids) | set(stop_token_ids)
    add_prefix_space = False
    if isinstance(tokenizer, ByteTokenizer):
        vocab = [b""] * vocab_size
        for b in range(256):
            vocab[b + ByteTokenizer.OFFSET] = bytes([b])
        vocab_type = xgr.VocabType.RAW
    elif isinstance(tokenizer, Llama2cTokenizer):
        vocab = tokenizer.token_bytes[:vocab_size]
        vocab += [b""] * (vocab_size - len(vocab))
        vocab_type = xgr.VocabType.RAW
    else:  # a tokenizers.Tokenizer: xgrammar reads the encoding from its serialized form, as from_huggingface does
        backend = tokenizer.backend
        by_token = backend.get_vocab(with_added_tokens=True)
        vocab = [""] * vocab_size
        for token, i in by_token.items():
            if i < vocab_size:
                vocab[i] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        vocab_type, add_prefix_space = meta["vocab_type"], meta["add_prefix_space"]
        from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(by_token)
        if from_vocab is not None and from_vocab != vocab_type:
            vocab_type = from_vocab
    empty = b"" if vocab and isinstance(vocab[0], bytes) else ""
    for i in specials:
        if 0 <= i < vocab_size:
            vocab[i] = empty
    stops = sorted(i for i in stop_token_ids if 0 <= i < vocab_size)
    if not stops:
        raise StructuredOutputsError("structured outputs need an end-of-sequence token (the grammar ends on it); "
                                     "this tokenizer has none in the vocabulary")
    return xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=add_prefix_space)


class GrammarCompiler:
    """Specs compiled against one tokenizer, off the caller's thread, cached by spec (LRU)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_cached: int = MAX_CACHED_GRAMMARS, threads: int = COMPILE_THREADS) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.max_cached = max_cached
        self.num_compiles = 0  # cache misses: compiles started
        self._threads = threads
        self._cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None  # xgrammar's, built by the first compile (its TokenizerInfo takes ~0.1 s)
        self._init_lock = threading.Lock()

    def compile(self, so: StructuredOutputs) -> Future:
        """The compiled grammar of `so` (a Future: done at once on a cache hit). Its exception is a
        StructuredOutputsError when the spec cannot be compiled."""
        future = self._cache.get(so)
        if future is not None:
            self._cache.move_to_end(so)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="grammar-compile")
        self.num_compiles += 1
        future = self._pool.submit(self._compile, so)
        self._cache[so] = future
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return future

    def _compile(self, so: StructuredOutputs):
        compiler = self._xgr_compiler()
        grammar = to_grammar(so)
        try:
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputsError(f"structured_outputs.{so.kind} could not be compiled for this model's "
                                         f"tokenizer: {e}") from None

    def _xgr_compiler(self):
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgrammar_tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # our LRU is the cache (counted, bounded); xgrammar's own would hold every spec again
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True, eq=False)
class _Constrained:
    future: Future  # the compiled grammar
    matcher: object | None = None  # xgrammar GrammarMatcher, once compiled


class StructuredOutputManager:
    """The engine's structured-output state: a matcher per constrained sequence (by sequence id)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._seqs: dict[str, _Constrained] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def add(self, seq_id: str, so: StructuredOutputs) -> bool:
        """Start (or reuse) the compile of the sequence's grammar; True if it is ready now."""
        state = _Constrained(self.compiler.compile(so))
        self._seqs[seq_id] = state
        if state.future.done() and state.future.exception() is None:  # a cache hit
            self._start(state)
            return True
        return False  # compiling (or failed: poll says so)

    def _start(self, state: _Constrained) -> None:
        import xgrammar as xgr

        state.matcher = xgr.GrammarMatcher(state.future.result())

    def num_compiling(self) -> int:
        return sum(1 for s in self._seqs.values() if s.matcher is None)

    def poll(self, seq_ids) -> tuple[list[str], dict[str, str]]:
        """Of the sequences still waiting for their grammar: (those now ready, those whose compile
        failed -> why)."""
        ready, failed = [], {}
        for sid in seq_ids:
            state = self._seqs.get(sid)
            if state is None or state.matcher is not None:
                continue
            if not state.future.done():
                continue
            error = state.future.exception()
            if error is None:
                self._start(state)
                ready.append(sid)
            else:
                failed[sid] = str(error) if isinstance(error, StructuredOutputsError) else \
                    f"structured outputs: compiling the grammar failed: {type(error).__name__}: {error}"
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some compile finishes, or timeout (the engine has nothing else to run)."""
        pending = {s.future for s in self._seqs.values() if s.matcher is None and not s.future.done()}
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def fill_mask(self, rows: list[tuple[int, str]]):
        """One bitmask row per (row index, sequence id) with a live matcher: (row indices, bitmask
        [len(row indices), ceil(vocab / 32)] int32 on the CPU), or None when no row needs one."""
        bitmask = torch.empty(len(rows), (self.vocab_size + 31) // 32, dtype=torch.int32)
        kept = []
        for row, sid in rows:
            state = self._seqs.get(sid)
            matcher = state.matcher if state is not None else None
            if matcher is None or matcher.is_terminated():
                continue
            if matcher.fill_next_token_bitmask(bitmask, len(kept)):  # False: every token allowed
                kept.append(row)
        return (kept, bitmask[:len(kept)]) if kept else None

    def accept(self, seq_id: str, token_id: int) -> str | None:
        """Advance the sequence's matcher: None, "terminated" (the grammar is complete and ended on
        this stop token) or "rejected" (the token breaks the grammar)."""
        state = self._seqs.get(seq_id)
        if state is None or state.matcher is None:
            return None
        if not state.matcher.accept_token(token_id):
            return "rejected"
        return "terminated" if state.matcher.is_terminated() else None

    def shutdown(self) -> None:
        self.compiler.shutdown()
