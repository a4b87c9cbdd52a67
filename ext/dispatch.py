"""The bookkeeping behind ext.ops, the door to every custom op: whether the CUDA extension serves a call (the
extension loads and the tensors are on CUDA), `cuda_calls()` (calls it served, per op name, so tests can prove
it ran) and `reference_fallbacks()` (calls on CUDA tensors that the PyTorch reference served instead: the
extension is not loaded or the inputs are outside what the kernel supports; the first one of each op logs a
warning; ext/prefill.py adds its cuDNN declines through count_slow_path). Every door module (ext/ops.py,
ext/layer_ops.py) decides through these."""
from __future__ import annotations

import logging
from collections import Counter

import torch

logger = logging.getLogger("ddtree.ext")
_calls: Counter = Counter()
_fallbacks: Counter = Counter()  # whole process
_pending: Counter = Counter()  # since the last take_reference_fallbacks()
_warned: set[str] = set()
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def cuda_calls() -> dict[str, int]:
    """op name -> calls served by the CUDA extension in this process."""
    return dict(_calls)


def reference_fallbacks() -> dict[str, int]:
    """op name -> calls on CUDA tensors that the PyTorch reference served, in this process."""
    return dict(_fallbacks)


def take_reference_fallbacks() -> dict[str, int]:
    """op name -> reference-served CUDA calls since the previous take (per engine step), then reset."""
    global _pending
    taken, _pending = _pending, Counter()
    return dict(taken)


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda  # not t.device.type: building the device object cost ~1.5 us a call, ~40 calls a layer on CPU


def _cuda_ops(t: torch.Tensor):
    """The built extension's op namespace when `t` is on CUDA and the extension loads, else None."""
    if not _on_cuda(t):
        return None
    from ext import build  # imported lazily: CPU machines never touch the toolchain

    return build.load_ops()


def _served(name: str, ops) -> bool:
    if ops is None:
        return False
    _calls[name] += 1
    return True


def count_slow_path(name: str) -> None:
    """Counts a call on CUDA that a slower path than `name`'s fast one served (the caller logs why, once);
    reported with the reference fallbacks (metric kernel_reference_fallbacks, label op=name)."""
    _fallbacks[name] += 1
    _pending[name] += 1


def _fallback(name: str, t: torch.Tensor, ops) -> None:
    """Called where the reference is about to serve `name`: counts it when `t` is on CUDA (warns once per op)."""
    if not _on_cuda(t):
        return
    _fallbacks[name] += 1
    _pending[name] += 1
    if name in _warned:
        return
    _warned.add(name)
    if ops is None:
        from ext import build

        why = f"the CUDA extension is not loaded ({build.load_error() or 'unknown reason'})"
    else:
        why = "the inputs are outside what its CUDA kernel supports"
    logger.warning("ext op %s runs its PyTorch reference on %s: %s; counted in ext.ops.reference_fallbacks()",
                   name, t.device, why)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels read query rows with arbitrary token/head strides but a unit last-dim stride."""
    return t if t.stride(-1) == 1 else t.contiguous()
