"""Matmuls on the CPU in fp32. PyTorch's x @ W^T for a few rows does not stream the weights at the memory's rate on
every CPU. Two routes besides it:
  - one row: the product as a batched matmul over one slice of the output features per thread (split_linear).
    Whether it beats F.linear depends on the machine, so each weight serves its first one-row calls by the two in
    turn, times them, and keeps the faster (one_row_route). Those are calls that decode, each reading its weight
    cold from memory as decoding does: timed back to back on one weight (warm in the cache) the two came out
    even and a process kept F.linear for 5-31 of the embedded model's 121 weights at random, which made its
    decoding steps 10-50% slower (2026-12-08). On a 2-core AMD EPYC a decoding step's matmuls of the embedded
    model took 15-19 ms split against 43 ms F.linear; on a 2-core Intel Xeon the split was 2-4x slower than
    F.linear (the vocabulary projection 8.6 against 2.5 ms);
  - more rows at inference: oneDNN's packed inner product over a reordered copy of the weight (cpu_linear),
    near the weight-streaming floor up to ~16 rows, and ahead of MKL's gemm at prefill sizes too (both machines).
On the AMD machine, a decoding step's matmuls (30 layers and the vocabulary projection), ms: 8 rows F.linear 57,
split 45, oneDNN 24.5; 16 rows 67 / 66 / 32; 512 rows 760 / 890 / 649. The cost: the packed copy doubles the
weights' memory. Values equal F.linear's up to the summation order (~1e-6 relative). docs/BENCHMARKS.md,
2026-12-05."""
from __future__ import annotations

import functools
import logging
import statistics
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger("ddtree.ext")

CPU_SPLIT_MAX_ROWS = 64
# oneDNN's packed inner product serves 2+ rows at inference: its weights reordered once, for this batch size (the
# layout depends on it: packed for 1, 16 rows took 45 ms against 32)
PACK_BATCH_HINT = 16
ONE_ROW_SAMPLES = 3  # one-row calls each route serves (timed) before a weight keeps the faster
_ROUTES_SAID: set[tuple[tuple[int, int], str]] = set()  # (weight shape, one-row route) logged at INFO


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias) on the CPU in fp32: one row split across the threads (split_linear)
    where that measured faster than F.linear (one_row_route), more through oneDNN's packed inner product at
    inference (a packed copy of the weight kept beside it: on the embedded model 8 rows took 24.5 ms against the
    split's 44.7, 512 rows 649 against F.linear's 760), else the split up to CPU_SPLIT_MAX_ROWS rows (autograd, or
    no oneDNN); None: F.linear's call (off the CPU, other dtypes, a weight that is not a contiguous matrix, one row
    where F.linear is faster)."""
    if not _cpu_fp32(x, weight):
        return None
    num_rows = x.numel() // max(x.shape[-1], 1)
    if num_rows == 1:
        route = one_row_route(weight)
        if route is None:
            return _sampled_one_row(x, weight, bias)
        return _split(x, weight, bias, 1) if route == "split" else None
    packed = _packed(weight)
    if packed is None:
        return _split(x, weight, bias, num_rows)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def one_row_route(weight: torch.Tensor) -> str | None:
    """"split" or "linear": the one-row route this weight keeps; None while its first calls still sample both."""
    return getattr(weight, "_ddtree_one_row", None)


def _sampled_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """One of a weight's first one-row calls, served by the split or F.linear (the one with fewer samples, the
    split first) and timed; once each has ONE_ROW_SAMPLES, the weight keeps the one with the lower median. A weight
    the split does not apply to keeps F.linear untimed (None: the caller's F.linear)."""
    if not _splittable(1, weight):
        weight._ddtree_one_row = "linear"
        return None
    samples = getattr(weight, "_ddtree_one_row_samples", None)
    if samples is None:
        samples = weight._ddtree_one_row_samples = ([], [])  # seconds: (split, F.linear)
    split_s, linear_s = samples
    use_split = len(split_s) <= len(linear_s)
    t0 = _clock()
    out = _split(x, weight, bias, 1) if use_split else F.linear(x, weight, bias)
    (split_s if use_split else linear_s).append(_clock() - t0)
    if len(linear_s) >= ONE_ROW_SAMPLES:
        split_median, linear_median = statistics.median(split_s), statistics.median(linear_s)
        weight._ddtree_one_row = "split" if split_median < linear_median else "linear"
        del weight._ddtree_one_row_samples
        _log_route(tuple(weight.shape), weight._ddtree_one_row, split_median, linear_median)
    return out


def _clock() -> float:
    return time.perf_counter()


def _log_route(shape: tuple[int, int], route: str, split_s: float, linear_s: float) -> None:
    """Says at INFO once per weight shape and route which one-row route this machine takes; each weight's times
    at DEBUG after that."""
    key = (shape, route)
    level = logging.DEBUG if key in _ROUTES_SAID else logging.INFO
    _ROUTES_SAID.add(key)
    logger.log(level, "CPU one-row matmul by a [%d, %d] weight: %s (measured: split %.3f ms, F.linear %.3f ms)",
               *shape, "split across the threads" if route == "split" else "F.linear", split_s * 1e3,
               linear_s * 1e3)


def _cpu_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] == weight.shape[1])


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of the weight, made on first use and again after the weight changes in place (kept
    on the weight itself); None under autograd (the packed op has no backward) or without oneDNN."""
    if (weight.requires_grad and torch.is_grad_enabled()) or not _onednn_linear():
        return None
    key = (_version(weight), weight.data_ptr())  # an inference tensor has no version: its storage tells
    cached = getattr(weight, "_ddtree_onednn", None)
    if cached is None or cached[0] != key:
        cached = weight._ddtree_onednn = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                                      PACK_BATCH_HINT))
    return cached[1]


@functools.cache
def _onednn_linear() -> bool:
    """Whether this torch has oneDNN's packed inner product (said once when not: the split serves instead)."""
    try:
        ok = torch.backends.mkldnn.is_available() and all(
            callable(getattr(torch.ops.mkldnn, name)) for name in ("_reorder_linear_weight", "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        ok = False
    if not ok:
        logger.warning("this torch has no oneDNN packed linear: CPU matmuls of 2-%d rows split across threads, more "
                       "through F.linear", CPU_SPLIT_MAX_ROWS)
    return ok


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for an inference tensor (it keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias) with the output features split across the intra-op threads, or None
    where that does not apply (off the CPU, not fp32, more than CPU_SPLIT_MAX_ROWS rows, one thread, N not a
    multiple of the thread count, a weight that is not a contiguous matrix)."""
    if not _cpu_fp32(x, weight):
        return None
    return _split(x, weight, bias, x.numel() // max(x.shape[-1], 1))


def _split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """split_linear past its input check (cpu_linear has made it)."""
    if not _splittable(num_rows, weight):
        return None
    num_out, k = weight.shape
    chunks = torch.get_num_threads()
    rows = x.reshape(num_rows, k)
    # [chunks, N / chunks, K] @ [chunks, K, rows] -> [chunks, N / chunks, rows]: bmm runs one chunk per thread
    out = torch.bmm(weight.view(chunks, num_out // chunks, k), rows.t().expand(chunks, k, num_rows))
    out = out.permute(2, 0, 1).reshape(num_rows, num_out).contiguous()  # [rows, N] (no copy at one row)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], num_out)


def _splittable(num_rows: int, weight: torch.Tensor) -> bool:
    """Whether _split applies: up to CPU_SPLIT_MAX_ROWS rows, more than one thread, features a multiple of them."""
    chunks = torch.get_num_threads()
    return 1 <= num_rows <= CPU_SPLIT_MAX_ROWS and chunks > 1 and weight.shape[0] % chunks == 0
