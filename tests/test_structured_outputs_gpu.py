"""Structured outputs on a GPU: the masked sampler under CUDA-graph decode and async scheduling.

Skipped without CUDA (CI has none); run on the GPU machine with
`TRITON_INTERPRET=0 python3 -m pytest -q tests/test_structured_outputs_gpu.py`. The model is
stories260K copied into head_dim-128 shapes (tests/test_engine_gpu.py's), so greedy tokens have a
trained model's margins: graphs with async scheduling (constrained steps launched as a forward,
then their sampling once the step in flight is collected) must give the tokens of eager,
synchronous steps, and every output must validate.
"""

import json
import re

import jsonschema
import pytest
import torch

from app import SamplingParams
from app.engine.structured_outputs import StructuredOutputs
from app.kernels import paged

from schemas_testing import SCHEMAS
from test_engine_gpu import _Counted, _widened

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or paged.interpreting(),
                                reason="needs CUDA (and TRITON_INTERPRET unset)")


def _workload():
    prompts, params, checks = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS[:40]):
        so = StructuredOutputs(json=json.dumps(schema))
        for temperature in (0.0, 0.8):
            prompts.append(f"Once upon a time {name}")
            params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=256, structured_outputs=so))
            checks.append(schema)
    prompts += ["Lily and Tom", "The little dog", "One day, a big bear"]
    params += [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),  # plain rows beside them
               SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(
                   regex=r"[A-Z][a-z]+( [a-z]+){2,4}\.")),
               SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(
                   choice=("bear", "dog", "cat")))]
    checks += [None, r"[A-Z][a-z]+( [a-z]+){2,4}\.", ("bear", "dog", "cat")]
    return prompts, params, checks


def test_graphs_and_async_scheduling_give_the_eager_tokens(stories_paths, tmp_path):
    (tmp_path / "fast").mkdir()
    (tmp_path / "slow").mkdir()
    fast = _widened(stories_paths, tmp_path / "fast", "small", max_num_seqs=96, async_scheduling=True)
    slow = _widened(stories_paths, tmp_path / "slow", "small", max_num_seqs=96, enforce_eager=True,
                    async_scheduling=False)
    runner = fast.engine.executor.runner
    assert fast.engine.async_scheduling and runner.graphs and not slow.engine.executor.runner.graphs
    for size, (graph, logits) in list(runner.graphs.items()):
        runner.graphs[size] = (_Counted(graph), logits)
    prompts, params, checks = _workload()
    got = fast.generate(prompts, params)
    want = slow.generate(prompts, params)
    assert sum(g.replays for g, _ in runner.graphs.values()) > 50  # constrained decode steps replayed graphs
    for p, a, b, check in zip(params, got, want, checks):
        if p.temperature == 0:
            assert a.token_ids == b.token_ids, (a.text, b.text)
        if isinstance(check, dict):
            assert a.finish_reason == "stop", a.text
            jsonschema.Draft202012Validator(check, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
                                            ).validate(json.loads(a.text))
        elif isinstance(check, str):
            assert re.fullmatch(check, a.text), a.text
        elif check is not None:
            assert a.text in check
    for llm in (fast, slow):
        engine = llm.engine
        assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks and not engine.structured
