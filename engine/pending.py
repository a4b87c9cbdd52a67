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
    # a whole round's successors() of its trees, computed inside its graph: (roots, root positions), [N] each
    next_roots: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_tree_step(self) -> bool:
        """Every request of the step verified a tree (root-only ones included)."""
        return self.batch is not None and not self.plain

    @property
    def verifies_trees(self) -> bool:
        """A step in which some request verified drafts (beside a prompt's chunk too): how many tokens it emits is
        known on the device only (after any other decoding step, each request is exactly one token past its host
        state)."""
        return self.batch is not None and any(self.batch.budgets)

    @property
    def num_drafted(self) -> int:
        """Requests the drafter ran for in this step: trees' proposals, and curves for requests at budget 0."""
        return (sum(self.batch.drafted) if self.batch is not None else 0) + self._num_watched()

    @property
    def num_curve_drafts(self) -> int:
        """... of which curves only: watched requests, and root-only trees that drafted (no tree verified)."""
        batch = self.batch
        return self._num_watched() + (sum(d and not b for d, b in zip(batch.drafted, batch.budgets))
                                      if batch is not None else 0)

    def _num_watched(self) -> int:
        return len(self.watched[0]) if self.watched else 0

    def most_emitted(self) -> dict[int, int]:
        """id(request) -> the most tokens this step can emit for it (a tree's budget + 1; 1 when it samples a plain
        row: decoding, or a prompt's last chunk)."""
        most = {id(req): 1 for req, _ in self.sampling}
        if self.batch is not None:
            most.update({id(s.request): b + 1 for s, b in zip(self.batch.seqs, self.batch.budgets)})
        return most

    def successors(self, requests: list, stage: Staging
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a tree step launched ahead of this step's results, per request (each sampling in this step), on the
        device: the next root (the last token this step emits), its position, the number of tokens this step
        emits, each [len(requests)] int64, and the emitted tokens [len(requests), A] (-1 past that number). A
        tree emits its accepted drafts then the bonus from the root's position on; a plain row one sampled token,
        at the position after the request's host tokens (a decoding request is one token ahead of them, and a
        prompt's last chunk ends there)."""
        plain = None
        if self.sampling:
            asked = requests if self.batch is None else [req for req, _ in self.sampling]
            roots = self.sampled_tokens(asked, stage)
            starts = stage([r.num_tokens for r in asked])
            plain = (roots, starts, torch.ones_like(starts), roots[:, None])
            if self.batch is None:
                return plain
        walk, accept_len = self.walk, self.walk.accept_len
        if self.next_roots is not None:
            roots, starts = self.next_roots
        else:
            roots = walk.emitted.gather(1, (accept_len - 1)[:, None])[:, 0]
            starts = self.inputs.tree_starts + accept_len
        return self._per_request(requests, stage, (roots, starts, accept_len, walk.emitted), plain)

    def accepted_features(self, requests: list, stage: Staging) -> torch.Tensor:
        """[len(requests), A, F] the captured target features of each request's accepted rows (root first; rows
        past its accepted length are filler; a plain row's: its one row, A = 1), for a drafter fed by them
        drafting ahead of this step's results."""
        plain = None
        if self.sampling:
            where = {id(req): row for req, row in self.sampling}
            asked = requests if self.batch is None else [req for req, _ in self.sampling]
            plain = (self.features[stage([where[id(r)] for r in asked])][:, None],)
            if self.batch is None:
                return plain[0]
        nodes = self.walk.accepted_nodes.clamp(min=0)  # [N, A]
        num, width = nodes.shape[0], self.batch.width
        rows = self.inputs.tree_row0 + torch.arange(num, device=nodes.device)[:, None] * width + nodes
        return self._per_request(requests, stage, (self.features[rows],), plain)[0]

    def _per_request(self, requests: list, stage: Staging, values: tuple[torch.Tensor, ...],
                     plain: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """Rows of per-tree `values` (this step's tree order), and of a mixed step's `plain` ones (its sampled plain
        rows' order; a column each where the trees have A: padded with -1), in the order of `requests`."""
        seqs = self.batch.seqs
        if plain is None and len(requests) == len(seqs) and all(r is s.request for r, s in zip(requests, seqs)):
            return values
        where = {id(s.request): i for i, s in enumerate(seqs)}
        if plain is not None:
            where.update({id(req): len(seqs) + i for i, (req, _) in enumerate(self.sampling)})
            values = tuple(torch.cat([v, _widen(p, v.shape[1]) if v.dim() > 1 else p]) for v, p in zip(values, plain))
        index = stage([where[id(r)] for r in requests])
        return tuple(v[index] for v in values)

    def watch_inputs(self, watch: list[ScheduledSeq], plain: list[ScheduledSeq], input_ids: torch.Tensor,
                     stage: Staging, features: bool) -> tuple:
        """What a drafter drafting from the device needs for the watched requests of a plain step scheduled ahead
        of this one's results: their roots (the tokens fed, input_ids: one per request of `plain` scheduled ahead;
        [M]), root positions (one past their host tokens), one new token each, and with `features` (a drafter fed
        by target features) the row this step computed for each ([M, 1, F]: its features reach the host only with
        this step's results)."""
        where = {id(s): i for i, s in enumerate(s for s in plain if s.num_ahead)}  # its row in input_ids
        index = [where[id(s)] for s in watch]
        # every request watched (the aligned steps' interval drafts): the fed tokens as they are; each torch call
        # here is ~30-40 us of host time on an H100's host, in a step that launches ~30 of them for the drafts
        whole = index == list(range(input_ids.shape[0]))
        roots = input_ids if whole else input_ids[stage(index)]
        positions, num_new = stage.pack([[s.request.num_tokens for s in watch], [1] * len(watch)])
        feats = self.accepted_features([s.request for s in watch], stage) if features else None
        return roots, positions, num_new, feats, roots[:, None]

    def sampled_tokens(self, requests: list, stage: Staging) -> torch.Tensor:
        """[len(requests)] int64 on the device: the token this step samples for each of these requests (a plain
        decoding step's rows, or a root-only tree step's bonus tokens), for a step scheduled ahead of this one's
        results."""
        if self.batch is not None:  # root-only trees (an admission's prompts' first tokens beside them)
            plain = (self.out.tokens[:len(self.sampling)],) if self.sampling else None
            return self._per_request(requests, stage, (self.walk.emitted[:, 0],), plain)[0]
        if len(requests) <= len(self.sampling) and all(r is q for r, (q, _) in zip(requests, self.sampling)):
            return self.out.tokens[:len(requests)]  # the same requests in the same order (the usual case): a view
        where = {id(req): i for i, (req, _) in enumerate(self.sampling)}
        return self.out.tokens.index_select(0, stage([where[id(r)] for r in requests]))


def _widen(plain: torch.Tensor, columns: int) -> torch.Tensor:
    """[M, 1, ...] plain rows' values to [M, columns, ...], the columns past the first -1 (filler)."""
    out = plain.new_full((plain.shape[0], columns, *plain.shape[2:]), -1)
    out[:, :1] = plain
    return out
