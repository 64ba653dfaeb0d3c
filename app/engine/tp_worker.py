"""One tensor-parallel rank as a Ray actor (RayExecutor in ray_executor.py starts one per bundle).

Importing this module imports neither torch nor the model: a worker first only records where
Ray placed it (node, GPU ids, CUDA_VISIBLE_DEVICES, bundle), which is all a placement check
needs. `load` then joins torch.distributed, loads this rank's shard and sizes its KV cache.

Compute device: the bundles decide what a worker reserves (a GPU when its bundle has one), the
engine's `device` decides where it computes. On CUDA each worker sees the one GPU Ray gave it
(CUDA_VISIBLE_DEVICES), so it computes on cuda:0 of its own view, whatever index `device` names.
On a test cluster whose nodes advertise fake GPUs, `device: cpu` places workers on those GPUs,
lets them report their GPU ids, and runs them on the CPU with gloo without touching CUDA.
"""

from __future__ import annotations

import os

from app.engine.tp_rank import free_port_address, start_rank


class TPWorker:
    def __init__(self, rank: int, tp_size: int, bundle_index: int | None) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.rank, self.tp_size = rank, tp_size
        self.runner = None
        self._info = {
            "rank": rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "placement_group_id": ctx.get_placement_group_id(),
            "bundle_index": bundle_index,
            "device": None,  # set by load()
        }

    def info(self) -> dict:
        return dict(self._info)

    def rendezvous_address(self) -> str:
        """tcp://<this node's IP>:<a free port> for torch.distributed's rendezvous (rank 0)."""
        return free_port_address(self._info["node_ip"])

    def load(self, config, vocab_size: int, max_model_len: int, init_method: str, backend: str) -> int:
        """Join the process group, load this rank's shard; the KV blocks this rank can fit."""
        # the one GPU Ray made visible to this worker, whatever index config.device names
        self.runner = start_rank(config, vocab_size, max_model_len, self.rank, self.tp_size, init_method, backend,
                                 cuda_index=0)
        self._info["device"] = str(self.runner.device)
        return self.runner.num_kv_blocks_fit(max_model_len)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, message):
        return self.runner.execute(message)
