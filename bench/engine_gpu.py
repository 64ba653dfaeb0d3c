"""Engine throughput on one GPU, side by side in one run: kv dtypes, rooflines, HF, capacity, step split.

    python3 bench/engine_gpu.py --json $OUT/engine_gpu.json        # everything (may pass 10 minutes), or:
    python3 bench/engine_gpu.py --sections throughput,hf --json $OUT/engine_gpu_thr.json
    python3 bench/engine_gpu.py --sections capacity,steps --json $OUT/engine_gpu_cap.json
    # other families' 8B-class shapes (dummy weights; app/engine/model_source.py DUMMY_MODELS):
    python3 bench/engine_gpu.py --model qwen3-8b --json $OUT/engine_gpu_qwen3.json    # or qwen2.5-7b, mistral-7b
    # CPU smoke (tiny sizes):
    python3 bench/engine_gpu.py --model tiny-llama --device cpu --shapes 4x64,8x32 --output-len 8 \
        --hf-shapes 4x64 --capacity-requests 8 --capacity-prompt-len 64 --capacity-output-len 8 \
        --capacity-kv-memory 1MiB --steps-shape 4x64 --kv-dtypes bf16,fp4 --json /tmp/e.json

Sections (--sections, run in this order):
1. throughput: per kv dtype (one LLM each, reused over --shapes = REQUESTSxPROMPT_LEN), after a
   warm-up run of each shape (8 requests, or one step's token budget and one more, so that a step mixes
   a prefill chunk with decodes): one max_tokens=N run whose engine steps are timed (no
   syncs added; each step ends with reading its tokens, so a step's wall time is its device time plus
   whatever host time is not overlapped). Steady decode tok/s = tokens of the decode-only steps /
   their time; prefill tok/s = prompt tokens / time of the other steps (prefill chunks, alone or
   mixed with early decodes); decode_tok_s_whole_run = (N-1)*requests / (wall - prefill steps);
   roofline decode tok/s = the same steps' tokens / their time at the copy rate, each step reading
   the weights (without the input embedding) and its sequences' K/V once (context_tokens *
   kv_bytes_per_token) at the copy bandwidth (a 2 GiB device-to-device copy, read + written, measured
   at start; null on CPU); decode_batch_mean: sequences per decode-only step (fewer than the requests
   where prefill ends after the first ones finish, or where the KV pool holds fewer); ratios vs bf16.
2. hf: transformers' model of the family (LlamaForCausalLM, Qwen3ForCausalLM, ...).generate (random
   weights, bf16; float32 on CPU), greedy,
   max_new_tokens=1 then N (min_new_tokens=N), next to our bf16 row of the same shape.
3. capacity: fixed KV budget, all requests submitted at once: peak running sequences, wall time,
   output tok/s, decode-phase tok/s (sum(out-1) / time of decode-only steps), TTFT/ITL percentiles.
4. steps: mean split of decode-only steps (schedule/prepare/forward/sample/output), CUDA graphs on/off, steps
   run serially (async scheduling off); with graphs off, device time per step by kernel (torch.profiler).
Each row prints as a JSON line when measured; --json is rewritten after
each section, so a run cut short keeps what it measured. A summary table prints at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app import LLM, SamplingParams  # noqa: E402
from app.config import EngineConfig  # noqa: E402
from app.engine.model_source import resolve_tokenizer  # noqa: E402
from app.engine.model_source import load_model_config  # noqa: E402
from app.engine.models.config import FAMILIES  # noqa: E402

SECTIONS = ("throughput", "hf", "capacity", "steps")
STEP_KEYS = ("schedule_s", "prepare_s", "forward_s", "sample_s", "output_s", "total_s")


# -- helpers --------------------------------------------------------------------------------------
def emit(results: dict, section: str, row: dict) -> dict:
    row = {"section": section, **row}
    results.setdefault(section, []).append(row)
    print(json.dumps(row), flush=True)
    return row


def save(args, results: dict) -> None:
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


def rnd(x, nd=1):
    return None if x is None else round(x, nd)


def ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


def parse_shapes(s: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in part.lower().split("x")) for part in s.split(",") if part.strip()]


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + n * 7919 + length)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def percentiles(xs: list[float]) -> dict:
    """p50/p90/p99 in ms (linear interpolation)."""
    xs, out = sorted(xs), {}
    for p in (50, 90, 99):
        k = (len(xs) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        out[f"p{p}"] = round((xs[lo] + (xs[hi] - xs[lo]) * (k - lo)) * 1e3, 3) if xs else None
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def make_llm(args, kv: str, enforce_eager: bool, **kw) -> LLM:
    return LLM(model=args.model, tokenizer=args.tokenizer, kv_cache_dtype=kv, device=args.device, dtype=args.dtype,
               max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=enforce_eager, **kw)


def step_seconds(steps: list[dict]) -> list[float]:
    """Wall time each step added: the gap between its end and the previous step's (with async
    scheduling a step's own [start, end] overlaps the next one's); the first step's own total."""
    return [st["total_s"] if i == 0 else st["end"] - steps[i - 1]["end"] for i, st in enumerate(steps)]


def timed_generate(llm: LLM, prompts, max_tokens: int, device: str):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    return time.perf_counter() - t0, outs


def copy_bandwidth(device: str, nbytes: int = 2 << 30, reps: int = 10) -> float | None:
    """Bytes read + written per second of a device-to-device copy (median of CUDA-event timings)."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):  # 3 warm-ups
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(), dst.copy_(src), b.record(), b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    free(device)
    return 2 * nbytes / sorted(times[3:])[reps // 2]


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes read per decode step: all but the input embedding (counted once as lm_head if tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared params once
    try:
        emb = model.get_parameter("model.embed_tokens.weight")
    except AttributeError:
        return total
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    tied = head is not None and head.data_ptr() == emb.data_ptr()
    return total if tied else total - emb.numel() * emb.element_size()


def step_records(engine) -> list[dict]:
    """The engine's per-step records since step_timings was set to a list; recording stops."""
    recs, engine.step_timings = engine.step_timings, None
    return recs


# -- sections -------------------------------------------------------------------------------------
def guarded(args, R: dict, section: str, ident: dict, fn, *a) -> None:
    """fn(*a); an exception (e.g. out of memory) becomes an error row and the run goes on."""
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        emit(R, section, {**ident, "error": repr(e)[:300]})
    free(args.device)
    save(args, R)


def throughput_one(args, R: dict, bw: float | None, kv: str, shapes: list[tuple[int, int]],
                   async_mode: str = "default") -> None:
    N = args.output_len
    extra = {} if async_mode == "default" else {"async_scheduling": async_mode == "on"}
    llm = make_llm(args, kv, args.enforce_eager, max_num_seqs=max(n for n, _ in shapes),
                   max_model_len=max(L for _, L in shapes) + N + 1, **extra)
    eng = llm.engine
    wb, kvpt, vocab = weight_bytes(eng.model), eng.kv_bytes_per_token, eng.vocab_size
    try:
        for n, L in shapes:
            prompts = make_prompts(n, L, vocab, seed=1)
            # warm-up at this shape (the prefill chunk sizes, the decode graph, a step mixing prefill
            # chunks with decodes), on at most 8 requests or one step's token budget and one more
            warm = max(8, eng.config.max_num_batched_tokens // L + 1)
            timed_generate(llm, prompts[:warm], 2, args.device)
            eng.step_timings = []  # per-step wall times, no syncs added
            tN, outs = timed_generate(llm, prompts, N, args.device)
            steps, eng.step_timings = eng.step_timings, None
            n_out = sum(len(o.token_ids) for o in outs)
            # steady decode: the steps where every request decodes (each ends with its token read);
            # prefill: the prompt tokens over the other steps (chunks, and chunks mixed with decodes)
            secs = step_seconds(steps)
            dec = [st for st in steps if st["decode_only"]]
            dec_s = sum(t for st, t in zip(steps, secs) if st["decode_only"])
            dec_tokens = sum(st["num_seqs"] for st in dec)
            decode = dec_tokens / dec_s if dec_s else None
            # the roofline of those same steps: each reads the weights and its sequences' K/V once
            dec_ctx = sum(st["context_tokens"] for st in dec)
            roof = dec_tokens * bw / (len(dec) * wb + dec_ctx * kvpt) if bw and dec else None
            pre_s = sum(t for st, t in zip(steps, secs) if not st["decode_only"])
            emit(R, "throughput", {
                "kv_cache_dtype": kv, "shape": f"{n}x{L}", "requests": n, "prompt_len": L, "output_len": N,
                "prefill_tok_s": rnd(n * L / pre_s) if pre_s else None, "decode_tok_s": rnd(decode),
                "roofline_decode_tok_s": rnd(roof),
                "frac_of_roofline": ratio(decode, roof),
                "decode_batch_mean": rnd(dec_tokens / len(dec) if dec else None),
                "decode_context_mean": rnd(dec_ctx / dec_tokens if dec else None),
                "decode_tok_s_whole_run": rnd((n_out - n) / max(tN - pre_s, 1e-9)),
                "decode_steps": len(dec), "graph_steps": sum(st["graph"] for st in dec),
                "decode_step_ms": rnd(1e3 * dec_s / len(dec) if dec else None, 3),
                "t_prefill_steps_s": rnd(pre_s, 3), "t_full_s": rnd(tN, 3),
                "weight_bytes": wb, "kv_bytes_per_token": kvpt,
                "kv_bytes_per_step": int(dec_ctx * kvpt / len(dec)) if dec else None,
                "enforce_eager": args.enforce_eager, "async_scheduling": eng.async_scheduling})
    finally:
        eng.shutdown()


def run_throughput(args, R: dict, bw: float | None) -> None:
    shapes = parse_shapes(args.shapes)
    modes = args.async_scheduling.split(",")
    for kv in args.kv_dtypes.split(","):
        for mode in modes:  # side by side, per KV format
            guarded(args, R, "throughput", {"kv_cache_dtype": kv, "async_mode": mode}, throughput_one, args, R, bw,
                    kv, shapes, mode)
    rows = R.get("throughput", [])
    if len(modes) > 1:  # each mode against the first, per format and shape
        first = {(r["kv_cache_dtype"], r["shape"]): r for r in rows
                 if "error" not in r and r.get("async_scheduling") == (modes[0] == "on")}
        for r in rows:
            b = first.get((r.get("kv_cache_dtype"), r.get("shape")))
            if b is not None and r is not b and "error" not in r:
                emit(R, "throughput_async", {"shape": r["shape"], "kv_cache_dtype": r["kv_cache_dtype"],
                                             "ratio": f"async {r['async_scheduling']} / {b['async_scheduling']}",
                                             "decode": ratio(r["decode_tok_s"], b["decode_tok_s"]),
                                             "whole_run": ratio(b["t_full_s"], r["t_full_s"])})
    base = {(r["shape"], r["async_scheduling"]): r for r in rows if r["kv_cache_dtype"] == "bf16" and "error" not in r}
    for r in rows:
        b = base.get((r.get("shape"), r.get("async_scheduling")))  # bf16 with the same scheduling
        if b is not None and r is not b and "error" not in r:
            r["decode_vs_bf16"] = ratio(r["decode_tok_s"], b["decode_tok_s"])
            r["prefill_vs_bf16"] = ratio(r["prefill_tok_s"], b["prefill_tok_s"])
            emit(R, "throughput_ratios", {"shape": r["shape"], "ratio": f"{r['kv_cache_dtype']}/bf16",
                                          "decode": r["decode_vs_bf16"], "prefill": r["prefill_vs_bf16"]})


def run_hf(args, R: dict) -> None:
    import transformers

    mc = load_model_config(args.model)
    vocab = resolve_tokenizer(EngineConfig(model=args.model, tokenizer=args.tokenizer), mc.vocab_size).vocab_size
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype, directly on the device
    try:
        with torch.device(args.device):
            hf_class = getattr(transformers, FAMILIES[mc.family].hf_architecture)  # the model's family
            model = hf_class(hf_class.config_class(**mc.to_hf()))
    finally:
        torch.set_default_dtype(prev)
    model.to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.02)
    N = args.output_len

    def gen(ids, n_new):
        mask = torch.ones_like(ids)
        sync(args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                                 min_new_tokens=n_new, pad_token_id=0)
        sync(args.device)
        return time.perf_counter() - t0, out.shape[1] - ids.shape[1]

    ours = {r.get("shape"): r for r in R.get("throughput", []) if r["kv_cache_dtype"] == "bf16"}
    for n, L in parse_shapes(args.hf_shapes):
        ids = torch.tensor(make_prompts(n, L, vocab, seed=1), device=args.device)
        gen(ids[:, :16], 4)  # warm-up
        t1, _ = gen(ids, 1)
        tN, got = gen(ids, N)
        decode = (got - 1) * n / max(tN - t1, 1e-9)
        o = ours.get(f"{n}x{L}", {})
        emit(R, "hf", {"engine": f"transformers {transformers.__version__}", "shape": f"{n}x{L}", "dtype": str(dtype),
                       "new_tokens": int(got), "prefill_tok_s": rnd(n * L / t1), "decode_tok_s": rnd(decode),
                       "ours_bf16_prefill_tok_s": o.get("prefill_tok_s"), "ours_bf16_decode_tok_s": o.get("decode_tok_s"),
                       "ours_vs_hf_prefill": ratio(o.get("prefill_tok_s"), n * L / t1),
                       "ours_vs_hf_decode": ratio(o.get("decode_tok_s"), decode)})


def capacity_one(args, R: dict, kv: str) -> None:
    P, O, n = args.capacity_prompt_len, args.capacity_output_len, args.capacity_requests
    llm = make_llm(args, kv, args.enforce_eager, kv_cache_memory=args.capacity_kv_memory,
                   max_num_seqs=args.capacity_max_num_seqs, max_model_len=P + O + 1)
    eng = llm.engine
    try:
        prompts = make_prompts(n, P, eng.vocab_size, seed=3)
        # Warm-up with 2 requests only: peak_num_running is a lifetime maximum.
        timed_generate(llm, make_prompts(2, 16, eng.vocab_size, seed=2), 4, args.device)
        eng.step_timings, eng.sync_step_timings = [], False
        wall, outs = timed_generate(llm, prompts, O, args.device)
        recs, peak = step_records(eng), eng.stats()["peak_num_running"]
    finally:
        eng.shutdown()
    n_out = sum(len(o.token_ids) for o in outs)
    dec = [r for r in recs if r["decode_only"]]
    dec_time = sum(t for r, t in zip(recs, step_seconds(recs)) if r["decode_only"])
    mets = [o.metrics for o in outs]  # every output here is final, so it carries its metrics
    ttft = [m.first_token_time - m.arrival_time for m in mets if m.first_token_time is not None]
    itl = [b - a for m in mets for a, b in zip(m.token_times, m.token_times[1:])]
    emit(R, "capacity", {
        "kv_cache_dtype": kv, "requests": n, "prompt_len": P, "output_len": O,
        "kv_cache_memory": args.capacity_kv_memory, "num_kv_blocks": eng.num_kv_blocks,
        "kv_bytes_per_token": eng.kv_bytes_per_token,
        "full_len_fit": eng.num_kv_blocks // -(-(P + O) // eng.config.block_size),  # requests at full length
        "peak_num_running": peak,
        "peak_step_seqs": max((r["num_seqs"] for r in recs), default=None),
        "wall_s": rnd(wall, 2), "output_tok_s": rnd(n_out / wall),
        "decode_phase_tok_s": rnd((n_out - n) / dec_time) if dec_time > 0 else None,
        "decode_steps": len(dec), "steps": len(recs), "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl)})


def run_capacity(args, R: dict) -> None:
    for kv in args.kv_dtypes.split(","):
        guarded(args, R, "capacity", {"kv_cache_dtype": kv}, capacity_one, args, R, kv)
    rows = {r["kv_cache_dtype"]: r for r in R.get("capacity", []) if "error" not in r}
    b = rows.get("bf16")
    for kv, r in rows.items():
        if b is not None and kv != "bf16":
            emit(R, "capacity_ratios", {"ratio": f"{kv}/bf16", **{k: ratio(r[k], b[k]) for k in (
                "peak_num_running", "full_len_fit", "output_tok_s", "decode_phase_tok_s", "wall_s")}})


def steps_one(args, R: dict, kv: str, eager: bool) -> None:
    (n, L), O = parse_shapes(args.steps_shape)[0], args.steps_output_len
    # serial steps: the split synchronizes between phases, and with async scheduling a step is scheduled before
    # the one before it ends, so its total would span both
    llm = make_llm(args, kv, eager, max_num_seqs=n, max_model_len=L + O + 1, async_scheduling=False)
    eng = llm.engine
    try:
        prompts = make_prompts(n, L, eng.vocab_size, seed=4)
        timed_generate(llm, make_prompts(n, 16, eng.vocab_size, seed=2), 4, args.device)  # warm-up at batch n
        eng.step_timings, eng.sync_step_timings = [], True
        wall, _ = timed_generate(llm, prompts, O, args.device)
        eng.sync_step_timings = False
        recs = step_records(eng)
        kernels = profile_decode(llm, prompts, O) if eager and args.device.startswith("cuda") else None
    finally:
        eng.shutdown()
    if kernels:
        emit(R, "decode_kernels", {"kv_cache_dtype": kv, "shape": f"{n}x{L}", "top": kernels})
    dec = [r for r in recs if r["decode_only"]]
    row = {"kv_cache_dtype": kv, "enforce_eager": eager, "shape": f"{n}x{L}",
           "output_len": O, "wall_s": rnd(wall, 3), "decode_steps": len(dec),
           "graph_frac": ratio(sum(r["graph"] for r in dec), len(dec)) if dec else None}
    for k in STEP_KEYS:
        row[k.replace("_s", "_ms")] = round(sum(r[k] for r in dec) / len(dec) * 1e3, 3) if dec else None
    emit(R, "steps", row)


def profile_decode(llm: LLM, prompts, max_tokens: int, num_steps: int = 3, top: int = 14) -> list:
    """Device time per eager decode step by kernel (torch.profiler), the largest first:
    [name, ms per step, launches per step]. Graph replays hide their kernels, so this runs eager."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    eng.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{i}", p, params)
    for _ in range(64):  # past the prefill: every running request decodes
        eng.step()
        if eng.scheduler.num_waiting == 0 and all(s.num_computed_tokens == s.num_tokens - 1
                                                   for s in eng.scheduler.running):
            break
    sync("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            eng.step()
        sync("cuda")
    eng.abort_request([f"prof-{i}" for i in range(len(prompts))])
    rows = [(e.key, e.self_device_time_total / 1e3 / num_steps, e.count / num_steps) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    if not rows:  # say so rather than print a total of 0
        return [["the profiler recorded no device time (CUPTI missing?)", 0, len(prof.events())]]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return [["TOTAL", round(total, 3), round(sum(r[2] for r in rows), 1)]] + \
        [[k[:90], round(ms, 3), round(c, 1)] for k, ms, c in rows[:top]]


def run_steps(args, R: dict) -> None:
    for kv in args.steps_kv_dtypes.split(","):
        for eager in (False, True):
            guarded(args, R, "steps", {"kv_cache_dtype": kv, "enforce_eager": eager}, steps_one, args, R, kv, eager)


# -- summary --------------------------------------------------------------------------------------
def table(title: str, rows: list[dict], cols: list[str]) -> None:
    if not rows:
        return
    print(f"\n### {title}\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")


def summary(R: dict) -> None:
    thr = R.get("throughput", [])
    table("throughput (decode tok/s vs roofline)", thr, ["shape", "kv_cache_dtype", "async_scheduling", "prefill_tok_s",
          "decode_tok_s", "roofline_decode_tok_s", "frac_of_roofline", "decode_batch_mean", "decode_context_mean",
          "decode_step_ms", "decode_vs_bf16",
          "prefill_vs_bf16", "t_full_s"])
    table("async scheduling against the first mode", R.get("throughput_async", []),
          ["shape", "kv_cache_dtype", "ratio", "decode", "whole_run"])
    table("ours bf16 vs HF transformers", R.get("hf", []), ["shape", "engine", "prefill_tok_s", "decode_tok_s",
          "ours_bf16_prefill_tok_s", "ours_bf16_decode_tok_s", "ours_vs_hf_prefill", "ours_vs_hf_decode", "error"])
    cap = [{**r, "ttft_p50/p99": r.get("ttft_ms") and f"{r['ttft_ms']['p50']}/{r['ttft_ms']['p99']}",
            "itl_p50/p99": r.get("itl_ms") and f"{r['itl_ms']['p50']}/{r['itl_ms']['p99']}"} for r in R.get("capacity", [])]
    table("capacity (fixed KV budget)", cap, ["kv_cache_dtype", "full_len_fit", "peak_num_running", "wall_s",
          "output_tok_s", "decode_phase_tok_s", "ttft_p50/p99", "itl_p50/p99", "error"])
    table("capacity ratios", R.get("capacity_ratios", []), ["ratio", "peak_num_running", "full_len_fit",
          "output_tok_s", "decode_phase_tok_s", "wall_s"])
    steps = {(r["kv_cache_dtype"], bool(r["enforce_eager"])): r for r in R.get("steps", []) if "error" not in r}
    rows = []
    for kv in dict.fromkeys(k for k, _ in steps):
        on, off = steps.get((kv, False), {}), steps.get((kv, True), {})
        for k in ("graph_frac", "decode_steps") + tuple(k.replace("_s", "_ms") for k in STEP_KEYS):
            rows.append({"kv_cache_dtype": kv, "per decode step": k, "graphs on": on.get(k), "graphs off": off.get(k),
                         "off/on": ratio(off.get(k), on.get(k)) if k.endswith("_ms") else None})
    table("decode step split, ms (graphs on: enforce_eager False; sync_step_timings)", rows,
          ["kv_cache_dtype", "per decode step", "graphs on", "graphs off", "off/on"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, help_ in [
        ("--sections", ",".join(SECTIONS), "comma-separated subset"), ("--model", "llama-3.1-8b", None),
        ("--tokenizer", None, None), ("--device", "cuda", None), ("--dtype", "auto", None),
        ("--kv-dtypes", "bf16,fp8,fp4", None), ("--shapes", "32x1024,64x2048,128x4096", "REQUESTSxPROMPT_LEN,..."),
        ("--output-len", 128, None), ("--max-num-batched-tokens", 8192, None), ("--hf-shapes", "32x1024", None),
        ("--capacity-kv-memory", "16GiB", None), ("--capacity-requests", 128, None),
        ("--capacity-prompt-len", 8192, None), ("--capacity-output-len", 1024, None),
        ("--capacity-max-num-seqs", 128, None), ("--steps-shape", "64x2048", None), ("--steps-output-len", 32, None),
        ("--steps-kv-dtypes", "bf16,fp4", None),
        ("--async-scheduling", "default", "throughput: on, off or default (the engine's: on for CUDA), or a list "
         "run side by side, e.g. off,on"),
        ("--json", None, "results file, rewritten after each section")]:
        ap.add_argument(flag, default=default, type=type(default) if default is not None else str, help=help_)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (throughput and capacity)")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")

    cuda = args.device.startswith("cuda")
    R: dict = {"meta": {
        "device": torch.cuda.get_device_name(args.device) if cuda
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__, "model": args.model, "args": vars(args)}}
    bw = copy_bandwidth(args.device)
    R["meta"]["copy_bw_gb_s"] = rnd(bw / 1e9 if bw else None)
    print(json.dumps({"section": "meta", **{k: v for k, v in R["meta"].items() if k != "args"}}), flush=True)
    save(args, R)
    runners = {"throughput": lambda: run_throughput(args, R, bw), "hf": lambda: run_hf(args, R),
               "capacity": lambda: run_capacity(args, R), "steps": lambda: run_steps(args, R)}
    for name in SECTIONS:
        if name in sections:
            t0 = time.perf_counter()
            if name == "hf":  # the other sections guard each LLM they build
                guarded(args, R, "hf", {}, runners[name])
            else:
                runners[name]()
            R["meta"][f"{name}_s"] = round(time.perf_counter() - t0, 1)
            save(args, R)
    summary(R)


if __name__ == "__main__":
    main()
