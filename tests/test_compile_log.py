"""app/kernels/compile_log.py: counting Triton's compiles and warning of those after start-up.

The CPU tests call the recorder the way Triton's hooks do (keyword arguments, jit_cache_hook's
return value deciding whether Triton compiles) and check the chaining of hooks installed before;
the GPU test launches a real kernel with a new specialization and sees it counted (skipped without
CUDA)."""

import logging

import pytest
import torch

from app.kernels import compile_log
from app.kernels.compile_log import CompileLog


def test_compiles_are_counted_and_those_while_serving_warned(caplog):
    log = CompileLog()
    assert log.on_cache_miss(key="k1", repr="add_kernel[num_warps=4](x: *fp32)") is None  # None: Triton compiles
    log.on_compiled(key="k1", repr="add_kernel[num_warps=4](x: *fp32)")
    assert log.stats()["kernel_compiles_total"] == 1 and log.stats()["kernel_compiles_serving_total"] == 0
    assert log.stats()["kernel_compile_s_total"] >= 0
    with caplog.at_level(logging.WARNING, logger="app.kernels.compile_log"):
        log.on_compiled(key="k0", repr="start_kernel")  # before serving: counted, not warned
        log.mark_serving()
        log.on_cache_miss(key="k2", repr="add_kernel[num_warps=4](x: *fp32, n: i32)")
        log.on_compiled(key="k2", repr="add_kernel[num_warps=4](x: *fp32, n: i32)")
    assert log.stats()["kernel_compiles_total"] == 3 and log.stats()["kernel_compiles_serving_total"] == 1
    (record,) = caplog.records
    assert "add_kernel[num_warps=4](x: *fp32, n: i32)" in record.getMessage() and "while serving" in record.getMessage()


def test_hooks_installed_before_keep_working_and_decide():
    seen = []
    log = CompileLog()
    log._prev_miss = lambda **kw: seen.append(("miss", kw["key"])) or True  # True: "skip this compile"
    log._prev_compiled = lambda **kw: seen.append(("compiled", kw["key"]))
    assert log.on_cache_miss(key="k") is True  # the earlier hook's answer reaches Triton
    log.on_compiled(key="k")
    assert seen == [("miss", "k"), ("compiled", "k")] and log.num_compiles == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real Triton compile)")
def test_a_real_launch_with_a_new_specialization_is_counted():
    import triton
    import triton.language as tl

    from app.kernels.paged import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET: nothing compiles")

    @triton.jit
    def scale(x_ptr, n, factor: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)

    log = compile_log.install()
    assert log is not None
    x = torch.ones(100, device="cuda")
    before = log.num_compiles
    scale[(1,)](x, 100, 2.0, BLOCK=128)
    scale[(1,)](x, 100, 2.0, BLOCK=128)  # same specialization: no compile
    assert log.num_compiles == before + 1
    scale[(1,)](x, 99, 2.0, BLOCK=128)  # 100 % 16 != 0 either: same key
    scale[(1,)](x, 1, 2.0, BLOCK=128)  # n == 1 is a specialization of its own
    torch.cuda.synchronize()
    assert log.num_compiles == before + 2 and log.compile_s > 0
