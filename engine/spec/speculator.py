"""The runner's DDTree half: for the requests the scheduler gave a tree budget, draft per-depth top-K
distributions, build the best-first trees, lay the trees out as verify rows, pick the target's token at every
row, walk, compact the accepted rows' KV into place, and keep the target features the drafter has not seen.

Per request and step (root = the last committed token, at position `start`, not yet in the target cache):
  verify rows j = 0..n-1 (root + drafted nodes) sit at logical KV positions start + j, rope positions
  start + depth[j]; after the walk accepted row acc[j] moves to logical position start + j, so the cache again
  holds a plain sequence of start + tau tokens, and tau tokens (accepted drafts + bonus) are emitted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import sampler
from engine.plan import ScheduledSeq
from engine.spec.drafter import DraftRequest
from ext import ops


@dataclass
class TreeBatch:
    seqs: list[ScheduledSeq]
    node_token_ids: torch.Tensor  # [N, B+1] root first, -1 padded
    parents: torch.Tensor  # [N, B+1]
    depths: torch.Tensor  # [N, B+1]
    num_nodes: list[int]  # rows per request (root + drafted nodes)
    visibility: torch.Tensor  # [N, B+1, B+1] bool
    max_depth: int


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
        logprobs, token_ids = self.drafter.propose(batch, top_k)  # [N, L, K]
        budgets = torch.tensor([s.spec_budget for s in seqs], dtype=torch.int64, device=logprobs.device)
        max_budget = max(s.spec_budget for s in seqs)
        built = ops.build_tree(logprobs, token_ids, budgets, max_budget)
        node_token_ids = built.node_token_ids.clone()
        node_token_ids[:, 0] = torch.tensor([s.request.all_token_ids[-1] for s in seqs], device=node_token_ids.device)
        return TreeBatch(seqs, node_token_ids, built.parents, built.depths, built.num_nodes.tolist(),
                         built.visibility, logprobs.shape[1])

    def verify_inputs(self, tree: TreeBatch, i: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Request i's verify rows: token ids, rope positions (start + depth), visibility [n, n]."""
        n, start = tree.num_nodes[i], tree.seqs[i].request.num_computed_tokens
        ids = tree.node_token_ids[i, :n].tolist()
        positions = (tree.depths[i, :n] + start).tolist()
        return ids, positions, tree.visibility[i, :n, :n]

    def target_tokens(self, tree: TreeBatch, i: int, logits: torch.Tensor) -> torch.Tensor:
        """The target's token after every verify row of request i; logits [n, vocab] fp32 -> [B+1] (padded)."""
        req = tree.seqs[i].request
        sp = req.sampling
        n = tree.num_nodes[i]
        out = torch.full((tree.node_token_ids.shape[1],), -1, dtype=torch.int64)
        if sp.greedy and not (sp.logit_bias or sp.presence_penalty or sp.frequency_penalty
                              or sp.repetition_penalty != 1.0):
            out[:n] = logits.argmax(-1)
            return out
        # per-row processing sees the path to the row as generated history, as plain decoding would
        parents, tokens = tree.parents[i].tolist(), tree.node_token_ids[i].tolist()
        for row in range(n):
            path, node = [], row
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            out[row] = sampler.choose(logits[row], req, req.output_token_ids + path[::-1])
        return out

    def accept(self, tree: TreeBatch, target_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """target_token_ids [N, B+1] -> (accepted rows [N, L+1], accept_len [N], bonus [N])."""
        num_nodes = torch.tensor(tree.num_nodes, dtype=torch.int64)
        return ops.tree_accept(target_token_ids, tree.node_token_ids, tree.parents, num_nodes, tree.max_depth)

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
