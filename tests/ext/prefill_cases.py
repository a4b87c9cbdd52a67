"""A mixed step for the dense-prefill split (ext/prefill.py): running requests, then newly admitted prompts,
their K/V already written to a paged cache as the attention layer leaves them."""
from __future__ import annotations

import torch

from ext import reference
from ext.metadata import build_metadata


def mixed_step(gen: torch.Generator, specs: list[tuple[int, int]], device="cpu", dtype=torch.float32,
               heads=4, kv_heads=2, head_dim=32, block_size=16):
    """specs: (new tokens, cached context) per sequence -> (q, k, v, k_cache, v_cache, meta); k and v hold every
    new row's key and value, and the cache holds every sequence's context and new rows."""
    query_lens = [n for n, _ in specs]
    seq_lens = [n + c for n, c in specs]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 1
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables, slots, positions, used = [], [], [], 0
    for (n, c), s in zip(specs, seq_lens):
        blocks = perm[used:used + -(-s // block_size)]
        used += len(blocks)
        tables.append(blocks)
        positions += list(range(c, s))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, s)]
    meta = build_metadata(positions, slots, query_lens, seq_lens, tables, block_size, device=device)
    rows = sum(query_lens)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(device, dtype)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    reference.write_kv_pair(caches[0], caches[1], k, v, meta.slot_mapping)
    return q, k, v, caches[0], caches[1], meta
