"""The KV-aware router against Ray Serve's default power-of-two-choices router, same run.

Starts a local Ray + Serve, deploys serve_config.yaml with `--replicas` LLMServer replicas, once
with the KV-aware router and once with `router.enabled: false` (Ray Serve's default), fresh
replicas each time, and drives the same multi-turn agent swarm through HTTP against both
(bench/http_load.py's session generator, same seed): every session shares a system prompt, and
each turn appends the previous answer plus new text.

Reports per router: cached-token fraction (prompt tokens served from the prefix cache), the
ideal fraction (every turn after a session's first fully cached up to its previous turn, in full
blocks; first turns up to the end of the shared system prompt), TTFT p50/p99, total time, and requests per replica (max/mean, from the replicas' own
counters).

    python bench/router_compare.py --replicas 4 --sessions 48 --turns 6
    python bench/router_compare.py --backend vllm --model DIR --replicas 3 --sessions 12 --turns 4   # vLLM replicas

`--backend vllm` runs vLLM replicas (engine.backend: vllm; vLLM installed in this environment)
on `--model` (a Hugging Face directory, e.g. bench/peer_model.py's), pages of 32 tokens, bf16 KV.
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

from bench.http_load import SessionWorkload, percentile, run_sessions  # noqa: E402

APP = "llm"


def deploy(replicas: int, kv_router: bool, engine_overrides: dict, model_id: str = "tiny-llama",
           router_overrides: dict | None = None) -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    (app,) = config["applications"]
    app["deployments"] = [{"name": "LLMServer", "num_replicas": replicas}]
    app["args"]["engine"]["model"] = "tiny-llama"  # the byte tokenizer: 1 char = 1 token (unless overridden)
    if engine_overrides.get("backend", "native") == "native" and engine_overrides.get("device", "cpu") == "cpu":
        # the replicas share the cores
        app["args"]["engine"]["cpu_threads"] = max(1, (os.cpu_count() or 1) // replicas)
    app["args"]["model_id"] = model_id
    app["args"]["engine"].update(engine_overrides)
    app["args"].setdefault("router", {}).update({**(router_overrides or {}), "enabled": kv_router})
    from ray import serve

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}), _blocking=False)
    t0 = time.time()
    deadline, shown = t0 + 600, t0
    while time.time() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":  # Serve gave up: say why, at once
            raise RuntimeError(f"application {APP} failed to deploy: {status.message}\n{deployment_states(status)}")
        if time.time() - shown >= 30:  # a slow start (compiles, weights) or a stuck one: say where it is
            shown = time.time()
            print(f"[deploy] {shown - t0:.0f} s: {status.status if status else 'not yet known'}\n"
                  f"{deployment_states(status)}", file=sys.stderr, flush=True)
        time.sleep(1)
    raise TimeoutError(f"application {APP} not running after 600 s:\n{deployment_states(serve.status().applications.get(APP))}")


def deployment_states(app_status) -> str:
    """One line per deployment of an application's status: its state, replicas by state, message."""
    if app_status is None:
        return "  (no status)"
    return "\n".join(f"  {name}: {d.status} {dict(d.replica_states)} {d.message[-500:]}".rstrip()
                     for name, d in app_status.deployments.items())


def replica_requests() -> dict[str, int]:
    import ray

    from app.router.index_actor import get_index

    stats = ray.get(get_index(APP).replica_stats.remote())
    return {r: s.get("num_requests_total", 0) for r, s in stats.items()}


def confirmed_blocks() -> dict[str, int]:
    """Replica -> blocks the application's index holds for it from the replica's KV events."""
    import ray

    from app.router.index_actor import get_index

    return {r: len(b) for r, b in ray.get(get_index(APP).dump.remote())[3].items()}


def ideal_cached_tokens(results, block_size: int, shared_tokens: int, tokenize=None,
                        shared_prompt: str | None = None) -> int:
    """Every turn after a session's first served from cache up to the end of its previous turn,
    and every first turn up to the end of the shared system prompt (full blocks).

    With `tokenize` (a BPE model's tokenizer) the context a turn can reuse is counted in the tokens
    it actually shares: the common prefix of its prompt's tokens with the previous prompt's tokens
    followed by the previous answer's (re-tokenized), and for first turns with `shared_prompt`'s.
    A BPE tokenizer merges across the seam of two texts, so the plain count overstates what any
    cache can hold. (Still an upper bound: the answer's generated ids may tokenize differently.)"""
    by_key = {(r.session, r.turn): r for r in results if r.ok}
    total = 0
    shared_ids = tokenize(shared_prompt) if tokenize is not None and shared_prompt is not None else None
    for (session, turn), r in by_key.items():
        prev = by_key.get((session, turn - 1))
        if tokenize is not None and r.prompt is not None:
            ids = tokenize(r.prompt)
            before = (tokenize(prev.prompt) + tokenize(prev.text, add_special_tokens=False)) if turn and prev else shared_ids
            context = _common_prefix(ids, before or [])
        else:
            context = (prev.prompt_tokens or 0) + prev.completion_tokens if turn and prev else shared_tokens
        total += min(context, (r.prompt_tokens or 0) - 1) // block_size * block_size
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def drive(url: str, w: SessionWorkload, model_id: str = "tiny-llama") -> tuple[list, float]:
    limits = httpx.Limits(max_connections=w.sessions + 4, max_keepalive_connections=w.sessions + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600)) as client:
        start = time.perf_counter()
        results = await run_sessions(client, model_id, w)
        return results, time.perf_counter() - start


def ideal_for(results, args, w: SessionWorkload) -> int:
    """The ideal cached tokens of a run of `w` (ideal_cached_tokens; in the model's tokens with --model)."""
    if byte_tokens(args):  # the byte tokenizer: BOS + one token per character, no merges
        return ideal_cached_tokens(results, args.block_size, 1 + args.system_prompt_tokens)
    import random

    from app.engine.tokenizer import load_tokenizer
    from bench.http_load import make_text

    tokenizer = load_tokenizer(args.model)
    system_prompt = make_text(random.Random(f"{w.seed}-system"), w.system_prompt_tokens, w.chars_per_token)
    return ideal_cached_tokens(results, args.block_size, 0, tokenizer.encode, system_prompt)


def byte_tokens(args) -> bool:
    """Whether the replicas tokenize by bytes: tiny-llama, or any model with dummy weights."""
    return not args.model or args.engine.get("load_format") == "dummy"


def engine_overrides(args) -> tuple[dict, str]:
    """(engine settings, model id) of the replicas `args` ask for."""
    if args.backend == "vllm":
        if not args.model:
            raise SystemExit("--backend vllm needs --model (a Hugging Face model directory)")
        return ({"backend": "vllm", "model": args.model, "block_size": args.block_size, "kv_cache_dtype": "bf16",
                 "kv_cache_memory": "1GiB"}, os.path.basename(os.path.normpath(args.model)))
    overrides = {"kv_cache_dtype": args.kv_cache_dtype, "block_size": args.block_size, **args.engine}
    if args.model:
        overrides["model"] = args.model
        return overrides, os.path.basename(os.path.normpath(args.model))
    return overrides, "tiny-llama"


ROUTERS = {  # --routers: name, KV-aware router?, replicas (None: --replicas)
    "one": ("one replica (what any cache could hold)", True, 1),
    "p2c": ("power of two (Ray Serve default)", False, None),
    "kv": ("KV-aware (ours)", True, None),
}


def run_one(url: str, name: str, kv_router: bool, replicas: int | None, args, w: SessionWorkload) -> dict:
    """One deployment (`replicas`, None: args.replicas) driven by `w`; deleted afterwards."""
    from ray import serve

    t0 = time.time()
    replicas = replicas or args.replicas
    overrides, model_id = engine_overrides(args)
    deploy(replicas, kv_router, overrides, model_id, {"slack": args.slack} if args.slack is not None else None)
    # replicas report their stats once per routing_stats period; wait until all have
    deadline = time.time() + 60
    while len(replica_requests()) < replicas and time.time() < deadline:
        time.sleep(0.5)
    before = replica_requests()
    print(f"[{name}] deployed {replicas} replicas in {time.time() - t0:.0f} s; driving "
          f"{w.sessions} sessions x {w.turns} turns", file=sys.stderr)
    results, wall = asyncio.run(drive(url, w, model_id))
    time.sleep(2.5)  # one more stats period
    after = replica_requests()
    index_blocks = confirmed_blocks()
    per_replica = [after.get(r, 0) - before.get(r, 0) for r in after]
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ideal = ideal_for(results, args, w)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    serve.delete(APP)
    return {
        "router": name, "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": cached / prompt,
        "ideal_fraction": ideal / prompt, "of_ideal": cached / ideal if ideal else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "requests_per_replica": sorted(per_replica, reverse=True),
        "max_over_mean": max(per_replica) / statistics.mean(per_replica) if sum(per_replica) else None,
        "index_blocks_per_replica": index_blocks,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompt-tokens", type=int, default=1536)
    p.add_argument("--new-tokens", type=int, nargs=2, default=(100, 500))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="fp4")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 16 as in serve_config.yaml; 32 with --backend vllm)")
    p.add_argument("--backend", choices=("native", "vllm"), default="native", help="engine.backend of the replicas")
    p.add_argument("--model", default=None, help="engine.model (default tiny-llama; required with --backend vllm)")
    p.add_argument("--engine-json", default="{}",
                   help="more engine settings of the replicas (native backend), e.g. on one GPU: "
                        "'{\"device\": \"cuda\", \"load_format\": \"dummy\", \"gpu_fraction\": 0.45}'")
    p.add_argument("--chars-per-token", type=float, default=None,
                   help="characters per token of the model's tokenizer (default: 1, tiny-llama's bytes; "
                        "1.9 with --model, bench/peer_model.py's BPE)")
    p.add_argument("--routers", default="p2c,kv",
                   help="which runs, of p2c (Ray Serve's router), kv (ours) and one (a single replica: every turn "
                        "finds its prefix, the attainable cached tokens where a BPE tokenizer makes the computed "
                        "ideal unreachable)")
    p.add_argument("--slack", type=int, default=None,
                   help="the KV-aware router's slack (args.router.slack; default serve_config.yaml's): requests "
                        "above load_factor x the least load a replica may carry before sessions are sent elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.engine = json.loads(args.engine_json)
    if args.block_size is None:
        args.block_size = 32 if args.backend == "vllm" else 16
    if args.chars_per_token is None:
        args.chars_per_token = 1.0 if byte_tokens(args) else 1.9  # 1.9: the peer model's BPE on these words
    return args


def workload(args) -> SessionWorkload:
    return SessionWorkload(sessions=args.sessions, turns=args.turns, system_prompt_tokens=args.system_prompt_tokens,
                           new_tokens=tuple(args.new_tokens), max_tokens=args.max_tokens, temperature=0.0,
                           ignore_eos=True, chars_per_token=args.chars_per_token, endpoint="completions",
                           session_header=True, seed=args.seed)


def main() -> None:
    args = parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    import ray
    from ray import serve

    w = workload(args)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = 8000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        rows = [run_one(url, *ROUTERS[r], args, w) for r in args.routers.split(",")]
    finally:
        serve.shutdown()
        ray.shutdown()
    command = "python bench/router_compare.py " + shlex.join(sys.argv[1:])
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    kv_format = "bf16 (vLLM)" if args.backend == "vllm" else args.kv_cache_dtype
    print(f"`{command}`\n\n{time.strftime('%Y-%m-%d %H:%M')}, {args.replicas} {args.backend} replicas, "
          f"{args.sessions} sessions x {args.turns} turns, KV {kv_format}\n")
    one = next((r for r in rows if r["router"] == ROUTERS["one"][0]), None)
    print("| router | requests (errors) | cached-token fraction | % of ideal | % of one replica | TTFT p50 / p99 (ms) "
          "| total time (s) | requests per replica | max/mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        of_one = f"{100 * r['cached_tokens'] / one['cached_tokens']:.0f} %" if one and one["cached_tokens"] else "-"
        print(f"| {r['router']} | {r['requests']} ({r['errors']}) | {r['cached_fraction']:.3f} "
              f"(ideal {r['ideal_fraction']:.3f}) | {100 * (r['of_ideal'] or 0):.0f} % | {of_one} | "
              f"{1e3 * r['ttft_p50_s']:.0f} / {1e3 * r['ttft_p99_s']:.0f} | {r['wall_s']:.1f} | "
              f"{r['requests_per_replica']} | {r['max_over_mean']:.2f} |")
    by_name = {r["router"]: r for r in rows}
    p2c, kv = by_name.get(ROUTERS["p2c"][0]), by_name.get(ROUTERS["kv"][0])
    if p2c is None or kv is None:
        return
    print(f"\ncached-token fraction ratio (KV-aware / power of two): {kv['cached_fraction'] / p2c['cached_fraction']:.2f}x; "
          f"TTFT p50 ratio: {kv['ttft_p50_s'] / p2c['ttft_p50_s']:.2f}")


if __name__ == "__main__":
    main()
