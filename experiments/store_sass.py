"""Compile store_kv's kernel for sm_90 on any machine (no GPU) and count what one (token, KV head) vector costs.

    python experiments/store_sass.py [--triton-path DIR] [--modules old=/tmp/store_old.py] [--json]

For each page format (fp4 default, fp8 keys with fp4 values, fp8, bf16) and (rows per program, warps) build
of `store_kv._store_kv_kernel`: registers per thread, the instructions a warp runs on its straight path (the
SASS up to the first unconditional EXIT: the kernel has no loop, and what follows the EXIT is the IEEE
division's out-of-line slow path, not run for these operands), that times warps / rows = warp instructions
per vector, and the barriers (BAR) and IEEE divisions (FCHK) among them. The store is a dependent chain per
vector, so at a decode step's few vectors its time follows the path one warp runs; at a prefill chunk's many,
the instructions per vector. --modules compiles other versions of app/kernels/store_kv.py (files) beside this
tree's. Compile with the Triton the GPU machine runs (3.6 there; kernel_sass.py says how).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUILDS = ((4, 4), (1, 1), (2, 1), (4, 1), (16, 4))
KINDS = {"fp4": ("fp4", "fp4"), "fp8-fp4": ("fp8", "fp4"), "fp8": ("fp8", "fp8"), "bf16": ("bf16", "bf16")}
SIG = {"k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i32", "num_rows": "i32", "flag_ptr": "*i32",
       "stride_k": "i32", "stride_v": "i32", "K_Z": "fp32", "V_Z": "fp32"}


def page_sig(prefix: str, kind: str) -> dict:
    if kind == "fp4":
        return {f"{prefix}0": "*u8", f"{prefix}1": "*u8", f"{prefix}2": "*u8", f"{prefix}3": "*bf16", f"{prefix}4": "*u8"}
    if kind == "fp8":
        return {f"{prefix}0": "*u8", **{f"{prefix}{i}": "*fp32" for i in range(1, 5)}}
    return {f"{prefix}{i}": "*bf16" for i in range(5)}


def straight_path(sass: str) -> collections.Counter:
    """Opcodes up to the first unconditional EXIT of a cuobjdump -sass listing."""
    ops = collections.Counter()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass):
        op = m.group(2).split(".")[0]
        ops[op] += 1
        if op == "EXIT" and not m.group(1):
            break
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-path", default=None, help="a directory holding the Triton to compile with")
    ap.add_argument("--modules", default="", help="name=path,...: other versions of app/kernels/store_kv.py")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    import torch
    import triton

    from app.config import FP4Config
    from app.kernels import paged
    from app.kernels import store_kv as this_tree
    from experiments.fp4_ab import load_module
    from experiments.kernel_sass import compile_kernel

    modules = {"": this_tree}
    for item in filter(None, args.modules.split(",")):
        name, path = item.split("=", 1)
        modules[f"{name}:"] = load_module(f"store_kv_{name}", path)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    fmts = FP4Config().formats()
    rows = []
    for kind in args.kinds.split(","):
        k_kind, v_kind = KINDS[kind]
        pages = []
        for p_kind, fmt in ((k_kind, fmts[0]), (v_kind, fmts[1])):
            pages.append((paged.quantize_pages(torch.zeros(2, 16, 8, 128), p_kind, fmt if p_kind == "fp4" else None),
                          fmt if p_kind == "fp4" else None))
        sig = {**SIG, **page_sig("k", k_kind), **page_sig("v", v_kind)}
        for label, module in modules.items():
            ce = {}
            for (p, fmt), prefix in zip(pages, ("K", "V")):
                ce.update(module._format_args(p, fmt, prefix)[0])
            for block_r, warps in BUILDS:
                const = dict(H=8, D=128, BLOCK_R=block_r, FLAG=True, **ce)
                with tempfile.TemporaryDirectory() as d:
                    path = compile_kernel(module._store_kv_kernel, sig, const, warps, 3, None, d)
                    res = subprocess.run([f"{bin_dir}/cuobjdump", "-res-usage", path], capture_output=True, text=True,
                                         check=True).stdout
                    sass = subprocess.run([f"{bin_dir}/cuobjdump", "-sass", path], capture_output=True, text=True,
                                          check=True).stdout
                ops = straight_path(sass)
                path_len = sum(ops.values())
                row = {"kind": kind, "version": label or "this tree", "rows": block_r, "warps": warps,
                       "registers": int(re.search(r"REG:(\d+)", res).group(1)),
                       "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
                       "warp_path": path_len, "per_vector": round(path_len * warps / block_r),
                       "barriers": ops["BAR"], "divisions": ops["FCHK"]}
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    print(f"Triton {triton.__version__}, sm_90, 8 KV heads x 128, K and V of one (token, KV head) per vector")
    print("| format | version | rows x warps | registers | warp path | per vector | barriers | divisions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['version']} | {r['rows']} x {r['warps']} | {r['registers']} | {r['warp_path']} | "
              f"{r['per_vector']} | {r['barriers']} | {r['divisions']} |")


if __name__ == "__main__":
    main()
