"""Typed errors of the engine. Every error a caller can cause is an InvalidRequestError."""


class InvalidRequestError(ValueError):
    """The request is invalid; the message says which field and what to do. Nothing was changed."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are queued; retry later (HTTP 503 with Retry-After)."""


class EngineDeadError(RuntimeError):
    """The engine loop has failed; the replica must be restarted (its health check fails)."""


class RequestFailedError(RuntimeError):
    """One request failed on its own (e.g. NaN/Inf in its K/V or logits); the engine and every other
    request run on. Retrying the same request will most likely fail the same way."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (request_timeout_s) and was aborted; its KV blocks are freed."""


class KVCacheAllocationError(MemoryError):
    """The KV cache could not be allocated when the engine started; the message names its size and
    the settings that set it (kv_cache_memory, num_kv_blocks, gpu_memory_utilization, ...)."""
