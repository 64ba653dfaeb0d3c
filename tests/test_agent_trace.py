"""bench/agent_trace.py at a CPU size: it runs for two KV formats on the same trace, every turn is
answered with its reply length, and its counters add up (hit + recomputed = prompt tokens, and both
equal what the engine's scheduler counted, which the script asserts)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_agent_trace_runs_and_its_counters_add_up(tmp_path):
    out = tmp_path / "agent.json"
    cmd = [sys.executable, str(ROOT / "bench" / "agent_trace.py"), "--model", "tiny-llama", "--device", "cpu",
           "--kv-dtypes", "bf16,fp4", "--sessions", "6", "--turns", "2,3", "--system-len", "64", "--append", "16,48",
           "--reply", "4,8", "--max-model-len", "512", "--kv-memory", "1MiB", "--think", "0.01", "--arrival", "0.01",
           "--json", str(out)]
    subprocess.run(cmd, check=True, timeout=300, cwd=ROOT)
    result = json.loads(out.read_text())
    rows = {r["kv_cache_dtype"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "fp4"}
    # the trace is seeded: both formats answer the same turns with the same prompt and output lengths
    assert rows["bf16"]["turns"] == rows["fp4"]["turns"] >= 12
    assert rows["bf16"]["prompt_tokens"] == rows["fp4"]["prompt_tokens"]
    assert rows["bf16"]["output_tokens"] == rows["fp4"]["output_tokens"]
    for r in rows.values():  # every turn of the trace answered, each with its reply length
        assert r["turns"] == result["trace_turns"] and r["output_tokens"] == result["trace_output_tokens"]
        assert r["hit_tokens"] + r["recomputed_tokens"] == r["prompt_tokens"]
        assert 0 < r["hit_rate"] < 1 and r["turns_per_s"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"]
    assert rows["fp4"]["kv_tokens"] > rows["bf16"]["kv_tokens"]  # the same budget holds more tokens
    assert rows["fp4"]["turns_per_s_vs_bf16"] > 0
