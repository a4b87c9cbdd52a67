"""`ddtree` command line: parse flags into the config dataclasses and run a subcommand.
Every user-facing failure (bad flag value, missing or corrupt checkpoint, unsupported config) is one line on
stderr and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


# `ddtree serve`'s own defaults where they differ from the library's (each default lives here or in the
# config dataclasses, nowhere else): serve speculates with the n-gram drafter unless told otherwise. The embedded
# model's shipped DFlash drafter is opt-in (`--drafter dflash`): on a CPU it measured 0.82-0.84x speculation off on
# bench/serve.py's chat mix, where the n-gram drafter measured 1.10x (docs/BENCHMARKS.md, "Shipped drafter").
SERVE_SPEC_DEFAULTS = {"drafter": "ngram"}


def add_engine_flags(p: argparse.ArgumentParser, spec_defaults: dict | None = None) -> None:
    from engine.config import EngineConfig, SpecConfig
    from server.flags import add_flags

    add_flags(p, EngineConfig)
    add_flags(p, SpecConfig, defaults=spec_defaults)


def engine_config(args, spec_defaults: dict | None = None):
    """EngineConfig from the parsed flags. Without --drafter, --draft-model means dflash."""
    from engine.config import EngineConfig, SpecConfig
    from server.flags import build

    defaults = dict(spec_defaults or {})
    if getattr(args, "draft_model", None) and not hasattr(args, "drafter"):
        defaults["drafter"] = "dflash"
    return build(EngineConfig, args, spec=build(SpecConfig, args, defaults))


def token_id_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_generate(args) -> int:
    import dataclasses

    from engine import LLM, SamplingParams

    config = engine_config(args)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed_sampling)
    drafter = None
    if config.spec.drafter == "oracle":
        # the oracle proposes a golden continuation: the target's own plain output, computed first
        from engine.speculative.oracle import OracleDrafter

        plain = LLM(config=dataclasses.replace(config, spec=dataclasses.replace(config.spec, drafter="none")))
        prompt_ids = args.prompt_ids or plain.encode(args.prompt, args.chat)
        golden = prompt_ids + plain.generate([prompt_ids], sampling)[0].token_ids
        drafter = OracleDrafter(lambda req: golden, plain.engine.vocab_size, horizon=7)
    llm = LLM(config=config, drafter=drafter)
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


def cmd_serve(args) -> int:
    from engine.ranks import torchrun_launch
    from server.serve import exit_now, serve

    server, engine = serve_configs(args)
    launch = torchrun_launch()
    if launch is not None and launch.rank > 0:  # torchrun's other ranks: an engine that follows rank 0's, no HTTP
        from engine.ranks import follow_launched

        return follow_launched(engine, launch, server.log_level.upper())
    exit_now(serve(server, engine))


def serve_configs(args):
    """(ServerConfig, EngineConfig) for `ddtree serve` from its parsed flags; ValueError for a bad setup."""
    from server.config import ServerConfig, api_key_from_env
    from server.flags import build

    engine = engine_config(args, SERVE_SPEC_DEFAULTS)
    if engine.spec.drafter == "oracle":
        raise ValueError("--drafter oracle cannot serve: it replays golden continuations, which only "
                         "`ddtree generate` and the tests have; use ngram, dflash (--draft-model) or none")
    if engine.model is not None and not os.path.exists(os.path.expanduser(engine.model)):
        raise ValueError(f"{engine.model}: no such file or directory (expected an HF folder or a .gguf file)")
    server = build(ServerConfig, args)
    if server.api_key is None and api_key_from_env() is not None:
        server = build(ServerConfig, args, api_key=api_key_from_env())
    if server.chat_template is not None:  # an unreadable path or a Jinja syntax error: fail before loading
        from server.tokenizer import load_chat_template

        load_chat_template(server.chat_template)
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


def cmd_train_drafter(args) -> int:
    """Generate the target's responses, train a DFlash drafter on them, measure its tau (engine/train/run.py)."""
    import logging

    from engine.train.config import TrainConfig
    from engine.train.run import train_drafter
    from server.flags import build

    config = build(TrainConfig, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = train_drafter(config)
    print(json.dumps({k: v for k, v in summary.items() if k != "eval"}))
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
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the CLI's default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sampling", type=int, default=None, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and timing")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_flags(s, SERVE_SPEC_DEFAULTS)
    from server.config import ServerConfig
    from server.flags import add_flags

    add_flags(s, ServerConfig)
    s.set_defaults(func=cmd_serve)
    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (responses, training, tau)")
    from engine.train.config import TrainConfig

    add_flags(t, TrainConfig)
    t.set_defaults(func=cmd_train_drafter)
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
