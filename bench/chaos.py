"""Chaos run: the main job under agent load while things break, and what every client saw.

Starts `serve run` of serve_config.yaml (LLMServer replicas set by --replicas, a free port, a
shorter request deadline), connects to its Ray, and for --duration seconds drives:

- agent sessions: multi-turn /v1/completions, each turn the previous prompt + answer + new text
  (streamed or not, alternately), a new session once the context is long; a turn that gets a
  503 or a mid-stream error is retried after Retry-After, as a client would;
- fuzzed request bodies from the API's own JSON schemas (bench/request_fuzz.py; a quarter of
  them chat bodies with tools, tool history and output constraints), plus bodies that are not
  JSON, not objects, or larger than max_request_body_bytes;
- clients that disconnect mid-stream (read two chunks, close the connection);

and at 1/4 of the run kills one LLMServer replica, at 1/2 the KV index actor (for good: the
KVIndex deployment replaces it, the replicas resync into the new one).

It counts every request by outcome (completed; clean OpenAI error, by status; 5xx other than 503;
hung past its deadline; broken: a non-JSON error body, a stream cut without an error event or
[DONE]), the LLMServer replicas that died other than the one killed, KV blocks still held once the
load has stopped and every replica is idle, and per 10 s window the cached-token fraction of the
sessions' turns and how many follow-up turns found their previous turn in the cache.

    python bench/chaos.py --replicas 3 --sessions 12 --duration 120 --json chaos.json
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_load import make_text  # noqa: E402
from bench.servers import serve_run  # noqa: E402

APP = "llm"
MODEL = "tiny-llama"
SESSION_HEADER = "x-session-id"


@dataclass
class Counts:
    sent: int = 0
    completed: int = 0
    clean_errors: collections.Counter = field(default_factory=collections.Counter)  # status -> n
    # 5xx other than 503 (overloaded / engine unavailable) and 504 (past request_timeout_s, which the
    # load is sized never to reach): (status, body), must be none
    server_errors: list = field(default_factory=list)
    hung: int = 0  # no answer within the deadline + margin: must be 0
    broken: list = field(default_factory=list)  # an error without an OpenAI error body, a cut stream
    disconnected: int = 0  # clients that left mid-stream on purpose
    error_samples: dict = field(default_factory=dict)  # clean error kind -> its first message

    def summary(self) -> dict:
        return {"sent": self.sent, "completed": self.completed, "clean_errors": dict(sorted(self.clean_errors.items(), key=lambda kv: str(kv[0]))),
                "server_errors": len(self.server_errors), "hung": self.hung, "broken": len(self.broken),
                "disconnected": self.disconnected, "error_samples": self.error_samples}


# the HTTP status an error event's code stands for (protocol.py's error classes)
_STREAM_ERROR_STATUS = {"overloaded": 503, "engine_unavailable": 503, "timeout": 504, "request_failed": 500}


def _is_openai_error(body: bytes | str) -> bool:
    try:
        err = json.loads(body)["error"]
        return isinstance(err, dict) and bool(err.get("message")) and "type" in err
    except (ValueError, KeyError, TypeError):
        return False


class Chaos:
    def __init__(self, url: str, args) -> None:
        self.url = url
        self.args = args
        self.counts: dict[str, Counts] = collections.defaultdict(Counts)  # by traffic kind
        self.turns: list[dict] = []  # (t, prompt_tokens, cached_tokens, follow_up, expected_cached)
        self.t0 = 0.0
        self.stop = False
        self.events: list[tuple[float, str]] = []
        self.killed_replica: str | None = None
        self.replica_back_after_s: float | None = None  # from the replica kill to its replacement's first stats
        self.index_killed_at = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- one request -----------------------------------------------------------------------------
    async def send(self, client: httpx.AsyncClient, kind: str, path: str, *, body=None, content=None,
                   stream=False, headers=None, disconnect_after: int | None = None,
                   started: asyncio.Event | None = None) -> dict | None:
        """POST and classify. Returns the usage (dict) of a completed request, else None."""
        c = self.counts[kind]
        c.sent += 1
        timeout = self.args.request_timeout + 30  # the server's deadline plus a margin
        try:
            return await asyncio.wait_for(self._send(client, c, path, body, content, stream, headers,
                                                     disconnect_after, started), timeout)
        except asyncio.TimeoutError:
            c.hung += 1
        except httpx.HTTPError as e:  # the connection broke: the server (or proxy) cut it
            c.broken.append(f"{type(e).__name__}: {e}")
        return None

    async def _send(self, client, c: Counts, path, body, content, stream, headers, disconnect_after, started):
        kwargs = {"content": content} if content is not None else {"json": body}
        if not stream:
            r = await client.post(path, headers=headers, **kwargs)
            return self._classify(c, r.status_code, r.content, lambda: r.json().get("usage"))
        async with client.stream("POST", path, headers=headers, **kwargs) as r:
            if r.status_code != 200:
                return self._classify(c, r.status_code, await r.aread(), None)
            usage, done, chunks, last, finish = None, False, 0, "", None
            async for line in r.aiter_lines():
                last = line or last
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an OpenAI error event mid-stream (then [DONE]): its code says which
                    err = chunk["error"]
                    status = _STREAM_ERROR_STATUS.get(err.get("code"), 500)
                    if status >= 500 and status not in (503, 504):
                        c.server_errors.append((f"stream:{status}", str(err.get("message"))[:300]))
                    else:
                        c.clean_errors[f"stream:{status}"] += 1
                        c.error_samples.setdefault(f"stream:{status}", str(err.get("message"))[:300])
                    return None
                usage = chunk.get("usage") or usage
                finish = next((ch.get("finish_reason") for ch in chunk.get("choices") or [] if ch.get("finish_reason")),
                              finish)
                chunks += 1
                if started is not None:
                    started.set()
                if disconnect_after is not None and chunks >= disconnect_after:
                    c.disconnected += 1
                    return None
            if not done or finish is None:
                c.broken.append(f"stream ended without [DONE] and a finish_reason, or an error event, after {chunks} "
                                f"chunks (last line {last[:120]!r})")
                return None
            c.completed += 1
            return usage or {}

    @staticmethod
    def _classify(c: Counts, status: int, content: bytes, usage):
        if status == 200:
            c.completed += 1
            return (usage() if usage else None) or {}
        if not _is_openai_error(content):
            c.broken.append(f"HTTP {status} without an OpenAI error body: {content[:200]!r}")
        elif status >= 500 and status not in (503, 504):
            c.server_errors.append((status, content[:300].decode(errors="replace")))
        else:
            c.clean_errors[status] += 1
            c.error_samples.setdefault(status, json.loads(content)["error"]["message"][:300])
        return None

    # -- traffic ---------------------------------------------------------------------------------
    async def session_loop(self, client, i: int) -> None:
        rng = random.Random(f"chaos-{i}")
        system = make_text(random.Random("chaos-system"), self.args.system_prompt_tokens, 1.0)
        generation = 0
        while not self.stop:
            sid = f"chaos-{i}-{generation}"
            prompt, prev_tokens = system, None
            while not self.stop and len(prompt) < self.args.max_context:
                prompt += f"\n\nUser: {make_text(rng, rng.randint(40, 160), 1.0)}\nAssistant:"
                body = {"model": MODEL, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                        "ignore_eos": True}
                usage = None
                while not self.stop and usage is None:  # retry this turn until it completes
                    stream = rng.random() < 0.5
                    if stream:
                        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                    else:
                        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
                    usage = await self.send(client, "sessions", "/v1/completions", body=body, stream=stream,
                                            headers={SESSION_HEADER: sid})
                    if usage is None:
                        await asyncio.sleep(1.0)
                if usage is None:
                    return
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                # The next turn extends this prompt (not the answer: the random model's bytes need not
                # round-trip through text), so a turn that found its replica has the previous prompt's
                # full blocks cached, less one block of slack.
                expected = ((prev_tokens or 0) // self.args.block_size - 1) * self.args.block_size
                self.turns.append({"t": self.now(), "prompt_tokens": usage.get("prompt_tokens", 0),
                                   "cached_tokens": cached, "follow_up": prev_tokens is not None,
                                   "expected": expected})
                prev_tokens = usage.get("prompt_tokens", 0)
            generation += 1

    async def fuzz_loop(self, client, bodies) -> None:
        rng = random.Random("chaos-fuzz")
        i = 0
        big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
        while not self.stop:
            r = rng.random()
            if r < 0.05:
                await self.send(client, "fuzz", "/v1/completions", content=big)
            elif r < 0.10 or not bodies:  # --fuzz-bodies 0: only these
                await self.send(client, "fuzz", rng.choice(["/v1/completions", "/v1/chat/completions"]),
                                content=rng.choice([b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": 1e999}']))
            else:
                path, body = bodies[i % len(bodies)]
                i += 1
                stream = isinstance(body, dict) and body.get("stream") is True
                await self.send(client, "fuzz", path, body=body, stream=stream)
            await asyncio.sleep(1.0 / self.args.fuzz_rps)

    async def disconnect_loop(self, client) -> None:
        rng = random.Random("chaos-disconnect")
        while not self.stop:
            body = {"model": MODEL, "prompt": make_text(rng, 200, 1.0), "max_tokens": 2000, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            await self.send(client, "disconnects", "/v1/completions", body=body, stream=True, disconnect_after=2)
            await asyncio.sleep(self.args.disconnect_every)

    # -- faults ----------------------------------------------------------------------------------
    async def faults(self, client) -> None:
        """At 1/4 of the run, with long streams running on every replica, kill one replica; at 1/2,
        the index actor; then time until the new index knows the blocks of every replica that survived."""
        import ray

        from app.router.index_actor import get_index

        d = self.args.duration
        await asyncio.sleep(d / 4)
        streams, started = [], []
        for i in range(2 * self.args.replicas):  # sessions spread by rendezvous: some on each replica
            started.append(asyncio.Event())
            body = {"model": MODEL, "prompt": f"Stream {i} while a replica dies. " * 4, "max_tokens": 800,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            streams.append(asyncio.create_task(self.send(client, "in flight at the replica kill", "/v1/completions",
                                                         body=body, stream=True, headers={SESSION_HEADER: f"kill-{i}"},
                                                         started=started[-1])))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#"))
        await asyncio.sleep(2.0)  # a routing-stats period or two: the index has every replica's load
        stats = await get_index(APP).replica_stats.remote()
        # the replica running the most requests (the most streams to cut)
        victim_id = max(stats, key=lambda r: stats[r]["num_running"])
        victim = next(n for n in names if n.endswith("#" + victim_id))
        self.killed_replica = victim_id
        survivors = {n.rsplit("#", 1)[1] for n in names} - {victim_id}
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = self.now()
        self.events.append((killed_at, f"killed replica {victim_id} (running {stats[victim_id]['num_running']} "
                                       "requests)"))
        back = asyncio.create_task(self._replacement_ready({n.rsplit("#", 1)[1] for n in names}, killed_at))
        await asyncio.sleep(max(0.0, d / 2 - self.now()))
        index = get_index(APP)
        old_epoch = await index.ping.remote()
        ray.kill(index, no_restart=True)
        self.index_killed_at = self.now()
        self.events.append((self.index_killed_at, "killed the KV index actor"))
        while self.now() - self.index_killed_at < 60:
            await asyncio.sleep(0.5)
            stats = await _ask_index("stats")
            # Every replica that survived the kill holds blocks and publishes them to the new index;
            # the killed one's replacement holds blocks only once a request has landed on it.
            if stats and stats["epoch"] != old_epoch and survivors <= set(stats["replicas"]):
                self.events.append((self.now(), f"new index holds blocks of {len(stats['replicas'])} replicas"))
                break
        await asyncio.gather(*streams, back)

    async def _replacement_ready(self, before: set[str], killed_at: float, timeout_s: float = 300) -> None:
        """Seconds from the kill until a replica not among `before` reports its stats to the index
        (it does so once its engine is up and its event loop runs): replica_back_after_s. Waited for
        past the end of the load, up to timeout_s."""
        while self.now() - killed_at < timeout_s:
            new = set(await _ask_index("replica_stats") or {}) - before
            if new:
                self.replica_back_after_s = self.now() - killed_at
                self.events.append((self.now(), f"replacement replica {min(new)} reports to the index"))
                return
            await asyncio.sleep(0.5)

    async def run(self, bodies) -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=httpx.Timeout(None)) as client:
            self.t0 = time.monotonic()
            tasks = [asyncio.create_task(self.session_loop(client, i)) for i in range(self.args.sessions)]
            tasks += [asyncio.create_task(self.fuzz_loop(client, bodies)),
                      asyncio.create_task(self.disconnect_loop(client))]
            faults = asyncio.create_task(self.faults(client))
            await asyncio.sleep(self.args.duration)
            self.stop = True
            await faults
            await asyncio.gather(*tasks)
            self.events.append((self.now(), "load stopped"))

    def windows(self, width: float = 10.0) -> list[dict]:
        """Turns by completion time in windows of `width` s, aligned on the index kill."""
        out = []
        end = max((t["t"] for t in self.turns), default=0.0)
        start = self.index_killed_at % width
        while start <= end:
            ts = [t for t in self.turns if start <= t["t"] < start + width]
            follow = [t for t in ts if t["follow_up"]]
            prompt = sum(t["prompt_tokens"] for t in ts)
            out.append({"from_s": start, "to_s": start + width, "turns": len(ts),
                        "cached_fraction": sum(t["cached_tokens"] for t in ts) / prompt if prompt else None,
                        "follow_up_hits": sum(t["cached_tokens"] >= t["expected"] for t in follow),
                        "follow_ups": len(follow)})
            start += width
        return out


async def _ask_index(method: str):
    """The application's index actor's answer to `method`, or None while it is down or being replaced."""
    from app.router.index_actor import get_index

    try:
        index = get_index(APP)
        return await asyncio.wait_for(getattr(index, method).remote(), 2) if index is not None else None
    except Exception:
        return None


def replica_actor_ids(ray) -> set[str]:
    return {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#")}


def chaos_config(args):
    """serve_config.yaml's changes for the run: replicas, KV memory, the tiny model, the deadline."""
    def edit(config: dict) -> None:
        (app,) = config["applications"]
        app["deployments"] = [{"name": "LLMServer", "num_replicas": args.replicas}]
        engine = app["args"]["engine"]
        engine["kv_cache_memory"] = args.kv_cache_memory
        # reliability, not the model, is under test: the tiny model (byte tokenizer: 1 char = 1 token)
        engine["model"] = app["args"]["model_id"] = MODEL
        engine.update(json.loads(args.engine_json))  # the served name stays MODEL
        if engine.get("device", "cpu") == "cpu":
            engine["cpu_threads"] = max(1, (os.cpu_count() or 1) // args.replicas)  # they share the cores
        app["args"]["request_timeout_s"] = args.request_timeout
    return edit


def replica_stats(ray) -> dict[str, dict]:
    from app.router.index_actor import get_index

    index = get_index(APP)
    return ray.get(index.replica_stats.remote(), timeout=10) if index is not None else {}


def wait_idle(ray, replicas: int, timeout_s: float = 120) -> dict[str, dict]:
    """Every replica's stats, fresh (reported after this call began) and idle; or the last seen."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    stats = {}
    while time.monotonic() < deadline:
        try:
            stats = replica_stats(ray)
        except Exception:
            stats = {}
        fresh = [s for s in stats.values() if s.get("reported_at", 0) > since + 1]
        if len(fresh) >= replicas and all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in fresh):
            return {s["replica_id"]: s for s in fresh}
        time.sleep(1)
    return stats


def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t_start = time.monotonic()
    draw = fuzz_drawer(args.fuzz_bodies)  # before serve run: a missing fuzzing library fails at once
    with serve_run(workdir, chaos_config(args)) as url:
        return _run(args, url, t_start, draw)


def fuzz_drawer(num_bodies: int):
    """draw(n, seed) -> fuzzed request bodies (bench/request_fuzz.py, which needs hypothesis and
    hypothesis-jsonschema, the test extra); with no bodies asked for, no import (a GPU machine with
    only the serving wheels runs --fuzz-bodies 0)."""
    if num_bodies <= 0:
        return lambda n, seed: []
    from bench.request_fuzz import draw

    return draw


def _run(args, url: str, t_start: float, draw) -> dict:
    try:
        import ray

        ray.init(address="auto", log_to_driver=False)
        deadline = time.monotonic() + 120
        while len(replica_stats(ray)) < args.replicas and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"serve run ready in {time.monotonic() - t_start:.0f} s, {args.replicas} replicas; "
              f"drawing {args.fuzz_bodies} fuzzed bodies", file=sys.stderr)
        bodies = draw(args.fuzz_bodies, seed=args.seed)
        replicas_before = replica_actor_ids(ray)
        seen = set(replicas_before)
        chaos = Chaos(url, args)

        async def main():
            async def watch():
                while not chaos.stop:
                    seen.update(replica_actor_ids(ray))
                    await asyncio.sleep(1.0)

            w = asyncio.create_task(watch())
            await chaos.run(bodies)
            await w

        asyncio.run(main())
        idle = wait_idle(ray, args.replicas)
        alive = replica_actor_ids(ray)
        dead = sorted(seen - alive - {chaos.killed_replica})
        leaked = {r: s["num_kv_blocks"] - s["num_free_kv_blocks"] for r, s in idle.items()}
        windows = chaos.windows()
        k = chaos.index_killed_at
        before = [w for w in windows if k - 20 <= w["from_s"] and w["to_s"] <= k + 1e-9]
        after = [w for w in windows if w["to_s"] > k]  # the first one holds the kill
        result = {
            "command": "python bench/chaos.py " + shlex.join(sys.argv[1:]) if __name__ == "__main__" else None,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "args": vars(args),
            "counts": {kind: c.summary() for kind, c in chaos.counts.items()},
            "server_errors": [e for c in chaos.counts.values() for e in c.server_errors][:20],
            "broken": [e for c in chaos.counts.values() for e in c.broken][:20],
            "events": chaos.events,
            "replicas_died_unasked": dead,
            "kv_blocks_leaked": leaked,
            "idle_replicas_checked": len(idle),
            "windows": windows,
            "cached_fraction_before_index_kill": _fraction(before),
            "cached_fraction_after_index_kill": [(w["from_s"] - k, w["cached_fraction"]) for w in after],
            "follow_up_hits_before": _hits(before),
            "follow_up_hits_after": [(w["from_s"] - k, w["follow_up_hits"], w["follow_ups"]) for w in after],
            "routing_recovered_after_s": _recovery(before, after, k),
            "replica_back_after_s": chaos.replica_back_after_s,
        }
        return result
    finally:
        try:
            import ray

            ray.shutdown()
        except Exception:
            pass


def _fraction(windows) -> float | None:
    turns = sum(w["turns"] for w in windows)
    if not turns:
        return None
    return sum((w["cached_fraction"] or 0) * w["turns"] for w in windows) / turns


def _recovery(before, after, killed_at: float) -> float | None:
    """Seconds from the index kill to the end of the first window after it whose follow-up hit
    rate is back to 90% of the rate before it (None: never, or no follow-ups to judge by)."""
    hits, total = _hits(before)
    if not total:
        return None
    for w in after:
        if w["follow_ups"] and w["follow_up_hits"] / w["follow_ups"] >= 0.9 * hits / total:
            return w["to_s"] - killed_at
    return None


def _hits(windows) -> tuple[int, int]:
    return sum(w["follow_up_hits"] for w in windows), sum(w["follow_ups"] for w in windows)


def to_markdown(r: dict) -> str:
    lines = ["| traffic | sent | completed | clean errors (status: n) | 5xx other than 503/504 | hung | broken | "
             "disconnected on purpose |", "|---|---|---|---|---|---|---|---|"]
    for kind, c in r["counts"].items():
        errs = ", ".join(f"{s}: {n}" for s, n in c["clean_errors"].items()) or "-"
        lines.append(f"| {kind} | {c['sent']} | {c['completed']} | {errs} | {c['server_errors']} | {c['hung']} | "
                     f"{c['broken']} | {c['disconnected']} |")
    lines.append("")
    lines.append("Events (s from the start of the load): " + "; ".join(f"{t:.1f}: {e}" for t, e in r["events"]) + ".")
    lines.append(f"The killed replica's replacement reported to the index {_fmt(r['replica_back_after_s'])} s after "
                 "the kill.")
    lines.append(f"Replica deaths not caused by the run: {len(r['replicas_died_unasked'])}; KV blocks held after "
                 f"the load, idle: {sum(r['kv_blocks_leaked'].values())} (over {r['idle_replicas_checked']} replicas).")
    hb, nb = r["follow_up_hits_before"]
    lines.append(f"Before the index kill (20 s): cached-token fraction {_fmt(r['cached_fraction_before_index_kill'])}, "
                 f"follow-up turns that hit their previous turn's blocks {hb}/{nb}.")
    lines.append(f"Routing quality back (follow-up hit rate >= 90% of before) "
                 f"{_fmt(r['routing_recovered_after_s'])} s after the index kill.")
    lines.append("After it, per 10 s window (seconds after the kill: fraction, hits/follow-ups): "
                 + "; ".join(f"{t:+.0f}: {_fmt(f)}, {h}/{n}" for (t, f), (_, h, n) in
                             zip(r["cached_fraction_after_index_kill"], r["follow_up_hits_after"])))
    return "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--system-prompt-tokens", type=int, default=512)
    p.add_argument("--max-context", type=int, default=3000, help="a session starts over beyond this many chars")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="as in serve_config.yaml")
    p.add_argument("--fuzz-bodies", type=int, default=200)
    p.add_argument("--fuzz-rps", type=float, default=4.0)
    p.add_argument("--disconnect-every", type=float, default=2.0, help="seconds between disconnecting clients")
    p.add_argument("--request-timeout", type=float, default=60.0, help="the app's request_timeout_s")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--engine-json", default="{}",
                   help="more engine settings (the served model name stays tiny-llama), e.g. on one GPU: "
                        "'{\"device\": \"cuda\", \"model\": \"llama-3.1-8b\", \"load_format\": \"dummy\", "
                        "\"gpu_fraction\": 0.45}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(f"`{result['command']}`, {result['date']}\n")
    print(to_markdown(result))
    return result


if __name__ == "__main__":
    main()
