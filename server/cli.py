"""`ddtree` command line: parse flags into the config dataclasses and run a subcommand.
Every user-facing failure (bad flag value, missing or corrupt checkpoint, unsupported config) is one line on
stderr and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--drafter", choices=["none", "ngram", "dflash", "oracle"], default=None)
    p.add_argument("--draft-model", default=None, help="DFlash drafter checkpoint folder")
    p.add_argument("--budget", "--spec-budget", dest="budget", type=int, default=16, help="tree nodes per step")
    p.add_argument("--block-size", type=int, default=16, help="KV page size in tokens")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def engine_kwargs(args) -> dict:
    drafter = args.drafter or ("dflash" if args.draft_model else "none")
    return dict(model=args.model, dtype=args.dtype, device=args.device, drafter=drafter, spec_budget=args.budget,
                draft_model=args.draft_model, block_size=args.block_size, max_model_len=args.max_model_len)


def cmd_generate(args) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed_sampling)
    t0 = time.perf_counter()
    (out,) = llm.generate(args.prompt, sampling, chat=args.chat)
    elapsed = time.perf_counter() - t0
    if args.json:
        record = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "num_prompt_tokens": len(out.prompt_token_ids), "num_generated_tokens": len(out.token_ids),
                  "elapsed_s": round(elapsed, 4), "tokens_per_s": round(len(out.token_ids) / elapsed, 2)}
        record.update(out.stats.get("spec", {}))
        print(json.dumps(record))
    else:
        print(out.text)
    return 0


def cmd_build_ext(args) -> int:
    from ext import build

    ops = build.load_ops(verbose=True)
    print("built" if ops is not None else "the CUDA extension is not available on this machine")
    return 0 if ops is not None else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddtree", description="LLM inference with DDTree speculative decoding")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion offline")
    add_engine_flags(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sampling", type=int, default=None, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and timing")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("build-ext", help="build the CUDA extension now instead of on first use")
    b.set_defaults(func=cmd_build_ext)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # CheckpointError / ConfigError are ValueErrors
        print(f"ddtree: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
