"""Prompt logprobs (SamplingParams.prompt_logprobs; /v1/completions echo + logprobs + max_tokens 0):
the engine's equal a full forward over the prompt; chunked prefill, prefix-cache state and batch
neighbours do not change them; max_tokens 0 computes the prompt only. The offline API gives them in
vLLM's shape: per prompt token (None for the first) {token id: Logprob(logprob, rank, decoded_token)}
holding the prompt token and the N best."""

import pytest
import torch

from app.engine.loader import load_model
from app.engine.outputs import Logprob
from app.engine.sampling_params import SamplingParams, SamplingParamsError
from app.llm import LLM
from tests.test_llama_model import PagedRun

PROMPT = list(range(3, 60))


def full_forward_logprobs(prompt: list[int], k: int):
    """log P(prompt[i] | prompt[:i]) for i >= 1, its rank (tokens at least as likely, itself
    included) and the k best at each position, from one forward of the same (seeded dummy) model
    over a float32 cache."""
    model, config = load_model("tiny-llama", dtype=torch.float32)
    logits = PagedRun(model, num_seqs=1, max_len=len(prompt) + 1).step({0: prompt})[0][:, : config.vocab_size]
    logp = torch.log_softmax(logits, dim=-1)[:-1]
    chosen = logp.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = [None] + (logp >= chosen).sum(-1).tolist()
    vals, ids = logp.topk(k, dim=-1)
    tops = [None] + [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [None] + chosen[:, 0].tolist(), ranks, tops


def logprobs_of(out) -> list[float | None]:
    """Each prompt token's log-prob (None for the first), from vLLM's shape."""
    return [None if d is None else d[t].logprob for t, d in zip(out.prompt_token_ids, out.prompt_logprobs)]


def tops_of(out, n: int) -> list[list[tuple[int, float]] | None]:
    """Each position's n best (id, log-prob), best first: the entries ranked 1..n."""
    return [None if d is None else [(t, e.logprob) for t, e in sorted(d.items(), key=lambda te: te[1].rank)
                                    if e.rank <= n] for d in out.prompt_logprobs]


def _engine(**kw) -> LLM:
    return LLM(model="tiny-llama", kv_cache_dtype="fp32", dtype="float32", num_kv_blocks=64, **kw)


def test_prompt_logprobs_equal_a_full_forward_in_vllms_shape():
    chosen, ranks, tops = full_forward_logprobs(PROMPT, 3)
    llm = _engine()
    out = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(logprobs_of(out)[1:]), torch.tensor(chosen[1:]), atol=1e-5, rtol=0)
    for i, (ours, ref) in enumerate(zip(tops_of(out, 3)[1:], tops[1:]), start=1):
        assert [t for t, _ in ours] == [t for t, _ in ref]
        torch.testing.assert_close(torch.tensor([v for _, v in ours]), torch.tensor([v for _, v in ref]),
                                   atol=1e-5, rtol=0)
        position, token = out.prompt_logprobs[i], PROMPT[i]
        assert isinstance(position[token], Logprob)
        assert next(iter(position)) == token  # the prompt token first, then the 3 best (as vLLM orders them)
        assert len(position) == (3 if token in dict(ref) else 4)
        assert position[token].rank == (1 + [t for t, _ in ref].index(token) if token in dict(ref) else ranks[i])
        assert all(e.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False) for t, e in position.items())
    assert any(ranks[i] > 3 for i in range(1, len(PROMPT)))  # prompt tokens outside the 3 best occur


@pytest.mark.parametrize("setup", ["chunked-7", "prefix-cached", "batched"])
def test_chunking_prefix_hits_and_neighbours_do_not_change_them(setup):
    reference = _engine().generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, temperature=0)
    if setup == "chunked-7":
        outs = _engine(max_num_batched_tokens=7).generate(PROMPT, params)
    elif setup == "prefix-cached":
        llm = _engine()
        llm.generate(PROMPT + [7, 8], SamplingParams(max_tokens=2))  # the prompt's blocks are now cached
        outs = llm.generate(PROMPT, params)
        assert outs[0].num_cached_tokens == 0  # a prompt-logprobs request computes its whole prompt
    else:
        outs = _engine().generate([list(range(100, 130)), PROMPT, list(range(200, 215))], params)[1:2]
    out = outs[0]
    assert len(out.token_ids) == 4
    torch.testing.assert_close(torch.tensor(logprobs_of(out)[1:]), torch.tensor(logprobs_of(reference)[1:]),
                               atol=1e-5, rtol=0)
    assert [[t for t, _ in top] for top in tops_of(out, 2)[1:]] == \
        [[t for t, _ in top] for top in tops_of(reference, 2)[1:]]


def test_prompt_logprobs_zero_gives_no_alternatives_and_bad_values_are_refused():
    out = _engine().generate(PROMPT[:10], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == 10
    assert all(list(d) == [t] for t, d in zip(PROMPT[1:10], out.prompt_logprobs[1:]))  # the prompt token only
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
