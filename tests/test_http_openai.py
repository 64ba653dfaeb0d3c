"""The OpenAI HTTP API end to end: real Ray Serve, real HTTP, the official `openai` client.

Two applications run in one local Ray: the embedded tiny model (random weights, byte tokenizer)
at /, and stories260K (real weights) at /stories.
"""

import json
import re

import httpx
import openai
import pytest
from ray import serve

from app.config import EngineConfig
from app.engine.model_source import load_model_config, resolve_tokenizer
from conftest import STORIES_GREEDY, STORIES_MODEL, STORIES_TOKENIZER
from serve_testing import local_serve, run_apps, wait_until

TINY_ARGS = {"engine": {"num_kv_blocks": 512, "max_model_len": 8192, "max_num_seqs": 8}}
STORIES_ARGS = {
    "engine": {"model": str(STORIES_MODEL), "tokenizer": str(STORIES_TOKENIZER), "num_kv_blocks": 256},
    "model_id": "stories260K",
}
TINY = "tiny-llama"


@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        apps = [(TINY_ARGS, "tiny", "/")]
        if STORIES_MODEL.exists():
            apps.append((STORIES_ARGS, "stories", "/stories"))
        run_apps(*apps)
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stories_client(base_url, stories_paths):
    return openai.OpenAI(base_url=f"{base_url}/stories/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    config = EngineConfig()
    return resolve_tokenizer(config, load_model_config(config.model).vocab_size)


def llm_server_stats(app_name: str) -> dict:
    """The app's one LLMServer replica's latest stats, as reported to the app's index (every second)."""
    import ray

    from app.router.index_actor import get_index

    (stats,) = wait_until(lambda: list(ray.get(get_index(app_name).replica_stats.remote()).values()), timeout_s=30)
    return stats


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_models_lists_the_model_with_max_model_len(client):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY]
    assert models[0].max_model_len == 8192


def test_completion_counts_usage_and_streams_the_same_text(client, tokenizer):
    prompt = "Agents talk to the server."
    kwargs = dict(model=TINY, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completion_accepts_token_ids_and_stop(client, tokenizer):
    ids = tokenizer.encode("The cluster has eight GPUs.")
    out = client.completions.create(model=TINY, prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 5
    free = client.completions.create(model=TINY, prompt=ids, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[3:5]
    if stop.strip() and "\ufffd" not in stop:
        cut = client.completions.create(model=TINY, prompt=ids, max_tokens=20, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
        assert cut.finish_reason == "stop" and cut.text == free[: free.index(stop)]


def test_chat_counts_usage_and_streams_the_same_text(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Status?"}]
    kwargs = dict(model=TINY, messages=messages, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids) and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    # Greedy: the sampled token is the most likely one.
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content)


def test_n_choices_are_the_requests_seeded_seed_plus_i(client):
    """n=3 over HTTP: choice i is what the same request with n=1 and seed + i returns, streamed or
    not; usage counts every choice's tokens and the prompt once."""
    kwargs = dict(model=TINY, prompt="Three agents answer the same question.", max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs, n=3, seed=40)
    assert [c.index for c in full.choices] == [0, 1, 2]
    singles = [client.completions.create(**kwargs, seed=40 + i) for i in range(3)]
    assert [c.text for c in full.choices] == [s.choices[0].text for s in singles]
    assert full.usage.completion_tokens == 18 and full.usage.prompt_tokens == singles[0].usage.prompt_tokens

    chunks = list(client.completions.create(**kwargs, n=3, seed=40, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {i: "" for i in range(3)}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]
    assert chunks[-1].usage.completion_tokens == 18

    messages = [{"role": "user", "content": "Pick a number."}]
    chat_kwargs = dict(model=TINY, messages=messages, max_tokens=5, temperature=1.0, seed=7,
                       extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**chat_kwargs, n=2)
    stream = list(client.chat.completions.create(**chat_kwargs, n=2, stream=True))
    roles = [c.choices[0].index for c in stream if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice's role first
    contents = {0: "", 1: ""}
    for c in stream:
        contents[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [contents[0], contents[1]] == [c.message.content for c in chat.choices]
    assert chat.choices[1].message.content == client.chat.completions.create(
        **{**chat_kwargs, "seed": 8}).choices[0].message.content


def test_echo_returns_the_prompt_logprobs_the_engine_computes(client, base_url):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0. Over HTTP (the
    official client) and over the Python handle, equal to the engine's own prompt logprobs (the
    offline API with the app's engine settings), the first token's null."""
    from app.config import ServerConfig
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    text = "Agents score this sentence token by token."
    body = dict(model=TINY, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    out = client.completions.create(**body)
    choice = out.choices[0]
    assert choice.text == text and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == "<s>" + text and lp.text_offset[:2] == [0, 3]  # BOS, then the prompt's tokens
    assert all(len(top) >= 2 and tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))

    handle = serve.get_app_handle("tiny")
    (via_handle,) = handle.options(stream=True).completions.remote(body)
    assert via_handle.choices[0].logprobs.token_logprobs == lp.token_logprobs

    engine = ServerConfig.model_validate(TINY_ARGS).engine
    llm = LLM(**engine.model_dump())
    ids = llm.tokenizer.encode(text)
    ref = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert len(lp.token_logprobs) == len(ids)
    ref_logprobs = [d[t].logprob for t, d in zip(ids[1:], ref.prompt_logprobs[1:])]  # vLLM's shape offline
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref_logprobs)) < 1e-5


def test_second_chat_turn_reports_cached_tokens(client):
    system = "You are the planning agent of swarm 7. Keep every answer short and concrete. " * 2
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "List the next step."}]
    first = client.chat.completions.create(model=TINY, messages=turn1, max_tokens=8, temperature=0,
                                           extra_headers={"x-session-id": "swarm-7"})
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And after that?"}]
    second = client.chat.completions.create(model=TINY, messages=turn2, max_tokens=8, temperature=0,
                                            extra_headers={"x-session-id": "swarm-7"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's full blocks (all but the last token's) come from the cache.
    assert cached > first.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens - 1) // 16 * 16
    assert cached < second.usage.prompt_tokens


def test_stories260k_greedy_completion_is_the_known_text(stories_client):
    out = stories_client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40,
                                            temperature=0)
    assert "Once upon a time" + out.choices[0].text == STORIES_GREEDY
    assert out.usage.completion_tokens == 40
    chunks = stories_client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40,
                                               temperature=0, stream=True)
    assert "Once upon a time" + "".join(c.choices[0].text for c in chunks) == STORIES_GREEDY


def test_stories260k_chat_second_turn_hits_the_prefix_cache(stories_client):
    turn1 = [{"role": "user", "content": "Tell me a story about a little girl named Lily and her red ball."}]
    first = stories_client.chat.completions.create(model="stories260K", messages=turn1, max_tokens=24,
                                                   temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "What happened next?"}]
    second = stories_client.chat.completions.create(model="stories260K", messages=turn2, max_tokens=8,
                                                    temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_health_and_metrics(base_url, client):
    client.completions.create(model=TINY, prompt="count me", max_tokens=3)
    with httpx.Client(base_url=base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "llm_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(text, "llm_time_to_first_token_seconds_count", endpoint="/v1/completions") >= 1
    assert metric(text, "llm_generation_tokens_total") >= 3
    replica_id = llm_server_stats("tiny")["replica_id"]
    assert metric(text, "llm_engine_kv_blocks_total", replica_id=replica_id) == 512
    for name in ("llm_engine_running_requests", "llm_engine_waiting_requests", "llm_engine_kv_blocks_used",
                 "llm_engine_prefix_cache_hit_tokens_total", "llm_engine_preemptions_total"):
        assert f'{name}{{replica_id="{replica_id}"}}' in text
    # the engine's own time to first token: counted (stats reach the index once a second)
    assert wait_until(lambda: metric(httpx.get(f"{base_url}/metrics").text, "llm_engine_first_tokens_total",
                                     replica_id=replica_id) >= 1, timeout_s=30)
    text = httpx.get(f"{base_url}/metrics").text
    assert 0 < metric(text, "llm_engine_time_to_first_token_seconds_total", replica_id=replica_id) < 60
    # a CPU engine compiles no Triton kernel: the series are there, at 0
    assert metric(text, "llm_engine_kernel_compiles_total", replica_id=replica_id) == 0
    assert metric(text, "llm_engine_kernel_compiles_serving_total", replica_id=replica_id) == 0


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(base_url):
    # idle first: stats reach the index once a second, so an earlier test's request may still show
    before = wait_until(lambda: (s := llm_server_stats("tiny"))["num_running"] == 0 and s, timeout_s=30)
    assert before
    metrics_before = httpx.get(f"{base_url}/metrics").text
    # As long as the context allows, so that the stream is still running when a client starved on a
    # loaded machine gets to read the stats (1800 tokens finished first there).
    body = {"model": TINY, "prompt": "Stream a very long answer. " * 8, "max_tokens": 7900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = []
            # Hold the line iterator: breaking out of a bare `for line in r.iter_lines()` drops the last
            # reference to httpx's generators, whose close shuts the connection at once, and the
            # server's abort then raced the stats read below (num_running 0 in about 1 run in 4).
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                if len(chunks) == 3:
                    break
            during = wait_until(lambda: (s := llm_server_stats("tiny"))["num_running"] == 1 and s, timeout_s=30)
            assert during and during["num_free_kv_blocks"] < before["num_free_kv_blocks"]
    # The connection is closed: the engine aborts the request and frees its blocks.
    after = wait_until(lambda: (s := llm_server_stats("tiny"))["num_running"] == 0 and s, timeout_s=30)
    assert after and after["num_free_kv_blocks"] == before["num_free_kv_blocks"]
    metrics_after = httpx.get(f"{base_url}/metrics").text
    gone = "llm_requests_total", {"endpoint": "/v1/completions", "status": "499"}
    assert metric(metrics_after, gone[0], **gone[1]) == metric(metrics_before, gone[0], **gone[1]) + 1
    # Fewer than the 7900 tokens asked for were generated.
    generated = metric(metrics_after, "llm_generation_tokens_total") - metric(metrics_before,
                                                                               "llm_generation_tokens_total")
    assert generated < 7900


def test_the_ingress_replica_never_loads_torch(client):
    """The ingress tokenizes and checks prompts with the model's config and tokenizer alone, so its
    process never imports torch (seconds of CPU at every start, hundreds of MB per ingress replica);
    the LLMServer replica beside it does, which shows the check can fail."""
    import ray

    client.completions.create(model=TINY, prompt="Hello", max_tokens=2)
    client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]

    def has_torch(kind: str) -> list[bool]:
        actors = [ray.get_actor(n, namespace="serve") for n in names if f"#{kind}#" in n]
        assert actors, (kind, names)
        return ray.get([a.__ray_call__.remote(lambda self: "torch" in __import__("sys").modules) for a in actors])

    assert all(has_torch("LLMServer"))
    assert not any(has_torch("OpenAIIngress"))
