"""Cost of the KV-aware routing decision at scale: pure Python, no Ray, no model.

Simulates N replicas, each a prefix cache of `--replica-blocks` blocks with LRU eviction that
reports BlockStored / BlockRemoved events to one PrefixIndex (as the index actor would receive
them), and S agent sessions that share a system prompt and grow turn by turn. Every request is
routed by the production code path (PrefixIndex.match + policy.choose) and timed. Load is the
number of requests each replica received within the last `--window` requests (a stand-in for
requests in flight).

Reports routing decisions per second (one thread); decision latency p50/p99 (index match +
policy: what a request waits for; recording the routed blocks happens after it, reported apart);
index memory (tracemalloc) and size; the cached-token fraction the decisions achieve; and load
balance (max/mean requests per replica).

    python bench/router_sim.py --replicas 64 --sessions 10000 --turns 4 --window 1024
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections import Counter, OrderedDict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.kv_events.block_hash import hash_block_tokens  # noqa: E402
from app.kv_events.schema import BlockRemoved, BlockStored  # noqa: E402
from app.router.index import PrefixIndex  # noqa: E402
from app.router.policy import RoutingPolicy, choose  # noqa: E402


class SimReplica:
    """A replica's prefix cache: LRU over block hashes, emitting KV events."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, hashes: list[int]) -> tuple[int, list]:
        """Leading blocks already cached, and the events of caching the whole prompt."""
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            hit += 1
        new = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        events = []
        if new:
            events.append(BlockStored(new, None, [], 16))
        if evicted:
            events.append(BlockRemoved(evicted))
        return hit, events


def chain(parent: int | None, tag: str, n: int) -> list[int]:
    out = []
    for i in range(n):
        parent = hash_block_tokens(parent, [i], [tag])
        out.append(parent)
    return out


def run(args) -> dict:
    rng = random.Random(args.seed)
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    sims = {r: SimReplica(args.replica_blocks) for r in replicas}
    system = chain(None, "system", args.system_blocks)
    # Each session's prompt blocks, turn by turn: system prompt + the session's growing history.
    sessions = []
    for s in range(args.sessions):
        history = list(system)
        turns = []
        for t in range(args.turns):
            history = history + chain(history[-1], f"s{s}t{t}", rng.randint(args.min_new_blocks, args.max_new_blocks))
            turns.append(list(history))
        sessions.append(turns)
    order = [(s, t) for t in range(args.turns) for s in rng.sample(range(args.sessions), args.sessions)]

    index = PrefixIndex(max_blocks=args.index_blocks)
    policy = RoutingPolicy()
    recent: deque[str] = deque()
    load: Counter[str] = Counter()
    received: Counter[str] = Counter()
    latencies, record_latencies = [], []
    cached = total = ideal = 0
    for s, t in order:
        hashes = sessions[s][t]
        t0 = time.perf_counter()
        matches = index.match(hashes)
        decision = choose(replicas, matches, load, f"session-{s}", policy, rng)
        t1 = time.perf_counter()
        index.record_routed(decision.ranking[0], hashes)  # after the decision, off its path
        latencies.append(t1 - t0)
        record_latencies.append(time.perf_counter() - t1)
        replica = decision.ranking[0]
        hit, events = sims[replica].serve(hashes)
        index.apply_all(replica, events)
        cached += hit
        total += len(hashes)
        ideal += len(sessions[s][t - 1]) if t else len(system) if s else 0
        received[replica] += 1
        recent.append(replica)
        load[replica] += 1
        if len(recent) > args.window:
            load[recent.popleft()] -= 1
    # Memory: rebuild the final index content under tracemalloc (tracing would distort the timing).
    tracemalloc.start()
    rebuilt = PrefixIndex(max_blocks=args.index_blocks)
    for r, sim in sims.items():
        rebuilt.apply(r, BlockStored(list(sim.blocks), None, [], 16))
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    latencies.sort()
    n = len(latencies)
    counts = [received[r] for r in replicas]
    return {
        "replicas": args.replicas, "sessions": args.sessions, "turns": args.turns, "requests": n,
        "decisions_per_s": n / sum(latencies),
        "p50_us": 1e6 * latencies[n // 2], "p99_us": 1e6 * latencies[int(0.99 * n)],
        "record_routed_mean_us": 1e6 * statistics.mean(record_latencies),
        "index_blocks": index.num_blocks, "index_entries": sum(len(sim.blocks) for sim in sims.values()),
        "traced_memory_mib": current / 2**20,
        "cached_block_fraction": cached / total, "ideal_fraction": ideal / total,
        "max_over_mean_requests": max(counts) / statistics.mean(counts),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-blocks", type=int, default=96, help="shared system prompt (16-token blocks)")
    p.add_argument("--min-new-blocks", type=int, default=6)
    p.add_argument("--max-new-blocks", type=int, default=32)
    p.add_argument("--replica-blocks", type=int, default=200_000, help="prefix-cache capacity of a replica")
    p.add_argument("--index-blocks", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=256, help="requests counted as in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    t0 = time.time()
    r = run(args)
    print(f"simulated {r['requests']} routing decisions in {time.time() - t0:.1f} s", file=sys.stderr)
    print("| replicas | sessions x turns | decisions/s | p50 | p99 | record routed (mean) | index blocks | "
          "index memory | cached blocks | ideal | max/mean requests |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {r['replicas']} | {r['sessions']} x {r['turns']} | {r['decisions_per_s']:,.0f} | "
          f"{r['p50_us']:.0f} us | {r['p99_us']:.0f} us | {r['record_routed_mean_us']:.0f} us | {r['index_blocks']:,} | {r['traced_memory_mib']:.0f} MiB | "
          f"{r['cached_block_fraction']:.3f} | {r['ideal_fraction']:.3f} | {r['max_over_mean_requests']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
