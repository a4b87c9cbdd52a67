"""Which quantized checkpoint formats load, and how: a config's quantization_config is either absent, DeepSeek-style
block FP8 (engine/model/fp8.py) or compressed-tensors pack-quantized INT4 (engine/model/int4.py); anything else is
refused by name before any weight is read.

Block FP8 runs its dense linears as FP8 GEMMs where engine/model/fp8_linear.py can (CUDA sm_90, bf16, 128x128
blocks); INT4 runs its linears as W4A16 GEMMs where engine/model/int4_linear.py can (CUDA, bf16 / fp16, groups
that are multiples of 8); everywhere else the weights are dequantized to the model's dtype as they stream in. The
reason a load dequantizes is logged once (a warning on CUDA).
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
    """`weights` with the checkpoint's quantized tensors dequantized as they are read, except the FP8 weights of
    the linears that run FP8 GEMMs (an Fp8GemmWeights, which picks them once it sees the model)."""
    from engine.model import fp8_linear
    from engine.model.fp8 import Fp8BlockWeights
    from engine.model.int4 import Int4PackedWeights

    kind = quantization_of(cfg)
    if kind is None or weights is None:
        return weights
    dtype_name = str(dtype).removeprefix("torch.")
    log = logger.warning if torch.device(device).type == "cuda" else logger.info
    if kind[0] == "int4":
        from engine.model import int4_linear

        reason = int4_linear.gemm_unavailable(kind[1], dtype, device)
        if reason is None:
            return int4_linear.Int4GemmWeights(weights, kind[1])
        log("INT4 checkpoint: W4A16 GEMMs are off (%s); the weights are dequantized to %s on load", reason,
            dtype_name)
        return Int4PackedWeights(weights, kind[1])
    gemm, reason = fp8_linear.choose_gemm(kind[1], dtype, device)
    if gemm is not None:
        return fp8_linear.Fp8GemmWeights(weights, kind[1], device, gemm)
    log("FP8 checkpoint: FP8 GEMMs are off (%s); the weights are dequantized to %s on load", reason, dtype_name)
    return Fp8BlockWeights(weights, kind[1])
