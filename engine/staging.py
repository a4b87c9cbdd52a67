"""Host-to-device staging of a step's small metadata (token ids, positions, slots, lengths, sampling
parameters): on CUDA each array is written into a pinned host buffer and copied with a non-blocking copy, so
the host never waits on the device to hand over a step's inputs.

Invariant: the buffers come in two generations that alternate at each `reset()` (called by the runner at the
start of each step, never inside one), so a region is reused two steps later. With asynchronous scheduling the
runner launches step k+1 before step k's results have come back, but step k-1's have (its device-to-host copy
synchronized after every earlier host-to-device copy), so the generation step k+1 rewrites is free.
"""
from __future__ import annotations

import numpy as np
import torch

# a host list converts through numpy: ~3x faster than torch.tensor() on a few thousand ints (a batch-64 step's
# block tables), which at batch 64 sat on the host's critical path
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
          torch.bool: np.bool_}


class Staging:
    def __init__(self, device, capacity: int = 1 << 16):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        # per generation: dtype -> (pinned buffer, a numpy view of it). Values are written through the numpy view:
        # each torch call costs the host a few us (on an H100's host staging took ~150 us of a ~1.1 ms batch-1 tree
        # round), a numpy slice assignment under one
        self._generations: list[dict[torch.dtype, tuple[torch.Tensor, np.ndarray | None]]] = [{}, {}]
        self._buffers = self._generations[0]
        self._offsets: dict[torch.dtype, int] = {}
        self._capacity = capacity

    def reset(self) -> None:
        """A new step: switch to the other generation of buffers and fill it from the start."""
        self._buffers = self._generations[1] if self._buffers is self._generations[0] else self._generations[0]
        self._offsets = {}

    def __call__(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A device tensor holding `values` (a list, or a host tensor)."""
        if isinstance(values, torch.Tensor) or dtype not in _NUMPY:
            host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
            if not self.pinned:
                return host
            region, view = self._region(host.numel(), dtype)
            if view is not None and host.device.type == "cpu":
                view[:] = host.reshape(-1).numpy()
            else:
                region.copy_(host.reshape(-1))
            return region.view(host.shape).to(self.device, non_blocking=True)
        array = np.asarray(values, dtype=_NUMPY[dtype])
        if not self.pinned:
            return torch.from_numpy(array)
        region, view = self._region(array.size, dtype)
        view[:] = array.reshape(-1)
        region = region if array.ndim == 1 else region.view(array.shape)
        return region.to(self.device, non_blocking=True)

    def into(self, dest: torch.Tensor, values) -> None:
        """Copies `values` (a list or an array of dest's size) into the contiguous device tensor `dest`: on CUDA
        one non-blocking copy from a pinned region straight into it (no device tensor in between, no
        device-to-device copy)."""
        if not dest.is_contiguous():
            raise ValueError("Staging.into writes contiguous destinations only")
        flat = np.asarray(values, dtype=_NUMPY[dest.dtype]).reshape(-1)
        if not self.pinned:
            dest.copy_(torch.from_numpy(flat).view(dest.shape))
            return
        region, view = self._region(dest.numel(), dest.dtype)
        view[:] = flat
        dest.copy_(region if dest.dim() == 1 else region.view(dest.shape), non_blocking=True)

    def _region(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray | None]:
        """n elements of this generation's pinned buffer of `dtype`, not handed out before in this step: the tensor
        region and a numpy view of it (None for a dtype numpy lacks)."""
        buffer, offset = self._buffers.get(dtype), self._offsets.get(dtype, 0)
        if buffer is None or offset + n > buffer[0].numel():
            # a fresh buffer (regions of the old one may still be in flight this step: it is not reused)
            size = max(self._capacity, 2 * (offset + n), buffer[0].numel() * 2 if buffer is not None else 0)
            pinned = torch.empty(size, dtype=dtype, pin_memory=True)
            buffer = self._buffers[dtype] = (pinned, pinned.numpy() if dtype in _NUMPY else None)
            offset = 0
        self._offsets[dtype] = offset + n
        return buffer[0][offset:offset + n], None if buffer[1] is None else buffer[1][offset:offset + n]

    def pack(self, arrays: list[list], dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
        """Device tensors holding each flat list of `arrays`, staged in one host-to-device copy (each a view of
        it)."""
        flat = [v for a in arrays for v in a]
        device = self(flat, dtype)
        out, pos = [], 0
        for a in arrays:
            out.append(device[pos:pos + len(a)])
            pos += len(a)
        return out
