"""Every bad request gets its 4xx and an OpenAI error body; overload gets 503 + Retry-After; API
keys give 401. Afterwards the server still serves. Real Ray Serve, real HTTP.

Three applications in one local Ray: the tiny model at /, a one-slot server at /busy
(max_num_seqs 1, max_queued_requests 1) and one with API keys at /secure.
"""

import asyncio

import httpx
import openai
import pytest

from app.config import ServerConfig
from app.deployments.ingress import api_keys
from serve_testing import local_serve, run_apps

TINY = "tiny-llama"
MAX_MODEL_LEN = 512
KEY = "sk-test-key"
MAX_BODY = 65536


@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        run_apps(
            ({"engine": {"num_kv_blocks": 128, "max_model_len": MAX_MODEL_LEN}, "max_request_body_bytes": MAX_BODY},
             "tiny", "/"),
            ({"engine": {"num_kv_blocks": 128, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 1},
              "max_queued_requests": 1, "retry_after_s": 2}, "busy", "/busy"),
            ({"engine": {"num_kv_blocks": 64, "max_model_len": MAX_MODEL_LEN}, "api_keys": [KEY],
              "metrics_require_api_key": True}, "secure", "/secure"),
        )
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


def completion(**fields) -> dict:
    return {"model": TINY, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


def drop(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# (route, body (bytes are sent as they are), status, param, words the message must contain)
BAD_REQUESTS = {
    "malformed json": (COMPLETIONS, b'{"model": "tiny-llama", "prompt": ', 400, None, ["JSON"]),
    "body not an object": (COMPLETIONS, b"[1, 2]", 400, None, ["JSON object"]),
    "unknown model": (COMPLETIONS, completion(model="gpt-9"), 404, "model", ["gpt-9", TINY]),
    "unknown model (chat)": (CHAT, chat(model="gpt-9"), 404, "model", ["gpt-9"]),
    "missing model": (COMPLETIONS, drop(completion(), "model"), 400, "model", ["missing"]),
    "missing prompt": (COMPLETIONS, drop(completion(), "prompt"), 400, "prompt", ["missing"]),
    "missing messages": (CHAT, drop(chat(), "messages"), 400, "messages", ["missing"]),
    "max_tokens wrong type": (COMPLETIONS, completion(max_tokens="ten"), 400, "max_tokens", ["integer"]),
    "temperature wrong type": (COMPLETIONS, completion(temperature="hot"), 400, "temperature", ["number"]),
    "stream wrong type": (COMPLETIONS, completion(stream="yes"), 400, "stream", ["bool"]),
    "content wrong type": (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
                           ["content"]),
    "unknown role": (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", ["role"]),
    "image content": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
                      "messages[0].content", ["text"]),
    "max_tokens -1": (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens", ["max_tokens", ">= 0", "-1"]),
    "max_completion_tokens -1": (CHAT, drop(chat(max_completion_tokens=-1), "max_tokens"), 400,
                                 "max_completion_tokens", [">= 0"]),
    "negative temperature": (COMPLETIONS, completion(temperature=-0.5), 400, "temperature", [">= 0"]),
    "negative temperature (chat)": (CHAT, chat(temperature=-1), 400, "temperature", [">= 0"]),
    "top_p 0": (COMPLETIONS, completion(top_p=0), 400, "top_p", ["top_p"]),
    "logprobs too many": (COMPLETIONS, completion(logprobs=50), 400, "logprobs", ["logprobs"]),
    "top_logprobs too many": (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", ["logprobs"]),
    "n 0": (COMPLETIONS, completion(n=0), 400, "n", ["greater than or equal to 1"]),
    "n 129 (chat)": (CHAT, chat(n=129), 400, "n", ["less than or equal to 128"]),
    "seed + n beyond 64 bits": (COMPLETIONS, completion(n=2, seed=2**63 - 1), 400, "seed", ["seed + n - 1"]),
    "empty prompt": (COMPLETIONS, completion(prompt=""), 400, "prompt", ["empty"]),
    "empty token list": (COMPLETIONS, completion(prompt=[]), 400, "prompt", ["empty"]),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages", ["empty"]),
    "batch of prompts": (COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt", ["batch", "one prompt"]),
    "token id out of range": (COMPLETIONS, completion(prompt=[1, 99999]), 400, "prompt", ["99999"]),
    "prompt too long": (COMPLETIONS, completion(prompt="x" * 600), 400, "prompt", ["601", str(MAX_MODEL_LEN)]),
    "prompt too long (chat)": (CHAT, chat(messages=[{"role": "user", "content": "x" * 600}]), 400, "messages",
                               [str(MAX_MODEL_LEN)]),
    "prompt + max_tokens too long": (COMPLETIONS, completion(prompt="x" * 100, max_tokens=500), 400, None,
                                     ["101", "500", str(MAX_MODEL_LEN)]),
    "suffix": (COMPLETIONS, completion(suffix="and then"), 400, "suffix", ["not supported"]),
    # a seed past 64 bits once passed validation and killed the replica's engine loop
    "seed 2**64": (COMPLETIONS, completion(seed=2 ** 64), 400, "seed", ["64-bit", str(2 ** 64)]),
    "seed below -2**63 (chat)": (CHAT, chat(seed=-(2 ** 63) - 1), 400, "seed", ["64-bit"]),
    "too many stop strings": (COMPLETIONS, completion(stop=[f"s{i}" for i in range(33)]), 400, "stop", ["32", "33"]),
    "stop string too long": (CHAT, chat(stop=["x" * 257]), 400, "stop", ["256", "257"]),
    "presence_penalty": (CHAT, chat(presence_penalty=1.0), 400, "presence_penalty", ["not supported"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(http, case):
    route, body, status, param, words = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        r = http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None or case.startswith(("malformed", "body")):
        assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    good = http.post(COMPLETIONS, json=completion())
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_a_body_past_the_limit_is_413_before_it_is_parsed(http):
    for send in ({"json": completion(prompt="x" * MAX_BODY)},  # refused by its Content-Length
                 {"content": iter([b'{"model": "tiny-llama", "prompt": "', b"x" * MAX_BODY, b'"}'])}):  # chunked
        r = http.post(COMPLETIONS, headers={"content-type": "application/json"}, **send)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and str(MAX_BODY) in error["message"]
    assert http.post(COMPLETIONS, json=completion()).status_code == 200


def test_streaming_bad_request_is_refused_before_the_stream(http):
    r = http.post(COMPLETIONS, json=completion(max_tokens=-1, stream=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = http.post(CHAT, json=chat(model="nope", stream=True))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openai_client_raises_its_typed_errors(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY, prompt="Hello", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert client.completions.create(model=TINY, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1


def test_overload_answers_503_with_retry_after_then_serves_again(base_url):
    body = completion(prompt="Keep the only slot busy.", max_tokens=150, ignore_eos=True)

    async def burst():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*[client.post("/busy/v1/completions", json=body) for _ in range(8)])

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503} and statuses.count(200) >= 1, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "2"
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "overloaded"
            assert "overloaded" in error["message"]
    with httpx.Client(base_url=base_url, timeout=120) as client:
        again = client.post("/busy/v1/completions", json=completion())
        assert again.status_code == 200


def test_api_key_is_required_when_configured(base_url):
    with httpx.Client(base_url=f"{base_url}/secure", timeout=60) as client:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            r = client.post(COMPLETIONS, json=completion(), headers=headers)
            assert r.status_code == 401
        # Authentication comes before parsing: a bad body without a key is still a 401.
        assert client.post(COMPLETIONS, content=b"{", headers={"content-type": "application/json"}).status_code == 401
        ok = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.post(COMPLETIONS, json=completion(), headers=ok).status_code == 200
        health = client.get("/health")  # probes need no key
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert client.get("/metrics").status_code == 401  # metrics_require_api_key
        assert "llm_requests_total" in client.get("/metrics", headers=ok).text
    good = openai.OpenAI(base_url=f"{base_url}/secure/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{base_url}/secure/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_api_keys_come_from_config_and_env():
    config = ServerConfig(api_keys=["a-secret-key"])
    assert "a-secret-key" not in repr(config) and "a-secret-key" not in str(config.model_dump())
    assert api_keys(config, {}) == {"a-secret-key"}
    config = ServerConfig(api_keys=["a"])
    assert api_keys(config, {"APP_API_KEYS": " b, c ,,"}) == {"a", "b", "c"}
    assert api_keys(ServerConfig(), {}) == frozenset()


def test_a_dead_replica_is_a_503_that_does_not_leak_ray_internals():
    from ray.exceptions import ActorDiedError

    from app.deployments.errors import to_openai_error

    err = to_openai_error(ActorDiedError(), {}, 1)
    assert err.status_code == 503 and err.code == "engine_unavailable" and err.retry_after_s == 1
    assert "actor" not in err.message.lower() and "pid" not in err.message
