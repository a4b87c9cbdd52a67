"""Where a drafter's steps go: per kind of step (tree or plain, how it was scheduled, which graph), how many ran, their
median wall time, tokens a step and phase timings, beside speculation off, with and without asynchronous scheduling, on
the self-repeating chat prompt of bench/gpu_serving.py. Also the adaptive budget's view at the end (drafting cost and
row threshold in tokens of throughput, whether drafts count as cheap, whether the engine drafts first), and over the run
the steps that drafted curves only, the steps with trees and the budgets counted as probes (a probe is counted when its
step is planned: under asynchronous scheduling a step's stats hold the probes of the step planned while it ran) with the
explore period's back-off at the end (StepBudgets._judge_exploration), the rounds run ahead by whether their shape's
measured time was believed or their width priced by its rows (StepCosts), and the throughput guard's verdicts and forced
plain steps. --trace FILE writes every step as a JSON line (the run, its budgets, width, tokens, wall time, scheduling
and graph, and the budget's threshold and fitted row and tree costs at that point), and --repeat N runs each
configuration N times: for runs whose speed swings from one to the next. --host-times adds, per kind of step, the
inclusive host time of the engine's methods a step (bench/host_timers.py's perf_counter wrappers). Each kind also
reports its median host busy time: wall time less the wait for the device's results, and its steps' summed time and
tokens (a few slow tree steps move a run's throughput where medians hide them). --slow-steps F lists each kind's steps
slower than F times its median, with the methods (all of them wrapped) that took longest beyond that kind's median step:
where a heavy tail's time goes (on the H100 at batch 16 it found the n-gram engine's curve drafts at every 16th step).
--queue K queues K times the batch's requests behind its seats, their lengths spread, as a loaded server sees them (one
closed batch of equal lengths lasts as long as its slowest request: speculation there can only shorten the run by
speeding up every request). --admission-rows 0 256 runs each configuration with the engine's --admission-decode-rows at
each value in turn (admission steps as prompt pieces, then as one-row requests beside the decoders). Requests reach the
engine as the server sends one without stop strings: no text (the server detokenizes it); --engine-detokenize has the
engine detokenize every request, as the server had it do before 2026-12-07.

    python bench/step_kinds.py --model SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --runs 16:0 1:1 1:0
    python bench/step_kinds.py --model ... --runs 16:0 --scheduling async --repeat 3 --trace steps.jsonl
    python bench/step_kinds.py --model ... --runs 64:1 64:0 --scheduling async --queue 4 --drafter ngram
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_serving import COPY_PROMPT, SMOLLM2_135M  # noqa: E402
from bench.host_timers import HostOps, HostTimers, host_speed_us  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

TINY = dict(SMOLLM2_135M, num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=1,
            num_key_value_heads=1, head_dim=64, vocab_size=4096)
# where a step waits for the device (its results' copy): a step's host busy time is its wall time less these
WAITS = {"ResultCopy.wait", "RoundCopy.wait"}


def step_record(label: str, index: int, stats, seconds: float, emitted: int, budgets) -> dict:
    """One step of a run as --trace writes it."""
    slope = budgets.fit.slope()
    return {"run": label, "step": index, "budgets": stats.spec_budgets, "width": max(stats.spec_budgets, default=0) + 1,
            "tokens": emitted, "ms": round(seconds * 1e3, 3), "scheduling": stats.scheduling,
            "cuda_graph": stats.cuda_graph, "threshold": round(budgets.threshold(), 4),
            "row_ms": round(slope * 1e3, 4) if slope is not None else None,
            "tree_ms": round(budgets.fit.tree_cost() * 1e3, 4), "batch": stats.batch_size,
            "guard_checks": stats.spec_guard_checks, "guard_plain": stats.spec_guard_plain,
            "drafted": stats.num_drafted, "probes": stats.num_probes,
            "rounds_priced_by_rows": budgets.costs.rounds_priced_by_rows,
            "draft_ms": round(stats.timings.get("draft", 0.0) * 1e3, 3)}


def lengths(num_requests: int, max_tokens: int, queue: int) -> list[int]:
    """Each request's max_tokens: all equal in a closed batch (queue 1); spread over max_tokens / 2 .. max_tokens
    when requests queue for seats, so they finish apart and the queue is admitted a few at a time, as under
    real traffic."""
    if queue == 1:
        return [max_tokens] * num_requests
    half = max_tokens // 2
    return [half + (i * 97) % (max_tokens - half + 1) for i in range(num_requests)]


def request_prompts(llm, dummy: bool, num_requests: int, distinct: bool) -> list[list[int]]:
    """The copy prompt for every request (after the first, found in the prefix cache but for its last token), or
    with distinct: each its own first words, so that an admission prefills a prompt as under real traffic."""
    if dummy:
        return [([1000 + i % 997] if distinct else []) + list(range(1000, 1040)) * 3 for i in range(num_requests)]
    if not distinct:
        return [llm.encode(COPY_PROMPT, chat=True)] * num_requests
    return [llm.encode(f"Ticket {i}. {COPY_PROMPT}", chat=True) for i in range(num_requests)]


def run(model, device, dtype, drafter, overlap, batch, temperature, max_tokens, emulate=False, trace=None,
        rep=0, host_times: list[str] | None = None, slow_steps: float | None = None, queue: int = 1,
        distinct: bool = False, admission_wait: int = 0,
        admission_rows: int = EngineConfig.admission_decode_rows, detokenize: bool = False, top_p: float = 0.9,
        host_ops: bool = False) -> None:
    label = f"batch {batch}{f' queue {queue}' if queue > 1 else ''}{' distinct' if distinct else ''}" \
            f"{f' wait {admission_wait}' if admission_wait else ''}" \
            f" rows {admission_rows}{' detokenized' if detokenize else ''} " \
            f"T {temperature} async {overlap} {drafter}" + (f" #{rep}" if rep else "")
    name, _, variant = drafter.partition(":")  # ngram:noguard: the adaptive budget without its throughput guard
    dummy = isinstance(model, dict)  # a config: random weights of its shape, a self-repeating prompt of token ids
    folder = tempfile.mkdtemp(prefix="dummy-shape-") if dummy else model
    if dummy:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(model, f)
    shape = dict(load_format="dummy", max_model_len=4096) if dummy else {}
    llm = LLM(folder, device=device, dtype=dtype, drafter=name, async_scheduling=overlap,
              spec_guard=variant != "noguard", max_num_seqs=batch, admission_wait_steps=admission_wait,
              admission_decode_rows=admission_rows, **shape)
    core = llm.engine
    if emulate:  # the CUDA-graph layout run eagerly, and asynchronous scheduling's bookkeeping (launches block)
        if name == "ngram":  # the drafter CUDA would use (same settings), through its PyTorch reference
            from engine.speculative.ngram_device import DeviceNgramDrafter

            core.speculator.drafter = DeviceNgramDrafter(core.vocab_size, horizon=core.speculator.horizon)
            core.speculator.use_staging(core.runner.staging)
        core.enable_graphs(emulate=True)
        core.overlap = overlap
    warm_up, *prompts = request_prompts(llm, dummy, batch * (queue + 1), distinct)[batch - 1:]  # own warm-up
    llm.generate([warm_up] * batch, SamplingParams(max_tokens=16, temperature=temperature))
    core.budgets.reset()
    for i, (prompt, num_tokens) in enumerate(zip(prompts, lengths(batch * queue, max_tokens, queue))):
        core.add_request(prompt, SamplingParams(max_tokens=num_tokens, temperature=temperature, top_p=top_p, seed=i,
                                                ignore_eos=True, detokenize=detokenize))
    # None: only the waits (host busy time); []: every method; labels: those and the waits
    wrapped = None if slow_steps else WAITS if host_times is None else (set(host_times) | WAITS) if host_times else None
    timers = step_timers(core, wrapped)
    per_step = collections.defaultdict(list)  # kind -> (index, ms, method -> us): for --slow-steps
    host = collections.defaultdict(collections.Counter)  # kind of step -> method -> seconds (inclusive)
    ops = collections.defaultdict(lambda: [collections.Counter(), collections.Counter()])  # kind -> (calls, seconds)
    kinds, tokens, t0, index = collections.defaultdict(list), 0, time.perf_counter(), 0
    # the guard's verdicts, steps drafting curves, probes the budget counted, steps with trees
    checks, forced_plain, curve_steps, num_probes, tree_steps = collections.Counter(), 0, 0, 0, 0
    probes = [host_speed_us()]  # the host's speed through the run (bench/host_timers.py host_speed_us)
    while core.has_unfinished():
        before = dict(timers.seconds)
        mode = HostOps() if host_ops else contextlib.nullcontext()
        start = time.perf_counter()
        with mode:
            deltas = core.step()
        seconds = time.perf_counter() - start
        emitted = sum(len(d.new_token_ids) for d in deltas)
        tokens += emitted
        stats = core.last_stats
        if stats is None:
            continue
        if trace is not None:
            trace.write(json.dumps(step_record(label, index, stats, seconds, emitted, core.budgets)) + "\n")
        index += 1
        checks.update(stats.spec_guard_checks)
        forced_plain += stats.spec_guard_plain
        curve_steps += stats.num_curve_drafts > 0
        num_probes += stats.num_probes
        if index % 128 == 0:
            probes.append(host_speed_us(3))
        tree = any(stats.spec_budgets)
        tree_steps += tree
        kind = f"{'tree' if tree else 'plain, curves' if stats.num_drafted else 'plain'} | {stats.scheduling[:28]} | " \
               f"{stats.cuda_graph[:22]}"
        waited = sum(timers.seconds[k] - before.get(k, 0.0) for k in WAITS)
        kinds[kind].append((seconds * 1e3, emitted, {k: v * 1e3 for k, v in stats.timings.items()},
                            (seconds - waited) * 1e3))
        host[kind].update({k: v - before.get(k, 0.0) for k, v in timers.seconds.items()})
        if host_ops:
            ops[kind][0].update(mode.calls)
            ops[kind][1].update(mode.seconds)
        if slow_steps:
            per_step[kind].append((index - 1, seconds * 1e3, {k: (v - before.get(k, 0.0)) * 1e6
                                                              for k, v in timers.seconds.items()}))
    timers.remove()
    elapsed, b = time.perf_counter() - t0, core.budgets
    print(f"== {label}: {tokens / elapsed:.0f} tok/s, "
          f"{sum(len(v) for v in kinds.values())} steps; draft_tokens {b.draft_tokens():.3f} threshold "
          f"{b.threshold():.3f} cheap {b.cheap_draft()} draft first {core.draft_first is not None}; curve steps "
          f"{curve_steps}, tree steps {tree_steps}, probes {num_probes} (explore back-off x{b.explore_backoff} at the "
          f"end), rounds ahead priced by their measured shape {b.costs.rounds_believed} / by rows (unmeasured or "
          f"stale) {b.costs.rounds_priced_by_rows}, guard won {checks['won']} lost "
          f"{checks['lost']}, forced plain {forced_plain}; host probe "
          f"{statistics.median(probes):.0f} us ({min(probes):.0f}-{max(probes):.0f})", flush=True)
    for kind, steps in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        phases = {a: round(statistics.median(s[2].get(a, 0.0) for s in steps), 3) for a in steps[0][2]}
        print(f"   {kind:70s} n={len(steps):4d} median {statistics.median(s[0] for s in steps):.3f} ms "
              f"(all {sum(s[0] for s in steps):.1f} ms, {sum(s[1] for s in steps)} tokens) "
              f"tokens/step {sum(s[1] for s in steps) / len(steps):.2f} host busy "
              f"{statistics.median(s[3] for s in steps):.3f} ms {phases}", flush=True)
        if host_times is not None:
            print("      host us/step: " + ", ".join(f"{k} {v / len(steps) * 1e6:.0f}"
                                                    for k, v in host[kind].most_common(40)), flush=True)
        if host_ops:
            calls, op_seconds = ops[kind]
            print(f"      torch ops a step: {sum(calls.values()) / len(steps):.1f} calls, "
                  f"{sum(op_seconds.values()) / len(steps) * 1e6:.0f} us below Python: " +
                  ", ".join(f"{k} {n / len(steps):.1f} x {op_seconds[k] / n * 1e6:.1f} us"
                            for k, n in calls.most_common(30)), flush=True)
    if slow_steps:
        print_slow_steps(per_step, slow_steps)


def print_slow_steps(per_step: dict, factor: float, num_steps: int = 12, num_methods: int = 8) -> None:
    """Per kind of step, its steps slower than `factor` times the kind's median, each with the methods that took
    longest beyond what they took in the kind's median step."""
    for kind, rows in per_step.items():
        median = statistics.median(ms for _, ms, _ in rows)
        slow = [r for r in rows if r[1] > factor * median]
        if not slow:
            continue
        typical = {k: statistics.median(d.get(k, 0.0) for _, _, d in rows) for k in {k for _, _, d in rows for k in d}}
        print(f"   slow steps of {kind} (median {median:.3f} ms): {len(slow)}, "
              f"{sum(ms - median for _, ms, _ in slow):.1f} ms beyond the median", flush=True)
        for index, ms, d in slow[:num_steps]:
            over = sorted(((v - typical.get(k, 0.0), k) for k, v in d.items()), reverse=True)[:num_methods]
            print(f"      step {index}: {ms:.3f} ms; " + ", ".join(f"{k} +{us:.0f} us" for us, k in over if us > 0),
                  flush=True)


def step_timers(core, only: set[str] | None) -> HostTimers:
    """perf_counter wrappers around the engine's methods (bench/host_timers.py), the drafter's included, or only
    around those named."""
    drafter = core.speculator.drafter if core.speculator is not None else None
    timers = HostTimers({type(drafter): "propose propose_ahead _write _draft _send_back"} if drafter is not None
                        else None, only)
    timers.active = True
    return timers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: the embedded model)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--smollm2-shape", action="store_true",
                       help="random weights of SmolLM2-135M's shape instead (no checkpoint to carry; the prompt is "
                            "a list of token ids said three times, the output random)")
    shape.add_argument("--tiny-shape", action="store_true",
                       help="as --smollm2-shape with one narrow layer and a 4096-token vocabulary: on the CPU, "
                            "with --emulate, a step's host work is then a visible share of its time")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--drafter", nargs="+", default=["ngram"],
                   help="drafters run after speculation off; ngram:noguard runs the budget without its guard")
    p.add_argument("--runs", nargs="+", default=["16:0", "1:1", "1:0"], help="batch:temperature pairs")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--top-p", type=float, default=0.9,
                   help="the queued requests' top-p (1.0: on the CPU the emulated sampler skips its sort, which "
                        "otherwise takes most of a batch-64 step there and hides the host work)")
    p.add_argument("--scheduling", choices=["both", "async", "sync"], default="both",
                   help="asynchronous scheduling on, off, or each in turn")
    p.add_argument("--emulate", action="store_true",
                   help="on the CPU: the CUDA-graph layout emulated and asynchronous scheduling's bookkeeping on, "
                        "with the device n-gram drafter's reference (step kinds and counts are CUDA's; the times "
                        "are not: every launch blocks)")
    p.add_argument("--queue", type=int, default=1, metavar="K",
                   help="K x batch requests, batch of them running at once (max_num_seqs) and the rest queued, "
                        "their lengths spread over max_tokens / 2 .. max_tokens: a loaded server (default 1: one "
                        "closed batch of equal lengths, whose run the slowest request decides)")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="each request its own prompt (the copy prompt after its own first words), so admissions "
                        "prefill it: without, every prompt after the first is found in the prefix cache")
    p.add_argument("--admission-wait", type=int, default=0, metavar="STEPS",
                   help="the engine's --admission-wait-steps: seats freed apart are filled by one admission step")
    p.add_argument("--admission-rows", type=int, nargs="+", default=[EngineConfig.admission_decode_rows],
                   metavar="N", help="the engine's --admission-decode-rows, each in turn (e.g. 0 256: admission "
                                     "steps as pieces, then as one-row requests; default: the engine's)")
    p.add_argument("--engine-detokenize", action="store_true",
                   help="the engine detokenizes every request (default: none, as the server sends a request "
                        "without stop strings)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration")
    p.add_argument("--no-off", action="store_true",
                   help="only the drafters named, without speculation off before them (one process per drafter, "
                        "e.g. under a sampling profiler: bench/spy_steps.py)")
    p.add_argument("--trace", default=None, help="write every step here as a JSON line")
    p.add_argument("--host-times", nargs="*", default=None, metavar="CLASS.METHOD",
                   help="per kind of step, the inclusive host time of the engine's methods (bench/host_timers.py); "
                        "with labels, of those only (fewer wrappers: each costs ~1 us a call)")
    p.add_argument("--host-ops", action="store_true",
                   help="per kind of step, the torch operators the host issues a step (bench/host_timers.py HostOps: "
                        "calls and their dispatch time; the Python mode slows every op, so times are of that run)")
    p.add_argument("--slow-steps", type=float, default=None, metavar="FACTOR",
                   help="list the steps slower than FACTOR times their kind's median and the methods that took "
                        "longest beyond that kind's median step (every method wrapped)")
    args = p.parse_args()
    model = SMOLLM2_135M if args.smollm2_shape else TINY if args.tiny_shape else args.model
    with open(args.trace, "w") if args.trace else contextlib.nullcontext() as trace:
        for pair in args.runs:
            batch, temperature = int(pair.split(":")[0]), float(pair.split(":")[1])
            for overlap in {"both": (True, False), "async": (True,), "sync": (False,)}[args.scheduling]:
                for drafter in args.drafter if args.no_off else ("none", *args.drafter):
                    for rep in range(1, args.repeat + 1):
                        for rows in args.admission_rows:
                            run(model, args.device, args.dtype, drafter, overlap, batch, temperature,
                                args.max_tokens, args.emulate, trace, rep if args.repeat > 1 else 0,
                                args.host_times, args.slow_steps, args.queue, args.distinct_prompts,
                                args.admission_wait, rows, args.engine_detokenize, args.top_p, args.host_ops)


if __name__ == "__main__":
    main()
