"""The DFlash training objective (ddtree.md §1.9) on our drafter's own modules (engine.speculative.dflash
.DFlashModel: the weights trained here are the ones load_dflash reads).

A training batch holds B sequences (prompt + the target's response) and, per sequence, A random anchor positions
in the response. Anchor a makes the block [token a, MASK x (bs-1)] at positions a..a+bs-1; block position k
predicts token a+k. All blocks of a batch run in one forward: every block query attends, through one boolean
mask, to the projected target context of its own sequence strictly before its anchor and to its own block
(bidirectionally), as the inference drafter attends to [context K/V | block K/V]. The loss is the cross-entropy
of block position k weighted by exp(-(k-1)/gamma), through the target's frozen lm_head (the mask token's logit
removed, as at inference), computed in row chunks that are recomputed in backward, so [rows, vocab] logits never
stay in memory.

The math is written with differentiable PyTorch (ext.reference's RMSNorm and rope), not the inference modules'
forward, whose CUDA ops have no backward; tests/train/test_objective.py checks it against DFlashDrafter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.speculative.dflash import DFlashModel
from ext.reference.layers import apply_rope, fused_add_rmsnorm

LOGIT_ELEMENTS_PER_CHUNK = 1 << 27  # rows x vocab of one loss chunk (512 MiB of fp32 logits)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64, zero-padded
    lengths: list[int]  # [B] real tokens per sequence
    anchors: torch.Tensor  # [B, A] int64 anchor positions (0 where padding)
    anchor_valid: torch.Tensor  # [B, A] bool

    def to(self, device) -> "Batch":
        return Batch(self.tokens.to(device), self.lengths, self.anchors.to(device), self.anchor_valid.to(device))


def make_batch(seqs: list[tuple[list[int], int]], anchors: int, generator: torch.Generator) -> Batch:
    """seqs: (token ids, prompt length) per sequence. Anchors are drawn without replacement from the response
    positions that have at least one token after them: prompt_len <= a <= len - 2."""
    lengths = [len(ids) for ids, _ in seqs]
    tokens = torch.zeros(len(seqs), max(lengths), dtype=torch.int64)
    chosen = []
    for b, (ids, prompt_len) in enumerate(seqs):
        tokens[b, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        first, count = prompt_len, max(0, len(ids) - 1 - prompt_len)
        pick = torch.randperm(count, generator=generator)[:anchors] if count else torch.zeros(0, dtype=torch.int64)
        chosen.append((first + pick).sort().values)
    width = max(1, max(len(c) for c in chosen))
    anchor_pos = torch.zeros(len(seqs), width, dtype=torch.int64)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, c in enumerate(chosen):
        anchor_pos[b, :len(c)], valid[b, :len(c)] = c, True
    return Batch(tokens, lengths, anchor_pos, valid)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return fused_add_rmsnorm(x, None, norm.weight, norm.eps)[0]


def block_labels(batch: Batch, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [B, A, bs-1] int64, valid [B, A, bs-1] bool): block position k's target token a+k, valid when it
    exists, the anchor is real and it is not the mask token."""
    tokens, anchors = batch.tokens, batch.anchors
    pos = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)  # [B, A, bs-1]
    lengths = torch.tensor(batch.lengths, device=anchors.device)
    labels = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1).flatten(1)).view(pos.shape)
    valid = batch.anchor_valid[..., None] & (pos < lengths[:, None, None]) & (labels != mask_token_id)
    return labels, valid


def attention_mask(batch: Batch, block_size: int, context_len: int) -> torch.Tensor:
    """[B, 1, Q, T + Q] bool (Q = A * bs block rows): a block row sees context positions before its anchor and
    the rows of its own block. Every row sees at least its own block, so no row is fully masked."""
    anchors = batch.anchors
    num_blocks = anchors.shape[1]
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    context = torch.arange(context_len, device=anchors.device) < row_anchor[..., None]  # [B, Q, T]
    block_of = torch.arange(num_blocks, device=anchors.device).repeat_interleave(block_size)  # [Q]
    own = (block_of[:, None] == block_of[None, :]).expand(anchors.shape[0], -1, -1)  # [B, Q, Q]
    return torch.cat([context, own], dim=-1)[:, None]


def _attention(attn, x, ctx, cos_b, sin_b, cos_c, sin_c, mask):
    """x [B, Q, H] block rows, ctx [B, T, H] projected context -> [B, Q, H] (the drafter layer's attention)."""
    batch, rows, _ = x.shape
    width = ctx.shape[1]
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = apply_rope(_rms(attn.q_proj(x).view(batch * rows, nh, hd), attn.q_norm), cos_b, sin_b)
    k_b = apply_rope(_rms(attn.k_proj(x).view(batch * rows, nkv, hd), attn.k_norm), cos_b, sin_b)
    k_c = apply_rope(_rms(attn.k_proj(ctx).view(batch * width, nkv, hd), attn.k_norm), cos_c, sin_c)
    v_b, v_c = attn.v_proj(x), attn.v_proj(ctx)
    keys = torch.cat([k_c.view(batch, width, nkv, hd), k_b.view(batch, rows, nkv, hd)], dim=1)  # [B, T+Q, nkv, hd]
    values = torch.cat([v_c, v_b], dim=1).view(batch, width + rows, nkv, hd)
    group = nh // nkv  # heads expanded by hand: SDPA's memory-efficient kernel takes a mask but not enable_gqa
    keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, nh, T+Q, hd]
    values = values.transpose(1, 2).repeat_interleave(group, dim=1)
    q = q.view(batch, rows, nh, hd).transpose(1, 2)  # [B, nh, Q, hd]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=hd**-0.5)  # [B, nh, Q, hd]
    return attn.o_proj(out.transpose(1, 2).reshape(batch, rows, nh * hd))


def draft_hidden(model: DFlashModel, embed, feats: torch.Tensor, batch: Batch) -> torch.Tensor:
    """feats [B, T, F] target features, embed: ids -> the target's embeddings -> final-normed block hidden
    [B, A, bs, H] (row k of a block predicts the token k after its anchor)."""
    c = model.config
    bs, (num_seq, width) = c.block_size, batch.tokens.shape
    num_blocks = batch.anchors.shape[1]
    if not torch.is_autocast_enabled(feats.device.type):
        feats = feats.to(model.fc.weight.dtype)
    ctx = _rms(model.fc(feats), model.hidden_norm)  # [B, T, H]
    dtype = ctx.dtype
    ids = torch.full((num_seq, num_blocks, bs), c.mask_token_id, dtype=torch.int64, device=feats.device)
    ids[..., 0] = batch.tokens.gather(1, batch.anchors)
    h = embed(ids).to(dtype).view(num_seq, num_blocks * bs, -1)  # [B, Q, H]
    positions = (batch.anchors[..., None] + torch.arange(bs, device=feats.device)).reshape(-1)  # [B*Q]
    cos_b, sin_b = model.rotary.cos_sin(positions, dtype)
    cos_c, sin_c = model.rotary.cos_sin(torch.arange(width, device=feats.device).repeat(num_seq), dtype)
    mask = attention_mask(batch, bs, width)
    for layer in model.layers:
        h = h + _attention(layer.self_attn, _rms(h, layer.input_layernorm), ctx, cos_b, sin_b, cos_c, sin_c, mask)
        h = h + layer.mlp(_rms(h, layer.post_attention_layernorm))
    return _rms(h, model.norm).view(num_seq, num_blocks, bs, -1)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[bs-1]: exp(-(k-1)/gamma) for block positions k = 1..bs-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32, device=device) / gamma)


def _loss_chunk(hidden, weight, labels, mask_token_id):
    logits = F.linear(hidden, weight).float()  # [n, V]
    logits = logits.index_fill(1, torch.tensor([mask_token_id], device=logits.device), float("-inf"))
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels


def token_losses(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, mask_token_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], labels [N] -> (cross-entropy [N] fp32, argmax correct [N] bool), in chunks whose logits
    are recomputed in backward (only [chunk, V] logits live at a time)."""
    rows = max(1, LOGIT_ELEMENTS_PER_CHUNK // head_weight.shape[0])
    losses, correct = [], []
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        if torch.is_grad_enabled() and hidden.requires_grad:
            ce, ok = checkpoint(_loss_chunk, hidden[part], head_weight, labels[part], mask_token_id,
                                use_reentrant=False)
        else:
            ce, ok = _loss_chunk(hidden[part], head_weight, labels[part], mask_token_id)
        losses.append(ce)
        correct.append(ok)
    return torch.cat(losses), torch.cat(correct)


@dataclass
class StepMetrics:
    loss: torch.Tensor  # the weighted loss (with grad)
    ce_sum: torch.Tensor  # [bs-1] summed cross-entropy per block position (no grad)
    correct: torch.Tensor  # [bs-1] top-1 hits per block position
    count: torch.Tensor  # [bs-1] valid labels per block position
    streak_sum: torch.Tensor  # () sum over blocks of the leading correct positions (the chain's accepted drafts)
    num_blocks: torch.Tensor  # () real blocks


def dflash_loss(model: DFlashModel, target, feats: torch.Tensor, batch: Batch, gamma: float) -> StepMetrics:
    """The weighted block cross-entropy of one batch, with per-position statistics. target: a FrozenTarget (or
    anything with embed(ids) and head_weight)."""
    c = model.config
    hidden = draft_hidden(model, target.embed, feats, batch)[:, :, 1:]  # [B, A, bs-1, H]
    labels, valid = block_labels(batch, c.block_size, c.mask_token_id)  # [B, A, bs-1]
    ce, ok = token_losses(hidden[valid], target.head_weight, labels[valid], c.mask_token_id)  # [N]
    weights = position_weights(c.block_size, gamma, hidden.device)
    pos = torch.nonzero(valid)[:, 2]  # [N] block position - 1 of every valid row
    loss = (ce * weights[pos]).sum() / weights[pos].sum().clamp(min=1e-9)
    with torch.no_grad():
        L = c.block_size - 1
        ce_sum = torch.zeros(L, device=ce.device).index_add_(0, pos, ce.detach())
        correct = torch.zeros(L, device=ce.device).index_add_(0, pos, ok.float())
        count = torch.zeros(L, device=ce.device).index_add_(0, pos, torch.ones_like(ce))
        hits = torch.zeros(valid.shape, dtype=torch.bool, device=ce.device)
        hits[valid] = ok
        streak = hits.int().cumprod(dim=-1).sum(-1)  # [B, A] leading correct positions
        streak_sum = streak[batch.anchor_valid].sum().float()
    return StepMetrics(loss, ce_sum, correct, count, streak_sum, batch.anchor_valid.sum().float())
