"""Admission steps as CUDA-graph replays. A step that computes prompt chunks beside decoding requests (under load
with real prompts, every admission) would run eagerly as one mixed forward, bound by its launches: 11-15 ms at
batch 64 with the embedded model on an H100, against 1.3 ms for a decoding step replayed. Here the prompt chunks
run as causal pieces in the prompt buckets' graphs (engine/cuda_graphs.py: a chain is a tree, so a piece is laid
out as a verify request whose mask is causal), pieces of the same round sharing a replay (up to PROMPT_SEQS of
them), a chunk longer than the widest prompt width in several rounds (each round's KV is in the cache before
the next reads it: one stream). The decoding rows then replay as if the step held them alone (the runner). Rows
of a piece past its length feed token 0, write no KV (slot -1) and are never read.

Beyond MAX_REPLAYS replays a step runs eagerly: a chunk that long is bound by its arithmetic, not by launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cuda_graphs import PROMPT_SEQS, CudaGraphs
from engine.inputs import first_position, slot_range
from engine.plan import ScheduledSeq
from engine.staging import Staging
from ext.metadata import AttentionMetadata, flat_block_table

MAX_REPLAYS = 4


@dataclass(frozen=True)
class Piece:
    seq: int  # the chunk's index among the step's prompt chunks
    offset: int  # its first token's index inside the chunk
    length: int  # rows


def plan_replays(prompts: list[ScheduledSeq], graphs: CudaGraphs) -> list[list[Piece]] | str:
    """The replays that compute these prompt chunks, in order (each chunk's piece j in a replay after its piece
    j - 1), or why they cannot."""
    widest = max(graphs.prompt_widths, default=0)
    if not widest:
        return "no prompt graphs"
    rounds: list[list[Piece]] = []
    for i, s in enumerate(prompts):
        for j, offset in enumerate(range(0, s.num_new_tokens, widest)):
            if j == len(rounds):
                rounds.append([])
            rounds[j].append(Piece(i, offset, min(widest, s.num_new_tokens - offset)))
    replays: list[list[Piece]] = []
    for pieces in rounds:  # a round's pieces, as many a replay as a captured bucket holds
        for p in pieces:
            group = replays[-1] if replays and replays[-1][0].offset == p.offset else None
            if group and len(group) < PROMPT_SEQS and \
                    graphs.prompt_bucket(len(group) + 1, max(p.length, *(q.length for q in group))) is not None:
                group.append(p)
            elif graphs.prompt_bucket(1, p.length) is None:
                return "no prompt graph for the step's pieces"
            else:
                replays.append([p])
    if len(replays) > MAX_REPLAYS:
        return f"prompt chunks beyond {MAX_REPLAYS} replays"
    return replays


class Admissions:
    """Runs an admission step's prompt chunks through the prompt buckets' graphs."""

    def __init__(self, graphs: CudaGraphs):
        self.graphs = graphs
        widest = max(graphs.prompt_widths, default=1)
        # [widest, widest] causal visibility; a replay's mask is its top-left corner once per piece
        self.causal = torch.ones(widest, widest, dtype=torch.bool, device=graphs.device).tril()

    def run(self, prompts: list[ScheduledSeq], replays: list[list[Piece]], stage: Staging
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The chunks' hidden rows [sum of their tokens, hidden] and captured layers' rows, chunk after chunk, each
        chunk's rows in order (what an eager forward of the chunks returns)."""
        outputs, where = [], {}  # where: (chunk, offset) -> (first row of that piece in the replays' outputs, rows)
        row0 = 0
        for pieces in replays:
            width = max(p.length for p in pieces)
            outputs.append(self._replay(prompts, pieces, width, stage))
            for k, p in enumerate(pieces):
                where[p.seq, p.offset] = (row0 + k * width, p.length)
            row0 += len(pieces) * width
        order = [row for _, (first, length) in sorted(where.items()) for row in range(first, first + length)]
        index = stage(order)
        hidden = torch.cat([h for h, _ in outputs]) if len(outputs) > 1 else outputs[0][0]
        layers = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*(ls for _, ls in outputs))]
        return hidden.index_select(0, index), [c.index_select(0, index) for c in layers]

    def _replay(self, prompts: list[ScheduledSeq], pieces: list[Piece], width: int, stage: Staging
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One replay: each piece a request of `width` causal rows (its rows past its length padding)."""
        graphs, block_size = self.graphs, self.graphs.block_size
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for p in pieces:
            req = prompts[p.seq].request
            start = first_position(prompts[p.seq]) + p.offset
            pad = width - p.length
            ids += req.token_ids(start, start + p.length) + [0] * pad
            positions += list(range(start, start + p.length)) + [start + p.length - 1] * pad
            slots += slot_range(req.block_ids, block_size, start, p.length) + [-1] * pad
            seq_lens.append(start + width)
            tables.append(req.block_ids)
        n = len(pieces)
        table, num_cols = flat_block_table(tables)
        ids_d, positions_d, slots_d = stage.pack([ids, positions, slots])
        seq_lens_d, table_d = stage.pack([seq_lens, table], torch.int32)
        meta = AttentionMetadata(
            positions=positions_d, slot_mapping=slots_d, query_start_loc=None, seq_lens=seq_lens_d,
            block_tables=table_d.view(n, num_cols), block_size=block_size,
            tree_mask=self.causal[:width, :width].repeat(n, 1), query_lens_host=[width] * n, seq_lens_host=seq_lens)
        return graphs.run(ids_d, meta, n, width, graphs.prompt_bucket(n, width))
