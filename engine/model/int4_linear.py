"""W4A16 linear layers for compressed-tensors pack-quantized INT4 checkpoints (engine/model/int4.py describes the
layout): the layer, which linears of a model get it, and the weight source that loads their packed weights as
stored.

Int4Linear keeps `weight_packed` [out, in / 8] int32 and `weight_scale` [out, groups] (float32: the stored bf16
scales widen exactly) and never materialises the bf16 weight for decode-sized batches: up to
ext.ops.W4A16_MAX_ROWS rows run ext.ops.w4a16_gemm (one kernel that reads a quarter of the bf16 bytes,
dequantizes in registers and sums in fp32). Larger batches (prefill chunks, wide verify steps) dequantize the
weight for that call (ext.ops.int4_dequantize, one kernel) and run a dense matmul: slower than bf16 by that pass.

Which linears (`int4_linear_plan`): those stored packed, except routed MoE experts (their grouped GEMM takes
stacked bf16 weights), MLA's kv_b_proj (read as a matrix), and shapes the kernel does not take (in_features % 8,
a group size that is not a multiple of 8); they are dequantized on load as before. Tensor-parallel models keep
the dequantizing path (their shard specs cut weights, not packed words and group scales). Int4GemmWeights swaps the
chosen nn.Linear modules on the meta device before the loader plans (`prepare_model`); one log line says how many.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.int4 import Int4PackedWeights, Int4Scheme
from engine.model.weights import WeightSource
from ext import ops

logger = logging.getLogger("ddtree.engine")

MATRIX_READ = {"kv_b_proj": "read as a matrix by MLA's absorbed attention",
               "lm_head": "read as a matrix by compute_logits"}


def _kept(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.keep_dtype = True  # the loader fills it in this dtype, not the model's (engine/model/loader.py fill_weights)
    return p


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W = int4 q x per-group scale, stored packed (the checkpoint's tensors)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, device=None):
        super().__init__()
        if in_features % 8 or group_size % 8:
            raise ValueError(f"Int4Linear needs in_features and group_size that are multiples of 8, got "
                             f"{in_features} and {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.weight_packed = _kept((out_features, in_features // 8), torch.int32, device)
        self.weight_scale = _kept((out_features, -(-in_features // group_size)), torch.float32, device)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] in x's dtype
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if 0 < rows.shape[0] <= ops.W4A16_MAX_ROWS:
            out = ops.w4a16_gemm(rows, self.weight_packed, self.weight_scale, self.group_size)
        else:
            weight = ops.int4_dequantize(self.weight_packed, self.weight_scale, self.group_size, x.dtype)
            out = F.linear(rows, weight)  # [M, out]; weight [out, in], one kernel, freed after the call
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def concat(cls, parts: list["Int4Linear"]) -> "Int4Linear | None":
        """One layer computing the parts' outputs side by side (fused projections): packed rows and their scales
        stack along out. None when the parts' group sizes differ."""
        first = parts[0]
        if any(p.group_size != first.group_size for p in parts):
            return None
        fused = cls(first.in_features, sum(p.out_features for p in parts), first.group_size,
                    first.bias is not None, device="meta")
        with torch.no_grad():
            fused.weight_packed = nn.Parameter(torch.cat([p.weight_packed for p in parts]), requires_grad=False)
            fused.weight_scale = nn.Parameter(torch.cat([p.weight_scale for p in parts]), requires_grad=False)
            if first.bias is not None:
                fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        return fused


def gemm_unavailable(scheme: Int4Scheme, dtype: torch.dtype, device) -> str | None:
    """Why W4A16 GEMMs cannot serve a load (None: they may)."""
    if torch.device(device).type != "cuda":
        return f"device {torch.device(device).type}: the W4A16 kernel runs on CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(dtype).removeprefix('torch.')}: W4A16 GEMMs serve bf16 / fp16 models"
    if scheme.group_size is not None and scheme.group_size % 8:
        return f"group_size {scheme.group_size}: the kernel needs a multiple of 8"
    return None


def int4_linear_plan(model: nn.Module, packed: set[str]) -> dict[str, str | None]:
    """Every nn.Linear whose checkpoint base name is in `packed` -> None when it becomes an Int4Linear, else why it
    stays a dequantized nn.Linear."""
    from engine.model.moe import Experts

    experts = tuple(name + "." for name, m in model.named_modules() if isinstance(m, Experts))
    plan: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or model.hf_name(name + ".weight").removesuffix(".weight") not in packed:
            continue
        if name.startswith(experts):
            plan[name] = "routed expert"
        elif name.rpartition(".")[2] in MATRIX_READ:
            plan[name] = MATRIX_READ[name.rpartition(".")[2]]
        elif module.in_features % 8:
            plan[name] = f"in_features {module.in_features} is not a multiple of 8"
        else:
            plan[name] = None
    return plan


class Int4GemmWeights(Int4PackedWeights):
    """Int4PackedWeights that, once it has seen the model (`prepare_model`), passes the chosen linears' packed
    weights and scales through as stored (weight_shape checked, not loaded) and dequantizes the rest."""

    def __init__(self, inner: WeightSource, scheme: Int4Scheme):
        super().__init__(inner, scheme)
        self.desc = inner.desc + " (INT4)"
        self.kept: set[str] = set()  # checkpoint base names loaded packed
        self.plan: dict[str, str | None] = {}

    def prepare_model(self, model: nn.Module) -> None:
        """Called by the loader before it plans: swaps the chosen linears for Int4Linear on the meta device."""
        bases = {k.removesuffix(".weight_shape") for k in self._small if k.endswith(".weight_shape")}
        self.plan = int4_linear_plan(model, bases)
        if getattr(model, "shard_specs", None):
            self.plan = {n: "tensor parallel: sharding packed INT4 weights is not implemented" for n in self.plan}
        for name, reason in self.plan.items():
            if reason is not None:
                continue
            old = model.get_submodule(name)
            group = old.in_features if self.scheme.group_size is None else self.scheme.group_size
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr,
                    Int4Linear(old.in_features, old.out_features, group, old.bias is not None, device="meta"))
            self.kept.add(model.hf_name(name + ".weight").removesuffix(".weight"))

    def shapes(self):
        shapes = super().shapes()
        for base in self.kept:
            del shapes[base + ".weight"]
            shapes[base + ".weight_packed"] = tuple(self.inner.shapes()[base + ".weight_packed"])
            shapes[base + ".weight_scale"] = tuple(self._small[base + ".weight_scale"].shape)
        return shapes

    def nbytes(self, key):
        return self.inner.nbytes(key) if key.removesuffix(".weight_packed").removesuffix(".weight_scale") in \
            self.kept else super().nbytes(key)

    def read(self, keys):
        keys = set(keys)
        mine = {k for k in keys if k.endswith((".weight_packed", ".weight_scale"))}
        for key in sorted(k for k in mine if k.endswith(".weight_scale")):
            yield key, self._small[key]
        packed = {k for k in mine if k.endswith(".weight_packed")}
        if packed:
            yield from self.inner.read(packed)
        yield from super().read(keys - mine)

    def log_done(self, count, nbytes, seconds, dtype):
        self.inner.log_done(count, nbytes, seconds, dtype)
        others = {n.rpartition(".")[2] + ": " + r for n, r in self.plan.items() if r is not None}
        logger.info("W4A16 GEMMs for %d linear layers (int4 %s, ext.ops.w4a16_gemm up to %d rows); %d INT4 weights "
                    "dequantized to %s%s", len(self.kept),
                    "per channel" if self.scheme.group_size is None else f"groups of {self.scheme.group_size}",
                    ops.W4A16_MAX_ROWS, self.count - len(self.kept), str(dtype).removeprefix("torch."),
                    f" ({'; '.join(sorted(others))})" if others else "")


def int4_modules(model: nn.Module) -> list[Int4Linear]:
    return [m for m in model.modules() if isinstance(m, Int4Linear)]
