"""The runner's DDTree half: for the requests the scheduler gave a tree budget, draft per-depth top-K
distributions, build the best-first trees, lay the trees out as verify rows, pick the target's token at every
row, walk, compact the accepted rows' KV into place, and keep the target features the drafter has not seen.

Per request and step (root = the last committed token, at position `start`, not yet in the target cache):
  verify rows j = 0..n-1 (root + drafted nodes) sit at logical KV positions start + j, rope positions
  start + depth[j]; after the walk accepted row acc[j] moves to logical position start + j, so the cache again
  holds a plain sequence of start + tau tokens, and tau tokens (accepted drafts + bonus) are emitted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine import sampler
from engine.plan import ScheduledSeq
from engine.speculative import verify
from engine.speculative.drafter import DraftRequest
from engine.speculative.tree import DraftTree
from ext import ops


@dataclass
class TreeBatch:
    """The step's trees, one per scheduled request that got a tree budget, in plan order."""

    seqs: list[ScheduledSeq]
    tree: DraftTree  # [N, B+1] rows, root first
    num_rows: list[int]  # host copy of tree.num_nodes: verify rows per request (root + drafted nodes)
    draft_s: float = 0.0  # seconds in the drafter's propose()
    tree_build_s: float = 0.0  # seconds building the trees from its proposal


class Speculator:
    def __init__(self, drafter, max_budget: int, chain: bool = False):
        self.drafter, self.max_budget, self.chain = drafter, max_budget, chain
        self.pending_hidden: dict[str, list[torch.Tensor]] = {}  # request -> feature rows not yet drafted on

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layer_ids)

    def record_hidden(self, request_id: str, rows: torch.Tensor | None) -> None:
        """Target features [num_rows, num_layers * hidden] of tokens that just got KV, in position order."""
        if rows is not None and self.capture_layer_ids:
            self.pending_hidden.setdefault(request_id, []).append(rows)

    def release(self, request_id: str) -> None:
        self.pending_hidden.pop(request_id, None)
        self.drafter.release(request_id)

    def draft(self, seqs: list[ScheduledSeq]) -> TreeBatch:
        """Drafter proposal -> per-request best-first trees (budgets from the plan)."""
        batch = []
        for s in seqs:
            rows = self.pending_hidden.pop(s.request.request_id, None)
            batch.append(DraftRequest(s.request.request_id, s.request.all_token_ids,
                                      torch.cat(rows) if rows else None))
        top_k = 1 if self.chain else self.max_budget
        t0 = time.perf_counter()
        logprobs, token_ids = self.drafter.propose(batch, top_k)  # [N, L, K]
        t1 = time.perf_counter()
        budgets = torch.tensor([s.spec_budget for s in seqs], dtype=torch.int64, device=logprobs.device)
        roots = torch.tensor([s.request.all_token_ids[-1] for s in seqs], device=logprobs.device)
        tree = DraftTree.from_topk(logprobs, token_ids, roots, budgets, max(s.spec_budget for s in seqs))
        num_rows = tree.num_nodes.tolist()
        return TreeBatch(seqs, tree, num_rows, draft_s=t1 - t0, tree_build_s=time.perf_counter() - t1)

    def verify_inputs(self, batch: TreeBatch, i: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Request i's verify rows: token ids, rope positions (start + depth), visibility [n, n]."""
        n, start = batch.num_rows[i], batch.seqs[i].request.num_computed_tokens
        tree = batch.tree
        return tree.node_token_ids[i, :n].tolist(), (tree.depths[i, :n] + start).tolist(), tree.visibility[i, :n, :n]

    def target_tokens(self, batch: TreeBatch, i: int, logits: torch.Tensor) -> torch.Tensor:
        """The target's token after every verify row of request i; logits [n, vocab] fp32 -> [B+1] (padded).
        Each row goes through engine.sampler exactly as a plain decoding step would, with the path to the row
        as generated history, so the walk keeps plain sampling's distribution."""
        req, n, tree = batch.seqs[i].request, batch.num_rows[i], batch.tree
        sp = req.sampling
        out = torch.full((tree.num_rows,), -1, dtype=torch.int64)
        if sp.greedy and not (sp.logit_bias or sp.presence_penalty or sp.frequency_penalty
                              or sp.repetition_penalty != 1.0):
            out[:n] = verify.greedy_target_token_ids(logits)
            return out
        parents, tokens = tree.parents[i].tolist(), tree.node_token_ids[i].tolist()
        for row in range(n):
            path, node = [], row
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            out[row] = sampler.choose(logits[row], req, req.output_token_ids + path[::-1])
        return out

    @staticmethod
    def compact(slot_views: list[torch.Tensor], row_slots: list[list[int]], accepted: list[list[int]]) -> None:
        """Moves each request's accepted row acc[j] from slot row_slots[acc[j]] to row_slots[j]."""
        src, dst = [], []
        for slots, acc in zip(row_slots, accepted):
            for j, a in enumerate(acc):
                if a != j:  # the spine accepted in pop order needs no copy
                    src.append(slots[a])
                    dst.append(slots[j])
        if src:
            ops.kv_compact(slot_views, torch.tensor(src, dtype=torch.int64, device=slot_views[0].device),
                           torch.tensor(dst, dtype=torch.int64, device=slot_views[0].device))
