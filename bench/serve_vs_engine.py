"""The serving path against the engine alone, on the same token shapes, in one call.

It starts a Ray instance, then `serve run` of serve_config.yaml on it with this script's engine
settings (so this process can hold handles too), and reports the replica's ready time: seconds from
`serve run` to a 200 on /v1/models and an answered 1-token completion. Then, per workload, over HTTP
(/v1/completions with token-id prompts) and through the handle API (the ingress's `completions`,
as agent swarms on Ray call it); then Serve and Ray are stopped and the same workloads run through
the engine alone in this process (LLM.generate for throughput, AsyncLLMEngine.generate for
sessions), so the two never share the device. Every request has ignore_eos and temperature 0:
every path generates exactly its max_tokens.

- throughput shapes `NxL+M`: N concurrent requests, each a prompt of L random token ids of its own
  (no prefix shared), M output tokens; wall time and output tok/s;
- streaming sessions: S concurrent sessions of T turns; turn t's prompt is turn t-1's plus
  --session-append new tokens (the reply is not appended, so every path sends the same ids), after
  a --session-prefix shared by all sessions; --session-reply tokens each; TTFT and inter-token
  latency (gaps between streamed chunks) p50/p99, and where the mean TTFT goes: the client's mean,
  the ingress's (from handing a request to a replica to its first output: /metrics'
  llm_time_to_first_token_seconds) and the engine's own (arrival in the engine to the first token:
  llm_engine_time_to_first_token_seconds over llm_engine_first_tokens), each over the workload's
  requests (counter deltas).

This process runs with the replicas' GIL switch interval (ServerConfig.gil_switch_interval_s, --server-json):
it is the handle path's caller and the engine alone's host, where the engine thread shares the GIL with
the client's event loop as it does with the replica's.

Each path draws its own token ids (same shapes), so no path finds another's prompts in the prefix
cache. "vs engine" is the path's output tok/s over the engine's on the same workload. With --repeats N
each workload runs N times per path, each time with new token ids: the run of median wall time (the
lower middle one for an even N) is reported, with the range of all N and the kernel compiles of all N
(one run on a GPU machine moved some ratios by up to 0.27x from another's).

GPU (one H100/H200; Ray from the offline bundle, see the README "On a GPU"):

    source .raydev/install.sh && python bench/serve_vs_engine.py --model llama-3.1-8b \
        --load-format dummy --device cuda --kv-cache-dtype fp4 --json serve_vs_engine.json

CPU (the smoke test, tests/test_serve_vs_engine.py, runs this at a smaller size):

    python bench/serve_vs_engine.py --model tiny-llama --kv-cache-dtype bf16 --shapes 8x64+16 \
        --sessions 2 --turns 2 --session-prefix 32 --session-append 16 --session-reply 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.http_load import RequestResult, percentile, send_once, send_streaming  # noqa: E402
from bench.servers import serve_run  # noqa: E402

MODEL_ID = "bench"
APP = "llm"
PATHS = ("http", "handle", "engine")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'64x2048+128' -> (64 requests, 2048 prompt tokens, 128 output tokens)."""
    try:
        n, rest = text.split("x")
        length, out = rest.split("+")
        shape = int(n), int(length), int(out)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is NxL+M, e.g. 64x2048+128 (got {text!r})") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"N, L and M must be >= 1 (got {text!r})")
    return shape


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-dtype", default="fp4")
    p.add_argument("--engine-json", default="{}", help="more engine settings, e.g. '{\"max_num_seqs\": 256}'")
    p.add_argument("--server-json", default="{}",
                   help="application settings (ServerConfig, the `args:` of serve_config.yaml) other than engine and "
                        "model_id, e.g. '{\"gil_switch_interval_s\": null}'; gil_switch_interval_s applies to this "
                        "process too (the handle path's caller, the engine alone's host)")
    p.add_argument("--shapes", type=lambda s: [parse_shape(x) for x in s.split(",") if x],
                   default=[(64, 2048, 128), (128, 4096, 128)], help="throughput shapes NxL+M, comma-separated")
    p.add_argument("--sessions", type=int, default=32, help="0: no session workload")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--session-prefix", type=int, default=1024, help="tokens every session's first turn starts with")
    p.add_argument("--session-append", type=int, default=256, help="new tokens per turn")
    p.add_argument("--session-reply", type=int, default=64, help="output tokens per turn")
    p.add_argument("--paths", default=",".join(PATHS), help=f"some of {','.join(PATHS)}")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time each path's first requests too (default: every workload once small and untimed first)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each workload per path (fresh prompts each): the run of median wall time (the "
                        "lower middle one for an even count) is reported, with every run's wall time; odd counts "
                        "give a true median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    if not set(args.paths) <= set(PATHS):
        p.error(f"--paths: some of {PATHS} (got {args.paths})")
    if args.repeats < 1:
        p.error(f"--repeats: at least 1 (got {args.repeats})")
    try:
        args.server = server_settings(args)
    except ValueError as e:  # bad JSON, not an object, an unknown or invalid setting
        p.error(f"--server-json: {e}")
    return args


def server_settings(args: argparse.Namespace) -> dict:
    """--server-json, checked against ServerConfig (a typo fails here, not in the replica); ValueError if bad."""
    from app.config import ServerConfig

    settings = json.loads(args.server_json)  # JSONDecodeError is a ValueError
    if not isinstance(settings, dict):
        raise ValueError(f"a JSON object of settings, e.g. '{{\"gil_switch_interval_s\": null}}' (got {args.server_json})")
    if {"engine", "model_id"} & settings.keys():
        raise ValueError("engine settings go in --engine-json, and model_id is the benchmark's")
    ServerConfig.model_validate(settings)
    return settings


def engine_settings(args: argparse.Namespace) -> dict:
    return {"model": args.model, "load_format": args.load_format, "device": args.device,
            "kv_cache_dtype": args.kv_cache_dtype, **json.loads(args.engine_json)}


# -- workloads: token ids, the same shapes for every path ------------------------------------------

def throughput_prompts(shape: tuple[int, int, int], vocab_size: int, seed: str) -> list[list[int]]:
    n, length, _ = shape
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


def session_prompts(args: argparse.Namespace, vocab_size: int, seed: str) -> list[list[list[int]]]:
    """Per session, the prompt of each turn."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(3, vocab_size) for _ in range(k)]  # noqa: E731
    prefix = ids(args.session_prefix)
    sessions = []
    for _ in range(args.sessions):
        prompt, turns = list(prefix), []
        for _ in range(args.turns):
            prompt = prompt + ids(args.session_append)
            turns.append(prompt)
        sessions.append(turns)
    return sessions


def workloads(args: argparse.Namespace) -> list[tuple[str, str, tuple | None]]:
    """(name, kind, shape) of each workload."""
    rows = [(f"{n}x{length}+{out}", "throughput", (n, length, out)) for n, length, out in args.shapes]
    if args.sessions:
        rows.append((f"sessions {args.sessions}x{args.turns} (+{args.session_append}, reply {args.session_reply})",
                     "sessions", None))
    return rows


# -- one request on each path: (output tokens, ttft_s, gaps) -----------------------------------------

class Stream:
    """Times of one request's streamed tokens."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.num_tokens = 0
        self._last = 0.0

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter() - self.start
        if self.ttft_s is None:
            self.ttft_s = now
        else:
            self.itl_s.append(now - self._last)
        self._last = now
        self.num_tokens += k


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def http_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool) -> Stream:
    result = RequestResult(session=0, turn=0, start=time.perf_counter())
    send = send_streaming if stream else send_once
    await send(client, "/v1/completions", completion_body(prompt, max_tokens), result)
    if not result.ok:
        raise RuntimeError(f"HTTP request failed: {result.error}")
    s = Stream()
    s.ttft_s, s.itl_s, s.num_tokens = result.ttft_s, result.itl_s, result.completion_tokens
    return s


async def handle_request(handle, prompt: list[int], max_tokens: int, stream: bool) -> Stream:
    from app.deployments.protocol import CompletionRequest

    body = completion_body(prompt, max_tokens)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    s = Stream()
    async for item in handle.options(stream=True).completions.remote(CompletionRequest(**body)):
        if stream and item.choices:
            s.tokens(1)
        if item.usage is not None:
            s.num_tokens = item.usage.completion_tokens
    return s


async def engine_request(engine, prompt: list[int], max_tokens: int) -> Stream:
    from app import SamplingParams

    s = Stream()
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)):
        s.tokens(len(out.delta_token_ids))
    return s


async def run_sessions(sessions: list[list[list[int]]], reply: int, send) -> list[Stream]:
    async def one(turns: list[list[int]]) -> list[Stream]:
        return [await send(prompt, reply) for prompt in turns]

    return [s for streams in await asyncio.gather(*(one(t) for t in sessions)) for s in streams]


def row(path: str, workload: str, streams: list[Stream], expected: int, wall_s: float, num_requests: int) -> dict:
    ttfts = [s.ttft_s for s in streams if s.ttft_s is not None]
    gaps = [g for s in streams for g in s.itl_s]
    output_tokens = sum(s.num_tokens for s in streams)
    return {"workload": workload, "path": path, "requests": num_requests,
            "answered": sum(s.num_tokens == expected for s in streams), "expected_tokens": expected,
            "output_tokens": output_tokens, "wall_s": wall_s, "output_tok_per_s": output_tokens / wall_s,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99)}


async def warm_up(path: str, args: argparse.Namespace, vocab_size: int, send, send_batch=None,
                  kinds=("throughput", "sessions"), counters=None) -> None:
    """Every workload once, untimed, with prompts of their own (their own seed): each throughput
    shape at its full size with at most 8 output tokens (its prefill steps, batch sizes and mixed
    steps: Triton specializes kernels on sizes, and a 16-request warm-up left the first path on a
    fresh H100 compiling inside its timed run, 9.8 s against 5.0 s warm), the sessions with 2 x 2
    turns. So the kernels a path's process compiles or loads on first use are ready before the timed
    runs, whichever path ran first on the machine."""
    start = time.perf_counter()
    before = await counters() if counters else None
    small = argparse.Namespace(**{
        **vars(args), "warmup": False, "repeats": 1, "seed": f"{args.seed}-warmup",
        "shapes": [(n, length, min(out, 8)) for n, length, out in args.shapes],
        "sessions": min(args.sessions, 2), "turns": min(args.turns, 2), "session_reply": min(args.session_reply, 8)})
    await run_workloads(path, small, vocab_size, send, send_batch, kinds)
    compiled = ""
    if counters:
        d = compile_deltas(before, await counters())
        compiled = f" ({d['kernel_compiles']} kernel compiles, {d['kernel_compile_s']:.1f} s)"
    print(f"[{path}] warmed up in {time.perf_counter() - start:.1f} s{compiled}", flush=True)


async def timed_run(path: str, name: str, kind: str, shape, seed: str, args: argparse.Namespace, vocab_size: int,
                    send, send_batch, counters) -> dict:
    """One timed run of one workload on one path (run_workloads' arguments): its row."""
    before = await counters() if counters else None
    if kind == "throughput":
        prompts, max_tokens = throughput_prompts(shape, vocab_size, seed), shape[2]
        start = time.perf_counter()
        if send_batch is not None:
            streams = send_batch(prompts, max_tokens)
        else:
            streams = await asyncio.gather(*(send(p, max_tokens, False) for p in prompts))
        run = row(path, name, streams, max_tokens, time.perf_counter() - start, len(prompts))
    else:
        sessions = session_prompts(args, vocab_size, seed)
        start = time.perf_counter()
        streams = await run_sessions(sessions, args.session_reply, lambda p, m: send(p, m, True))
        run = row(path, name, streams, args.session_reply, time.perf_counter() - start, args.sessions * args.turns)
    if counters:
        after = await counters()
        run.update(compile_deltas(before, after))
        if kind == "sessions":
            run.update(ttft_means(before, after))
    compiled = f", {run['kernel_compiles']} kernel compiles" if counters else ""
    print(f"[{path}] {name}: {run['wall_s']:.2f} s{compiled}", flush=True)
    return run


async def run_workloads(path: str, args: argparse.Namespace, vocab_size: int, send, send_batch=None,
                        kinds=("throughput", "sessions"), counters=None) -> list[dict]:
    """The workloads of `kinds` on one path. send(prompt, max_tokens, stream) -> Stream;
    send_batch(prompts, max_tokens) -> list[Stream] replaces concurrent sends for the throughput
    shapes (the engine's offline LLM.generate). counters() -> the engines' counters (async, see
    scrape_counters), read before and after each workload: the Triton compiles inside it
    (compile_deltas), and for sessions the mean TTFTs by stage (ttft_means)."""
    rows = []
    if args.warmup:
        await warm_up(path, args, vocab_size, send, send_batch, kinds, counters)
    for name, kind, shape in workloads(args):
        if kind not in kinds:
            continue
        runs = []
        for rep in range(args.repeats):  # fresh prompts each time: no repeat hits the last one's cache
            seed = f"{args.seed}-{path}-{name}" + (f"-r{rep}" if rep else "")
            print(f"[{path}] {name}{f' (run {rep + 1} of {args.repeats})' if args.repeats > 1 else ''} ...",
                  flush=True)
            runs.append(await timed_run(path, name, kind, shape, seed, args, vocab_size, send, send_batch, counters))
        # the run of median wall time (the lower middle one for an even count) stands for the workload;
        # every run's wall time is kept, and the compiles are those of all runs
        chosen = dict(sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2])
        chosen["wall_s_runs"] = [r["wall_s"] for r in runs]
        if counters:
            chosen["kernel_compiles"] = sum(r["kernel_compiles"] for r in runs)
            chosen["kernel_compile_s"] = sum(r["kernel_compile_s"] for r in runs)
        rows.append(chosen)
    return rows


# -- where the time to first token goes ----------------------------------------------------------

def scrape_counters(metrics_text: str) -> dict:
    """The counters of one /metrics scrape: the ingress TTFT histogram's sum and count (every
    endpoint), the engines' first tokens and their summed times, and the engines' Triton compiles
    and their seconds (every replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(("ingress_sum", "ingress_count", "engine_sum", "engine_count", "compiles", "compile_s"),
                           0.0)
    names = {"llm_time_to_first_token_seconds_sum": "ingress_sum",
             "llm_time_to_first_token_seconds_count": "ingress_count",
             "llm_engine_time_to_first_token_seconds_total": "engine_sum",
             "llm_engine_first_tokens_total": "engine_count",
             "llm_engine_kernel_compiles_total": "compiles",
             "llm_engine_kernel_compile_seconds_total": "compile_s"}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
    return totals


def ttft_means(before: dict, after: dict) -> dict:
    """Mean TTFT by stage between two counter readings (None where no request counted)."""
    def mean(stage: str) -> float | None:
        n = after[f"{stage}_count"] - before[f"{stage}_count"]
        return (after[f"{stage}_sum"] - before[f"{stage}_sum"]) / n if n > 0 else None

    return {"ingress_ttft_mean_s": mean("ingress"), "engine_ttft_mean_s": mean("engine")}


def compile_deltas(before: dict, after: dict) -> dict:
    """Triton compiles in the engines between two counter readings, and their seconds: a compile
    inside a timed run stalls its steps for that long."""
    return {"kernel_compiles": int(after["compiles"] - before["compiles"]),
            "kernel_compile_s": after["compile_s"] - before["compile_s"]}


def metrics_counters(url: str):
    """scrape_counters for a serving path, from /metrics. The ingress counts at once, the engines'
    counters reach /metrics through the index once a second: a reading waits (up to 10 s) until the
    engines have counted as many first tokens as the ingress (every request is n=1)."""
    async def read() -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 10
            while True:
                r = await client.get("/metrics")
                r.raise_for_status()
                counters = scrape_counters(r.text)
                if counters["engine_count"] >= counters["ingress_count"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.25)
        return counters

    return read


def engine_counters(engine):
    """scrape_counters' counters for the engine alone: its own stats (no ingress; compiles on CUDA only)."""
    async def read() -> dict:
        stats = engine.stats()
        return {"ingress_sum": 0.0, "ingress_count": 0.0, "engine_sum": stats["time_to_first_token_s_total"],
                "engine_count": stats["num_first_tokens_total"], "compiles": stats.get("kernel_compiles_total", 0),
                "compile_s": stats.get("kernel_compile_s_total", 0.0)}

    return read


# -- the paths ---------------------------------------------------------------------------------------

def serving_paths(args: argparse.Namespace, vocab_size: int) -> tuple[float, list[dict]]:
    """(ready seconds, rows of the http and handle paths) from one `serve run`."""
    import ray
    from ray import serve

    engine = engine_settings(args)

    def edit(config: dict) -> None:
        (app,) = config["applications"]
        app["args"]["engine"] = engine  # the engine defaults, not serve_config.yaml's CPU settings
        app["args"]["model_id"] = MODEL_ID
        app["args"].update(args.server)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as serve_run's `serve run`, which joins this instance
    context = ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            with serve_run(Path(tmp), edit, timeout_s=args.ready_timeout, address=context.address_info["address"]) as url:
                r = httpx.post(f"{url}/v1/completions", json=completion_body([5], 1), timeout=args.ready_timeout)
                r.raise_for_status()
                ready_s = time.monotonic() - start
                print(f"replica ready (a 1-token completion answered) {ready_s:.1f} s after `serve run`", flush=True)

                async def drive() -> None:
                    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
                    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
                        if "http" in args.paths:
                            rows.extend(await run_workloads(
                                "http", args, vocab_size, lambda p, m, st: http_request(client, p, m, st),
                                counters=metrics_counters(url)))
                    if "handle" in args.paths:
                        handle = serve.get_app_handle(APP)
                        rows.extend(await run_workloads(
                            "handle", args, vocab_size, lambda p, m, st: handle_request(handle, p, m, st),
                            counters=metrics_counters(url)))

                asyncio.run(drive())
    finally:
        ray.shutdown()
    return ready_s, rows


def engine_path(args: argparse.Namespace, vocab_size: int) -> list[dict]:
    """The same workloads through the engine alone, in this process (Serve is gone by now)."""
    from app import LLM, SamplingParams
    from app.engine.async_engine import AsyncLLMEngine

    llm = LLM(**engine_settings(args))
    llm.generate([[5]], SamplingParams(max_tokens=1))  # as the serving paths' ready probe: a first step

    def batch(prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            log_every_s=1e9)
        streams = []
        for out in outs:
            s = Stream()
            s.num_tokens = len(out.token_ids)
            streams.append(s)
        return streams

    # The throughput shapes through the offline API first, then the sessions through an async engine
    # over the same engine: once the async engine's thread steps it, offline generate must not.
    rows = asyncio.run(run_workloads("engine", args, vocab_size, None, send_batch=batch, kinds=("throughput",),
                                     counters=engine_counters(llm.engine)))

    async def sessions() -> list[dict]:
        engine = AsyncLLMEngine(engine=llm.engine)
        try:
            return await run_workloads("engine", args, vocab_size, lambda p, m, st: engine_request(engine, p, m),
                                       kinds=("sessions",), counters=engine_counters(llm.engine))
        finally:
            engine.shutdown()

    return rows + asyncio.run(sessions())  # the async engine's shutdown stops llm's engine too


def vocab_size(args: argparse.Namespace) -> int:
    """Ids the model's tokenizer knows (prompts are drawn below it)."""
    from app.config import EngineConfig
    from app.engine.model_source import load_model_config, resolve_tokenizer

    config = EngineConfig(**engine_settings(args))
    return resolve_tokenizer(config, load_model_config(config.model).vocab_size).vocab_size


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's output tok/s over the engine's on the same workload (None without an engine row)."""
    engine = {r["workload"]: r["output_tok_per_s"] for r in rows if r["path"] == "engine"}
    for r in rows:
        base = engine.get(r["workload"])
        r["vs_engine"] = r["output_tok_per_s"] / base if base else None
    return rows


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:,.1f}"


def to_markdown(rows: list[dict]) -> str:
    lines = ["| workload | path | answered | output tokens | wall s (range of runs) | output tok/s | vs engine "
             "| TTFT p50 / p99 ms | TTFT mean: client / ingress / engine ms | ITL p50 / p99 ms | kernel compiles (s), all runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "n/a" if r["vs_engine"] is None else f"{r['vs_engine']:.3f}x"
        compiles = "n/a" if r.get("kernel_compiles") is None else f"{r['kernel_compiles']} ({r['kernel_compile_s']:.1f})"
        means = ("" if r.get("engine_ttft_mean_s") is None and r.get("ingress_ttft_mean_s") is None else
                 f"{_ms(r['ttft_mean_s'])} / {_ms(r['ingress_ttft_mean_s'])} / {_ms(r['engine_ttft_mean_s'])}")
        runs = r["wall_s_runs"]
        wall = f"{r['wall_s']:.2f}" + (f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else "")
        lines.append(f"| {r['workload']} | {r['path']} | {r['answered']}/{r['requests']} | {r['output_tokens']:,} "
                     f"| {wall} | {r['output_tok_per_s']:,.1f} | {ratio} "
                     f"| {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} | {means} "
                     f"| {_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])} | {compiles} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from app.config import ServerConfig
    from app.deployments.llm_server import set_switch_interval

    # This process is the handle path's caller (Serve's router thread and the client's event loop share its
    # GIL) and the engine alone's host (the engine thread and the client's loop): the replicas' switch interval.
    switch_interval = ServerConfig.model_validate(args.server).gil_switch_interval_s
    set_switch_interval(switch_interval)
    vocab = vocab_size(args)
    ready_s, rows = None, []
    if {"http", "handle"} & set(args.paths):
        ready_s, rows = serving_paths(args, vocab)
    if "engine" in args.paths:
        rows += engine_path(args, vocab)
    order = {name: i for i, (name, _, _) in enumerate(workloads(args))}
    rows = with_ratios(sorted(rows, key=lambda r: (order[r["workload"]], PATHS.index(r["path"]))))
    command = "python bench/serve_vs_engine.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    ready = "n/a" if ready_s is None else f"{ready_s:.1f} s"
    print(f"\n`{command}`\n\n{time.strftime('%Y-%m-%d %H:%M')}, engine {engine_settings(args)}, application "
          f"{args.server}, GIL switch interval {switch_interval}; replica ready (from `serve run` to an "
          f"answered 1-token completion): {ready}\n")
    print(to_markdown(rows))
    result = {"command": command, "engine": engine_settings(args), "server": args.server,
              "gil_switch_interval_s": switch_interval, "ready_s": ready_s, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
