"""The KV-aware routing decision, as a pure function (no Ray): the router and the simulation
in bench/router_sim.py call the same code.

For one request, given how many of its leading prompt blocks each replica holds (the prefix
index) and each replica's load:

1. Replicas with room: load <= load_factor * min_load + slack, i.e. within a bound relative to
   the least loaded replica (in the spirit of consistent hashing with bounded loads; Mirrokni,
   Thorup and Zadimoghaddam 2018). The rest are skipped, so a popular prefix (a system prompt
   every session shares) or session cannot turn one replica into a hot spot. A bound relative to
   the mean instead let three of four replicas take every session of a swarm that shares a
   system prompt while the fourth idled (docs/history.md).
2. Among those, the replica holding the most prefix blocks wins. Ties (e.g. a system prompt
   cached everywhere) and requests with no cached prefix go by rendezvous hashing of the session
   id over the replicas with room, so a session lands on the same replica turn after turn and
   finds its blocks there, and sessions spread evenly. Rendezvous hashing moves only the sessions
   of a replica that leaves.
3. No session id and no cached prefix: power of two choices by load.

The result is a ranking: the chosen replica first, then the other replicas with room by load,
then the replicas without room, so the caller can fall through when a replica refuses.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.config import RouterConfig

ReplicaId = str
_DEFAULTS = RouterConfig()  # the settings' one source: RouterConfig (args.router of serve_config.yaml)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    load_factor: float = _DEFAULTS.load_factor  # a replica with room carries at most this times the least load ...
    slack: int = _DEFAULTS.slack  # ... plus this many requests
    min_match_blocks: int = _DEFAULTS.min_match_blocks  # fewer matched blocks than this count as no match

    @classmethod
    def from_config(cls, config: RouterConfig | Mapping) -> RoutingPolicy:
        """The policy of `config`: a RouterConfig or its fields as a dict (the request_router_kwargs
        the builder passes), validated; fields not given take RouterConfig's defaults."""
        config = RouterConfig.model_validate(config)
        return cls(load_factor=config.load_factor, slack=config.slack, min_match_blocks=config.min_match_blocks)

    def __post_init__(self) -> None:
        if self.load_factor < 1:
            raise ValueError(f"load_factor must be >= 1 (got {self.load_factor})")
        if self.slack < 0 or self.min_match_blocks < 1:
            raise ValueError("slack must be >= 0 and min_match_blocks >= 1")


@dataclass(slots=True)
class Decision:
    ranking: list[ReplicaId]  # best first
    reason: str  # "prefix", "session", "load": what decided the first choice
    matched_blocks: int  # prefix blocks the chosen replica holds


def rendezvous_score(session_id: str, replica: ReplicaId) -> int:
    """Highest-random-weight hash of (session, replica); stable across processes."""
    digest = hashlib.blake2b(f"{session_id}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def with_room(loads: Mapping[ReplicaId, float], policy: RoutingPolicy) -> list[ReplicaId]:
    if not loads:
        return []
    bound = policy.load_factor * min(loads.values()) + policy.slack
    return [r for r, load in loads.items() if load <= bound]


def choose(
    replicas: Sequence[ReplicaId],
    matches: Mapping[ReplicaId, int],
    loads: Mapping[ReplicaId, float],
    session_id: str | None,
    policy: RoutingPolicy = RoutingPolicy(),
    rng: random.Random | None = None,
) -> Decision:
    """Rank `replicas` for a request. `matches`: leading prompt blocks each replica holds;
    `loads`: requests in flight or queued per replica (missing = 0)."""
    if not replicas:
        raise ValueError("no replicas to route to")
    load = {r: float(loads.get(r, 0.0)) for r in replicas}
    room = with_room(load, policy)
    room_set = set(room)

    def by_load(rs):
        return sorted(rs, key=lambda r: load[r])

    rest = by_load(r for r in replicas if r not in room_set)
    best = max((matches.get(r, 0) for r in room), default=0)
    if best >= policy.min_match_blocks:
        top = [r for r in room if matches.get(r, 0) == best]
        if session_id is not None:
            top.sort(key=lambda r: rendezvous_score(session_id, r), reverse=True)
        else:
            top = by_load(top)
        first, reason = top[0], "prefix"
    elif session_id is not None:
        first = max(room, key=lambda r: rendezvous_score(session_id, r))
        reason = "session"
    else:
        rng = rng or random
        picks = rng.sample(room, min(2, len(room)))
        first = min(picks, key=lambda r: load[r])
        reason = "load"
    others = by_load(r for r in room if r != first)
    return Decision([first, *others, *rest], reason, matches.get(first, 0))
