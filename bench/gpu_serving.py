"""[gpu-serving] numbers: the KV cache a Qwen3-8B-shaped model gets at the default --gpu-memory-utilization (and
its maximum concurrency at a 32k context), and decode tokens/s at T=0 against T=1 (top_p 0.9), with DDTree on
(n-gram drafter, a prompt that repeats itself so drafts get accepted) and off, on a real model. Prints JSON
lines; not a test.

    python bench/gpu_serving.py capacity --device cuda                       # Qwen3-8B shape, dummy weights
    python bench/gpu_serving.py decode --model SmolLM2.gguf --device cuda --batch 1 16
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.host_timers import host_speed_us  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-05,
                "max_position_embeddings": 65536, "vocab_size": 49152, "tie_word_embeddings": True,
                "rope_theta": 100000.0, "torch_dtype": "bfloat16"}
COPY_PROMPT = ("Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
               "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine.")


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """--model, or a dummy-weight shape: --qwen3-8b, --smollm2, --dummy-config (one required)."""
    shape = p.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model", help="HF folder or GGUF")
    shape.add_argument("--qwen3-8b", action="store_true", help="Qwen3-8B shape, dummy bf16 weights")
    shape.add_argument("--smollm2", action="store_true", help="SmolLM2-135M shape, dummy bf16 weights")
    shape.add_argument("--dummy-config", help="a config.json of any supported shape, dummy weights")


def shape_model(args, prefix: str) -> tuple[str, str]:
    """(model path, load format) for add_shape_args' choice: a temporary folder holding the shape's config.json
    (load_format "dummy") unless --model was given."""
    if args.model is not None:
        return args.model, "auto"
    if args.dummy_config:
        with open(args.dummy_config) as f:
            cfg = json.load(f)
    else:
        cfg = QWEN3_8B if args.qwen3_8b else SMOLLM2_135M
    folder = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder, "dummy"


def free_engine_memory() -> None:
    """After the last reference to an LLM is dropped: collects anything a cycle might still hold (the engine has
    none: tests/engine/test_lifetime.py, with emulated graphs and steps launched ahead too; captured CUDA graphs
    themselves are not covered there) and hands the freed blocks back to the device, so the next engine of the run
    sizes its KV cache from the whole memory."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def capacity(args) -> None:
    folder = tempfile.mkdtemp(prefix="qwen3-8b-shape-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(QWEN3_8B, f)
    t0 = time.perf_counter()
    llm = LLM(folder, device=args.device, load_format="dummy", max_model_len=32768)
    plan = llm.engine.kv_plan
    print(json.dumps({"bench": "capacity", "model": "Qwen3-8B shape (dummy bf16)", "device": args.device,
                      "gpu_memory_utilization": llm.config.gpu_memory_utilization, "kv_blocks": plan.num_blocks,
                      "kv_tokens": plan.num_tokens, "kv_gib": round(plan.num_bytes / 2**30, 2),
                      "max_concurrency_at_32k": round(plan.max_concurrency(32768), 2),
                      "startup_s": round(time.perf_counter() - t0, 1)}), flush=True)


def decode(args) -> None:
    for name in args.drafters:
        drafter, _, variant = name.partition(":")
        kwargs = {"spec_guard": False} if variant == "noguard" else {}
        llm = LLM(args.model, device=args.device, drafter=drafter, spec_budget=args.budget, **kwargs)
        prompt = llm.encode(COPY_PROMPT, chat=True)
        for batch in args.batch:
            for temperature in (0.0, 1.0):
                sp = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_p=0.9, seed=1,
                                    ignore_eos=True)
                llm.engine.budgets.reset()  # each configuration learns its own costs and acceptance
                llm.generate([prompt], SamplingParams(max_tokens=8, temperature=temperature))  # warm-up
                for rnd in range(args.rounds):  # rounds after the first keep what the budget and its guard learned
                    t0 = time.perf_counter()
                    outs = llm.generate([prompt] * batch, sp)
                    elapsed = time.perf_counter() - t0
                    tokens = sum(len(o.token_ids) for o in outs)
                    steps = sum(o.stats["steps"] for o in outs)  # every request's, not the first one's
                    print(json.dumps({"bench": "decode", "model": os.path.basename(str(args.model)), "drafter": name,
                                      "budget": args.budget if drafter != "none" else 0, "batch": batch,
                                      "temperature": temperature, "round": rnd,
                                      "tokens_per_s": round(tokens / elapsed, 1), "steps": round(steps / len(outs), 1),
                                      "mean_accept_length": round(tokens / steps, 2),
                                      "host_probe_us": round(host_speed_us(3))}),
                          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["capacity", "decode"])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1,
                   help="batches run back to back per configuration after one reset: round 0 pays the adaptive "
                        "budget's and its guard's learning, later rounds show the state a running server reaches")
    p.add_argument("--drafters", nargs="+", default=["none", "ngram"],
                   help="none, ngram, ngram:noguard (the adaptive budget without its throughput guard)")
    args = p.parse_args()
    capacity(args) if args.what == "capacity" else decode(args)


if __name__ == "__main__":
    main()
