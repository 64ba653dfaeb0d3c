"""Engine settings that cannot work together, found from the config alone (no model files, no
devices): backend x device x block_size x KV format x tensor parallelism.

`check_settings` runs where the application is built (app/deployments/builder.py: `serve run`
fails at once, with one message naming each problem, instead of a replica that fails and is
restarted again and again) and again where an engine starts (LLMEngine, VLLMEngine), so the
offline API refuses the same settings with the same words.
"""

from __future__ import annotations

import os

from app.config import EngineConfig, FP4Config
from app.engine.gguf_file import MODEL_PACKAGES
from app.engine.model_source import DUMMY_MODELS

# vLLM's CPU attention backend takes pages of a multiple of 32 tokens only (vLLM 0.32).
CPU_BLOCK_MULTIPLE = 32
# Our kv_cache_dtype -> vLLM's; the others (fp4, fp8-fp4, fp32) are this project's engine only.
VLLM_KV_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp8": "fp8_e4m3"}


class UnsupportedSettingError(ValueError):
    """Settings that cannot work together; raised by build_app and where an engine starts."""


def setting_problems(config: EngineConfig, *, on_cpu: bool | None = None, model_here: bool = False) -> list[str]:
    """One sentence per problem (empty: the settings can work). `on_cpu` defaults to
    config.device == "cpu". `model_here`: where the engine starts, also refuse a vLLM `model` that
    is no directory on this machine (the machine that builds the application may not hold it)."""
    on_cpu = config.device == "cpu" if on_cpu is None else on_cpu
    shared = _gpu_fraction_problems(config, on_cpu)
    if config.backend == "vllm":
        return shared + _vllm_problems(config, on_cpu, model_here)
    return shared + _native_problems(config, on_cpu)


def check_settings(config: EngineConfig, *, on_cpu: bool | None = None, model_here: bool = False) -> None:
    """Raise UnsupportedSettingError naming every problem setting_problems finds."""
    problems = setting_problems(config, on_cpu=on_cpu, model_here=model_here)
    if problems:
        raise UnsupportedSettingError(
            f"engine.backend {config.backend!r} cannot honour these settings: " + "; ".join(problems))


def _gpu_fraction_problems(config: EngineConfig, on_cpu: bool) -> list[str]:
    """gpu_fraction shares one GPU between engines of one worker each (its range, (0, 1], is the
    field's own constraint)."""
    fraction = config.gpu_fraction
    if fraction is None:
        return []
    problems = []
    if config.tensor_parallel_size > 1:
        problems.append(f"gpu_fraction {fraction} shares one GPU between engines of tensor_parallel_size 1; with "
                        f"tensor_parallel_size {config.tensor_parallel_size} every worker takes a whole GPU "
                        "(leave gpu_fraction unset)")
    if on_cpu:
        problems.append(f"gpu_fraction {fraction} is a share of a GPU, and device {config.device!r} uses none "
                        "(leave gpu_fraction unset, or set device 'cuda')")
    return problems


def _native_problems(config: EngineConfig, on_cpu: bool) -> list[str]:
    problems = []
    tp = config.tensor_parallel_size
    if tp > 1 and config.async_scheduling and config.distributed_executor_backend == "ray":
        problems.append("async_scheduling needs an executor that launches steps in the background: the 'ray' "
                        "executor runs each step to the end (use distributed_executor_backend 'mp', or leave "
                        "async_scheduling unset)")
    if tp > 1 and on_cpu and config.distributed_backend == "nccl":
        problems.append("distributed_backend 'nccl' needs CUDA devices (device 'cpu'): use 'gloo' or 'auto'")
    if config.kv_cache_dtype == "fp8-fp4":
        problems += _fp8_keys_problems(config.fp4)
    return problems


def _fp8_keys_problems(fp4: FP4Config) -> list[str]:
    """kv_cache_dtype 'fp8-fp4' stores keys in fp8 and values in fp4: fp4's key options (set to other
    than their defaults) would do nothing, and its rotation turns K and V together (the queries and
    the output alike)."""
    problems = []
    keys = [name for name in ("key_group_size", "key_outliers")
            if getattr(fp4, name) != FP4Config.model_fields[name].default]
    if keys:
        problems.append(f"fp4 {', '.join(keys)}: kv_cache_dtype 'fp8-fp4' stores keys in fp8, so fp4's key "
                        "options do nothing (leave them at their defaults, or use kv_cache_dtype 'fp4')")
    if fp4.rotate:
        problems.append("fp4 rotate rotates K and V together, and kv_cache_dtype 'fp8-fp4' stores keys in fp8 "
                        "(leave rotate off, or use kv_cache_dtype 'fp4')")
    return problems


def _vllm_problems(config: EngineConfig, on_cpu: bool, model_here: bool) -> list[str]:
    """What vLLM has no equivalent for (README "The vLLM backend")."""
    problems = []
    model = config.model
    if model in DUMMY_MODELS:
        problems.append(f"model {model!r} is one of our built-in dummy models; vLLM needs a Hugging Face model "
                        "directory (load_format: dummy gives it random weights)")
    elif model.endswith((".bin", ".gguf")) or model.lower() in MODEL_PACKAGES or (model_here and not os.path.isdir(model)):
        problems.append(f"model {model!r}: the vllm backend serves Hugging Face model directories "
                        "(config.json + *.safetensors) only")
    if config.kv_cache_dtype not in VLLM_KV_DTYPES:
        problems.append(f"kv_cache_dtype {config.kv_cache_dtype!r}: vLLM's KV cache formats here are "
                        f"{sorted(VLLM_KV_DTYPES)} (fp4 and fp8-fp4 KV are this project's engine: backend native)")
    if config.fp4 != FP4Config():
        problems.append("fp4 options are settings of our fp4 KV cache; vLLM has none of them")
    if config.device not in ("cpu", "cuda"):
        problems.append(f"device {config.device!r}: with vLLM use 'cpu' or 'cuda' (vLLM takes the GPUs the "
                        "replica sees, cuda:0 first)")
    if on_cpu and config.block_size % CPU_BLOCK_MULTIPLE:
        problems.append(f"block_size {config.block_size}: vLLM's CPU attention needs a multiple of "
                        f"{CPU_BLOCK_MULTIPLE}")
    for name in ("execute_timeout_s", "distributed_backend", "cpu_threads", "warmup"):
        if name in config.model_fields_set:
            problems.append(f"{name} has no vLLM equivalent (vLLM picks its own collectives, timeouts, CPU "
                            "threads (VLLM_CPU_OMP_THREADS_BIND) and start-up warm-up)")
    return problems
