"""What a bench/step_kinds.py --trace run's tree steps cost and what started them: per run, the steps with trees
(width > 1) split by whether the step planned before them counted probes (under asynchronous scheduling a step's
record holds the probes of the step planned while it ran) and by whether the round was priced by its rows (its
shape never measured or gone stale: StepCosts.rounds_priced_by_rows moved at that step) or by its measured time;
for each group its steps, tokens, milliseconds and the milliseconds beyond what the run's plain steps would have
taken for those tokens; the same for the root-only rounds that leave trees (width 1, a whole-round replay), plain
steps that drafted curves, and admission steps (whose prompt rows make "beyond plain" only a rough guide).

    python bench/trace_rounds.py steps.jsonl [more.jsonl ...]
"""
from __future__ import annotations

import argparse
import collections
import json


def load(paths: list[str]) -> dict[str, list[dict]]:
    """run label -> its step records, in order."""
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                runs[record["run"]].append(record)
    return runs


def groups(steps: list[dict]) -> dict[str, list[dict]]:
    """The run's steps by kind: tree rounds by what started them, leaving rounds, curve drafts, admissions, plain."""
    out: dict[str, list[dict]] = collections.defaultdict(list)
    priced_before = 0
    for k, step in enumerate(steps):
        count = step.get("rounds_priced_by_rows")  # (traces before 2026-12-07 17:00 lack it)
        price = "unknown" if count is None else "rows" if count > priced_before else "measure"
        priced_before = count or 0
        admission = "admission" in step["cuda_graph"]
        if step["width"] > 1:
            probes = k > 0 and steps[k - 1].get("probes", 0) > 0
            out[f"tree{', admission' if admission else ''}, {'probes' if probes else 'no probes'}, "
                f"priced by {price}"].append(step)
        elif "whole round" in step["cuda_graph"]:
            out["leaving round"].append(step)
        elif admission:
            out["plain admission"].append(step)
        elif step["drafted"]:
            out["plain, curves"].append(step)
        elif "whole step" in step["cuda_graph"]:
            out["plain"].append(step)
        else:
            out["other"].append(step)
    return out


def report(label: str, steps: list[dict]) -> None:
    by_kind = groups(steps)
    plain = by_kind.get("plain", [])
    ms_per_token = sum(s["ms"] for s in plain) / max(1, sum(s["tokens"] for s in plain))
    total = sum(s["ms"] for s in steps)
    print(f"== {label}: {len(steps)} steps, {total:.0f} ms; plain steps {ms_per_token * 1e3:.1f} us a token")
    for kind in sorted(by_kind, key=lambda k: -len(by_kind[k])):
        rows = by_kind[kind]
        ms, tokens = sum(s["ms"] for s in rows), sum(s["tokens"] for s in rows)
        excess = ms - tokens * ms_per_token
        print(f"   {kind:40s} {len(rows):5d} steps, {tokens:7d} tokens, {ms:8.1f} ms, beyond plain "
              f"{excess:7.1f} ms ({100 * excess / total:.1f}% of the run)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    args = p.parse_args()
    for label, steps in load(args.traces).items():
        report(label, steps)


if __name__ == "__main__":
    main()
