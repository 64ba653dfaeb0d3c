"""The placement group of one engine replica: one bundle per tensor-parallel rank, on one node.

Pure arithmetic (no Ray), used by the Ray executor for the group it creates outside Ray Serve and
by app/deployments/builder.py for the Serve options of an LLMServer replica.
"""

from __future__ import annotations

PLACEMENT_STRATEGY = "STRICT_PACK"
DEFAULT_CPUS_PER_WORKER = {True: 1.0, False: 0.1}  # keyed by "on GPU"


def placement_bundles(tp_size: int, cpus_per_worker: float, gpu: bool, driver_cpus: float = 0.0,
                      gpu_fraction: float | None = None) -> list[dict]:
    """Bundles of one replica's placement group: one per tensor-parallel rank, bundle 0 also
    holding the replica process (driver_cpus). Use with strategy PLACEMENT_STRATEGY.
    gpu_fraction (tp_size 1 only): the one bundle takes that share of a GPU instead of a whole one,
    so that several replicas' bundles fit one GPU (Ray packs fractional GPUs onto one device)."""
    if tp_size < 1 or cpus_per_worker < 0 or driver_cpus < 0:
        raise ValueError(f"need tp_size >= 1 and CPUs >= 0 (got tp_size={tp_size}, "
                         f"cpus_per_worker={cpus_per_worker}, driver_cpus={driver_cpus})")
    if gpu_fraction is not None and not (tp_size == 1 and 0 < gpu_fraction <= 1):
        raise ValueError(f"gpu_fraction must be in (0, 1] with tp_size 1 (got {gpu_fraction} with tp_size {tp_size})")
    gpus = float(gpu_fraction) if gpu_fraction is not None else 1.0
    bundles = []
    for i in range(tp_size):
        bundle = {"GPU": gpus} if gpu else {}
        cpus = cpus_per_worker + (driver_cpus if i == 0 else 0.0)
        if cpus > 0:
            bundle["CPU"] = cpus
        if not bundle:
            raise ValueError("a CPU-only bundle needs cpus_per_worker > 0 (Ray refuses empty bundles)")
        bundles.append(bundle)
    return bundles
