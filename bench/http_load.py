r"""Load generator for the OpenAI HTTP endpoint: multi-turn agent sessions, or the product-brief load test.

Sessions (default): N concurrent sessions share one system prompt; each runs --turns requests in a
row, streamed (SSE, stream_options.include_usage), and each turn's prompt is the previous one plus
the previous answer plus new text, so later turns can be served from the prefix cache. Per request
it measures time to first token (TTFT), time per output token after the first (TPOT), latency,
prompt / completion / cached tokens (from the usage chunk) and errors; it reports percentiles,
throughput, the cached-token fraction, and requests per replica where a response header names one.

    python bench/http_load.py --url http://localhost:8000 --sessions 8 --turns 3 --session-header \
        --system-prompt-tokens 512 --new-tokens 64:128 --max-tokens 32 --chars-per-token 1   # tiny default

Load test (--load-test): --num-requests concurrent non-streaming /v1/completions with the product
brief's prompt, temperature 0, max_tokens 128; --distinct prepends the request number to each.

    python bench/http_load.py --load-test --num-requests 250 [--distinct]

Text sizes are given in tokens but made of words without a tokenizer: --chars-per-token converts
(about 5 for Llama-3's BPE on these words, 1 for the byte tokenizer of the tiny default model).
The report gives the real token counts from the server's usage.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

LOAD_TEST_PROMPT = ("Analyze this Kubernetes deployment YAML and suggest resource optimizations: "
                    + "metadata: name: pod-worker\n" * 200)
SESSION_HEADER = "x-session-id"
_WORDS = (
    "agent cluster node replica request token cache block prefix session model serve deploy scale "
    "queue batch memory latency throughput config service pod worker container image volume network "
    "route health metric alert log trace error retry timeout limit budget plan step tool call result "
    "file code test build review merge branch commit patch issue task goal state value check update "
    "read write list find search compare report summary table chart data input output format schema "
    "the a of to and in for on with by from as at is are was be this that it not or can will should"
).split()


@dataclass(slots=True)
class RequestResult:
    """One HTTP request. Times are seconds; `start` is time.perf_counter() when it was sent."""

    session: int
    turn: int
    start: float
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    replica: str | None = None
    text: str = ""
    prompt: str | None = None  # the completions prompt of a session turn (for an exact ideal; bench/router_compare.py)
    itl_s: list[float] = field(default_factory=list)  # streamed: gaps between successive token chunks

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(slots=True)
class SessionWorkload:
    sessions: int = 8
    turns: int = 3
    system_prompt_tokens: int = 1024
    new_tokens: tuple[int, int] = (64, 256)  # per turn, drawn uniformly from [lo, hi]
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    chars_per_token: float = 5.0
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    session_header: bool = False
    seed: int = 0


def make_text(rng: random.Random, num_tokens: int, chars_per_token: float) -> str:
    """Words from a fixed list, about num_tokens tokens long (num_tokens * chars_per_token chars)."""
    target = max(1, round(num_tokens * chars_per_token))
    words: list[str] = []
    length = 0
    while length < target:
        words.append(rng.choice(_WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)


def _chunk_text(chunk: dict) -> str | None:
    """The generated text of one stream chunk; None for chunks that carry no token (the chat role
    announcement, the usage-only chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        if delta.get("role") and not delta.get("content"):
            return None
        return delta.get("content") or ""
    return choice.get("text") or ""


def _error_message(body: bytes | str) -> str:
    try:
        err = json.loads(body)["error"]
        return f"{err.get('type')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return (body.decode(errors="replace") if isinstance(body, bytes) else body)[:300]


def _apply_usage(result: RequestResult, usage: dict) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


async def send_streaming(client: httpx.AsyncClient, path: str, payload: dict, result: RequestResult,
                         headers: dict[str, str] | None = None, replica_header: str | None = None
                         ) -> RequestResult:
    """POST a stream=True request and read its SSE chunks (`data: {...}` ... `data: [DONE]`)."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    num_token_chunks = 0
    usage = None
    last = 0.0
    try:
        async with client.stream("POST", path, json=payload, headers=headers) as response:
            result.status = response.status_code
            if replica_header:
                result.replica = response.headers.get(replica_header)
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_error_message(data)}"
                    break
                text = _chunk_text(chunk)
                if text is not None:
                    now = time.perf_counter() - result.start
                    if result.ttft_s is None:
                        result.ttft_s = now
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    num_token_chunks += 1
                    parts.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.latency_s = time.perf_counter() - result.start
    result.text = "".join(parts)
    if usage is not None:
        _apply_usage(result, usage)
    else:
        result.completion_tokens = num_token_chunks
    result.ok = result.error is None
    return result


async def send_once(client: httpx.AsyncClient, path: str, payload: dict, result: RequestResult,
                    headers: dict[str, str] | None = None, replica_header: str | None = None) -> RequestResult:
    """POST a non-streaming request; the latency is that of the whole response."""
    try:
        response = await client.post(path, json={**payload, "stream": False}, headers=headers)
        result.status = response.status_code
        if replica_header:
            result.replica = response.headers.get(replica_header)
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {_error_message(response.content)}"
        else:
            body = response.json()
            choice = body["choices"][0]
            result.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
            _apply_usage(result, body.get("usage") or {})
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.latency_s = time.perf_counter() - result.start
    result.ok = result.error is None
    return result


async def run_session(client: httpx.AsyncClient, model: str, w: SessionWorkload, session: int,
                      system_prompt: str, replica_header: str | None = None) -> list[RequestResult]:
    """One agent session: --turns streamed requests, each prompt extending the previous one."""
    rng = random.Random(f"{w.seed}-{session}")
    headers = {SESSION_HEADER: f"bench-{w.seed}-{session}"} if w.session_header else None
    messages = [{"role": "system", "content": system_prompt}]
    prompt = system_prompt
    results = []
    for turn in range(w.turns):
        user_text = make_text(rng, rng.randint(*w.new_tokens), w.chars_per_token)
        body = {"model": model, "max_tokens": w.max_tokens, "temperature": w.temperature}
        if w.ignore_eos:
            body["ignore_eos"] = True
        if w.endpoint == "chat":
            messages.append({"role": "user", "content": user_text})
            path, body["messages"] = "/v1/chat/completions", list(messages)
        else:
            prompt += f"\n\nUser: {user_text}\nAssistant:"
            path, body["prompt"] = "/v1/completions", prompt
        result = RequestResult(session=session, turn=turn, start=time.perf_counter(),
                               prompt=body.get("prompt"))
        await send_streaming(client, path, body, result, headers, replica_header)
        results.append(result)
        if not result.ok:
            break  # the conversation cannot go on without the answer
        if w.endpoint == "chat":
            messages.append({"role": "assistant", "content": result.text})
        else:
            prompt += result.text
    return results


async def run_sessions(client: httpx.AsyncClient, model: str, w: SessionWorkload,
                       replica_header: str | None = None) -> list[RequestResult]:
    system_prompt = make_text(random.Random(f"{w.seed}-system"), w.system_prompt_tokens, w.chars_per_token)
    per_session = await asyncio.gather(*(
        run_session(client, model, w, s, system_prompt, replica_header) for s in range(w.sessions)))
    return [r for results in per_session for r in results]


async def run_load_test(client: httpx.AsyncClient, model: str, num_requests: int, distinct: bool,
                        max_tokens: int = 128, replica_header: str | None = None) -> list[RequestResult]:
    """The product brief's load test: num_requests concurrent non-streaming /v1/completions."""
    async def one(i: int) -> RequestResult:
        prompt = f"Request {i}: {LOAD_TEST_PROMPT}" if distinct else LOAD_TEST_PROMPT
        body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}
        return await send_once(client, "/v1/completions", body,
                               RequestResult(session=i, turn=0, start=time.perf_counter()),
                               replica_header=replica_header)

    return list(await asyncio.gather(*(one(i) for i in range(num_requests))))


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    latencies = [r.latency_s for r in ok]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached_known = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in cached_known)
    output_tokens = sum(r.completion_tokens for r in ok)
    errors = collections.Counter(str(r.status) if r.status not in (None, 200) else (r.error or "")[:80]
                                 for r in results if not r.ok)
    replicas = collections.Counter(r.replica for r in results if r.replica)
    by_turn = {}
    for turn in sorted({r.turn for r in ok}):
        rs = [r for r in ok if r.turn == turn]
        p = sum(r.prompt_tokens or 0 for r in rs)
        by_turn[turn] = {
            "requests": len(rs),
            "mean_prompt_tokens": p / len(rs),
            "ttft_p50_s": percentile([r.ttft_s for r in rs if r.ttft_s is not None], 50),
            "cached_fraction": sum(r.cached_tokens or 0 for r in rs) / p if p else None,
        }
    return {
        "requests": len(results),
        "successes": len(ok),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(errors),
        "wall_s": wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "latency_mean_s": sum(latencies) / len(latencies) if latencies else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached if cached_known else None,
        "cached_fraction": cached / prompt_tokens if cached_known and prompt_tokens else None,
        "requests_per_replica": dict(replicas) or None,
        "by_turn": by_turn,
    }


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value * scale:,.{digits}f}"


def to_markdown(s: dict) -> str:
    rows = [
        ("successes / requests", f"{s['successes']} / {s['requests']}"),
        ("errors", f"{s['errors']}" + (f" {s['errors_by_kind']}" if s["errors"] else "")),
        ("wall time (s)", _fmt(s["wall_s"], digits=2)),
    ]
    if s["ttft_p50_s"] is not None:  # streamed requests only
        rows += [
            ("TTFT p50 / p99 (ms)", f"{_fmt(s['ttft_p50_s'], 1e3)} / {_fmt(s['ttft_p99_s'], 1e3)}"),
            ("TPOT p50 / p99 (ms)", f"{_fmt(s['tpot_p50_s'], 1e3)} / {_fmt(s['tpot_p99_s'], 1e3)}"),
        ]
    rows += [
        ("latency mean / p50 / p99 (s)", " / ".join(_fmt(s[k], digits=2) for k in
                                                    ("latency_mean_s", "latency_p50_s", "latency_p99_s"))),
        ("throughput (requests/s)", _fmt(s["requests_per_s"], digits=2)),
        ("throughput (output tokens/s)", _fmt(s["output_tokens_per_s"])),
        ("prompt tokens (cached)", f"{s['prompt_tokens']:,} ({_fmt(s['cached_tokens'], digits=0)})"),
        ("cached-token fraction", _fmt(s["cached_fraction"], 100) + (" %" if s["cached_fraction"] is not None
                                                                      else "")),
    ]
    if s["requests_per_replica"]:
        rows.append(("requests per replica", ", ".join(f"{k}: {v}" for k, v in
                                                       sorted(s["requests_per_replica"].items()))))
    lines = ["| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if len(s["by_turn"]) > 1:
        lines += ["", "| turn | requests | mean prompt tokens | TTFT p50 (ms) | cached fraction |",
                  "|---|---|---|---|---|"]
        for turn, t in s["by_turn"].items():
            lines.append(f"| {turn + 1} | {t['requests']} | {_fmt(t['mean_prompt_tokens'], digits=0)} | "
                         f"{_fmt(t['ttft_p50_s'], 1e3)} | {_fmt(t['cached_fraction'], 100)} % |")
    return "\n".join(lines)


def _token_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"--new-tokens must be N or LO:HI with 1 <= LO <= HI (got {text!r})")
    return lo_i, hi_i


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://localhost:8000", help="server root (a trailing /v1 is accepted)")
    ap.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="sessions' API")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent agent sessions")
    ap.add_argument("--turns", type=int, default=3, help="requests per session, one after the other")
    ap.add_argument("--system-prompt-tokens", type=int, default=1024, help="shared by every session")
    ap.add_argument("--new-tokens", type=_token_range, default=(64, 256),
                    help="new user text per turn, N or LO:HI tokens (uniform)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every answer is max-tokens long")
    ap.add_argument("--chars-per-token", type=float, default=5.0,
                    help="converts token sizes to text (about 5 for Llama-3 BPE, 1 for a byte tokenizer)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    ap.add_argument("--session-header", action="store_true", help=f"send {SESSION_HEADER}: one id per session")
    ap.add_argument("--replica-header", default="x-replica-id",
                    help="response header naming the replica that served a request (counted if present)")
    ap.add_argument("--load-test", action="store_true",
                    help="the product brief's load test instead of sessions (non-streaming /v1/completions)")
    ap.add_argument("--num-requests", type=int, default=250, help="--load-test: concurrent requests")
    ap.add_argument("--distinct", action="store_true", help="--load-test: prepend the request number")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--json", default=None, help="also write the summary and every request here")
    return ap.parse_args(argv)


async def first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    if response.status_code != 200:
        raise SystemExit(f"GET {response.url} answered HTTP {response.status_code} "
                         f"({_error_message(response.content)}); pass --model to skip it")
    return response.json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> tuple[str, list[RequestResult], float]:
    """(model, results, wall seconds) of the run args describe."""
    base_url = args.url.rstrip("/").removesuffix("/v1")
    concurrency = args.num_requests if args.load_test else args.sessions
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model or await first_model(client)
        start = time.perf_counter()
        if args.load_test:
            results = await run_load_test(client, model, args.num_requests, args.distinct, args.max_tokens,
                                          args.replica_header)
        else:
            workload = SessionWorkload(
                sessions=args.sessions, turns=args.turns, system_prompt_tokens=args.system_prompt_tokens,
                new_tokens=args.new_tokens, max_tokens=args.max_tokens, temperature=args.temperature,
                ignore_eos=args.ignore_eos, chars_per_token=args.chars_per_token, endpoint=args.endpoint,
                session_header=args.session_header, seed=args.seed)
            results = await run_sessions(client, model, workload, args.replica_header)
        return model, results, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, results, wall_s = asyncio.run(run(args))
    summary = summarize(results, wall_s)
    command = "python bench/http_load.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    mode = (f"load test, {args.num_requests} concurrent /v1/completions"
            + (", distinct prompts" if args.distinct else ", identical prompts") if args.load_test else
            f"{args.sessions} sessions x {args.turns} turns, /v1/{'chat/' if args.endpoint == 'chat' else ''}"
            "completions, streamed")
    print(f"`{command}`\n\n{time.strftime('%Y-%m-%d %H:%M')}, {args.url}, model {model}: {mode}\n")
    print(to_markdown(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "model": model, "args": vars(args), "summary": summary,
                       "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in results]}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
