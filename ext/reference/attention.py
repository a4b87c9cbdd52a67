"""Pure-PyTorch reference of the paged attention ops (also the CPU implementation).

`paged_attention` is GQA attention (Llama, Qwen3) and `mla_paged_attention` is DeepSeek-V3 MLA in the absorbed
form over a latent cache; both read `ext.metadata.AttentionMetadata`, so the same op serves prefill chunks,
plain decode (one query) and tree verify (a tree mask over the new tokens). Math runs in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ext.metadata import AttentionMetadata


def unpadded(slot_mapping: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(slots, rows) without the padding rows (slot -1)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, rows
    return slot_mapping[keep], tuple(r[keep] for r in rows)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *row_shape] at slots (no padding) <- rows [len(slots), *row_shape]."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slots, rows.to(flat.dtype))


def write_kv(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *row_shape]; rows [num_tokens, *row_shape]; slot -1 = padding, skipped."""
    slots, (rows,) = unpadded(slot_mapping, rows)
    write_rows(cache, rows, slots)


def _visibility(meta: AttentionMetadata, seq: int, q0: int, num_q: int, seq_len: int) -> torch.Tensor | None:
    """[num_q, seq_len] bool, or None when plain causal attention over a fresh sequence suffices."""
    context_len = seq_len - num_q
    device = meta.block_tables.device
    if meta.tree_mask is None:
        if num_q == 1:
            return None
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=device).tril()
    else:
        causal = meta.tree_mask[q0 : q0 + num_q, :num_q]
    prefix = torch.ones(num_q, context_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, causal], dim=1)


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] for slots of any shape, through index_select (several times faster than advanced indexing on
    the CPU, the same values)."""
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


BATCH_MAX_QUERY = 64  # sequences with at most this many new tokens are batched by query length
BY_HEAD_MIN_KEYS = 1024  # a batched group with this many keys in all (sequences x longest) goes a KV head at a time


def _groups(meta: AttentionMetadata) -> tuple[list[int], dict[int, list[int]], list[int]]:
    """(first query row per sequence, query length -> batchable sequences, sequences done one by one)."""
    starts, batched, single, q0 = [], {}, [], 0
    for seq, num_q in enumerate(meta.query_lens_host):
        starts.append(q0)
        q0 += num_q
        if 0 < num_q <= BATCH_MAX_QUERY:
            batched.setdefault(num_q, []).append(seq)
        elif num_q:
            single.append(seq)
    for num_q, seqs in list(batched.items()):
        if len(seqs) == 1:
            single.extend(batched.pop(num_q))
    return starts, batched, single


def _batched_layout(meta: AttentionMetadata, seqs: list[int], starts: list[int], num_q: int):
    """For sequences sharing a query length: KV slots [S, L] (L = longest KV), query rows [S, num_q], and the
    visibility [S, num_q, L] (the whole context, then causal or tree-masked among the new tokens)."""
    device = meta.block_tables.device
    seq_lens = torch.tensor([meta.seq_lens_host[s] for s in seqs], device=device)  # [S]
    longest = int(max(meta.seq_lens_host[s] for s in seqs))
    cols = torch.arange(longest, device=device)
    logical = torch.minimum(cols[None, :], seq_lens[:, None] - 1)  # [S, L], clamped inside each sequence
    tables = meta.block_tables[torch.tensor(seqs, device=device)].long()
    slots = tables.gather(1, logical // meta.block_size) * meta.block_size + logical % meta.block_size
    q_rows = torch.tensor([starts[s] for s in seqs], device=device)[:, None] + torch.arange(num_q, device=device)
    context = seq_lens - num_q  # [S]
    rel = cols[None, :] - context[:, None]  # [S, L]: index among the new tokens, < 0 in the context
    is_new = (rel >= 0) & (rel < num_q)
    if meta.tree_mask is None:
        new_visible = rel[:, None, :] <= torch.arange(num_q, device=device)[None, :, None]  # causal
    else:
        rows = meta.tree_mask[q_rows.reshape(-1), :num_q].view(len(seqs), num_q, num_q)
        new_visible = rows.gather(2, rel.clamp(0, num_q - 1)[:, None, :].expand(-1, num_q, -1))
    visible = (rel < 0)[:, None, :] | (is_new[:, None, :] & new_visible)
    return slots, q_rows, visible


def _step_layout(meta: AttentionMetadata, on_cuda: bool) -> tuple[list, list]:
    """The step's attention layout, the same for every layer: ([(query rows [S * num_q], KV slots [S * L], hidden
    [S, num_q, 1, L] or None when every key is visible, S)] per batched query length, [(first row, query count, KV
    slots, hidden [num_q, seq_len] or None)] per sequence done alone). Built by the first layer and kept on the
    metadata for the others (~10 small ops a group, rebuilt by each of 30 layers they made a CPU tree step ~15 ms
    dearer than a plain one at batch 16 on two threads). Not kept for CUDA tensors: a graph captured after an eager
    warm-up over the same metadata would replay the warm-up's values."""
    if not on_cuda and meta._reference_layout is not None:
        return meta._reference_layout
    starts, batched, single = _groups(meta)
    groups = []
    for num_q, seqs in batched.items():
        slots, q_rows, visible = _batched_layout(meta, seqs, starts, num_q)
        hidden = ~visible[:, :, None]  # [S, num_q, 1, L]
        groups.append((q_rows.reshape(-1), slots.reshape(-1), hidden if bool(hidden.any()) else None, len(seqs)))
    alone = []
    for seq in single:
        num_q, seq_len, q0 = meta.query_lens_host[seq], meta.seq_lens_host[seq], starts[seq]
        mask = _visibility(meta, seq, q0, num_q, seq_len)
        alone.append((q0, num_q, meta.kv_slots(seq), None if mask is None else ~mask))
    layout = groups, alone
    if not on_cuda:
        meta._reference_layout = layout
    return layout


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    groups, alone = _step_layout(meta, q.is_cuda)
    for q_rows, slots, hidden, num_seqs in groups:  # decode rows and tree-verify blocks: batched per length
        qs = q[q_rows].float()
        keys, values = _gather(k_flat, slots).float(), _gather(v_flat, slots).float()
        by_head = slots.shape[0] >= BY_HEAD_MIN_KEYS
        out[q_rows] = _attend_batched(qs, keys, values, hidden, num_seqs, scale, by_head).to(q.dtype)
    for q0, num_q, slots, hidden in alone:
        qs = q[q0 : q0 + num_q].float()
        keys, values = k_flat.index_select(0, slots).float(), v_flat.index_select(0, slots).float()
        if num_q > BATCH_MAX_QUERY and meta.tree_mask is None and not q.is_cuda:  # a long prompt chunk, on the CPU
            o = _attend_chunk(qs, keys, values, scale)
        else:
            # a few queries: one product over all heads (a head at a time was slower at a query or a few, ~0.33
            # against ~0.24 ms a layer at 1,000 keys on the 2-core CPU; SDPA with enable_gqa several times slower);
            # a tree too wide to batch or a chunk on CUDA (where the reference is the kernels' twin in the GPU tests,
            # and SDPA's bottom-right mask with GQA has not run on a GPU here) by head from BY_HEAD_MIN_KEYS keys
            by_head = num_q > BATCH_MAX_QUERY and slots.shape[0] >= BY_HEAD_MIN_KEYS
            o = _attend_batched(qs, keys, values, None if hidden is None else hidden[None, :, None], 1, scale, by_head)
        out[q0 : q0 + num_q] = o.to(q.dtype)
    return out


def _attend_batched(
    q: torch.Tensor,  # [S * num_q, num_heads, head_dim] fp32
    keys: torch.Tensor,  # [S * L, num_kv_heads, head_dim] fp32
    values: torch.Tensor,  # [S * L, num_kv_heads, head_dim] fp32
    hidden: torch.Tensor | None,  # [S, num_q, 1, L] bool: keys a query does not see (None: it sees them all)
    num_seqs: int,
    scale: float,
    by_head: bool,
) -> torch.Tensor:  # [S * num_q, num_heads, head_dim] fp32
    """Attention of S sequences with num_q queries and L keys each. by_head (the callers: from BY_HEAD_MIN_KEYS keys
    in a batched group), one KV head at a time, both products on strided views of the gathered rows: permuted for
    one product over all heads, matmul copied K and V again, each a fresh buffer of the gathered size
    (bench/cpu_attention.py: the embedded model's decoding step at 16 requests of 400 tokens 131-144 ms before,
    118-124 after, on the 2-core CPU). Else that one product, whose copies cost less than the head loop's extra
    calls (0.18-0.20 against 0.25 ms a layer at 4 sequences of 100 keys). The same values either way."""
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    num_q, longest = q.shape[0] // num_seqs, keys.shape[0] // num_seqs
    group = q.shape[1] // num_kv_heads  # query head h reads KV head h // group
    qs = q.view(num_seqs, num_q, num_kv_heads, group, head_dim)
    keys = keys.view(num_seqs, longest, num_kv_heads, head_dim)
    values = values.view(num_seqs, longest, num_kv_heads, head_dim)
    if not by_head:
        scores = (qs.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * num_q, head_dim)
                  @ keys.permute(0, 2, 3, 1)).mul_(scale)  # [S, kv_heads, group * num_q, L]
        if hidden is not None:  # [S, num_q, 1, L] -> [S, 1, 1, num_q, L]
            scores.view(num_seqs, num_kv_heads, group, num_q, longest).masked_fill_(
                hidden.permute(0, 2, 1, 3)[:, None], float("-inf"))
        o = (scores.softmax(dim=-1) @ values.transpose(1, 2)).view(num_seqs, num_kv_heads, group, num_q, head_dim)
        return o.permute(0, 3, 1, 2, 4).reshape(num_seqs * num_q, num_kv_heads * group, head_dim)
    o = q.new_empty(num_seqs, num_q, num_kv_heads, group, head_dim)  # on q's device: the reference runs on CUDA too
    for h in range(num_kv_heads):
        qh = qs[:, :, h].reshape(num_seqs, num_q * group, head_dim)
        scores = torch.bmm(qh, keys[:, :, h].transpose(1, 2)).mul_(scale)  # [S, num_q * group, L]
        if hidden is not None:
            scores.view(num_seqs, num_q, group, longest).masked_fill_(hidden, float("-inf"))
        o[:, :, h] = torch.bmm(scores.softmax(dim=-1), values[:, :, h]).view(num_seqs, num_q, group, head_dim)
    return o.view(num_seqs * num_q, num_kv_heads * group, head_dim)


def _attend_chunk(
    q: torch.Tensor,  # [num_q, num_heads, head_dim] fp32
    keys: torch.Tensor,  # [L, num_kv_heads, head_dim] fp32: the context, then the chunk's own
    values: torch.Tensor,  # [L, num_kv_heads, head_dim] fp32
    scale: float,
) -> torch.Tensor:  # [num_q, num_heads, head_dim] fp32
    """A prompt chunk's attention through torch's fused attention: each row sees the context and the chunk's rows up
    to its own (causal, aligned to the bottom right), GQA read in place. On the 2-core CPU 2.4x our products at 400
    new tokens and 6x at 2,048 (178 against 30 ms a layer), the same values to ~1e-6."""
    num_q, seq_len = q.shape[0], keys.shape[0]
    mask = causal_lower_right(num_q, seq_len) if seq_len > num_q else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def mla_paged_attention(
    q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]: q_nope absorbed through W_UK
    q_rope: torch.Tensor,  # [num_tokens, num_heads, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]: attention output in latent space (before W_UV)
    kv_lora_rank = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    q0 = 0
    for seq, (num_q, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        rows = flat.index_select(0, meta.kv_slots(seq)).float()  # [seq_len, kv_lora_rank + rope_dim]
        latent, k_rope = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
        ql = q_latent[q0 : q0 + num_q].float()
        qr = q_rope[q0 : q0 + num_q].float()
        scores = (torch.einsum("thc,sc->hts", ql, latent) + torch.einsum("thr,sr->hts", qr, k_rope)) * scale
        mask = _visibility(meta, seq, q0, num_q, seq_len)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q0 : q0 + num_q] = torch.einsum("hts,sc->thc", probs, latent).to(q_latent.dtype)
        q0 += num_q
    return out
