"""CPU decode throughput of the embedded SmolLM2-135M-Instruct: our engine against transformers' `generate`
on the same machine in the same run (greedy, batch 1, N new tokens). Prints a table; not a test.

    .venv/bin/python bench/decode.py [--new-tokens 128] [--repeats 3] [--drafter ngram]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.model.embedded import embedded_model_dir  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def time_hf(model, prompt_ids, new_tokens):
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return time.perf_counter() - t0, out[0, len(prompt_ids):].tolist()


def time_ours(llm, prompt_ids, new_tokens):
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt_ids], SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - t0, out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drafter", default="none")
    args = ap.parse_args()
    folder = embedded_model_dir()
    llm = LLM(None, dtype="fp32", drafter=args.drafter)
    prompt_ids = llm.encode(PROMPT, chat=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    time_hf(hf, prompt_ids, 8)  # warm-up both
    time_ours(llm, prompt_ids, 8)
    hf_times, our_times, same = [], [], True
    for _ in range(args.repeats):  # alternate to cancel drift
        t, ref = time_hf(hf, prompt_ids, args.new_tokens)
        hf_times.append(t)
        t, ours = time_ours(llm, prompt_ids, args.new_tokens)
        our_times.append(t)
        same &= ours == ref
    hf_tps = args.new_tokens / statistics.median(hf_times)
    our_tps = args.new_tokens / statistics.median(our_times)
    print(f"SmolLM2-135M-Instruct fp32, batch 1, prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"| engine | tokens/s | ratio |\n|---|---|---|")
    print(f"| transformers {transformers.__version__} generate | {hf_tps:.1f} | 1.00x |")
    print(f"| ddtree (drafter={args.drafter}) | {our_tps:.1f} | {our_tps / hf_tps:.2f}x |")
    print(f"greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
