"""Where a checkpoint's tensors come from, one at a time: the WeightSource protocol, an in-memory state dict, and
safetensors files read through safe_open (reopened every MAX_MAPPED_BYTES so mapped pages leave the resident
set); also finding a folder's safetensors files. engine.model.loader fills a model from any WeightSource."""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Iterator, Mapping

import torch

from engine.model.errors import CheckpointError

logger = logging.getLogger("ddtree.engine")

MAX_MAPPED_BYTES = 256 << 20  # safetensors reads reopen their file after this many bytes (see SafetensorsWeights)

# safetensors dtype names -> bytes per element (for the progress bar's total before anything is read)
_ST_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class WeightSource:
    """Checkpoint tensors by HF name: their shapes up front (from file headers, nothing read), then the tensors
    themselves one at a time. `read` yields host tensors in any float dtype; the loader casts them."""

    where: str  # the path checkpoint errors name
    desc = "loading weights"  # progress bar label

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def nbytes(self, key: str) -> int:  # bytes read for `key` (for the progress bar and throughput)
        raise NotImplementedError

    def read(self, keys: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def log_done(self, count: int, nbytes: int, seconds: float, dtype: torch.dtype) -> None:
        logger.info("read %d tensors, %.2f GiB, from %s in %.2f s (%.2f GB/s)", count, nbytes / 2**30, self.where,
                    seconds, nbytes / 1e9 / max(seconds, 1e-9))


class DictWeights(WeightSource):
    """An in-memory state dict (tests; the old build_model(cfg, state, ...) interface)."""

    def __init__(self, state: Mapping[str, torch.Tensor], where: str):
        self.state, self.where = state, where

    def shapes(self):
        return {k: tuple(t.shape) for k, t in self.state.items()}

    def nbytes(self, key):
        t = self.state[key]
        return t.numel() * t.element_size()

    def read(self, keys):
        for k, t in self.state.items():
            if k in keys:
                yield k, t

    def log_done(self, count, nbytes, seconds, dtype):
        logger.debug("copied %d tensors, %.2f GiB, in %.2f s", count, nbytes / 2**30, seconds)


class SafetensorsWeights(WeightSource):
    """One or more .safetensors files, read through safe_open: headers once to learn names and shapes, then
    file by file, tensor by tensor in file order. safe_open maps the file and get_tensor returns a view of that
    mapping; the loader copies it into its parameter, and the handle is closed and reopened every
    MAX_MAPPED_BYTES so that the file pages touched so far leave the process's resident set as well (they are
    clean page cache, but they would otherwise count in RSS up to the shard size)."""

    def __init__(self, files: list[str], where: str):
        from safetensors import safe_open

        self.files, self.where = files, where
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._bytes: dict[str, int] = {}
        self._file_of: dict[str, str] = {}
        self._by_file: dict[str, list[str]] = {}  # in the order of their data in the file
        for path in files:
            try:
                with safe_open(path, framework="pt") as f:
                    names = list(f.offset_keys() if hasattr(f, "offset_keys") else f.keys())
                    for name in names:
                        s = f.get_slice(name)
                        shape = tuple(int(d) for d in s.get_shape())
                        if name in self._file_of:
                            raise CheckpointError(path, f"tensor {name!r} is also stored in {self._file_of[name]}")
                        self._shapes[name], self._file_of[name] = shape, path
                        self._bytes[name] = math.prod(shape) * _ST_ITEMSIZE.get(s.get_dtype(), 4)
                    self._by_file[path] = names
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
                raise self._corrupt(path, e) from None

    @staticmethod
    def _corrupt(path: str, e: Exception) -> CheckpointError:
        return CheckpointError(path, f"corrupt or truncated safetensors file ({type(e).__name__}: {e})")

    def shapes(self):
        return dict(self._shapes)

    def nbytes(self, key):
        return self._bytes[key]

    def read(self, keys):
        from safetensors import safe_open

        for path in self.files:
            names = [k for k in self._by_file[path] if k in keys]
            handle, mapped = None, 0
            try:
                for name in names:
                    if handle is None or mapped >= MAX_MAPPED_BYTES:
                        if handle is not None:
                            handle.__exit__(None, None, None)
                        handle, mapped = safe_open(path, framework="pt"), 0
                        handle.__enter__()
                    tensor = handle.get_tensor(name)
                    mapped += self._bytes[name]
                    yield name, tensor
                    del tensor
            except Exception as e:
                raise self._corrupt(path, e) from None
            finally:
                if handle is not None:
                    handle.__exit__(None, None, None)


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(index, f"unreadable shard index ({e})") from None
        files = [os.path.join(folder, n) for n in names]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        pickled = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        why = f"only pickle weights ({pickled[0]}), which are never loaded" if pickled else "no *.safetensors weights"
        raise CheckpointError(folder, why)
    return files


def read_safetensors(files: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of `files` in one host dict. Only for small checkpoints (the DFlash drafter); models stream
    through SafetensorsWeights instead."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
            raise CheckpointError(path, f"corrupt or truncated safetensors file ({type(e).__name__}: {e})") from None
    return state

