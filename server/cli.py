"""`ddtree` command line: parse flags into the config dataclasses and run a subcommand.
Every user-facing failure (bad flag value, missing or corrupt checkpoint, unsupported config) is one line on
stderr and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import json
import os
import re
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


def token_id_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_generate(args) -> int:
    from engine import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed_sampling)
    if kwargs["drafter"] == "oracle":
        # the oracle proposes a golden continuation: the target's own plain output, computed first
        from engine.speculative.oracle import OracleDrafter

        plain = LLM(**dict(kwargs, drafter="none"))
        prompt_ids = args.prompt_ids or plain.encode(args.prompt, args.chat)
        golden = prompt_ids + plain.generate([prompt_ids], sampling)[0].token_ids
        kwargs["drafter"] = OracleDrafter(lambda req: golden, plain.engine.vocab_size, horizon=7)
    llm = LLM(**kwargs)
    t0 = time.perf_counter()
    (out,) = llm.generate(args.prompt_ids or args.prompt, sampling, chat=args.chat)
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


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 536870912, 512M or 1G, got {text!r}")
    unit = m.group(2).lower()
    scale = 1024 ** ("kmgt".find(unit) + 1) if unit else 1
    return int(float(m.group(1)) * scale)


def cmd_serve(args) -> int:
    from server.serve import exit_now, serve

    exit_now(serve(*serve_configs(args)))


def serve_configs(args):
    """(ServerConfig, EngineConfig) for `ddtree serve` from its parsed flags; ValueError for a bad setup."""
    from engine.config import EngineConfig, SpecConfig
    from server.config import ServerConfig, api_key_from_env

    if args.drafter == "oracle":
        raise ValueError("--drafter oracle cannot serve: it replays golden continuations, which only "
                         "`ddtree generate` and the tests have; use ngram, dflash (--draft-model) or none")
    if args.model is not None:
        if not os.path.exists(os.path.expanduser(args.model)):
            raise ValueError(f"{args.model}: no such file or directory (expected an HF folder or a .gguf file)")
    drafter = args.drafter or ("dflash" if args.draft_model else "ngram")
    spec = SpecConfig(drafter=drafter, budget=args.budget, draft_model=args.draft_model)
    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          seed=args.seed, spec=spec)
    api_key = args.api_key if args.api_key is not None else api_key_from_env()
    server = ServerConfig(host=args.host, port=args.port, api_key=api_key,
                          served_model_name=args.served_model_name, max_queue_len=args.max_queue_len,
                          max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout,
                          log_level=args.log_level, access_log=not args.no_access_log)
    return server, engine


def cmd_build_ext(args) -> int:
    """Ahead-of-time build of the CUDA extension (no GPU needed) into $DDTREE_EXT_DIR, else the package's ext/lib/,
    for $DDTREE_CUDA_ARCH_LIST (default 8.0;9.0+PTX)."""
    from ext import build

    print(f"building the CUDA extension for {build.arch_list()} into {build.output_dir()}", flush=True)
    try:
        path = build.build(verbose=True)
    except build.BuildError as e:
        print(f"ddtree: error: cannot build the CUDA extension: {e}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line on stderr and exit 2 (argparse would add a usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ddtree", description="LLM inference with DDTree speculative decoding")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    g = sub.add_parser("generate", help="generate a completion offline")
    add_engine_flags(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=token_id_list, help="comma-separated prompt token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sampling", type=int, default=None, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and timing")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_flags(s)
    s.set_defaults(drafter=None)  # serve: n-gram drafting unless --drafter or --draft-model says otherwise
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DDTREE_API_KEY, which keeps "
                        "the key out of `ps`)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: from MODEL)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests running in the engine at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    s.add_argument("--kv-cache-memory", type=parse_bytes, default=1 << 30, help="KV cache size, e.g. 512M or 4G")
    s.add_argument("--max-queue-len", type=int, default=1024,
                   help="engine requests in flight (running + waiting) beyond which requests get a 429")
    s.add_argument("--max-body-bytes", type=parse_bytes, default=4 << 20, help="request bodies above get a 413")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds open requests get in total before they are cut")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--no-access-log", action="store_true")
    s.set_defaults(func=cmd_serve)
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
