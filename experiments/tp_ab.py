"""A/B of multiprocess-executor details in one run: Llama-3.1-8B shapes (dummy weights), TP=2, 64 x
2048 prompts, 128 output tokens; per variant one engine, measured twice. Variants: the order in
which a step is written to the ranks' pipes (the executor's private `_send_order`), and the CPU
threads of torch in the worker processes (OMP_NUM_THREADS, which spawned workers inherit). A
measurement aid for choices in app/engine/mp_executor.py.

    python3 experiments/tp_ab.py --kv-dtype bf16          # on 2 GPUs
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app import LLM  # noqa: E402
from bench.tp_gpu import decode_rate  # noqa: E402

VARIANTS = {  # name -> (worker OMP_NUM_THREADS or None for torch's default, send order)
    "threads default, rank 0 first": (None, [0, 1]),
    "threads default, rank 1 first": (None, [1, 0]),
    "1 thread, rank 1 first": ("1", [1, 0]),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--variants", default=";".join(VARIANTS))
    args = ap.parse_args()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 32000) for _ in range(2048)] for _ in range(64)]
    for name in args.variants.split(";"):
        threads, order = VARIANTS[name]
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
        llm = LLM(model="llama-3.1-8b", device="cuda", kv_cache_dtype=args.kv_dtype, tensor_parallel_size=2,
                  max_num_seqs=64, max_model_len=2048 + 129, max_num_batched_tokens=8192)
        llm.engine.executor._send_order = order
        for _ in range(2):
            print(json.dumps({"variant": name, "kv": args.kv_dtype, **decode_rate(llm, prompts, 128)}), flush=True)
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
