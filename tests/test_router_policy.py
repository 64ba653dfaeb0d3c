"""The routing decision (app/router/policy.py): exact expectations, no Ray."""

import random
from collections import Counter

import pytest

from app.router.policy import RoutingPolicy, choose, rendezvous_score, with_room

R = ["a", "b", "c"]


def test_most_cached_prefix_wins():
    d = choose(R, {"a": 2, "b": 5}, {}, "s1")
    assert d.ranking[0] == "b" and d.reason == "prefix" and d.matched_blocks == 5
    assert sorted(d.ranking) == R


def test_overloaded_replica_is_skipped_despite_its_cache():
    # b holds the prefix but carries 10 requests while a and c carry 0: bound = 1.25 * 0 + 2 = 2
    d = choose(R, {"b": 5}, {"a": 0, "b": 10, "c": 0}, "s1")
    assert d.ranking[0] in ("a", "c") and d.reason == "session"
    assert d.ranking[-1] == "b"  # still a last resort
    assert with_room({"a": 0, "b": 10, "c": 0}, RoutingPolicy()) == ["a", "c"]
    # with a little load everywhere b keeps its request
    assert choose(R, {"b": 5}, {"a": 3, "b": 5, "c": 3}, "s1").ranking[0] == "b"


def test_session_without_cache_is_sticky_and_consistent():
    first = choose(R, {}, {}, "session-42")
    assert first.reason == "session"
    assert first.ranking[0] == max(R, key=lambda r: rendezvous_score("session-42", r))
    assert all(choose(R, {}, {}, "session-42").ranking[0] == first.ranking[0] for _ in range(5))
    # removing another replica does not move the session (rendezvous hashing)
    others = [r for r in R if r != first.ranking[0]]
    assert choose([first.ranking[0], others[0]], {}, {}, "session-42").ranking[0] == first.ranking[0]


def test_ties_in_cached_blocks_go_by_session():
    """A system prompt cached everywhere must not pull every session to one replica."""
    matches = {r: 4 for r in R}
    firsts = Counter(choose(R, matches, {}, f"s{i}").ranking[0] for i in range(300))
    assert set(firsts) == set(R) and min(firsts.values()) > 60


def test_sessions_without_cache_spread_evenly_by_the_hash():
    """Rendezvous hashing splits many sessions nearly evenly, and a fourth replica takes about a
    quarter of them from each of the others (no other session moves)."""
    before = Counter(choose(R, {}, {}, f"agent-{i}").ranking[0] for i in range(3000))
    assert all(900 <= n <= 1100 for n in before.values()), before
    moved = [i for i in range(3000)
             if choose(R + ["d"], {}, {}, f"agent-{i}").ranking[0] != choose(R, {}, {}, f"agent-{i}").ranking[0]]
    assert 600 <= len(moved) <= 900
    assert all(choose(R + ["d"], {}, {}, f"agent-{i}").ranking[0] == "d" for i in moved)


def test_no_session_no_cache_balances_by_load():
    rng = random.Random(0)
    loads = {"a": 0, "b": 1, "c": 1}
    picks = Counter(choose(R, {}, loads, None, rng=rng).ranking[0] for _ in range(200))
    assert picks["a"] > picks["b"] and picks["a"] > picks["c"]  # a wins whenever it is sampled
    assert choose(["a"], {}, {}, None).ranking == ["a"]


def test_min_match_blocks_and_bad_inputs():
    d = choose(R, {"a": 1}, {}, "s", RoutingPolicy(min_match_blocks=2))
    assert d.reason == "session"
    with pytest.raises(ValueError, match="no replicas"):
        choose([], {}, {}, None)
    with pytest.raises(ValueError, match="load_factor"):
        RoutingPolicy(load_factor=0.5)


def test_the_policy_takes_its_settings_and_defaults_from_router_config():
    from pydantic import ValidationError

    from app.config import RouterConfig

    config = RouterConfig()
    assert RoutingPolicy() == RoutingPolicy.from_config(config) == RoutingPolicy.from_config({})
    assert (RoutingPolicy().load_factor, RoutingPolicy().slack, RoutingPolicy().min_match_blocks) == \
        (config.load_factor, config.slack, config.min_match_blocks)
    # the request_router_kwargs the builder passes: args.router, whole
    assert RoutingPolicy.from_config(RouterConfig(load_factor=2.0).model_dump()) == RoutingPolicy(load_factor=2.0)
    with pytest.raises(ValidationError, match="load_factr"):
        RoutingPolicy.from_config({"load_factr": 2.0})
