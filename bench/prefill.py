"""Time to first token of one long prompt, measured in the engine (no HTTP): the paged attention kernel for every
prefill chunk (--dense-prefill-min-tokens 0) against the dense-prefill route (whole prompts through torch's cuDNN
attention, else FlashAttention) in the same run. A prompt longer than the step budget is chunked: its first chunk
takes the route, later chunks (after cached context) gather their context and take FlashAttention. The first
prompt of each length is timed apart (a cuDNN plan or cuBLAS choice not made at startup shows there). Prints JSON
lines and a table; not a test.

    python bench/prefill.py --qwen3-8b --lengths 2048 4096 8192 16384 32768
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.gpu_serving import add_shape_args, free_engine_memory, shape_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from ext import ops  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_to_first_token(llm: LLM, prompt: list[int]) -> float:
    """Seconds from add_request to the first token on the host (the engine otherwise idle)."""
    engine = llm.engine
    sync()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False))
    req = engine.requests[rid]
    while not req.output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--min-tokens", type=int, default=2048, help="--dense-prefill-min-tokens of the routed run")
    p.add_argument("--repeats", type=int, default=5, help="timed prompts per length, after the first")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("ddtree.engine").setLevel(logging.INFO)  # the warm-up's timings

    model, load_format = shape_model(args, "prefill-shape-")
    rows = []
    for min_tokens in (0, args.min_tokens):
        llm = LLM(model, load_format=load_format, device=args.device, max_num_seqs=1, enable_prefix_caching=False,
                  max_model_len=max(args.lengths) + 16, dense_prefill_min_tokens=min_tokens)
        vocab = llm.engine.vocab_size
        for length in args.lengths:
            gen = torch.Generator().manual_seed(length)
            prompts = [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(args.repeats + 1)]
            before = ops.cuda_calls()
            first = time_to_first_token(llm, prompts[0])
            times = [time_to_first_token(llm, prompt) for prompt in prompts[1:]]
            calls = {k: v - before.get(k, 0) for k, v in ops.cuda_calls().items()
                     if k.startswith("dense_prefill") and v != before.get(k, 0)}
            row = dict(bench="prefill", dense_prefill_min_tokens=min_tokens, L=length, first_ms=first * 1e3,
                       ttft_ms=statistics.median(times) * 1e3, tokens_per_s=length / statistics.median(times),
                       dense_calls=calls)
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del llm
        free_engine_memory()
    print("\n| L | TTFT ms, paged kernel | TTFT ms, dense route | speedup | first prompt ms (kernel / route) |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        base, routed = (next(r for r in rows if r["L"] == length and r["dense_prefill_min_tokens"] == m)
                        for m in (0, args.min_tokens))
        print(f"| {length} | {base['ttft_ms']:.1f} | {routed['ttft_ms']:.1f} | {base['ttft_ms'] / routed['ttft_ms']:.2f}x "
              f"| {base['first_ms']:.1f} / {routed['first_ms']:.1f} |")


if __name__ == "__main__":
    main()
