"""Device time of each captured graph a decoding step replays, per bucket: the forward (plain decoding at both
context capacities, tree widths), a plain step's sampling epilogue per variant, and a whole round's prologue and
epilogue per variant (argmax; the sampler's draw at T > 0; with top-k/top-p, which sorts every row). What a
root-only step (width 1, leaving trees ahead) costs against a plain step, and what choosing tokens at T > 0 costs
a tree step. SmolLM2 shape (or Qwen3-8B's), dummy bf16 weights; graphs replay over whatever their static buffers
hold (timing only). One JSON line per graph; not a test.

    python bench/round_phases.py [--qwen3-8b] [--batch 1 16 64] [--widths 1 17]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def device_ms(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """Median device time of one replay (CUDA events around each, the stream idle before)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def main() -> None:
    from bench.gpu_serving import QWEN3_8B, SMOLLM2_135M
    from bench.step import FixedTreeDrafter
    from engine import LLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qwen3-8b", action="store_true")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 17], help="round widths (budget + 1)")
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args()
    cfg = QWEN3_8B if args.qwen3_8b else SMOLLM2_135M
    folder = tempfile.mkdtemp(prefix="round-phases-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = LLM(folder, load_format="dummy", device="cuda", max_num_seqs=max(args.batch),
              max_model_len=args.max_model_len, drafter=FixedTreeDrafter(cfg["vocab_size"], 8, "cuda"),
              spec_budget=16, adaptive=False)
    runner = llm.engine.runner
    graphs, plain, rounds = runner.graphs, runner.plain_graphs, runner.rounds
    for n in args.batch:
        for key in sorted(k for k in graphs.graphs if k[0] == n):
            record = dict(batch=n, width=key[1], context=key[2])
            print(json.dumps({**record, "graph": "forward", "ms": round(device_ms(graphs.graphs[key].graph), 4)}),
                  flush=True)
            for (pkey, variant), (graph, _) in sorted(plain.epilogues.items()):
                if pkey == key:
                    print(json.dumps({**record, "graph": f"plain sampling: {variant}",
                                      "ms": round(device_ms(graph), 4)}), flush=True)
            rnd = rounds.rounds.get(key)
            if rnd is None or key[1] not in args.widths:
                continue
            print(json.dumps({**record, "graph": "round prologue", "ms": round(device_ms(rnd.prologue), 4)}),
                  flush=True)
            for variant, (graph, _) in sorted(rnd.epilogues.items()):
                print(json.dumps({**record, "graph": f"round epilogue: {variant}", "ms": round(device_ms(graph), 4)}),
                      flush=True)


if __name__ == "__main__":
    main()
