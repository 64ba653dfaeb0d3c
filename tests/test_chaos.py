"""The chaos run (bench/chaos.py), shortened: `serve run` with 3 LLMServer replicas, agent
sessions, fuzzed bodies and clients that leave mid-stream, while one replica and then the KV
index actor are killed. The counts that must be zero are zero, and routing quality comes back
within 30 s of the index kill. The full run and its numbers are in bench/RESULTS.md."""

import pytest

from bench import chaos


# 3.5 minutes on the 2-core CI machine: the slow tier (`python -m pytest -m slow`). The default suite
# keeps each of its checks on its own: HTTP errors and a dead replica (test_http_errors.py),
# disconnects (test_http_openai.py), replica and index kills (test_router_serve.py).
@pytest.mark.slow
def test_chaos_run_counts_no_hang_no_5xx_no_request_death_no_leak():
    r = chaos.run(chaos.parse_args(["--replicas", "3", "--sessions", "4", "--duration", "40", "--fuzz-bodies", "40",
                                    "--disconnect-every", "3"]))
    print(chaos.to_markdown(r))
    counts = r["counts"]
    for kind, c in counts.items():
        assert c["hung"] == 0 and c["server_errors"] == 0 and c["broken"] == 0, (kind, c, r["server_errors"],
                                                                                r["broken"])
    assert counts["sessions"]["completed"] >= 20, counts
    assert sum(n for s, n in counts["fuzz"]["clean_errors"].items() if str(s).startswith("4")) > 0, counts
    assert counts["disconnects"]["disconnected"] > 0, counts
    # the streams running on the killed replica ended with an OpenAI error event, the others completed
    killed = counts["in flight at the replica kill"]
    assert killed["completed"] + sum(killed["clean_errors"].values()) == killed["sent"], killed
    assert any(e.endswith("replicas") and e.startswith("new index") for _, e in r["events"]), r["events"]
    assert r["replicas_died_unasked"] == [], r["events"]
    assert r["idle_replicas_checked"] == 3 and sum(r["kv_blocks_leaked"].values()) == 0, r["kv_blocks_leaked"]
    assert r["replica_back_after_s"] is not None and r["replica_back_after_s"] <= 90, r["events"]
    assert r["routing_recovered_after_s"] is not None and r["routing_recovered_after_s"] <= 30, r["windows"]


def test_counts_summary_orders_http_and_stream_statuses():
    """A session class can see both a 503 answer and a 503 error event mid-stream."""
    c = chaos.Counts(sent=3, completed=1)
    c.clean_errors.update({503: 1, "stream:503": 1})
    assert c.summary()["clean_errors"] == {503: 1, "stream:503": 1}


def test_no_fuzzed_bodies_needs_no_fuzzing_library(monkeypatch):
    """--fuzz-bodies 0 (a GPU machine with only the serving wheels) imports no fuzzing library; asking
    for bodies without it fails at once, before `serve run` starts, not after."""
    import sys

    monkeypatch.delitem(sys.modules, "bench.request_fuzz", raising=False)
    monkeypatch.setitem(sys.modules, "hypothesis_jsonschema", None)  # as if not installed
    assert chaos.fuzz_drawer(0)(0, seed=0) == []
    with pytest.raises(ImportError):
        chaos.fuzz_drawer(5)
