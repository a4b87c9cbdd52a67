"""One step's model inputs: the flat token rows, their rope positions, cache slots and the attention metadata,
for plain sequences (prefill chunks and decodes, laid out first, from host lists; a decode scheduled ahead gets
a placeholder id the runner replaces on the device) followed by the DDTree verify rows (N requests x W rows,
taken from the device-resident trees without a host sync)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.plan import ScheduledSeq
from engine.speculative.speculator import Speculator, TreeBatch
from engine.staging import Staging
from ext.metadata import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    plain_rows: list[tuple[int, int]]  # per plain sequence: (first row, number of rows)
    tree_row0: int  # first verify row (= number of plain rows)
    tree_slots: torch.Tensor | None  # [N, W] int64 cache slots of the verify rows


def slot_of(block_ids: list[int], block_size: int, index: int) -> int:
    return block_ids[index // block_size] * block_size + index % block_size


def slot_range(block_ids: list[int], block_size: int, start: int, count: int) -> list[int]:
    """[slot_of(block_ids, block_size, i) for i in range(start, start + count)], one range per block touched."""
    out, pos, end = [], start, start + count
    while pos < end:
        offset = pos % block_size
        take = min(block_size - offset, end - pos)
        base = block_ids[pos // block_size] * block_size + offset
        out.extend(range(base, base + take))
        pos += take
    return out


def prepare_inputs(plain: list[ScheduledSeq], batch: TreeBatch | None, block_size: int,
                   device: torch.device, stage: Staging | None = None) -> StepInputs:
    stage = stage or Staging(device)
    ids, positions, slots, offsets = [], [], [], []  # offsets: row index inside its sequence (causal mask)
    query_lens, seq_lens, tables, rows = [], [], [], []
    for s in plain:
        req, start = s.request, s.request.num_computed_tokens + s.num_ahead
        # a request scheduled ahead feeds a token the previous step samples: the runner puts it in on the device
        new_ids = [0] * s.num_new_tokens if s.num_ahead else req.token_ids(start, start + s.num_new_tokens)
        n = len(new_ids)
        rows.append((len(ids), n))
        if n == 1:  # a decode (most rows of most steps): no per-token ranges
            ids.append(new_ids[0])
            positions.append(start)
            slots.append(slot_of(req.block_ids, block_size, start))
            offsets.append(0)
        else:
            ids.extend(new_ids)
            positions.extend(range(start, start + n))
            slots.extend(slot_range(req.block_ids, block_size, start, n))
            offsets.extend(range(n))
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(req.block_ids)
    tree_row0 = len(ids)
    tree_ids = tree_pos = tree_vis = tree_slots = None
    starts, tree_slot_list = [], []
    if batch is not None:
        width = batch.width
        for s in batch.seqs:
            req, start = s.request, s.request.num_computed_tokens
            starts.append(start)
            tree_slot_list.extend(slot_range(req.block_ids, block_size, start, width))
            query_lens.append(width)
            seq_lens.append(start + width)
            tables.append(req.block_ids)
    num_cols = max((len(t) for t in tables), default=1) or 1
    table = []
    for t in tables:
        table += t
        if len(t) < num_cols:
            table += [0] * (num_cols - len(t))
    # two host-to-device copies for the whole step: the int64 arrays, then the int32 ones
    ids_d, pos_d, slots_d, starts_d, tree_slots_d, offsets_d = stage.pack(
        [ids, positions, slots, starts, tree_slot_list, offsets if batch is not None else []])
    qsl_d, seq_lens_d, table_d = stage.pack([_cumulative(query_lens), seq_lens, table], torch.int32)
    if batch is not None:
        tree_ids, tree_pos, tree_vis = Speculator.verify_rows(batch, starts_d)
        tree_slots = tree_slots_d.view(batch.num_requests, batch.width)
    input_ids = _concat(ids_d, tree_ids)
    meta = AttentionMetadata(
        positions=_concat(pos_d, tree_pos),
        slot_mapping=_concat(slots_d, tree_slots.reshape(-1) if tree_slots is not None else None),
        query_start_loc=qsl_d,
        seq_lens=seq_lens_d,
        block_tables=table_d.view(len(tables), num_cols),
        block_size=block_size,
        tree_mask=_tree_mask(offsets_d if tree_vis is not None else None, tree_vis,
                             max(query_lens, default=1), device),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    return StepInputs(input_ids, meta, rows, tree_row0, tree_slots)


def _concat(head: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    return head if tail is None else torch.cat([head, tail])


def _cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _tree_mask(offsets: torch.Tensor | None, tree_vis: torch.Tensor | None, max_q: int, device
               ) -> torch.Tensor | None:
    """[num_tokens, max_q] bool visibility among each sequence's new tokens: causal for the plain rows (offsets:
    each row's index inside its sequence), the trees' ancestor-or-self visibility for the verify rows; None (all
    causal) when there is no tree."""
    if tree_vis is None:
        return None
    cols = torch.arange(max_q, device=device)
    plain = cols[None, :] <= offsets[:, None]
    tree = torch.zeros(tree_vis.shape[0], max_q, dtype=torch.bool, device=device)
    tree[:, :tree_vis.shape[1]] = tree_vis
    return torch.cat([plain, tree])
