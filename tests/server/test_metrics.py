"""server/metrics.py: exposed names (parsed back with prometheus_client's own parser), the model_name label,
per-instance registries, and the values that step and request records produce."""
from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import StepStats
from server.metrics import PHASES, Metrics, RequestStats

COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "request_success_total", "num_preemptions_total",
            "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
            "http_requests_total", "prefix_cache_queries_total", "prefix_cache_hits_total"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "spec_decode_accept_length", "spec_decode_tree_nodes",
              "step_time_seconds", "batch_size"]


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels) -> float:
    labels = {"model_name": metrics.model_name, **{k: str(v) for k, v in labels.items()}}
    return samples(metrics).get(("ddtree:" + name, frozenset(labels.items())), 0.0)


def busy_metrics() -> Metrics:
    m = Metrics("tiny-model")
    m.record_step(StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, batch_size=3, num_preemptions=1,
                            timings={"schedule": 0.0002, "draft": 0.003, "tree_build": 0.0004, "verify": 0.008,
                                     "accept": 0.0003},
                            accept_lengths=[3, 1, 5], tree_nodes=[16, 16, 32], prefix_cache_queries=48,
                            prefix_cache_hits=32))
    m.record_tokens(prompt_tokens=40, generation_tokens=9)  # counted per request by the front end
    m.record_request(RequestStats("stop", queue_time=0.01, time_to_first_token=0.05, e2e_latency=1.5,
                                  token_intervals=[(0.02, 1), (0.03, 3)]))
    m.record_http_response(200)
    m.record_http_response(400)
    return m


def test_every_metric_is_exposed_under_its_exact_name_with_model_name():
    m = busy_metrics()
    text = m.render().decode()
    found = samples(m)
    names = {name for name, _ in found}
    expected = ([f"ddtree:{c}" for c in COUNTERS] + [f"ddtree:{g}" for g in GAUGES] +
                [f"ddtree:{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "count", "sum")])
    for name in expected:
        assert name in names, name
        assert f"\n{name}{{" in text  # the literal exposed sample name, e.g. ddtree:prompt_tokens_total{...}
    for name, labels in found:
        assert dict(labels).get("model_name") == "tiny-model", (name, labels)
    assert not any(n.endswith(("_total_total", "_created")) for n in names)
    assert m.content_type.startswith("text/plain")


def test_zero_valued_series_exist_before_any_event():
    m = Metrics("m")
    assert ("ddtree:request_success_total", frozenset({("model_name", "m"), ("finished_reason", "abort")})) \
        in samples(m)
    for phase in PHASES:
        assert value(m, "step_time_seconds_count", phase=phase) == 0.0


def test_step_record_values():
    m = busy_metrics()
    assert value(m, "num_requests_running") == 3 and value(m, "num_requests_waiting") == 2
    assert value(m, "kv_cache_usage_perc") == 0.25
    assert value(m, "prompt_tokens_total") == 40 and value(m, "generation_tokens_total") == 9
    assert value(m, "num_preemptions_total") == 1
    assert value(m, "prefix_cache_queries_total") == 48 and value(m, "prefix_cache_hits_total") == 32
    assert value(m, "spec_decode_num_drafts_total") == 3
    assert value(m, "spec_decode_num_draft_tokens_total") == 64
    assert value(m, "spec_decode_num_accepted_tokens_total") == 2 + 0 + 4
    # accepted path lengths 2, 0, 4 -> depth 1: 2 requests, depth 2: 2, depth 3: 1, depth 4: 1
    per_pos = [value(m, "spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(5)]
    assert per_pos == [2, 2, 1, 1, 0]
    assert value(m, "spec_decode_accept_length_count") == 3 and value(m, "spec_decode_accept_length_sum") == 9
    assert value(m, "spec_decode_accept_length_bucket", le="1.0") == 1
    assert value(m, "spec_decode_tree_nodes_bucket", le="16.0") == 2
    assert value(m, "batch_size_count") == 1 and value(m, "batch_size_sum") == 3
    assert value(m, "step_time_seconds_count", phase="verify") == 1
    assert value(m, "step_time_seconds_sum", phase="verify") == pytest.approx(0.008)
    m.record_step({"timings": {"sample": 0.001}, "accept_lengths": [2], "tree_nodes": [8],
                   "accepted_per_position": [1]})  # a dict, an extra phase, explicit per-position counts
    assert value(m, "step_time_seconds_count", phase="sample") == 1
    assert value(m, "spec_decode_num_accepted_tokens_per_pos_total", position=0) == 3
    with pytest.raises(ValueError):
        m.record_step(StepStats(0, 0, 0.0, 0, 0, {}, accept_lengths=[1, 2], tree_nodes=[4]))


def test_request_record_values_and_itl_spreading():
    m = busy_metrics()
    assert value(m, "request_success_total", finished_reason="stop") == 1
    assert value(m, "request_success_total", finished_reason="length") == 0
    assert value(m, "time_to_first_token_seconds_sum") == pytest.approx(0.05)
    assert value(m, "e2e_request_latency_seconds_bucket", le="1.0") == 0
    assert value(m, "e2e_request_latency_seconds_bucket", le="2.5") == 1
    assert value(m, "request_queue_time_seconds_count") == 1
    # (0.02 s, 1 token) + (0.03 s, 3 tokens): four samples, three of them 0.01 s
    assert value(m, "inter_token_latency_seconds_count") == 4
    assert value(m, "inter_token_latency_seconds_sum") == pytest.approx(0.05)
    assert value(m, "inter_token_latency_seconds_bucket", le="0.01") == 3
    m.record_request({"finished_reason": "abort", "time_to_first_token": None})
    assert value(m, "request_success_total", finished_reason="abort") == 1
    assert value(m, "time_to_first_token_seconds_count") == 1
    assert value(m, "http_requests_total", status=400) == 1 and value(m, "http_requests_total", status=200) == 1


def test_drafter_reliability_by_confidence_accumulates_per_bin():
    m = Metrics("m")
    for _ in range(2):
        m.record_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, batch_size=1, num_preemptions=0,
                                timings={}, draft_confidence={"0.5": (3, 2.5), "0.0625": (0, 0.4)}))
    assert value(m, "spec_decode_accepted_by_confidence_total", confidence="0.5") == 6
    assert value(m, "spec_decode_draft_probability_by_confidence_total", confidence="0.5") == pytest.approx(5.0)
    assert value(m, "spec_decode_accepted_by_confidence_total", confidence="0.0625") == 0
    assert value(m, "spec_decode_draft_probability_by_confidence_total", confidence="0.0625") == pytest.approx(0.8)


def test_accepts_the_engines_step_stats():
    import server.metrics

    assert server.metrics.StepStats is StepStats  # one StepStats: the engine's message
    m = Metrics("m")
    m.record_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, batch_size=1, num_preemptions=0,
                            timings={"verify": 0.01}, accept_lengths=[4], tree_nodes=[8]))
    assert value(m, "spec_decode_num_accepted_tokens_total") == 3 and value(m, "kv_cache_usage_perc") == 0.5
    m.record_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, batch_size=1, num_preemptions=0,
                            timings={}, prefix_cache_queries=20, prefix_cache_hits=16,
                            kernel_fallbacks={"paged_attention": 30}, cuda_alloc_retries=2))
    assert value(m, "prefix_cache_hits_total") == 16 and value(m, "prefix_cache_queries_total") == 20
    assert value(m, "kernel_reference_fallbacks_total", op="paged_attention") == 30
    assert value(m, "cuda_alloc_retries_total") == 2
    m.record_step(StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.5, batch_size=2, num_preemptions=0,
                            timings={}, spec_budgets=[0, 16], cuda_graph="replay", scheduling="ahead"))
    m.record_step(StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.5, batch_size=2, num_preemptions=0,
                            timings={}, cuda_graph="eager: mixed step", scheduling="synchronous: waiting requests"))
    for graph in ("replay: whole round", "replay: forward only (requests ask for logprobs)"):
        m.record_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, batch_size=1, num_preemptions=0,
                                timings={}, cuda_graph=graph))
    assert value(m, "spec_decode_budget_count") == 2 and value(m, "spec_decode_budget_bucket", le="0.0") == 1
    assert value(m, "engine_steps_total", mode="replay", reason="") == 1
    assert value(m, "engine_steps_total", mode="replay", reason="whole round") == 1
    assert value(m, "engine_steps_total", mode="replay", reason="forward only (requests ask for logprobs)") == 1
    assert value(m, "engine_steps_total", mode="eager", reason="mixed step") == 1
    assert value(m, "engine_step_scheduling_total", scheduling="ahead", reason="") == 1
    assert value(m, "engine_step_scheduling_total", scheduling="synchronous", reason="waiting requests") == 1
    assert value(m, "spec_decode_guard_checks_total", outcome="lost") == 0  # present before the first check
    m.record_step(StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.5, batch_size=2, num_preemptions=0,
                            timings={}, spec_guard_checks=["won", "lost"], spec_guard_plain=1))
    assert value(m, "spec_decode_guard_checks_total", outcome="won") == 1
    assert value(m, "spec_decode_guard_checks_total", outcome="lost") == 1
    assert value(m, "spec_decode_guard_plain_steps_total") == 1
    assert value(m, "spec_decode_curve_draft_steps_total") == 0
    for curves in (5, 0, 1):  # a step drafting curves for 5 requests, a plain one, one drafting for 1
        m.record_step(StepStats(num_running=8, num_waiting=0, kv_cache_usage=0.5, batch_size=8, num_preemptions=0,
                                timings={}, num_drafted=curves + 2, num_curve_drafts=curves))
    assert value(m, "spec_decode_curve_draft_steps_total") == 2
    assert value(m, "spec_decode_probes_total") == 0
    m.record_step(StepStats(num_running=8, num_waiting=0, kv_cache_usage=0.5, batch_size=8, num_preemptions=0,
                            timings={}, num_probes=3))
    assert value(m, "spec_decode_probes_total") == 3


def test_registries_are_per_instance():
    a, b = Metrics("a"), Metrics("b")
    a.record_tokens(prompt_tokens=5)
    assert value(a, "prompt_tokens_total") == 5 and value(b, "prompt_tokens_total") == 0
    assert "ddtree:" not in prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
