"""bench/cpu_vs_vllm.py's summary of several server starts (the load itself runs in test_serve_run.py
and in the benchmark)."""

from bench.cpu_vs_vllm import median_run


def run(wall, cpu, ok=250):
    return {"wall_s": wall, "server_cpu_s": cpu, "successes": ok, "requests": 250, "latency_p50_s": wall / 2}


def test_median_of_starts_keeps_every_wall_and_the_worst_count():
    out = median_run([run(3.9, 4.0), run(3.3, 3.6, ok=249), run(3.5, None)])
    assert out["wall_s"] == 3.5 and out["latency_p50_s"] == 1.75  # the median start's run
    assert out["walls"] == [3.9, 3.3, 3.5]
    assert out["server_cpu_s"] == 3.8  # median of the starts that measured it
    assert out["successes"] == 249  # a failure in any start shows
    assert median_run([run(4.0, 1.0), run(3.0, 2.0)])["wall_s"] == 3.0  # even count: the lower one
