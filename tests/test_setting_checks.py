"""Settings that cannot work together fail when the application is built (build_app: `serve run`
stops at once with the message) and where an engine starts, naming every problem. No Ray."""

import pytest
import yaml

from app.config import EngineConfig
from app.deployments.builder import build_app
from app.engine.setting_checks import UnsupportedSettingError, check_settings, setting_problems
from tests.serve_testing import REPO_ROOT


def default_args() -> dict:
    (app,) = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())["applications"]
    return app["args"]


def test_the_default_config_builds():
    from ray.serve import Application

    assert isinstance(build_app(default_args()), Application)
    assert isinstance(build_app({}), Application)


def test_vllm_on_the_cpu_with_the_default_settings_fails_the_build_naming_each_problem():
    args = default_args()
    args["engine"]["backend"] = "vllm"  # smollm2 (a GGUF file), fp4 KV, block_size 16 on the CPU
    with pytest.raises(UnsupportedSettingError) as e:
        build_app(args)
    message = str(e.value)
    assert message.startswith("engine.backend 'vllm' cannot honour these settings: "), message
    for problem in ("model 'smollm2-135m-instruct'", "Hugging Face model directories", "kv_cache_dtype 'fp4'",
                    "block_size 16: vLLM's CPU attention needs a multiple of 32"):
        assert problem in message, (problem, message)
    assert message.count(";") == 2  # three problems, one message

    # the default block_size alone, everything else vLLM can serve
    with pytest.raises(UnsupportedSettingError, match=r"honour these settings: block_size 16: [^;]*$"):
        build_app({"engine": {"backend": "vllm", "model": "/models/llama", "kv_cache_dtype": "bf16"}})


def test_a_vllm_config_it_can_serve_builds_without_the_model_on_this_machine():
    # the machine that builds the application may not hold the model: the replica checks the directory
    build_app({"engine": {"backend": "vllm", "model": "/models/llama", "block_size": 32, "kv_cache_dtype": "fp8"}})
    build_app({"engine": {"backend": "vllm", "model": "/models/llama", "device": "cuda", "tensor_parallel_size": 2}})


@pytest.mark.parametrize("engine, problem", [
    (dict(tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=True),
     "async_scheduling needs an executor that launches steps in the background"),
    (dict(tensor_parallel_size=2, distributed_backend="nccl"), "distributed_backend 'nccl' needs CUDA devices"),
    (dict(backend="vllm", model="/m", block_size=32, device="cuda:1"), "device 'cuda:1'"),
    (dict(backend="vllm", model="/m", block_size=32, fp4={"key_outliers": 2}), "fp4 options"),
    (dict(backend="vllm", model="stories.bin", block_size=32), "Hugging Face model directories"),
    (dict(backend="vllm", model="tiny-llama", block_size=32), "built-in dummy"),
    (dict(backend="vllm", model="/m", block_size=32, kv_cache_dtype="fp32"), "kv_cache_dtype 'fp32'"),
    (dict(backend="vllm", model="/m", block_size=32, execute_timeout_s=5), "execute_timeout_s"),
    (dict(backend="vllm", model="/m", block_size=32, cpu_threads=2), "cpu_threads has no vLLM equivalent"),
    (dict(device="cuda", gpu_fraction=0.5, tensor_parallel_size=2), "with tensor_parallel_size 2 every worker takes"),
    (dict(device="cuda", gpu_fraction=0.5, tensor_parallel_size=2, distributed_executor_backend="ray"),
     "gpu_fraction 0.5 shares one GPU between engines of tensor_parallel_size 1"),
    (dict(gpu_fraction=0.5), "gpu_fraction 0.5 is a share of a GPU, and device 'cpu' uses none"),
    (dict(backend="vllm", model="/m", block_size=32, gpu_fraction=0.5), "device 'cpu' uses none"),
])
def test_each_problem_fails_the_build(engine, problem):
    with pytest.raises(UnsupportedSettingError, match=problem):
        build_app({"engine": engine})


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5])
def test_a_gpu_fraction_outside_0_1_fails_the_build(fraction):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"engine.gpu_fraction\n  Input should be (greater than 0|less than or equal to 1)"):
        build_app({"engine": {"device": "cuda", "gpu_fraction": fraction}})


def test_settings_that_can_work_pass():
    for engine in (EngineConfig(), EngineConfig(device="cuda", gpu_fraction=0.45), EngineConfig(device="cuda", gpu_fraction=1), EngineConfig(device="cuda", tensor_parallel_size=2, distributed_backend="nccl"),
                   EngineConfig(tensor_parallel_size=2, async_scheduling=True),  # the mp executor pipelines
                   EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray"),
                   EngineConfig(backend="vllm", model="/m", block_size=16, device="cuda")):
        assert setting_problems(engine) == [], engine
        check_settings(engine)


def test_the_offline_api_refuses_the_same_settings_before_loading_anything():
    from app.llm import LLM

    with pytest.raises(UnsupportedSettingError, match="distributed_backend 'nccl'"):
        LLM(model="no-such-model", tensor_parallel_size=2, distributed_backend="nccl")
