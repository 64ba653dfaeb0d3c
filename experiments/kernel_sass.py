"""Compile the decode kernels for sm_90 on any machine (no GPU) and count their instructions.

    python experiments/kernel_sass.py [--triton-path DIR] [--only Gluon] [--json]

Triton compiles for a target it is given, and its wheel carries ptxas and cuobjdump, so the
machine code of a kernel can be read without a GPU (Gluon kernels too). For each decode kernel
and shape this prints registers and stack (spill) bytes per thread and the instructions of the
main loop (the largest backward branch), per thread and per (token, KV head): loop instructions x
warps / tokens per loop iteration (tiles per iteration x tokens per tile), the figure to hold
against the ~36 warp instructions per (token, KV head) that streaming fp4's 150 bytes at the copy
rate leaves (4 issue slots per cycle per SM, docs/history.md). Compile with the Triton the GPU
machine runs (3.6 there: pip install --target DIR triton==3.6.0, then --triton-path DIR); other
versions give other code. A Gluon build's query loads are chosen as Launch chooses them for that build:
16-byte loads where it fits in 128 registers without spilling, else two-byte loads ("q 2-byte" in the
table, "qvec": false in --json). The build itself is the one named (a paired build that spills is listed,
where Launch would run single tiles).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

PAGE_SIG = {"k0": "*u8", "k1": "*u8", "k2": "*u8", "k3": "*bf16", "k4": "*u8",
            "v0": "*u8", "v1": "*u8", "v2": "*u8", "v3": "*bf16", "v4": "*u8"}
SIG = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", **PAGE_SIG,
       "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "sm_scale_log2": "fp32", "stride_q_seq": "i32",
       "stride_q_head": "i32", "stride_bt": "i32", "split_size": "i32", "num_splits": "i32"}
DIVISIBLE = {"stride_q_seq", "stride_q_head", "stride_bt", "split_size"}  # as the launcher's arguments are
SHAPES = {"8B": (8, 4), "70B-TP8": (1, 8)}  # (KV heads, query heads per KV head) per GPU


def sass_loop(cubin: str, bin_dir: str) -> tuple[str, list[str], dict]:
    """(resource line, opcodes of the main loop: loop_ops, its cp.async copies by width: copy_widths) of a
    cubin."""
    res = subprocess.run([f"{bin_dir}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    sass = subprocess.run([f"{bin_dir}/cuobjdump", "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    return res, loop_ops(sass), copy_widths(sass)


def copy_widths(sass: str) -> dict:
    """The main loop's cp.async copies (LDGSTS) by bytes per thread: {16: n, 8: n, 4: n} ("LDGSTS.E.BYPASS.128"
    moves 16 bytes, ".64" 8, no width suffix 4)."""
    widths = collections.Counter()
    for text in loop_instructions(sass):
        if opcode(text) == "LDGSTS":
            widths[{"128": 16, "64": 8}.get(mnemonic(text).split(".")[-1], 4)] += 1
    return dict(widths)


def mnemonic(text: str) -> str:
    """An instruction's opcode and modifiers without its predicate ("@!P0 LDGSTS.E.64 [R1], ..." ->
    "LDGSTS.E.64")."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text.strip()).split()[0]


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers ("@!P0 BRA `(.L_x_1) 0x10" -> "BRA")."""
    return mnemonic(text).split(".")[0]


def main_loop(ins: list[tuple[int, str]]) -> tuple[int, int] | None:
    """Index range (first, last) of the main loop in a listing of (address, instruction) in address
    order (cuobjdump -sass, or ncu's source page): the largest backward branch's range, the largest
    with MMA instructions if any has them (in a warp-specialized kernel, the attending warps' loop
    rather than the producer's). A range that holds an EXIT is not a loop of the kernel's body: ptxas
    puts the retry of an mbarrier wait out of line, after the kernel's exits, and branches back."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    ops = [opcode(t) for _, t in ins]
    loops = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            j = index[int(m.group(1), 16)]
            if "EXIT" not in ops[j:i + 1]:
                loops.append((j, i, "HMMA" in ops[j:i + 1]))
    loops = [lp for lp in loops if lp[2]] or loops
    if not loops:
        return None
    j, i, _ = max(loops, key=lambda lp: lp[1] - lp[0])
    return j, i


def loop_instructions(sass: str) -> list[str]:
    """The main loop's instructions (main_loop) in a SASS listing (cuobjdump -sass), as written."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    span = main_loop(ins)
    return [] if span is None else [t for _, t in ins[span[0]:span[1] + 1]]


def loop_ops(sass: str) -> list[str]:
    """Opcodes of the main loop (main_loop) in a SASS listing (cuobjdump -sass)."""
    return [opcode(t) for t in loop_instructions(sass)]


def compile_kernel(fn, sig: dict, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None,
                   out_dir: str) -> str:
    """Compile a Triton or Gluon kernel for sm_90 and write its cubin to out_dir; returns the path."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: N814

    params = list(inspect.signature(fn.fn).parameters)
    full = {p: sig.get(p, "constexpr") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]]
             for p in params if full[p].startswith("*") or p in DIVISIBLE}
    # the cases share common constexprs (PRECISE...): those this kernel does not take are left out
    src = ASTSource(fn, full, constexprs={(params.index(k),): v for k, v in constexprs.items() if k in params},
                    attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    path = os.path.join(out_dir, f"{fn.fn.__name__}.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-path", default=None, help="a directory holding the Triton to compile with")
    ap.add_argument("--only", default=None, help="only the kernels whose name contains this (e.g. Gluon)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per kernel and shape")
    args = ap.parse_args()
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import triton
    import triton.language as tl

    from app.kernels import decode_fp4_gluon, decode_fp8_gluon
    from app.kernels.decode_attention import FP8_BLOCK_N, FP8_STAGES, _decode_fp4_kernel, _decode_fp8_kernel, _decode_kernel

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not args.json:
        print(f"triton {triton.__version__}, sm_90; loop instructions per thread and per (token, KV head)")
    common = {"D": 128, "BS": 16, "DT": tl.bfloat16, "SPLIT": True, "PRECISE": False, "ASM": True}
    fp4_args = {"K_G": 32, "K_KO": 4, "V_G": 32, "V_KO": 0}
    generic_fp4 = {"K_KIND": 2, "K_G": 32, "K_KO": 4, "V_KIND": 2, "V_G": 32, "V_KO": 0}
    dense = {"K_KIND": 0, "K_G": 1, "K_KO": 0, "V_KIND": 0, "V_G": 1, "V_KO": 0}
    dense_sig = dict(SIG, **{k: "*bf16" for k in PAGE_SIG})
    gluon_sig = dict(SIG, qt_ptr="*fp32")
    # _decode_fp8_kernel: fp8 K and V pages (E4M3 values, float32 scales)
    fp8_sig = dict({k: v for k, v in SIG.items() if k not in PAGE_SIG}, k_vals="*u8", k_scale="*fp32",
                   v_vals="*u8", v_scale="*fp32")
    fp8_args = {"DT": tl.float16}
    # values: E4M3 and scales (fp8) or fp4 codes, group scales and scale_exp (V_FP4); int32 tables, as the engine's
    fp8_gluon_sig = dict({k: v for k, v in fp8_sig.items() if not k.startswith("v_")}, v0="*u8", v1="*fp32",
                         v2="*fp32")
    fp8_gluon_args = {"TW": decode_fp8_gluon.TW, "OFF64": False, "V_FP4": False, **decode_fp8_gluon.layouts()}
    gluon_args = {"K_KO": 4, "TW": decode_fp4_gluon.TW, "OFF64": False, "STAGES": decode_fp4_gluon.STAGES,
                  "F16": True, "PAIR": None, "KG8": False, "KG16": False, "QVEC": decode_fp4_gluon.QUERY_VECTOR,
                  **decode_fp4_gluon.layouts()}  # fp16 MMAs: the default
    # PAIR None: the launcher's choice for the shape (tile pairs at <= 4 query heads per KV head with the
    # 4-tile ring: the loop then takes two pairs, 4 tiles, at PAIR_MAXNREG registers)
    # (name, kernel, signature, constexprs, warps, stages, maxnreg, tokens per tile, tiles per loop iteration:
    # the Gluon ring's loop is unrolled over an even and an odd tile)
    cases = [
        ("Gluon fp4 kernel (cp.async ring)", decode_fp4_gluon._decode_fp4_gluon_kernel, gluon_sig, gluon_args, 4, 1,
         None, 64, 2),
        ("Gluon fp4 kernel, no key slots, one split", decode_fp4_gluon._decode_fp4_gluon_kernel, gluon_sig,
         dict(gluon_args, K_KO=0, SPLIT=False), 4, 1, None, 64, 2),
        ("Gluon fp4 kernel, loads into registers", decode_fp4_gluon._decode_fp4_gluon_kernel, gluon_sig,
         dict(gluon_args, STAGES=0), 4, 1, None, 64, 1),
        ("Gluon fp4 kernel, single tiles (pair=0)", decode_fp4_gluon._decode_fp4_gluon_kernel, gluon_sig,
         dict(gluon_args, PAIR=0), 4, 1, None, 64, 2),
        ("Gluon fp4 kernel, the engine's int64 tables and lengths", decode_fp4_gluon._decode_fp4_gluon_kernel,
         dict(gluon_sig, block_tables_ptr="*i64", seq_lens_ptr="*i64"), gluon_args, 4, 1, None, 64, 2),
        ("Gluon fp4 kernel, key groups of 8 (no key slots)", decode_fp4_gluon._decode_fp4_gluon_kernel, gluon_sig,
         dict(gluon_args, K_KO=0, KG8=True), 4, 1, None, 64, 2),
        ("Gluon fp4 kernel, key groups of 16 with key slots (KG16)", decode_fp4_gluon._decode_fp4_gluon_kernel,
         gluon_sig, dict(gluon_args, KG16=True), 4, 1, None, 64, 2),
        ("Gluon fp4 kernel, key groups of 16, single tiles", decode_fp4_gluon._decode_fp4_gluon_kernel,
         gluon_sig, dict(gluon_args, KG16=True, PAIR=0), 4, 1, None, 64, 2),
        ("Gluon fp4 kernel, bf16 MMAs (fp16=False)", decode_fp4_gluon._decode_fp4_gluon_kernel, gluon_sig,
         dict(gluon_args, F16=False), 4, 1, None, 64, 2),
        ("Triton fp4 kernel (128 regs, 1 stage)", _decode_fp4_kernel, SIG, fp4_args, 4, 1, 128, 128, 1),
        ("fp4 kernel, registers uncapped, 2 stages", _decode_fp4_kernel, SIG, fp4_args, 4, 2, None, 128, 1),
        ("generic kernel on fp4 pages (before)", _decode_kernel, SIG, generic_fp4, 4, 2, None, 128, 1),
        ("generic kernel on bf16 pages", _decode_kernel, dense_sig, dense, 4, 2, None, 64, 1),
        ("Gluon fp8 kernel, 1 tile ahead", decode_fp8_gluon._decode_fp8_gluon_kernel, fp8_gluon_sig,
         dict(fp8_gluon_args, PREFETCH=1), 4, 1, None, 64, 1),
        ("Gluon fp8 kernel, 2 tiles ahead", decode_fp8_gluon._decode_fp8_gluon_kernel, fp8_gluon_sig,
         dict(fp8_gluon_args, PREFETCH=2), 4, 1, None, 64, 1),
        ("Gluon fp8 kernel, no loads ahead", decode_fp8_gluon._decode_fp8_gluon_kernel, fp8_gluon_sig,
         dict(fp8_gluon_args, PREFETCH=0), 4, 1, None, 64, 1),
        ("Gluon fp8 kernel, 1 tile ahead at 128 registers", decode_fp8_gluon._decode_fp8_gluon_kernel, fp8_gluon_sig,
         dict(fp8_gluon_args, PREFETCH=1), 4, 1, 128, 64, 1),
        ("Gluon fp8 kernel, fp4 values, 1 tile ahead", decode_fp8_gluon._decode_fp8_gluon_kernel,
         dict(fp8_gluon_sig, v1="*u8", v2="*u8"), dict(fp8_gluon_args, PREFETCH=1, V_FP4=True,
                                                        V_LOAD=decode_fp8_gluon.layouts()["V4_LOAD"]), 4, 1, None, 64, 1),
        ("Gluon fp8 kernel, fp4 values, 2 tiles ahead", decode_fp8_gluon._decode_fp8_gluon_kernel,
         dict(fp8_gluon_sig, v1="*u8", v2="*u8"), dict(fp8_gluon_args, PREFETCH=2, V_FP4=True,
                                                        V_LOAD=decode_fp8_gluon.layouts()["V4_LOAD"]), 4, 1, None, 64, 1),
        ("fp8 kernel (fp8 K and V)", _decode_fp8_kernel, fp8_sig, fp8_args, 4, FP8_STAGES, None, FP8_BLOCK_N, 1),
        ("generic kernel on fp8-fp4 pages", _decode_kernel, dict(SIG, k0="*u8", k1="*fp32", k2="*fp32",
         k3="*fp32", k4="*fp32"), dict(generic_fp4, K_KIND=1, K_G=1, K_KO=0), 4, 2, None, 64, 1),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for model, (heads, group) in SHAPES.items():
            for name, fn, sig, extra, warps, stages, maxnreg, block_n, tiles in cases:
                if args.only and args.only not in name:
                    continue
                const = dict(common, H=heads, GROUP=group, GP=16, BLOCK_N=block_n, **extra)
                pair = 0
                if fn.is_gluon():  # its own parameters only
                    const = dict({"SPLIT": True}, H=heads, GROUP=group, BS=16, **extra)
                    if "PAIR" in const and const["PAIR"] is None:
                        const["PAIR"] = decode_fp4_gluon.pair_min_tiles(group, const["STAGES"])
                    pair = const.get("PAIR", 0)
                    if pair:
                        maxnreg, tiles = decode_fp4_gluon.PAIR_MAXNREG, 4
                def build(const):
                    res, ops, copies = sass_loop(compile_kernel(fn, sig, const, warps, stages, maxnreg, tmp), bin_dir)
                    return ops, copies, re.search(r"REG:(\d+)", res).group(1), re.search(r"STACK:(\d+)", res).group(1)

                ops, copies, regs, stack = build(const)
                qvec = bool(const.get("QVEC")) and bool(const.get("F16"))
                if qvec and not decode_fp4_gluon.query_vector_fits(int(regs), int(stack)):
                    # as Launch does: the query's two-byte loads where its vector loads do not fit
                    qvec = False
                    ops, copies, regs, stack = build(dict(const, QVEC=False))
                counts = collections.Counter(ops)
                per_token_head = len(ops) * warps / (block_n * tiles)
                if args.json:
                    print(json.dumps({"model": model, "kernel": name, "triton": triton.__version__, "pair": bool(pair),
                                      "qvec": qvec,
                                      "regs": int(regs),
                                      "stack": int(stack),
                                      "loop": len(ops), "tiles": tiles, "per_token_head": per_token_head,
                                      "ops": dict(counts), "copies": copies}), flush=True)
                    continue
                top = ", ".join(f"{op} {n}" for op, n in counts.most_common(8))
                print(f"{model:8s} {name:42s}{' (pairs)' if pair else ''}{' (q 2-byte)' if 'QVEC' in const and not qvec else ''} regs {regs:>3s} stack {stack:>3s} | loop "
                      f"{len(ops):5d} / thread ({tiles} tile{'s' if tiles > 1 else ''}), {per_token_head:5.1f} / "
                      f"(token, KV head) | {top}",
                      flush=True)


if __name__ == "__main__":
    main()
