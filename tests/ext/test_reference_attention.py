"""The CPU's paged attention (ext/reference/attention.py) against torch's scaled_dot_product_attention run sequence by
sequence on dense keys with an explicit mask: decode groups small and large (its two batched forms), sequences of
unequal lengths (hidden keys), tree-verify blocks, a lone sequence, and prompt chunks with and without context (the
fused path), in one step each."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ext.metadata import AttentionMetadata
from ext.reference import attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


def step(gen: torch.Generator, seqs: list[tuple[int, int]], tree: bool):
    """seqs: (context, new tokens) per sequence; blocks scattered; tree: a random tree mask among the new tokens of
    the sequences with 2-64 of them. -> q, caches, metadata, and each sequence's visibility [new, context + new]."""
    blocks_each = [-(-(c + n) // BLOCK) for c, n in seqs]
    num_blocks = sum(blocks_each) + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(blocks_each), dtype=torch.int32)
    for i, b in enumerate(blocks_each):
        tables[i, :b] = torch.tensor(order[:b])
        order = order[b:]
    num_tokens = sum(n for _, n in seqs)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    width = max(n for _, n in seqs)
    mask = torch.zeros(num_tokens, width, dtype=torch.bool) if tree else None
    visible, row = [], 0
    for c, n in seqs:
        new = torch.ones(n, n, dtype=torch.bool).tril()
        if tree and 1 < n <= attention.BATCH_MAX_QUERY:
            new &= torch.rand(n, n, generator=gen) < 0.6
            new |= torch.eye(n, dtype=torch.bool)
        if mask is not None:
            mask[row:row + n, :n] = new
        visible.append(torch.cat([torch.ones(n, c, dtype=torch.bool), new], dim=1))
        row += n
    lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        positions=torch.zeros(num_tokens, dtype=torch.long), slot_mapping=torch.zeros(num_tokens, dtype=torch.long),
        query_start_loc=torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))]).int(),
        seq_lens=torch.tensor(lens).int(), block_tables=tables, block_size=BLOCK, tree_mask=mask,
        query_lens_host=[n for _, n in seqs], seq_lens_host=lens)
    return q, k_cache, v_cache, meta, visible


def dense(q, k_cache, v_cache, meta, visible, scale):
    """Each sequence's keys gathered densely by its block table and attended through torch's SDPA."""
    out, row = [], 0
    for i, (n, length) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        blocks = meta.block_tables[i, :-(-length // BLOCK)].long()
        k = k_cache[blocks].flatten(0, 1)[:length].repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:length].repeat_interleave(HEADS // KV_HEADS, dim=1)
        o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible[i], scale=scale)
        out.append(o.transpose(0, 1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("seqs,tree", [
    ([(30, 1), (12, 1), (50, 1)], False),                 # a small decode group, unequal lengths
    ([(300, 1)] * 3 + [(200, 1)] * 3, False),             # a decode group past BY_HEAD_MIN_KEYS, unequal lengths
    ([(40, 5), (33, 5), (70, 5), (9, 3)], True),          # small tree blocks, and a lone one of 3
    ([(300, 5), (280, 5), (260, 5), (100, 1)], True),     # large tree blocks beside a lone decode
    ([(0, 90)], False),                                   # a whole prompt past BATCH_MAX_QUERY (fused)
    ([(60, 100), (20, 1), (0, 70)], False),               # a chunk after context, a decode, a whole prompt
    ([(50, 70)], True),                                   # a tree too wide to batch
])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_paged_attention_reference_equals_sdpa_sequence_by_sequence(seqs, tree, device):
    """On CUDA the reference is the kernels' twin in the GPU tests: its by-head form once returned a CPU buffer there."""
    gen = torch.Generator().manual_seed(len(seqs) * 7 + tree)
    q, k_cache, v_cache, meta, visible = step(gen, seqs, tree)
    want = dense(q, k_cache, v_cache, meta, visible, 0.3)
    moved = {f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    meta = dataclasses.replace(meta, **moved)
    got = attention.paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), meta, 0.3)
    assert got.device.type == device
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
