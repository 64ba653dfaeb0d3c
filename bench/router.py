"""The KV-aware router against Ray Serve's default power-of-two-choices router, same run.

Starts a local Ray + Serve, deploys serve_config.yaml with `--replicas` LLMServer replicas, once
with the KV-aware router and once with `router.enabled: false` (Ray Serve's default), fresh
replicas each time, and drives the same multi-turn agent swarm through HTTP against both
(bench/serving.py's session generator, same seed): every session shares a system prompt, and
each turn appends the previous answer plus new text.

Reports per router: cached-token fraction (prompt tokens served from the prefix cache), the
ideal fraction (every turn after a session's first fully cached up to its previous turn, in full
blocks; first turns up to the end of the shared system prompt), TTFT p50/p99, total time, and requests per replica (max/mean, from the replicas' own
counters).

    python bench/router.py --replicas 4 --sessions 48 --turns 6
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import SessionWorkload, percentile, run_sessions  # noqa: E402

APP = "llm"


def deploy(replicas: int, kv_router: bool, engine_overrides: dict) -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    (app,) = config["applications"]
    for d in app["deployments"]:
        if d["name"] == "LLMServer":
            d["num_replicas"] = replicas
            if not kv_router:
                d.pop("request_router_config", None)
    app["args"]["engine"]["model"] = app["args"]["model_id"] = "tiny-llama"  # the byte tokenizer: 1 char = 1 token
    app["args"]["engine"].update(engine_overrides)
    app["args"].setdefault("router", {})["enabled"] = kv_router
    from ray import serve

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}), _blocking=False)
    deadline = time.time() + 600
    while time.time() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            return
        time.sleep(1)
    raise TimeoutError(f"application {APP} not running after 600 s: {serve.status()}")


def replica_requests() -> dict[str, int]:
    import ray

    from app.router.index_actor import get_index

    stats = ray.get(get_index(APP).replica_stats.remote())
    return {r: s.get("num_requests_total", 0) for r, s in stats.items()}


def ideal_cached_tokens(results, block_size: int, shared_tokens: int) -> int:
    """Every turn after a session's first served from cache up to the end of its previous turn,
    and every first turn up to the end of the shared system prompt (full blocks)."""
    by_key = {(r.session, r.turn): r for r in results if r.ok}
    total = 0
    for (session, turn), r in by_key.items():
        prev = by_key.get((session, turn - 1))
        context = (prev.prompt_tokens or 0) + prev.completion_tokens if turn and prev else shared_tokens
        total += min(context, (r.prompt_tokens or 0) - 1) // block_size * block_size
    return total


async def drive(url: str, w: SessionWorkload) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=w.sessions + 4, max_keepalive_connections=w.sessions + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600)) as client:
        start = time.perf_counter()
        results = await run_sessions(client, "tiny-llama", w)
        return results, time.perf_counter() - start


def run_one(url: str, name: str, kv_router: bool, args, w: SessionWorkload) -> dict:
    from ray import serve

    t0 = time.time()
    deploy(args.replicas, kv_router, {"kv_cache_dtype": args.kv_cache_dtype})
    # replicas report their stats once per routing_stats period; wait until all have
    deadline = time.time() + 60
    while len(replica_requests()) < args.replicas and time.time() < deadline:
        time.sleep(0.5)
    before = replica_requests()
    print(f"[{name}] deployed {args.replicas} replicas in {time.time() - t0:.0f} s; driving "
          f"{w.sessions} sessions x {w.turns} turns", file=sys.stderr)
    results, wall = asyncio.run(drive(url, w))
    time.sleep(2.5)  # one more stats period
    after = replica_requests()
    per_replica = [after.get(r, 0) - before.get(r, 0) for r in after]
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ideal = ideal_cached_tokens(results, args.block_size, shared_tokens=1 + args.system_prompt_tokens)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    serve.delete(APP)
    return {
        "router": name, "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": cached / prompt,
        "ideal_fraction": ideal / prompt, "of_ideal": cached / ideal if ideal else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "requests_per_replica": sorted(per_replica, reverse=True),
        "max_over_mean": max(per_replica) / statistics.mean(per_replica) if sum(per_replica) else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompt-tokens", type=int, default=1536)
    p.add_argument("--new-tokens", type=int, nargs=2, default=(100, 500))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="fp4")
    p.add_argument("--block-size", type=int, default=16, help="as in serve_config.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    import ray
    from ray import serve

    # The byte tokenizer of tiny-llama: one token per character (chars_per_token=1).
    w = SessionWorkload(sessions=args.sessions, turns=args.turns, system_prompt_tokens=args.system_prompt_tokens,
                        new_tokens=tuple(args.new_tokens), max_tokens=args.max_tokens, temperature=0.0,
                        ignore_eos=True, chars_per_token=1.0, endpoint="completions", session_header=True,
                        seed=args.seed)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = 8000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        rows = [run_one(url, "power of two (Ray Serve default)", False, args, w),
                run_one(url, "KV-aware (ours)", True, args, w)]
    finally:
        serve.shutdown()
        ray.shutdown()
    command = "python bench/router.py " + shlex.join(sys.argv[1:])
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(f"`{command}`\n\n{time.strftime('%Y-%m-%d %H:%M')}, {args.replicas} replicas, {args.sessions} sessions x "
          f"{args.turns} turns, KV {args.kv_cache_dtype}\n")
    print("| router | requests (errors) | cached-token fraction | % of ideal | TTFT p50 / p99 (ms) | total time (s) "
          "| requests per replica | max/mean |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['router']} | {r['requests']} ({r['errors']}) | {r['cached_fraction']:.3f} "
              f"(ideal {r['ideal_fraction']:.3f}) | {100 * (r['of_ideal'] or 0):.0f} % | "
              f"{1e3 * r['ttft_p50_s']:.0f} / {1e3 * r['ttft_p99_s']:.0f} | {r['wall_s']:.1f} | "
              f"{r['requests_per_replica']} | {r['max_over_mean']:.2f} |")
    p2c, kv = rows
    print(f"\ncached-token fraction ratio (KV-aware / power of two): {kv['cached_fraction'] / p2c['cached_fraction']:.2f}x; "
          f"TTFT p50 ratio: {kv['ttft_p50_s'] / p2c['ttft_p50_s']:.2f}")


if __name__ == "__main__":
    main()
