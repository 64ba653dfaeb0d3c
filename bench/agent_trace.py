"""The agent workload, the product's headline measurement: many multi-turn sessions at a fixed KV
budget, per KV format, the same seeded trace for each, in one run.

    # one H200, Llama-3.1-8B shapes (dummy weights), 16 GiB of KV (~130k tokens in bf16, ~445k in fp4):
    python3 bench/agent_trace.py --kv-dtypes bf16,fp8,fp4 --json $OUT/agent.json
    # CPU smoke (tiny model, small trace):
    python3 bench/agent_trace.py --model tiny-llama --device cpu --sessions 6 --turns 2,3 --system-len 64 \
        --append 16,48 --reply 4,8 --max-model-len 512 --kv-memory 2MiB --think 0 --arrival 0

The trace (seeded, so every format sees the same one): every session starts with one shared system
prompt (the tools text); each turn appends a tool result or user message of --append tokens (log-uniform)
and asks for a reply of --reply tokens (uniform, ignore_eos), --turns turns per session (uniform), while
the context stays within --max-model-len. Session i arrives at i x --arrival seconds; each turn is sent
--think seconds after the previous reply ended (the agent's tool time), with the whole context so far
(prompt + replies) as its prompt, as an agent framework sends it.

Reported per format: wall time, turns/s, output tok/s, TTFT per turn (p50/p90/p99: first token time -
the turn's send time), prompt tokens, prefix-cache hit tokens (the engine's num_cached_tokens per turn,
at admission) and recomputed tokens (prompt - hit: prefilled at admission; what a preempted turn prefills again
is not in it), hit rate, preemptions, peak running sessions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app import LLM, SamplingParams  # noqa: E402
from bench.engine_gpu import free, percentiles  # noqa: E402


def make_trace(args, vocab: int) -> dict:
    """The seeded trace: the system prompt, and per session its arrival time and turns."""
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    a_lo, a_hi = args.append
    sessions = []
    for i in range(args.sessions):
        turns, ctx = [], args.system_len
        for _ in range(rng.randint(*args.turns)):
            new = round(math.exp(rng.uniform(math.log(a_lo), math.log(a_hi))))
            reply = rng.randint(*args.reply)
            if ctx + new + reply > args.max_model_len:
                break
            turns.append((tok(new), reply))
            ctx += new + reply
        sessions.append({"arrival": i * args.arrival, "turns": turns})
    return {"system": tok(args.system_len), "sessions": sessions}


def run_trace(llm: LLM, trace: dict, think: float) -> dict:
    """Drive the engine through the trace in real time; return the measured row."""
    eng = llm.engine
    sched = eng.scheduler
    preempt0, hit0, prompt0 = sched.num_preemptions_total, sched.num_prefix_hit_tokens_total, \
        sched.num_prompt_tokens_total
    eng.peak_num_running = 0  # the warm-up's requests are not the trace's
    sessions = trace["sessions"]
    context = [list(trace["system"]) for _ in sessions]
    next_turn = [0] * len(sessions)
    t0 = time.perf_counter()
    due = [(s["arrival"], i) for i, s in enumerate(sessions) if s["turns"]]  # (send time, session)
    inflight: dict[str, dict] = {}
    turns_done, ttft, prompt_toks, hit_toks, out_toks = 0, [], 0, 0, 0
    while due or inflight:
        now = time.perf_counter() - t0
        ready = [d for d in due if d[0] <= now]
        for d in ready:
            due.remove(d)
            i = d[1]
            new, reply = sessions[i]["turns"][next_turn[i]]
            prompt = context[i] + new
            rid = f"s{i}t{next_turn[i]}"
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True))
            # the turn's TTFT counts from when it was due, not from when the loop got to it after a step
            inflight[rid] = {"session": i, "sent": d[0], "prompt": prompt, "first": None}
        if not inflight:
            time.sleep(max(0.0, min(d[0] for d in due) - now))
            continue
        for out in eng.step():
            st = inflight.get(out.request_id)
            if st is None:
                continue
            if st["first"] is None and out.delta_token_ids:
                st["first"] = time.perf_counter() - t0
            if not out.finished:
                continue
            if out.finish_reason != "length":
                raise RuntimeError(f"turn {out.request_id} ended with {out.finish_reason!r}")
            del inflight[out.request_id]
            i = st["session"]
            ttft.append(st["first"] - st["sent"])
            turns_done += 1
            prompt_toks += len(st["prompt"])
            hit_toks += out.num_cached_tokens
            out_toks += len(out.token_ids)
            context[i] = st["prompt"] + list(out.token_ids)
            next_turn[i] += 1
            if next_turn[i] < len(sessions[i]["turns"]):
                due.append((time.perf_counter() - t0 + think, i))
    wall = time.perf_counter() - t0
    assert sched.num_prompt_tokens_total - prompt0 == prompt_toks, "the engine counted other prompt tokens"
    assert sched.num_prefix_hit_tokens_total - hit0 == hit_toks, "the engine counted other prefix hits"
    return {"wall_s": round(wall, 2), "turns": turns_done, "turns_per_s": round(turns_done / wall, 3),
            "output_tok_s": round(out_toks / wall, 1), "output_tokens": out_toks, "ttft_ms": percentiles(ttft),
            "prompt_tokens": prompt_toks, "hit_tokens": hit_toks, "recomputed_tokens": prompt_toks - hit_toks,
            "hit_rate": round(hit_toks / prompt_toks, 4) if prompt_toks else None,
            "preemptions": sched.num_preemptions_total - preempt0, "peak_running": eng.stats()["peak_num_running"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-dtypes", default="bf16,fp8,fp4")
    ap.add_argument("--kv-memory", default="16GiB", help="the KV budget (kv_cache_memory), the same for every format")
    ap.add_argument("--sessions", type=int, default=128)
    ap.add_argument("--turns", type=pair, default=(8, 24), help="MIN,MAX turns per session")
    ap.add_argument("--system-len", type=int, default=2048, help="tokens of the shared system prompt + tools")
    ap.add_argument("--append", type=pair, default=(256, 4096), help="MIN,MAX new tokens a turn (log-uniform)")
    ap.add_argument("--reply", type=pair, default=(50, 400), help="MIN,MAX reply tokens a turn")
    ap.add_argument("--think", type=float, default=0.5, help="seconds between a reply and the next turn")
    ap.add_argument("--arrival", type=float, default=0.25, help="seconds between sessions' first turns")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows, trace = [], None
    for kv in [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]:
        llm = LLM(model=args.model, kv_cache_dtype=kv, device=args.device, kv_cache_memory=args.kv_memory,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        try:
            if trace is None:
                trace = make_trace(args, llm.engine.vocab_size)
                print(json.dumps({"sessions": len(trace["sessions"]),
                                  "turns": sum(len(s["turns"]) for s in trace["sessions"])}), flush=True)
            # warm-up (kernels compiled, graphs captured): a short request decoding beside a prompt longer
            # than the step's token budget (mixed steps), then an empty prefix cache
            long = min(args.max_num_batched_tokens + 64, args.max_model_len - 8)
            rng = random.Random(args.seed + 1)
            warm = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in (64, long)]
            llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            llm.engine.reset_prefix_cache()
            row = {"kv_cache_dtype": kv, "num_kv_blocks": llm.engine.num_kv_blocks,
                   "kv_tokens": llm.engine.num_kv_blocks * llm.engine.config.block_size,
                   **run_trace(llm, trace, args.think)}
        finally:
            llm.engine.shutdown()
            del llm
            free(args.device)  # the engine holds reference cycles: without a collection the next format's
            # engine is built beside this one's weights, pages and graphs (an OOM on one 80 GB card)
        if args.device.startswith("cuda"):
            row["cuda_allocated_after_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in rows if r["kv_cache_dtype"] == "bf16"), None)
    for r in rows:
        if base is not None:
            r["turns_per_s_vs_bf16"] = round(r["turns_per_s"] / base["turns_per_s"], 3)
            r["ttft_p99_vs_bf16"] = round(r["ttft_ms"]["p99"] / base["ttft_ms"]["p99"], 3)
    result = {"args": {k: v for k, v in vars(args).items()}, "rows": rows,
              "trace_turns": sum(len(s["turns"]) for s in trace["sessions"]),
              "trace_output_tokens": sum(r for s in trace["sessions"] for _, r in s["turns"])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("| KV | wall s | turns/s | vs bf16 | TTFT p50 / p99 ms | hit rate | recomputed tok | preemptions | "
          "peak running |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['wall_s']} | {r['turns_per_s']} | {r.get('turns_per_s_vs_bf16')} | "
              f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} | {r['hit_rate']} | {r['recomputed_tokens']} | "
              f"{r['preemptions']} | {r['peak_running']} |")
    return result


if __name__ == "__main__":
    main()
