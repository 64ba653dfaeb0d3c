"""bench/serve_vs_engine.py at a CPU size, as a user runs it: `serve run` (tiny-llama), HTTP and
handle traffic, then the engine alone. Every request of every path is answered with its full length
(ignore_eos), the paths' token counts agree, the ratios are positive and the ready time is known."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~60-90 s on 2 cores, most of it serve run's start
def test_serve_vs_engine_runs_and_its_counts_add_up(tmp_path):
    out = tmp_path / "sve.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serve_vs_engine.py"), "--model", "tiny-llama",
           "--kv-cache-dtype", "bf16", "--shapes", "6x48+8", "--sessions", "2", "--turns", "2",
           "--session-prefix", "32", "--session-append", "16", "--session-reply", "6", "--ready-timeout", "240",
           "--repeats", "2", "--json", str(out)]
    subprocess.run(cmd, check=True, timeout=300, cwd=ROOT)
    result = json.loads(out.read_text())
    assert result["ready_s"] > 0
    rows = {(r["workload"], r["path"]): r for r in result["rows"]}
    workloads = {w for w, _ in rows}
    assert len(workloads) == 2 and set(rows) == {(w, p) for w in workloads for p in ("http", "handle", "engine")}
    for (workload, path), r in rows.items():
        expected = 6 * 8 if workload == "6x48+8" else 2 * 2 * 6
        assert r["answered"] == r["requests"] and r["output_tokens"] == expected, r
        assert r["wall_s"] > 0 and r["output_tok_per_s"] > 0 and r["vs_engine"] > 0
        assert len(r["wall_s_runs"]) == 2 and r["wall_s"] == min(r["wall_s_runs"]), r  # two runs: the lower middle one
        assert (r["vs_engine"] == 1.0) == (path == "engine")
        assert r["kernel_compiles"] == 0 and r["kernel_compile_s"] == 0, r  # CPU engines compile no Triton kernel
        if workload != "6x48+8":  # streamed: a first token and gaps between the others, per request
            assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["itl_p50_s"] <= r["itl_p99_s"], r
            # the mean TTFT by stage: each stage starts later and ends no later than the one outside it
            assert 0 < r["engine_ttft_mean_s"] <= r["ttft_mean_s"], r
            if path == "engine":
                assert r["ingress_ttft_mean_s"] is None
            else:
                assert r["engine_ttft_mean_s"] <= r["ingress_ttft_mean_s"] <= r["ttft_mean_s"], r


def test_arguments_are_checked_before_anything_starts():
    """Bad --repeats, --paths or --server-json stop the benchmark at parsing (exit 2), before Ray or Serve start."""
    from bench import serve_vs_engine

    for argv in (["--repeats", "0"], ["--paths", "http,grpc"], ["--server-json", '{"engine": {}}'],
                 ["--server-json", '{"gil_switch_interval": 1}'], ["--server-json", "[1]"],
                 ["--server-json", "{"], ["--server-json", '{"gil_switch_interval_s": 0}']):
        with pytest.raises(SystemExit) as info:
            serve_vs_engine.parse_args(argv)
        assert info.value.code == 2
    assert serve_vs_engine.parse_args(["--repeats", "3"]).repeats == 3
    args = serve_vs_engine.parse_args(["--server-json", '{"gil_switch_interval_s": null}'])
    assert serve_vs_engine.server_settings(args) == {"gil_switch_interval_s": None}
