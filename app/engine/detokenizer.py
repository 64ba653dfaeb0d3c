"""Incremental detokenization with stop strings, for one request. Pure Python (no torch).

Each step decodes a short window of recent tokens twice, without and with the new ones, and keeps
the difference (vLLM's prefix_offset / read_offset). Decoding a window rather than single tokens
handles tokenizers whose decode of a slice is not a slice of the full decode (SentencePiece drops
the leading space of the first piece) and characters whose UTF-8 bytes span several tokens: while
the window's text ends in U+FFFD the new tokens are held back until the character completes.
"""

from __future__ import annotations

from typing import Sequence

from app.engine.tokenizer import Tokenizer

# Prompt tokens decoded before the first output token, so the first piece gets its context.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns output token ids into text as they arrive and watches for stop strings.

    `output_text` is the text so far, truncated at a matched stop string (before it, or after it
    with include_stop_str_in_output). `get_delta` hands out that text piece by piece for streaming.
    Concatenating all deltas, the last one with finished=True, always gives output_text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty (got {list(stop)!r})")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []  # output tokens only
        self.stop_reason: str | None = None  # the stop string that matched
        self._text = ""  # confirmed text: ends in a complete character
        self._pending = ""  # text of held-back tokens, ending in U+FFFD; shown only when finished
        self._sent = 0  # characters of output_text already returned by get_delta
        # The window is _ids[prefix_offset:]; _ids[prefix_offset:read_offset] is already in _text.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    @property
    def output_text(self) -> str:
        return self._text if self.stop_reason is not None else self._text + self._pending

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def append(self, new_token_ids: Sequence[int]) -> str | None:
        """Add the tokens just sampled; returns the stop string they completed, if any."""
        if self.stop_reason is not None:
            raise RuntimeError(f"append() after stop string {self.stop_reason!r} matched; the "
                               f"request is finished and must not be given more tokens")
        self.token_ids.extend(new_token_ids)
        self._ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip)
        window_text = decode(self._ids[self._prefix_offset:], skip)
        new_text = window_text[len(prefix_text):]
        if window_text.endswith("\ufffd"):
            self._pending = new_text  # an unfinished character: wait for its next bytes
            return None
        self._pending = ""
        if not new_text:
            return None  # e.g. a skipped special token: keep the window as it is
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        old_len = len(self._text)
        self._text += new_text
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        """Earliest stop string that ends in the new text (a match there ends after old_len)."""
        if not self.stop:
            return None
        start = max(0, old_len - self._holdback)
        best_pos, best = len(self._text), None
        for s in self.stop:
            pos = self._text.find(s, start)
            if pos != -1 and pos < best_pos:
                best_pos, best = pos, s
        if best is None:
            return None
        end = best_pos + len(best) if self.include_stop_str_in_output else best_pos
        self._text = self._text[:end]
        self.stop_reason = best
        return best

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned. Until finished (or stopped) it keeps back the last
        len(longest stop) - 1 characters, which a later token could turn into a stop string."""
        text = self.output_text
        if finished or self.stop_reason is not None:
            end = len(text)
        else:
            end = max(self._sent, len(self._text) - self._holdback)
        delta = text[self._sent:end]
        self._sent = end
        return delta
