"""Structured outputs: what a JSON schema costs a decode step, and what compiling one costs.

Decode: a batch of requests with a JSON schema (an agent's plan with tool calls: strings, enums,
integers, an array of objects) against the same batch unconstrained, greedy. Each engine step is
timed (LLMEngine.step_timings); the rate counts only decode-only steps whose batch is still
whole (every request running), as the time a step adds (the gap between its end and the previous
step's: with async scheduling a step's span overlaps the next one's), over the first steps that
both kinds ran whole. The two kinds of batch alternate over --rounds; each one's best round is
reported.

Compile: a typical tool-call schema, --compiles variants (a different description each, so no
cache hit), compiled against the model's tokenizer on the engine's compile threads: p50 and max;
then the same spec again (a cache hit), and the check the ingress runs (check_structured_outputs).

    python bench/grammar_cost.py --model tiny-llama
    python bench/grammar_cost.py --model smollm2-135m-instruct
    python bench/grammar_cost.py --model llama-3.1-8b --load-format dummy --device cuda --kv-cache-dtype bf16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from app import LLM, SamplingParams
from app.engine.structured_outputs import StructuredOutputs, check_structured_outputs

PLAN = {
    "type": "object",
    "properties": {
        "thought": {"type": "string", "maxLength": 160},
        "tool_calls": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": ["search", "calculator", "get_weather", "lookup"]},
                "arguments": {"type": "object", "properties": {
                    "query": {"type": "string", "maxLength": 60},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
                    "required": ["query", "limit"]}},
            "required": ["name", "arguments"]}},
        "final": {"type": "boolean"},
    },
    "required": ["thought", "tool_calls", "final"],
}


def tool_schema(i: int) -> dict:
    """A typical tool's parameters (OpenAI's get_weather example, with a few more), variant i."""
    return {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": f"City and country, e.g. Paris, France ({i})"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "include_hourly": {"type": "boolean"},
            "fields": {"type": "array", "items": {"type": "string", "enum": ["temp", "wind", "rain", "uv"]},
                       "maxItems": 4},
        },
        "required": ["location", "unit"],
        "additionalProperties": False,
    }


def decode_gaps(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list[float], float]:
    """(the time each decode-only step of the whole batch added, mean output tokens)."""
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.step_timings = []
    outs = llm.generate(prompts, params)
    timings, engine.step_timings = engine.step_timings, None
    gaps = [t["end"] - prev["end"] for prev, t in zip(timings, timings[1:])
            if t["decode_only"] and t["num_seqs"] == len(prompts)]
    if not gaps:
        raise SystemExit("no decode step ran the whole batch: raise --max-tokens or use a longer schema")
    return gaps, statistics.mean(len(o.token_ids) for o in outs)


def compile_times(llm: LLM, n: int) -> dict:
    compiler = llm.engine.structured.compiler
    compiler.compile(StructuredOutputs(json=json.dumps(tool_schema(-1)))).result()  # builds the tokenizer info
    cold = []
    for i in range(n):
        so = StructuredOutputs(json=json.dumps(tool_schema(i)))
        start = time.perf_counter()
        compiler.compile(so).result()
        cold.append(time.perf_counter() - start)
    hits, checks = [], []
    for _ in range(n):
        start = time.perf_counter()
        compiler.compile(so).result()
        hits.append(time.perf_counter() - start)
    for i in range(n):  # new specs each time: check_structured_outputs caches too
        so = StructuredOutputs(json=json.dumps(tool_schema(1000 + i)))
        start = time.perf_counter()
        check_structured_outputs(so)
        checks.append(time.perf_counter() - start)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"compile_p50_ms": ms(cold), "compile_max_ms": round(1e3 * max(cold), 3), "cache_hit_p50_ms": ms(hits),
            "check_p50_ms": ms(checks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="fp4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256, help="the unconstrained batch's length (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compiles", type=int, default=20)
    ap.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    asyn = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    llm = LLM(model=args.model, tokenizer=args.tokenizer, load_format=args.load_format, device=args.device,
              dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(args.batch, 8),
              async_scheduling=asyn)
    tok = llm.tokenizer
    if tok.chat_template and args.model not in ("tiny-llama", "llama-3.1-8b", "llama-3.1-70b"):
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Plan three tool calls for task {i}: find "
                                                                          "the weather, compute a sum, look up a word."}])
                   for i in range(args.batch)]
    else:
        prompts = [f"task {i}: plan three tool calls" for i in range(args.batch)]
    schema = StructuredOutputs(json=json.dumps(PLAN))
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=schema)
    llm.generate(prompts[:2], constrained)  # compile the schema and warm up both paths
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    runs = {"plain": [], "json": []}
    for _ in range(args.rounds):  # alternated, so that a load from elsewhere falls on both kinds
        for kind in ("plain", "json"):
            runs[kind].append(decode_gaps(llm, prompts, plain if kind == "plain" else constrained))
    # the same steps of both: the first k of the whole batch (the constrained batch shrinks once
    # its first request completes its schema; later steps also attend over longer contexts)
    k = min(len(gaps) for gaps, _ in runs["json"] + runs["plain"])
    best = {kind: max(args.batch * k / sum(gaps[:k]) for gaps, _ in r) for kind, r in runs.items()}
    result = {
        "model": args.model, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else
        platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "batch": args.batch,
        "async_scheduling": llm.engine.async_scheduling, "kv_cache_dtype": args.kv_cache_dtype,
        "plain_tok_s": round(best["plain"], 1), "json_tok_s": round(best["json"], 1),
        "json_over_plain": round(best["json"] / best["plain"], 3), "steps_counted": k,
        "json_mean_output_tokens": round(statistics.mean(m for _, m in runs["json"]), 1),
        **compile_times(llm, args.compiles),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
