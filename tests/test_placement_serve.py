"""Node-sized LLMServer replicas through Ray Serve, on a local cluster of two fake 8-GPU nodes.

The application is deployed the way `serve run` deploys a config: a tensor_parallel_size 8
engine (a small dummy Llama with 8 KV heads; the workers compute on CPU with gloo since the GPUs
are fake), each replica's placement group 8 x {"GPU": 1, "CPU": c} STRICT_PACK. Two replicas must
take one node each, 8 workers on 8 distinct GPUs of their node; a third must stay pending rather
than split across nodes, and Serve must say so.
"""

import json
import os
import time

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from app.config import ServerConfig
from app.deployments.builder import placement_options
from tests.serve_testing import REPO_ROOT, wait_until

APP = "llm"
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 320, "max_position_embeddings": 512, "model_type": "llama",
          "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # the controller's "cannot be scheduled" notice, after 5 s instead of 30 and not just once per 30 s
    os.environ["RAY_SERVE_SLOW_STARTUP_WARNING_S"] = "5"
    os.environ["RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=2, num_gpus=8) for _ in range(2)]
    ray.init(address=c.address)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    model_dir = tmp_path_factory.mktemp("tp8-model")
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    try:
        yield c, nodes, str(model_dir)
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def deploy(model_dir: str, num_replicas: int, blocking: bool) -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    args = {"engine": {"model": model_dir, "load_format": "dummy", "tensor_parallel_size": 8, "distributed_executor_backend": "ray", "device": "cpu",
                       "num_kv_blocks": 64, "max_model_len": 256},
            "placement": {"cpus_per_worker": 0.1, "replica_cpus": 0.1}}
    # what the builder derives for CUDA engines, with the engine itself on CPU (the GPUs are fake)
    gpu_args = {**args, "engine": {**args["engine"], "device": "cuda"}}
    placement = placement_options(ServerConfig.model_validate(gpu_args))
    assert len(placement["placement_group_bundles"]) == 8
    assert all(b["GPU"] == 1 for b in placement["placement_group_bundles"])
    app = {"name": APP, "route_prefix": "/", "import_path": "app.deployments.builder:build_app", "args": args,
           "deployments": [{"name": "LLMServer", "num_replicas": num_replicas, **placement},
                           {"name": "OpenAIIngress", "ray_actor_options": {"num_cpus": 0.1}}]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}), _blocking=blocking)


def _replica_states() -> dict:
    status = serve.status().applications.get(APP)
    if status is None or "LLMServer" not in status.deployments:
        return {}
    return dict(status.deployments["LLMServer"].replica_states)


# Two minutes on the 2-core CI machine: the slow tier. The default suite keeps the same placement
# rules at the Ray level (tests/test_placement.py: whole-node TP8 groups, a third one pending).
@pytest.mark.slow
def test_two_tp8_replicas_take_one_node_each_and_a_third_stays_pending(cluster):
    _, nodes, model_dir = cluster
    deploy(model_dir, 2, blocking=False)
    assert wait_until(lambda: _replica_states().get("RUNNING") == 2, timeout_s=300), serve.status()

    handle = serve.get_deployment_handle("LLMServer", APP)
    infos = {}
    deadline = time.monotonic() + 60
    while len(infos) < 2 and time.monotonic() < deadline:  # each call reaches one replica
        info = handle.worker_info.remote().result()
        infos[info["replica_id"]] = info["workers"]
    assert len(infos) == 2
    worker_nodes = {node.node_id for node in nodes}
    used = []
    for workers in infos.values():
        assert len(workers) == 8
        (node_id,) = {w["node_id"] for w in workers}  # one node per replica
        assert node_id in worker_nodes
        gpus = [g for w in workers for g in w["gpu_ids"]]
        assert sorted(gpus, key=int) == [str(i) for i in range(8)]  # 8 distinct GPUs, one each
        used.append(node_id)
    assert len(set(used)) == 2  # the two replicas on different nodes

    # the engines work across their 8 workers
    from app.serving_types import GenerateRequest
    from app.engine.sampling_params import SamplingParams

    outs = list(handle.options(stream=True).generate.remote(
        GenerateRequest("tp8", [1, 5, 9, 13], SamplingParams(temperature=0, max_tokens=3))))
    assert outs[-1].finished and len(outs[-1].token_ids) == 3

    # a third node-sized replica fits nowhere: it stays pending, whole, and Serve says why
    deploy(model_dir, 3, blocking=False)

    def pending_notice() -> str:
        status = serve.status().applications.get(APP)
        message = status.deployments["LLMServer"].message if status and "LLMServer" in status.deployments else ""
        return message if "to be scheduled" in message else ""

    message = wait_until(pending_notice, timeout_s=90)
    assert "1 replicas that have taken more than" in message, serve.status()
    assert "'GPU': 8.0" in message or "GPU" in message  # the notice names the resources it waits for
    states = _replica_states()
    assert states.get("RUNNING") == 2 and sum(states.values()) == 3, states
    pending = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING"]
    assert len(pending) == 1 and len(pending[0]["bundles"]) == 8 and pending[0]["strategy"] == "STRICT_PACK"
