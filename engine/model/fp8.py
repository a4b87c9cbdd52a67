"""FP8 block-quantized checkpoints in the DeepSeek-V3 layout: `quantization_config` {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, each quantized weight stored as
float8_e4m3fn `<name>.weight` beside a float32 `<name>.weight_scale_inv` of one scale per 128 x 128 block
(ceil(out / 128) x ceil(in / 128)); the real weight is fp8 x scale, block by block.

Fp8BlockWeights wraps the checkpoint's WeightSource and dequantizes every such weight to the model's dtype as it
streams in, except the weights named in `kept`: those (and their scales) pass through as stored, for the FP8
linear layers of engine/model/fp8_linear.py (Hopper). engine/model/quantization.py decides which path a load takes.
`quantize_block_fp8` writes that layout (tests, tiny checkpoints, the FP8 GEMM probe).
"""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from engine.model.errors import CheckpointError, ConfigError
from engine.model.weights import WeightSource

logger = logging.getLogger("ddtree.engine")

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"


def fp8_block_size(q: dict) -> tuple[int, int]:
    """The weight block size of a DeepSeek-style FP8 quantization_config; other FP8 variants are refused by name."""
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config field 'quantization_config.fmt'={q['fmt']!r} is not supported (only 'e4m3')")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"config field 'quantization_config.activation_scheme'={q['activation_scheme']!r} is not "
                          f"supported (only 'dynamic')")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                         for b in block)):
        raise ConfigError(f"config field 'quantization_config.weight_block_size'={block!r} must be two positive "
                          f"integers (per-tensor FP8 is not supported)")
    return int(block[0]), int(block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] float8_e4m3fn, scale_inv [ceil(out / b0), ceil(in / b1)] -> [out, in] float32."""
    out_dim, in_dim = weight.shape
    want = (-(-out_dim // block[0]), -(-in_dim // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)}, expected {want} for a {tuple(weight.shape)} weight "
                         f"in {block[0]}x{block[1]} blocks")
    scales = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out_dim, :in_dim]
    return weight.float() * scales


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (float8_e4m3fn weight, float32 scale_inv per block) in the DeepSeek-V3 layout:
    each block scaled so its largest magnitude maps to the format's maximum (448)."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.float()
    tiles = padded.view(rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [rows, cols]
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(rows * block[0], cols * block[1])[:out_dim, :in_dim].contiguous(), scale_inv


class Fp8BlockWeights(WeightSource):
    """A checkpoint's tensors with its FP8 weights dequantized (float32) and their scales hidden, except the weights
    in `kept` (set before the loader plans): those stay float8_e4m3fn and their `weight_scale_inv` is listed."""

    def __init__(self, inner: WeightSource, block: tuple[int, int]):
        self.inner, self.block, self.where = inner, block, inner.where
        self.desc = inner.desc + " (FP8, dequantized)"
        shapes = inner.shapes()
        self.scale_of = {k.removesuffix(SCALE_SUFFIX): k for k in shapes if k.endswith(SCALE_SUFFIX)}
        missing = [k for k in self.scale_of if k not in shapes]
        if missing:
            raise CheckpointError(self.where, f"tensor {self.scale_of[missing[0]]!r} scales a weight that is missing")
        self._scale_shapes = {k: s for k, s in shapes.items() if k.endswith(SCALE_SUFFIX)}
        self._shapes = {k: s for k, s in shapes.items() if not k.endswith(SCALE_SUFFIX)}
        self._scales = {w: t for w, t in self._read_scales()}
        self.kept: set[str] = set()  # weight keys loaded as stored (FP8 GEMMs), with their scales

    def _read_scales(self) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = {s: w for w, s in self.scale_of.items()}
        for key, tensor in self.inner.read(set(wanted)):
            yield wanted[key], tensor.float().clone()

    def shapes(self):
        return {**self._shapes, **{self.scale_of[w]: self._scale_shapes[self.scale_of[w]] for w in self.kept}}

    def nbytes(self, key):
        return self.inner.nbytes(key)

    def read(self, keys):
        scales = {k for k in keys if k.endswith(SCALE_SUFFIX)}
        for key in scales:  # only kept weights' scales are listed; they were read at construction
            yield key, self._scales[key.removesuffix(SCALE_SUFFIX)]
        for key, tensor in self.inner.read(set(keys) - scales):
            if key in self._scales and tensor.dtype != torch.float8_e4m3fn:
                raise CheckpointError(self.where, f"tensor {key!r} has a scale but is stored as {tensor.dtype}, "
                                                  f"not float8_e4m3fn")
            if tensor.dtype == torch.float8_e4m3fn and key not in self.kept:
                scale = self._scales.get(key)
                if scale is None:
                    raise CheckpointError(self.where, f"FP8 tensor {key!r} has no {key + SCALE_SUFFIX!r}")
                try:
                    tensor = dequantize_block_fp8(tensor, scale, self.block)
                except ValueError as e:
                    raise CheckpointError(self.where, f"tensor {key!r}: {e}") from None
            yield key, tensor

    def log_done(self, count, nbytes, seconds, dtype):
        self.inner.log_done(count, nbytes, seconds, dtype)
        logger.info("dequantized %d FP8 block-quantized weights (%dx%d blocks) to %s", len(self._scales),
                    *self.block, str(dtype).removeprefix("torch."))
