"""Tensor parallelism for the model families: which parameters each rank holds, and where partial results are
summed. Applied to the module tree on the meta device, before loading, so each rank reads and keeps only its
shard (the loader slices every checkpoint tensor by the parameter's `ShardSpec`).

The layout (Megatron-style, two all-reduces per decoder layer):
- attention: heads split across ranks. GQA: q, k, v by heads (num_heads and num_kv_heads must divide), o_proj by
  its input; MLA: q (q_proj or q_b_proj) and kv_b_proj by heads, o_proj by its input, while q_a / kv_a and the
  latent KV cache are replicated: the latent row is shared by every head, so it cannot be split by heads, and it is
  small (kv_lora_rank + rope dims per token and layer); each rank attends its own heads over the whole latent.
- MLP and every expert (routed and shared): gate/up split by the intermediate dimension, down_proj by its input
  (TP inside each expert). Routers are replicated, so every rank routes every token identically and no token
  moves between ranks; expert parallelism with all-to-all would cut the expert weights read per rank further at
  large batch, at the price of an exchange per layer and load imbalance, and is not implemented.
- The attention block's and the MLP block's outputs are partial sums on each rank: one all-reduce after each
  (a forward hook on the decoder layer's `self_attn` and `mlp`). Row-parallel biases live on rank 0 only
  (zeros elsewhere), so the sum adds them once.
- Embedding and lm_head: split by vocabulary rows; a rank embeds the ids in its range (zeros for the others, then
  an all-reduce), and the logits are all-gathered. vocab_size must divide.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.errors import ConfigError


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is cut from its checkpoint tensor: `split` along `dim` into world_size equal parts (this
    rank's part), or `rank0` (rank 0 keeps it whole, the others get zeros)."""
    kind: str
    dim: int
    rank: int
    world_size: int

    def full_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "rank0":
            return tuple(shape)
        return tuple(n * self.world_size if i == self.dim else n for i, n in enumerate(shape))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.kind == "rank0":
            return full if self.rank == 0 else torch.zeros_like(full)
        size = full.shape[self.dim] // self.world_size
        return full.narrow(self.dim, self.rank * size, size)


def _divides(world_size: int, n: int, what: str) -> None:
    if n % world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} does not divide {what}={n}")


def _shard_param(model, module: nn.Module, module_name: str, attr: str, kind: str, dim: int, tp) -> None:
    param = getattr(module, attr, None)
    if param is None:
        return
    spec = ShardSpec(kind, dim, tp.rank, tp.world_size)
    shape = list(param.shape)
    if kind == "split":
        shape[dim] //= tp.world_size
    setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=False))
    model.shard_specs[f"{module_name}.{attr}" if module_name else attr] = spec


def _column(model, linear: nn.Linear, name: str, tp) -> None:
    """Output features split: this rank computes its slice of the output."""
    _shard_param(model, linear, name, "weight", "split", 0, tp)
    _shard_param(model, linear, name, "bias", "split", 0, tp)
    linear.out_features //= tp.world_size


def _row(model, linear: nn.Linear, name: str, tp) -> None:
    """Input features split: this rank's output is a partial sum (reduced by the enclosing block's hook)."""
    _shard_param(model, linear, name, "weight", "split", 1, tp)
    _shard_param(model, linear, name, "bias", "rank0", 0, tp)
    linear.in_features //= tp.world_size


def shard_model(model, tp) -> None:
    """Cuts `model` (on the meta device) to rank tp.rank's shard and installs the reductions; fills
    model.shard_specs (parameter name -> ShardSpec) for the loader. A ConfigError names any size that
    tp.world_size does not divide."""
    from engine.model.attention import GQAttention
    from engine.model.deepseek_v3 import MLAttention
    from engine.model.layers import GatedMLP

    w = tp.world_size
    model.shard_specs = {}
    _divides(w, model.vocab_size, "vocab_size")
    modules = dict(model.named_modules())
    for name, m in modules.items():
        prefix = name + "." if name else ""
        if isinstance(m, GQAttention):
            _divides(w, m.num_heads, "num_attention_heads")
            _divides(w, m.num_kv_heads, "num_key_value_heads")
            for proj in ("q_proj", "k_proj", "v_proj"):
                _column(model, getattr(m, proj), prefix + proj, tp)
            _row(model, m.o_proj, prefix + "o_proj", tp)
            m.num_heads, m.num_kv_heads = m.num_heads // w, m.num_kv_heads // w
        elif isinstance(m, MLAttention):
            _divides(w, m.num_heads, "num_attention_heads")
            _column(model, m.q_b_proj if m.q_lora else m.q_proj, prefix + ("q_b_proj" if m.q_lora else "q_proj"), tp)
            _column(model, m.kv_b_proj, prefix + "kv_b_proj", tp)
            _row(model, m.o_proj, prefix + "o_proj", tp)
            m.num_heads //= w
        elif isinstance(m, GatedMLP):
            _divides(w, m.gate_proj.out_features, f"the intermediate size of {name}")
            _column(model, m.gate_proj, prefix + "gate_proj", tp)
            _column(model, m.up_proj, prefix + "up_proj", tp)
            _row(model, m.down_proj, prefix + "down_proj", tp)
    _shard_param(model, model.embed_tokens, "embed_tokens", "weight", "split", 0, tp)
    if model.lm_head is not None:
        _column(model, model.lm_head, "lm_head", tp)
    for layer in model.layers:  # each block's output is a partial sum until reduced
        for block in (layer.self_attn, layer.mlp):
            block.register_forward_hook(lambda _m, _args, out: tp.all_reduce(out))
    model.tp = tp


def vocab_parallel_embed(weight: torch.Tensor, input_ids: torch.Tensor, tp) -> torch.Tensor:
    """weight [vocab / world, hidden] (this rank's rows) -> the full embedding [num_tokens, hidden] on every rank."""
    rows = weight.shape[0]
    local = input_ids - tp.rank * rows
    mine = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), weight) * mine[:, None].to(weight.dtype)
    return tp.all_reduce(out)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp) -> torch.Tensor:
    """[num_rows, hidden] x this rank's head rows -> the full logits [num_rows, vocab] fp32 on every rank."""
    return tp.all_gather(F.linear(hidden, weight).float(), dim=-1)
