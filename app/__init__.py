"""FP4-KV LLM serving on Ray Serve.

`from app import LLM, SamplingParams` is the offline API. Imports are lazy so that pure-Python
parts (block hashes, the router's index) load without torch.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from app.llm import LLM

        return LLM
    if name == "SamplingParams":
        from app.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'app' has no attribute {name!r}")
