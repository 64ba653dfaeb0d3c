"""KV events over ZMQ as vLLM publishes them, and the re-hashing that puts them in our index.

The transport is vLLM's `ZmqEventPublisher` (`kv_events_config` with publisher "zmq"):

- a PUB socket sends each batch as three frames: topic, sequence number (8 bytes, big-endian,
  counting from 0), payload (msgpack `[ts, [event, ...], data_parallel_rank]`, app/kv_events/wire.py);
- a ROUTER replay socket: a DEALER that sends `[b"", start]` (start: 8 bytes, big-endian) gets
  back every batch still buffered from `start` on as `[b"", topic, seq, payload]`, then the end
  marker `[b"", b"", seq -1 (signed), b""]`.

`ZmqEventPublisher` speaks the same protocol, so our replicas can publish their events where
vLLM's consumers (and our subscriber) read them (`kv_events_endpoint`). `ZmqEventSubscriber`
follows one publisher in a thread: it applies batches in sequence order,
drops duplicates, and when a sequence number is skipped (PUB drops messages a slow or late
subscriber has not taken) fetches the missing batches from the replay socket. What the replay
no longer holds is lost: the subscriber says so (`on_lost`), and the consumer forgets what it
knew of that publisher's blocks rather than keep a wrong picture.

`BlockRehasher` turns the publisher's block hashes into ours. vLLM's hashes depend on its hash
algorithm and seed; the router hashes prompts with app/kv_events/block_hash.py. A BlockStored event
carries the blocks' token ids and its parent's hash, so each block is re-hashed with our chain
hash from its parent's (our) hash, and the map publisher hash -> our hash is kept for the
parents of later blocks and for BlockRemoved, which carries hashes only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable

import zmq

from app.kv_events.block_hash import BlockHash, hash_block_tokens
from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from app.kv_events.wire import decode_batch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker


class ZmqEventPublisher:
    """vLLM's ZMQ KV event publisher protocol (PUB + ROUTER replay, see the module docstring).

    `publish(events)` numbers and sends one batch (thread-safe); a thread answers replay requests
    from a buffer of the last `buffer_steps` batches. Endpoints are bound ("tcp://*:5557",
    "ipc:///tmp/x"); `tcp://host:0` binds a free port, which `endpoint` then names.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self.endpoint = self._bind(self._pub, endpoint)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        self._topic = topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.next_seq = 0
        self._stop = threading.Event()
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kv-event-replay", daemon=True)
            self._thread.start()

    @staticmethod
    def _bind(sock, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[: -len(":0")])
            return f"{endpoint[: -len(':0')]}:{port}"
        sock.bind(endpoint)
        return endpoint

    def publish(self, events: list[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        return self.publish_payload(encode_batch(time.time() if ts is None else ts, events))

    def publish_payload(self, payload: bytes) -> int:
        with self._lock:  # numbering, buffering and sending in one order
            seq = self.next_seq
            self.next_seq += 1
            self._buffer.append((seq, payload))
            self._send(seq, payload)
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._replay.poll(100):
                    continue
                frames = self._replay.recv_multipart()
            except zmq.ZMQError:  # closed
                return
            if len(frames) != 3:
                logger.warning("malformed KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start = int.from_bytes(start, "big")
            with self._lock:
                batches = [b for b in self._buffer if b[0] >= start]
            for seq, payload in batches:
                self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


class BlockRehasher:
    """A publisher's KV events, re-keyed by our chain hash (one instance per publisher)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ours: dict[Hashable, list] = {}  # publisher hash -> [our hash, physical blocks holding it]
        self.num_unresolved = 0  # stored blocks left out: unknown parent, other block size, extra keys

    def translate(self, events: list[KVEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, BlockRemoved):
                removed = []
                for h in event.block_hashes:
                    entry = self._ours.get(h)
                    if entry is None:
                        continue
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._ours[h]
                        removed.append(entry[0])
                if removed:
                    out.append(BlockRemoved(removed))
            elif isinstance(event, AllBlocksCleared):
                self._ours.clear()
                out.append(event)
        return out

    def _stored(self, event: BlockStored) -> BlockStored | None:
        n = len(event.block_hashes)
        bs = self.block_size
        if (event.block_size != bs or len(event.token_ids) != n * bs
                or (event.extra_keys and any(k is not None for k in event.extra_keys))):
            self.num_unresolved += n
            return None
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            entry = self._ours.get(event.parent_block_hash)
            if entry is None:  # its parent's event was lost or came before we followed
                self.num_unresolved += n
                return None
            parent = entry[0]
        first_parent, hashes = parent, []
        for i, theirs in enumerate(event.block_hashes):
            parent = hash_block_tokens(parent, event.token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
            entry = self._ours.get(theirs)
            if entry is None:
                self._ours[theirs] = [parent, 1]
            else:
                entry[1] += 1
        return BlockStored(hashes, first_parent, list(event.token_ids), bs)

    def reset(self) -> list[KVEvent]:
        """Forget every block (after lost batches); the event that tells a consumer to do the same."""
        self._ours.clear()
        return [AllBlocksCleared()]

    def snapshot_events(self) -> list[KVEvent]:
        """The publisher's cached blocks as we know them, as a consumer's resync (see the engine's)."""
        return [AllBlocksCleared()] + [BlockStored([ours], None, [], self.block_size) for ours, _ in self._ours.values()]

    @property
    def num_blocks(self) -> int:
        return len(self._ours)


class ZmqEventSubscriber:
    """Follows one ZMQ KV event publisher in a background thread.

    `on_batch(events)` gets each batch's decoded events, in sequence order, exactly once;
    `on_lost(n)` is told of n batches that neither the PUB socket nor the replay socket delivered.
    Both are called from the subscriber's thread. Without a replay endpoint a gap is a loss. After
    `probe_s` without a batch it asks the replay socket for newer ones (a batch PUB dropped is
    otherwise noticed only when the next one comes, and the first ones before the subscription
    took effect never would be).
    """

    def __init__(self, endpoint: str, on_batch: Callable[[list[KVEvent]], None], *,
                 replay_endpoint: str | None = None, topic: str = "",
                 on_lost: Callable[[int], None] | None = None, replay_timeout_s: float = 2.0,
                 poll_ms: int = 100, probe_s: float = 1.0) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_batch, self.on_lost = on_batch, on_lost
        self.replay_timeout_s, self.poll_ms, self.probe_s = replay_timeout_s, poll_ms, probe_s
        self.next_seq = 0  # the publisher counts from 0
        self.num_batches = self.num_events = self.num_replayed = self.num_lost = self.num_bad = 0
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)

    def start(self) -> "ZmqEventSubscriber":
        self._thread.start()
        self._ready.wait(5.0)
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; the publisher's HWM bounds the queue
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        replay = None
        self._ready.set()
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                if not sub.poll(self.poll_ms):
                    # PUB drops what it sends before a new subscription takes effect, and a dropped
                    # batch is only noticed when a later one arrives: when idle, ask the replay socket
                    # for anything after what we have (as right after connecting)
                    if self.replay_endpoint is not None and time.monotonic() - idle_since >= self.probe_s:
                        replay = self._fill_gap(replay, None)
                        idle_since = time.monotonic()
                    continue
                idle_since = time.monotonic()
                _topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq < self.next_seq:
                    continue  # delivered already (by a replay)
                if seq > self.next_seq:
                    replay = self._fill_gap(replay, seq)
                    if seq < self.next_seq:
                        continue
                self._apply(seq, payload)
        except Exception:  # a closed context at interpreter exit, or a bug: say so, stop following
            if not self._stop.is_set():
                logger.exception("KV event subscriber of %s stopped", self.endpoint)
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self.num_batches += 1
        try:
            _, events = decode_batch(payload)
        except (ValueError, TypeError) as e:  # not a KV event batch: count it, keep following
            self.num_bad += 1
            logger.warning("KV event batch %d from %s is malformed: %s", seq, self.endpoint, e)
            return
        self.num_events += len(events)
        try:
            self.on_batch(events)
        except Exception:  # the consumer failed on this batch: it cannot trust what it holds now
            logger.exception("KV event batch %d from %s: the consumer failed; reported as lost", seq, self.endpoint)
            self.num_lost += 1
            if self.on_lost is not None:
                self.on_lost(1)

    def _fill_gap(self, replay, seq: int | None):
        """Batches next_seq..seq-1 from the replay socket (seq None: all it has from next_seq on);
        those it no longer has are lost. Returns the replay socket to reuse (None after a timeout: a
        new one drops stale replies)."""
        wanted = self.next_seq
        if self.replay_endpoint is not None:
            if replay is None:
                replay = self._ctx.socket(zmq.DEALER)
                replay.connect(self.replay_endpoint)
            replay.send_multipart([b"", wanted.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not replay.poll(left_ms):
                    logger.warning("KV event replay from %s timed out", self.replay_endpoint)
                    replay.close(linger=0)
                    replay = None
                    break
                frames = replay.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                got = int.from_bytes(frames[2], "big")
                if self.next_seq <= got and (seq is None or got < seq):  # in order; the buffer may start later
                    self._lose(got)
                    self.num_replayed += 1
                    self._apply(got, frames[3])
        if seq is not None:
            self._lose(seq)
        return replay

    def _lose(self, upto: int) -> None:
        """Batches next_seq..upto-1 will never come: tell the consumer, go on from upto."""
        if self.next_seq >= upto:
            return
        lost = upto - self.next_seq
        self.num_lost += lost
        logger.warning("KV event batches %d..%d from %s are lost (not in the replay buffer)", self.next_seq,
                       upto - 1, self.endpoint)
        self.next_seq = upto
        if self.on_lost is not None:
            self.on_lost(lost)
