"""Exports the engine's loaded tokenizer (save_pretrained) into a cache folder that the HTTP process reads with
`tokenizers` and `jinja2` alone (server/tokenizer.py), so the server tokenizes exactly as the engine does without
importing transformers or torch. For a GGUF checkpoint this is the only source of tokenizer files.

A folder is keyed by the checkpoint's path, the size and mtime of its tokenizer-related files and the library
versions; it is written in a temporary sibling and renamed into place, so a folder under its final name is
complete."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from engine.config import cache_dir

# Weights are not the tokenizer's: leaving them out of the key spares a stat per shard and keeps the key stable.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
MARKER = "export.json"  # written last, inside the temporary folder


def _cache_key(path: str) -> str:
    import tokenizers
    import transformers

    path = os.path.abspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if not n.endswith(_WEIGHT_SUFFIXES))
    else:
        files = [path]
    stats = [(f, s.st_size, s.st_mtime_ns) for f in files if os.path.isfile(f) for s in [os.stat(f)]]
    blob = json.dumps([path, stats, transformers.__version__, tokenizers.__version__])
    name = os.path.basename(os.path.normpath(path)).removesuffix(".gguf")[:48] or "model"
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def export_tokenizer(tokenizer, model_path: str | None, cache_root: str | None = None) -> str | None:
    """The folder holding `tokenizer`'s files (tokenizer.json, tokenizer_config.json, chat_template.jinja),
    exporting it on first use; None when there is no tokenizer."""
    if tokenizer is None or model_path is None:
        return None
    root = os.path.join(cache_root or cache_dir(), "tokenizers")
    final = os.path.join(root, _cache_key(model_path))
    if os.path.isfile(os.path.join(final, MARKER)):
        return final
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    except OSError as e:
        raise OSError(f"cannot write the tokenizer cache {root} ({e.strerror or e}); set DDTREE_CACHE to a "
                      f"writable folder") from None
    try:
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"model": os.path.abspath(model_path)}, f)
        if os.path.isdir(final):  # incomplete (no marker): replace it
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, MARKER)):  # another engine won the race with a full folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
