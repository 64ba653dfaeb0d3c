"""Types the serving layers share: what the ingress (or a Python caller) sends an LLMServer replica,
what a replica reports about its model. Their own module below app/router and app/deployments, so
that the router (which reads a GenerateRequest's block hashes and session) never imports the
deployments."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One engine request, as the ingress (or a Python caller) sends it to a replica. The replica's
    outputs do not carry the prompt back (RequestOutput.prompt None, prompt_token_ids empty): the
    caller has it, and a streamed output would otherwise carry every prompt id once per step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    session_id: str | None = None  # agent session (x-session-id or `user`), for routing
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the prompt's full blocks
    # False: the replica sends only the first output (the prompt is computed) and each choice's
    # final one (which carries the complete text, ids and logprobs), not one message per step;
    # the ingress sets it for non-streaming HTTP requests.
    stream: bool = True


@dataclass(slots=True)
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_cache_dtype: str
    tensor_parallel_size: int
    num_kv_blocks: int
