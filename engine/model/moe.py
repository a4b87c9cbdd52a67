"""Mixture-of-experts pieces shared by Qwen3-MoE and DeepSeek-V3: the routed experts (one SwiGLU MLP each, the
checkpoints' per-expert layout, packed after loading into two stacked tensors that the experts' parameters view)
and the token -> expert dispatch: on CUDA one pair of grouped GEMMs over tokens sorted by expert, with no host sync
(so MoE steps can run as CUDA graphs); elsewhere, or where the grouped GEMM is unavailable, the loop over the
experts the tokens chose (the reference; it synchronizes to learn which experts those are). Routers live with
their family."""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.model.layers import GatedMLP
from ext import ops


class Experts(nn.ModuleList):
    """The routed experts. After loading, fuse_projections() stacks their weights into w13 [E, 2I, H] ([gate; up]
    per expert) and w2 [E, H, I]; each expert's parameters become views of those (no second copy)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self._grouped: dict[tuple, bool] = {}  # (device, dtype) -> the grouped GEMM serves these shapes

    def fuse_projections(self) -> None:
        with torch.no_grad():
            self.w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in self])
            self.w2 = torch.stack([m.down_proj.weight for m in self])
        for e, m in enumerate(self):
            fused = nn.Linear(m.gate_proj.in_features, 2 * m.gate_proj.out_features, bias=False, device="meta")
            fused.weight = nn.Parameter(self.w13[e], requires_grad=False)
            m.gate_up_proj = fused
            del m.gate_proj, m.up_proj
            m.down_proj.weight = nn.Parameter(self.w2[e], requires_grad=False)

    def grouped_ok(self, x: torch.Tensor) -> bool:
        """Whether the sync-free grouped path serves inputs like x: CUDA, bf16 on sm_90+ (torch's grouped GEMM
        for other dtypes loops on the host over the group ends), checked once against the loop."""
        if self.w13 is None or x.device.type != "cuda" or x.dtype != torch.bfloat16:
            return False
        key = (x.device, x.dtype)
        if key not in self._grouped:  # decided once: this runs per MoE layer per forward
            self._grouped[key] = self._check_grouped(x.device, x.dtype)
        return self._grouped[key]

    def _check_grouped(self, device, dtype) -> bool:
        if torch.cuda.get_device_capability(device) < (9, 0):
            return False
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(4, self.w13.shape[2], generator=g).to(device, dtype)
        ids = torch.randint(0, len(self), (4, 2), generator=g).to(device)
        weights = torch.rand(4, 2, generator=g).to(device, dtype)
        try:
            got = run_experts_grouped(self, x, ids, weights)
        except (RuntimeError, NotImplementedError):
            return False
        want = _run_experts_loop(self, x, ids, weights)
        return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


def make_experts(num_experts: int, hidden_size: int, intermediate_size: int) -> Experts:
    return Experts(num_experts, hidden_size, intermediate_size)


def sync_free(model: nn.Module) -> bool:
    """Whether every MoE layer of `model` dispatches without a host sync on its device and dtype."""
    param = next(model.parameters())
    probe = torch.empty(0, device=param.device, dtype=param.dtype)
    return all(m.grouped_ok(probe) for m in model.modules() if isinstance(m, Experts))


def run_experts(
    experts: Experts,
    x: torch.Tensor,  # [num_tokens, hidden]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    topk_weights: torch.Tensor,  # [num_tokens, top_k], in x's dtype
) -> torch.Tensor:  # [num_tokens, hidden]
    if experts.grouped_ok(x):
        return run_experts_grouped(experts, x, topk_ids, topk_weights)
    return _run_experts_loop(experts, x, topk_ids, topk_weights)


def run_experts_grouped(experts: Experts, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
    """Every (token, chosen expert) pair sorted by expert, then two grouped GEMMs whose group ends come from the
    device (no host sync, fixed shapes for a given number of tokens)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [T*k]
    order = flat.argsort(stable=True)
    counts = torch.zeros(len(experts), dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync for its size
    ends = counts.cumsum(0, dtype=torch.int32)  # [E]
    rows = order // top_k  # the token of each sorted pair
    h = torch._grouped_mm(x[rows], experts.w13.transpose(1, 2), offs=ends)  # [T*k, 2I]
    h = ops.silu_and_mul(h)  # [T*k, I]
    y = torch._grouped_mm(h, experts.w2.transpose(1, 2), offs=ends)  # [T*k, H]
    y = y * topk_weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype))


def _run_experts_loop(experts: nn.ModuleList, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    # visit only the experts some token chose; one gather + one scatter-add per expert
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        y = experts[e](x[token_idx]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


_PACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def packed_experts_layer(key: str) -> int | None:
    """The decoder layer of a packed expert tensor's checkpoint name, or None for any other name."""
    m = _PACKED.fullmatch(key)
    return int(m.group(1)) if m else None


def split_packed_experts(key: str, shape: tuple[int, ...]):
    """One packed expert tensor of HF's in-memory layout (`{prefix}experts.gate_up_proj` [E, 2I, H] or
    `{prefix}experts.down_proj` [E, H, I]) -> the per-expert parameters it fills, as
    [(`{prefix}experts.{e}.{gate,up,down}_proj.weight`, shape, take)] with take(packed) a view of that part.
    None for any other tensor (the per-expert layout needs no mapping). One tensor at a time: the loader never
    holds a whole state dict. Experts beyond the model's come out as unexpected tensors."""
    prefix, _, kind = key.rpartition("experts.")
    if kind not in ("gate_up_proj", "down_proj") or len(shape) != 3:
        return None
    experts, rows, cols = shape
    parts = []
    for e in range(experts):
        if kind == "gate_up_proj":
            half = rows // 2
            parts.append((f"{prefix}experts.{e}.gate_proj.weight", (half, cols), lambda t, e=e, h=half: t[e, :h]))
            parts.append((f"{prefix}experts.{e}.up_proj.weight", (rows - half, cols), lambda t, e=e, h=half: t[e, h:]))
        else:
            parts.append((f"{prefix}experts.{e}.down_proj.weight", (rows, cols), lambda t, e=e: t[e]))
    return parts
