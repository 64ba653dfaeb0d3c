"""A stand-in for a Ray Serve replica, for the tensor-parallel tests (not a test module)."""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0.1)
class ReplicaStandIn:
    """Runs an engine the way a Ray Serve replica does: inside bundle 0 of its placement group."""

    def __init__(self, **config):
        from app import LLM

        self.llm = LLM(**config)

    def generate(self, prompt: str, max_tokens: int) -> list[int]:
        from app import SamplingParams

        return self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].token_ids

    def worker_info(self) -> list[dict]:
        return self.llm.engine.worker_info()

    def shutdown(self) -> None:
        self.llm.engine.shutdown()


def run_in_placement_group(pg, max_tokens: int = 8, **config) -> tuple[list[int], list[dict]]:
    """Start an engine in bundle 0 of `pg`, greedy-generate from "hello"; (tokens, worker_info)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    replica = ReplicaStandIn.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote(**config)
    try:
        tokens = ray.get(replica.generate.remote("hello", max_tokens), timeout=180)
        info = ray.get(replica.worker_info.remote())
        ray.get(replica.shutdown.remote())
    finally:
        ray.kill(replica)
    return tokens, info
