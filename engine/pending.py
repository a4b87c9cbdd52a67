"""PendingStep: a launched step, what the runner's collect() needs once its results reach the host, and what a
step launched ahead of those results reads from it on the device (its sampled or emitted tokens, root positions,
accepted rows' features)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inputs import StepInputs
from engine.plan import ScheduledSeq
from engine.sampler import SampleOutput
from engine.speculative.speculator import TreeBatch, Walk
from engine.staging import Staging
from engine.step_results import ResultCopy


@dataclass
class PendingStep:
    """A launched step: what collect() needs once its results reach the host."""

    plain: list[ScheduledSeq]
    batch: TreeBatch | None
    watched: tuple | None
    inputs: StepInputs
    sampling: list  # (request, row) per sampled plain row
    out: SampleOutput
    walk: Walk | None
    features: torch.Tensor | None
    graph_mode: str
    copy: ResultCopy
    t1: float
    t2: float

    @property
    def is_tree_step(self) -> bool:
        """Every request of the step verified a tree (root-only ones included)."""
        return self.batch is not None and not self.plain

    @property
    def verifies_trees(self) -> bool:
        """A tree step in which some request verified drafts: how many tokens it emits is known on the device
        only (after any other decoding step, each request is exactly one token past its host state)."""
        return self.is_tree_step and any(self.batch.budgets)

    def most_emitted(self) -> dict[int, int]:
        """id(request) -> the most tokens this step can emit for it (a tree's budget + 1; 1 when decoding)."""
        if not self.is_tree_step:
            return {id(req): 1 for req, _ in self.sampling}
        return {id(s.request): b + 1 for s, b in zip(self.batch.seqs, self.batch.budgets)}

    def successors(self, requests: list, stage: Staging
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a tree step launched ahead of this step's results, per request (each decoding in this step), on the
        device: the next root (the last token this step emits), its position, the number of tokens this step
        emits, each [len(requests)] int64, and the emitted tokens [len(requests), A] (-1 past that number). A
        tree step emits its accepted drafts then the bonus from the root's position on; a plain decoding step
        one sampled token, at the position after the request's host tokens (each is one token ahead of them)."""
        if not self.is_tree_step:
            roots = self.sampled_tokens(requests, stage)
            starts = stage([r.num_tokens for r in requests])
            return roots, starts, torch.ones_like(starts), roots[:, None]
        walk, starts = self.walk, self.inputs.tree_starts
        accept_len = walk.accept_len
        roots = walk.emitted.gather(1, (accept_len - 1)[:, None])[:, 0]
        return self._per_request(requests, stage, roots, starts + accept_len, accept_len, walk.emitted)

    def accepted_features(self, requests: list, stage: Staging) -> torch.Tensor:
        """[len(requests), A, F] the captured target features of each request's accepted rows (root first; rows
        past its accepted length are filler; a plain decoding step's: its one row, A = 1), for a drafter fed by
        them drafting ahead of this step's results."""
        if not self.is_tree_step:
            where = {id(req): row for req, row in self.sampling}
            return self.features[stage([where[id(r)] for r in requests])][:, None]
        nodes = self.walk.accepted_nodes.clamp(min=0)  # [N, A]
        num, width = nodes.shape[0], self.batch.width
        rows = self.inputs.tree_row0 + torch.arange(num, device=nodes.device)[:, None] * width + nodes
        return self._per_request(requests, stage, self.features[rows])[0]

    def _per_request(self, requests: list, stage: Staging, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of per-tree `values` (this step's tree order) in the order of `requests`."""
        seqs = self.batch.seqs
        if len(requests) == len(seqs) and all(r is s.request for r, s in zip(requests, seqs)):
            return values
        where = {id(s.request): i for i, s in enumerate(seqs)}
        index = stage([where[id(r)] for r in requests])
        return tuple(v[index] for v in values)

    def sampled_tokens(self, requests: list, stage: Staging) -> torch.Tensor:
        """[len(requests)] int64 on the device: the token this step samples for each of these requests (a plain
        decoding step's rows, or a root-only tree step's bonus tokens), for a step scheduled ahead of this one's
        results."""
        if self.is_tree_step:
            return self._per_request(requests, stage, self.walk.emitted[:, 0])[0]
        if len(requests) <= len(self.sampling) and all(r is q for r, (q, _) in zip(requests, self.sampling)):
            return self.out.tokens[:len(requests)]  # the same requests in the same order (the usual case): a view
        where = {id(req): i for i, (req, _) in enumerate(self.sampling)}
        return self.out.tokens.index_select(0, stage([where[id(r)] for r in requests]))
