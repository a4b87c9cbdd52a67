"""Draft before choosing the budget: each decoding request's tree is drafted before the scheduler asks the adaptive
budget about it, so its budget is priced on the tree the step will verify rather than the one drafted a step ago.

Why: the budget reads a request's latest tree. Drafted curve-only at the end of step k, that tree continues the
context of step k's input; step k + 1 verifies a tree that continues one token more. For an n-gram drafter the
two differ most where it matters: a match whose prediction the sampled token broke is gone from the next tree, so
a strong tree drafted a step ago was a poor guess of the next (at T = 1 on the CPU, batch 1, 12-17 trees a
request of 128 tokens were verified on that guess and ~85% of them accepted nothing; drafted first, two).

When: the drafter works from committed tokens alone (no target features a step would have to hand over), its
drafts are cheap (BudgetController.cheap_draft: a few hundredths of a token of throughput a request, the n-gram
lookup; a dear drafter keeps drafting at budget 0 only now and then, after its step, as before), each step is
scheduled after the previous one's results reached the host (no asynchronous scheduling: a step planned ahead
does not know its input token yet), on one rank (the drafting time feeds the budget, and ranks must agree on it).
The runner's own curve-only drafts are then redundant and skipped; a step that verifies trees drafts them again
(deterministic: the same trees), which the budget counts as the tree's drafting cost."""
from __future__ import annotations

import time

import torch

from engine.plan import ScheduledSeq
from engine.speculative.confidence import confidence_rows


class DraftFirst:
    def __init__(self, speculator, budgets):
        self.speculator, self.budgets = speculator, budgets

    @staticmethod
    def applies(speculator, adaptive: bool, overlap: bool, tensor_parallel: bool) -> bool:
        return speculator is not None and adaptive and not overlap and not tensor_parallel \
            and not speculator.capture_layer_ids

    @torch.inference_mode()  # the speculator stages inputs in the runner's buffers (inference tensors on CUDA)
    def refresh(self, running: list) -> None:
        """While drafts are cheap: drafts every running request whose next step decodes (its KV holds all but its
        newest token) and hands each full-budget tree's node confidence to the adaptive budget."""
        if not self.budgets.cheap_draft() or not self.budgets.guard.allows_trees():
            return
        decoding = [r for r in running if not r.finished and r.num_computed_tokens == r.num_tokens - 1]
        if not decoding:
            return
        t0 = time.perf_counter()
        seqs = [ScheduledSeq(r, num_new_tokens=1, sample=True) for r in decoding]
        curve, _ = self.speculator.curves(seqs)
        rows = confidence_rows(curve.cpu().numpy())  # [N] of (q, bins)
        # the wall time, tree build and copy included: it runs before the step's clock starts
        self.budgets.observe_draft(len(decoding), time.perf_counter() - t0)
        for request, confidence in zip(decoding, rows):
            self.budgets.observe_curve(request.request_id, confidence)

    def watch(self, request_id: str, ahead: bool = False) -> bool:
        """The runner's watch: whether a decoding request at budget 0 drafts curve-only after its step. Not while
        drafts are cheap (the next step drafts it first); otherwise the budget's own interval."""
        return not self.budgets.cheap_draft() and self.budgets.should_draft(request_id, ahead=ahead)
