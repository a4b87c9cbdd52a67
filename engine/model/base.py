"""What every model family shares: embedding -> decoder layers -> final norm -> lm_head, run over the step's
flattened tokens with one `AttentionMetadata`, and the interface the runner relies on.

A family subclass builds `self.layers` (each `layer(x, residual, cos, sin, meta, kv_cache) -> (x, residual)`, the
residual stream being x + residual, formed by the next norm's fused add; residual None = x is the stream) and
`self.rotary`, and says the per-layer KV cache shape. `forward` can also return the outputs of chosen decoder
layers (the residual stream after layer i, HF's hidden_states[i + 1]), which the DFlash drafter consumes.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.layers import RMSNorm
from engine.model.tensor_parallel import vocab_parallel_embed, vocab_parallel_logits
from ext import ops
from ext.metadata import AttentionMetadata


class CausalLM(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rms_norm_eps: float, tie_word_embeddings: bool):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.tie_word_embeddings = tie_word_embeddings
        self.lm_head = None if tie_word_embeddings else nn.Linear(hidden_size, vocab_size, bias=False)
        self.tp = None  # engine.distributed.TPGroup once engine/model/tensor_parallel.py shards this model
        self.shard_specs: dict = {}  # parameter name -> ShardSpec (tensor parallel only)

    # HF checkpoint names: model.embed_tokens / model.layers / model.norm / lm_head
    def hf_name(self, name: str) -> str:
        return name if name.startswith("lm_head") else "model." + name

    def remap_checkpoint_tensor(self, key: str, shape: tuple[int, ...]):
        """Loader hook, one checkpoint tensor at a time (never the whole state dict): None when the tensor named
        `key` fills the parameter of that HF name as is; else the parameters it fills, as
        [(HF parameter name, shape, take)] where take(tensor) is that parameter's part (e.g. packed MoE experts)."""
        return None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_cache_shape(self, layer: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.layers[layer].self_attn.kv_cache_shape(num_blocks, block_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return vocab_parallel_embed(self.embed_tokens.weight, input_ids, self.tp)
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        capture_layer_ids: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size], replaces the embedding
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # final-normed hidden [num_tokens, hidden], captured layers
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(meta.positions, h.dtype)
        captured, residual = {}, None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, meta, kv_caches[i])
            if i in capture_layer_ids:
                captured[i] = h + residual  # the residual stream after layer i
        out = self.norm(h) if residual is None else self.norm(h, residual)[0]
        if self.num_layers - 1 in captured:  # HF's hidden_states[-1] is taken after the final norm
            captured[self.num_layers - 1] = out
        return out, [captured[i] for i in capture_layer_ids]  # in the order asked for

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] fp32 logits; fp32=False: in the model's dtype where that saves a
        copy (for an argmax alone: the cast to fp32 is exact, so the argmax is the same; at batch 64 with trees
        the fp32 copy of ~1k rows of logits and its re-read cost ~0.1 ms a step on the H200)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp is not None:
            return vocab_parallel_logits(hidden, weight, self.tp)
        # ops.dense: cuBLAS, not the GEMV (on the vocab projection it is as fast or faster: bench/kernels.py --only
        # gemv); on the CPU in fp32, ext/cpu_linear.py's routes
        logits = ops.dense(hidden, weight)
        return logits.float() if fp32 else logits
