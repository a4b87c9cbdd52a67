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

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn
from tqdm import tqdm

from engine.model.errors import CheckpointError, ConfigError, read_json_object as _read_json_object
from engine.model.quantization import dequantizing
from engine.model.generation_config import default_sampling, read_generation_config  # noqa: F401 (re-exported)
from engine.model.layers import route_linears
from engine.model.weights import (DictWeights, SafetensorsWeights, WeightSource,  # noqa: F401 (re-exported)
                                  read_safetensors, safetensors_files)

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
DUMMY_SEED = 0
DUMMY_STD = 0.02




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


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(path, "config.json not found (expected an HF checkpoint folder or a .gguf file)")
    return _read_json_object(path)




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
        shape, want = filled[hf][1], _full_shape(model, name, tuple(params[name].shape))
        if shape != want:
            raise CheckpointError(where, f"tensor {hf!r} has shape {shape}, expected {want}")
    for key, parts in plan.items():  # tensor parallel: each parameter takes its shard of what it is given
        plan[key] = [(name, _sharded(take, model.shard_specs.get(name))) for name, take in parts]
    return plan


def _full_shape(model, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    spec = model.shard_specs.get(name)
    return shape if spec is None else spec.full_shape(shape)


def _sharded(take: Take, spec) -> Take:
    if spec is None:
        return take
    return spec.take if take is None else (lambda t: spec.take(take(t)))


def fill_weights(model, source: WeightSource, where: str, dtype: torch.dtype, device) -> None:
    """Reads `source` tensor by tensor into `model`'s meta parameters on `device`: each checkpoint tensor is
    read, cast and copied into a freshly allocated parameter, then dropped, so at most about one checkpoint
    tensor is held in host memory at a time. fp32_param_suffixes stay float32, and parameters marked `keep_dtype`
    (FP8 weights and their scales, engine/model/fp8_linear.py) keep their own dtype. A source with a
    `prepare_model(model)` may first swap modules on the meta device (the FP8 linears)."""
    if hasattr(source, "prepare_model"):
        source.prepare_model(model)
    plan = _plan(model, source, where)
    fp32_names = getattr(model, "fp32_param_suffixes", ())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    kept = {n: p.dtype for n, p in model.named_parameters() if getattr(p, "keep_dtype", False)}
    total = sum(source.nbytes(k) for k in plan)
    start, count, done = time.perf_counter(), 0, 0
    with torch.no_grad(), tqdm(total=total, desc=source.desc, unit="B", unit_scale=True, unit_divisor=1024,
                               disable=None, leave=False) as bar:
        for key, tensor in source.read(set(plan)):
            for name, take in plan.pop(key):
                src = tensor if take is None else take(tensor)
                keep_fp32 = any(name.endswith(s) for s in fp32_names)
                dst_dtype = kept.get(name, torch.float32 if keep_fp32 else dtype)
                dst = torch.empty(shapes[name], dtype=dst_dtype, device=device)
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
            spec = model.shard_specs.get(name)
            shape = tuple(p.shape) if spec is None else spec.full_shape(tuple(p.shape))
            value = torch.empty(shape, dtype=torch.float32 if keep_fp32 else dtype, device=device)
            if name.endswith("bias"):
                value.zero_()
            elif _is_norm_weight(model, name):
                value.fill_(1.0)
            else:
                value.normal_(0.0, DUMMY_STD, generator=generator)
            if spec is not None:  # every rank draws the whole tensor, so shards agree with an unsharded model
                value = spec.take(value).contiguous()
            total += value.numel() * value.element_size()
            _set_param(model, name, value)
    logger.info("initialised %d tensors (%.2f GiB) with dummy weights (seed %d) in %.2f s", len(params),
                total / 2**30, seed, time.perf_counter() - start)


def build_model(cfg: dict, weights: Mapping[str, torch.Tensor] | WeightSource | None, where: str,
                dtype: torch.dtype, device, seed: int = DUMMY_SEED, tp=None):
    """Builds the family's module tree on the meta device, then fills every parameter on `device`: from
    `weights` (a WeightSource streamed tensor by tensor, or an in-memory state dict), or with dummy weights
    when `weights` is None. With `tp` (engine.distributed.TPGroup) the tree is cut to this rank's shard first
    (engine/model/tensor_parallel.py) and only that shard is read."""
    cls = model_class(cfg, where)
    with torch.device("meta"):
        model = cls(cfg)
    if tp is not None and tp.world_size > 1:
        from engine.model.tensor_parallel import shard_model

        shard_model(model, tp)
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
    route_linears(model)
    return model.eval()


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def load_model(path: str | None, dtype: str | torch.dtype | None = None, device: str = "cpu",
               load_format: str = "auto", tp=None) -> LoadedModel:
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
        model = build_model(cfg, None if dummy else weights, path, torch_dtype, device, tp=tp)
        tokenizer = load_gguf_tokenizer(path) if weights.has_tokenizer else None
        loaded = LoadedModel(model, tokenizer, cfg, path, {})
    else:
        cfg = read_config(path)
        model_class(cfg, os.path.join(path, "config.json"))  # fail on the architecture before reading weights
        generation_config = read_generation_config(path)
        try:
            weights = None if dummy else SafetensorsWeights(safetensors_files(path), path)
            weights = dequantizing(cfg, weights, torch_dtype, device)
            model = build_model(cfg, weights, path, torch_dtype, device, tp=tp)
        except ConfigError as e:
            raise ConfigError(f"{os.path.join(path, 'config.json')}: {e}") from None
        loaded = LoadedModel(model, load_tokenizer(path), cfg, path, generation_config)
    params = sum(p.numel() for p in loaded.model.parameters())
    logger.info("loaded %s (%s, %s params, %s, %s) in %.1f s", path, type(loaded.model).__name__, _count(params),
                str(torch_dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return loaded
