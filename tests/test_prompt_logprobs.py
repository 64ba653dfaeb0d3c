"""Prompt logprobs (SamplingParams.prompt_logprobs; /v1/completions echo + logprobs + max_tokens 0):
the engine's equal a full forward over the prompt; chunked prefill, prefix-cache state and batch
neighbours do not change them; max_tokens 0 computes the prompt only."""

import pytest
import torch

from app.engine.loader import load_model
from app.engine.sampling_params import SamplingParams, SamplingParamsError
from app.llm import LLM
from tests.test_llama_model import PagedRun

PROMPT = list(range(3, 60))


def full_forward_logprobs(prompt: list[int], k: int):
    """log P(prompt[i] | prompt[:i]) for i >= 1 and the k best at each position, from one forward
    of the same (seeded dummy) model over a float32 cache."""
    model, config = load_model("tiny-llama", dtype=torch.float32)
    logits = PagedRun(model, num_seqs=1, max_len=len(prompt) + 1).step({0: prompt})[0][:, : config.vocab_size]
    logp = torch.log_softmax(logits, dim=-1)
    chosen = [None] + logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    vals, ids = logp[:-1].topk(k, dim=-1)
    tops = [None] + [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return chosen, tops


def _engine(**kw) -> LLM:
    return LLM(model="tiny-llama", kv_cache_dtype="fp32", dtype="float32", num_kv_blocks=64, **kw)


def test_prompt_logprobs_equal_a_full_forward():
    chosen, tops = full_forward_logprobs(PROMPT, 3)
    out = _engine().generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(chosen[1:]), atol=1e-5, rtol=0)
    for ours, ref in zip(out.prompt_top_logprobs[1:], tops[1:]):
        assert [t for t, _ in ours] == [t for t, _ in ref]
        torch.testing.assert_close(torch.tensor([v for _, v in ours]), torch.tensor([v for _, v in ref]),
                                   atol=1e-5, rtol=0)


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
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(reference.prompt_logprobs[1:]),
                               atol=1e-5, rtol=0)
    assert [[t for t, _ in top] for top in out.prompt_top_logprobs[1:]] == \
        [[t for t, _ in top] for top in reference.prompt_top_logprobs[1:]]


def test_prompt_logprobs_zero_gives_no_alternatives_and_bad_values_are_refused():
    out = _engine().generate(PROMPT[:10], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == 10 and out.prompt_top_logprobs is None
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
