"""Pure-PyTorch twins of the decoder-layer ops: exactly the eager math of engine/model/layers.py and
engine/model/attention.py as it stood before the ops existed (so CPU results are unchanged), also the CPU
implementation. The CUDA kernels (ext/csrc/layers.cu) round every intermediate the same way."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ext.reference.attention import unpadded, write_rows


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual): new_residual = x + residual (x itself when residual is None); out = weight * the
    RMSNorm of new_residual, normalised in fp32 and cast back to its dtype before the weight multiply (as HF)."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotate-half rope: x [num_tokens, num_heads, dim]; cos/sin [num_tokens, dim]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    # x * cos + rotate_half(x) * sin without materializing rotate_half: the same roundings (a - b == a + (-b))
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def rope_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, Hq, D] and k [T, Hk, D] (views allowed) rotated in place."""
    q.copy_(apply_rope(q, cos, sin))
    k.copy_(apply_rope(k, cos, sin))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate; up) -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """write_kv of k into k_cache and of v into v_cache at the same slots (-1 skipped), the padding test done once
    for both."""
    slots, (k, v) = unpadded(slot_mapping, k, v)
    write_rows(k_cache, k, slots)
    write_rows(v_cache, v, slots)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rope_inplace of q and k, then write_kv_pair of the roped k and v (one CUDA launch does both)."""
    rope_inplace(q, k, cos, sin)
    write_kv_pair(k_cache, v_cache, k, v, slot_mapping)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         silu_mul: bool = False) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T (+ bias) -> [rows, N]; silu_mul: weight is [gate; up] and the result is
    silu_and_mul of the product [rows, N / 2] (the GEMV kernel fuses it)."""
    out = F.linear(x, weight, bias)
    return silu_and_mul(out) if silu_mul else out


gemm_skinny = gemv  # the tensor-core few-row GEMM (gemm_skinny.cu) computes the same product for up to 32 rows
