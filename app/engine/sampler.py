"""Next-token sampling for a batch of rows: greedy, temperature, top-k, top-p, seeds, logprobs.

Sampling is the exponential race: with q_i ~ Exp(1) per token, argmax_i(p_i / q_i) is token i
with probability p_i (the first of independent Exp(p_i) clocks to ring). It is computed in log
space, argmax_i(logit_i / T - log q_i), which skips the softmax: the Gumbel-max trick. Each row's
q is one [vocab] draw from its own generator when it has one, so a seeded request samples the
same tokens whatever else is in the batch. The work is a few in-place passes over one
[rows, vocab] buffer: on CPU, fresh tensors of that size cost more in page faults than the math.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from app.engine.sampling_params import SamplingParams

# Temperatures below this are greedy: logits / T would overflow float32.
_MIN_TEMPERATURE = 1e-5
# Top-p alone first looks for its nucleus among this many best tokens, then sorts the whole row.
_TOP_P_CANDIDATES = 1024
_NEG_INF = float("-inf")

_default_generators: dict[torch.device, torch.Generator] = {}


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator shared by rows without one, one per device, seeded from the OS."""
    if device not in _default_generators:
        gen = torch.Generator(device)
        gen.seed()
        _default_generators[device] = gen
    return _default_generators[device]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # log-prob of the sampled token per row; None if no row asked
    top_logprobs: list[list[tuple[int, float]] | None] | None  # per row its N best (id, logprob)
    extra: list[int] | None = None  # the caller's `extra` tensor, read with the token ids (one sync)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed (set by the runner)
    # request id -> (start position, prompt-token log-probs, their N best or None) (set by the runner)
    prompt_logprobs: dict = field(default_factory=dict)


class Sampler:
    """Picks one token per row. Rows without a generator of their own share default_generator
    (the engine may set one seeded from its config), else a module-level one per device."""

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], extra: torch.Tensor | None = None,
                 defer: bool = False, mask: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> SamplerOutput | PendingSample:
        """One token per row. `extra` (an int64 tensor on the logits' device) is read back with the
        token ids in one device-to-host copy and returned as SamplerOutput.extra. defer: return a
        PendingSample (the copy started, not waited for) instead of the SamplerOutput. mask: (rows,
        bitmask) of structured outputs, on the logits' device: those rows may pick only the tokens
        their bitmask row allows (apply_token_bitmask), and their logprobs are those of the masked
        distribution, as vLLM's are (the disallowed tokens' -inf never appear in top_logprobs)."""
        # logits: [num_rows, vocab]
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"logits must be [num_rows, vocab] with one SamplingParams and one "
                             f"generator (or None) per row; got logits {tuple(logits.shape)}, "
                             f"{len(params)} params, {len(generators)} generators")
        logits = logits.float()
        if mask is not None:
            apply_token_bitmask(logits, mask[1], mask[0])
        num_rows, device = logits.shape[0], logits.device
        shared = self.default_generator
        if shared is None:
            shared = _default_generator(device)
        greedy = [i for i, p in enumerate(params) if p.temperature < _MIN_TEMPERATURE]
        sampled = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
        if not sampled:
            token_ids = logits.argmax(dim=-1)  # [num_rows]; the first index on ties
        elif not greedy:
            token_ids = _sample(logits, params, generators, shared)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            rows = _tensor(greedy, torch.long, device)
            token_ids[rows] = logits[rows].argmax(dim=-1)
            rows = _tensor(sampled, torch.long, device)
            token_ids[rows] = _sample(logits[rows], [params[i] for i in sampled],
                                      [generators[i] for i in sampled], shared)
        pending = _with_logprobs(logits, token_ids, params, extra)
        return pending if defer else pending.result()


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], j] = -inf where bit j of bitmask[i] is 0 (xgrammar's token bitmask: bit j of
    word w is token 32 w + j), in place. Other rows are untouched.
    logits: [num_rows, vocab] float32; bitmask: [k, ceil(vocab / 32)] int32; rows: [k] int64, distinct.
    Each byte of the bitmask picks its 8 addends (0 or -inf) from a [256, 8] table, added to the
    rows with one index_add_: 2 ms for 32 x 49,152 on two CPU cores (unpacking bits by shifts: 5 ms;
    xgrammar's CPU kernel: 3.3 ms), a few small kernels on a GPU, no sync."""
    k, words = bitmask.shape
    vocab = logits.shape[1]
    assert bitmask.dtype == torch.int32 and words * 32 >= vocab and rows.shape == (k,), \
        (bitmask.dtype, tuple(bitmask.shape), vocab, tuple(rows.shape))
    assert sys.byteorder == "little"  # byte b of a word holds its bits 8 b .. 8 b + 7
    table = _BYTE_BITS.get(logits.device)
    if table is None:  # [256, 8]: entry (b, i) is 0 if bit i of byte b is set, else -inf
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_BITS[logits.device] = torch.where(bits == 1, 0.0, float("-inf")).to(logits.device)
    addend = table.index_select(0, bitmask.contiguous().view(torch.uint8).view(-1).int())  # [k * words * 4, 8]
    logits.index_add_(0, rows, addend.view(k, words * 32)[:, :vocab])


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """apply_token_bitmask, bit by bit (the reference of tests/test_sampler.py)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows.tolist()):
        words = bitmask[i].tolist()
        for j in range(vocab):
            if not (words[j // 32] >> (j % 32)) & 1:
                logits[row, j] = float("-inf")


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a sync (pinned staging, non-blocking copy on CUDA;
    a plain copy from pageable memory would wait for the device)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _sample(logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    # logits: [rows, vocab] -> token ids [rows]
    rows, vocab = logits.shape
    device = logits.device
    temperature = _tensor([float(p.temperature) for p in params], torch.float32, device)[:, None]  # [rows, 1]
    removed = _filtered_out(logits, temperature, params)  # [rows, vocab] bool, or None

    score = torch.empty_like(logits)  # [rows, vocab], u ~ U[0, 1) first
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == rows:
        score.uniform_(generator=shared)
    elif unseeded:
        score[unseeded] = torch.empty(len(unseeded), vocab, device=device).uniform_(generator=shared)
    for i, gen in enumerate(generators):
        if gen is not None:
            score[i].uniform_(generator=gen)
    # log q with q = -log u ~ Exp(1); u = 0 gives +inf, a score of -inf: never picked.
    score.log_().neg_().log_()
    # argmax(logits / T - log q) == argmax(logits - T * log q) since T > 0
    score.mul_(-temperature).add_(logits)
    if removed is not None:
        score.masked_fill_(removed, float("-inf"))
    return score.argmax(dim=-1)


def _filtered_out(logits: torch.Tensor, temperature: torch.Tensor,
                  params: list[SamplingParams]) -> torch.Tensor | None:
    """[rows, vocab] True where top-k / top-p remove a token; None when no row filters."""
    rows, vocab = logits.shape
    device = logits.device
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    with_k = [i for i in range(rows) if top_k[i] < vocab]
    p_only = [i for i in range(rows) if top_k[i] == vocab and params[i].top_p < 1.0]
    if not with_k and not p_only:
        return None
    threshold = torch.full((rows, 1), float("-inf"), device=device)  # [rows, 1]
    for group in (with_k, p_only):  # top-k rows need only torch.topk; top-p alone may sort
        if group:
            idx = _tensor(group, torch.long, device)
            k = _tensor([top_k[i] for i in group], torch.long, device)  # [len(group)]
            p = _tensor([float(params[i].top_p) for i in group], torch.float32, device)  # [len(group)]
            group_logits = logits if len(group) == rows else logits[idx]
            threshold[idx] = top_k_top_p_threshold(group_logits, temperature[idx], k, p,
                                                    max_k=max(top_k[i] for i in group))
    return logits < threshold


def top_k_top_p_threshold(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """The smallest logit each row keeps: of its top_k logits, the smallest set whose probability
    (softmax of logits / temperature, renormalized over those k) reaches top_p.
    logits: [rows, vocab]; temperature: [rows, 1]; top_k: [rows] long in [1, vocab], either all
    < vocab or all == vocab; top_p: [rows] float in (0, 1]; max_k: top_k.max() if the caller knows
    it (saves a device sync). Returns [rows, 1]: keep the logits >= it (ties with the last kept token
    are kept too). Top-p alone syncs once to see whether its candidates hold the nucleus."""
    vocab = logits.shape[1]
    check_mixed = max_k is None  # a caller that passes max_k has grouped its rows (and saves the syncs)
    max_k = int(top_k.max()) if max_k is None else max_k
    if max_k < vocab:
        best = logits.topk(max_k, dim=-1).values  # [rows, max_k] descending
        rank = torch.arange(max_k, device=logits.device)
        probs = (best / temperature).masked_fill(rank >= top_k[:, None], float("-inf")).softmax(-1)
    else:
        if check_mixed and bool((top_k < vocab).any()):
            raise ValueError("top_k_top_p_threshold: rows with and without top-k; call it "
                             "once for each kind")
        best = logits.topk(min(vocab, _TOP_P_CANDIDATES), dim=-1).values  # [rows, n] descending
        row_max = best[:, :1] / temperature  # [rows, 1]
        scaled = (logits / temperature).sub_(row_max).exp_()  # [rows, vocab]
        lse = row_max + scaled.sum(dim=-1, keepdim=True).log_()  # [rows, 1] log of softmax's sum
        probs = (best / temperature - lse).exp()
        if best.shape[1] < vocab and bool((probs.sum(dim=-1) < top_p).any()):
            best = logits.sort(dim=-1, descending=True).values  # [rows, vocab]
            probs = (best / temperature - lse).exp()
    rank = torch.arange(best.shape[1], device=logits.device)
    mass_before = probs.cumsum(dim=-1) - probs  # [rows, n] mass of the higher-ranked tokens
    # rank 0 is always kept; top_p 1 keeps all (the cumsum may round past 1.0 before the end)
    keep = (rank < top_k[:, None]) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_keep = keep.sum(dim=-1, keepdim=True)  # [rows, 1]
    return best.gather(1, num_keep - 1)


class PendingSample:
    """A step's samples on their way to the host: on CUDA copied into pinned memory without a sync
    (result() waits for that copy alone, not for whatever the device runs after it). token_ids stays
    on the device, where async scheduling's next step takes its input tokens from."""

    def __init__(self, token_ids: torch.Tensor, tensors: list[torch.Tensor], build) -> None:
        self.token_ids = token_ids  # [rows] int64 on the device
        self._build = build  # host lists of `tensors` -> SamplerOutput
        self._event = None
        if token_ids.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    @classmethod
    def of_extra(cls, extra: torch.Tensor) -> PendingSample:
        """No row sampled: only the caller's `extra` comes back (SamplerOutput.extra)."""
        return cls(extra[:0], [extra.long()], lambda flags: SamplerOutput([], None, None, flags))

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        return self._build(*(h.tolist() for h in self._host))


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams],
                   extra: torch.Tensor | None = None) -> PendingSample:
    # logits: [num_rows, vocab]; token_ids: [num_rows]
    token_ids = token_ids.long()
    n = len(token_ids)
    head = token_ids if extra is None else torch.cat((token_ids, extra.long()))  # one copy for both

    def split(both: list[int]) -> tuple[list[int], list[int] | None]:
        return both[:n], (both[n:] if extra is not None else None)

    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        def build_ids(both: list[int]) -> SamplerOutput:
            ids, extra_list = split(both)
            return SamplerOutput(ids, None, None, extra_list)

        return PendingSample(token_ids, [head], build_ids)
    logprobs = logits.log_softmax(dim=-1)  # [num_rows, vocab], of the raw logits
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    max_n = max(params[i].logprobs for i in wanted)
    tensors = [head, chosen]
    if max_n:
        tensors += list(logprobs.topk(max_n, dim=-1))  # values, ids: [num_rows, max_n] descending

    def build(both, chosen, top_values=None, top_ids=None) -> SamplerOutput:
        ids, extra_list = split(both)
        top: list[list[tuple[int, float]] | None] = [None] * len(params)
        for i in wanted:
            k = params[i].logprobs
            # a row masked by its grammar may allow fewer than k tokens: the rest are -inf, left out
            top[i] = [(t, v) for t, v in zip(top_ids[i][:k], top_values[i][:k]) if v != _NEG_INF] if k else []
        return SamplerOutput(ids, chosen, top, extra_list)

    return PendingSample(token_ids, tensors, build)
