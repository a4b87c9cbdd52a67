"""Few-row matmuls on the CPU. PyTorch's x @ W^T for a few rows (MKL's gemv at one row, its gemm at small M) keeps
one of the 2-core machine's cores busy: ~12 GB/s of weights where a plain sum streams 32. The same product as a
batched matmul over one slice of the output features per thread runs every core (30-35 GB/s). On the embedded
model in fp32, a decoding step's matmuls (30 layers and the vocabulary projection, weights streamed from memory)
took 43 ms at 1 row against 19, 80 against 19 at 2 rows, 64 against 26 at 4, 88 against 42 at 6; from 9 to 128
rows the split is 0-20% faster (compute-bound from ~4 rows on two cores), from 256 rows F.linear is (prefill
chunks keep it). Values equal F.linear's up to the summation order (~1e-7 relative). docs/BENCHMARKS.md,
2026-12-05."""
from __future__ import annotations

import torch

CPU_SPLIT_MAX_ROWS = 64


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias) with the output features split across the intra-op threads, or None
    where that does not apply (off the CPU, not fp32, more than CPU_SPLIT_MAX_ROWS rows, one thread, N not a
    multiple of the thread count, a weight that is not a contiguous matrix)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    num_rows, (num_out, k) = x.numel() // max(x.shape[-1], 1), weight.shape
    chunks = torch.get_num_threads()
    if not (1 <= num_rows <= CPU_SPLIT_MAX_ROWS and chunks > 1 and num_out % chunks == 0
            and weight.is_contiguous() and x.shape[-1] == k):
        return None
    rows = x.reshape(num_rows, k)
    # [chunks, N / chunks, K] @ [chunks, K, rows] -> [chunks, N / chunks, rows]: bmm runs one chunk per thread
    out = torch.bmm(weight.view(chunks, num_out // chunks, k), rows.t().expand(chunks, k, num_rows))
    out = out.permute(2, 0, 1).reshape(num_rows, num_out).contiguous()  # [rows, N] (no copy at one row)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], num_out)
