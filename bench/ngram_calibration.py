"""How well the n-gram drafter's probabilities predict the target, which is what the adaptive budget and the tree
build price nodes by. Greedy outputs of the embedded model on bench/serve.py's chat mix are generated first; the
drafter is then called token by token along each output, as the engine calls it while a request decodes one token
a step, and each call's top candidates are checked against the target's tokens that follow. Reports, per depth d,
the mean predicted probability of the top chain through depth d (the product of the per-depth top probabilities,
as DDTree prices a path) against how often the whole chain held; and the depth-1 calibration (predicted
probability by decile against how often the top was right). Deterministic (greedy, a fixed seed); not a test.

    python bench/ngram_calibration.py [--num-requests 24 --output-len 64]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serve import make_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.speculative.drafter import DraftRequest  # noqa: E402
from engine.speculative.ngram import NgramDrafter  # noqa: E402


def replay(drafter: NgramDrafter, sequences: list[tuple[list[int], list[int]]]) -> tuple[list, list]:
    """(per depth [sum of chain probabilities, chains that held, calls], per decile [sum of p, right, calls])."""
    horizon = drafter.horizon
    chains = [[0.0, 0, 0] for _ in range(horizon)]
    deciles = [[0.0, 0, 0] for _ in range(10)]
    for i, (prompt, output) in enumerate(sequences):
        seq = prompt + output
        for root in range(len(prompt), len(seq) - 1):  # the root is seq[root]; the target's next tokens follow
            rows = drafter.candidates(DraftRequest(f"r{i}", seq[: root + 1]))
            chain, held = 1.0, True
            for d, row in enumerate(rows[: len(seq) - 1 - root]):
                p, right = (math.exp(row[0][1]), row[0][0] == seq[root + 1 + d]) if row else (0.0, False)
                if d == 0:
                    cell = deciles[min(9, int(p * 10))]
                    cell[0], cell[1], cell[2] = cell[0] + p, cell[1] + right, cell[2] + 1
                chain, held = chain * p, held and right
                cell = chains[d]
                cell[0], cell[1], cell[2] = cell[0] + chain, cell[1] + held, cell[2] + 1
    return chains, deciles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--horizon", type=int, default=8)
    args = p.parse_args()
    llm = LLM(None, dtype="fp32")
    rng = random.Random(args.seed)
    prompts = [llm.encode(make_prompt(rng, args.input_len), chat=True) for _ in range(args.num_requests)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    sequences = [(q, o.token_ids) for q, o in zip(prompts, outs)]
    vocab = llm.engine.vocab_size
    results = {name: replay(NgramDrafter(vocab, horizon=args.horizon, calibrate=cal), sequences)
               for name, cal in (("shares", False), ("calibrated", True))}
    print(f"{args.num_requests} chat requests, {args.output_len} greedy tokens each; the n-gram drafter called at "
          "every output position\n")
    print("| depth | chain held | " + " | ".join(f"predicted ({name})" for name in results) + " |")
    print("|---|---|" + "---|" * len(results))
    for d in range(args.horizon):
        held = results["shares"][0][d]
        cells = " | ".join(f"{r[0][d][0] / r[0][d][2]:.3f}" for r in results.values())
        print(f"| {d + 1} | {held[1] / held[2]:.3f} | {cells} |")
    for name, (_, deciles) in results.items():
        print(f"\ndepth 1, {name}: predicted probability -> right (calls)")
        print("  " + "  ".join(f"{c[0] / c[2]:.2f}->{c[1] / c[2]:.2f} ({c[2]})" for c in deciles if c[2]))


if __name__ == "__main__":
    main()
