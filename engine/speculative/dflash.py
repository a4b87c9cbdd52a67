"""DFlash block-diffusion drafter (ddtree.md §1), loaded from a z-lab checkpoint folder.

Model: the target features of the context (outputs of target decoder layers `target_layer_ids`, concatenated)
go through `fc` + `hidden_norm` into `ctx`. Each Qwen3-style layer (q/k/v/o, per-head q_norm/k_norm before
rope, GQA, SwiGLU) attends from the block only, over keys/values [context K/V | block K/V], non-causal and
unmasked; context K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx). The block [bonus, MASK x (bs-1)] at
positions start..start+bs-1 is embedded with the target's embedding; after the final norm the target's
lm_head gives logits, and block row j+1 predicts depth j+1 (horizon L = bs - 1). The full block always runs.

Draft KV: per request and layer, the context K/V of every committed token the drafter has been shown
("draft-KV materialization": each call appends the K/V of its `new_hidden` rows), in pages of a pool the
drafter owns (DraftKVPool), the layout of the target's paged cache. A call writes its blocks' K/V after each
context and runs one paged-attention launch per layer for the whole batch, every block row seeing its context
and its whole block (an all-visible tree mask); the next call's context rows overwrite those slots.

Checkpoint: config.json (block_size top level or in dflash_config; mask_token_id in dflash_config or top level;
dflash_config.target_layer_ids, else the build_target_layer_ids rule; rope_theta top level or in
rope_parameters) and safetensors weights fc / hidden_norm / norm / layers.*, with or without a `model.`
prefix. DFlash2 checkpoints (conv layers, candidate selector) are a different architecture and are refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.errors import CheckpointError, ConfigError
from engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope
from engine.model.loader import read_config, read_safetensors, safetensors_files
from engine.speculative.dflash_ahead import prepare_ahead
from engine.speculative.dflash_config import DFlashConfig, build_target_layer_ids  # noqa: F401 (re-exported)
from engine.speculative.draft_kv import PAGE_TOKENS, DraftKVPool
from engine.speculative.drafter import DraftRequest, proposal_width
from engine.staging import Staging
from ext import ops
from ext.metadata import AttentionMetadata, flat_block_table
from ext.ops import topk_logprobs

DFLASH2_MARKERS = ("attention_conv", "mlp_conv", "candidate_selector")
IGNORED_KEYS = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def key_value(self, x, cos, sin):  # x [T, H] -> K, V [T, n_kv, hd] (K after k_norm + rope)
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        """x [N*bs, H] block rows at meta.positions; their K/V go into `cache` ([pages, page, n_kv, hd] each) at
        meta.slot_mapping, then every row attends over its context and whole block -> [N*bs, H]."""
        num_rows = x.shape[0]
        q = self.q_proj(x).view(num_rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        ops.qk_norm_rope_write_kv(q, k, v, cos, sin, cache[0], cache[1], meta.slot_mapping, self.q_norm.weight,
                                  self.k_norm.weight, self.q_norm.eps)
        out = ops.paged_attention(q, cache[0], cache[1], meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(num_rows, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DFlashModel(nn.Module):
    """The drafter's own weights (no embedding, no head). Parameter names = checkpoint names."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, c.max_position_embeddings)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats [T, F] target features at `positions` [T] -> K, V [num_layers, T, n_kv, hd]."""
        ctx = self.hidden_norm(self.fc(feats))  # [T, H]
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        kvs = [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])

    def block_forward(self, h: torch.Tensor, meta: AttentionMetadata, pool: DraftKVPool) -> torch.Tensor:
        """h [N*bs, H] embedded blocks at meta.positions, their context K/V in `pool` -> final-normed hidden."""
        cos, sin = self.rotary.cos_sin(meta.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, pool.layer(i), meta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


class DFlashDrafter:
    """The DFlash drafter behind the Drafter protocol, bound to a target model's embedding and lm_head."""

    def __init__(self, model: DFlashModel, target_model, vocab_size: int):
        c = model.config
        self.model, self.target, self.vocab_size = model, target_model, vocab_size
        self.block_size, self.horizon, self.mask_token_id = c.block_size, c.block_size - 1, c.mask_token_id
        self.target_layer_ids = c.target_layer_ids
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.pool = DraftKVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        self._context_len: dict[str, int] = {}
        self._all_visible: dict[int, torch.Tensor] = {}  # rows -> [rows, bs] all-True block mask
        self.graphs = None  # engine.speculative.dflash_graphs.DraftGraphs once captured
        # the step's positions and bonus tokens reach the device through pinned non-blocking copies (a plain
        # .to(device) of a host tensor synchronizes the stream: four waits a drafter call on the H200); the
        # speculator hands over the runner's staging, which is reset every step
        self.stage = Staging(self.device)

    def context_len(self, request_id: str) -> int:
        """Committed tokens whose draft K/V are cached (the first position new_hidden must start at)."""
        return self._context_len.get(request_id, 0)

    def release(self, request_id: str) -> None:
        self._context_len.pop(request_id, None)
        self.pool.release(request_id)

    def _check(self, batch: list[DraftRequest]) -> list[int]:
        """Validates the whole batch before any state changes; returns new context rows per request."""
        if len({r.request_id for r in batch}) != len(batch):
            raise ValueError("dflash drafter: a request appears twice in one batch")
        width = len(self.target_layer_ids) * self.model.config.target_hidden_size
        counts = []
        for r in batch:
            if not r.token_ids:
                raise ValueError(f"request {r.request_id}: no committed tokens (the bonus token is needed)")
            seen, want = self.context_len(r.request_id), len(r.token_ids) - 1 - self.context_len(r.request_id)
            got = 0 if r.new_hidden is None else r.new_hidden.shape[0]
            if want < 0 or got != want:
                raise ValueError(f"request {r.request_id}: new_hidden has {got} rows, expected {max(want, 0)} "
                                 f"(drafter has seen {seen} of {len(r.token_ids) - 1} context tokens)")
            if got and (r.new_hidden.dim() != 2 or r.new_hidden.shape[1] != width):
                raise ValueError(f"request {r.request_id}: new_hidden has shape {tuple(r.new_hidden.shape)}, "
                                 f"expected [{got}, {width}] (target layers {list(self.target_layer_ids)})")
            counts.append(got)
        return counts

    @property
    def kv_bytes_per_token(self) -> int:
        """Draft-KV bytes one context token takes (every layer's K and V)."""
        c = self.model.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def reserve_kv(self, num_tokens: int, max_num_seqs: int) -> None:
        """Sizes the pool once for an engine whose KV cache holds num_tokens: every running request's context
        fits, plus its block and the pages both round up to (so the pool never grows under CUDA graphs)."""
        self.pool.ensure_pages(-(-num_tokens // PAGE_TOKENS) + 2 * max_num_seqs + 1)

    def capture_graphs(self, batch_sizes: list[int], top_k: int, max_model_len: int, emulate: bool = False) -> None:
        """CUDA graphs of the block, the head and the top-K for `batch_sizes` (engine/speculative/dflash_graphs.py);
        emulate: the same static buffers run eagerly (CPU tests)."""
        from engine.speculative.dflash_graphs import DraftGraphs

        self.graphs = DraftGraphs(self, batch_sizes, top_k, max_model_len, emulate=emulate)

    @torch.inference_mode()
    def forward_logits(self, batch: list[DraftRequest]) -> torch.Tensor:
        """Materializes the new context K/V, runs the full block -> logits [N, L, V] fp32 (mask not excluded)."""
        if not batch:
            self._check(batch)
            return torch.empty((0, self.horizon, self.vocab_size), device=self.device)
        call = self._prepare(batch)
        return self.block_logits(call.bonus, call.meta)

    def _prepare(self, batch: list[DraftRequest]) -> "DraftCall":
        """Validates the batch, gives every request's context and block their pool slots, writes the new context
        rows' K/V, and stages the block's inputs: bonus tokens, positions and slots, lengths and page tables."""
        counts = self._check(batch)
        bs, n = self.block_size, len(batch)
        starts = [len(r.token_ids) - 1 for r in batch]  # each block's first position = its context's length
        tables = [self.pool.reserve(r.request_id, start + bs) for r, start in zip(batch, starts)]
        context_positions, context_slots, block_slots = [], [], []
        for r, c, start in zip(batch, counts, starts):
            if c:
                context_positions.extend(range(start - c, start))
                context_slots.extend(self.pool.slots(r.request_id, start - c, c))
            block_slots.extend(self.pool.slots(r.request_id, start, bs))
        block_positions = [start + j for start in starts for j in range(bs)]
        context_d, context_slots_d, bonus_d, positions_d, block_slots_d = self.stage.pack(
            [context_positions, context_slots, [r.token_ids[-1] for r in batch], block_positions, block_slots])
        flat, num_cols = flat_block_table(tables)
        seq_lens = [start + bs for start in starts]
        qsl_d, seq_lens_d, table_d = self.stage.pack([list(range(0, (n + 1) * bs, bs)), seq_lens, flat], torch.int32)
        if any(counts):  # draft-KV materialization, one batched projection for all requests' new rows
            rows = [r.new_hidden for r, c in zip(batch, counts) if c]
            if self.graphs is None or not self.graphs.write_context(rows, context_d, context_slots_d):
                self.write_context(torch.cat(rows).to(self.device, self.dtype), context_d, context_slots_d)
            for r, start in zip(batch, starts):
                self._context_len[r.request_id] = start
        meta = AttentionMetadata(
            positions=positions_d, slot_mapping=block_slots_d, query_start_loc=qsl_d, seq_lens=seq_lens_d,
            block_tables=table_d.view(n, num_cols), block_size=PAGE_TOKENS, tree_mask=self._block_mask(n * bs),
            query_lens_host=[bs] * n, seq_lens_host=seq_lens)
        return DraftCall(bonus_d, meta)

    def write_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The K/V of context rows (target features feats [T, F] at positions [T]) into the pool at slots [T]
        (-1: skipped)."""
        k, v = self.model.context_kv(feats, positions)  # [num_layers, T, n_kv, hd]
        for i in range(self.model.config.num_layers):
            ops.write_kv_pair(*self.pool.layer(i), k[i], v[i], slots)

    def block_logits(self, bonus: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The blocks [bonus, MASK x (bs-1)] (bonus [N]) at meta's positions, their K/V written at its slots ->
        logits [N, L, V] fp32 (row j predicts depth j + 1)."""
        n, bs = bonus.shape[0], self.block_size
        ids = torch.full((n, bs), self.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = bonus
        embedded = self.target.embed(ids.reshape(-1))  # [N*bs, H], the target's dtype
        h = self.model.block_forward(embedded.to(self.dtype), meta, self.pool).view(n, bs, -1)
        rows = h[:, 1:].reshape(n * self.horizon, -1).to(embedded.dtype)
        return self.target.compute_logits(rows).view(n, self.horizon, -1)

    def block_topk(self, bonus: torch.Tensor, meta: AttentionMetadata, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """block_logits' top-K log-probs with the mask token removed before the softmax (the rest renormalise)."""
        logits = self.block_logits(bonus, meta)  # [N, L, V]
        logits[..., self.mask_token_id] = float("-inf")
        return topk_logprobs(logits, proposal_width(top_k, logits.shape[-1], 1))

    def _block_mask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, bs] all True: a block row sees every row of its block (and, as always, its context)."""
        if num_rows not in self._all_visible:
            self._all_visible[num_rows] = torch.ones((num_rows, self.block_size), dtype=torch.bool, device=self.device)
        return self._all_visible[num_rows]

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, L, K] f32 log-probs sorted descending, [N, L, K] int64 ids); the mask token is never proposed.
        With CUDA graphs captured, the block runs as a replay (views of its outputs, valid until the next call)."""
        if not batch:
            logits = self.forward_logits(batch)
            return topk_logprobs(logits, proposal_width(top_k, logits.shape[-1], 1))
        call = self._prepare(batch)
        out = self.graphs.run(call, top_k) if self.graphs is not None else None
        return out if out is not None else self.block_topk(call.bonus, call.meta, top_k)

    @torch.inference_mode()
    def propose_ahead(self, batch: list[DraftRequest], top_k: int, root_ids: torch.Tensor,
                      root_positions: torch.Tensor, num_new: torch.Tensor, feats: torch.Tensor,
                      emitted_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """propose() for a tree step launched before the previous one's results reach the host
        (engine/speculative/dflash_ahead.py); needs the graphs (an eager call plans from exact host lengths)."""
        call = prepare_ahead(self, batch, root_ids, root_positions, feats, num_new)
        out = self.graphs.run(call, top_k)
        return out if out is not None else self.block_topk(call.bonus, call.meta, top_k)

    def confirm_ahead(self, request_id: str, num_rows: int) -> None:
        """The previous tree step's results reached the host: the num_rows accepted rows a call ahead wrote are
        context now."""
        if request_id in self._context_len:  # (not when the request finished meanwhile)
            self._context_len[request_id] += num_rows


@dataclass
class DraftCall:
    """One call's block inputs on the device: bonus tokens [N] and the block's attention metadata."""

    bonus: torch.Tensor
    meta: AttentionMetadata


def load_dflash(folder: str, target_model, vocab_size: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Loads a z-lab DFlash folder against `target_model`. Errors: one-line ValueError naming the problem."""
    folder = os.path.expanduser(str(folder))
    if not os.path.isdir(folder):
        raise CheckpointError(folder, "DFlash drafter: expected a checkpoint folder (config.json + *.safetensors)")
    where = os.path.join(folder, "config.json")
    raw = read_config(folder)
    if any("dflash2" in str(a).lower() for a in raw.get("architectures") or []):
        raise CheckpointError(where, f"DFlash2 checkpoints ({raw['architectures'][0]}) are not supported, "
                                     f"only DFlash v1")
    try:
        c = DFlashConfig.from_hf(raw, num_target_layers=target_model.num_layers)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if c.hidden_size != target_model.hidden_size or c.target_hidden_size != target_model.hidden_size:
        raise ConfigError(f"{where}: DFlash drafter hidden_size {c.hidden_size} does not match the target's "
                          f"hidden_size {target_model.hidden_size}")
    if c.vocab_size is not None and int(c.vocab_size) != vocab_size:
        raise ConfigError(f"{where}: DFlash drafter vocab_size {c.vocab_size} does not match the target's "
                          f"vocab_size {vocab_size}")
    if not 0 <= c.mask_token_id < vocab_size:
        raise ConfigError(f"{where}: DFlash mask_token_id {c.mask_token_id} is outside the target's vocabulary "
                          f"(size {vocab_size})")
    if raw.get("num_target_layers") is not None and int(raw["num_target_layers"]) != target_model.num_layers:
        raise ConfigError(f"{where}: DFlash drafter num_target_layers {raw['num_target_layers']} does not match "
                          f"the target's {target_model.num_layers} layers")
    bad = [i for i in c.target_layer_ids if not 0 <= i < target_model.num_layers]
    if bad:
        raise ConfigError(f"{where}: DFlash target_layer_ids {list(c.target_layer_ids)} name layers outside the "
                          f"target's {target_model.num_layers}")
    state = read_safetensors(safetensors_files(folder))
    dflash2 = next((k for k in state if any(m in k for m in DFLASH2_MARKERS)), None)
    if dflash2 is not None:
        raise CheckpointError(folder, f"tensor {dflash2!r} is from a DFlash2 checkpoint, which is not supported "
                                      f"(only DFlash v1)")
    state = {k.removeprefix("model."): t for k, t in state.items()}
    with torch.device("meta"):
        model = DFlashModel(c)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    for key in state:
        if key not in params and not key.endswith(IGNORED_KEYS):
            raise CheckpointError(folder, f"unexpected tensor {key!r} for a DFlash drafter")
    with torch.no_grad():
        for name, dst in params.items():
            if name not in state:
                raise CheckpointError(folder, f"tensor {name!r} is missing")
            if tuple(state[name].shape) != tuple(dst.shape):
                raise CheckpointError(folder, f"tensor {name!r} has shape {tuple(state[name].shape)}, "
                                              f"expected {tuple(dst.shape)}")
            dst.data = state[name].to(device=device, dtype=dtype)
    model.rotary.init_buffers(device)
    return DFlashDrafter(model.eval(), target_model, vocab_size)
