"""Admission steps as CUDA-graph replays. A step that computes prompt chunks beside decoding requests (under load
with real prompts, every admission) would run eagerly as one mixed forward, bound by its launches: 11.5 ms at
batch 64 with the embedded model on an H100, against 1.3 ms for a decoding step replayed. Here each prompt chunk
runs as causal pieces of at most the widest prompt width, each piece a replay of the prompt bucket that holds
it (engine/cuda_graphs.py: a chain is a tree, so a piece is laid out as one verify request whose mask is causal;
a chunk's pieces in order, each one's KV in the cache before the next reads it: one stream). The decoding rows
then replay as if the step held them alone (the runner).

With --admission-decode-rows N the step can instead run as one plain-decoding replay (rows_as_decodes): each
prompt token is a one-row request of its own over the prompt's block table, its KV length ending at that token, so
the decode attention gives it exactly the causal view (every row of a layer writes its K/V before any row
attends), and the decoding rows follow. One forward instead of a forward per piece plus the decoders': on an H100
with the embedded model a piece's replay took ~1.5 ms of device time beside the decoders' 1.2 (docs/BENCHMARKS.md,
2026-12-07). Each such row reads its whole prefix, so a chunk goes this way only while its rows read at most
MAX_ROW_KEYS keys in all (a short prompt, not one past a long cached prefix).

One piece a replay, never several prompts in one: a prompt's rows then go through the same kernels whatever else
the step admits (the GEMM a bucket runs depends on its row count), so a seeded request samples the same tokens
alone and as choice 0 of n = 2 in bf16 too. Beyond MAX_REPLAYS replays a step runs eagerly: that many rows are
bound by their arithmetic more than by launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cuda_graphs import CudaGraphs
from engine.inputs import decode_rows, first_position, slot_range
from engine.plan import ScheduledSeq
from engine.staging import Staging
from ext.metadata import AttentionMetadata

MAX_REPLAYS = 8
MAX_ROW_KEYS = 16384  # keys a step's prompt chunks may read in all as one-row requests (a 128-token prompt: 8,256)


@dataclass(frozen=True)
class Piece:
    seq: int  # the chunk's index among the step's prompt chunks
    offset: int  # its first token's index inside the chunk
    length: int  # rows


def plan_replays(prompts: list[ScheduledSeq], graphs: CudaGraphs) -> list[Piece] | str:
    """The replays that compute these prompt chunks, one piece each, in order (a chunk's pieces one after the
    other), or why they cannot."""
    widest = max(graphs.prompt_widths, default=0)
    if not widest:
        return "no prompt graphs"
    replays = [Piece(i, offset, min(widest, s.num_new_tokens - offset))
               for i, s in enumerate(prompts) for offset in range(0, s.num_new_tokens, widest)]
    if len(replays) > MAX_REPLAYS:
        return f"prompt chunks beyond {MAX_REPLAYS} replays"
    return replays


@dataclass
class DecodeRows:
    """An admission step as one-row requests: the prompt chunks' tokens in order, then the decoding requests."""
    ids: list[int]  # host token ids (0 where the device feeds the token: `fed`)
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    seqs: list[ScheduledSeq]  # each row's sequence (its request's sampling parameters and output position)
    fed: list[int]  # rows whose token the step in flight samples (decoders scheduled ahead), in order
    sampled: list[int]  # the rows the step samples: each sampling prompt's last row, then the decoders'


def rows_as_decodes(prompts: list[ScheduledSeq], decoders: list[ScheduledSeq], block_size: int,
                    max_rows: int) -> DecodeRows | str:
    """The admission step's rows as one-row requests (module doc), or why not."""
    num_rows = sum(s.num_new_tokens for s in prompts) + len(decoders)
    if num_rows > max_rows:
        return f"{num_rows} rows past the largest plain bucket ({max_rows})"
    keys = sum(s.num_new_tokens * first_position(s) + s.num_new_tokens * (s.num_new_tokens + 1) // 2 for s in prompts)
    if keys > MAX_ROW_KEYS:
        return f"prompt rows reading {keys} keys (more than {MAX_ROW_KEYS})"
    rows = DecodeRows([], [], [], [], [], [], [], [])
    for s in prompts:
        req, start, n = s.request, first_position(s), s.num_new_tokens
        rows.ids += req.token_ids(start, start + n)
        rows.positions += range(start, start + n)
        rows.slots += slot_range(req.block_ids, block_size, start, n)
        rows.seq_lens += range(start + 1, start + n + 1)
        rows.tables += [req.block_ids] * n
        rows.seqs += [s] * n
        if s.sample:
            rows.sampled.append(len(rows.ids) - 1)
    first = len(rows.ids)
    ids, positions, slots, seq_lens = decode_rows(decoders, block_size)
    rows.ids += ids
    rows.positions += positions
    rows.slots += slots
    rows.seq_lens += seq_lens
    rows.tables += [s.request.block_ids for s in decoders]
    rows.seqs += decoders
    rows.fed = [first + i for i, s in enumerate(decoders) if s.num_ahead]
    rows.sampled += [first + i for i, s in enumerate(decoders) if s.sample]
    return rows


def row_layout(seqs: list[ScheduledSeq]) -> tuple[list[tuple[int, int]], int]:
    """(first row, rows) of each sequence laid out one after the other, and the rows in all."""
    rows, row = [], 0
    for s in seqs:
        rows.append((row, s.num_new_tokens))
        row += s.num_new_tokens
    return rows, row


def pick_rows(values: torch.Tensor, rows: list[int], stage: Staging) -> torch.Tensor:
    """values[rows]: a slice when the rows are consecutive (no index on the device), else one gather."""
    first = rows[0] if rows else 0
    if rows == list(range(first, first + len(rows))):
        return values[first:first + len(rows)]
    return values.index_select(0, stage(rows))


class Admissions:
    """Runs an admission step's prompt chunks through the prompt buckets' graphs."""

    def __init__(self, graphs: CudaGraphs):
        self.graphs = graphs
        widest = max(graphs.prompt_widths, default=1)
        # [widest, widest] causal visibility; a replay's mask is its top-left corner once per piece
        self.causal = torch.ones(widest, widest, dtype=torch.bool, device=graphs.device).tril()

    def run(self, prompts: list[ScheduledSeq], replays: list[Piece], stage: Staging
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The chunks' hidden rows [sum of their tokens, hidden] and captured layers' rows, chunk after chunk, each
        chunk's rows in order (what an eager forward of the chunks returns)."""
        outputs = [self._replay(prompts[p.seq], p, stage) for p in replays]  # each [piece rows, ...]
        if len(outputs) == 1:
            return outputs[0]
        hidden = torch.cat([h for h, _ in outputs])
        return hidden, [torch.cat(parts) for parts in zip(*(layers for _, layers in outputs))]

    def run_rows(self, prompts: list[ScheduledSeq], decoders: list[ScheduledSeq], ahead_ids: torch.Tensor | None,
                 stage: Staging, plain_graphs, fault_injection: bool = False
                 ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None] | str:
        """The step as one plain-decoding replay of one-row requests (rows_as_decodes): hidden and captured layers
        of every row (the chunks' then the decoders'), and the sampled rows' tokens from the bucket's sampling graph
        (engine/plain_graphs.py; None when its requests need the sampler); or why not. ahead_ids: the decoders'
        tokens the step in flight samples (those scheduled ahead, in order)."""
        graphs = self.graphs
        rows = rows_as_decodes(prompts, decoders, graphs.block_size, graphs.max_decode_rows)
        if isinstance(rows, str):
            return rows
        ids = rows.ids if ahead_ids is None else stage(rows.ids).index_copy(0, stage(rows.fed), ahead_ids)
        key = graphs.write_decode(ids, rows.positions, rows.slots, rows.seq_lens, rows.tables, stage, table_runs=True)
        if key is None:
            return f"no graph for {len(rows.ids)} rows"
        hidden, layers = graphs.replay_rows(key, len(rows.ids))
        tokens = plain_graphs.tokens(rows.seqs, key, stage, hidden, fault_injection) if plain_graphs else None
        return hidden, layers, pick_rows(tokens, rows.sampled, stage) if tokens is not None else None

    def _replay(self, seq: ScheduledSeq, piece: Piece, stage: Staging) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One piece as a request of its own: `piece.length` causal rows of the prompt bucket that holds them."""
        graphs, req, n = self.graphs, seq.request, piece.length
        start = first_position(seq) + piece.offset
        ids_d, positions_d, slots_d = stage.pack([req.token_ids(start, start + n), list(range(start, start + n)),
                                                  slot_range(req.block_ids, graphs.block_size, start, n)])
        seq_lens_d, table_d = stage.pack([[start + n], req.block_ids], torch.int32)
        meta = AttentionMetadata(
            positions=positions_d, slot_mapping=slots_d, query_start_loc=None, seq_lens=seq_lens_d,
            block_tables=table_d.view(1, -1), block_size=graphs.block_size, tree_mask=self.causal[:n, :n],
            query_lens_host=[n], seq_lens_host=[start + n])
        return graphs.run(ids_d, meta, 1, n, graphs.prompt_bucket(n))
