"""The router-local copy of the KV index: the index actor's change log (the class itself), and the
follower thread against a real index actor in a local Ray, including the actor's death and a new
one taking its place."""

import os
import time

import pytest

from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from app.kv_events.wire import encode_batch
from app.router.index_actor import CHANGE_LOG_LEN, INDEX_NAMESPACE, KVIndexActor, index_actor_name
from app.router.index_follower import IndexFollower


def stored(*hashes):
    return BlockStored(list(hashes), None, [], 4)


def batch(*events):
    return encode_batch(0.0, list(events))


def test_change_log_continues_a_copy_or_asks_it_to_reload():
    index = KVIndexActor(max_blocks=50, predicted_ttl_s=5)
    assert index.changes(None, 0)[2] is None  # a copy that never synced loads a dump
    index.publish("a", 1, batch(stored(1, 2)))
    index.record_routed("b", [1])
    index.publish("a", 2, batch(BlockRemoved([2])))
    epoch, version, entries = index.changes(index.epoch, 1)
    assert version == 3 and [(v, kind, r) for v, kind, r, _ in entries] == [(2, "routed", "b"), (3, "events", "a")]
    assert index.changes(index.epoch, 3)[2] == []
    assert index.changes(index.epoch, 4)[2] is None  # ahead of this index: not its log
    # a copy of a previous epoch applies this index's log from its start (it began at 1)
    assert [v for v, *_ in index.changes("an-older-epoch", 3)[2]] == [1, 2, 3]
    epoch, version, settings, blocks = index.dump()
    assert (version, settings, blocks) == (3, {"max_blocks": 50, "predicted_ttl_s": 5}, {"a": [1]})


def test_a_copy_too_far_behind_reloads():
    index = KVIndexActor()
    for i in range(CHANGE_LOG_LEN + 5):
        index.record_routed("a", [i])
    assert index.changes(index.epoch, 2)[2] is None
    assert len(index.changes(index.epoch, index.version - 10)[2]) == 10


@pytest.fixture(scope="module")
def ray_local():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _start_index(ray, app):
    actor = ray.remote(KVIndexActor).options(name=index_actor_name(app), namespace=INDEX_NAMESPACE,
                                             num_cpus=0).remote(max_blocks=1000, predicted_ttl_s=60)
    ray.get(actor.ping.remote())
    return actor


def _wait(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_follower_tracks_the_index_and_routes_on_its_copy_while_the_index_is_dead(ray_local):
    ray = ray_local
    actor = _start_index(ray, "f1")
    ray.get(actor.publish.remote("a", 1, batch(stored(10, 11, 12))))
    follower = IndexFollower("f1", poll_s=0.05, call_timeout_s=1.0)
    try:
        assert _wait(lambda: follower.match([10, 11, 12]) == {"a": 3})
        assert follower.index.max_blocks == 1000  # the copy has the index's settings (from its dump)
        ray.get(actor.publish.remote("b", 1, batch(stored(10, 11))))
        ray.get(actor.publish.remote("a", 2, batch(BlockRemoved([12]))))
        assert _wait(lambda: follower.match([10, 11, 12]) == {"a": 2, "b": 2})
        # this router's routing history is in the copy at once, and reaches the index (other routers)
        follower.record_routed("c", [20, 21])
        assert follower.match([20, 21]) == {"c": 2}
        assert _wait(lambda: ray.get(actor.match.remote([20, 21])) == {"c": 2})

        ray.kill(actor, no_restart=True)
        t0 = time.perf_counter()
        for _ in range(100):
            assert follower.match([10, 11, 12]) == {"a": 2, "b": 2}  # stale, not missing, and no wait
        assert time.perf_counter() - t0 < 0.5
        assert _wait(lambda: follower.num_errors > 0)

        # a new index (new epoch): replica a resyncs with a snapshot, b has not yet
        actor = _start_index(ray, "f1")
        ray.get(actor.publish.remote("a", 3, batch(AllBlocksCleared(), stored(30, 31))))
        assert _wait(lambda: follower.match([30, 31]) == {"a": 2})
        assert follower.match([10, 11]) == {"b": 2}  # a's old blocks went with its snapshot
        assert follower.epoch == ray.get(actor.ping.remote())
    finally:
        follower.close()


def test_index_deployment_health_check_waits_out_a_restart_and_replaces_a_dead_index(ray_local):
    """The KVIndex deployment's health check: an index Ray is restarting, or one slow to answer,
    keeps the deployment healthy (failing it would make Serve replace the deployment's replica,
    whose destructor kills the index for good: the flake CI once hit); an index dead for good is
    replaced under the same name; one unresponsive past the limit fails the check."""
    from app.deployments.kv_index import KVIndex
    from app.router.index_actor import get_index

    class _SlowIndex(KVIndexActor):
        """An index whose ping hangs while `hang` is set (a loaded node, or a restart in progress)."""

        def __init__(self, **kw):
            super().__init__(**kw)
            self.hang = False

        async def set_hang(self, hang: bool) -> None:
            self.hang = hang

        async def ping(self) -> str:
            import asyncio

            while self.hang:
                await asyncio.sleep(0.05)
            return self.epoch

    ray = ray_local
    app = "hc1"
    deployment = KVIndex.__new__(KVIndex)  # the Serve constructor needs a replica context
    deployment._name = index_actor_name(app)
    deployment._options = {"max_blocks": 1000, "predicted_ttl_s": 60}
    deployment.actor = deployment._create(timeout_s=30.0)
    deployment._unresponsive_since = None
    deployment.PING_TIMEOUT_S = 0.5
    deployment.UNRESPONSIVE_LIMIT_S = 1.5
    try:
        epoch = ray.get(deployment.actor.ping.remote())
        # restarted by Ray (max_restarts=-1): the check passes, the actor comes back, same handle
        ray.kill(deployment.actor, no_restart=False)
        deployment.check_health()
        assert _wait(lambda: _alive(ray, deployment.actor) not in (None, epoch))
        deployment.check_health()
        assert deployment._unresponsive_since is None

        # killed for good: the check creates a new index under the application's name
        old = deployment.actor
        ray.kill(old, no_restart=True)
        assert _wait(lambda: _alive(ray, old) is None)
        deployment.check_health()
        assert deployment.actor is not old and ray.get(get_index(app).ping.remote())

        # slow, then unresponsive past the limit: passes, then fails
        slow = ray.remote(_SlowIndex).options(num_cpus=0, max_concurrency=64).remote()
        ray.get(slow.ping.remote())
        ray.get(slow.set_hang.remote(True))
        ray.kill(deployment.actor, no_restart=True)
        deployment.actor = slow
        deployment.check_health()  # 0.5 s unanswered: waited for
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="unresponsive"):
            while time.monotonic() - t0 < 10:
                deployment.check_health()
        ray.get(slow.set_hang.remote(False))
        deployment.check_health()
        assert deployment._unresponsive_since is None
    finally:
        ray.kill(deployment.actor, no_restart=True)
        deployment.actor = None  # its destructor has nothing left to kill


def _alive(ray, actor):
    try:
        return ray.get(actor.ping.remote(), timeout=1)
    except Exception:
        return None
