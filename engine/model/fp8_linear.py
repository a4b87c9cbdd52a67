"""FP8 GEMMs for DeepSeek-V3-style block-FP8 checkpoints (engine/model/fp8.py describes the layout): the linear
layer that runs them, which linear layers of a model get it, and the load-time check that it works.

Fp8BlockLinear keeps the checkpoint's float8_e4m3fn `weight` [out, in] and float32 `weight_scale_inv`
[out / 128, in / 128] as they are stored. Its forward quantizes the activations per token per 128 columns
(scale = amax / 448) and runs one blockwise-scaled GEMM, torch._scaled_mm with 1x128 activation scales and 128x128
weight scales (cuBLASLt, CUDA >= 12.9, sm_90), accumulating in fp32 and writing bf16. `emulated_blockwise_mm` is
its reference: both operands dequantized by their scales, one fp32 matmul.

Which linears run FP8 (`fp8_linear_plan`): those whose weight has a scale in the checkpoint, except
- routed MoE experts (engine/model/moe.py packs them into stacked bf16 tensors for its grouped GEMM; an FP8
  grouped GEMM is future work), so they are dequantized to bf16 as before;
- weights read as matrices rather than called: MLA's kv_b_proj (absorbed attention), lm_head;
- shapes the GEMM does not take: out_features % 128 != 0 (DeepSeek-V3's kv_a_proj_with_mqa, 576 rows), or
  in_features % 512 != 0 (cuBLASLt wants the 128x128 scales' K/128 leading dimension padded to a multiple of 4,
  and torch._scaled_mm takes them unpadded, so K/128 must already be one);
- tensor-parallel models (their shard specs cut weights, not per-block scales).
Fp8GemmWeights (a Fp8BlockWeights) swaps those nn.Linear modules for Fp8BlockLinear on the meta device before the
loader plans (`prepare_model`), and passes their FP8 weights and scales through as stored. Before any swap, each
distinct weight shape is probed once per device: an Fp8BlockLinear of that shape with random weights must run and
match its emulation; if any shape fails, no module is swapped and every FP8 weight is dequantized (the reason is
logged). One log line says which path a load took.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from engine.model.fp8 import Fp8BlockWeights, dequantize_block_fp8, quantize_block_fp8
from engine.model.weights import WeightSource
from ext import ops

logger = logging.getLogger("ddtree.engine")

BLOCK = 128  # the only block size torch._scaled_mm's blockwise scaling takes (1x128 and 128x128)
AMAX_FLOOR = 1e-10  # an all-zero group (padding rows) gets a tiny positive scale, not a division by zero
# activation rows are padded to a multiple of this: cuBLASLt's 1x128 scales are M-major, and their leading
# dimension (M floats) must be 16-byte aligned
M_ALIGN = 4
PROBE_TOKENS = (3, 257)  # one partial tile and several, both padded
PROBE_REL_TOL = 1e-2  # GEMM vs its fp32 emulation, relative Frobenius error: bf16 output rounding is ~4e-3
MATRIX_READ = {"kv_b_proj": "read as a matrix by MLA's absorbed attention",
               "lm_head": "read as a matrix by compute_logits"}

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def quantize_activations(x: torch.Tensor, padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (float8_e4m3fn [P, K], float32 scales [P, K / 128] with strides (1, P)), P =
    padded_rows (default M; rows past M are zeros): each token's 128-column group scaled so its largest magnitude
    maps to 448; x ~= x_fp8 * scale, group by group. One kernel on CUDA (ext.ops.quantize_fp8_blockwise)."""
    q, scale_t = ops.quantize_fp8_blockwise(x, x.shape[0] if padded_rows is None else padded_rows, AMAX_FLOOR)
    return q, scale_t.t()  # [P, K/128], outer-dim-major as torch._scaled_mm's 1x128 scales must be


def scaled_mm_blockwise(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 [M, K] row-major with x_scale [M, K/128]; weight [N, K] with scale_inv [N/128, K/128] (contiguous)
    -> [M, N] in out_dtype. torch._scaled_mm wants mat2 [K, N] column-major (weight.t() is), the 1x128 scales
    outer-dim-major ([M, K/128] with strides (1, M)) and the 128x128 scales as [K/128, N/128] whose transpose is
    contiguous (scale_inv.t() is)."""
    scale_a = x_scale.t().contiguous().t()  # [M, K/128], strides (1, M) (a no-op for quantize_activations')
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=scale_a, scale_b=scale_inv.t(), out_dtype=out_dtype)


GEMM_NAMES = {scaled_mm_blockwise: "torch._scaled_mm"}


def emulated_blockwise_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """The reference of scaled_mm_blockwise (same arguments): both operands dequantized, one fp32 matmul."""
    m, k = x_fp8.shape
    x = (x_fp8.float().view(m, k // BLOCK, BLOCK) * x_scale[..., None]).view(m, k)  # [M, K]
    w = dequantize_block_fp8(weight, scale_inv, (BLOCK, BLOCK))  # [N, K] fp32
    return (x @ w.t()).to(out_dtype)


def _fp8_param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.keep_dtype = True  # the loader fills it in this dtype, not the model's (engine/model/loader.py fill_weights)
    return p


class Fp8BlockLinear(nn.Module):
    """y = x W^T (+ b) with W stored as float8_e4m3fn blocks and their float32 scales (the checkpoint's tensors)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, gemm: Gemm = scaled_mm_blockwise):
        super().__init__()
        if in_features % BLOCK or out_features % BLOCK:
            raise ValueError(f"Fp8BlockLinear needs dimensions that are multiples of {BLOCK}, got {out_features}x"
                             f"{in_features}")
        self.in_features, self.out_features, self.gemm = in_features, out_features, gemm
        self.weight = _fp8_param((out_features, in_features), torch.float8_e4m3fn, device)
        self.weight_scale_inv = _fp8_param((out_features // BLOCK, in_features // BLOCK), torch.float32, device)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] in x's dtype
        return self._run(x, self.gemm)

    def emulate(self, x: torch.Tensor) -> torch.Tensor:
        """forward with the fp32 emulation of the GEMM (the same activation quantization)."""
        return self._run(x, emulated_blockwise_mm)

    def _run(self, x: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        m = rows.shape[0]
        padded = -(-m // M_ALIGN) * M_ALIGN  # zero rows past M: their outputs are dropped below
        x_fp8, x_scale = quantize_activations(rows, padded)
        out = gemm(x_fp8, x_scale, self.weight, self.weight_scale_inv, x.dtype)[:m]  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def concat(cls, parts: list["Fp8BlockLinear"]) -> "Fp8BlockLinear":
        """One layer computing the parts' outputs side by side (fused projections). Every part's out_features is
        a multiple of 128, so the weights' blocks and their scales stack along out unchanged."""
        first = parts[0]
        fused = cls(first.in_features, sum(p.out_features for p in parts), first.bias is not None, device="meta",
                    gemm=first.gemm)
        with torch.no_grad():
            # cat through uint8: float8 cat is not implemented on every backend
            weight = torch.cat([p.weight.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
            fused.weight = nn.Parameter(weight, requires_grad=False)
            fused.weight_scale_inv = nn.Parameter(torch.cat([p.weight_scale_inv for p in parts]), requires_grad=False)
            if first.bias is not None:
                fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        return fused


# ---- which linears run FP8 -------------------------------------------------------------------------------------

def gemm_unavailable(block: tuple[int, int], dtype: torch.dtype, device) -> str | None:
    """Why FP8 GEMMs cannot serve a load (None: they may, each weight shape subject to the probe)."""
    if tuple(block) != (BLOCK, BLOCK):
        return f"weight_block_size {list(block)}: torch._scaled_mm's blockwise scaling takes 128x128 blocks"
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')}: FP8 GEMMs serve bf16 models"
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device.type}: FP8 GEMMs need CUDA sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0):
        return f"compute capability sm_{major}{minor}: blockwise FP8 GEMMs need sm_90"
    return None


def choose_gemm(block: tuple[int, int], dtype: torch.dtype, device) -> tuple[Gemm | None, str | None]:
    """(the GEMM FP8 linears run with, None) or (None, why FP8 GEMMs are off for this load)."""
    reason = gemm_unavailable(block, dtype, device)
    return (None, reason) if reason is not None else (scaled_mm_blockwise, None)


def _routed_expert_prefixes(model: nn.Module) -> tuple[str, ...]:
    from engine.model.moe import Experts

    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, Experts))


def fp8_linear_plan(model: nn.Module, scaled: set[str]) -> dict[str, str | None]:
    """Every nn.Linear whose weight's checkpoint name is in `scaled` (weights with a weight_scale_inv) -> None when
    it becomes an Fp8BlockLinear, else why it stays a dequantized nn.Linear."""
    experts = _routed_expert_prefixes(model)
    plan: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or model.hf_name(name + ".weight") not in scaled:
            continue
        out_features, in_features = module.out_features, module.in_features
        if name.startswith(experts):
            plan[name] = "routed expert"
        elif name.rpartition(".")[2] in MATRIX_READ:
            plan[name] = MATRIX_READ[name.rpartition(".")[2]]
        elif out_features % BLOCK or in_features % (4 * BLOCK):
            plan[name] = f"{out_features}x{in_features} (needs out % 128 == 0 and in % 512 == 0)"
        else:
            plan[name] = None
    return plan


def probe(out_features: int, in_features: int, device, gemm: Gemm) -> str | None:
    """None when an Fp8BlockLinear of this shape runs on `device` and matches its emulation, else why not."""
    g = torch.Generator(device=device).manual_seed(0)
    weight, scale_inv = quantize_block_fp8(torch.randn(out_features, in_features, device=device, generator=g))
    layer = Fp8BlockLinear(in_features, out_features, bias=False, device="meta", gemm=gemm)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
    x = torch.randn(max(PROBE_TOKENS), in_features, device=device, generator=g).to(torch.bfloat16)
    for m in PROBE_TOKENS:
        try:
            got = layer(x[:m]).float()
        except (RuntimeError, ValueError, TypeError) as e:  # NotImplementedError is a RuntimeError
            return f"the FP8 GEMM failed on a {out_features}x{in_features} weight: {str(e).splitlines()[0]}"
        want = layer.emulate(x[:m]).float()
        err = float((got - want).norm() / want.norm().clamp(min=1e-30))
        if not err <= PROBE_REL_TOL:
            return (f"the FP8 GEMM differs from its emulation on a {out_features}x{in_features} weight with {m} "
                    f"tokens (relative error {err:.3g} > {PROBE_REL_TOL})")
    return None


_PROBED: dict[tuple, str | None] = {}  # (device, out, in, gemm) -> probe's answer; decided once per process


def probe_once(out_features: int, in_features: int, device, gemm: Gemm) -> str | None:
    key = (str(torch.device(device)), out_features, in_features, gemm)
    if key not in _PROBED:
        _PROBED[key] = probe(out_features, in_features, device, gemm)
    return _PROBED[key]


class Fp8GemmWeights(Fp8BlockWeights):
    """Fp8BlockWeights that, once it has seen the model (`prepare_model`), keeps the FP8 linears' weights and
    scales as stored and swaps those linears for Fp8BlockLinear."""

    def __init__(self, inner: WeightSource, block: tuple[int, int], device, gemm: Gemm):
        super().__init__(inner, block)
        self.device, self.gemm = device, gemm
        self.desc = inner.desc + " (FP8)"
        self.plan: dict[str, str | None] = {}
        self.off_reason: str | None = None  # why no linear runs FP8 after all (a probe failed, tensor parallel)

    def prepare_model(self, model: nn.Module) -> None:
        """Called by the loader before it plans: swaps the FP8 linears on the meta device."""
        self.plan = fp8_linear_plan(model, set(self.scale_of))
        chosen = [name for name, reason in self.plan.items() if reason is None]
        self.off_reason = self._why_off(model, chosen)
        if self.off_reason is not None:
            logger.warning("FP8 GEMMs are off (%s): every FP8 weight is dequantized on load", self.off_reason)
            return
        for name in chosen:
            old = model.get_submodule(name)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr,
                    Fp8BlockLinear(old.in_features, old.out_features, old.bias is not None, "meta", self.gemm))
        self.kept = {model.hf_name(name + ".weight") for name in chosen}

    def _why_off(self, model: nn.Module, chosen: list[str]) -> str | None:
        if getattr(model, "shard_specs", None):
            return "tensor parallel: sharding FP8 weights with their block scales is not implemented"
        shapes = sorted({(model.get_submodule(n).out_features, model.get_submodule(n).in_features) for n in chosen})
        for out_features, in_features in shapes:
            reason = probe_once(out_features, in_features, self.device, self.gemm)
            if reason is not None:
                return reason
        return None

    def log_done(self, count, nbytes, seconds, dtype):
        self.inner.log_done(count, nbytes, seconds, dtype)
        dtype_name = str(dtype).removeprefix("torch.")
        if self.off_reason is not None:
            logger.info("FP8 GEMMs for 0 linear layers (%s); %d FP8 weights dequantized to %s", self.off_reason,
                        len(self._scales), dtype_name)
            return
        experts = sum(1 for r in self.plan.values() if r == "routed expert")
        others = {name: r for name, r in self.plan.items() if r not in (None, "routed expert")}
        why = "; ".join(sorted({f"{name.rpartition('.')[2]}: {r}" for name, r in others.items()}))
        logger.info("FP8 GEMMs for %d linear layers (blockwise 128x128, %s); %d routed-expert weights dequantized "
                    "to %s%s", len(self.kept), GEMM_NAMES.get(self.gemm, self.gemm.__name__), experts, dtype_name,
                    f"; {len(others)} other FP8 weights dequantized ({why})" if others else "")


def fp8_modules(model: nn.Module) -> list[Fp8BlockLinear]:
    return [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
