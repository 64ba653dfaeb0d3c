"""The fp8 decode kernel's tile / pipeline / split variants against the bf16 paged kernel, the generic kernel
on the same fp8 pages (the path before the fp8 kernel) and the default fp4 kernel, on one GPU.

    SWEEP="64,2,2;128,2,2;64,2,4" python3 experiments/fp8_decode_sweep.py   # BLOCK_N,STAGES,PROGRAMS_PER_SM;...

Each case: ms of one call in a CUDA graph (bench/kernel_timings.bench), random fp8 pages over shuffled
blocks, the relative error of each variant against the generic kernel, the best variant's share of the
copy rate. Writes $OUT/fp8_sweep.json (or ./fp8_sweep.json)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from app.kernels import fp8  # noqa: E402
from app.kernels.decode_attention import DecodeOptions, decode_attention, num_splits_for  # noqa: E402
from bench.kernel_timings import BLOCK, FORMATS, HEAD_DIM, bench, copy_bandwidth, random_fp4_pages, shuffled_tables  # noqa: E402,E501

DEV = torch.device("cuda")
bw = copy_bandwidth()
print("copy GB/s", bw / 1e9, flush=True)
gen = torch.Generator().manual_seed(0)
cases = [("8B", 32, 8, 1024, 32), ("8B", 32, 8, 2048, 64), ("8B", 32, 8, 4096, 128), ("8B", 32, 8, 32768, 8),
         ("70B-TP8", 8, 1, 8192, 8), ("70B-TP8", 8, 1, 32768, 1)]
rows = []
for model, hq, hk, ctx, batch in cases:
    table, nb = shuffled_tables(batch, ctx, gen)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, hq, HEAD_DIM, device=DEV).bfloat16()
    sc = HEAD_DIM ** -0.5
    row = {"model": model, "ctx": ctx, "batch": batch}
    kp = torch.randn(nb, BLOCK, hk, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    row["bf16"] = bench(lambda: decode_attention(q, kp, vp, table, sl, sc, ctx))
    k8, v8 = fp8.fp8_quantize(kp), fp8.fp8_quantize(vp)
    del kp, vp
    ref = decode_attention(q, k8, v8, table, sl, sc, ctx, options=DecodeOptions(kernel="generic"))
    row["fp8_generic"] = bench(lambda: decode_attention(q, k8, v8, table, sl, sc, ctx,
                                                        options=DecodeOptions(kernel="generic")))
    variants = [tuple(int(x) for x in v.split(",")) for v in os.environ.get("SWEEP", "64,2,2;128,2,2;64,2,4").split(";")]
    for bn, st, pps in variants:
        ns = num_splits_for(batch, hk, ctx, DEV, bn, pps)
        name = f"fp8_bn{bn}_st{st}_pps{pps}"
        try:
            o = decode_attention(q, k8, v8, table, sl, sc, ctx,
                                 options=DecodeOptions(block_n=bn, num_stages=st, num_splits=ns))
        except Exception as e:  # a variant that does not compile or fit: recorded, the sweep goes on
            row[name] = repr(e)[:100]
            continue
        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
        row["max_err_vs_generic"] = max(row.get("max_err_vs_generic", 0.0), err)
        row[name] = bench(lambda: decode_attention(q, k8, v8, table, sl, sc, ctx,
                                                   options=DecodeOptions(block_n=bn, num_stages=st, num_splits=ns)))
    del k8, v8
    kf, vf = random_fp4_pages(nb, hk, FORMATS[0]), random_fp4_pages(nb, hk, FORMATS[1])
    row["fp4"] = bench(lambda: decode_attention(q, kf, vf, table, sl, sc, ctx, FORMATS))
    del kf, vf
    torch.cuda.empty_cache()
    fp8_bytes = batch * ctx * hk * 2 * (HEAD_DIM + 4)
    best = min((v, k) for k, v in row.items() if k.startswith("fp8_bn") and isinstance(v, float))
    row["best"] = best[1]
    row["best_vs_bf16"] = round(row["bf16"] / best[0], 3)
    row["best_bw_pct"] = round(100 * fp8_bytes / (best[0] * 1e-3) / bw, 1)
    row["generic_vs_bf16"] = round(row["bf16"] / row["fp8_generic"], 3)
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fp8_sweep.json"), "w"), indent=1)
