"""INT4 weight-only checkpoints as Kimi-K2-Thinking publishes them: compressed-tensors "pack-quantized", symmetric
int4 with one scale per group of input columns (or per output channel). A quantized Linear stores
`<name>.weight_packed` (int32, [out, ceil(in * 4 / 32)]: value i of a row at bits 4i..4i+3 of the row's words,
little-endian, stored as q + 8), `<name>.weight_scale` ([out, ceil(in / group)], or [out, 1] per channel) and
`<name>.weight_shape` ([out, in]); the real weight is q x scale. Modules on the config's ignore list are stored
unquantized.

Loading dequantizes these weights to the model's dtype as they stream in (Int4PackedWeights wraps the checkpoint's
WeightSource), except on CUDA where engine/model/int4_linear.py keeps them packed for its W4A16 GEMM.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.model.errors import CheckpointError, ConfigError
from engine.model.weights import WeightSource
from ext.reference import quant as reference_quant

logger = logging.getLogger("ddtree.engine")

SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")


@dataclass(frozen=True)
class Int4Scheme:
    group_size: int | None  # None: one scale per output channel


def int4_scheme(q: dict) -> Int4Scheme:
    """The scheme of a compressed-tensors quantization_config we can load; a ConfigError naming the field
    otherwise."""
    if q.get("format", "pack-quantized") != "pack-quantized":
        raise ConfigError(f"config field 'quantization_config.format'={q['format']!r} is not supported (only "
                          f"'pack-quantized')")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"config field 'quantization_config.config_groups' has {len(groups)} groups (only one "
                          f"weight scheme is supported)")
    (name, group), = groups.items()
    w, where = group.get("weights") or {}, f"quantization_config.config_groups.{name}"
    if group.get("input_activations"):
        raise ConfigError(f"config field '{where}.input_activations' is set: only weight-only quantization is "
                          f"supported")
    if (w.get("num_bits"), w.get("type", "int")) != (4, "int"):
        raise ConfigError(f"config field '{where}.weights' is {w.get('num_bits')}-bit {w.get('type')!r}: only 4-bit "
                          f"int is supported")
    if not w.get("symmetric", True):
        raise ConfigError(f"config field '{where}.weights.symmetric' is false: zero points are not supported")
    strategy = w.get("strategy", "group")
    if strategy == "channel":
        return Int4Scheme(None)
    if strategy != "group" or not isinstance(w.get("group_size"), int) or w["group_size"] < 1:
        raise ConfigError(f"config field '{where}.weights' strategy {strategy!r} group_size {w.get('group_size')!r} "
                          f"is not supported (group with a positive group_size, or channel)")
    return Int4Scheme(int(w["group_size"]))


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
                    scheme: Int4Scheme) -> torch.Tensor:
    out_dim, in_dim = shape
    if packed.shape[0] != out_dim or packed.shape[1] * 8 < in_dim:
        raise ValueError(f"packed shape {tuple(packed.shape)} cannot hold a {shape} weight")
    groups = 1 if scheme.group_size is None else -(-in_dim // scheme.group_size)
    if tuple(scale.shape) != (out_dim, groups):
        raise ValueError(f"scale shape {tuple(scale.shape)}, expected {(out_dim, groups)}")
    return reference_quant.dequantize_int4(packed, scale, in_dim, in_dim if scheme.group_size is None
                                           else scheme.group_size)


class Int4PackedWeights(WeightSource):
    """A checkpoint's tensors with every packed INT4 weight dequantized (float32) under its plain `.weight` name."""

    def __init__(self, inner: WeightSource, scheme: Int4Scheme):
        self.inner, self.scheme, self.where = inner, scheme, inner.where
        self.desc = inner.desc + " (INT4, dequantized)"
        shapes = inner.shapes()
        bases = {k.removesuffix(".weight_packed") for k in shapes if k.endswith(".weight_packed")}
        for base in bases:
            for suffix in SUFFIXES:
                if base + suffix not in shapes:
                    raise CheckpointError(self.where, f"tensor {base + suffix!r} is missing (INT4 weight {base!r})")
        small = {base + s for base in bases for s in (".weight_scale", ".weight_shape")}
        self._small = dict(inner.read(small))  # scales and shapes: small, read once up front
        self._shapes = {k: s for k, s in shapes.items() if not k.endswith(SUFFIXES)}
        for base in bases:
            self._shapes[base + ".weight"] = tuple(int(d) for d in self._small[base + ".weight_shape"].tolist())
        self.count = len(bases)

    def shapes(self):
        return dict(self._shapes)

    def nbytes(self, key):
        base = key.removesuffix(".weight")
        return self.inner.nbytes(base + ".weight_packed" if base + ".weight_scale" in self._small else key)

    def read(self, keys):
        inner_keys = {k.removesuffix(".weight") + ".weight_packed" if k.removesuffix(".weight") + ".weight_scale"
                      in self._small else k for k in keys}
        for key, tensor in self.inner.read(inner_keys):
            if not key.endswith(".weight_packed"):
                yield key, tensor
                continue
            base = key.removesuffix(".weight_packed")
            shape = tuple(int(d) for d in self._small[base + ".weight_shape"].tolist())
            try:
                yield base + ".weight", dequantize_int4(tensor, self._small[base + ".weight_scale"], shape,
                                                        self.scheme)
            except ValueError as e:
                raise CheckpointError(self.where, f"INT4 weight {base!r}: {e}") from None

    def log_done(self, count, nbytes, seconds, dtype):
        self.inner.log_done(count, nbytes, seconds, dtype)
        logger.info("dequantized %d INT4 weights (%s) to %s", self.count,
                    "per channel" if self.scheme.group_size is None else f"groups of {self.scheme.group_size}",
                    str(dtype).removeprefix("torch."))
