"""A CPU engine computes on the cores it may run on, also inside a Ray worker.

Ray sets OMP_NUM_THREADS to an actor's CPU reservation (1 for the 0.2 CPUs of a CPU LLMServer
replica), and torch starts with that many threads: the serving default computed on one core of
the machine while the engine alone used them all. The engine sets torch's threads itself
(engine.cpu_threads, default: the physical cores of the process's affinity mask divided by
tensor_parallel_size). The task below reserves 0.2 CPUs, as a CPU replica does."""

from __future__ import annotations

import os

import pytest
import ray

from app.engine.model_runner import physical_cores


@pytest.fixture(scope="module")
def ray_two_cpus():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0.2)
def engine_threads(**settings) -> tuple[str | None, int, int]:
    import torch

    from app import LLM, SamplingParams

    before = torch.get_num_threads()
    llm = LLM(model="tiny-llama", kv_cache_memory="16MiB", **settings)
    llm.generate(["hi"], SamplingParams(max_tokens=2))
    return os.environ.get("OMP_NUM_THREADS"), before, torch.get_num_threads()


def test_a_replica_reserving_a_fraction_of_a_cpu_computes_on_all_it_may_use(ray_two_cpus):
    omp, before, after = ray.get(engine_threads.remote())
    assert omp == "1" and before == 1  # what Ray gives the actor
    assert after == physical_cores()


def test_cpu_threads_sets_them(ray_two_cpus):
    omp, before, after = ray.get(engine_threads.remote(cpu_threads=3))
    assert after == 3
