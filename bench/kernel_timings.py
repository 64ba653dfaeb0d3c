"""Kernel checks and timings on one GPU (issue 4), in one run.

    python3 bench/kernel_timings.py --tune --json $OUT/kernels.json

1. ceilings: device-to-device copy bandwidth (bytes read + written), measured here;
2. checks at small sizes on realistic data: store_kv bits against the torch path, decode and
   prefill against float32 attention over the dequantized pages, the inline-PTX fp4 unpack
   against plain Triton;
3. decode: fp4, fp8 and fp8-key/fp4-value pages vs torch SDPA bf16 on contiguous K/V (enable_gqa, fastest backend) vs our bf16
   paged kernel, Llama-3.1-8B per GPU (32 q heads, 8 KV heads) and 70B at TP=8 (8 q heads, 1 KV
   head), head_dim 128, contexts 1k-64k, batch 1-128; effective bandwidth = KV bytes / time; fp4
   runs the default (the Gluon kernel on this cache) and, on the same pages, the Triton fp4 kernel
   (kernel "fp4") and the generic kernel (kernel "generic"), side by side; fp8 runs the default (the Gluon
   fp8 kernel, its build by launch size), each build (0, 1, 2 tiles of loads ahead), the rule with twice the
   splits, the Triton fp8 kernel and the generic kernel; fp8-fp4 the rule's kernel (the Gluon fp8 kernel's
   fp4-value build) and the generic kernel;
4. store_kv cost per token; 5. prefill TFLOP/s per format (fp8 and fp4 as the engine runs them: dequantized
   into a dense scratch, then the bf16 kernel; and the former in-kernel fp4 path) against SDPA bf16; 6. the engine smoke:
   greedy tokens with the kernels vs the torch path, Llama-3.1-8B shapes carrying a trained model
   (stories260K widened exactly, app/engine/widen.py; --stories names its directory).
Timings are triton.testing.do_bench medians (ms) of a CUDA graph holding one call; host launch
cost is timed apart. Pages are shuffled over the cache; timed pages hold random bytes of valid
encodings (never zeros). --tune adds decode variants at 8k/32k x batch 1/8/32; --lean leaves out the
comparisons of builds and older paths (each fp8 build, twice the splits, the generic kernel, fp4 loads into
registers: about half a decode row's time), keeping the rules' kernels, the Triton fp4/fp8 kernels and the
fp8-fp4 generic kernel. Each section's
results are written to --json as it ends, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config import FP4Config  # noqa: E402
from app.kernels import decode_fp4_gluon, decode_fp8_gluon, fp4, fp8, paged  # noqa: E402
from app.kernels.attention_ref import decode_attention_ref, prefill_attention_ref  # noqa: E402
from app.kernels.decode_attention import DecodeOptions, decode_attention, num_splits_for, split_plan  # noqa: E402
from app.kernels.prefill_attention import prefill_attention  # noqa: E402
from app.kernels.dequantize_blocks import dequantize_blocks  # noqa: E402
from app.engine.prefill_plan import plan_prefill  # noqa: E402
from app.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402

DEV = torch.device("cuda")
FORMATS = FP4Config().formats()
KG8 = FP4Config(key_group_size=8, key_outliers=0).formats()[0]  # the key-groups-of-8 option's key format
HEAD_DIM = 128
BLOCK = 16
MODELS = {"8B": (32, 8), "70B-TP8": (8, 1)}  # (q heads, KV heads) per GPU
FP4_BYTES = sum(f.bytes_per_vector(HEAD_DIM) for f in FORMATS)  # K + V per token and KV head: 150
BF16_BYTES = 2 * 2 * HEAD_DIM  # 512
FP8_BYTES = 2 * (HEAD_DIM + 4)  # K + V: E4M3 values and a float32 scale each: 264
FP8_FP4_BYTES = HEAD_DIM + 4 + FORMATS[1].bytes_per_vector(HEAD_DIM)  # fp8 K, fp4 V (kv_cache_dtype fp8-fp4): 201
GLUON_TILE = decode_fp4_gluon.W * decode_fp4_gluon.TW  # tokens per program and tile, as the launcher splits


def bench(fn, reps: int = 100) -> float:
    """Median ms of fn's device work: fn is captured in a CUDA graph and the graph replayed, so
    host launch overhead (timed separately, launch_overhead) stays out of kernel times."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = do_bench(graph.replay, warmup=25, rep=reps, return_mode="median")
    del graph
    return ms


def host_us(fn, calls: int = 200) -> float:
    """Wall microseconds per call of fn issued back to back (host launch path included)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def best_times(runs: dict, rounds: int) -> dict:
    """Each callable's best bench() time (ms) over `rounds` rounds, the callables alternated within a round so
    that the machine's drift reaches them alike."""
    best = {n: float("inf") for n in runs}
    for _ in range(rounds):
        for n, fn in runs.items():
            best[n] = min(best[n], bench(fn))
    return best


def add_case_args(ap: argparse.ArgumentParser, rounds: int) -> None:
    """The options of the decode benchmarks that time cases side by side: which cases, how many rounds,
    where to write."""
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--json", default=None)


def save_row(results: dict, row: dict, path: str | None) -> None:
    """A finished row: into results, printed as JSON, results rewritten to `path` (if given)."""
    torch.cuda.empty_cache()
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def run_info(**extra) -> dict:
    """The header of a benchmark's results: the GPU, its SM count, torch, Triton, the date (+ extra)."""
    props = torch.cuda.get_device_properties(DEV)
    return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), **extra}


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.randint(0, 255, (4 << 30,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * (4 << 30) / ms * 1e3


# -- caches --------------------------------------------------------------------------------------
def shuffled_tables(batch: int, ctx: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    per = math.ceil(ctx / BLOCK)
    num_blocks = batch * per
    perm = torch.randperm(num_blocks, generator=gen).to(DEV)
    return perm.view(batch, per).to(torch.int32), num_blocks


def random_fp4_pages(num_blocks: int, heads: int, fmt: fp4.FP4Format) -> fp4.FP4Tensor:
    """Valid random encodings: any code byte, scales 0.5..8, second-level exponents near 2^0."""
    shape = (num_blocks, BLOCK, heads)
    g = fmt.group(HEAD_DIM)
    return fp4.FP4Tensor(
        codes=torch.randint(0, 256, (*shape, HEAD_DIM // 2), dtype=torch.uint8, device=DEV),
        scales=torch.randint(0x30, 0x58, (*shape, HEAD_DIM // g), dtype=torch.uint8,
                             device=DEV).view(torch.float8_e4m3fn),
        scale_exp=torch.randint(120, 128, shape, dtype=torch.uint8, device=DEV),
        out_vals=torch.randn(*shape, fmt.outliers, device=DEV).bfloat16(),
        out_idx=torch.randint(0, HEAD_DIM, (*shape, fmt.outliers), dtype=torch.uint8, device=DEV),
    )


def realistic(batch: int, ctx: int, heads: int, gen_seed: int):
    """Keys with a few massive channels and Gaussian values, contiguous [batch, ctx, heads, D]."""
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    k = torch.randn(batch, ctx, heads, HEAD_DIM, device=DEV, generator=g)
    k[..., :3] *= 12.0
    v = torch.randn(batch, ctx, heads, HEAD_DIM, device=DEV, generator=g)
    return k, v


# -- checks --------------------------------------------------------------------------------------
def checks(results: dict) -> None:
    torch.manual_seed(0)
    out = {}
    # store_kv: bits against the torch path (CUDA), fp32 and bf16 inputs
    for kind, fmts in (("fp4", FORMATS), ("fp8", (None, None)), ("bf16", (None, None))):
        for dtype in (torch.float32, torch.bfloat16):
            t, h = 4096, 8
            k, v = (x.reshape(t, h, HEAD_DIM).to(dtype) for x in realistic(1, t, h, 1))
            slots = torch.randperm(300 * BLOCK, device=DEV)[:t]
            pages = []
            for fn in (store_kv, store_kv_ref):
                z = torch.zeros(300, BLOCK, h, HEAD_DIM, device=DEV)
                kp, vp = paged.quantize_pages(z, kind, fmts[0]), paged.quantize_pages(z, kind, fmts[1])
                fn(k, v, slots, kp, vp, fmts)
                pages.append((kp, vp))
            diff = 0
            total = 0
            for a_pages, b_pages in zip(*pages):
                arrays = zip([a_pages] if kind == "bf16" else a_pages, [b_pages] if kind == "bf16" else b_pages)
                for a, b in arrays:
                    if a.numel():
                        a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                        diff += (a8 != b8).sum().item()
                        total += a8.numel()
            out[f"store_{kind}_{str(dtype)[6:]}_bytes_differing"] = f"{diff} / {total}"
    # decode and prefill against float32 attention on the dequantized pages; PTX vs plain Triton
    for (hq, hk), name in ((MODELS["8B"], "8B"), (MODELS["70B-TP8"], "70B-TP8")):
        lens = [1, 17, 1000, 4097, 9000]
        gen = torch.Generator().manual_seed(1)
        table, nb = shuffled_tables(len(lens), max(lens), gen)
        for kind, fmts in (("fp4", FORMATS), ("fp8", (None, None)), ("bf16", (None, None))):
            x = [torch.randn(nb, BLOCK, hk, HEAD_DIM, device=DEV) for _ in range(2)]
            x[0][..., :3] *= 12.0
            kp, vp = paged.quantize_pages(x[0], kind, fmts[0]), paged.quantize_pages(x[1], kind, fmts[1])
            q = torch.randn(len(lens), hq, HEAD_DIM, device=DEV).bfloat16()
            sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
            ref = decode_attention_ref(q, kp, vp, table, sl, HEAD_DIM ** -0.5, fmts)
            variants = {"auto": {}, "one_split": {"num_splits": 1}, "precise": {"precise_pv": True}}
            if kind == "fp4":
                variants.update({"plain_triton": {"asm": False}, "generic_kernel": {"kernel": "generic"},
                                 "triton_fp4_kernel": {"kernel": "fp4"},
                                 "triton_fp4_regs_uncapped": {"kernel": "fp4", "maxnreg": 0},
                                 "gluon_regs96": {"maxnreg": 96},
                                 "gluon_many_splits": {"num_splits": 37}})
            for vname, kw in variants.items():
                o = torch.full_like(q, float("nan"))
                decode_attention(q, kp, vp, table, sl, HEAD_DIM ** -0.5, max(lens), fmts, out=o,
                                 options=DecodeOptions(**kw))
                out[f"decode_{name}_{kind}_{vname}_rel_err"] = ((o.float() - ref).norm() / ref.norm()).item()
            chunks = [(0, 300), (4000, 97), (8999, 1), (700, 300), (0, 1)]
            qsl = torch.tensor([0] + [c for _, c in chunks], device=DEV).cumsum(0).to(torch.int32)
            plens = torch.tensor([a + b for a, b in chunks], dtype=torch.int32, device=DEV)
            qp = torch.randn(int(qsl[-1]), hq, HEAD_DIM, device=DEV).bfloat16()
            ref = prefill_attention_ref(qp, kp, vp, table, plens, qsl, HEAD_DIM ** -0.5, fmts)
            o = torch.full_like(qp, float("nan"))
            prefill_attention(qp, kp, vp, table, plens, qsl, HEAD_DIM ** -0.5, fmts, out=o)
            out[f"prefill_{name}_{kind}_rel_err"] = ((o.float() - ref).norm() / ref.norm()).item()
    results["checks"] = out
    for key, val in out.items():
        print(f"check {key}: {val}")


# -- decode --------------------------------------------------------------------------------------
def sdpa_decode(q4, k, v):
    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def best_sdpa(q4, k, v) -> tuple[float, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = (float("inf"), "none")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                sdpa_decode(q4, k, v)
                ms = bench(lambda: sdpa_decode(q4, k, v))
        except RuntimeError:
            continue
        best = min(best, (ms, backend.name))
    return best


def decode_cases(contexts, batches):
    """The decode timing cases (every model x context x batch that fits the GPU), each as (row
    holding SDPA's time, query, shuffled block table, sequence lengths, scale, number of blocks)."""
    gen = torch.Generator().manual_seed(0)
    for model, (hq, hk) in MODELS.items():
        for ctx in contexts:
            for batch in batches:
                kv_bytes = batch * ctx * hk * BF16_BYTES  # bf16 K+V, each of SDPA's and ours
                if 2 * kv_bytes + batch * ctx * hk * FP4_BYTES > 100e9:
                    continue
                table, nb = shuffled_tables(batch, ctx, gen)
                sl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
                q = torch.randn(batch, hq, HEAD_DIM, device=DEV).bfloat16()
                row = {"model": model, "ctx": ctx, "batch": batch}
                # SDPA on contiguous [batch, heads, ctx, D]
                k = torch.randn(batch, hk, ctx, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(q[:, :, None], k, v)
                del k, v
                yield row, q, table, sl, HEAD_DIM ** -0.5, nb


def note_gluon_resources(results: dict, launch) -> None:
    """Record a Gluon launch's compiled registers per thread and shared memory per program in results."""
    c = launch.constexprs
    regs, shared = launch.resources()
    slots, stages, fp16 = f"key slots {c['K_KO']}", f"stages {c['STAGES']}", f"fp16 {c['F16']}"
    results["gluon_registers"][f"group {c['GROUP']} {slots} maxnreg {c.get('maxnreg')} {stages} {fp16}"] = regs
    results["gluon_shared_bytes"][f"group {c['GROUP']} {slots} {stages} {fp16}"] = shared


def decode_section(results: dict, copy_bw: float, contexts, batches, tune: bool, save=lambda: None,
                   lean: bool = False) -> None:
    rows = results["decode"] = []
    results["gluon_registers"], results["gluon_shared_bytes"] = {}, {}
    for row, q, table, sl, scale, nb in decode_cases(contexts, batches):
        model, ctx, batch, hk = row["model"], row["ctx"], row["batch"], MODELS[row["model"]][1]
        kv_bytes = batch * ctx * hk * BF16_BYTES  # bf16 K+V, each of SDPA's and ours
        # our bf16 paged kernel
        kp = torch.randn(nb, BLOCK, hk, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        row["bf16_paged_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx))
        if tune and ctx in (8192, 32768) and batch in (1, 32):
            row["bf16_paged_precise_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx,
                                                                          options=DecodeOptions(precise_pv=True)))
            row["bf16_paged_bn128_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx,
                                                                        options=DecodeOptions(block_n=128)))
        # fp8 pages: the rule's kernel (the Gluon one, its build by launch size), each of its builds (0, 1, 2 tiles of
        # loads ahead) and the rule's with twice the splits, the Triton fp8 kernel and the generic kernel on the same
        # pages (the paths before them)
        k8, v8 = fp8.fp8_quantize(kp), fp8.fp8_quantize(vp)
        del kp, vp
        row["fp8_ms"] = bench(lambda: decode_attention(q, k8, v8, table, sl, scale, ctx))
        const = decode_fp8_gluon.constexprs(q, k8, v8)
        splits = num_splits_for(batch, hk, ctx, DEV, GLUON_TILE,
                                decode_fp8_gluon.programs_per_sm(q, k8, v8, table, sl, const), fp4_rule=True)
        row["fp8_num_splits"] = splits
        row["fp8_rule_ahead"] = decode_fp8_gluon.prefetch_for(batch * hk * split_plan(ctx, splits, GLUON_TILE)[1],
                                                              torch.cuda.get_device_properties(DEV).multi_processor_count)
        row["fp8_triton_ms"] = bench(lambda: decode_attention(q, k8, v8, table, sl, scale, ctx,
                                                              options=DecodeOptions(kernel="fp8")))
        if not lean:
            for ahead in (0, 1, 2):
                row[f"fp8_ahead{ahead}_ms"] = bench(lambda: decode_attention(
                    q, k8, v8, table, sl, scale, ctx, options=DecodeOptions(kernel="gluon", prefetch=ahead)))
            row["fp8_2x_splits_ms"] = bench(lambda: decode_attention(q, k8, v8, table, sl, scale, ctx,
                                                                     options=DecodeOptions(num_splits=2 * splits)))
            row["fp8_generic_ms"] = bench(lambda: decode_attention(q, k8, v8, table, sl, scale, ctx,
                                                                   options=DecodeOptions(kernel="generic")))
        del v8
        # fp4; fp8 keys with fp4 values (kv_cache_dtype fp8-fp4) by the rule (the Gluon fp8 kernel's fp4-value build
        # while decode_attention.FP8_FP4_GLUON), and the generic kernel on the same pages
        kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
        row["fp8_fp4_ms"] = bench(lambda: decode_attention(q, k8, vp, table, sl, scale, ctx, (None, FORMATS[1])))
        row["fp8_fp4_generic_ms"] = bench(lambda: decode_attention(q, k8, vp, table, sl, scale, ctx, (None, FORMATS[1]),
                                                                   options=DecodeOptions(kernel="generic")))
        del k8
        row["fp4_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS))
        if not lean:  # the Gluon kernel with loads into registers instead of its cp.async ring (the default, fp4_ms)
            row["fp4_regload_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS,
                                                                   options=DecodeOptions(num_stages=0)))
        pps = decode_fp4_gluon.Launch(q, kp, vp, table, sl, 1.0, FORMATS[0].outliers).programs_per_sm()
        for stages in (None, 0):  # the ring (fp4_ms) and loads into registers (fp4_regload_ms)
            note_gluon_resources(results, decode_fp4_gluon.Launch(q, kp, vp, table, sl, 1.0, FORMATS[0].outliers,
                                                                  stages=stages))
        row["fp4_gluon_programs_per_sm"] = pps
        row["fp4_num_splits"] = num_splits_for(batch, hk, ctx, DEV, GLUON_TILE, pps, fp4_rule=True)
        # the Triton fp4 kernel (the default before decode_fp4_gluon) on the same pages
        row["fp4_triton_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS,
                                                              options=DecodeOptions(kernel="fp4")))
        if not lean:  # the generic kernel on the same pages (the fp4 path before _decode_fp4_kernel)
            row["fp4_generic_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS,
                                                                   options=DecodeOptions(kernel="generic")))
        if model == "8B" and ctx == 1024 and batch == 1:
            results["launch_overhead_us"] = {
                "decode_fp4_host_us_per_call": host_us(
                    lambda: decode_attention(q, kp, vp, table, sl, scale, ctx, FORMATS)),
                "decode_fp4_graph_us": 1e3 * row["fp4_ms"]}
        if tune and ctx in (8192, 32768) and batch in (1, 8, 32):
            variants = dict(TUNE_VARIANTS)
            for pps in (2, 3, 4, 5, 6, 8):  # the Gluon kernel's split rule for other program counts per SM
                variants[f"gluon_splits_{pps}_per_sm"] = {"num_splits": num_splits_for(
                    batch, hk, ctx, DEV, GLUON_TILE, programs_per_sm=pps, fp4_rule=True)}

            for name, kw in variants.items():
                row[f"fp4_{name}_ms"] = bench(lambda: decode_attention(q, kp, vp, table, sl, scale, ctx,
                                                                       FORMATS, options=DecodeOptions(**kw)))
                if name.startswith("gluon_"):
                    note_gluon_resources(results, decode_fp4_gluon.Launch(
                        q, kp, vp, table, sl, 1.0, FORMATS[0].outliers, kw.get("maxnreg"), kw.get("num_stages")))
            # what the 4 key outlier slots cost: keys in the values' format (no slots)
            kp0 = random_fp4_pages(nb, hk, FORMATS[1])
            row["fp4_no_key_outliers_ms"] = bench(lambda: decode_attention(q, kp0, vp, table, sl, scale, ctx,
                                                                           (FORMATS[1], FORMATS[1])))
            note_gluon_resources(results, decode_fp4_gluon.Launch(q, kp0, vp, table, sl, 1.0, 0))
            del kp0
        del kp, vp
        torch.cuda.empty_cache()
        ratio = lambda a, b: row[a] / row[b] if a in row and b in row else None  # noqa: E731 (lean rows lack some)
        row["fp4_speedup_vs_sdpa"] = row["sdpa_ms"] / row["fp4_ms"]
        row["fp4_speedup_vs_generic"] = ratio("fp4_generic_ms", "fp4_ms")
        row["fp4_speedup_vs_triton"] = row["fp4_triton_ms"] / row["fp4_ms"]
        row["fp4_speedup_vs_regload"] = ratio("fp4_regload_ms", "fp4_ms")
        row["bf16_paged_vs_sdpa"] = row["bf16_paged_ms"] / row["sdpa_ms"]
        row["fp8_speedup_vs_bf16_paged"] = row["bf16_paged_ms"] / row["fp8_ms"]
        row["fp8_speedup_vs_generic"] = ratio("fp8_generic_ms", "fp8_ms")
        row["fp8_eff_bw_pct_copy"] = 100 * batch * ctx * hk * FP8_BYTES / (row["fp8_ms"] * 1e-3) / copy_bw
        row["fp8_speedup_vs_sdpa"] = row["sdpa_ms"] / row["fp8_ms"]
        row["fp8_speedup_vs_triton"] = row["fp8_triton_ms"] / row["fp8_ms"]
        for build in ("triton", "ahead0", "ahead1", "ahead2", "2x_splits"):
            row[f"fp8_{build}_speedup_vs_sdpa"] = ratio("sdpa_ms", f"fp8_{build}_ms")
        row["fp8_fp4_speedup_vs_sdpa"] = row["sdpa_ms"] / row["fp8_fp4_ms"]
        row["fp8_fp4_generic_speedup_vs_sdpa"] = row["sdpa_ms"] / row["fp8_fp4_generic_ms"]
        row["fp8_fp4_eff_bw_pct_copy"] = 100 * batch * ctx * hk * FP8_FP4_BYTES / (row["fp8_fp4_ms"] * 1e-3) / copy_bw
        row["fp4_eff_bw_pct_copy"] = 100 * batch * ctx * hk * FP4_BYTES / (row["fp4_ms"] * 1e-3) / copy_bw
        row["sdpa_eff_bw_pct_copy"] = 100 * kv_bytes / (row["sdpa_ms"] * 1e-3) / copy_bw
        row["bf16_paged_eff_bw_pct_copy"] = 100 * kv_bytes / (row["bf16_paged_ms"] * 1e-3) / copy_bw
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()  # a run cut short keeps the rows it measured
    print("gluon registers:", results["gluon_registers"], "shared:", results["gluon_shared_bytes"], flush=True)


def _smoke_shapes() -> dict:
    import dataclasses

    from app.engine.model_source import DUMMY_MODELS

    eight_b = DUMMY_MODELS["llama-3.1-8b"]
    return {"8B": eight_b, "8B-kv4": dataclasses.replace(eight_b, num_key_value_heads=4)}


SMOKE_SHAPES = _smoke_shapes()

TUNE_VARIANTS = {  # the fp4 default: the Gluon kernel, 16-token warp tiles; the rest: the Triton fp4 kernel
    "gluon_stages8": {"num_stages": 8},
    "gluon_regs96": {"maxnreg": 96},
    "gluon_regs112": {"maxnreg": 112},
    "triton_regs_uncapped": {"kernel": "fp4", "maxnreg": 0},
    "triton_stages2": {"kernel": "fp4", "num_stages": 2},
    "triton_precise": {"precise_pv": True},
}


# -- store ---------------------------------------------------------------------------------------
def store_section(results: dict) -> None:
    rows = []
    hk = MODELS["8B"][1]
    for tokens in (32, 128, 2048, 8192):
        k = torch.randn(tokens, hk, HEAD_DIM, device=DEV).bfloat16()
        v = torch.randn_like(k)
        slots = torch.randperm(1024 * BLOCK, device=DEV)[:tokens]
        row = {"tokens": tokens}
        for kind, fmts in (("fp4", FORMATS), ("fp8", (None, None)), ("bf16", (None, None))):
            z = torch.zeros(1024, BLOCK, hk, HEAD_DIM, device=DEV)
            kp, vp = paged.quantize_pages(z, kind, fmts[0]), paged.quantize_pages(z, kind, fmts[1])
            row[f"{kind}_us"] = 1e3 * bench(lambda: store_kv(k, v, slots, kp, vp, fmts, check_finite=False))
            row[f"{kind}_ns_per_token"] = 1e6 * row[f"{kind}_us"] / 1e3 / tokens
            row[f"{kind}_host_us"] = host_us(lambda: store_kv(k, v, slots, kp, vp, fmts, check_finite=False))
            if kind != "bf16":  # the NaN/Inf check syncs with the host: no graph, wall time per call
                row[f"{kind}_checked_host_us"] = host_us(lambda: store_kv(k, v, slots, kp, vp, fmts))
        rows.append(row)
        print(json.dumps(row), flush=True)
    results["store"] = rows


# -- prefill -------------------------------------------------------------------------------------
PREFILL_CASES = {  # (batch, new tokens, cached context): whole prompts, then agent-turn chunks
    "8B": ((4, 4096, 0), (2, 2048, 16384), (1, 512, 8192), (1, 2048, 8192), (1, 512, 32768), (1, 2048, 32768),
           (4, 1024, 16384)),
    "70B-TP8": ((4, 4096, 0), (2, 2048, 16384)),
}


def two_pass(q, pages, formats, table, sl, qsl, plan, scratch):
    """The engine's prefill over quantized pages (KVCache._attend_kernels): the sequences' blocks
    dequantized into a dense scratch, the prefill kernel over the scratch."""
    (kp, vp), (sk, sv), g = pages, scratch, plan.groups[0]
    dequantize_blocks(kp, formats[0], table, g.prog_seq, g.prog_blk, g.seq_off, sk)
    dequantize_blocks(vp, formats[1], table, g.prog_seq, g.prog_blk, g.seq_off, sv)
    return prefill_attention(q, sk, sv, g.tables, sl, qsl, HEAD_DIM ** -0.5, skip_decodes=True)


def prefill_section(results: dict) -> None:
    """Prefill attention TFLOP/s per format: bf16 pages, fp8 and fp4 through the engine's two passes
    (the sequences' blocks dequantized into a dense scratch, timed with the attention), fp4 with the dequantization inside the attention kernel (the former path, its
    former 64 x 64 tiles), and SDPA on contiguous K/V for whole prompts."""
    rows = []
    gen = torch.Generator().manual_seed(2)
    for model, (hq, hk) in MODELS.items():
        for batch, new, ctx in PREFILL_CASES[model]:
            total = ctx + new
            table, nb = shuffled_tables(batch, total, gen)
            sl = torch.full((batch,), total, dtype=torch.int32, device=DEV)
            qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * new
            q = torch.randn(batch * new, hq, HEAD_DIM, device=DEV).bfloat16()
            plan = plan_prefill([total] * batch, qsl.tolist(), BLOCK, True, 1 << 30, DEV)
            scratch = torch.empty(2, plan.groups[0].num_blocks, BLOCK, hk, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
            # causal FLOPs: each new token attends to ctx + its position + 1 keys; 4 FLOPs per key and dim
            flops = 4 * batch * hq * HEAD_DIM * (new * ctx + new * (new + 1) / 2)
            row = {"model": model, "batch": batch, "new_tokens": new, "ctx": ctx}
            kp = torch.randn(nb, BLOCK, hk, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
            vp = torch.randn_like(kp)
            row["bf16_ms"] = bench(lambda: prefill_attention(q, kp, vp, table, sl, qsl, HEAD_DIM ** -0.5))
            fp8_pages = paged.quantize_pages(kp, "fp8"), paged.quantize_pages(vp, "fp8")
            del kp, vp
            row["fp8_ms"] = bench(lambda: two_pass(q, fp8_pages, (None, None), table, sl, qsl, plan, scratch))
            del fp8_pages
            kp, vp = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
            row["fp4_ms"] = bench(lambda: two_pass(q, (kp, vp), FORMATS, table, sl, qsl, plan, scratch))
            row["fp4_in_kernel_ms"] = bench(lambda: prefill_attention(q, kp, vp, table, sl, qsl, HEAD_DIM ** -0.5,
                                                                      FORMATS, block_m=64, block_n=64))
            del kp, vp, scratch
            if ctx == 0:  # SDPA's is_causal aligns the mask top-left, right only when q and k have one length
                qs = torch.randn(batch, hq, new, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
                ks = torch.randn(batch, hk, total, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
                vs = torch.randn_like(ks)
                row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                              enable_gqa=True))
                del qs, ks, vs
            for key in ("bf16", "fp8", "fp4", "fp4_in_kernel", "sdpa"):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
            row["fp8_vs_bf16"], row["fp4_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"], row["bf16_ms"] / row["fp4_ms"]
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    results["prefill"] = rows


# -- end to end ----------------------------------------------------------------------------------
def smoke_section(results: dict, stories_dir: str, max_tokens: int = 64, device: str = "cuda",
                  shapes: tuple[str, ...] = ("8B", "8B-kv4")) -> None:
    """The engine at Llama-3.1-8B shapes (hidden 4096, 32 layers, 32 query and 8 KV heads of 128)
    carrying stories260K's trained weights, copied exactly into those shapes (app/engine/widen.py;
    vocabulary 512); "8B-kv4" the same with 4 KV heads (8 query heads per KV head, the MMA's whole
    N, as for 70B at TP 8). Random 8B weights are useless here: their greedy
    tokens are chaotic, the torch path does not even agree with itself across batch shapes. Greedy
    tokens, for fp4 and bf16 KV: the kernels (store + attention), the kernels' attention over the
    torch path's pages, and the torch path, on the same engine; and the small model itself in
    float32 on the CPU."""
    import tempfile
    from pathlib import Path

    from app import LLM, SamplingParams
    from app.engine.loader import load_model
    from app.engine.widen import copy_widened, widen_config

    stories = Path(stories_dir)
    small, small_config = load_model(str(stories / "stories260K.bin"))
    tokenizer = str(stories / "tok512.bin")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bear",
               "Tim had a red car. He", "The sun was hot and the", "Sue wanted to bake a cake", "Max was sad"]
    reference = LLM(model=str(stories / "stories260K.bin"), tokenizer=tokenizer, device="cpu")
    ref_outputs = reference.generate(prompts, params)
    ref = [o.token_ids for o in ref_outputs]
    del reference
    results["smoke"] = {"model": "stories260K widened", "prompts": prompts, "max_tokens": max_tokens,
                        "small_fp32_text": [o.text for o in ref_outputs]}

    def equal_prefix(a, b):
        return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]

    for shape in shapes:
        config = widen_config(small_config, SMOKE_SHAPES[shape])
        for kv in ("fp4", "bf16"):
            with tempfile.TemporaryDirectory() as model_dir:
                (Path(model_dir) / "config.json").write_text(json.dumps(config.to_hf()))
                llm = LLM(model=model_dir, load_format="dummy", tokenizer=tokenizer, kv_cache_dtype=kv,
                          device=device, dtype="bfloat16", kv_cache_memory=1 << 30, enable_prefix_caching=False)
            copy_widened(small, llm.engine.model)
            cache = llm.engine.kv_cache
            out, texts = {}, {}
            # "attention": the torch path stores (so both read the same pages), the kernels attend
            def torch_store(*args, **kwargs):
                cache.use_kernels = False
                try:
                    type(cache).store(cache, *args, **kwargs)
                finally:
                    cache.use_kernels = True

            for path, use in (("kernels", True), ("torch", False), ("attention", True)):
                cache.use_kernels = use
                if path == "attention":
                    cache.store = torch_store
                t = time.time()
                outputs = llm.generate(prompts, params)
                out[f"{path}_s"] = time.time() - t
                out[path], texts[path] = [o.token_ids for o in outputs], [o.text for o in outputs]
            del cache.store
            cache.use_kernels = True
            results["smoke"].setdefault(shape, {})[kv] = {
                "kernels_vs_torch_equal_prefix": equal_prefix(out["kernels"], out["torch"]),
                "attention_only_vs_torch_equal_prefix": equal_prefix(out["attention"], out["torch"]),
                "kernels_vs_small_fp32_equal_prefix": equal_prefix(out["kernels"], ref),
                "torch_vs_small_fp32_equal_prefix": equal_prefix(out["torch"], ref),
                "kernels_s": out["kernels_s"], "torch_s": out["torch_s"], "kernels_text": texts["kernels"]}
            print("smoke", shape, kv, json.dumps(results["smoke"][shape][kv]), flush=True)
            del llm, cache
            if device != "cpu":
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--contexts", default="1024,8192,32768,65536")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--tune", action="store_true",
                    help="also time decode variants (split rules, register caps, Triton kernel options)")
    ap.add_argument("--lean", action="store_true",
                    help="decode: only the rules' kernels, the split merge as a second kernel, and the Triton fp4/fp8 "
                         "kernels (not each fp8 build, twice the splits, the generic kernel, fp4 loads into registers)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: checks,decode,store,prefill,smoke")
    ap.add_argument("--stories", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models",
                                                      "stories260K"),
                    help="directory of stories260K.bin and tok512.bin, for the smoke")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) - {""}
    t0 = time.time()
    results = run_info()
    results["copy_bw_GBps"] = copy_bandwidth() / 1e9
    print(json.dumps(results), flush=True)

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    sections = {
        "checks": lambda: checks(results),
        "decode": lambda: decode_section(results, results["copy_bw_GBps"] * 1e9,
                                         [int(c) for c in args.contexts.split(",")],
                                         [int(b) for b in args.batches.split(",")], args.tune, save, args.lean),
        "store": lambda: store_section(results),
        "prefill": lambda: prefill_section(results),
        "smoke": lambda: smoke_section(results, args.stories),
    }
    for name, run in sections.items():
        if name in skip:
            continue
        t = time.time()
        try:
            run()
        except Exception:  # report and go on: one broken section should not cost the others
            import traceback

            traceback.print_exc()
            results.setdefault("errors", []).append(name)
        print(f"section {name}: {time.time() - t:.0f} s", flush=True)
        save()  # after every section, so a run cut short keeps what it measured
    results["wall_s"] = time.time() - t0
    save()
    print_tables(results)


def print_tables(results: dict) -> None:
    print(f"\n{results['device']}  copy {results['copy_bw_GBps']:.0f} GB/s  torch {results['torch']}  "
          f"triton {results['triton']}  {results['wall_s']:.0f} s")
    if "decode" not in results:
        return

    def table(title: str, cols: list[tuple[str, str]]) -> None:
        """One line per row: model ctx batch | each (key, format) column; '-' where the run did not time it (--lean)."""
        print(f"model ctx batch | {title}")
        for r in results["decode"]:
            cells = [("-" if r.get(k) is None else format(r[k], f)) for k, f in cols]
            print(f"{r['model']} {r['ctx']} {r['batch']} | " + " ".join(cells))

    table("sdpa_ms bf16_paged_ms fp4_ms fp4_triton_ms fp4_generic_ms | fp4 x sdpa, x triton, x generic | "
          "bf16paged/sdpa | fp4 %copy sdpa %copy",
          [("sdpa_ms", ".4f"), ("bf16_paged_ms", ".4f"), ("fp4_ms", ".4f"),
           ("fp4_triton_ms", ".4f"), ("fp4_generic_ms", ".4f"), ("fp4_speedup_vs_sdpa", ".2f"),
           ("fp4_speedup_vs_triton", ".2f"), ("fp4_speedup_vs_generic", ".2f"),
           ("bf16_paged_vs_sdpa", ".2f"), ("fp4_eff_bw_pct_copy", ".0f"), ("sdpa_eff_bw_pct_copy", ".0f")])
    table("sdpa_ms fp8_ms (tiles ahead, splits) | x sdpa: fp8 (the rule), 0, 1, 2 tiles ahead, 2x splits, Triton fp8 | "
          "fp8 x Triton fp8 | fp8 %copy",
          [("sdpa_ms", ".4f"), ("fp8_ms", ".4f"), ("fp8_rule_ahead", "d"),
           ("fp8_num_splits", "d"), ("fp8_speedup_vs_sdpa", ".2f"),
           ("fp8_ahead0_speedup_vs_sdpa", ".2f"), ("fp8_ahead1_speedup_vs_sdpa", ".2f"),
           ("fp8_ahead2_speedup_vs_sdpa", ".2f"), ("fp8_2x_splits_speedup_vs_sdpa", ".2f"),
           ("fp8_triton_speedup_vs_sdpa", ".2f"), ("fp8_speedup_vs_triton", ".2f"), ("fp8_eff_bw_pct_copy", ".0f")])
    table("sdpa_ms fp8_ms fp8_fp4_ms fp8_fp4_generic_ms fp4_ms | x sdpa: fp8, fp8-fp4 (the rule), fp8-fp4 (generic), fp4 | "
          "fp8 %copy fp8-fp4 %copy fp4 %copy",
          [("sdpa_ms", ".4f"), ("fp8_ms", ".4f"), ("fp8_fp4_ms", ".4f"), ("fp8_fp4_generic_ms", ".4f"), ("fp4_ms", ".4f"),
           ("fp8_speedup_vs_sdpa", ".2f"), ("fp8_fp4_speedup_vs_sdpa", ".2f"), ("fp8_fp4_generic_speedup_vs_sdpa", ".2f"),
           ("fp4_speedup_vs_sdpa", ".2f"), ("fp8_eff_bw_pct_copy", ".0f"), ("fp8_fp4_eff_bw_pct_copy", ".0f"),
           ("fp4_eff_bw_pct_copy", ".0f")])

if __name__ == "__main__":
    main()
