"""The Python handle API: the ingress's `completions`, `chat` and `models` over a Ray Serve app
handle, taking and returning the protocol's pydantic objects; bad input raises a typed error."""

import asyncio

import pytest
from ray import serve

from app.deployments.protocol import (
    BadRequestError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelList,
    ModelNotFoundError,
    OpenAIError,
)
from serve_testing import local_serve, run_apps

TINY = "tiny-llama"
APP = "agents"


@pytest.fixture(scope="module")
def handle():
    with local_serve():
        run_apps(({"engine": {"num_kv_blocks": 128, "max_model_len": 1024}}, APP, "/"))
        yield serve.get_app_handle(APP)


def test_models(handle):
    models = handle.models.remote().result()
    assert isinstance(models, ModelList)
    assert models.data[0].id == TINY and models.data[0].max_model_len == 1024


def test_completion_yields_one_response_or_the_chunks(handle):
    fields = dict(model=TINY, prompt="Plan the rollout.", max_tokens=9, temperature=0, ignore_eos=True)
    [full] = list(handle.options(stream=True).completions.remote(CompletionRequest(**fields)))
    assert isinstance(full, CompletionResponse)
    assert full.usage.completion_tokens == 9 and full.choices[0].finish_reason == "length"

    streaming = CompletionRequest(**fields, stream=True, stream_options={"include_usage": True})
    chunks = list(handle.options(stream=True).completions.remote(streaming, session_id="agent-1"))
    assert all(isinstance(c, CompletionStreamResponse) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 9)
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_chat_from_async_code(handle):
    request = ChatCompletionRequest(model=TINY, messages=[{"role": "user", "content": "Next step?"}],
                                    max_completion_tokens=6, temperature=0, ignore_eos=True)

    async def agent():
        items = [x async for x in handle.options(stream=True).chat.remote(request)]
        stream = handle.options(stream=True).chat.remote(request.model_copy(update={"stream": True}))
        return items, [x async for x in stream]

    items, chunks = asyncio.run(agent())
    assert len(items) == 1 and isinstance(items[0], ChatCompletionResponse)
    text = items[0].choices[0].message.content
    assert all(isinstance(c, ChatCompletionStreamResponse) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_a_dict_request_is_validated_like_json(handle):
    [out] = list(handle.options(stream=True).completions.remote({"model": TINY, "prompt": "hi", "max_tokens": 2}))
    assert isinstance(out, CompletionResponse)


@pytest.mark.parametrize(
    "request_, error, param",
    [
        (CompletionRequest(model=TINY, prompt="hi", max_tokens=-1), BadRequestError, "max_tokens"),
        (CompletionRequest(model=TINY, prompt="hi", temperature=-1), BadRequestError, "temperature"),
        (CompletionRequest(model=TINY, prompt="x" * 1100), BadRequestError, "prompt"),
        ({"model": TINY, "prompt": "hi", "n": 0}, BadRequestError, "n"),
        (CompletionRequest(model="other", prompt="hi"), ModelNotFoundError, "model"),
    ],
)
def test_bad_request_raises_a_typed_error(handle, request_, error, param):
    with pytest.raises(error) as e:
        list(handle.options(stream=True).completions.remote(request_))
    assert isinstance(e.value, OpenAIError)
    assert e.value.param == param and e.value.status_code in (400, 404)
    [ok] = list(handle.options(stream=True).completions.remote({"model": TINY, "prompt": "hi", "max_tokens": 1}))
    assert ok.usage.completion_tokens == 1


def test_bad_chat_raises_a_typed_error(handle):
    request = ChatCompletionRequest(model=TINY, messages=[{"role": "user", "content": "hi"}],
                                    max_completion_tokens=-1)
    with pytest.raises(BadRequestError) as e:
        list(handle.options(stream=True).chat.remote(request))
    assert e.value.param == "max_completion_tokens"


def test_client_errors_are_one_warning_line_in_the_replica_logs(handle):
    """A bad request is the client's mistake: the caller gets the typed error, and the replica's
    log gets one WARNING line for it, not Serve's "Request failed." traceback (an engine-level
    refusal through the LLMServer handle, and an ingress-level one)."""
    import glob
    import time

    import ray

    from app.serving_types import GenerateRequest
    from app.engine.errors import InvalidRequestError
    from app.engine.sampling_params import SamplingParams

    llm_server = serve.get_deployment_handle("LLMServer", app_name=APP)
    bad = GenerateRequest(request_id="bad-token-ids", prompt_token_ids=[1, 10 ** 6], sampling_params=SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocab"):
        list(llm_server.options(stream=True).generate.remote(bad))
    with pytest.raises(BadRequestError):
        list(handle.options(stream=True).completions.remote({"model": TINY, "prompt": "hi", "max_tokens": -1}))
    logs_dir = ray._private.worker._global_node.get_logs_dir_path()
    for deployment, error in (("LLMServer", "InvalidRequestError"), ("OpenAIIngress", "BadRequestError")):
        deadline = time.monotonic() + 10
        while True:
            text = "".join(open(f).read() for f in glob.glob(f"{logs_dir}/serve/replica_{APP}_{deployment}_*.log"))
            if f"request refused ({error})" in text or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert f"WARNING" in text and f"request refused ({error})" in text, deployment
        assert "Request failed." not in text and "Traceback" not in text, deployment


def test_a_replica_streams_outputs_without_the_prompt(handle):
    """LLMServer's outputs leave the prompt with the caller (it sent it): a streamed output would
    otherwise carry every prompt id once per step. The ingress puts it back (usage, echo)."""
    from app.engine.sampling_params import SamplingParams
    from app.serving_types import GenerateRequest

    llm_server = serve.get_deployment_handle("LLMServer", app_name=APP)
    request = GenerateRequest(request_id="no-prompt-back", prompt_token_ids=list(range(1, 200)),
                              sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    outs = list(llm_server.options(stream=True).generate.remote(request))
    assert outs and outs[-1].finished and len(outs[-1].token_ids) == 4
    assert all(o.prompt_token_ids == [] and o.prompt is None for o in outs)
    [echoed] = list(handle.options(stream=True).completions.remote(
        {"model": TINY, "prompt": "abc", "max_tokens": 2, "echo": True}))
    assert echoed.choices[0].text.startswith("abc") and echoed.usage.prompt_tokens >= 3  # (a BOS, byte tokens)
