"""OpenAIServing (the operations behind the HTTP and handle APIs) on a fake LLMServer handle, no
Ray: what the ingress sends to a replica (token ids, block hashes, session id, sampling params)
and that a caller who stops reading cancels the replica's stream. The fake stands in for the
LLMServer only; the real one is exercised end to end in test_http_openai.py."""

import asyncio

import pytest

from app.serving_types import ModelInfo
from app.deployments.protocol import BadRequestError, CompletionStreamResponse
from app.deployments.serving import OpenAIServing
from app.kv_events.block_hash import hash_request_tokens
from app.engine.outputs import RequestOutput
from tests.serve_testing import FakeReplicaHandle

BLOCK_SIZE = 4


class FakeStream:
    """What `handle.options(stream=True).generate.remote(request)` returns: per choice (the
    request's n), `num_tokens` outputs of one token each, the last one finished; choices interleave."""

    def __init__(self, request, num_tokens: int) -> None:
        self.request = request
        self.num_tokens = num_tokens
        self.cancelled = False

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        for i in range(self.num_tokens):
            await asyncio.sleep(0)
            last = i == self.num_tokens - 1
            for choice in range(self.request.sampling_params.n):
                # as a replica sends them: without the prompt (the ingress has it)
                yield RequestOutput(self.request.request_id, None, [], "x" * (i + 1), "x", [120],
                                    last, "length" if last else None, None, 0,
                                    token_ids=[120] * self.num_tokens if last else None, index=choice)

    def cancel(self) -> None:
        self.cancelled = True


class FakeLLMServer(FakeReplicaHandle):
    def __init__(self, num_tokens: int = 3) -> None:
        super().__init__(ModelInfo("tiny-llama", 256, 320, BLOCK_SIZE, "bf16", 1, 64))
        self.num_tokens = num_tokens
        self.streams: list[FakeStream] = []

    def stream(self, request):
        self.streams.append(FakeStream(request, self.num_tokens))
        return self.streams[-1]


@pytest.fixture
def server():
    return FakeLLMServer()


@pytest.fixture
def serving(server):
    return OpenAIServing(server, {"engine": {"block_size": BLOCK_SIZE}})


def collect(agen) -> list:
    async def run():
        return [item async for item in agen]

    return asyncio.run(run())


def test_completion_sends_token_ids_block_hashes_and_session(serving, server):
    prompt = "Hello, swarm of agents"
    [out] = collect(serving.completions({"model": "tiny-llama", "prompt": prompt, "max_tokens": 3,
                                         "temperature": 0.5, "top_k": 7, "seed": 3, "stop": "\n",
                                         "user": "user-1"}))
    sent = server.streams[0].request
    ids = serving.tokenizer.encode(prompt)
    assert sent.prompt_token_ids == ids
    assert sent.block_hashes == hash_request_tokens(ids, BLOCK_SIZE) and len(sent.block_hashes) == len(ids) // 4
    assert sent.session_id == "user-1"  # no explicit session: the `user` field
    p = sent.sampling_params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop) == (3, 0.5, 7, 3, ["\n"])
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3
    collect(serving.completions({"model": "tiny-llama", "prompt": [1, 2, 3], "user": "user-1"},
                                session_id="session-9"))
    assert server.streams[1].request.session_id == "session-9"  # the header / argument wins
    assert server.streams[1].request.prompt_token_ids == [1, 2, 3]


def test_chat_sends_the_templated_prompt_and_defaults_max_tokens_to_the_context(serving, server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    collect(serving.chat({"model": "tiny-llama", "messages": messages}))
    sent = server.streams[0].request
    text = serving.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert sent.prompt_token_ids == serving.tokenizer.encode(text)
    assert sent.sampling_params.max_tokens == 256 - len(sent.prompt_token_ids)


def test_a_caller_who_stops_reading_cancels_the_replica_stream(serving, server):
    server.num_tokens = 50

    async def read_two():
        chunks = serving.completions({"model": "tiny-llama", "prompt": "go", "stream": True})
        got = [await anext(chunks), await anext(chunks)]
        await chunks.aclose()
        return got

    got = asyncio.run(read_two())
    assert all(isinstance(c, CompletionStreamResponse) for c in got)
    assert server.streams[0].cancelled
    assert 'status="499"' in serving.metrics.render().decode()


def test_a_finished_stream_is_not_cancelled(serving, server):
    collect(serving.completions({"model": "tiny-llama", "prompt": "go", "stream": True}))
    assert not server.streams[0].cancelled


def test_bad_values_are_refused_before_a_replica_is_called(serving, server):
    with pytest.raises(BadRequestError) as e:
        collect(serving.chat({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 2, "temperature": -1}))
    assert e.value.param == "temperature"
    assert server.streams == []


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x" * 300, "max_tokens": 1}, "prompt", ["longer than max_model_len (256)"]),
    ({"prompt": [1, 2, 3], "max_tokens": 254}, "prompt", ["257", "max_model_len (256)"]),
    ({"prompt": [1, 99999], "max_tokens": 2}, "prompt", ["99999"]),
    ({"prompt": [], "max_tokens": 2}, "prompt", ["empty"]),
])
def test_prompts_that_cannot_fit_are_refused_before_a_replica_is_called(serving, server, body, param, words):
    """The admission check at the ingress: length against max_model_len and the KV cache, token ids
    against the vocabulary (ModelInfo: 256 tokens, vocab 320, 64 blocks of 4); no replica sees them."""
    with pytest.raises(BadRequestError) as e:
        collect(serving.completions({"model": "tiny-llama", **body}))
    assert e.value.param == param, e.value.message
    assert all(w in e.value.message for w in words), e.value.message
    assert server.streams == []
    with pytest.raises(BadRequestError, match="256"):  # 64 blocks x 4 tokens: 260 tokens can never be cached
        collect(serving.chat({"model": "tiny-llama", "messages": [{"role": "user", "content": "x" * 240}],
                              "max_completion_tokens": 10}))
    assert server.streams == []


def test_a_prompt_text_sent_again_is_not_tokenized_again(serving, server, monkeypatch):
    """The ingress keeps recent prompts' ids and block hashes: the same text again (completions or
    chat) sends the same ids and hashes without calling the tokenizer."""
    calls = []
    encode = serving.tokenizer.encode
    monkeypatch.setattr(serving._prompts, "encode", lambda *a, **k: calls.append(a[0]) or encode(*a, **k))
    body = {"model": "tiny-llama", "prompt": "Plan the rollout of the fleet. " * 5, "max_tokens": 2}
    collect(serving.completions(body))
    collect(serving.completions(body))
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    collect(serving.chat(chat))
    collect(serving.chat(chat))
    assert len(calls) == 2  # once per distinct text
    first, second, chat1, chat2 = (s.request for s in server.streams)
    assert first.prompt_token_ids == second.prompt_token_ids == encode(body["prompt"])
    assert first.block_hashes == second.block_hashes == hash_request_tokens(first.prompt_token_ids, BLOCK_SIZE)
    assert chat1.prompt_token_ids == chat2.prompt_token_ids and chat1.block_hashes == chat2.block_hashes
    first.prompt_token_ids.append(0)  # what a caller does with its ids never reaches the cache
    collect(serving.completions(body))
    assert server.streams[-1].request.prompt_token_ids == second.prompt_token_ids


def test_the_prompt_cache_is_bounded_by_entries_and_tokens():
    from app.deployments.serving import PromptCache

    def encode(text, add_special_tokens=True):
        return [1] * add_special_tokens + [ord(c) for c in text]

    cache = PromptCache(encode, 2, max_entries=3, max_tokens=10)
    for text in ("a", "bb", "ccc", "dd"):  # four entries: "a" goes
        cache.get(text, True)
    assert [k[0] for k in cache._entries] == ["bb", "ccc", "dd"]
    cache.get("bb", True)  # a hit moves it to the back
    cache.get("eeeeee", True)  # 7 tokens: "ccc" and "dd" go (10 at most)
    assert [k[0] for k in cache._entries] == ["bb", "eeeeee"] and cache._num_tokens == 10
    ids, hashes = cache.get("x" * 20, False)  # larger than the whole cache: not kept
    assert ids == [ord("x")] * 20 and len(hashes) == 10 and ("x" * 20, False) not in cache._entries
    assert cache.get("bb", False)[0] == [98, 98]  # the flag is part of the key
    assert (cache.hits, cache.misses) == (1, 7)
