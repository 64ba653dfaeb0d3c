"""Several replicas on one GPU: engine.gpu_fraction on a local Ray cluster whose one worker node
advertises one (fake) GPU. No CUDA: the replicas' actors only report what Ray gave them.

Each replica gets the placement group and actor options the builder derives for a CUDA engine at
gpu_fraction 0.45 (one bundle {"GPU": 0.45, "CPU": c}, the actor num_gpus 0.45, as Ray Serve starts
an LLMServer replica in bundle 0): two replicas are placed together on the node's one GPU, and a
third, which would need 1.35 GPUs there, stays pending.
"""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import ServerConfig
from app.deployments.builder import placement_options

FRACTION = 0.45


@pytest.fixture(scope="module")
def one_gpu_node():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    node = cluster.add_node(num_cpus=3, num_gpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield node.node_id
    ray.shutdown()
    cluster.shutdown()


@ray.remote
class Replica:
    """Stands in for an LLMServer replica: started the way Serve starts one, reporting its placement."""

    def placement(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "resources": ctx.get_assigned_resources(), "placement_group_id": ctx.get_placement_group_id()}


def test_two_replicas_at_045_share_the_one_gpu_and_a_third_waits(one_gpu_node):
    options = placement_options(ServerConfig.model_validate(
        {"engine": {"device": "cuda", "gpu_fraction": FRACTION}, "placement": {"replica_cpus": 0.5}}))
    assert options["placement_group_bundles"] == [{"GPU": FRACTION, "CPU": 0.5}]
    pgs = [placement_group(options["placement_group_bundles"], strategy=options["placement_group_strategy"])
           for _ in range(3)]
    try:
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=2, timeout=60)
        assert len(ready) == 2
        placed = [pg for pg in pgs if placement_group_table(pg)["state"] == "CREATED"]
        (pending,) = [pg for pg in pgs if pg not in placed]
        replicas = [Replica.options(**options["ray_actor_options"], scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote() for pg in placed]
        infos = ray.get([r.placement.remote() for r in replicas], timeout=60)
        for info, pg in zip(infos, placed):
            assert info["node_id"] == one_gpu_node
            assert info["gpu_ids"] == [0] and info["cuda_visible_devices"] == "0"  # the node's one GPU, both
            assert info["resources"]["GPU"] == pytest.approx(FRACTION)
            assert info["placement_group_id"] == pg.id.hex()
        assert ray.available_resources().get("GPU", 0) == pytest.approx(1 - 2 * FRACTION)
        # 0.1 GPU is left: the third replica's group waits whole, on no node
        table = placement_group_table(pending)
        assert table["state"] == "PENDING" and table["bundles"] == {0: {"GPU": FRACTION, "CPU": 0.5}}
        # once a replica goes, the third takes its share of the same GPU
        for r in replicas:
            ray.kill(r)
        remove_placement_group(placed[0])
        assert ray.get(pending.ready(), timeout=60)
        third = Replica.options(**options["ray_actor_options"], scheduling_strategy=PlacementGroupSchedulingStrategy(
            pending, placement_group_bundle_index=0)).remote()
        info = ray.get(third.placement.remote(), timeout=60)
        assert info["node_id"] == one_gpu_node and info["gpu_ids"] == [0]
    finally:
        for pg in pgs:
            remove_placement_group(pg)
