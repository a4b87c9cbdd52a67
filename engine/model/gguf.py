"""GGUF checkpoints -> an HF-style Llama config dict and the tensors under HF parameter names, dequantized to
float32 one at a time (open_gguf, which the loader streams from), or all at once (load_gguf).

This module owns reading GGUF files (through the `gguf` package's reader and dequantizer) and undoing
what llama.cpp's converter did to a Hugging Face checkpoint: the renamed tensors, the reversed dimension
order, and the row permutation of q/k projections for llama.cpp's rope layout. Only the `llama`
architecture is supported. Every failure is a one-line `CheckpointError` naming the file.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re

import numpy as np
import torch

from engine.model.errors import CheckpointError
from engine.model.loader import WeightSource

logger = logging.getLogger("ddtree.engine")

GGUF_MAGIC = b"GGUF"
GGUF_ARRAY = 9  # gguf.GGUFValueType.ARRAY; a plain int so importing this module does not need gguf

# Per-layer GGUF tensor names -> HF names (without the "model.layers.{i}." prefix).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def load_gguf(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a llama GGUF file whole: (config dict as a Llama config.json holds it, float32 state dict).
    The loader streams through open_gguf instead; this is for tests and tools that want the full dict."""
    config, weights = open_gguf(path)
    return config, dict(weights.read(set(weights.shapes())))


def open_gguf(path: str) -> tuple[dict, "GGUFWeights"]:
    """Read a llama GGUF file's metadata and tensor directory, nothing dequantized: (config dict, GGUFWeights
    that dequantizes one tensor at a time). Tensor names and shapes are checked here."""
    reader = _open_reader(path)
    # Arrays (the vocabulary, merges) are the tokenizer's business and slow to decode: skip them.
    fields = {name: _field_value(f) for name, f in reader.fields.items() if f.types[:1] != [GGUF_ARRAY]}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(path, f"GGUF architecture {arch!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    config = _llama_config(path, fields, tensors)
    return config, GGUFWeights(path, reader, tensors, config)


class GGUFWeights(WeightSource):
    """A GGUF file's tensors under their HF names: shapes from the tensor directory, then each tensor
    dequantized to float32 and its q/k rows put back in HF order as it is read (one tensor in memory at a time;
    the loader casts it to the model's dtype)."""

    desc = "dequantizing GGUF"

    def __init__(self, path: str, reader, tensors: dict, config: dict):
        self.where, self.reader, self.config = path, reader, config
        self.has_tokenizer = "tokenizer.ggml.tokens" in reader.fields  # files written without a vocabulary have none
        expected = _expected_shapes(config)
        self._tensors: dict[str, object] = {}  # hf name -> GGUF tensor, in file order
        for name, tensor in tensors.items():
            if name == "rope_freqs.weight":  # consumed by the config (llama3 rope scaling)
                continue
            hf_name = _hf_name(path, name)
            shape = _shape(tensor)
            if hf_name not in expected:
                raise CheckpointError(path, f"unexpected tensor {name} for this llama config")
            if shape != expected[hf_name]:
                raise CheckpointError(path, f"tensor {name} has shape {list(shape)}, expected {list(expected[hf_name])}")
            self._tensors[hf_name] = tensor
        missing = [k for k in expected if k not in self._tensors]
        if missing:
            raise CheckpointError(path, f"{len(missing)} tensors missing, first {missing[0]}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: _shape(t) for k, t in self._tensors.items()}

    def nbytes(self, key: str) -> int:
        return int(self._tensors[key].n_bytes)

    def read(self, keys):
        for hf_name, tensor in self._tensors.items():
            if hf_name not in keys:
                continue
            weight = _dequantize(self.where, tensor)
            if ".q_proj." in hf_name:
                weight = _unpermute_rope_rows(weight, self.config["num_attention_heads"])
            elif ".k_proj." in hf_name:
                weight = _unpermute_rope_rows(weight, self.config["num_key_value_heads"])
            yield hf_name, weight
            del weight
            self._drop_pages(tensor)

    def _drop_pages(self, tensor) -> None:
        """Unmaps the tensor's file pages from this process once it is read (they stay in the page cache), so
        that the resident set does not grow to the file size over the load. Best effort."""
        mm = getattr(getattr(self.reader.data, "base", None), "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, int(tensor.data_offset) + int(tensor.n_bytes) - start)
        except (OSError, ValueError):
            pass

    def log_done(self, count: int, nbytes: int, seconds: float, dtype: torch.dtype) -> None:
        logger.info("dequantized %d GGUF tensors (%.2f GiB in the file) from %s to %s in %.2f s", count,
                    nbytes / 2**30, self.where, str(dtype).removeprefix("torch."), seconds)


def load_gguf_tokenizer(path: str):
    """The GGUF file's tokenizer as a `PreTrainedTokenizerFast`, chat template included."""
    from transformers import PreTrainedTokenizerFast

    _check_header(path)  # the full reader takes seconds; transformers runs its own
    path = os.path.abspath(path)
    try:
        # The concrete class, not AutoTokenizer: that one parses the whole GGUF once more to pick a class.
        tok = PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
    except Exception as exc:  # transformers' GGUF readers raise struct.error, ValueError, KeyError, ...
        problem = f"truncated or corrupt GGUF tokenizer metadata ({type(exc).__name__}: {exc})"
        raise CheckpointError(path, problem) from exc
    # transformers 5.17's converter for llama GGUFs names the bos token as eos too (SmolLM2: <|im_start|>, not
    # <|im_end|>). The file's ids are the truth; init_kwargs holds the tokenizer.ggml.*_token_id values it read.
    for role in ("bos", "eos", "pad", "unk"):
        token_id = tok.init_kwargs.get(f"{role}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tok):
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(token_id))
    # Decoding must not touch spaces before punctuation (transformers ignores the flag for BPE, with a warning).
    tok.clean_up_tokenization_spaces = False
    return tok


def _check_header(path: str) -> int:
    """Cheap checks before any parsing: the file exists and starts with the GGUF magic. Returns its size."""
    if not os.path.isfile(path):
        raise CheckpointError(path, "no such file" if not os.path.exists(path) else "not a regular file")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror or exc})") from exc
    if size == 0:
        raise CheckpointError(path, "empty file (expected a GGUF checkpoint)")
    if magic != GGUF_MAGIC:
        raise CheckpointError(path, f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return size


def _open_reader(path: str):
    try:
        import gguf
    except ImportError as exc:
        raise CheckpointError(path, "reading GGUF needs the 'gguf' package: pip install gguf") from exc
    size = _check_header(path)

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memmap.

        The reader slices its buffer a few times per vocabulary entry; np.memmap's Python-level slicing
        hooks made that 5x slower (5.7 s against 1.1 s for SmolLM2's 49k tokens + 49k merges).
        """

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray)  # same mapping, the memmap stays alive as its base

    try:
        reader = PlainArrayReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, OverflowError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"truncated or corrupt GGUF file ({size} bytes): {exc}") from exc
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise CheckpointError(path, f"truncated: tensor {t.name} ends at byte {end}, file has {size}")
    return reader


def _field_value(field):
    """A metadata value as a Python scalar, str or list (the reader keeps raw numpy parts)."""
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def _require(path: str, fields: dict, key: str):
    if fields.get(key) is None:
        raise CheckpointError(path, f"GGUF metadata key {key!r} is missing")
    return fields[key]


def _llama_config(path: str, fields: dict, tensors: dict) -> dict:
    get = lambda key, default=None: fields.get(f"llama.{key}", default)  # noqa: E731
    hidden = int(_require(path, fields, "llama.embedding_length"))
    num_heads = int(_require(path, fields, "llama.attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(path, "different key and value head sizes are not supported for llama")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(path, f"partial rotary (rope dims {rope_dim} of head_dim {head_dim}) is not supported")
    if "token_embd.weight" not in tensors:
        raise CheckpointError(path, "tensor token_embd.weight is missing")
    if any(name.endswith("_exps.weight") for name in tensors):
        raise CheckpointError(path, "mixture-of-experts llama GGUF files are not supported")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF dims are [hidden, vocab]
    rope_theta = _shortest_f32(get("rope.freq_base", 10000.0))

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(path, fields, "llama.feed_forward_length")),
        "num_hidden_layers": int(_require(path, fields, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(re.fullmatch(r"blk\.\d+\.attn_[a-z]+\.bias", name) for name in tensors),
        "mlp_bias": False,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = fields.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)

    scaling = _rope_scaling(path, fields, tensors, rope_theta, head_dim)
    if scaling is not None:
        config["rope_parameters"] = {**scaling, "rope_theta": rope_theta}
        config["rope_scaling"] = dict(scaling)  # what transformers 4.x reads
    return config


def _shortest_f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds back to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(path: str, fields: dict, tensors: dict, theta: float, head_dim: int) -> dict | None:
    kind = fields.get("llama.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_require(path, fields, "llama.rope.scaling.factor"))}
    if kind not in (None, "none"):
        raise CheckpointError(path, f"rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" not in tensors:
        return None
    factors = _dequantize(path, tensors["rope_freqs.weight"]).double()  # [head_dim // 2]
    original = fields.get("llama.rope.scaling.original_context_length")
    return _fit_llama3_rope(path, factors, theta, head_dim, int(original or 8192))


def _fit_llama3_rope(path: str, factors: torch.Tensor, theta: float, head_dim: int, original: int) -> dict | None:
    """Recover llama3 rope parameters from llama.cpp's per-frequency divisors (rope_freqs.weight).

    llama.cpp stores only f_i, where the scaled inverse frequency is inv_freq_i / f_i: f_i = 1 for short
    wavelengths, = factor for long ones, and 1/f_i = (1-s)/factor + s in between, with
    s = (original/wavelen_i - low) / (high - low). Scaling (original, low, high) together leaves every f_i
    unchanged, so `original` is taken from the metadata (8192, Llama 3.x's value, when absent) and low/high
    are fitted; the result is accepted only if it reproduces every f_i.
    """
    if factors.numel() != head_dim // 2:
        raise CheckpointError(path, f"rope_freqs.weight has {factors.numel()} entries, expected {head_dim // 2}")
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    medium = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    candidates = [(1.0, 4.0)]  # Llama 3.x's values; fit below when the medium band pins them down
    if int(medium.sum()) >= 2:
        # original / wavelen = low + s * (high - low): a line in s
        s, y = smooth[medium], original / wavelen[medium]
        slope, low = np.polyfit(s.numpy(), y.numpy(), 1)
        candidates.insert(0, (round(float(low), 4), round(float(low + slope), 4)))
    for low, high in candidates:
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                  "high_freq_factor": high, "original_max_position_embeddings": original}
        if torch.allclose(_llama3_factors(inv_freq, params), factors, rtol=1e-5, atol=0):
            return params
    raise CheckpointError(path, "rope_freqs.weight does not match any llama3 rope scaling")


def _llama3_factors(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"]
    )
    medium = 1.0 / ((1 - smooth) / p["factor"] + smooth)
    short = wavelen < p["original_max_position_embeddings"] / p["high_freq_factor"]
    long = wavelen > p["original_max_position_embeddings"] / p["low_freq_factor"]
    return torch.where(short, torch.ones_like(medium), torch.where(long, torch.full_like(medium, p["factor"]), medium))


def _hf_name(path: str, name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise CheckpointError(path, f"unexpected tensor {name!r} for the llama architecture")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def _shape(tensor) -> tuple[int, ...]:
    """GGUF lists dims fastest-first, PyTorch slowest-first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantize(path: str, tensor) -> torch.Tensor:
    import gguf

    shape = _shape(tensor)
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if not array.flags.writeable:  # a view of the read-only memmap: copy so the file can be closed
            array = array.copy()
        return torch.from_numpy(array).reshape(shape)
    except NotImplementedError as exc:
        raise CheckpointError(path, f"tensor {tensor.name}: {exc}") from exc
    except (ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(path, f"corrupt data in tensor {tensor.name} ({exc})") from exc


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    HF's rotate_half pairs dim j of a head with dim j + head_dim/2; llama.cpp's rope pairs dims 2j and 2j+1.
    The converter therefore stores HF row (head, half, j) at row (head, j, half). Reading the rows as
    [num_heads, head_dim/2, 2] and swapping the last two axes restores the HF order.
    """
    rows = weight.shape[0]  # weight: [num_heads * head_dim, hidden], or [num_heads * head_dim] for a bias
    gguf_order = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return gguf_order.transpose(1, 2).reshape(weight.shape).contiguous()


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name the config implies, with its shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config["attention_bias"]:  # HF then expects a bias on all four projections
        per_layer.update({f"self_attn.{p}_proj.bias": (rows,) for p, rows in
                          (("q", q_rows), ("k", kv_rows), ("v", kv_rows), ("o", hidden))})
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes
