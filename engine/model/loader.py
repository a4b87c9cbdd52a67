"""Loads a model from a local HF checkpoint folder (config.json + single or sharded *.safetensors + tokenizer
+ optional generation_config.json) or a GGUF file, into one of our model families. safetensors and GGUF only: no
pickle, no remote code. Every failure is a CheckpointError / ConfigError whose one line names the file, tensor
or field.

Weights are streamed: the module tree is built on the meta device, every checkpoint tensor's name and shape is
checked from the file headers before any data is read, then the tensors are read one at a time (safetensors'
safe_open, or one GGUF tensor dequantized), cast and copied into freshly allocated parameters on the target
device, and dropped. Host memory therefore stays near one tensor, not the whole checkpoint. A family that stores
tensors differently from its parameters (packed MoE experts) maps one checkpoint tensor to its parameters with
`remap_checkpoint_tensor(key, shape)`, never over the whole state dict.

load_format="dummy" builds the model from config.json alone with deterministic random weights (benchmarks).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from tqdm import tqdm

from engine.model.errors import CheckpointError, ConfigError

logger = logging.getLogger("ddtree.engine")

# architecture name (config "architectures"[0]) or model_type -> (module, class)
FAMILIES = {
    "LlamaForCausalLM": ("engine.model.llama", "LlamaForCausalLM"),
    "llama": ("engine.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("engine.model.qwen3", "Qwen3ForCausalLM"),
    "qwen3": ("engine.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.model.qwen3", "Qwen3MoeForCausalLM"),
    "qwen3_moe": ("engine.model.qwen3", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("engine.model.deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v3": ("engine.model.deepseek_v3", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("engine.model.deepseek_v3", "DeepseekV3ForCausalLM"),
}

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
MAX_MAPPED_BYTES = 256 << 20  # safetensors reads reopen their file after this many bytes (see SafetensorsWeights)
DUMMY_SEED = 0
DUMMY_STD = 0.02

# safetensors dtype names -> bytes per element (for the progress bar's total before anything is read)
_ST_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

# generation_config.json keys that become sampling defaults (as vLLM reads them) -> SamplingParams field
GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class LoadedModel:
    model: Any  # engine.model.base.CausalLM
    tokenizer: Any  # transformers tokenizer, or None when the checkpoint has none
    hf_config: dict
    path: str
    generation_config: dict = field(default_factory=dict)  # generation_config.json as JSON, {} when absent


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (choose fp32, bf16 or fp16)")
    return DTYPES[dtype]


def model_class(cfg: dict, where: str):
    archs = cfg.get("architectures") or []
    key = next((a for a in archs if a in FAMILIES), None) or cfg.get("model_type")
    if key not in FAMILIES:
        raise ConfigError(f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported "
                          f"(supported: Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/Kimi-K2)")
    module, name = FAMILIES[key]
    return getattr(__import__(module, fromlist=[name]), name)


def _read_json_object(path: str) -> dict:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(path, "expected a JSON object")
    return obj


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(path, "config.json not found (expected an HF checkpoint folder or a .gguf file)")
    return _read_json_object(path)


# ---- generation_config.json --------------------------------------------------------------------------------

def read_generation_config(folder: str) -> dict:
    """The folder's generation_config.json as JSON ({} when absent), its eos_token_id and sampling defaults
    checked so that a bad value fails at load with the file and field named, not on every request."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    gen = _read_json_object(path)
    eos = gen.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(e) for e in eos))):
        raise CheckpointError(path, f"field 'eos_token_id'={eos!r} must be an integer or a list of integers")
    try:
        default_sampling(gen)
    except ConfigError as e:
        raise CheckpointError(path, str(e)) from None
    return gen


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_sampling(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling defaults a generation_config.json sets, as vLLM reads them: temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens, only those present (and not null), under our SamplingParams names
    (max_new_tokens -> max_tokens). A request's own values override them. Raises ConfigError for a value that
    SamplingParams would refuse."""
    out: dict[str, Any] = {}
    for key, name in GENERATION_SAMPLING_KEYS.items():
        value = (generation_config or {}).get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"generation_config field {key!r}={value!r} is not a number")
        if name in ("top_k", "max_tokens"):
            if value != int(value):
                raise ConfigError(f"generation_config field {key!r}={value!r} is not an integer")
            value = int(value)
        else:
            value = float(value)
        ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "top_k": value >= -1, "min_p": 0 <= value <= 1,
              "repetition_penalty": value > 0, "max_tokens": value >= 1}[name]
        if not ok:
            raise ConfigError(f"generation_config field {key!r}={value!r} is out of range")
        out[name] = value
    return out


# ---- where weights come from ---------------------------------------------------------------------------------

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


def load_tokenizer(folder: str):
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")) and not os.path.isfile(
        os.path.join(folder, "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(os.path.join(folder, "tokenizer.json"), f"tokenizer failed to load ({e})") from None


# ---- filling the module tree ---------------------------------------------------------------------------------

Take = Callable[[torch.Tensor], torch.Tensor] | None  # checkpoint tensor -> the part one parameter gets


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, nn.Parameter(value, requires_grad=False))


def _plan(model, source: WeightSource, where: str) -> dict[str, list[tuple[str, Take]]]:
    """Checks names and shapes from the headers alone; returns checkpoint key -> [(parameter name, take)]."""
    params = dict(model.named_parameters())
    expected = {model.hf_name(n): n for n in params}
    ignorable = getattr(model, "ignorable_checkpoint_key", lambda k: False)
    remap = getattr(model, "remap_checkpoint_tensor", lambda key, shape: None)
    plan: dict[str, list[tuple[str, Take]]] = {}
    filled: dict[str, tuple[str, tuple[int, ...]]] = {}  # hf name -> (checkpoint key, shape)
    for key, shape in source.shapes().items():
        if key.endswith("rotary_emb.inv_freq") or ignorable(key):
            continue
        if key == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: a stored copy of the head is redundant
        parts = remap(key, shape)
        for hf, part_shape, take in [(key, shape, None)] if parts is None else parts:
            if hf not in expected:
                raise CheckpointError(where, f"unexpected tensor {hf!r} for {type(model).__name__}")
            if hf in filled:
                raise CheckpointError(where, f"tensor {hf!r} is stored twice ({filled[hf][0]!r} and {key!r})")
            filled[hf] = (key, tuple(part_shape))
            plan.setdefault(key, []).append((expected[hf], take))
    for hf, name in expected.items():
        if hf not in filled:
            raise CheckpointError(where, f"tensor {hf!r} is missing")
        shape, want = filled[hf][1], tuple(params[name].shape)
        if shape != want:
            raise CheckpointError(where, f"tensor {hf!r} has shape {shape}, expected {want}")
    return plan


def fill_weights(model, source: WeightSource, where: str, dtype: torch.dtype, device) -> None:
    """Reads `source` tensor by tensor into `model`'s meta parameters on `device`: each checkpoint tensor is
    read, cast and copied into a freshly allocated parameter, then dropped, so at most about one checkpoint
    tensor is held in host memory at a time. fp32_param_suffixes stay float32."""
    plan = _plan(model, source, where)
    fp32_names = getattr(model, "fp32_param_suffixes", ())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    total = sum(source.nbytes(k) for k in plan)
    start, count, done = time.perf_counter(), 0, 0
    with torch.no_grad(), tqdm(total=total, desc=source.desc, unit="B", unit_scale=True, unit_divisor=1024,
                               disable=None, leave=False) as bar:
        for key, tensor in source.read(set(plan)):
            for name, take in plan.pop(key):
                src = tensor if take is None else take(tensor)
                keep_fp32 = any(name.endswith(s) for s in fp32_names)
                dst = torch.empty(shapes[name], dtype=torch.float32 if keep_fp32 else dtype, device=device)
                dst.copy_(src)
                _set_param(model, name, dst)
                del src
            count, done = count + 1, done + source.nbytes(key)
            bar.update(source.nbytes(key))
            del tensor
    if plan:  # a source that skipped a tensor it listed
        raise CheckpointError(where, f"tensor {next(iter(plan))!r} could not be read")
    source.log_done(count, done, time.perf_counter() - start, dtype)


def _is_norm_weight(model: nn.Module, name: str) -> bool:
    from engine.model.layers import RMSNorm

    owner = name.rpartition(".")[0]
    return isinstance(model.get_submodule(owner) if owner else model, RMSNorm) or "norm" in owner.rpartition(".")[2]


def fill_dummy_weights(model, dtype: torch.dtype, device, seed: int = DUMMY_SEED) -> None:
    """Deterministic random weights in the checkpoint's shapes: normal(0, 0.02) for matrices, ones for norm
    weights, zeros for biases; one generator on `device` seeded with `seed`, drawn in parameter order (the same
    seed and device give the same weights). fp32_param_suffixes stay float32."""
    fp32_names = getattr(model, "fp32_param_suffixes", ())
    generator = torch.Generator(device=device).manual_seed(seed)
    params = list(model.named_parameters())
    start, total = time.perf_counter(), 0
    with torch.no_grad():
        for name, p in tqdm(params, desc="dummy weights", unit="tensor", disable=None, leave=False):
            keep_fp32 = any(name.endswith(s) for s in fp32_names)
            value = torch.empty(p.shape, dtype=torch.float32 if keep_fp32 else dtype, device=device)
            if name.endswith("bias"):
                value.zero_()
            elif _is_norm_weight(model, name):
                value.fill_(1.0)
            else:
                value.normal_(0.0, DUMMY_STD, generator=generator)
            total += value.numel() * value.element_size()
            _set_param(model, name, value)
    logger.info("initialised %d tensors (%.2f GiB) with dummy weights (seed %d) in %.2f s", len(params),
                total / 2**30, seed, time.perf_counter() - start)


def build_model(cfg: dict, weights: Mapping[str, torch.Tensor] | WeightSource | None, where: str,
                dtype: torch.dtype, device, seed: int = DUMMY_SEED):
    """Builds the family's module tree on the meta device, then fills every parameter on `device`: from
    `weights` (a WeightSource streamed tensor by tensor, or an in-memory state dict), or with dummy weights
    when `weights` is None."""
    cls = model_class(cfg, where)
    with torch.device("meta"):
        model = cls(cfg)
    if weights is None:
        fill_dummy_weights(model, dtype, device, seed)
    else:
        source = weights if isinstance(weights, WeightSource) else DictWeights(weights, where)
        fill_weights(model, source, where, dtype, device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a buffer without init_buffers, or a parameter the plan did not cover: a bug, not a bad file
        raise RuntimeError(f"{cls.__name__}: {left[0]} was not materialised after loading")
    for module in list(model.modules()):
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()
    return model.eval()


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def load_model(path: str | None, dtype: str | torch.dtype | None = None, device: str = "cpu",
               load_format: str = "auto") -> LoadedModel:
    """path: an HF checkpoint folder, a .gguf file, or None for the embedded SmolLM2-135M-Instruct.
    load_format: "auto" reads the weights; "dummy" builds the model from its config alone with deterministic
    random weights (no weight files needed)."""
    start = time.perf_counter()
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format {load_format!r} is not supported (choose auto or dummy)")
    dummy = load_format == "dummy"
    torch_dtype = resolve_dtype(dtype, device)
    if path is None:
        from engine.model.embedded import embedded_model_dir

        path = embedded_model_dir()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise CheckpointError(path, "no such file or directory")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(path, "expected an HF checkpoint folder or a .gguf file")
        from engine.model.gguf import load_gguf_tokenizer, open_gguf

        cfg, weights = open_gguf(path)
        model = build_model(cfg, None if dummy else weights, path, torch_dtype, device)
        tokenizer = load_gguf_tokenizer(path) if weights.has_tokenizer else None
        loaded = LoadedModel(model, tokenizer, cfg, path, {})
    else:
        cfg = read_config(path)
        model_class(cfg, os.path.join(path, "config.json"))  # fail on the architecture before reading weights
        generation_config = read_generation_config(path)
        try:
            weights = None if dummy else SafetensorsWeights(safetensors_files(path), path)
            model = build_model(cfg, weights, path, torch_dtype, device)
        except ConfigError as e:
            raise ConfigError(f"{os.path.join(path, 'config.json')}: {e}") from None
        loaded = LoadedModel(model, load_tokenizer(path), cfg, path, generation_config)
    params = sum(p.numel() for p in loaded.model.parameters())
    logger.info("loaded %s (%s, %s params, %s, %s) in %.1f s", path, type(loaded.model).__name__, _count(params),
                str(torch_dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return loaded
