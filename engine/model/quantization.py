"""Which quantized checkpoint formats load, and how: a config's quantization_config is either absent, DeepSeek-style
block FP8 (engine/model/fp8.py) or compressed-tensors pack-quantized INT4 (engine/model/int4.py); anything else is
refused by name before any weight is read. Both formats are dequantized as they stream in; their GEMMs (FP8 on
Hopper, W4A16) are not implemented, which the loader says once on CUDA.
"""
from __future__ import annotations

import logging

import torch

from engine.model.errors import ConfigError
from engine.model.weights import WeightSource

logger = logging.getLogger("ddtree.engine")


def quantization_of(cfg: dict):
    """None, ("fp8", block size) or ("int4", Int4Scheme); a ConfigError for anything else."""
    from engine.model.fp8 import fp8_block_size
    from engine.model.int4 import int4_scheme

    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return "fp8", fp8_block_size(q)
    if method == "compressed-tensors":
        return "int4", int4_scheme(q)
    raise ConfigError(f"config field 'quantization_config.quant_method'={method!r} is not supported (block 'fp8' "
                      f"or 'compressed-tensors' pack-quantized INT4)")


def dequantizing(cfg: dict, weights: WeightSource | None, dtype: torch.dtype, device) -> WeightSource | None:
    """`weights` with the checkpoint's quantized tensors dequantized as they are read."""
    from engine.model.fp8 import Fp8BlockWeights
    from engine.model.int4 import Int4PackedWeights

    kind = quantization_of(cfg)
    if kind is None or weights is None:
        return weights
    if torch.device(device).type == "cuda":
        logger.warning("%s checkpoint: its quantized GEMMs are not implemented; the weights are dequantized to %s "
                       "on load", kind[0].upper(), str(dtype).removeprefix("torch."))
    return Fp8BlockWeights(weights, kind[1]) if kind[0] == "fp8" else Int4PackedWeights(weights, kind[1])
