"""What engine replicas, the router and the serving layer share about KV blocks.

- `block_hash`: the chained block hash; the engine's prefix cache and the router's index key
  blocks by it, so a prompt hashed anywhere matches the blocks a replica reports (pure Python);
- `schema`: the KV events a replica emits (BlockStored, BlockRemoved, AllBlocksCleared; vLLM's
  field names; pure Python);
- `wire`: their msgpack encoding, in vLLM's KVEventBatch layout;
- `zmq_transport`: vLLM's ZMQ publisher protocol (PUB + replay), a subscriber that follows it, and
  the re-hashing of another engine's block hashes into ours.

It imports nothing else of `app`, so the engine, the router and the deployments all depend on
it and never on each other for these.
"""
