"""`build_app(args) -> Application`: the entry point `serve run serve_config.yaml` imports.

`args` is a ServerConfig (app/config.py). The application is three deployments with stable names:
`OpenAIIngress` (HTTP + Python handle API, stateless, scales out) in front of `LLMServer` (one
engine replica per node), and `KVIndex` (one replica, no resources: it owns the application's KV
index actor, which the replicas publish to and the routers follow; app/deployments/kv_index.py). Each LLMServer replica gets a placement group sized to its
tensor-parallel workers (placement_options below). Every Ray Serve option is derived here from
`args`; an option set under `deployments:` in the YAML overrides the derived one (Ray Serve applies
it after this builder runs).
"""

from __future__ import annotations

import os

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import ServerConfig
from app.deployments.ingress import OpenAIIngress
from app.deployments.kv_index import INDEX_DEPLOYMENT_NAME, KVIndex
from app.deployments.llm_server import LLMServer
from app.engine.placement import DEFAULT_CPUS_PER_WORKER, placement_bundles

LLM_SERVER_NAME = "LLMServer"
INGRESS_NAME = "OpenAIIngress"
_INGRESS_CPUS = 0.2


def uses_gpu(config: ServerConfig) -> bool:
    return config.engine.device.startswith("cuda")


def placement_options(config: ServerConfig) -> dict:
    """Ray Serve options that place one LLMServer replica on one node.

    tensor_parallel_size n > 1: n bundles {"GPU": 1, "CPU": cpus_per_worker} (no GPU key on CPU),
    bundle 0 enlarged by the replica's own CPUs since Ray Serve starts the replica in bundle 0;
    the engine starts its n workers on bundles 0..n-1. n = 1: one bundle with the replica, which
    runs the engine in-process (and takes the GPU on GPU devices, or engine.gpu_fraction of one, so
    that several replicas share it: two at 0.45 fit one GPU). With distributed_executor_backend
    "mp" the workers are the replica's own child processes, so the replica takes everything: one
    bundle {"GPU": n, "CPU": replica_cpus + n x cpus_per_worker}, all of it reserved by the replica
    (Ray then makes exactly those n GPUs visible to it).
    """
    gpu = uses_gpu(config)
    p = config.placement
    cpus_per_worker = p.cpus_per_worker if p.cpus_per_worker is not None else DEFAULT_CPUS_PER_WORKER[gpu]
    replica_cpus = p.replica_cpus if p.replica_cpus is not None else (1.0 if gpu else 0.2)
    tp = config.engine.tensor_parallel_size
    if tp > 1 and config.engine.distributed_executor_backend == "mp":
        cpus = replica_cpus + tp * cpus_per_worker
        return {
            "ray_actor_options": {"num_cpus": cpus, "num_gpus": float(tp) if gpu else 0.0},
            "placement_group_bundles": [{"CPU": cpus, **({"GPU": float(tp)} if gpu else {})}],
            "placement_group_strategy": p.strategy,
        }
    fraction = config.engine.gpu_fraction
    bundles = placement_bundles(tp, cpus_per_worker if tp > 1 else 0.0, gpu, driver_cpus=replica_cpus,
                                gpu_fraction=fraction if gpu else None)
    # tp 1: the engine runs in the replica, which takes the GPU (or its gpu_fraction of one); tp > 1:
    # the workers take them.
    actor = {"num_cpus": replica_cpus, "num_gpus": (fraction or 1.0) if gpu and tp == 1 else 0.0}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": bundles,
        "placement_group_strategy": p.strategy,
    }


KV_ROUTER_CLASS = "app.router.kv_router:KVAwareRouter"


def router_options(config: ServerConfig) -> dict:
    """request_router_config of the LLMServer deployment: the KV-aware router unless disabled."""
    r = config.router
    if not r.enabled:  # Ray Serve's default router, but the replicas' stats still refresh as often
        return {"request_router_config": RequestRouterConfig(request_routing_stats_period_s=r.routing_stats_period_s)}
    return {"request_router_config": RequestRouterConfig(
        request_router_class=KV_ROUTER_CLASS,
        request_router_kwargs=r.model_dump(),  # KVAwareRouter.initialize_state validates them again
        request_routing_stats_period_s=r.routing_stats_period_s,
    )}


# Ray Serve's throughput-optimized mode, minus direct ingress (its controller would need the flag too)
# and with replica logs written as by default: on stderr (serve run's terminal shows client-error
# warnings) and to the log files line by line (the mode buffers 1,000 records).
THROUGHPUT_OPTIMIZED_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def with_serve_env(config: ServerConfig, actor_options: dict) -> dict:
    """actor_options with the serve_throughput_optimized variables in its runtime_env (those the
    environment building the application already sets are left to it)."""
    if not config.serve_throughput_optimized:
        return actor_options
    env = {k: v for k, v in THROUGHPUT_OPTIMIZED_ENV.items() if k not in os.environ}
    if not env:
        return actor_options
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
    return {**actor_options, "runtime_env": runtime_env}


def build_app(args: dict | ServerConfig | None = None) -> Application:
    """The application `serve run` deploys; `args` are the `args:` of serve_config.yaml.

    Settings that cannot work together raise UnsupportedSettingError here, naming each, so that
    `serve run` fails at once rather than in replicas that Serve restarts again and again."""
    from app.engine.setting_checks import check_settings

    config = ServerConfig.model_validate(args or {})
    check_settings(config.engine)
    engine = config.engine
    placement = placement_options(config)
    placement["ray_actor_options"] = with_serve_env(config, placement["ray_actor_options"])
    server = serve.deployment(LLMServer).options(
        name=LLM_SERVER_NAME,
        # Every running and queued request is one ongoing call; the engine refuses beyond its queue.
        max_ongoing_requests=engine.max_num_seqs + config.max_queued_requests,
        # What a caller (an ingress replica) may queue while every replica is at max_ongoing_requests;
        # beyond it the handle raises BackPressureError, which the ingress answers with 503 + Retry-After.
        max_queued_requests=config.max_queued_requests,
        health_check_period_s=10,
        health_check_timeout_s=60,
        **placement,
        **router_options(config),
    )
    index = serve.deployment(KVIndex).options(
        name=INDEX_DEPLOYMENT_NAME, num_replicas=1, ray_actor_options=with_serve_env(config, {"num_cpus": 0}),
        health_check_period_s=2, health_check_timeout_s=30,
    )
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_NAME,
        max_ongoing_requests=4 * (engine.max_num_seqs + config.max_queued_requests),
        ray_actor_options=with_serve_env(config, {"num_cpus": _INGRESS_CPUS}),
    )
    return ingress.bind(server.bind(config, kv_index=index.bind(config)), config)
