"""Continuous batching: which requests run this step and with how many tokens, under a token budget and the
KV blocks available. Phase-free: every request catches its num_computed_tokens up to its known tokens, so
chunked prefill and decode share one loop. When blocks run out the newest running request is preempted by
recompute (its KV dropped, it re-queues at the front)."""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.plan import ScheduledSeq, StepPlan, StepResult
from engine.request import Request, Status


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 max_budget: int = 0, budget_of: Callable[[Request], int] | None = None,
                 width_of: Callable[[list[Request], list[int]], list[int]] | None = None,
                 uniform_of: Callable[[list[Request], list[int], list[int], bool], list[int]] | None = None):
        self.config, self.blocks, self.max_model_len = config, block_manager, max_model_len
        self.max_budget = max_budget  # tree nodes per request at low load (0 = no speculation)
        # each request's wanted tree budget this step (the adaptive controller), before the caps below
        self.budget_of = budget_of or (lambda request: max_budget)
        # the step's budgets at one padded width (the adaptive controller's harmonize); fill_trees: each tree then
        # verifies as many nodes as that width holds (one_width)
        self.width_of = width_of or (lambda requests, budgets: budgets)
        self.fill_trees = True
        # CUDA graphs: a step with trees lays out every decoding request at the step's width, so all of them
        # reserve its KV rows, and such a step's nodes are chosen for all of them at once (uniform_of: requests,
        # wanted budgets, caps, whether the step is scheduled after its predecessor's results -> verified nodes;
        # the adaptive controller's uniform; None: harmonize and fill)
        self.uniform_trees = False
        self.uniform_of = uniform_of
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.steps_seat_free = 0  # steps observed in a row with a free seat and a waiting request (admits)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admits(self) -> bool:
        """Whether a waiting request may take a seat now (fewer than max_num_seqs running): it joins the next
        step, scheduled ahead of its predecessor's results when that step could be (schedule_ahead, or
        schedule_ahead_trees beside trees). While every seat is taken the waiting requests cannot join and the
        running ones decode ahead. With --admission-wait-steps a seat is taken only once one has been free that
        many steps, or when nothing runs."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        return not self.running or self.steps_seat_free >= self.config.admission_wait_steps

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.finish(req, "abort")
                    return req
        return None

    def finish(self, request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        self.blocks.free(request)

    def preempt(self, request: Request) -> None:
        self.blocks.free(request)
        request.status, request.num_computed_tokens = Status.PREEMPTED, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def step_budget(self, num_running: int) -> int:
        """The most tree nodes a request may verify this step: the configured budget, shrinking as the batch
        grows so that trees take at most half of the step's token budget."""
        share = self.config.max_num_batched_tokens // (2 * max(1, num_running)) - 1
        return max(0, min(self.max_budget, share))

    def spec_budget(self, request: Request, step_budget: int) -> int:
        """Drafted nodes this request verifies: what the budget controller wants, never past budget_cap. 0 = plain
        decoding."""
        if step_budget == 0 or request.num_tokens - request.num_computed_tokens != 1:
            return 0  # a tree needs a decoding request: only its root (last token) lacks KV
        return max(0, min(self.budget_of(request), self.budget_cap(request, step_budget)))

    def budget_cap(self, request: Request, step_budget: int, ahead: int = 0) -> int:
        """The most nodes the request may verify: the step's cap, its remaining tokens and the context, `ahead`
        tokens further on (a step planned before its predecessor's results)."""
        remaining = request.sampling.max_tokens - len(request.output_token_ids) - ahead
        return min(step_budget, remaining - 1, self.max_model_len - request.num_tokens - ahead - 1)

    def one_width(self, requests: list[Request], budgets: list[int], caps: Callable[[], list[int]],
                  uniform: bool, synchronous: bool = False) -> tuple[list[int], list[int]]:
        """(chosen, verified) budgets of one step's decoding requests, whose trees are all laid out at the widest
        one's rows. uniform (CUDA graphs, every request decoding): the requests at budget 0 are laid out at that
        width too, so uniform_of prices the width for all of them and fills every request whose nodes pay for
        their drafting. Otherwise the budgets are harmonized to the width that pays (width_of), then each
        tree verifies as many nodes as that width holds within its own cap (fill_trees: the rows are paid
        anyway). The adaptive budget learns from the nodes a request chose (all of them when it chose none).
        caps: the requests' budget_cap, asked only when needed. synchronous: the step is scheduled after its
        predecessor's results (schedule(), not a step planned ahead)."""
        def differ(values: list[int]) -> bool:
            return len({b for b in values if b}) > 1

        if uniform and self.uniform_of is not None:
            if not any(budgets):
                return budgets, budgets
            verified = self.uniform_of(requests, budgets, caps(), synchronous)
            # a request that wanted no tree but fills this one learns from all of it, as from a probe (else a
            # request the record rates middling would be drafted for at every tree step and never re-rated)
            return [min(b, v) if b else v for b, v in zip(budgets, verified)], verified
        if any(budgets):  # one width, and trees only when they pay the step's fixed cost (width_of)
            budgets = self.width_of(requests, budgets)
        if not (self.fill_trees and differ(budgets)):
            return budgets, budgets
        width = max(budgets)
        return budgets, [max(b, min(width, cap)) if b else 0 for b, cap in zip(budgets, caps())]

    def wants_trees(self, requests: list[Request], wanted: list[int]) -> bool:
        """Whether a decoding step of these requests, each one token past its host state (planned ahead of its
        predecessor's results), would verify any tree: their budgets (wanted, the adaptive budget's dry answers)
        capped and put to one width as schedule() does. A request's own budget may want a tree that the step's
        width does not pay for (under graphs every request pays it); such a step is plain, and may as well run
        ahead."""
        if not any(b > 0 for b in wanted):
            return False  # no request wants a tree: its caps need not be worked out
        step_budget = self.step_budget(len(self.running))
        caps = [self.budget_cap(r, step_budget, ahead=1) for r in requests]
        budgets = [max(0, min(b, cap)) for b, cap in zip(wanted, caps)]
        return any(budgets) and any(self.one_width(requests, budgets, lambda: caps, self.uniform_trees)[1])

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        admits = self.admits()
        step_budget = self.step_budget(len(self.running) + admits)
        # every tree of the step is padded to one width: decide the budgets first, then reserve that width. Under
        # CUDA graphs they are chosen for all decoding requests at once (uniform_of), in an admission step too: the
        # runner replays such a step's trees as one graph beside its prompt chunks' pieces (engine/admission.py),
        # and a synchronous step's trees are priced at what such steps measured
        uniform = self.uniform_trees and all(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        chosen, verified = self.one_width(self.running, [self.spec_budget(r, step_budget) for r in self.running],
                                          lambda: [self.budget_cap(r, step_budget) for r in self.running], uniform,
                                          synchronous=True)
        chosen = {id(r): b for r, b in zip(self.running, chosen)}
        wanted = {id(r): b for r, b in zip(self.running, verified)}
        plan.spec_budgets = [wanted[id(r)] for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        step_budget = max(wanted.values(), default=0)
        scheduled: list[Request] = []
        # 1. requests already running, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            sample = req.num_computed_tokens + n == req.num_tokens
            nodes = wanted[id(req)] if sample else 0
            decoding = sample and n == 1 and self.uniform_trees
            lookahead = step_budget if nodes or decoding else 0
            while not self.blocks.allocate(req, req.num_computed_tokens + n + lookahead):
                victim = self.running.pop()
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            else:
                own = chosen[id(req)] if nodes else None
                plan.seqs.append(ScheduledSeq(req, n, sample, nodes, chosen_budget=own))
                scheduled.append(req)
                budget -= n + lookahead
                i += 1
        # 2. admit waiting requests while seats, budget and blocks allow
        if admits:
            self._admit(plan, budget, step_budget)
        return plan

    def _admit(self, plan: StepPlan, budget: int, step_budget: int) -> None:
        """Admits waiting requests into `plan` while seats, the token budget and blocks allow: each feeds its
        prompt's next chunk (its KV from the prefix cache where it can)."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.blocks.match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            sample = req.num_computed_tokens + n == req.num_tokens
            nodes = self.spec_budget(req, step_budget) if sample else 0
            lookahead = step_budget if nodes else 0
            if not self.blocks.allocate(req, req.num_computed_tokens + n + lookahead):
                self.blocks.free(req)  # give the adopted prefix blocks back; retry next step
                req.num_computed_tokens = 0
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
                plan.prefix_cache_queries += req.num_prompt_tokens
                plan.prefix_cache_hits += cached
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()  # queue time ends (metrics)
            self.running.append(req)
            plan.seqs.append(ScheduledSeq(req, n, sample, nodes))
            budget -= n + lookahead

    def schedule_ahead(self, previous: StepPlan) -> StepPlan | str:
        """Asynchronous scheduling: the next step, planned before `previous`'s results reach the host. Only when
        `previous` sampled every running request without a tree (decoding, or the last chunk of its prompt): each
        request then decodes the token `previous` samples for it (num_ahead = 1; that token is fed from the
        device), and waiting requests that may take a seat (admits) join with their prompts' chunks, which the
        host knows (an admission step, CUDA graphs replaying it beside the decodes: engine/admission.py).
        Requests that certainly finish with that token (max_tokens, the context length) are left out. When
        this does not apply or blocks run out, why not (the next step is then scheduled after the results)."""
        admits = self.admits()
        # a request whose prompt's last chunk ran in `previous` samples its first token there: it decodes like the
        # others (engine.inputs.first_position); one mid-prompt has no token to feed
        decoding = {id(s.request) for s in previous.seqs if s.sample and not s.spec_budget}
        if any(id(r) not in decoding for r in self.running):
            return "after a prefill or tree step"
        plan = StepPlan()
        block_size, max_model_len = self.blocks.block_size, self.max_model_len
        seqs, finished = plan.seqs, Status.FINISHED
        for s in previous.seqs:
            req = s.request
            if req.status is finished:
                continue
            num_output = len(req.output_token_ids) + 1  # with the token `previous` samples
            num_tokens = len(req.prompt_token_ids) + num_output  # ... and the one this step feeds
            if num_output >= req.sampling.max_tokens or num_tokens >= max_model_len:
                continue
            # KV for the in-flight token (a new block once every block_size steps)
            if num_tokens > len(req.block_ids) * block_size and not self.blocks.allocate(req, num_tokens):
                return "KV blocks"
            seqs.append(ScheduledSeq(req, 1, True, 0, num_ahead=1))
        plan.spec_budgets = [0] * len(plan.seqs)
        if admits:
            self._admit(plan, self.config.max_num_batched_tokens - len(plan.seqs), 0)
        return plan if plan.seqs else "every request finishes"

    def schedule_ahead_trees(self, previous: StepPlan, budget_of: Callable[[Request], int],
                             after_prompts: bool = True) -> StepPlan | str:
        """Asynchronous scheduling of a tree step: the next step, planned before `previous`'s results reach the
        host, when `previous` sampled every running request (a tree step, root-only trees included, a plain
        decoding step, either beside prompts' last chunks: after_prompts, which a drafter fed by the target's
        features cannot draft from, their features still on the device). A request then lies up to its previous
        budget + 1 tokens past its host state (a prompt's last chunk: 1 past the prompt), so its KV is reserved
        for the longest case, its budget (budget_of) is capped as if it had advanced that far (0 when it may reach
        max_tokens with `previous`'s tokens), and a request that may reach the context's end is left out; budgets
        that differ are harmonized and filled to one width (one_width) as in schedule(). When no request wants a
        tree after a step that verified one, every request gets a root-only tree: a plain decoding step whose
        roots and positions come from the device (so leaving trees never waits for the host); after a step of
        known lengths the plain step (schedule_ahead) serves instead. Waiting requests that may take a seat
        (admits) join after the trees with their prompts' chunks, as in schedule_ahead (the runner computes them
        before the verify rows). Why not, when this does not apply, blocks run out or no request wants a tree."""
        admits = self.admits()
        sampled = {id(s.request) for s in previous.seqs if s.sample and (s.num_new_tokens == 1 or after_prompts)}
        if any(id(r) not in sampled for r in self.running):
            return "a request not decoding in the previous step"
        step_budget = self.step_budget(len(self.running))
        budgets: list[tuple[Request, int, int, int]] = []  # (request, budget, most tokens `previous` emits, cap)
        for s in previous.seqs:
            req = s.request
            if req.finished:
                continue
            most = s.spec_budget + 1
            if self.max_model_len - req.num_tokens - most <= 0:
                continue  # it may reach the context's end with previous's tokens: no row may go past it
            # one that may reach max_tokens rides at budget 0: if it did, the host drops what this step makes for
            # it (as for a stop token), and if not, the step after this one need not wait for the host
            cap = max(0, self.budget_cap(req, step_budget, ahead=most))
            budgets.append((req, min(budget_of(req), cap), most, cap))
        if not budgets:
            return "every request may finish"
        chosen, wanted = self.one_width([r for r, _, _, _ in budgets], [b for _, b, _, _ in budgets],
                                        lambda: [cap for _, _, _, cap in budgets], self.uniform_trees)
        width = max(wanted) + 1
        if width == 1 and not any(s.spec_budget for s in previous.seqs):
            return "no tree wanted"
        plan = StepPlan()
        for (req, _, most, _), budget, own in zip(budgets, wanted, chosen):
            # (the host has not applied `previous`: its root lacks KV, or the prompt's last chunk ends there)
            if not self.blocks.allocate(req, req.num_tokens - 1 + most + width):
                return "KV blocks"
            plan.seqs.append(ScheduledSeq(req, 1, True, budget, root_on_device=True, chosen_budget=own))
        plan.spec_budgets = wanted
        if admits:  # their chunks replay before the trees' verify rows (engine/runner.py)
            self._admit(plan, self.config.max_num_batched_tokens - width * len(plan.seqs), 0)
        return plan

    def update(self, plan: StepPlan, result: StepResult, in_flight: StepPlan | None = None) -> list[Request]:
        """Applies a step's result; returns the requests that finished this step. Tokens are appended before
        the prefix cache registers the blocks they fill (a verify step's accepted tokens included). in_flight:
        the step launched ahead of this one's results (its requests keep the KV rows it writes)."""
        busy = {id(s.request) for s in in_flight.seqs} if in_flight is not None else set()
        seat_free = bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        self.steps_seat_free = self.steps_seat_free + 1 if seat_free else 0
        finished = []
        new_token_ids, accepted_rows, logprobs = result.new_token_ids, result.accepted_rows, result.logprobs
        for s in plan.seqs:
            req = s.request
            if req.status is Status.FINISHED:  # aborted while the step ran
                continue
            rid = req.request_id
            new_ids = new_token_ids.get(rid, [])
            accepted = accepted_rows.get(rid) if accepted_rows else None
            req.num_computed_tokens += s.num_new_tokens
            if accepted is not None:
                req.num_computed_tokens += len(accepted)
                req.accept_lengths.append(len(new_ids))
            reason = self._append(req, new_ids, logprobs.get(rid) if logprobs else None)
            self.blocks.commit(req)
            if reason:
                self.running.remove(req)
                self.finish(req, reason)
                finished.append(req)
            elif s.spec_budget and id(req) not in busy:
                self.blocks.trim(req, req.num_tokens)  # hand back the rejected tree rows' blocks
        return finished

    def _append(self, req: Request, new_ids: list[int], logprobs: list | None) -> str | None:
        """Appends a step's tokens up to the first one that stops the request; returns why it stops, or None.
        Without stop strings or a grammar the step's tokens are scanned first and detokenized in one call (a
        tree step commits up to depth + 1 tokens per request; per-token detokenization dominated its host
        time at batch 64)."""
        if req.constraint is None and (req.text is None or not req.text.has_stop_strings):
            kept, reason = self._first_stop(req, new_ids)
            req.output_token_ids.extend(new_ids[:kept])
            if logprobs is not None:
                req.output_logprobs.extend(logprobs[:kept])
            if req.text is not None and kept:
                req.text.push(new_ids[:kept])
            return reason
        reason = None
        for j, token in enumerate(new_ids):
            req.output_token_ids.append(token)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[j])
            reason = self.stop_reason(req, token)
            if req.constraint is not None and not reason and not req.constraint.commit(token):
                reason = "abort"  # the grammar refused a token it had allowed (logged): end, never emit junk
            if reason:
                break
        return reason

    def _first_stop(self, req: Request, new_ids: list[int]) -> tuple[int, str | None]:
        """(how many of a step's tokens `req` keeps, why it stops after the last of them or None), stop strings
        aside: _token_stop token by token, scanning only when a stop token is among them."""
        num_out = len(req.output_token_ids)
        num_tokens = len(req.prompt_token_ids) + num_out
        # the first token (1-based) at which the request reaches max_tokens or the context
        at_length = req.sampling.max_tokens - num_out
        if self.max_model_len - num_tokens < at_length:
            at_length = self.max_model_len - num_tokens
        at_length = at_length if at_length > 1 else 1
        stops = req.stop_ids
        if stops and not stops.isdisjoint(new_ids):
            for j, token in enumerate(new_ids[:at_length], 1):
                if token in stops:
                    reason = self._token_stop(req, token, num_out + j, num_tokens + j)
                    if reason:
                        return j, reason
        if at_length <= len(new_ids):
            return at_length, "length"
        return len(new_ids), None

    def stop_reason(self, req: Request, token: int) -> str | None:
        """Why `req` stops after its newest token `token`, or None. Sets req.stop_reason (the stop token id or
        stop string); the request's text (when it detokenizes) takes the token here, so a stop string ending
        inside a multi-token step cuts the output right after the token that completed it."""
        if req.text is not None:
            matched = req.text.push(token)
            if matched.stopped:
                req.stop_reason = matched.matched_stop
                return "stop"
        return self._token_stop(req, token, len(req.output_token_ids), req.num_tokens)

    def _token_stop(self, req: Request, token: int, num_out: int, num_tokens: int) -> str | None:
        """Why `req` stops once `token` is its num_out-th output token (num_tokens in all), stop strings aside."""
        sp = req.sampling
        if num_out >= sp.min_tokens:
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if token in req.eos_token_ids and not sp.ignore_eos:
                return "stop"
        if num_out >= sp.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None
