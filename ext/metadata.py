"""Attention metadata for one step over the paged KV cache: the contract between the runner, which
builds it once per step, and every attention op, which only reads it.

Layout: the step's new tokens of all sequences are flattened to `num_tokens` rows; sequence `i` owns rows
`query_start_loc[i]:query_start_loc[i+1]`. Its KV (context + new tokens) has `seq_lens[i]` logical slots,
found through `block_tables[i]`; the new tokens are its last `query_len` logical slots. A query sees the whole
context, and among the new tokens either a causal prefix (tree_mask is None: prefill chunks, decode) or the
rows `tree_mask` marks (tree verify: ancestors and itself). Positions are explicit per token: tree siblings
share one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] int64, rope position of every new token
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot (block * block_size + offset) for its K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length per sequence including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    block_size: int
    # [num_tokens, max_query_len] bool: visibility among the new tokens of the same sequence; None = causal
    tree_mask: torch.Tensor | None = None
    # host copies, so the reference path and the runner never sync on device tensors
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    # prefill chunks of at least this many tokens with no cached context (and the sequences after them) attend
    # through torch's FlashAttention when the op is given the dense new rows (ext/prefill.py); 0 = never
    dense_prefill_min_tokens: int = 0
    # the last sequence is an eager step's padding rows (engine.inputs.padding_rows): nothing reads its output
    padded: bool = False
    _kv_slots: list[torch.Tensor] | None = field(default=None, repr=False)
    # device-side, derived once per step on first use: tree_mask packed to [num_tokens, ceil(max_query_len/64)]
    # int64 words (bit j of word w = new token 64*w + j), what the CUDA attention kernels read
    _tree_bits: torch.Tensor | None = field(default=None, repr=False)
    _prefixes: dict = field(default_factory=dict, repr=False)  # num_seqs -> the metadata of the first num_seqs
    _row_starts: list[int] | None = field(default=None, repr=False)
    # the reference (CPU) attention's layout of the step, built by its first layer (ext/reference/attention.py)
    _reference_layout: tuple | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def packed_tree_mask(self) -> torch.Tensor | None:
        """tree_mask as packed bits (see `pack_bits`), computed once and cached; None when causal."""
        if self.tree_mask is None:
            return None
        if self._tree_bits is None:
            from ext import ops  # lazily: ops imports this module

            self._tree_bits = ops.pack_tree_mask(self.tree_mask)
        return self._tree_bits

    def prefix(self, num_seqs: int) -> "AttentionMetadata":
        """The metadata of the step's first num_seqs sequences and their rows (slices, cached per step; causal
        steps only: a tree mask's rows would need its own slice)."""
        if num_seqs not in self._prefixes:
            if self.tree_mask is not None:
                raise ValueError("prefix(): tree-verify steps are not split")
            rows = sum(self.query_lens_host[:num_seqs])
            self._prefixes[num_seqs] = AttentionMetadata(
                positions=self.positions[:rows], slot_mapping=self.slot_mapping[:rows],
                query_start_loc=self.query_start_loc[: num_seqs + 1], seq_lens=self.seq_lens[:num_seqs],
                block_tables=self.block_tables[:num_seqs], block_size=self.block_size,
                query_lens_host=self.query_lens_host[:num_seqs], seq_lens_host=self.seq_lens_host[:num_seqs])
        return self._prefixes[num_seqs]

    def row_starts(self) -> list[int]:
        """First row of every sequence, and the row count last: the host twin of query_start_loc."""
        if self._row_starts is None:
            self._row_starts = [0]
            for n in self.query_lens_host:
                self._row_starts.append(self._row_starts[-1] + n)
        return self._row_starts

    def kv_slots(self, seq: int) -> torch.Tensor:
        """Cache slots of sequence `seq`'s logical KV positions 0..seq_len-1, computed once per step."""
        if self._kv_slots is None:
            self._kv_slots = []
            for i, seq_len in enumerate(self.seq_lens_host):
                logical = torch.arange(seq_len, device=self.block_tables.device)
                blocks = self.block_tables[i, logical // self.block_size].long()
                self._kv_slots.append(blocks * self.block_size + logical % self.block_size)
        return self._kv_slots[seq]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, Q] -> int64 [T, ceil(Q/64)], bit j of word w = column 64*w + j (pure torch, any device)."""
    num_tokens, num_cols = mask.shape
    words = (num_cols + 63) // 64
    padded = torch.zeros(num_tokens, words * 64, dtype=torch.int64, device=mask.device)
    padded[:, :num_cols] = mask.to(torch.int64)
    shifts = torch.arange(64, dtype=torch.int64, device=mask.device)
    # distinct powers of two never carry, so the (wrapping) sum is the bitwise or, bit 63 included
    return (padded.view(num_tokens, words, 64) << shifts).sum(-1)


def flat_block_table(tables: list[list[int]]) -> tuple[list[int], int]:
    """Per-sequence block lists -> (one flat row-major list, each row padded with block 0 to the longest, and
    the number of columns). Padding entries are never read (kernels stop at each sequence's length)."""
    num_cols = max((len(t) for t in tables), default=1) or 1
    flat = []
    for t in tables:
        flat += t
        if len(t) < num_cols:
            flat += [0] * (num_cols - len(t))
    return flat, num_cols


def block_table_rows(tables: list[list[int]], runs: bool = False) -> np.ndarray:
    """flat_block_table's table as an int32 array [len(tables), columns]. runs: rows come in runs holding the same
    list object, each run converted once and repeated (an admission step's one-row requests repeat their prompt's
    table per prompt token: converting 244 rows of 63 blocks from lists took 243 us on the 2-core CPU, by runs 96;
    64 distinct rows take ~6 us longer that way, so plain steps do not ask for it)."""
    unique, counts = tables, None
    if runs:
        unique, counts = [], []
        for t in tables:
            if unique and t is unique[-1]:
                counts[-1] += 1
            else:
                unique.append(t)
                counts.append(1)
    flat, num_cols = flat_block_table(unique)
    rows = np.asarray(flat, dtype=np.int32).reshape(len(unique), num_cols)
    return rows if len(unique) == len(tables) else np.repeat(rows, counts, axis=0)


def slots_on_device(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of logical positions computed on the device: block_tables [N, C] (any int dtype), positions
    [N, K] int64 -> [N, K] int64 (for steps whose positions are not known on the host)."""
    return block_tables.gather(1, positions // block_size).long() * block_size + positions % block_size


def build_metadata(
    positions: list[int],
    slot_mapping: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    tree_masks: list[torch.Tensor | None] | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Packs host lists into device tensors. tree_masks[i] is [query_len_i, query_len_i] bool or None (causal)."""
    num_seqs = len(query_lens)
    max_blocks = max((len(t) for t in block_tables), default=1) or 1
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    mask = None
    if tree_masks is not None and any(m is not None for m in tree_masks):
        max_q = max(query_lens)
        mask = torch.zeros(cu[-1], max_q, dtype=torch.bool)
        for i, n in enumerate(query_lens):
            m = tree_masks[i]
            if m is None:
                m = torch.ones(n, n, dtype=torch.bool).tril()
            mask[cu[i] : cu[i + 1], :n] = m
        mask = mask.to(device)
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        block_size=block_size,
        tree_mask=mask,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )
