"""One run of the engine logged step by step: for every engine step its wall time, batch size, the tree budgets
chosen, tokens emitted, whether it replayed a CUDA graph (or why not), how it was scheduled (ahead of its
predecessor's results or why not) and the runner's phase timings; then cProfile's view of a window of steps, or
the inclusive host time of the engine's methods over one (--host-times: bench/host_timers.py, which times only
what it wraps where cProfile misattributes time around C calls).
For finding where a benchmark's time goes (admission steps, tails of requests that left the oracle, host work
per tree step), not a benchmark itself. Prints one JSON line per step, then a summary with the steady state (steps
where every request decodes and none has finished: ms per step and tokens/s, profiled steps left out).

    python bench/step_log.py --model SmolLM2.gguf --batch 64 --mode ddtree
    python bench/step_log.py --model SmolLM2.gguf --batch 8 --mode chain --profile 6 12
    python bench/step_log.py --smollm2-shape --batch 64 --mode plain --profile 40 80
    python bench/step_log.py --smollm2-shape --batch 8 --mode ddtree --host-times 8 28

The drafter of the chain and ddtree modes is bench/e2e.py's device oracle replaying the plain run's output
(computed first, in the same process).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.e2e import prompts  # noqa: E402
from bench.host_timers import HostTimers  # noqa: E402
from bench.gpu_serving import QWEN3_8B, SMOLLM2_135M, free_engine_memory  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.speculative.oracle import DeviceOracle  # noqa: E402


def log_steps(llm: LLM, ps: list[list[int]], sp: SamplingParams, profile: tuple[int, int] | None,
              host_times: tuple[int, int] | None = None) -> None:
    core, profiler, n = llm.engine, cProfile.Profile(), 0
    drafter = core.speculator.drafter if core.speculator is not None else None
    timers = HostTimers({type(drafter): "propose propose_ahead"} if drafter is not None else None) \
        if host_times else None
    full: list[tuple[float, int]] = []  # (ms, tokens) of unprofiled steps with every request decoding
    decoding, finished = set(), 0  # requests that produced a token before the step; requests done
    for p in ps:
        core.add_request(p, SamplingParams(**vars(sp)))
    t_all = time.perf_counter()
    while core.has_unfinished():
        in_profile = profile is not None and profile[0] <= n < profile[1]
        if timers is not None:
            timers.active = host_times[0] <= n < host_times[1]
        # measured steps stay out of the steady state below (the profiler, or the timers' ~1 us a call)
        profiled = in_profile or (timers is not None and timers.active)
        if in_profile:
            profiler.enable()
        t0 = time.perf_counter()
        deltas = core.step()
        ms = (time.perf_counter() - t0) * 1e3
        if in_profile:
            profiler.disable()
        st = core.last_stats
        tokens = sum(len(d.new_token_ids) for d in deltas)
        if not profiled and len(decoding) == len(ps) and not finished and not any(d.finished for d in deltas):
            full.append((ms, tokens))
        decoding.update(d.request_id for d in deltas if d.new_token_ids)
        finished += sum(d.finished for d in deltas)
        print(json.dumps(dict(
            step=n, ms=round(ms, 2), batch=st.batch_size if st else None,
            budgets=sorted(set(st.spec_budgets)) if st and st.spec_budgets else None,
            tokens=tokens, graph=st.cuda_graph if st else None,
            scheduling=st.scheduling if st else None,
            phases_ms={k: round(v * 1e3, 2) for k, v in (st.timings.items() if st else [])})), flush=True)
        n += 1
    summary = dict(total_s=round(time.perf_counter() - t_all, 3), steps=n)
    if full:  # the steady state: every request decoding, none admitted or finished yet (profiled steps left out)
        ms, tokens = sum(m for m, _ in full), sum(t for _, t in full)
        summary.update(full_batch_steps=len(full), full_batch_ms_per_step=round(ms / len(full), 3),
                       full_batch_tok_s=round(tokens / ms * 1e3, 1))
    print(json.dumps(summary), flush=True)
    if timers is not None:
        timers.remove()
        num_timed = max(0, min(n, host_times[1]) - host_times[0])
        print(f"host time of {num_timed} steps (from step {host_times[0]}), inclusive:")
        print("\n".join(timers.report(num_timed)) if num_timed else "no step timed")
    if profile is not None and profile[0] >= n:
        print(f"no step profiled: the run took {n} steps, the window starts at step {profile[0]}")
    elif profile is not None:
        out = io.StringIO()
        for key in ("cumulative", "tottime"):
            pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(40)
        print(out.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF folder or GGUF")
    source.add_argument("--smollm2-shape", action="store_true", help="a SmolLM2-135M-shaped model, dummy bf16 weights")
    source.add_argument("--qwen3-8b", action="store_true", help="a Qwen3-8B-shaped model, dummy bf16 weights")
    p.add_argument("--device", default="cuda")
    p.add_argument("--mode", choices=("plain", "chain", "ddtree"), default="ddtree")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--depth", type=int, default=7, help="oracle horizon")
    p.add_argument("--replay-own", action="store_true",
                   help="log a second pass, the oracle replaying the first pass's own output (bench/e2e.py's "
                        "timed pass: no request leaves the oracle by bf16 rounding; the adaptive budget warm)")
    p.add_argument("--no-harmonize", action="store_true", help="the step's budgets are not harmonized to one width")
    p.add_argument("--no-fill", action="store_true", help="trees narrower than the step's width are not filled")
    p.add_argument("--no-uniform", action="store_true",
                   help="a graph step's width is not priced for every request (harmonize and fill instead)")
    p.add_argument("--miss-rate", type=float, default=0.0, help="share of positions where the oracle's top-1 misses")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--profile", type=int, nargs=2, metavar=("FIRST", "END"), help="cProfile steps FIRST..END-1")
    p.add_argument("--host-times", type=int, nargs=2, metavar=("FIRST", "END"),
                   help="inclusive host time of the engine's methods over steps FIRST..END-1 (bench/host_timers.py)")
    args = p.parse_args()
    common = dict(device=args.device, max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=4096, enable_prefix_caching=False)
    shape = QWEN3_8B if args.qwen3_8b else SMOLLM2_135M if args.smollm2_shape else None
    if shape is not None:  # dummy weights of a known shape: no checkpoint to carry
        args.model = tempfile.mkdtemp(prefix="dummy-shape-")
        with open(os.path.join(args.model, "config.json"), "w") as f:
            json.dump(shape, f)
        common["load_format"] = "dummy"
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    plain = LLM(args.model, **common)
    ps = prompts(plain.engine.vocab_size, args.batch, args.prompt_len)
    if args.mode == "plain":
        log_steps(plain, ps, sp, tuple(args.profile) if args.profile else None,
                  tuple(args.host_times) if args.host_times else None)
        return
    outs = plain.generate(ps, sp)
    golden = {tuple(q): q + o.token_ids for q, o in zip(ps, outs)}
    vocab = plain.engine.vocab_size
    del plain
    free_engine_memory()
    oracle = DeviceOracle(golden, args.prompt_len, vocab, args.depth, args.device, miss_rate=args.miss_rate)
    kwargs = dict(chain=True) if args.mode == "chain" else dict(spec_budget=args.budget)
    llm = LLM(args.model, drafter=oracle, **kwargs, **common)
    if args.no_harmonize:  # every tree at its own budget, padded to the step's widest (the A/B baseline)
        llm.engine.scheduler.width_of = lambda requests, budgets: budgets
    if args.no_fill:  # trees narrower than the step's width keep their padding rows
        llm.engine.scheduler.fill_trees = False
    if args.no_uniform:  # graph steps priced and filled as if only the trees paid the width
        llm.engine.scheduler.uniform_of = None
    if args.replay_own:  # as bench/e2e.py's timed pass: the mode's own output replayed, the budget warm
        oracle.load({tuple(q): q + o.token_ids for q, o in zip(ps, llm.generate(ps, sp))})
    log_steps(llm, ps, sp, tuple(args.profile) if args.profile else None,
              tuple(args.host_times) if args.host_times else None)


if __name__ == "__main__":
    main()
