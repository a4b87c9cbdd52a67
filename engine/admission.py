"""Admission steps as CUDA-graph replays. A step that computes prompt chunks beside decoding requests (under load
with real prompts, every admission) would run eagerly as one mixed forward, bound by its launches: 11.5 ms at
batch 64 with the embedded model on an H100, against 1.3 ms for a decoding step replayed. Here each prompt chunk
runs as causal pieces of at most the widest prompt width, each piece a replay of the prompt bucket that holds
it (engine/cuda_graphs.py: a chain is a tree, so a piece is laid out as one verify request whose mask is causal;
a chunk's pieces in order, each one's KV in the cache before the next reads it: one stream). The decoding rows
then replay as if the step held them alone (the runner).

One piece a replay, never several prompts in one: a prompt's rows then go through the same kernels whatever else
the step admits (the GEMM a bucket runs depends on its row count), so a seeded request samples the same tokens
alone and as choice 0 of n = 2 in bf16 too. Beyond MAX_REPLAYS replays a step runs eagerly: that many rows are
bound by their arithmetic more than by launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cuda_graphs import CudaGraphs
from engine.inputs import first_position, slot_range
from engine.plan import ScheduledSeq
from engine.staging import Staging
from ext.metadata import AttentionMetadata

MAX_REPLAYS = 8


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
