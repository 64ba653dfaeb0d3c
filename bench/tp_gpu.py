"""Tensor parallelism on the GPUs of one node, with the multiprocess executor (no Ray needed).

    python3 bench/tp_gpu.py --stories .whl/stories260K --json $OUT/tp.json     # on 2 GPUs
    python3 bench/tp_gpu.py --sections kill --device cpu --model tiny-llama       # CPU smoke (gloo)
    RAY_AUTH_MODE=disabled python bench/tp_gpu.py --sections throughput --device cpu --model tiny-llama \
        --shape 16x64 --output-len 64 --kv-dtypes bf16 --backends mp,ray            # mp vs ray executor, CPU

Sections (--sections, in this order):
1. equality: stories260K widened exactly into head_dim-128 shapes (app/engine/widen.py, written as a
   safetensors directory so that each rank loads its own shard), greedy tokens of TP=1 and TP=N, for
   bf16 and fp4 KV.
2. throughput: --model (dummy weights), --shape REQUESTSxPROMPT_LEN, --output-len tokens, TP=1 and
   TP=N (with each of --backends) one after the other in this run, per kv dtype: steady decode tok/s (decode-only steps'
   tokens / their wall time; each step ends with reading its tokens) and the ratio TP=N / TP=1.
3. allreduce: all-reduce of a [rows, hidden] bf16 tensor between N processes for rows 1, 8 and
   the shape's requests, by NCCL and by PyTorch symmetric memory's one-shot and two-shot kernels:
   median ms per call eager, and per call inside a CUDA graph of 64 calls (2 per layer at 32).
4. kill: a TP=N engine decoding; rank 1 is SIGKILLed; seconds until the engine's step raises
   EngineDeadError, then seconds until a new engine has generated.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app import LLM, SamplingParams  # noqa: E402
from app.engine.errors import EngineDeadError  # noqa: E402
from bench.engine_gpu import step_seconds  # noqa: E402

SECTIONS = ("equality", "throughput", "allreduce", "kill")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bear",
           "Tim had a red car. He", "The sun was hot and the", "Sue wanted to bake a cake", "Max was sad"]


def emit(R: dict, section: str, row: dict) -> None:
    R.setdefault(section, []).append(row)
    print(json.dumps({"section": section, **row}), flush=True)


def save(args, R: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(R, indent=1))


def widened_dir(stories: Path, out: Path) -> Path:
    """stories260K copied exactly into a head_dim-128 shape, saved as config.json + safetensors."""
    from safetensors.torch import save_file

    from app.engine.loader import load_model
    from app.engine.models.config import ModelConfig
    from app.engine.widen import copy_widened, widen_config

    small, small_config = load_model(str(stories / "stories260K.bin"))
    shape = ModelConfig(vocab_size=1, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    config = widen_config(small_config, shape)
    (out / "config.json").write_text(json.dumps(config.to_hf()))
    big, _ = load_model(str(out), load_format="dummy", dtype=torch.float32)
    copy_widened(small, big)
    save_file({n: p.detach().contiguous() for n, p in big.named_parameters()}, str(out / "model.safetensors"))
    return out


def run_equality(args, R: dict) -> None:
    stories = Path(args.stories)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = widened_dir(stories, Path(tmp))
        for kv in args.kv_dtypes.split(","):
            outs = {}
            for tp in (1, args.tp):
                llm = LLM(model=str(model), tokenizer=str(stories / "tok512.bin"), device=args.device,
                          dtype=args.dtype, kv_cache_dtype=kv, tensor_parallel_size=tp,
                          distributed_executor_backend="mp", kv_cache_memory=1 << 30, max_num_seqs=16)
                outs[tp] = llm.generate(PROMPTS, params)
                llm.engine.shutdown()
                del llm
            same = [a.token_ids == b.token_ids for a, b in zip(outs[1], outs[args.tp])]
            emit(R, "equality", {"kv_cache_dtype": kv, "dtype": args.dtype, "tp": args.tp, "prompts_equal": sum(same),
                                 "prompts": len(same), "text_tp1": outs[1][0].text, "text_tpN": outs[args.tp][0].text})
            save(args, R)


def decode_rate(llm: LLM, prompts, output_len: int) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    eng.reset_prefix_cache()
    eng.step_timings = []
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps, eng.step_timings = eng.step_timings, None
    dec = [s for s in steps if s["decode_only"]]
    dec_s = sum(g for s, g in zip(steps, step_seconds(steps)) if s["decode_only"])
    split = {f"{k[:-2]}_ms": round(1e3 * sum(s[k] for s in dec) / len(dec), 3)
             for k in ("prepare_s", "forward_s", "sample_s")}  # rank 0's, unsynced: sample_s waits for the device
    return {"decode_tok_s": round(sum(s["num_seqs"] for s in dec) / dec_s, 1), "decode_steps": len(dec),
            "graph_steps": sum(bool(s["graph"]) for s in dec), "decode_step_ms": round(1e3 * dec_s / len(dec), 3),
            **{f"rank0_{k}": v for k, v in split.items()}, "wall_s": round(wall, 2)}


def run_throughput(args, R: dict) -> None:
    import random

    n, length = (int(v) for v in args.shape.lower().split("x"))
    rng = random.Random(1)
    modes = {"default": None, "on": True, "off": False}
    runs = [(1, "mp", modes[m]) for m in args.async_scheduling.split(",")]
    runs += [(args.tp, b, modes[m]) for b in args.backends.split(",") for m in args.async_scheduling.split(",")
             if not (b == "ray" and m == "on")]
    for kv in args.kv_dtypes.split(","):
        rates = {}
        for tp, backend, mode in runs:
            try:
                llm = LLM(model=args.model, device=args.device, kv_cache_dtype=kv, tensor_parallel_size=tp,
                          distributed_executor_backend=backend, max_num_seqs=n, async_scheduling=mode,
                          max_model_len=length + args.output_len + 1, max_num_batched_tokens=8192)
                vocab = llm.engine.vocab_size
                prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]
                key = (tp, backend if tp > 1 else "in-process", llm.engine.async_scheduling)
                rates[key] = decode_rate(llm, prompts, args.output_len)
                llm.engine.shutdown()
                del llm
                torch.cuda.empty_cache() if args.device.startswith("cuda") else None
                emit(R, "throughput", {"model": args.model, "kv_cache_dtype": kv, "tp": tp, "executor": key[1],
                                       "async_scheduling": key[2], "shape": args.shape,
                                       "output_len": args.output_len, **rates[key]})
            except Exception as e:  # noqa: BLE001 - the row says what failed; the run goes on
                traceback.print_exc()
                emit(R, "throughput", {"kv_cache_dtype": kv, "tp": tp, "executor": backend, "error": repr(e)[:300]})
            save(args, R)
        for (tp, executor, asyn), rate in rates.items():
            base = rates.get((1, "in-process", asyn))  # TP=1 with the same scheduling
            if tp > 1 and base:
                emit(R, "throughput", {"kv_cache_dtype": kv, "executor": executor, "async_scheduling": asyn,
                                       f"tp{tp}_over_tp1": round(rate["decode_tok_s"] / base["decode_tok_s"], 3)})


def _median_ms(fn, reps: int) -> float:
    """Median CUDA-event time of fn() in ms."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(sorted(times)[len(times) // 2], 4)


def _allreduce_worker(rank: int, world: int, address: str, rows: int, hidden: int, q) -> None:
    """Per way of all-reducing a [rows, hidden] bf16 tensor: median ms per call, eager (CUDA events
    around each call) and inside a CUDA graph of 64 calls (a decode step's count at 32 layers)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=address, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    ways = {"nccl": lambda: dist.all_reduce(x)}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, group)
        ways["symm_mem one_shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x, "sum", group)
        ways["symm_mem two_shot"] = lambda: (buf.copy_(x), torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group))
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            q.put(("symm_mem", {"error": repr(e)[:300]}))
    for name, fn in ways.items():
        row = {}
        try:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            row["eager_ms"] = _median_ms(fn, 200)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(64):
                    fn()
            torch.cuda.synchronize()
            row["graph_ms"] = round(_median_ms(graph.replay, 30) / 64, 4)
        except Exception as e:  # noqa: BLE001 - the row says what failed
            row["error"] = repr(e)[:300]
        if rank == 0:
            q.put((name, row))
        dist.barrier()
    if rank == 0:
        q.put(None)
    dist.destroy_process_group()


def run_allreduce(args, R: dict) -> None:
    import multiprocessing as mp

    from app.engine.model_source import load_model_config
    from app.engine.tp_rank import free_port_address

    mc = load_model_config(args.model)
    ctx = mp.get_context("spawn")
    for rows in sorted({1, 8, int(args.shape.lower().split("x")[0])}):
        q = ctx.Queue()
        address = free_port_address("127.0.0.1")
        procs = [ctx.Process(target=_allreduce_worker, args=(r, args.tp, address, rows, mc.hidden_size, q))
                 for r in range(args.tp)]
        for p in procs:
            p.start()
        while (item := q.get(timeout=300)) is not None:
            name, row = item
            emit(R, "allreduce", {"tp": args.tp, "way": name, "shape": [rows, mc.hidden_size], "dtype": "bf16", **row,
                                  "allreduces_per_step": 2 * mc.num_hidden_layers})
        for p in procs:
            p.join(timeout=60)
        save(args, R)


def run_kill(args, R: dict) -> None:
    llm = LLM(model=args.model, device=args.device, tensor_parallel_size=args.tp, distributed_executor_backend="mp",
              max_model_len=4096, max_num_seqs=8)
    eng = llm.engine
    for i in range(8):
        eng.add_request(f"r{i}", list(range(3, 300)), SamplingParams(max_tokens=2000, ignore_eos=True))
    for _ in range(5):
        eng.step()
    pid = eng.worker_info()[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    error = None
    try:
        while eng.has_unfinished_requests():
            eng.step()
    except EngineDeadError as e:
        error = str(e)
    t_error = time.perf_counter() - t0
    eng.shutdown()
    del llm, eng
    t1 = time.perf_counter()
    again = LLM(model=args.model, device=args.device, tensor_parallel_size=args.tp, distributed_executor_backend="mp",
                max_model_len=4096, max_num_seqs=8)
    ok = len(again.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    t_restart = time.perf_counter() - t1
    again.engine.shutdown()
    emit(R, "kill", {"tp": args.tp, "model": args.model, "error_after_s": round(t_error, 2),
                     "error": (error or "")[:300], "next_engine_generated": ok, "next_engine_ready_and_generated_s": round(t_restart, 1)})
    save(args, R)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--stories", default=str(Path(__file__).resolve().parents[2] / "shared/models/stories260K"))
    ap.add_argument("--shape", default="64x2048", help="REQUESTSxPROMPT_LEN of the throughput section")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-dtypes", default="bf16,fp4", help="KV formats of the equality and throughput sections")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype of the equality section (float32: TP sums "
                    "partial products in another order, exact only without bf16 rounding between them)")
    ap.add_argument("--backends", default="mp", help="executors of the TP=N throughput runs: mp and/or ray "
                    "(ray needs Ray installed: not on the GPU machine)")
    ap.add_argument("--async-scheduling", default="default",
                    help="throughput: on, off or default (the engine's: on at TP=1 on CUDA, off with TP), or a "
                         "list run side by side, e.g. off,on (the ray executor runs off only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    cuda = args.device.startswith("cuda")
    R = {"meta": {"devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
                  else "cpu", "torch": torch.__version__, "args": vars(args), "date": time.strftime("%Y-%m-%d")}}
    print(json.dumps(R["meta"]), flush=True)
    runners = {"equality": run_equality, "throughput": run_throughput, "allreduce": run_allreduce, "kill": run_kill}
    for name in SECTIONS:
        if name in sections:
            t0 = time.perf_counter()
            try:
                runners[name](args, R)
            except Exception as e:  # noqa: BLE001 - the next section still runs
                traceback.print_exc()
                emit(R, name, {"error": repr(e)[:500]})
            R["meta"][f"{name}_s"] = round(time.perf_counter() - t0, 1)
            save(args, R)


if __name__ == "__main__":
    main()
