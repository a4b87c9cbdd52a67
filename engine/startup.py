"""What the engine settles once at startup, apart from loading: whether the CUDA extension is usable, the EOS ids
of a checkpoint, and the int64 form of request seeds."""
from __future__ import annotations

import logging
import time

from engine.config import EngineConfig

logger = logging.getLogger("ddtree.engine")


def eos_token_ids(hf_config: dict, generation_config: dict, tokenizer) -> tuple[int, ...]:
    ids = set()
    for source in (hf_config, generation_config):
        eos = source.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(int(i) for i in ids))


def signed64(seed: int) -> int:
    """Any integer seed as the int64 with the same low 64 bits (OpenAI seeds may be unsigned)."""
    return (int(seed) + (1 << 63)) % (1 << 64) - (1 << 63)


def check_extension(config: EngineConfig) -> None:
    """On CUDA the extension must load (before /health turns 200), unless reference kernels are allowed."""
    if not config.is_cuda:
        return
    from ext import build

    t0 = time.perf_counter()
    if build.load_ops() is not None:
        logger.info("CUDA extension loaded in %.1f s", time.perf_counter() - t0)
        return
    reason = build.load_error() or "unknown reason"
    if not config.reference_kernels:
        raise RuntimeError(f"the CUDA extension cannot be loaded ({reason}); build it with `ddtree build-ext`, "
                           f"or pass --reference-kernels to run the slow PyTorch references on the GPU")
    logger.warning("the CUDA extension cannot be loaded (%s): running ext's PyTorch references on the GPU "
                   "(--reference-kernels); every step will be slow", reason)
