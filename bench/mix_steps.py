"""bench/serve.py's chat mix in process, step by step: the same prompts (a list of words to continue) and sampling
(each request seeded by its index), N requests admitted as slots free at most C at a time (max_num_seqs = C, as
the server under C concurrent clients), each drafter in turn. Per kind of step (tree, plain, or a step that admitted
a request and prefilled its prompt) its count, median
wall time and tokens; then tokens/s while requests still wait for a slot (the steady state) and during the drain
(the last requests, the batch shrinking as they finish). Not a benchmark of the server (no HTTP, no detokenized
streaming): for seeing where a drafter's steps gain or lose against speculation off.

    python bench/mix_steps.py --num-requests 64 --concurrency 16 --temperature 0.7 --drafters ngram none
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.host_timers import host_speed_us  # noqa: E402
from bench.serve import make_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def run(args, drafter: str) -> None:
    rng = random.Random(args.seed)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, drafter=drafter, max_num_seqs=args.concurrency)
    core = llm.engine
    prompts = [llm.encode(make_prompt(rng, args.input_len), chat=True) for _ in range(args.num_requests)]
    # warm-up: a first admission's worth of other prompts (the process's first prefill of that size paid ~1-1.6 s
    # of one-time costs on the 2-core CPU, and the drafter run first lost ~4% to them; other prompts, so the
    # measured ones are not found in the prefix cache)
    warm_rng = random.Random(~args.seed)
    warm = [llm.encode(make_prompt(warm_rng, args.input_len), chat=True) for _ in range(args.concurrency)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=args.temperature))
    core.budgets.reset()
    for i, p in enumerate(prompts):
        core.add_request(p, SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                                           top_p=args.top_p, seed=args.seed + i, ignore_eos=True))
    kinds, phases = collections.defaultdict(list), {True: [0.0, 0], False: [0.0, 0]}  # waiting -> [s, tokens]
    t0, tokens, checks, forced = time.perf_counter(), 0, collections.Counter(), 0
    while core.has_unfinished():
        waiting = len(core.scheduler.waiting) > 0
        start = time.perf_counter()
        emitted = sum(len(d.new_token_ids) for d in core.step())
        seconds = time.perf_counter() - start
        tokens += emitted
        phases[waiting][0] += seconds
        phases[waiting][1] += emitted
        if core.last_stats is not None:
            # a step that admitted a request prefilled its prompt beside the decoding rows
            kind = "tree" if any(core.last_stats.spec_budgets) else \
                "admit" if core.last_stats.prefix_cache_queries else "plain"
            kinds[kind].append((seconds * 1e3, emitted, core.last_stats.batch_size))
            checks.update(core.last_stats.spec_guard_checks)
            forced += core.last_stats.spec_guard_plain
    elapsed = time.perf_counter() - t0
    print(f"== {drafter}: {tokens / elapsed:.1f} tok/s, {sum(len(v) for v in kinds.values())} steps, host probe "
          f"{host_speed_us():.0f} us; guard checks {dict(checks)}, {forced} steps kept plain", flush=True)
    for kind, steps in kinds.items():
        print(f"   {kind:5s} n={len(steps):4d} median {statistics.median(s[0] for s in steps):7.1f} ms, tokens/step "
              f"{sum(s[1] for s in steps) / len(steps):5.2f}, batch {statistics.mean(s[2] for s in steps):5.1f}, "
              f"{sum(s[0] for s in steps) / 1e3:.1f} s in all")
    for waiting, label in ((True, "while requests wait"), (False, "drain")):
        seconds, n = phases[waiting]
        print(f"   {label}: {n / seconds if seconds else 0.0:.1f} tok/s over {seconds:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: the embedded model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="the engine's default for the device when not given")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafters", nargs="+", default=["ngram", "none"])
    args = p.parse_args()
    for drafter in args.drafters:
        run(args, drafter)


if __name__ == "__main__":
    main()
