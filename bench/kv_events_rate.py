"""How many KV events per second the ZMQ subscriber follows (app/kv_events/zmq_transport.py).

Publishes --batches batches of --events BlockStored events each (one block of --block-size tokens
per event, chained per session, in vLLM's wire layout with publisher-side sha256 hashes) as fast
as the publisher sends them, over ipc sockets: ours (`--publisher ours`) or vLLM's own
ZmqEventPublisher (`--publisher vllm`, where vLLM is installed). A subscriber in this process
re-hashes every block with our chain hash and applies it to a PrefixIndex, as a replica and the
index do. Reports events/s published and followed (from the first publish to the last batch
applied), and batches replayed and lost.

    python bench/kv_events_rate.py --batches 2000 --events 50 [--publisher vllm]
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.kv_events.wire import event_from_wire  # noqa: E402
from app.kv_events.zmq_transport import BlockRehasher, ZmqEventPublisher, ZmqEventSubscriber  # noqa: E402
from app.router.index import PrefixIndex  # noqa: E402


def make_batches(num_batches: int, per_batch: int, block_size: int, sessions: int = 1000) -> list[list[dict]]:
    """Events extending `sessions` chains by one block each, round robin (vLLM's maps)."""
    parents: list[bytes | None] = [None] * sessions
    batches = []
    n = 0
    for b in range(num_batches):
        events = []
        for _ in range(per_batch):
            s = n % sessions
            tokens = [(n * 7 + i) % 50_000 for i in range(block_size)]
            h = hashlib.sha256(repr((parents[s], tokens)).encode()).digest()
            events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parents[s],
                           "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "extra_keys": [None], "group_idx": 0,
                           "kv_cache_spec_kind": "full_attention"})
            parents[s] = h
            n += 1
        batches.append(events)
    return batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--events", type=int, default=50, help="events per batch")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--publisher", choices=("ours", "vllm"), default="ours")
    args = p.parse_args()

    batches = make_batches(args.batches, args.events, args.block_size)
    d = tempfile.mkdtemp(prefix="kv-events-bench-")
    ep, rep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    if args.publisher == "vllm":
        from vllm.distributed import kv_events as vk

        vpub = vk.ZmqEventPublisher(0, endpoint=ep, replay_endpoint=rep, buffer_steps=args.batches)

        def publish(events):
            structs = [vk.BlockStored(**{k: v for k, v in e.items() if k != "type"}) for e in events]
            vpub.publish(vk.KVEventBatch(ts=time.time(), events=structs))

        close = vpub.shutdown
    else:
        pub = ZmqEventPublisher(ep, rep, buffer_steps=args.batches)

        def publish(events):
            pub.publish_payload(msgpack.packb([time.time(), events, 0], use_bin_type=True))

        close = pub.close
    rehasher, index, lock = BlockRehasher(args.block_size), PrefixIndex(max_blocks=10**7), threading.Lock()
    lost: list[int] = []

    def on_batch(events):
        with lock:
            index.apply_all("r", rehasher.translate(events))

    sub = ZmqEventSubscriber(ep, on_batch, replay_endpoint=rep, on_lost=lost.append).start()
    time.sleep(0.2)
    # the wire dicts are decoded by the subscriber; check one round trip here so a schema slip fails loudly
    event_from_wire(batches[0][0])
    t0 = time.perf_counter()
    for events in batches:
        publish(events)
    t_pub = time.perf_counter() - t0
    deadline = time.monotonic() + 600
    while sub.next_seq < args.batches and time.monotonic() < deadline:
        time.sleep(0.005)
    t_follow = time.perf_counter() - t0
    sub.close()
    close()
    n = args.batches * args.events
    print(f"`python bench/kv_events_rate.py {shlex.join(sys.argv[1:])}`\n")
    print("| publisher | events | published events/s | followed events/s (re-hashed, indexed) | batches replayed | "
          "lost | unresolved blocks | blocks in the index |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.publisher} | {n} | {n / t_pub:,.0f} | {n / t_follow:,.0f} | {sub.num_replayed} | {sub.num_lost} | "
          f"{rehasher.num_unresolved} | {index.num_blocks} |")


if __name__ == "__main__":
    main()
