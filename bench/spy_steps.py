"""Where an engine's step time goes on the host, from py-spy's collapsed stacks (`py-spy record -f raw`): per
function, the microseconds a step spent inside it (inclusive: its callees too; `--self`: its own lines only) among
the samples under one root frame (default EngineCore.step), for one profile or two side by side with their difference
(e.g. speculation off against the n-gram drafter, one process each: bench/step_kinds.py --no-off). A sampling
profiler adds no cost to the calls it counts, where perf_counter wrappers (--host-times) add ~1 us to each, which
at batch 64 is most of a per-request function's time. Samples are converted at the rate given to py-spy.

    py-spy record -r 1000 -f raw -o off.txt -- python bench/step_kinds.py ... --drafter none --no-off
    py-spy record -r 1000 -f raw -o ngram.txt -- python bench/step_kinds.py ... --drafter ngram --no-off
    python bench/spy_steps.py off.txt ngram.txt --steps 916 --rate 1000
    python bench/spy_steps.py ngram.txt --tree ModelRunner.collect --depth 2
    python bench/spy_steps.py off.txt ngram.txt --threads    # (recorded with py-spy's --threads)

--threads: milliseconds a profile's threads were busy (py-spy samples only threads that are not idle), per thread,
over the whole run: a thread beside the engine's that competes for its cores or its GIL.
"""
from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(r":\d+\)$")  # a frame's line number: functions are counted whatever line was running


def frames_of(line: str) -> tuple[list[str], int]:
    """One collapsed stack ("frame;frame;... count") -> (its frames, outermost first, without line numbers; count)."""
    stack, _, count = line.rstrip().rpartition(" ")
    return [LINE.sub(")", f) for f in stack.split(";")], int(count)


def under(frames: list[str], root: str) -> list[str] | None:
    """The frames from the outermost one named `root` on, or None when the stack never enters it."""
    for i, frame in enumerate(frames):
        if frame.startswith(root):
            return frames[i:]
    return None


def totals(path: str, root: str, own: bool) -> tuple[collections.Counter, int]:
    """(samples per function under `root`, inclusive or own; samples under `root` in all)."""
    counts, total = collections.Counter(), 0
    with open(path) as f:
        for line in f:
            frames, n = frames_of(line)
            frames = under(frames, root)
            if frames is None:
                continue
            total += n
            for frame in [frames[-1]] if own else set(frames):
                counts[frame] += n
    return counts, total


def threads(path: str) -> collections.Counter:
    """Samples per thread (the outermost frame of a stack recorded with --threads: "thread (id): name")."""
    counts = collections.Counter()
    with open(path) as f:
        for line in f:
            frames, n = frames_of(line)
            counts[frames[0]] += n
    return counts


def tree(path: str, root: str, depth: int) -> collections.Counter:
    """Samples per call path of up to `depth` frames below `root` (the root's children, theirs, ...)."""
    paths = collections.Counter()
    with open(path) as f:
        for line in f:
            frames, n = frames_of(line)
            frames = under(frames, root)
            for d in range(1, min(len(frames or ()), depth + 1) + 1):
                paths[tuple(frames[:d])] += n
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", help="one or two py-spy raw files")
    p.add_argument("--root", default="EngineCore.step", help="the frame whose samples count (a prefix of its name)")
    p.add_argument("--steps", type=int, nargs="+", default=[1], help="steps each profile ran (one for all, or each)")
    p.add_argument("--rate", type=float, default=100.0, help="samples a second given to py-spy (-r)")
    p.add_argument("--self", dest="own", action="store_true", help="own time, not inclusive")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--tree", default=None, metavar="FRAME", help="the call tree below FRAME (first profile)")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--threads", action="store_true", help="busy milliseconds per thread over each whole run")
    args = p.parse_args()
    steps = args.steps * len(args.profiles) if len(args.steps) == 1 else args.steps
    us = [1e6 / args.rate / n for n in steps]  # microseconds a step per sample, per profile
    if args.threads:
        for path in args.profiles:
            for name, n in threads(path).most_common(12):
                print(f"{path}: {n * 1e3 / args.rate:9.1f} ms  {name[:100]}")
        return
    if args.tree:
        for path, n in sorted(tree(args.profiles[0], args.tree, args.depth).items()):
            print(f"{n * us[0]:9.1f} us  " + "  " * (len(path) - 1) + path[-1][:120])
        return
    counted = [totals(path, args.root, args.own) for path in args.profiles]
    print("us a step under " + args.root + ": " + ", ".join(f"{total * u:.1f}" for (_, total), u in zip(counted, us)))
    names = set().union(*(c for c, _ in counted))

    def order(name: str) -> float:  # by the difference with two profiles, else by time
        times = [c[name] * u for (c, _), u in zip(counted, us)]
        return -abs(times[1] - times[0]) if len(times) == 2 else -times[0]

    for name in sorted(names, key=order)[:args.top]:
        times = [c[name] * u for (c, _), u in zip(counted, us)]
        diff = f" {times[1] - times[0]:+9.1f}" if len(times) == 2 else ""
        print(" ".join(f"{t:9.1f}" for t in times) + diff + "  " + name[:130])


if __name__ == "__main__":
    main()
