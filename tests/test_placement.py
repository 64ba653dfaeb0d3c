"""Multi-node placement on a local Ray cluster of two fake 8-GPU nodes (no real GPU, no CUDA).

A replica's placement group is 8 bundles {"GPU": 1, "CPU": c}, STRICT_PACK: two replicas take the
two nodes, each with its 8 workers on 8 distinct GPUs of one node; a third stays pending rather
than being split across nodes, and is placed once a node frees up. Workers here only record
their placement (no weights), except in the last test, where a TP=2 engine computes on the CPU
(device "cpu") while its workers hold fake GPUs.
"""

from __future__ import annotations

import logging
import os

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from app import LLM, SamplingParams
from app.engine.placement import PLACEMENT_STRATEGY, placement_bundles
from app.engine.ray_executor import TPWorkerGroup

from tp_testing import run_in_placement_group

GPUS_PER_NODE = 8


@pytest.fixture(scope="module")
def gpu_nodes():
    """Node ids of two fake 8-GPU nodes (the head node has 1 CPU and no GPU)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    nodes = [cluster.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield [n.node_id for n in nodes]
    ray.shutdown()
    cluster.shutdown()


def assert_one_node_eight_gpus(info: list[dict], pg) -> str:
    assert [i["rank"] for i in info] == [i["bundle_index"] for i in info] == list(range(GPUS_PER_NODE))
    assert len({i["node_id"] for i in info}) == 1
    assert sorted(int(i["gpu_ids"][0]) for i in info) == list(range(GPUS_PER_NODE))
    assert all(i["gpu_ids"] == [i["cuda_visible_devices"]] for i in info)
    assert {i["placement_group_id"] for i in info} == {pg.id.hex()}
    return info[0]["node_id"]


def test_tp8_replicas_take_whole_nodes_and_a_third_stays_pending(gpu_nodes, caplog):
    bundles = placement_bundles(GPUS_PER_NODE, 0.1, gpu=True)
    pgs = [placement_group(bundles, strategy=PLACEMENT_STRATEGY) for _ in range(3)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=2, timeout=60)
    assert len(ready) == 2
    placed = [pg for pg in pgs if placement_group_table(pg)["state"] == "CREATED"]
    (pending,) = [pg for pg in pgs if pg not in placed]
    groups = [TPWorkerGroup(GPUS_PER_NODE, placement_group=pg) for pg in placed]
    try:
        nodes = [assert_one_node_eight_gpus(g.worker_info(), pg) for g, pg in zip(groups, placed)]
        assert sorted(nodes) == sorted(gpu_nodes)  # one replica per node
        # The third replica is not split across the nodes' leftovers: it waits, whole.
        table = placement_group_table(pending)
        assert table["state"] == "PENDING" and not any(table["bundles_to_node_id"].values())
        # A replica that creates its own group reports what did not fit, and gives up cleanly.
        with caplog.at_level(logging.WARNING, logger="app.engine.ray_executor"):
            with pytest.raises(RuntimeError, match=r"8 bundles \{'GPU': 1.0, 'CPU': 0.1\} \(STRICT_PACK: all on one "
                                                   r"node\) was not placed within 6 s"):
                TPWorkerGroup(GPUS_PER_NODE, gpu=True, cpus_per_worker=0.1, placement_timeout_s=6)
        assert "waiting for a placement group of 8 bundles" in caplog.text
        # A node frees up: the pending replica takes it, whole.
        groups.pop(0).shutdown()
        remove_placement_group(placed[0])
        ray.get(pending.ready(), timeout=60)
        groups.append(TPWorkerGroup(GPUS_PER_NODE, placement_group=pending))
        assert assert_one_node_eight_gpus(groups[-1].worker_info(), pending) == nodes[0]
    finally:
        for g in groups:
            g.shutdown()
        for pg in pgs:
            remove_placement_group(pg)


# 70 s on the 2-core CI machine: the slow tier. The default suite runs the Ray executor's TP=2
# workers in a caller's placement group (tests/test_tensor_parallel.py) and on fake-GPU nodes above.
@pytest.mark.slow
def test_tp2_engine_on_fake_gpus_computes_on_cpu(gpu_nodes):
    """The Ray Serve layout in miniature: the replica in bundle 0, one worker per fake GPU."""
    pg = placement_group(placement_bundles(2, 0.1, gpu=True, driver_cpus=0.1), strategy=PLACEMENT_STRATEGY)
    ray.get(pg.ready(), timeout=60)
    try:
        tokens, info = run_in_placement_group(pg, model="tiny-llama", tensor_parallel_size=2, device="cpu",
                                              distributed_executor_backend="ray")
    finally:
        remove_placement_group(pg)
    assert len({i["node_id"] for i in info}) == 1 and {i["device"] for i in info} == {"cpu"}
    assert len({i["gpu_ids"][0] for i in info}) == 2 and all(i["cuda_visible_devices"] for i in info)
    assert tokens == LLM(model="tiny-llama").generate(["hello"], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
