"""A/B of the order in which the multiprocess executor writes a step to its ranks' pipes, in one run:
Llama-3.1-8B shapes (dummy weights), TP=2, bf16 KV, 64 x 2048 prompts, 128 output tokens, each
order twice on the same engine. Sets the executor's private `_send_order`; a measurement aid.

    python3 bench/tp_send_order.py          # on 2 GPUs
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import LLM  # noqa: E402
from tp_gpu import decode_rate  # noqa: E402


def main():
    rng = random.Random(1)
    llm = LLM(model="llama-3.1-8b", device="cuda", kv_cache_dtype="bf16", tensor_parallel_size=2, max_num_seqs=64,
              max_model_len=2048 + 129, max_num_batched_tokens=8192)
    prompts = [[rng.randrange(3, 32000) for _ in range(2048)] for _ in range(64)]
    for order in ([0, 1], [1, 0], [0, 1], [1, 0]):
        llm.engine.executor._send_order = order
        print(json.dumps({"order": order, **decode_rate(llm, prompts, 128)}), flush=True)
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
