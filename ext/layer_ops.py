"""The decoder layer's ops behind ext.ops (which re-exports them): KV cache writes, RMSNorm with the residual add,
rope (alone, with the cache write, with Qwen3's q/k norms), SiLU-and-mul and the decode-sized projections (the
GEMV kernel). Each runs its CUDA kernel where ext.dispatch says the extension serves the call, else its PyTorch
twin in ext/reference (the eager math the kernels reproduce)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ext import reference
from ext.cpu_linear import cpu_linear
from ext.dispatch import _FLOATS, _cuda_ops, _fallback, _on_cuda, _rows, _served


def write_kv(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter rows [num_tokens, ...] into cache [num_blocks, block_size, ...] at slot_mapping (-1 skips)."""
    ops = _cuda_ops(cache)
    if (ops is not None and cache.is_contiguous() and rows.is_cuda and slot_mapping.is_cuda
            and slot_mapping.dtype == torch.int64 and rows.dtype in _FLOATS and cache.dtype in _FLOATS):
        _served("write_kv", ops)
        ops.write_kv(cache, rows, slot_mapping)
        return
    _fallback("write_kv", cache, ops)
    reference.write_kv(cache, rows, slot_mapping)


def write_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """write_kv of k into k_cache and of v into v_cache at the same slots, in one launch."""
    ops = _cuda_ops(k_cache)
    if (ops is not None and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype in _FLOATS
            and v_cache.dtype == k_cache.dtype and k.dtype in _FLOATS and v.dtype == k.dtype and k.is_cuda
            and v.is_cuda and slot_mapping.is_cuda and slot_mapping.dtype == torch.int64):
        _served("write_kv_pair", ops)
        ops.write_kv_pair(k_cache, v_cache, k, v, slot_mapping)
        return
    _fallback("write_kv_pair", k_cache, ops)
    reference.write_kv_pair(k_cache, v_cache, k, v, slot_mapping)


# ---- decoder-layer ops (the eager math they reproduce: ext/reference/layers.py) ----------------------------------

def _norm_rows(t: torch.Tensor) -> torch.Tensor:
    """Any [..., H] as the kernel's [rows, H] or [tokens, heads, H] with a unit last stride."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    elif t.dim() > 3:
        t = t.flatten(0, -3)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual): new_residual = x + residual in x's dtype (x itself when residual is None), out =
    weight * RMSNorm(new_residual) normalised in fp32 and cast back before the weight multiply. x [..., H]
    (Qwen3's per-head q/k norm passes [T, heads, head_dim] views)."""
    ops = _cuda_ops(x)
    if (ops is not None and x.dim() >= 1 and x.dtype in _FLOATS and weight.dtype in _FLOATS and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and weight.device == x.device and x.shape[-1] < 2**31
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.device == x.device))):
        _served("fused_add_rmsnorm", ops)
        rows = _norm_rows(x)
        if residual is None:
            return ops.rms_norm(rows, weight, float(eps)).view(x.shape), x
        out, new_residual = ops.fused_add_rmsnorm(rows, _norm_rows(residual), weight, float(eps))
        return out.view(x.shape), new_residual.view(x.shape)
    _fallback("fused_add_rmsnorm", x, ops)
    return reference.fused_add_rmsnorm(x, residual, weight, eps)


def rope_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox (rotate-half) rope of q [T, Hq, D] and k [T, Hk, D] in place, one launch; cos/sin [T, D]. q and k may
    be views of the fused qkv projection (any token and head strides, unit last stride)."""
    ops = _cuda_ops(q)
    if (ops is not None and q.dim() == 3 and k.dim() == 3 and cos.dim() == 2 and sin.dim() == 2
            and q.dtype in _FLOATS and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] % 2 == 0
            and k.device == q.device and cos.device == q.device and sin.device == q.device):
        _served("rope_inplace", ops)
        ops.rope_inplace(q, k, _rows(cos), _rows(sin))
        return
    _fallback("rope_inplace", q, ops)
    reference.rope_inplace(q, k, cos, sin)


def _rope_write_kv_fits(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> bool:
    """The fused rope + cache write kernel takes these inputs (caches in q's dtype, unit last strides)."""
    return (q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and cos.dim() == 2
            and q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype and cos.dtype == q.dtype
            and sin.dtype == q.dtype and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and q.shape[-1] % 2 == 0
            and k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and all(t.device == q.device for t in (k, v, cos, sin, k_cache, v_cache, slot_mapping)))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rope_inplace(q, k, cos, sin) then write_kv_pair(k_cache, v_cache, k, v, slot_mapping) in one launch, for
    caches [blocks, block_size, Hk, D] in q's dtype; other caches (another dtype) take the two ops."""
    ops = _cuda_ops(q)
    if ops is not None and _rope_write_kv_fits(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        _served("rope_write_kv", ops)
        ops.rope_write_kv(q, k, v, _rows(cos), _rows(sin), k_cache, v_cache, slot_mapping.contiguous())
        return
    rope_inplace(q, k, cos, sin)
    write_kv_pair(k_cache, v_cache, k, v, slot_mapping)


def _qk_norm_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  caches: tuple[torch.Tensor, torch.Tensor], weights: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The norm variant's extra needs (ext/csrc/kernels.h RopeParams): weights [D] in q's dtype, every row
    16-byte aligned, and a head's half in 16-byte vectors a power of two <= 16 (its lanes reduce in one warp)."""
    d, vec = q.shape[-1], 16 // q.element_size()
    chunks = d // 2 // vec
    return (d % (2 * vec) == 0 and 0 < chunks <= 16 and chunks & (chunks - 1) == 0
            and all(w.dim() == 1 and w.shape[0] == d and w.dtype == q.dtype and w.is_contiguous()
                    and w.device == q.device for w in weights)
            and all(t.stride(i) % vec == 0 for t in (q, k, v) for i in (0, 1))
            and all(t.stride(0) % vec == 0 for t in (cos, sin))
            and all(t.data_ptr() % 16 == 0 for t in (q, k, v, cos, sin, *caches, *weights)))


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
    """Qwen3's per-head RMSNorm of q and k in place (fused_add_rmsnorm's math, weights [D]), then rope_write_kv:
    one launch where the kernel takes the shapes (bit for bit the norm kernel then the rope kernel), else the
    norms (copied back into q and k) and rope_write_kv."""
    ops = _cuda_ops(q)
    caches, weights = (k_cache, v_cache), (q_weight, k_weight)
    if (ops is not None and _rope_write_kv_fits(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
            and _qk_norm_fits(q, k, v, _rows(cos), _rows(sin), caches, weights)):
        _served("qk_norm_rope_write_kv", ops)
        ops.qk_norm_rope_write_kv(q, k, v, _rows(cos), _rows(sin), k_cache, v_cache, slot_mapping.contiguous(),
                                  q_weight, k_weight, float(eps))
        return
    for x, w in ((q, q_weight), (k, k_weight)):
        x.copy_(fused_add_rmsnorm(x, None, w, eps)[0])
    rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


# At most this many rows go through the GEMV kernel. bench/kernels.py --only gemv on the H200 (docs/BENCHMARKS.md):
# at one row it takes 0.64-0.97x cuBLAS's time on the SmolLM2 and Qwen3-8B layer projections (1.01x on Qwen3's
# gate_up, both at the weight-read floor); at two rows 0.71-1.03x on SmolLM2's and 0.93-1.16x on Qwen3-8B's; at
# four it loses on nearly all. Two rows, not one: a row's GEMV result does not depend on the other rows, and a seeded request must
# sample the same tokens alone and as choice 0 of n = 2 (cuBLAS and the GEMV round differently).
GEMV_MAX_ROWS = 2
# Rows above GEMV_MAX_ROWS up to SKINNY_MAX_ROWS go through the tensor-core GEMM (gemm_skinny.cu) when K is a
# multiple of 32 and the weight is small enough for that row count: a batch-1 verify step of a 16-node tree is 17
# rows. On the H200 (bench/kernels.py --only gemv, docs/BENCHMARKS.md 2026-12-04) it takes 0.52-0.86x cuBLAS's
# time at 4-32 rows on SmolLM2's projections (a few MB: both bound by latency); on Qwen3-8B's it takes 0.88-0.97x
# at 4-8 rows on qkv (50 MB), o_proj (34 MB) and down (101 MB) and 0.88x on o_proj at 17 rows, but 1.05-1.48x on
# the larger weights at 17 rows and 1.01-1.06x on gate_up (201 MB) and the vocabulary projections at 4-8 rows,
# which cuBLAS streams closer to the copy rate. A whole Qwen3-8B decode step (bench/step.py --qwen3-8b --batch 4 8
# --budgets 0, against --cublas-few-rows, same call) moved by about 1% either way: batch 4 5.14-5.15 against
# 5.09-5.10 ms, batch 8 5.61-5.63 against 5.69-5.71.
SKINNY_MAX_ROWS = 32
SKINNY_MAX_WEIGHT_BYTES = 40 << 20  # 9-32 rows
SKINNY_FEW_ROWS = 8
SKINNY_FEW_ROWS_MAX_WEIGHT_BYTES = 128 << 20  # 3-8 rows


def _few_rows_kernel(x: torch.Tensor, weight: torch.Tensor, rows: int) -> str | None:
    """Which few-row kernel serves `rows` rows of x times weight: "gemv", "gemm_skinny" or None (cuBLAS)."""
    if 1 <= rows <= GEMV_MAX_ROWS:
        return "gemv"
    largest = SKINNY_FEW_ROWS_MAX_WEIGHT_BYTES if rows <= SKINNY_FEW_ROWS else SKINNY_MAX_WEIGHT_BYTES
    if (GEMV_MAX_ROWS < rows <= SKINNY_MAX_ROWS and x.shape[-1] % 32 == 0
            and weight.numel() * weight.element_size() <= largest):
        return "gemm_skinny"
    return None


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor | None:
    """The few-row kernels' result when one serves this call (CUDA, up to SKINNY_MAX_ROWS rows, bf16/fp16,
    aligned), else None: other shapes, dtypes and layouts are cuBLAS's by design; a missing extension counts as a
    fallback."""
    kernel = _few_rows_kernel(x, weight, x.numel() // max(x.shape[-1], 1)) if _on_cuda(x) else None
    if kernel is None:
        return None
    ops = _cuda_ops(x)
    if ops is None:
        _fallback(kernel, x, ops)
        return None
    rows = x.reshape(-1, x.shape[-1])
    if not (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.is_contiguous() and weight.device == x.device and x.shape[-1] % 8 == 0
            and rows.stride(1) == 1 and rows.stride(0) % 8 == 0 and rows.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0 and (not silu_mul or weight.shape[0] % 2 == 0)
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.device == x.device))):
        return None
    _served(kernel, ops)
    out = getattr(ops, kernel)(rows, weight, bias, silu_mul)
    return out.view(*x.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N]: the few-row kernels for up to SKINNY_MAX_ROWS rows on
    CUDA (weight-read-bound shapes), ext/cpu_linear.py's routes on the CPU in fp32, F.linear (cuBLAS, MKL)
    otherwise."""
    out = _gemv(x, weight, bias, False)
    return out if out is not None else dense(x, weight, bias)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear() without the CUDA few-row kernels (the vocabulary projection: cuBLAS is as fast as the GEMV there):
    F.linear, or on the CPU in fp32 ext/cpu_linear.py's routes."""
    out = cpu_linear(x, weight, bias)
    return out if out is not None else F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) for a fused [gate; up] weight [2I, K] -> [..., I]: one few-row launch for
    up to SKINNY_MAX_ROWS rows on CUDA (bit-identical to the two ops), else the two ops."""
    out = _gemv(x, weight, None, True)
    return out if out is not None else silu_and_mul(dense(x, weight))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (the fused gate_up projection) -> silu(x[..., :I]) * x[..., I:] [..., I]."""
    ops = _cuda_ops(x)
    if ops is not None and x.dim() >= 1 and x.dtype in _FLOATS and x.shape[-1] % 2 == 0 and x.shape[-1] < 2**31:
        _served("silu_and_mul", ops)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        return ops.silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
    _fallback("silu_and_mul", x, ops)
    return reference.silu_and_mul(x)
