"""Helpers of the Ray Serve tests: one local Ray + Serve per test module, apps on a free port; a
stand-in for the LLMServer deployment's handle where the ingress's operations are tested without Ray."""

import asyncio
import contextlib
import os
import time
from pathlib import Path

from bench.servers import free_port  # the benches' server helpers

REPO_ROOT = Path(__file__).resolve().parents[1]


class FakeReplicaHandle:
    """What OpenAIServing calls on an LLMServer handle, without Ray: `model_info.remote()` is a
    future of `info`, `options(...).generate.remote(request)` what stream(request) returns."""

    def __init__(self, info) -> None:
        self.info = info  # an app.serving_types.ModelInfo

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    @property
    def model_info(self):
        return self

    def remote(self, request=None):
        if request is None:  # model_info
            future = asyncio.get_running_loop().create_future()
            future.set_result(self.info)
            return future
        return self.stream(request)

    def stream(self, request):
        raise NotImplementedError


@contextlib.contextmanager
def local_serve(num_cpus: int = 4):
    """Start Ray (no dashboard, no auth) and Serve on a free port; yields the base URL."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray workers must import this checkout's `app`, whatever else is installed.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    import ray
    from ray import serve

    port = free_port()
    # address="local": a new Ray even if another one (another test's cluster) is running here.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             log_to_driver=bool(os.environ.get("SERVE_TEST_LOGS")))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def run_apps(*apps: tuple[dict, str, str]) -> None:
    """Deploy build_app(args) for each (args, name, route_prefix), all at once; waits until all run."""
    from ray import serve
    from ray.serve.api import RunTarget

    from app.deployments.builder import build_app

    serve.run_many([RunTarget(build_app(args), name=name, route_prefix=prefix) for args, name, prefix in apps])


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    """Poll until predicate() is truthy; returns its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
