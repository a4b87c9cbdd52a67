"""Dropping the last reference to an LLM frees its engine (weights, KV cache, drafter) at once, without waiting
for a garbage collection: `del llm` then `torch.cuda.empty_cache()` is how users of vLLM's LLM hand the memory
back before building the next engine in the same process."""
from __future__ import annotations

import gc
import weakref

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize("drafter", ["none", "ngram"])
@pytest.mark.parametrize("cuda_paths", [False, True])
def test_dropping_an_llm_frees_its_engine_without_a_collection(tiny_checkpoints, drafter, cuda_paths):
    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, dtype="fp32", drafter=drafter)
    if cuda_paths:  # what a CUDA engine adds: the graphs' static buffers (emulated here) and steps launched ahead
        llm.engine.enable_graphs(emulate=True)
        llm.engine.overlap = llm.engine.budgets.pipelined = True
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.model)
    gc.disable()  # only reference counting may free it
    try:
        del llm
        assert engine() is None and model() is None, "the engine is kept alive by a reference cycle"
    finally:
        gc.enable()
