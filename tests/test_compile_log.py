"""app/kernels/compile_log.py: counting Triton's compiles and warning of those after start-up.

CPU: the recorder's counts and warnings, and the description of a real Triton kernel's
specialization; install() wraps JITFunction._do_compile, passing its result through. GPU (skipped
without CUDA): a real kernel's new specialization counted once. The engine installs the recorder on
CUDA, so tests/test_engine_gpu.py compiles every Gluon and Triton kernel through it."""

import logging

import pytest
import torch
import triton
import triton.language as tl

from app.kernels import compile_log
from app.kernels.compile_log import CompileLog, describe


def test_compiles_are_counted_and_those_while_serving_warned(caplog):
    log = CompileLog()
    with caplog.at_level(logging.WARNING, logger="app.kernels.compile_log"):
        log.record("start_kernel(x: *fp32; )", 0.5)  # before serving: counted, not warned
        log.mark_serving()
        log.record("add_kernel(x: *fp32, n: i32; BLOCK=128)", 0.25)
    assert log.stats() == {"kernel_compiles_total": 2, "kernel_compile_s_total": 0.75,
                           "kernel_compiles_serving_total": 1}
    (record,) = caplog.records
    assert "add_kernel(x: *fp32, n: i32; BLOCK=128)" in record.getMessage() and "while serving" in record.getMessage()


def test_a_second_engine_starting_in_the_process_is_not_warned_of_its_start_up_compiles(caplog):
    """One recorder per process: an engine starting after another has served marks it starting
    again, so its own graph-capture and warm-up compiles are start-up ones."""
    log = CompileLog()
    log.mark_serving()  # the first engine serves
    log.mark_starting()  # a second one starts
    with caplog.at_level(logging.WARNING, logger="app.kernels.compile_log"):
        log.record("capture_kernel(x: *fp32; )", 0.1)
    assert log.stats()["kernel_compiles_serving_total"] == 0 and not caplog.records


def _scale(x_ptr, n, factor: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


def test_a_kernel_is_described_by_its_name_types_and_constexprs():
    from triton.runtime.jit import JITFunction

    fn = JITFunction(_scale)  # the compiled form, whatever TRITON_INTERPRET says
    text = describe(fn, {"x_ptr": "*fp32", "n": "i32", "factor": "constexpr", "BLOCK": "constexpr"},
                    {(2,): 2.0, (3,): 128})
    assert text == "_scale(x_ptr: *fp32, n: i32; factor=2.0, BLOCK=128)"
    assert describe(object(), {}, {}) == "?"  # never raises


def test_install_wraps_the_compile_and_passes_its_result_through(monkeypatch):
    from triton.runtime.jit import JITFunction

    compiled = []
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, key, sig, dev, consts, *a: compiled.append(key) or "K")
    monkeypatch.setattr(compile_log, "_LOG", None)
    log = compile_log.install()
    assert compile_log.install() is log  # once per process
    fn = JITFunction(_scale)
    assert JITFunction._do_compile(fn, "key1", {"x_ptr": "*fp32"}, 0, {}, None, {}, False) == "K"
    assert compiled == ["key1"] and log.num_compiles == 1 and log.compile_s >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real Triton compile)")
def test_a_real_launch_with_a_new_specialization_is_counted():
    from app.kernels.paged import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET: nothing compiles")
    scale = triton.jit(_scale)
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
