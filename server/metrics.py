"""Prometheus metrics of the server: every metric name, label and bucket lives here.

One `Metrics` object owns its own CollectorRegistry (no process-global state, so tests and several apps in
one process do not collide). Names follow vLLM's (prefix `ddtree:` instead of `vllm:`) so existing
dashboards and PromQL recipes carry over; every series has a `model_name` label.

Inputs are plain numbers. The engine reports a step as an engine.messages.StepStats (or a dict with the same
keys); the front end reports each request's tokens as they arrive and a finished request as a `RequestStats`. PromQL recipes (tree speculation):
  mean accepted tokens per step = rate(spec_decode_num_accepted_tokens_total) / rate(spec_decode_num_drafts_total) + 1
  acceptance at depth d          = rate(..._per_pos_total{position="d-1"}) / rate(spec_decode_num_drafts_total)
With a tree, draft tokens are tree nodes, so accepted / draft_tokens is far below a chain's acceptance rate
for the same quality of drafter and must not be compared across methods.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.messages import StepStats

PREFIX = "ddtree:"
PHASES = ("schedule", "draft", "tree_build", "verify", "accept")  # pre-created; other phase names also record
FINISHED_REASONS = ("stop", "length", "abort")

REQUEST_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                           7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                         0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 60.0)
STEP_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                     0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ACCEPT_LENGTH_BUCKETS = tuple(float(i) for i in range(1, 17)) + (20.0, 24.0, 32.0)
TREE_NODES_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
BUDGET_BUCKETS = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)


@dataclass
class RequestStats:
    """One finished request, measured by whoever sees it finish (times in seconds; None = not observed)."""
    finished_reason: str  # stop | length | abort (anything else is recorded under its own label)
    queue_time: Optional[float] = None  # arrival -> first scheduled
    time_to_first_token: Optional[float] = None  # arrival -> first output token
    e2e_latency: Optional[float] = None  # arrival -> finished
    # each output emission after the first: (seconds since the previous emission, tokens it carried)
    token_intervals: Sequence[tuple[float, int]] = ()


class _WithoutCreated:
    """A view of a registry without the `*_created` timestamp series that prometheus_client adds to every
    counter and histogram; they double the scrape and no dashboard reads them. (disable_created_metrics()
    would do the same, but process-wide.)"""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def _get(stats: Any, name: str, default: Any) -> Any:
    if isinstance(stats, Mapping):
        return stats.get(name, default)
    return getattr(stats, name, default)


class Metrics:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, m + list(labels), registry=r)  # exposed as <name>_total

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, m + list(labels), buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests holding KV in the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.").labels(model_name)
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ["finished_reason"])
        self.num_preemptions = counter("num_preemptions", "Recompute preemptions.").labels(model_name)
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Draft trees verified.").labels(model_name)
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                             "Draft tokens (tree nodes) verified.").labels(model_name)
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted (bonus tokens excluded).").labels(model_name)
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each tree depth (position 0 = depth 1).",
                                             ["position"])
        self.spec_accepted_by_confidence = counter(
            "spec_decode_accepted_by_confidence", "Verified draft-tree nodes that were accepted, by the drafter's "
            "probability for the node (confidence = the bin's lowest probability; bins halve).", ["confidence"])
        self.spec_probability_by_confidence = counter(
            "spec_decode_draft_probability_by_confidence", "Sum of the drafter's probabilities of the verified "
            "draft-tree nodes, by the same bins: accepted / this is the drafter's reliability at that confidence "
            "(1 = calibrated).", ["confidence"])
        self.http_requests = counter("http_requests", "HTTP responses by status code.", ["status"])
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                            "(first admission of each request).").labels(model_name)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens whose KV came from the prefix "
                                         "cache.").labels(model_name)
        self.structured_requests = counter("structured_output_requests", "Requests admitted with a grammar "
                                           "(response_format json_object / json_schema, or a tool call the "
                                           "tool_choice requires).").labels(model_name)
        self.grammar_pruned = counter("spec_decode_grammar_pruned_nodes", "Draft-tree candidates dropped before "
                                      "verification because the request's grammar forbids them.").labels(model_name)
        self.alloc_retries = counter("cuda_alloc_retries", "Times the CUDA caching allocator failed an allocation, "
                                     "freed its cache and retried (a stall; should stay 0).").labels(model_name)
        self.kernel_fallbacks = counter("kernel_reference_fallbacks", "Calls of an ext op on a CUDA tensor that "
                                        "ran its PyTorch reference (only with --reference-kernels), or that a "
                                        "slower fused path served (op dense_prefill_cudnn: FlashAttention where "
                                        "cuDNN declined a prompt).", ["op"])

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first output token.",
                                             REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens (a multi-token emission is spread evenly "
            "over its tokens).", TOKEN_LATENCY_BUCKETS).labels(model_name)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                             REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.request_queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                            REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.spec_accept_length = histogram(
            "spec_decode_accept_length", "Tokens committed per request per speculative step (accepted + bonus).",
            ACCEPT_LENGTH_BUCKETS).labels(model_name)
        self.spec_tree_nodes = histogram("spec_decode_tree_nodes", "Draft-tree nodes per request per step.",
                                         TREE_NODES_BUCKETS).labels(model_name)
        self.step_time = histogram("step_time_seconds", "Engine step time by phase.", STEP_TIME_BUCKETS,
                                   ["phase"])
        self.batch_size = histogram("batch_size", "Requests per engine step.", BATCH_SIZE_BUCKETS).labels(model_name)
        self.spec_budget = histogram("spec_decode_budget", "Tree budget the adaptive speculation chose per decoding "
                                     "request per step (0 = plain decoding).", BUDGET_BUCKETS).labels(model_name)
        self.spec_guard_checks = counter("spec_decode_guard_checks", "Checks of speculative decoding against a "
                                         "window of plain steps: won (trees stay on), lost (trees off for a "
                                         "back-off), discarded (the batch changed).", ["outcome"])
        self.spec_guard_plain_steps = counter("spec_decode_guard_plain_steps", "Decoding steps the throughput guard "
                                              "kept plain: its check windows and back-offs.").labels(model_name)
        self.spec_curve_draft_steps = counter("spec_decode_curve_draft_steps", "Decoding steps in which the drafter "
                                              "ran for requests that verified no tree (curve-only drafts: what the "
                                              "adaptive budget reads to decide when a request at budget 0 verifies "
                                              "again; on a GPU their host work costs about a plain step).").labels(
            model_name)
        self.spec_probes = counter("spec_decode_probes", "Tree budgets the adaptive speculation chose as probes: "
                                   "a small tree verified to re-rate a request whose drafter is confident but "
                                   "whose record (or, new, the engine's) says it is wrong; under CUDA graphs each "
                                   "probe's step lays the whole batch out at the probe's width.").labels(model_name)
        self.engine_steps = counter("engine_steps", "Engine steps on a device with CUDA graphs: replayed (a tree "
                                    "step as a whole round, or its forward only with the reason), or eager with the "
                                    "reason.", ["mode", "reason"])
        self.step_scheduling = counter("engine_step_scheduling", "Engine steps under asynchronous scheduling: "
                                       "launched ahead of the previous step's results, or synchronous with the "
                                       "reason.", ["scheduling", "reason"])

        # Create the fixed label values now so dashboards see zero-valued series before the first event.
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for phase in PHASES:
            self.step_time.labels(model_name, phase)
        for outcome in ("won", "lost", "discarded"):
            self.spec_guard_checks.labels(model_name, outcome)

    # ------------------------------------------------------------------------------------------ inputs

    def set_scheduler_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage_perc.set(kv_cache_usage)

    def record_tokens(self, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)

    def record_step(self, stats: Union[StepStats, Mapping[str, Any]]) -> None:
        """Record one engine step (an engine.messages.StepStats, or a dict of its fields). Prompt and output
        tokens are not a step's: the front end counts them per request (record_tokens)."""
        self.set_scheduler_state(_get(stats, "num_running", 0), _get(stats, "num_waiting", 0),
                                 _get(stats, "kv_cache_usage", 0.0))
        batch = _get(stats, "batch_size", 0)
        if batch:
            self.batch_size.observe(batch)
        preempted = _get(stats, "num_preemptions", 0)
        if preempted:
            self.num_preemptions.inc(preempted)
        queries, hits = _get(stats, "prefix_cache_queries", 0), _get(stats, "prefix_cache_hits", 0)
        if queries:
            self.prefix_cache_queries.inc(queries)
        if hits:
            self.prefix_cache_hits.inc(hits)
        constrained, pruned = _get(stats, "num_constrained_requests", 0), _get(stats, "num_grammar_pruned", 0)
        if constrained:
            self.structured_requests.inc(constrained)
        if pruned:
            self.grammar_pruned.inc(pruned)
        retries = _get(stats, "cuda_alloc_retries", 0)
        if retries:
            self.alloc_retries.inc(retries)
        for op, count in (_get(stats, "kernel_fallbacks", None) or {}).items():
            self.kernel_fallbacks.labels(self.model_name, op).inc(count)
        for phase, seconds in (_get(stats, "timings", None) or {}).items():
            self.step_time.labels(self.model_name, phase).observe(seconds)
        for budget in _get(stats, "spec_budgets", None) or ():
            self.spec_budget.observe(budget)
        for confidence, (accepted, probability) in (_get(stats, "draft_confidence", None) or {}).items():
            self.spec_accepted_by_confidence.labels(self.model_name, confidence).inc(accepted)
            self.spec_probability_by_confidence.labels(self.model_name, confidence).inc(probability)
        for outcome in _get(stats, "spec_guard_checks", None) or ():
            self.spec_guard_checks.labels(self.model_name, outcome).inc()
        guarded = _get(stats, "spec_guard_plain", 0)
        if guarded:
            self.spec_guard_plain_steps.inc(guarded)
        if _get(stats, "num_curve_drafts", 0):
            self.spec_curve_draft_steps.inc()
        probes = _get(stats, "num_probes", 0)
        if probes:
            self.spec_probes.inc(probes)
        graph = _get(stats, "cuda_graph", "")
        if graph:
            mode, _, reason = graph.partition(": ")
            self.engine_steps.labels(self.model_name, mode, reason).inc()
        scheduling = _get(stats, "scheduling", "")
        if scheduling:
            kind, _, reason = scheduling.partition(": ")
            self.step_scheduling.labels(self.model_name, kind, reason).inc()

        accept = list(_get(stats, "accept_lengths", None) or ())
        nodes = list(_get(stats, "tree_nodes", None) or ())
        if len(accept) != len(nodes):
            raise ValueError(f"accept_lengths ({len(accept)}) and tree_nodes ({len(nodes)}) must pair up per request")
        if not accept:
            return
        for a, n in zip(accept, nodes):
            self.spec_accept_length.observe(a)
            self.spec_tree_nodes.observe(n)
        self.spec_num_drafts.inc(len(accept))
        self.spec_num_draft_tokens.inc(sum(nodes))
        self.spec_num_accepted_tokens.inc(sum(max(a - 1, 0) for a in accept))
        per_pos = list(_get(stats, "accepted_per_position", None) or ())
        if not per_pos:
            per_pos = [0] * max(max(accept) - 1, 0)
            for a in accept:
                for d in range(a - 1):
                    per_pos[d] += 1
        for position, count in enumerate(per_pos):
            if count:
                self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(count)

    def observe_inter_token_latency(self, interval: float, num_tokens: int = 1) -> None:
        """One emission of num_tokens after `interval` seconds: interval/num_tokens, num_tokens times, so a
        speculative burst reads as its per-token cost instead of one long gap and several zero gaps."""
        if num_tokens <= 0 or not math.isfinite(interval) or interval < 0:
            return
        per_token = interval / num_tokens
        for _ in range(num_tokens):
            self.inter_token_latency.observe(per_token)

    def record_request(self, stats: Union[RequestStats, Mapping[str, Any], Any]) -> None:
        """Record one finished request (a RequestStats or a dict of its fields)."""
        self.request_success.labels(self.model_name, _get(stats, "finished_reason", None) or "unknown").inc()
        for name, hist in (("queue_time", self.request_queue_time), ("time_to_first_token", self.time_to_first_token),
                           ("e2e_latency", self.e2e_request_latency)):
            value = _get(stats, name, None)
            if value is not None and math.isfinite(value) and value >= 0:
                hist.observe(value)
        for interval, num_tokens in _get(stats, "token_intervals", None) or ():
            self.observe_inter_token_latency(interval, num_tokens)

    def record_http_response(self, status_code: int) -> None:
        self.http_requests.labels(self.model_name, str(int(status_code))).inc()

    # ------------------------------------------------------------------------------------------ output

    def render(self) -> bytes:
        """The text exposition for GET /metrics; serve it with `self.content_type`."""
        return generate_latest(_WithoutCreated(self.registry))  # type: ignore[arg-type]
