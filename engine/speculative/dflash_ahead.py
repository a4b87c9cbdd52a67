"""The DFlash drafter's call for a tree step launched ahead of the previous tree step's results (asynchronous
scheduling, engine.core): the previous step's accepted rows, their target features and its bonus token are still
on the device, so the new context rows are written padded and the block's positions, slots and lengths are
computed there.

Per request, with p = the previous tree's root position (the drafter's host view of the request ends there):
  - context rows: first the features the host still holds (positions context_len .. p - 1, a known count),
    then A padded rows at positions p .. p + A - 1 from the previous step's accepted rows (root first); row j
    is real when j < accepted length, else its K/V write is skipped (slot -1);
  - block: the bonus token at position p + accepted length, its rows' slots looked up in the request's pages
    on the device; the pages are reserved for the longest case (p + A + block size);
  - the request's context length on the host stays p until the previous step's results arrive, when
    `confirm` advances it by the accepted length (DFlashDrafter.confirm_ahead)."""
from __future__ import annotations

import torch

from engine.speculative.draft_kv import PAGE_TOKENS
from engine.speculative.drafter import DraftRequest
from ext.metadata import AttentionMetadata, flat_block_table, slots_on_device


def prepare_ahead(drafter, batch: list[DraftRequest], root_ids: torch.Tensor, root_positions: torch.Tensor,
                  feats: torch.Tensor, num_new: torch.Tensor):
    """-> DraftCall for `batch` (the requests' host state as of before the previous tree step). root_ids,
    root_positions, num_new [N] int64 and feats [N, A, F] (the previous step's accepted rows' features, padded)
    on the device."""
    from engine.speculative.dflash import DraftCall

    counts = drafter._check(batch)  # the host's own pending rows
    bs, n, span = drafter.block_size, len(batch), feats.shape[1]
    pool, stage = drafter.pool, drafter.stage
    prev = [r.root_position for r in batch]  # the previous tree's roots
    tables = [pool.reserve(r.request_id, p + span + bs) for r, p in zip(batch, prev)]
    # context rows: every request's host-held rows, then every request's span of the previous step's rows
    positions, slots = [], []
    for r, c, p in zip(batch, counts, prev):
        positions.extend(range(p - c, p))
        slots.extend(pool.slots(r.request_id, p - c, c))
    num_host = len(positions)
    for r, p in zip(batch, prev):
        positions.extend(range(p, p + span))
        slots.extend(pool.slots(r.request_id, p, span))
    flat, num_cols = flat_block_table(tables)
    positions, slots = stage.pack([positions, slots])
    qsl_d, table_d = stage.pack([list(range(0, (n + 1) * bs, bs)), flat], torch.int32)
    table = table_d.view(n, num_cols)
    # the previous step's rows past its accepted length write nowhere
    past = torch.arange(span, device=feats.device)[None, :] >= num_new[:, None]  # [N, A]
    slots[num_host:].masked_fill_(past.reshape(-1), -1)
    rows = [r.new_hidden for r, c in zip(batch, counts) if c] + [feats.reshape(n * span, -1)]
    if drafter.graphs is None or not drafter.graphs.write_context(rows, positions, slots):
        drafter.write_context(torch.cat(rows).to(drafter.device, drafter.dtype), positions, slots)
    for r, p in zip(batch, prev):
        drafter._context_len[r.request_id] = p
    block_positions = root_positions[:, None] + torch.arange(bs, device=feats.device)  # [N, bs]
    block_slots = slots_on_device(table, block_positions, PAGE_TOKENS)
    meta = AttentionMetadata(
        positions=block_positions.reshape(-1), slot_mapping=block_slots.reshape(-1), query_start_loc=qsl_d,
        seq_lens=(root_positions + bs).to(torch.int32), block_tables=table,
        block_size=PAGE_TOKENS, tree_mask=drafter._block_mask(n * bs), query_lens_host=[bs] * n,
        seq_lens_host=[p + span + bs for p in prev])
    return DraftCall(root_ids, meta)
