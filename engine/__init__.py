"""The inference engine: model families over a paged KV cache, continuous-batching scheduler, DDTree
speculative decoding. `from engine import LLM, SamplingParams` is the offline API."""
from engine.request import SamplingParams


def __getattr__(name):  # keep `import engine` light: LLM pulls in torch models only when used
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
