"""The engine's warm-up before it serves (CUDA): one step at the largest shape on a scratch cache, which is what
engine.memory measures to size the KV cache, and cuDNN's attention plans for every prompt length the
dense-prefill route can see (ext/prefill.py), so that requests find them built."""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.model.attention import GQAttention
from engine.plan import ScheduledSeq, StepPlan
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplingBatch
from ext import prefill

logger = logging.getLogger("ddtree.engine")


def warm_up(config: EngineConfig, model, dtype: torch.dtype, max_budget: int) -> None:
    """A max_num_batched_tokens forward, then the sampler over as many rows as a step can sample with every
    sampling feature on, then the dense-prefill plans."""
    t0 = time.perf_counter()
    vocab, num_tokens, block_size = model.vocab_size, config.max_num_batched_tokens, config.block_size
    num_blocks = -(-num_tokens // block_size)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (num_tokens,), generator=gen).tolist()
    req = Request(prompt, SamplingParams(max_tokens=1, detokenize=False))
    req.block_ids = list(range(num_blocks))
    sampler = Sampler(vocab, config.device)
    runner = ModelRunner(model, num_blocks, block_size, config.device, dtype, sampler,
                         dense_prefill_min_tokens=config.dense_prefill_min_tokens)
    runner.execute(StepPlan([ScheduledSeq(req, num_tokens, sample=True)]))
    num_rows = min(num_tokens, config.max_num_seqs * (max_budget + 1))
    hidden = torch.randn(num_rows, model.hidden_size, device=config.device, dtype=dtype)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            logprobs=20, detokenize=False)
    rows = [Request([t], params, request_id=f"warmup-{i}") for i, t in enumerate(prompt[:num_rows])]
    for r in rows:
        r.output_token_ids = [0]
    sampler(model.compute_logits(hidden), SamplingBatch(rows, [1] * num_rows))
    del runner, sampler
    warm_dense_prefill(config, model, dtype)
    logger.info("warm-up at the largest step shape (%d tokens, %d sampled rows) took %.1f s", num_tokens, num_rows,
                time.perf_counter() - t0)


def warm_dense_prefill(config: EngineConfig, model, dtype: torch.dtype) -> None:
    t0 = time.perf_counter()
    shapes = {(m.num_heads, m.num_kv_heads, m.head_dim) for m in model.modules() if isinstance(m, GQAttention)}
    lengths = prefill.warm_up(shapes, dtype, torch.device(config.device), config.dense_prefill_min_tokens,
                              config.max_num_batched_tokens) if shapes else []
    if lengths:
        logger.info("dense prefill: cuDNN attention plans for prompts of %d..%d tokens (%d plans) took %.1f s",
                    lengths[0], lengths[-1], len(lengths) * len(shapes), time.perf_counter() - t0)
