"""What one engine step hands back: per request that produced tokens or finished, its Delta (new tokens, text and
logprobs; when it finished, its queue time and accept lengths), and the step's StepStats for the metrics."""
from __future__ import annotations

import time

from engine.messages import Delta, StepStats
from engine.plan import StepPlan
from engine.request import Request, Status


def step_delta(req: Request, num_before: int, now: float) -> Delta | None:
    """The request's Delta since it had num_before output tokens, or None when it has nothing new and runs on (the
    caller releases a finished request's state)."""
    # (each attribute read once: at batch 64 this runs 64 times a step on the host's critical path)
    output, finished, text = req.output_token_ids, req.status is Status.FINISHED, req.text
    new = output[num_before:] if len(output) > num_before else []
    if not new and not finished:
        return None
    if new and req.first_token_time is None:
        req.first_token_time = time.monotonic()
    if finished and text is not None:
        text.finish()
    delta = Delta(req.request_id, new, finished, req.finish_reason,
                  req.output_logprobs[num_before:] if req.sampling.logprobs is not None else None,
                  len(req.prompt_token_ids), req.num_cached_tokens, text=text.take() if text is not None else "",
                  stop_reason=req.stop_reason)
    if finished:
        delta.queue_time = (req.first_scheduled_time or now) - req.arrival_time
        delta.accept_lengths = list(req.accept_lengths)
    return delta


def step_stats(plan: StepPlan, result, scheduler, kv_cache_usage: float, budgets, num_preemptions: int,
               num_constrained: int) -> StepStats:
    """The step's statistics (a StepPlan and its StepResult), with the scheduler's queues after it and what the
    adaptive budget's guard and reliability bins counted since the last step."""
    from ext import ops

    guard_checks, guard_plain = budgets.guard.take_outcomes()
    return StepStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), kv_cache_usage=kv_cache_usage,
        batch_size=len(plan.seqs), num_preemptions=num_preemptions, timings=result.timings,
        accept_lengths=result.accept_lengths, tree_nodes=result.tree_nodes,
        accepted_per_position=result.accepted_per_position, prefix_cache_queries=plan.prefix_cache_queries,
        prefix_cache_hits=plan.prefix_cache_hits, kernel_fallbacks=ops.take_reference_fallbacks(),
        spec_budgets=plan.spec_budgets, cuda_graph=result.cuda_graph, num_constrained_requests=num_constrained,
        num_grammar_pruned=result.num_grammar_pruned, draft_confidence=budgets.take_confidence_counts(),
        spec_guard_checks=guard_checks, spec_guard_plain=guard_plain, num_drafted=result.num_drafted,
        num_curve_drafts=result.num_curve_drafts, num_probes=budgets.take_probes())
