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
from ext.metadata import AttentionMetadata, flat_block_table, slots_on_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata | None  # None: a decoding step already written into a graph's buffers (graph_key)
    plain_rows: list[tuple[int, int]]  # per plain sequence: (first row, number of rows)
    tree_row0: int  # first verify row (= number of plain rows)
    tree_slots: torch.Tensor | None  # [N, W] int64 cache slots of the verify rows
    tree_starts: torch.Tensor | None = None  # [N] int64 root position of each tree, on the device
    graph_key: tuple[int, int, int] | None = None  # a decoding step already written into this graph's buffers


def decode_rows(plain: list[ScheduledSeq], block_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """A plain decoding step's host arrays, one row per request: (token ids, positions, cache slots, KV lengths).
    A request scheduled ahead feeds the token the step in flight samples: its id here is a placeholder (0)."""
    ids, positions, slots, seq_lens = [], [], [], []
    for s in plain:
        req = s.request
        start = first_position(s)
        ids.append(0 if s.num_ahead else req.token_ids(start, start + 1)[0])
        positions.append(start)
        slots.append(slot_of(req.block_ids, block_size, start))
        seq_lens.append(start + 1)
    return ids, positions, slots, seq_lens


def first_position(s: ScheduledSeq) -> int:
    """The position of the first token a sequence feeds this step. A request scheduled ahead feeds the token the
    step in flight samples, at the position past its host tokens: its host count of computed tokens lags by what
    that step computes (1 when decoding, a whole chunk when that step ended its prompt)."""
    req = s.request
    return req.num_tokens + s.num_ahead - 1 if s.num_ahead else req.num_computed_tokens


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


def padding_rows(num_rows: int, pad_to: int) -> int:
    """Rows that round an eagerly run step of num_rows up to a multiple of pad_to (steps of at most pad_to rows
    stay as they are: few row counts, and one or two rows take the GEMV)."""
    return (-num_rows) % pad_to if pad_to and num_rows > pad_to else 0


def prepare_inputs(plain: list[ScheduledSeq], batch: TreeBatch | None, block_size: int,
                   device: torch.device, stage: Staging | None = None, pad_to: int = 0,
                   dense_prefill_min_tokens: int = 0) -> StepInputs:
    """dense_prefill_min_tokens: carried in the metadata for the attention op (ext/prefill.py; 0 = off).
    pad_to: round the step's rows up to a multiple of it (an eager step on CUDA: cuBLAS chooses its kernels
    once per row count, ~0.2 ms a projection shape on the H200, so row counts that repeat are cheaper). The
    padding rows form one extra sequence after the verify rows: token 0 at positions 0.., causal, reading block
    0 (finite values: caches start zeroed) and writing nowhere (slot -1); nothing samples them."""
    stage = stage or Staging(device)
    ids, positions, slots, offsets = [], [], [], []  # offsets: row index inside its sequence (causal mask)
    query_lens, seq_lens, tables, rows = [], [], [], []
    for s in plain:
        req, start = s.request, first_position(s)
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
    num_pad = padding_rows(tree_row0 + (batch.num_requests * batch.width if batch is not None else 0), pad_to)
    if num_pad:
        query_lens.append(num_pad)
        seq_lens.append(num_pad)
        tables.append([0] * -(-num_pad // block_size))
    table, num_cols = flat_block_table(tables)
    # two host-to-device copies for the whole step: the int64 arrays, then the int32 ones
    pad_pos = list(range(num_pad))
    ids_d, pos_d, slots_d, starts_d, tree_slots_d, offsets_d, pad_pos_d, pad_slots_d, pad_ids_d = stage.pack(
        [ids, positions, slots, starts, tree_slot_list, offsets if batch is not None else [], pad_pos,
         [-1] * num_pad, [0] * num_pad])
    qsl_d, seq_lens_d, table_d = stage.pack([_cumulative(query_lens), seq_lens, table], torch.int32)
    if batch is not None:
        tree_ids, tree_pos, tree_vis = Speculator.verify_rows(batch, starts_d)
        tree_slots = tree_slots_d.view(batch.num_requests, batch.width)
    pad = num_pad > 0
    input_ids = _concat(ids_d, tree_ids, pad_ids_d if pad else None)
    meta = AttentionMetadata(
        positions=_concat(pos_d, tree_pos, pad_pos_d if pad else None),
        slot_mapping=_concat(slots_d, tree_slots.reshape(-1) if tree_slots is not None else None,
                             pad_slots_d if pad else None),
        query_start_loc=qsl_d,
        seq_lens=seq_lens_d,
        block_tables=table_d.view(len(tables), num_cols),
        block_size=block_size,
        tree_mask=_tree_mask(offsets_d if tree_vis is not None else None, tree_vis,
                             max(query_lens, default=1), device, pad_pos_d if pad else None),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        dense_prefill_min_tokens=dense_prefill_min_tokens,
        padded=pad,
    )
    return StepInputs(input_ids, meta, rows, tree_row0, tree_slots, starts_d if batch is not None else None)


def prepare_tree_inputs_ahead(batch: TreeBatch, max_starts: list[int], block_size: int, stage: Staging,
                              dense_prefill_min_tokens: int = 0) -> StepInputs:
    """The inputs of a tree step drafted ahead of its predecessor's results: every request's root position
    (batch.starts) is on the device, so the verify rows' positions, cache slots and key counts are computed
    there from the block tables, which the scheduler grew for the longest case (max_starts: each root's
    largest possible position, which the host-side lengths report)."""
    n, width = batch.num_requests, batch.width
    flat, num_cols = flat_block_table([s.request.block_ids for s in batch.seqs])
    qsl_d, table_d = stage.pack([_cumulative([width] * n), flat], torch.int32)
    table_d = table_d.view(n, num_cols)
    starts = batch.starts  # [N] int64
    pos = starts[:, None] + torch.arange(width, device=starts.device)  # [N, W] logical KV positions
    tree_slots = slots_on_device(table_d, pos, block_size)  # [N, W]
    tree_ids, tree_pos, tree_vis = Speculator.verify_rows(batch, starts)
    meta = AttentionMetadata(
        positions=tree_pos, slot_mapping=tree_slots.reshape(-1), query_start_loc=qsl_d,
        seq_lens=(starts + width).to(torch.int32), block_tables=table_d, block_size=block_size,
        tree_mask=tree_vis, query_lens_host=[width] * n, seq_lens_host=[m + width for m in max_starts],
        dense_prefill_min_tokens=dense_prefill_min_tokens, padded=False)
    return StepInputs(tree_ids, meta, [], 0, tree_slots, starts)


def _concat(head: torch.Tensor, *tails: torch.Tensor | None) -> torch.Tensor:
    parts = [head, *(t for t in tails if t is not None)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _tree_mask(offsets: torch.Tensor | None, tree_vis: torch.Tensor | None, max_q: int, device,
               pad_offsets: torch.Tensor | None = None) -> torch.Tensor | None:
    """[num_tokens, max_q] bool visibility among each sequence's new tokens: causal for the plain rows (offsets:
    each row's index inside its sequence) and the padding rows, the trees' ancestor-or-self visibility for the
    verify rows; None (all causal) when there is no tree."""
    if tree_vis is None:
        return None
    if offsets.numel() == 0 and pad_offsets is None and tree_vis.shape[1] == max_q:
        return tree_vis  # only trees (every step replayed as a graph with trees): their visibility is the mask
    cols = torch.arange(max_q, device=device)
    plain = cols[None, :] <= offsets[:, None]
    tree = torch.zeros(tree_vis.shape[0], max_q, dtype=torch.bool, device=device)
    tree[:, :tree_vis.shape[1]] = tree_vis
    parts = [plain, tree] + ([cols[None, :] <= pad_offsets[:, None]] if pad_offsets is not None else [])
    return torch.cat(parts)
