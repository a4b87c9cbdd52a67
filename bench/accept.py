"""Acceptance of a DFlash drafter on held-out prompts: tau (tokens per verify step, bonus included) and the
fraction of steps accepting each depth, for the chain (the drafter's top-1 path, block_size - 1 drafts) and for
DDTree at fixed budgets, at each temperature, with tokens/s beside plain decoding at the same temperature.

Every speculative run verifies its full budget every step (no adaptive budget), so tau is the drafter's, not the
controller's. Prompts: the held-out split of engine/train/prompts.py (never trained on), as chat turns.

    python bench/accept.py                                  # embedded SmolLM2 + its shipped drafter, CPU
    python bench/accept.py --device cuda --num-prompts 64 --json out.json
    python bench/accept.py --schema person.json --no-chain   # tau with grammar pruning against without
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig  # noqa: E402
from engine.train.evaluate import TABLE_HEADER, measure  # noqa: E402


def heldout_prompt_ids(loaded, sources, count: int, max_prompt_tokens: int, chat: bool) -> list[list[int]]:
    from engine.train.prompts import load_prompts, split
    from engine.train.responses import encode_prompt

    _, heldout = split(load_prompts(sources))
    out = []
    for p in heldout:
        ids = encode_prompt(loaded.tokenizer, p, chat)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == count:
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", default=None, help="DFlash drafter folder (default: the shipped one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompts", nargs="+", default=["sharegpt"], help="prompt sources (held-out split used)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (1 = batch 1)")
    p.add_argument("--no-chain", action="store_true", help="skip the chain")
    p.add_argument("--no-chat", action="store_true", help="prompts as plain text, not chat turns")
    p.add_argument("--schema", default=None, help="a JSON schema file: constrain every output to it and measure "
                                                  "DDTree with and without grammar pruning")
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args()

    from engine.drafters import shipped_drafter_dir
    from engine.model.loader import load_model

    draft = args.draft_model or shipped_drafter_dir()
    base = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, enable_prefix_caching=False,
                        max_num_seqs=max(1, args.concurrency))
    loaded = load_model(args.model, args.dtype, args.device)
    ids = heldout_prompt_ids(loaded, args.prompts, args.num_prompts, args.max_prompt_tokens, not args.no_chat)
    print(f"{time.strftime('%Y-%m-%d')} | {platform.node()} | device {args.device} | target {loaded.path} | "
          f"drafter {draft} | {len(ids)} held-out prompts x {args.max_tokens} tokens | concurrency "
          f"{args.concurrency}", flush=True)
    print(TABLE_HEADER, flush=True)
    kw = dict(max_tokens=args.max_tokens, concurrency=args.concurrency)
    prunings = [True]
    if args.schema:
        from engine.grammar import json_schema_grammar

        with open(args.schema) as f:
            kw["grammar"] = json_schema_grammar(json.load(f))
        prunings = [True, False]
    results = []
    for t in args.temperatures:
        plain = measure(loaded, base, ids, "plain", temperature=t, **kw)
        print(plain.row(), flush=True)
        results.append(plain)
        runs = [] if args.no_chain else [("chain", 0)]
        runs += [("ddtree", b) for b in args.budgets]
        for mode, budget in runs:
            for pruning in prunings:
                m = measure(loaded, base, ids, mode, draft_model=draft, budget=budget or 16, temperature=t,
                            grammar_pruning=pruning, **kw)
                print(m.row(plain.tokens_per_s), flush=True)
                results.append(m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "target": loaded.path, "draft_model": draft, "prompts": len(ids),
                       "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                       "results": [dataclasses.asdict(m) for m in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
