"""KV events over real ZMQ sockets (app/kv_events/zmq_transport.py): the subscriber keeps up with 10k
events/s, fills dropped sequence numbers from the replay socket, reports what the replay no
longer holds; the rehasher keys a publisher's blocks by our chain hash.

The publisher is vLLM's own `ZmqEventPublisher` where vLLM is installed (the vLLM CI step), and
ours (app/kv_events/zmq_transport.py, written from vLLM's protocol: PUB frames topic / 8-byte sequence
/ msgpack batch; a ROUTER replay socket answering `[b"", start]` with the buffered batches and
an end marker) with a switch to drop chosen sequence numbers on the PUB socket.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import msgpack
import pytest

from app.kv_events.block_hash import hash_request_tokens
from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from app.kv_events.zmq_transport import BlockRehasher, ZmqEventPublisher, ZmqEventSubscriber
from app.router.index import PrefixIndex

BS = 4


class DroppingPublisher(ZmqEventPublisher):
    """Our publisher of vLLM's protocol, dropping chosen sequence numbers on the PUB socket only
    (as a slow subscriber's HWM would); the replay buffer keeps them."""

    drop: frozenset[int] = frozenset()

    def _send(self, seq: int, payload: bytes) -> None:
        if seq not in self.drop:
            super()._send(seq, payload)

    def publish_maps(self, events: list[dict]) -> int:
        """A batch of events given in vLLM's wire layout (maps, publisher-side hashes)."""
        return self.publish_payload(msgpack.packb([time.time(), events, 0], use_bin_type=True))


def _endpoints(tmp_path) -> tuple[str, str]:
    name = uuid.uuid4().hex[:8]
    return f"ipc://{tmp_path}/{name}.pub", f"ipc://{tmp_path}/{name}.replay"


def _their_hash(token_ids) -> bytes:  # any publisher-side hash: not ours
    return hashlib.sha256(repr(list(token_ids)).encode()).digest()


def _stored(prefix: list[int], new: list[int], parent: bytes | None) -> tuple[dict, list[bytes]]:
    """vLLM's BlockStored map for the blocks `new` extending `prefix` (whole blocks)."""
    hashes = [_their_hash(prefix + new[: (i + 1) * BS]) for i in range(len(new) // BS)]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": new,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes),
            "group_idx": 0, "kv_cache_spec_kind": "full_attention"}, hashes


def test_rehasher_keys_blocks_by_our_chain_hash():
    r = BlockRehasher(BS)
    tokens = list(range(100, 124))  # 6 blocks, stored in two events (the second's parent: the first's last)
    e1, h1 = _stored([], tokens[:8], None)
    e2, h2 = _stored(tokens[:8], tokens[8:], h1[-1])
    from app.kv_events.wire import event_from_wire

    out = r.translate([event_from_wire(e1), event_from_wire(e2)])
    ours = hash_request_tokens(tokens, BS)
    assert out[0] == BlockStored(ours[:2], None, tokens[:8], BS)
    assert out[1] == BlockStored(ours[2:], ours[1], tokens[8:], BS)
    # a second physical block with the same hash: removed only when both are
    assert r.translate([BlockStored([h2[-1]], h2[-2], tokens[20:], BS)]) == [BlockStored([ours[-1]], ours[-2],
                                                                                          tokens[20:], BS)]
    assert r.translate([BlockRemoved([h2[-1]])]) == []
    assert r.translate([BlockRemoved([h2[-1], h1[0], b"unknown"])]) == [BlockRemoved([ours[-1], ours[0]])]
    # an unknown parent, another block size, extra keys: left out and counted, never guessed
    assert r.translate([BlockStored([b"x"], b"never seen", list(range(BS)), BS),
                        BlockStored([b"y"], None, list(range(8)), 8),
                        BlockStored([b"z"], None, list(range(BS)), BS, [["lora", "a"]])]) == []
    assert r.num_unresolved == 3
    snap = r.snapshot_events()
    assert snap[0] == AllBlocksCleared() and {e.block_hashes[0] for e in snap[1:]} == set(ours[1:5])
    assert r.translate([AllBlocksCleared()]) == [AllBlocksCleared()] and r.num_blocks == 0


def _vllm_publisher(endpoint, replay_endpoint, buffer_steps):
    """vLLM's own publisher, where vLLM is installed; events go in as its msgspec structs."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")

    class Publisher:
        def __init__(self):
            self.p = kv_events.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                                 buffer_steps=buffer_steps)

        def publish_maps(self, events):
            structs = []
            for e in events:
                kind = e["type"]
                fields = {k: v for k, v in e.items() if k != "type"}
                structs.append(getattr(kv_events, kind)(**fields))
            self.p.publish(kv_events.KVEventBatch(ts=time.time(), events=structs))

        def close(self):
            self.p.shutdown()

    return Publisher()


@pytest.fixture(params=["wire", "vllm"])
def publisher_factory(request, tmp_path):
    made = []

    def make(buffer_steps=10_000):
        ep, rep = _endpoints(tmp_path)
        if request.param == "vllm":
            pub = _vllm_publisher(ep, rep, buffer_steps)
        else:
            pub = DroppingPublisher(ep, rep, buffer_steps=buffer_steps)
        made.append(pub)
        return pub, ep, rep

    yield make
    for pub in made:
        pub.close()


def _follow(ep, rep, block_size=BS, probe_s=1.0):
    """A subscriber feeding a rehasher and a PrefixIndex, as a replica and the index do."""
    rehasher, index, lost = BlockRehasher(block_size), PrefixIndex(), []
    lock = threading.Lock()

    def on_batch(events):
        with lock:
            index.apply_all("r", rehasher.translate(events))

    def on_lost(n):
        lost.append(n)
        with lock:
            index.apply_all("r", rehasher.reset())

    sub = ZmqEventSubscriber(ep, on_batch, replay_endpoint=rep, on_lost=on_lost, probe_s=probe_s).start()
    return sub, rehasher, index, lost


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_subscriber_keeps_up_with_10k_events_per_second_and_replays_a_dropped_batch(publisher_factory):
    """20k BlockStored/BlockRemoved events (each stored block re-hashed) published as fast as the
    publisher goes, two batches dropped on the PUB socket (the wire publisher) and the first ones
    sent before the subscription took effect: the subscriber takes them in at 10k+ events/s, and
    afterwards the index holds exactly the blocks still stored. The publisher is not paced: a
    paced one shares this process's GIL with the subscriber, and on a loaded CI host it fell
    short of the offered rate itself (the claim is about the subscriber, ~100k events/s here)."""
    pub, ep, rep = publisher_factory()
    time.sleep(0.1)
    sub, rehasher, index, lost = _follow(ep, rep)
    batches, per_batch = 200, 100  # 20k events
    if isinstance(pub, DroppingPublisher):
        pub.drop = {57, 143}
    sessions: list[list[int]] = []  # token ids of each chain stored so far
    parents: list[bytes | None] = []
    live: dict[int, list[int]] = {}  # session -> its tokens still stored (prefix)
    # the batches are built before the clock starts: the claim is about the subscriber, and a slow
    # host must not fail it by building (and hashing) events slower than 10k/s in this loop
    all_batches: list[list[dict]] = []
    n_events = 0
    for b in range(batches):
        events = []
        for k in range(per_batch):
            s = (b * per_batch + k) % 400
            if s >= len(sessions):  # a new chain: its first block
                tokens = [s, b, k, 7]
                ev, hs = _stored([], tokens, None)
                sessions.append(tokens)
                parents.append(hs[-1])
            elif (b + k) % 5 == 0 and live.get(s):  # evict the chain's last block
                tokens = sessions[s]
                events.append({"type": "BlockRemoved", "block_hashes": [parents[s]], "medium": "GPU"})
                sessions[s] = tokens = tokens[:-BS]
                parents[s] = _their_hash(tokens) if tokens else None
                live[s] = tokens
                n_events += 1
                continue
            else:  # extend it by one block
                new = [s % 97, b % 89, k % 83, 1]
                ev, hs = _stored(sessions[s], new, parents[s])
                sessions[s] = sessions[s] + new
                parents[s] = hs[-1]
            live[s] = sessions[s]
            events.append(ev)
            n_events += 1
        all_batches.append(events)
    t0 = time.perf_counter()
    for events in all_batches:
        pub.publish_maps(events)
    _wait(lambda: sub.next_seq == batches)
    follow_s = time.perf_counter() - t0
    sub.close()
    assert n_events / follow_s >= 10_000, f"the subscriber took in only {n_events / follow_s:.0f} events/s"
    assert lost == [] and sub.num_lost == 0 and sub.num_bad == 0
    assert sub.num_batches == batches and sub.num_events == n_events
    if isinstance(pub, DroppingPublisher):
        assert sub.num_replayed >= 2
    # the index now holds exactly the stored chains, by our hashes
    expected = {h for tokens in live.values() if tokens for h in hash_request_tokens(tokens, BS)}
    assert set(index.confirmed_blocks().get("r", [])) == expected
    assert rehasher.num_unresolved == 0
    for tokens in list(live.values())[:50]:
        if tokens:
            assert index.match(hash_request_tokens(tokens, BS)) == {"r": len(tokens) // BS}


def test_batches_the_replay_no_longer_holds_are_reported_lost(tmp_path):
    ep, rep = _endpoints(tmp_path)
    pub = DroppingPublisher(ep, rep, buffer_steps=3)
    try:
        time.sleep(0.1)
        sub, rehasher, index, lost = _follow(ep, rep)
        first, hs = _stored([], [1, 2, 3, 4], None)
        pub.publish_maps([first])
        _wait(lambda: sub.next_seq == 1)
        sub.probe_s = 3600  # from now no idle probe: the gap is found by batch 6, when the buffer holds 4..6
        replayed = sub.num_replayed  # batch 0 itself comes by replay when it beat the subscription
        assert index.num_blocks_of("r") == 1
        pub.drop = {1, 2, 3, 4, 5}
        for i in range(6):  # batches 1..6; the buffer keeps 4..6 only
            pub.publish_maps([_stored([1, 2, 3, 4], [i, i, i, i], hs[0])[0]])
        _wait(lambda: sub.next_seq == 7)
        sub.close()
        # 1..3 are gone: the index forgot the replica (AllBlocksCleared), then took 4..6, whose
        # parent (batch 0's block) is no longer known: left out, not guessed
        assert lost == [3] and sub.num_lost == 3 and sub.num_replayed - replayed == 2
        assert index.num_blocks_of("r") == 0 and rehasher.num_unresolved == 3
    finally:
        pub.close()


def test_a_dropped_last_batch_is_fetched_when_the_publisher_goes_quiet(tmp_path):
    """No later batch reveals the gap: after probe_s without batches the subscriber asks the
    replay socket for what came after its last one."""
    ep, rep = _endpoints(tmp_path)
    pub = DroppingPublisher(ep, rep)
    try:
        time.sleep(0.1)
        sub, _, index, lost = _follow(ep, rep, probe_s=0.3)
        first, hs = _stored([], [1, 2, 3, 4], None)
        pub.publish_maps([first])
        _wait(lambda: sub.next_seq == 1)
        pub.drop = {1}
        pub.publish_maps([_stored([1, 2, 3, 4], [5, 6, 7, 8], hs[0])[0]])
        _wait(lambda: sub.next_seq == 2, timeout=10)
        sub.close()
        assert sub.num_replayed >= 1 and lost == [] and index.num_blocks_of("r") == 2  # (the first, too, if early)
    finally:
        pub.close()


def test_a_malformed_batch_is_counted_and_skipped(tmp_path):
    ep, rep = _endpoints(tmp_path)
    pub = DroppingPublisher(ep, rep)
    try:
        time.sleep(0.1)
        sub, _, index, lost = _follow(ep, rep)
        pub.publish_payload(b"\xc1not msgpack")
        pub.publish_maps([_stored([], [1, 2, 3, 4], None)[0]])
        _wait(lambda: sub.next_seq == 2)
        sub.close()
        assert sub.num_bad == 1 and lost == [] and index.num_blocks_of("r") == 1
    finally:
        pub.close()


def test_our_replica_publishes_its_kv_events_the_way_vllm_does(tmp_path):
    """kv_events_endpoint: an LLMServer (our engine, outside Serve) publishes its KV event batches
    over ZMQ in vLLM's protocol; a subscriber of that protocol reads the prompt's blocks, and
    re-hashing them from their token ids gives the same (our) hashes back."""
    import asyncio

    from app.deployments.llm_server import LLMServer
    from app.serving_types import GenerateRequest
    from app.engine.sampling_params import SamplingParams

    ep = f"ipc://{tmp_path}/ours"
    server = LLMServer({"engine": {"model": "tiny-llama", "kv_cache_memory": "64MiB"}, "kv_events_endpoint": ep})
    try:
        assert server.stats()["kv_events_endpoint"] == ep
        received: list = []
        sub = ZmqEventSubscriber(ep, received.extend, replay_endpoint=server.stats()["kv_events_replay_endpoint"],
                                 on_lost=lambda n: received.append(("lost", n))).start()
        rehasher = BlockRehasher(16)
        prompt = list(range(10, 60))

        async def run():
            return [o async for o in server.generate(GenerateRequest("z1", prompt, SamplingParams(max_tokens=4)))]

        assert asyncio.run(run())[-1].finished
        server.record_routing_stats()  # cuts the pending batch
        want = set(hash_request_tokens(prompt, 16))
        _wait(lambda: want <= {h for e in received if isinstance(e, BlockStored) for h in e.block_hashes})
        rehashed = {h for e in rehasher.translate([e for e in received if not isinstance(e, tuple)])
                    if isinstance(e, BlockStored) for h in e.block_hashes}
        assert want <= rehashed and not any(isinstance(e, tuple) for e in received)
        sub.close()
    finally:
        server.engine.shutdown()
        server._zmq.close()
