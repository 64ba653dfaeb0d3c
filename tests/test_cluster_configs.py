"""Every deployable YAML (serve_config.yaml and cluster/*.yaml) is valid and they agree with each other.

Fast and offline: no Ray cluster is started. Serve configs are checked against Ray Serve's own
schema and their `args` against ServerConfig; the launcher config against Ray's launcher schema;
the RayService must embed exactly the 70B serve config; versions and GPU counts must match across
files.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from app.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
DEFAULT_CONFIG = ROOT / "serve_config.yaml"
CONFIG_70B = CLUSTER / "serve_config_70b.yaml"
RAY_CLUSTER = CLUSTER / "ray-cluster.yaml"
RAYSERVICE = CLUSTER / "rayservice.yaml"
ENTRY_POINT = "app.deployments.builder:build_app"
DEPLOYMENT_NAMES = {"LLMServer", "OpenAIIngress", "KVIndex"}

YAML_FILES = [DEFAULT_CONFIG, *sorted(CLUSTER.glob("*.yaml"))]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def serve_config_of(path: Path) -> dict | None:
    """The Ray Serve config a YAML deploys (a RayService's serveConfigV2), or None for other files."""
    doc = load(path)
    if doc.get("kind") == "RayService":
        return yaml.safe_load(doc["spec"]["serveConfigV2"])
    return doc if "applications" in doc else None


def app_of(serve_config: dict) -> dict:
    (application,) = serve_config["applications"]
    return application


def replicas(application: dict, name: str) -> int:
    return next(d["num_replicas"] for d in application["deployments"] if d["name"] == name)


def ray_pin() -> str:
    m = re.search(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml must pin ray[serve]==X.Y.Z"
    return m.group(1)


def test_cluster_dir_has_the_expected_files():
    assert {p.name for p in YAML_FILES} >= {"serve_config.yaml", "serve_config_70b.yaml",
                                              "ray-cluster.yaml", "rayservice.yaml"}


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_parses_and_is_a_known_kind(path):
    doc = load(path)
    assert isinstance(doc, dict), f"{path} is not a YAML mapping"
    assert serve_config_of(path) is not None or "provider" in doc, (
        f"{path} is neither a Serve config, a RayService nor a Ray cluster launcher config")


SERVE_YAMLS = [p for p in YAML_FILES if serve_config_of(p) is not None]


@pytest.mark.parametrize("path", SERVE_YAMLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_serve_config_is_valid(path):
    from ray.serve.schema import ServeDeploySchema

    serve_config = serve_config_of(path)
    ServeDeploySchema.model_validate(serve_config)  # Ray Serve's own check of `serve deploy` input
    application = app_of(serve_config)
    assert application["import_path"] == ENTRY_POINT
    ServerConfig.model_validate(application["args"])
    names = {d["name"] for d in application.get("deployments", [])}
    assert names <= DEPLOYMENT_NAMES, f"unknown deployment names {names - DEPLOYMENT_NAMES} in {path}"


def test_70b_config_is_two_nodes_of_eight_gpus():
    application = app_of(load(CONFIG_70B))
    config = ServerConfig.model_validate(application["args"])
    engine = config.engine
    assert engine.tensor_parallel_size == 8
    assert engine.device == "cuda"
    assert engine.kv_cache_dtype == "fp4"
    assert engine.max_model_len >= 32768
    assert engine.model.startswith("/"), "the 70B model is a local directory, the same path on every node"
    assert config.placement.strategy == "STRICT_PACK"
    assert config.api_keys == [], "API keys come from APP_API_KEYS, not from the file"
    assert replicas(application, "LLMServer") == 2


def test_rayservice_embeds_the_70b_config():
    config_70b = load(CONFIG_70B)
    embedded = serve_config_of(RAYSERVICE)
    assert embedded["applications"] == config_70b["applications"], (
        "cluster/rayservice.yaml serveConfigV2 differs from cluster/serve_config_70b.yaml: keep them identical")
    assert embedded.get("proxy_location") == config_70b.get("proxy_location")


def test_rayservice_has_one_worker_pod_per_replica():
    spec = load(RAYSERVICE)["spec"]
    assert load(RAYSERVICE)["apiVersion"] == "ray.io/v1"
    application = app_of(serve_config_of(RAYSERVICE))
    engine = ServerConfig.model_validate(application["args"]).engine
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin()
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    n = replicas(application, "LLMServer")
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == n
    (container,) = group["template"]["spec"]["containers"]
    for kind in ("requests", "limits"):
        assert int(container["resources"][kind]["nvidia.com/gpu"]) == engine.tensor_parallel_size
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(engine.model.startswith(m.rstrip("/") + "/") for m in mounts), (
        f"no volume of the worker pods holds the model directory {engine.model}")


def test_ray_cluster_launcher_config_is_valid():
    from ray.autoscaler._private.util import prepare_config, validate_config

    doc = load(RAY_CLUSTER)
    validate_config(prepare_config(copy.deepcopy(doc)))  # Ray's launcher schema + its own checks
    application = app_of(load(CONFIG_70B))
    engine = ServerConfig.model_validate(application["args"]).engine
    head = doc["available_node_types"][doc["head_node_type"]]
    assert head["resources"]["CPU"] == 0, "replicas must land on the GPU nodes, where /models is"
    (worker,) = [t for name, t in doc["available_node_types"].items() if name != doc["head_node_type"]]
    assert worker["resources"]["GPU"] == engine.tensor_parallel_size
    n = replicas(application, "LLMServer")
    assert worker["min_workers"] == worker["max_workers"] == doc["max_workers"] == n
    assert doc["docker"]["image"].startswith(f"rayproject/ray:{ray_pin()}-")
    setup = " ".join(doc["setup_commands"])
    assert "download.pytorch.org/whl/cu" in setup and "pip install -e" in setup


def test_dockerfile_uses_the_pinned_ray():
    assert f"FROM rayproject/ray:{ray_pin()}-" in (CLUSTER / "Dockerfile").read_text()


def _builder():
    try:
        from app.deployments import builder
    except ImportError as e:  # the ingress is written concurrently and may not import yet
        pytest.skip(f"app.deployments.builder does not import yet ({e}); placement not checked")
    return builder


def test_70b_replica_takes_one_node_of_eight_gpus():
    builder = _builder()
    config = ServerConfig.model_validate(app_of(load(CONFIG_70B))["args"])
    options = builder.placement_options(config)
    (bundle,) = options["placement_group_bundles"]
    # The replica reserves the node's 8 GPUs and starts its 8 worker processes: one replica = one node.
    assert bundle["GPU"] == 8 and options["ray_actor_options"]["num_gpus"] == 8
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert bundle["CPU"] <= 192 - 1  # fits a p5.48xlarge beside an ingress replica


def test_mp_executor_replica_takes_the_node_in_one_bundle():
    builder = _builder()
    config = ServerConfig.model_validate({"engine": {"device": "cuda", "tensor_parallel_size": 8,
                                                     "distributed_executor_backend": "mp"}})
    options = builder.placement_options(config)
    (bundle,) = options["placement_group_bundles"]
    # The workers are the replica's child processes: the replica reserves all 8 GPUs itself.
    assert bundle["GPU"] == 8 and options["ray_actor_options"]["num_gpus"] == 8
    assert options["ray_actor_options"]["num_cpus"] == bundle["CPU"] == 1 + 8 * 1.0


def test_a_gpu_fraction_replica_takes_that_share_of_one_gpu():
    builder = _builder()
    config = ServerConfig.model_validate({"engine": {"device": "cuda", "gpu_fraction": 0.45}})
    options = builder.placement_options(config)
    (bundle,) = options["placement_group_bundles"]
    # The replica runs the engine itself: it and its one bundle take 0.45 of a GPU, two fit one GPU.
    assert bundle == {"GPU": 0.45, "CPU": 1.0}
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.45}
    whole = builder.placement_options(ServerConfig.model_validate({"engine": {"device": "cuda"}}))
    assert whole["placement_group_bundles"] == [{"GPU": 1.0, "CPU": 1.0}]


def test_default_config_fits_a_cpu_machine():
    builder = _builder()
    config = ServerConfig.model_validate(app_of(load(DEFAULT_CONFIG))["args"])
    options = builder.placement_options(config)
    (bundle,) = options["placement_group_bundles"]
    assert "GPU" not in bundle and bundle["CPU"] < 1


def test_replicas_get_serve_throughput_optimized_env(monkeypatch):
    builder = _builder()
    for name in builder.THROUGHPUT_OPTIMIZED_ENV:
        monkeypatch.delenv(name, raising=False)
    config = ServerConfig.model_validate(app_of(load(DEFAULT_CONFIG))["args"])
    assert config.serve_throughput_optimized  # the default
    options = builder.with_serve_env(config, {"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}})
    assert options["num_cpus"] == 1 and options["runtime_env"]["pip"] == ["x"]
    assert options["runtime_env"]["env_vars"] == {"A": "1", **builder.THROUGHPUT_OPTIMIZED_ENV}
    assert options["runtime_env"]["env_vars"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    # A variable set where the app is built (the cluster's own choice) is not overridden.
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
    env = builder.with_serve_env(config, {})["runtime_env"]["env_vars"]
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in env and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    off = config.model_copy(update={"serve_throughput_optimized": False})
    assert builder.with_serve_env(off, {"num_cpus": 1}) == {"num_cpus": 1}


def test_a_replica_runs_with_its_gil_switch_interval():
    """LLMServer sets gil_switch_interval_s for its process (the value configured, read back from Python), None
    leaves the process's; the setting refuses intervals CPython cannot hold (it keeps whole microseconds). The
    replica's constructor also routes the project's loggers through Serve's handlers (logs.install): undone
    here, so that later tests' log capture still sees them."""
    import logging
    import sys

    from pydantic import ValidationError

    from app.deployments import logs
    from app.deployments.llm_server import LLMServer

    before = sys.getswitchinterval()
    project, serve_logger = logging.getLogger(logs.PROJECT_LOGGER), logging.getLogger(logs.SERVE_LOGGER)
    saved = project.handlers[:], project.propagate, project.level, serve_logger.filters[:]
    try:
        server = LLMServer({"gil_switch_interval_s": 0.002})  # the CPU default engine (tiny-llama)
        server.engine.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.002)
        server = LLMServer({"gil_switch_interval_s": None})
        server.engine.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)
        project.handlers[:], project.propagate, serve_logger.filters[:] = saved[0], saved[1], saved[3]
        project.setLevel(saved[2])
    assert ServerConfig().gil_switch_interval_s == 0.0005
    for bad in (0, 1e-7, 1.0):
        with pytest.raises(ValidationError, match="gil_switch_interval_s"):
            ServerConfig(gil_switch_interval_s=bad)
