"""Asynchronous scheduling: the step after a launched one, planned and launched before that step's results are
read (EngineCore.step), so the host's bookkeeping of step k runs while the device computes step k+1. Two kinds:
  - a plain decoding step after a step that sampled every request without a tree (plain decoding, a root-only
    tree step, or a prompt's last chunk): each request feeds the token the previous step samples for it, gathered
    on the device, and waiting requests that may take a seat join with their prompts' chunks (an admission:
    engine.scheduler.schedule_ahead);
  - a tree step after any step that sampled every request (decoding, with or without trees, beside prompts' last
    chunks too: an admission), with a drafter that drafts from the device (Speculator.cannot_draft_ahead) and
    under CUDA graphs (an eager step plans attention from exact host lengths): each request's root, root
    position and sampling offset come from the previous step's results on the device, its KV is reserved for
    the longest case (engine.scheduler.schedule_ahead_trees), the drafter is fed the emitted tokens (or
    accepted rows) from the device. When no request wants a tree after a step that verified one, the step is
    made of root-only trees: plain decoding whose positions come from the device. So neither entering trees nor
    leaving them waits for the host. Waiting requests that may take a seat join it too, their prompts' chunks
    computed before the trees' verify rows.
Requests whose sampling needs the newest token on the host (a grammar, penalties) never run ahead; when the
next step cannot run ahead, `why_not` says why (StepStats.scheduling)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.plan import StepPlan
from engine.pending import PendingStep
from engine.sampler import RequestFault, needs_penalty


def trees_blocked(speculator, runner) -> str | None:
    """Why no tree step can be launched ahead of its predecessor's results in this engine, or None."""
    if speculator is None:
        return "no speculation"
    why = speculator.cannot_draft_ahead()
    if why is None and runner.graphs is None:
        why = "no CUDA graphs"
    return why


@dataclass
class Launched:
    """A step on its way: its plan, the runner's pending step, and what its statistics need."""

    plan: StepPlan
    step: PendingStep
    schedule_time: float
    preemptions_before: int
    t_launch: float
    scheduling: str = ""  # StepStats.scheduling of this step
    next_scheduling: str = ""  # ... of the step scheduled after it, when that one could not run ahead


class AheadLauncher:
    def __init__(self, scheduler, runner, speculator, budgets):
        self.scheduler, self.runner, self.speculator, self.budgets = scheduler, runner, speculator, budgets
        self.why_not = ""  # why the last step could not be followed by one launched ahead

    def launch(self, current: Launched) -> Launched | None:
        """The step after `current`, launched before `current`'s results are read, or None (why_not says why)."""
        self.why_not = "grammar or penalties"
        if any(s.request.constraint is not None or needs_penalty(s.request) for s in current.plan.seqs):
            return None
        return self.trees(current) if current.step.verifies_trees else self.plain(current)

    def plain(self, current: Launched) -> Launched | None:
        """After a step that left every request one token past its host state: plain decoding of the same
        requests, or the tree step when one is wanted (and trees can run ahead: trees_blocked). A request at
        budget 0 that wants a draft needs its newest token on the host unless the drafter drafts from the device
        (then it drafts in the plain step, from the token fed from the device)."""
        budgets = self.budgets if self.speculator is not None and self.budgets.enabled else None
        if budgets is None:
            return self._plain(current, None, False)
        with budgets.planning_after(False):
            return self._plain(current, budgets, self.speculator.cannot_draft_ahead() is None)

    def _plain(self, current: Launched, budgets, watch_ahead: bool) -> Launched | None:
        if self.speculator is not None:
            requests = [s.request for s in current.plan.seqs if not s.request.finished]
            request_ids = [r.request_id for r in requests]
            if budgets is not None and not watch_ahead and any(budgets.drafts_of(request_ids, dry=True, ahead=True)):
                self.why_not = "a draft wanted"
                return None
            # (adaptive budgets off: every request wants its whole tree, after a prompt its first)
            wanted = self.budgets.budgets_of(request_ids, dry=True, ahead=True)
            if self.scheduler.wants_trees(requests, wanted):
                blocked = trees_blocked(self.speculator, self.runner)
                if blocked is not None:
                    self.why_not = f"a tree wanted: {blocked}"
                    return None
                return self._trees(current, budgets)
        t0 = time.perf_counter()
        plan = self.scheduler.schedule_ahead(current.plan)
        if isinstance(plan, str):
            self.why_not = plan
            return None
        if budgets is not None:  # this step counts for the adaptive budget as a plain one at budget 0
            # each request's budget is counted before its draft (a tree chosen resets its drafting interval); the
            # requests it admits are asked once they decode, as in a synchronous admission
            decoding = [s for s in plan.seqs if s.num_ahead]
            request_ids = [s.request.request_id for s in decoding]
            budgets.count_plain(request_ids)
            # a drafter fed by target features drafts a request just past its prompt once the prompt's features
            # reached the host (the step in flight computes them)
            features = bool(self.speculator.capture_layer_ids)
            for s, drafts in zip(decoding, budgets.drafts_of(request_ids, ahead=True)):
                req = s.request
                s.watched = drafts and watch_ahead and not (features and req.num_computed_tokens + 1 < req.num_tokens)
        return self._launch(plan, current, t0)

    def trees(self, current: Launched) -> Launched | None:
        """The step after `current` (a step that verified trees, beside a prompt's chunk too): a tree step, root-only
        when no tree is wanted."""
        why = trees_blocked(self.speculator, self.runner)
        if why is not None:
            self.why_not = why
            return None
        budgets = self.budgets if self.budgets.enabled else None
        if budgets is None:
            return self._trees(current, None)
        with budgets.planning_after(True):
            return self._trees(current, budgets)

    def _trees(self, current: Launched, budgets) -> Launched | None:
        t0 = time.perf_counter()
        dry = (lambda r: budgets.budget(r.request_id, dry=True, ahead=True)) if budgets else (lambda r: 10 ** 9)
        if budgets is not None:  # (the scheduler asks them one by one)
            budgets.value_step([s.request.request_id for s in current.plan.seqs if not s.request.finished], True)
        # a drafter fed by the target's features has not seen a prompt whose last chunk is in flight
        after_prompts = not self.speculator.capture_layer_ids
        plan = self.scheduler.schedule_ahead_trees(current.plan, dry, after_prompts)
        if isinstance(plan, str):
            self.why_not = plan
            return None
        if self.runner.graphs.bucket(len(plan.spec_budgets), max(plan.spec_budgets) + 1) is None:  # (the trees)
            self.why_not = "no graph for the tree step"
            return None
        if budgets is not None:  # counted now (the same answers as the dry run: the same clock)
            for s in plan.seqs[:len(plan.spec_budgets)]:  # (those it admits are asked once they decode)
                budgets.budget(s.request.request_id, ahead=True)
        return self._launch(plan, current, t0)

    def _launch(self, plan: StepPlan, current: Launched, t0: float) -> Launched | None:
        t_launch = time.perf_counter()
        try:
            step = self.runner.launch(plan, after=current.step)
        except RequestFault:
            self.why_not = "a request failed"
            return None  # the next step, scheduled as usual, meets the fault again and fails its request
        return Launched(plan, step, t_launch - t0, self.scheduler.num_preemptions, t_launch, scheduling="ahead")
