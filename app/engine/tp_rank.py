"""What a tensor-parallel rank's process does first, whichever executor started it (the Ray
executor's TPWorker actors, the multiprocess executor's children): join torch.distributed and load
this rank's shard. No Ray here.
"""

from __future__ import annotations

import socket
from datetime import timedelta

COLLECTIVE_TIMEOUT_S = 600  # a collective that waits longer (a rank hung or gone) raises


def start_rank(config, vocab_size: int, max_model_len: int, rank: int, tp_size: int, init_method: str,
               backend: str, cuda_index: int):
    """In a tensor-parallel worker process: join the process group and load this rank's shard.
    Computes on cuda:<cuda_index> of this process's view when config.device is CUDA. Returns the
    rank's ModelRunner (KV cache not yet allocated). Shared by the Ray and multiprocess executors."""
    import torch
    import torch.distributed as dist

    from app.engine.model_runner import ModelRunner

    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", cuda_index)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return ModelRunner(config, vocab_size, rank, tp_size, device, max_model_len)


def free_port_address(host: str) -> str:
    """tcp://<host>:<a free port> for torch.distributed's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"
