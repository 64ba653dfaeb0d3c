"""Sampler: greedy, temperature, top-k, top-p, per-request seeds and logprobs."""

import math

import pytest
import torch

from app.engine.sampler import Sampler, apply_token_bitmask, apply_token_bitmask_ref, top_k_top_p_threshold
from app.engine.sampling_params import SamplingParams as SP


def _logits(rows, vocab, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale  # [rows, vocab]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_ties_pick_lowest_id():
    logits = _logits(16, 1000)
    logits[3, [7, 500, 900]] = 100.0  # a three-way tie
    out = Sampler()(logits, [SP(temperature=0)] * 16, [None] * 16)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 7
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_and_tiny_top_p_are_greedy(temperature):
    logits = _logits(32, 5000, seed=1)
    greedy = logits.argmax(-1).tolist()
    for params in (SP(temperature=temperature, top_k=1), SP(temperature=temperature, top_p=1e-6),
                   SP(temperature=temperature, top_k=10, top_p=1e-6)):
        for gens in ([None] * 32, [_gen(i) for i in range(32)]):
            assert Sampler()(logits, [params] * 32, gens).token_ids == greedy


def test_tiny_temperature_is_greedy_not_nan():
    logits = _logits(8, 300, seed=2)
    out = Sampler()(logits, [SP(temperature=1e-7)] * 8, [None] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_ignore_the_rest_of_the_batch():
    vocab, steps = 3000, 5
    logits = _logits(6, vocab, seed=3, scale=1.0)  # flat: the samples depend on the draws
    params = [SP(temperature=0.9, seed=11), SP(temperature=1.0), SP(temperature=0),
              SP(temperature=1.2, top_k=40, seed=5), SP(temperature=0.7, top_p=0.5),
              SP(temperature=0.8, top_p=0.9, seed=7)]
    seeded = [0, 3, 5]

    def run_batch(rows, shared_seed):
        gens = {i: _gen(params[i].seed) if params[i].seed is not None else None for i in rows}
        sampler = Sampler(default_generator=_gen(shared_seed))
        tokens = []
        for _ in range(steps):
            out = sampler(logits[rows], [params[i] for i in rows], [gens[i] for i in rows])
            tokens.append(dict(zip(rows, out.token_ids)))
        return {i: [t[i] for t in tokens] for i in rows}

    full = run_batch(list(range(6)), shared_seed=1)
    for i in seeded:
        alone = run_batch([i], shared_seed=2)
        assert alone[i] == full[i]
        assert len(set(alone[i])) > 1  # the draws advance from step to step
    reordered = run_batch([5, 4, 3, 1, 0], shared_seed=3)
    for i in seeded:
        assert reordered[i] == full[i]
    assert run_batch([0], shared_seed=4)[0] == full[0]  # fresh generators, same seed


def test_unseeded_rows_use_the_default_generator():
    logits = _logits(4, 2000, seed=4, scale=0.5)
    params = [SP(temperature=1.0)] * 4
    a = Sampler(default_generator=_gen(9))(logits, params, [None] * 4).token_ids
    b = Sampler(default_generator=_gen(9))(logits, params, [None] * 4).token_ids
    c = Sampler(default_generator=_gen(10))(logits, params, [None] * 4).token_ids
    assert a == b and a != c


def _chi_square(counts, probs, n):
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


# Chi-square critical values at p = 1e-5 (scipy.stats.chi2.isf(1e-5, df) for df = 7 and 2): a
# correct sampler exceeds them with probability 1e-5 (the seeds are fixed, so the tests do not
# flake); a wrong distribution (checked below) exceeds them many times over.
_CHI2_CRIT = {7: 35.3, 2: 23.1}


def test_temperature_matches_softmax_distribution():
    n, temperature = 100_000, 0.7
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    out = Sampler(default_generator=_gen(0))(logits.expand(n, 8).contiguous(),
                                             [SP(temperature=temperature)] * n, [None] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).tolist()
    expected = torch.softmax(logits.double() / temperature, -1).tolist()
    assert _chi_square(counts, expected, n) < _CHI2_CRIT[7]
    wrong = torch.softmax(logits.double(), -1).tolist()  # temperature ignored
    assert _chi_square(counts, wrong, n) > 10 * _CHI2_CRIT[7]


def test_seeded_rows_match_softmax_distribution():
    n, temperature = 20_000, 1.3
    logits = torch.tensor([0.3, 0.0, -0.2, 0.8, -1.0, 0.1, 0.5, -0.4])
    shared = _gen(1)  # all rows draw in turn from one generator: the per-row path
    out = Sampler()(logits.expand(n, 8).contiguous(), [SP(temperature=temperature)] * n, [shared] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).tolist()
    expected = torch.softmax(logits.double() / temperature, -1).tolist()
    assert _chi_square(counts, expected, n) < _CHI2_CRIT[7]


def test_top_k_and_top_p_renormalize_within_the_kept_set():
    n = 60_000
    logits = torch.tensor([1.0, 3.0, 0.0, 2.5, 2.0, -1.0])  # ranks: 1, 3, 4, 0, 2, 5
    params = [SP(temperature=1.0, top_k=3)] * n
    out = Sampler(default_generator=_gen(2))(logits.expand(n, 6).contiguous(), params, [None] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).tolist()
    kept = torch.softmax(logits[[1, 3, 4]].double(), -1).tolist()
    assert sum(counts[i] for i in (0, 2, 5)) == 0
    assert _chi_square([counts[i] for i in (1, 3, 4)], kept, n) < _CHI2_CRIT[2]
    unfiltered = torch.softmax(logits.double(), -1)[[1, 3, 4]].tolist()  # wrong: not renormalized
    assert _chi_square([counts[i] for i in (1, 3, 4)], unfiltered, n) > 10 * _CHI2_CRIT[2]
    # softmax: token 1 has 0.459, then token 3 0.278 (cumulative 0.738) -> top_p 0.7 keeps {1, 3}
    out = Sampler(default_generator=_gen(3))(logits.expand(n, 6).contiguous(),
                                             [SP(temperature=1.0, top_p=0.7)] * n, [None] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).tolist()
    assert {i for i, c in enumerate(counts) if c} == {1, 3}
    probs = torch.softmax(logits.double(), -1)
    p1 = (probs[1] / (probs[1] + probs[3])).item()
    assert abs(counts[1] / n - p1) < 5 * math.sqrt(p1 * (1 - p1) / n)  # within 5 standard errors


def _nucleus(row_logits, temperature, top_k, top_p, tol=1e-4):
    """Independent reference (float64, sorted in Python): the ids top-k then top-p may return.
    A token is in the nucleus when the mass ranked above it is < top_p; the sampler computes that
    mass as a float32 cumsum, so tokens within tol of the boundary are allowed either way."""
    order = sorted(range(len(row_logits)), key=lambda i: -row_logits[i])
    if top_k > 0:
        order = order[:top_k]
    if top_p >= 1.0:
        return set(order)
    weights = [math.exp((row_logits[i] - row_logits[order[0]]) / temperature) for i in order]
    total, mass_before, allowed = sum(weights), 0.0, set()
    for i, w in zip(order, weights):
        if mass_before >= top_p + tol:
            break
        allowed.add(i)
        mass_before += w / total
    return allowed


@pytest.mark.parametrize("vocab,scale", [(50, 1.0), (5000, 0.3), (5000, 4.0)])
def test_samples_stay_inside_top_k_and_nucleus(vocab, scale):
    # (5000, 0.3): nuclei of thousands of tokens, beyond the 1024 candidates -> the full sort path
    rows = 24
    logits = _logits(rows, vocab, seed=vocab, scale=scale)
    params = []
    for r in range(rows):
        k = [-1, 1, 5, 40][r % 4]
        p = [1.0, 0.9, 0.5, 0.97, 0.3, 0.75][r % 6]
        params.append(SP(temperature=[0.5, 1.0, 2.0][r % 3], top_k=k, top_p=p))
    allowed = [_nucleus(logits[r].tolist(), params[r].temperature, params[r].top_k, params[r].top_p)
               for r in range(rows)]
    sampler = Sampler(default_generator=_gen(5))
    seen = [set() for _ in range(rows)]
    for step in range(30):
        gens = [_gen(100 * step + r) if r % 2 else None for r in range(rows)]
        for r, t in enumerate(sampler(logits, params, gens).token_ids):
            assert t in allowed[r], (r, params[r])
            seen[r].add(t)
    assert any(len(s) > 5 for s in seen)  # really sampling, not greedy


@pytest.mark.parametrize("vocab,scale,top_k", [(5000, 0.3, -1), (5000, 4.0, -1), (5000, 0.3, 3000),
                                               (300, 1.0, 50)])
def test_threshold_keeps_exactly_the_nucleus(vocab, scale, top_k):
    # (5000, 0.3, -1): nuclei of thousands of tokens, beyond the 1024 candidates -> full sort
    rows = 12
    logits = _logits(rows, vocab, seed=vocab + 1, scale=scale)
    temperature = torch.tensor([[0.5], [1.0], [2.0]] * 4)  # [rows, 1]
    top_p = torch.tensor([0.9, 0.5, 0.97, 0.3, 0.75, 1.0] * 2)
    k = torch.full((rows,), top_k if top_k > 0 else vocab)
    threshold = top_k_top_p_threshold(logits, temperature, k, top_p)  # [rows, 1]
    for r in range(rows):
        row = logits[r].tolist()
        kept = {i for i, x in enumerate(row) if x >= threshold[r, 0].item()}
        args = (row, temperature[r, 0].item(), top_k, top_p[r].item())
        assert _nucleus(*args, tol=-1e-4) <= kept <= _nucleus(*args, tol=1e-4), r


def test_masked_logits_are_never_sampled():
    logits = torch.zeros(4, 100)
    logits[:, 50:] = float("-inf")
    for _ in range(20):
        out = Sampler()(logits, [SP(temperature=2.0)] * 4, [None, _gen(1), None, _gen(2)])
        assert all(t < 50 for t in out.token_ids)


def test_logprobs_are_raw_log_softmax():
    logits = _logits(5, 700, seed=6)
    params = [SP(temperature=0.5, logprobs=3), SP(temperature=0), SP(temperature=2.0, logprobs=0),
              SP(temperature=0, logprobs=20), SP(temperature=1.0, top_k=5, logprobs=1)]
    out = Sampler()(logits, params, [None] * 5)
    ref = torch.log_softmax(logits.double(), -1)  # [5, 700]
    for r, t in enumerate(out.token_ids):
        assert out.logprobs[r] == pytest.approx(ref[r, t].item(), abs=1e-4)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] == []
    for r, n in ((0, 3), (3, 20), (4, 1)):
        top = out.top_logprobs[r]
        values, ids = ref[r].sort(descending=True)
        assert [i for i, _ in top] == ids[:n].tolist()
        assert [v for _, v in top] == pytest.approx(values[:n].tolist(), abs=1e-4)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert out.top_logprobs[3][0][0] == out.token_ids[3]  # greedy picks the top logprob


@pytest.mark.parametrize("rows, vocab, constrained", [
    (1, 32, [0]), (5, 1027, [0, 2, 4]), (4, 1000, [3, 1]), (8, 4099, list(range(8)))])
def test_token_bitmask_against_its_reference(rows, vocab, constrained):
    """Vocabularies that are not whole words (1027, 4099), unconstrained rows between constrained
    ones, rows out of order."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g)  # [rows, vocab]
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained), words), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # all allowed
    bitmask[-1, -1] = 0  # none of the last word
    idx = torch.tensor(constrained)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, idx)
    apply_token_bitmask_ref(ref, bitmask, idx)
    assert torch.equal(ours, ref)
    untouched = [r for r in range(rows) if r not in constrained]
    assert torch.equal(ours[untouched], logits[untouched])
    assert (ours == float("-inf")).any()


def test_a_mask_restricts_sampling_and_logprobs_to_allowed_tokens():
    """Greedy, sampled and seeded rows pick only allowed tokens; the log-probs are those of the
    masked distribution (renormalized over the allowed tokens) and name no disallowed token."""
    logits = _logits(3, 200, seed=3)
    bitmask = torch.zeros(2, 7, dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # tokens 0, 1, 3
    bitmask[1, 3] = 1 << 5  # token 101 alone
    params = [SP(temperature=0, logprobs=5), SP(temperature=1.0, logprobs=5), SP(temperature=0.7, logprobs=2)]
    for seed in range(10):
        out = Sampler()(logits.clone(), params, [None, _gen(seed), None],
                        mask=(torch.tensor([0, 2]), bitmask))
        assert out.token_ids[0] in (0, 1, 3) and out.token_ids[2] == 101
        allowed = torch.log_softmax(logits[0, [0, 1, 3]].double(), -1)
        assert [i for i, _ in out.top_logprobs[0]] == [(0, 1, 3)[j] for j in allowed.argsort(descending=True)]
        assert [v for _, v in out.top_logprobs[0]] == pytest.approx(allowed.sort(descending=True).values.tolist(),
                                                                    abs=1e-5)
        assert out.top_logprobs[2] == [(101, pytest.approx(0.0, abs=1e-6))] and out.logprobs[2] == pytest.approx(0.0)
        assert len(out.top_logprobs[1]) == 5  # the unconstrained row


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler()(torch.zeros(3, 10), [SP()] * 2, [None] * 3)
    with pytest.raises(ValueError, match=r"\[num_rows, vocab\]"):
        Sampler()(torch.zeros(10), [SP()], [None])
