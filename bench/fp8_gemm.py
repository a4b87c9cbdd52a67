"""FP8 block-scaled linear layers (engine/model/fp8_linear.py: per-token 1x128 activation quantization + torch's
blockwise _scaled_mm) against the bf16 linear of the same weights, at DeepSeek-V3's projection shapes and
several token counts. Each layer runs inside a CUDA graph (as decode steps do), timed with CUDA events; prints
a markdown table and, with --json, one JSON line per shape.

    python bench/fp8_gemm.py [--tokens 1 16 64 256 1024] [--json out.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.fp8 import dequantize_block_fp8, quantize_block_fp8  # noqa: E402
from engine.model.fp8_linear import Fp8BlockLinear  # noqa: E402

# (name, out_features, in_features): DeepSeek-V3 / Kimi-K2 (hidden 7168, q_lora 1536, 128 heads)
SHAPES = [
    ("q_a_proj", 1536, 7168),
    ("q_b_proj", 24576, 1536),
    ("o_proj", 7168, 16384),
    ("dense gate_up", 36864, 7168),
    ("dense down", 7168, 18432),
    ("shared gate_up", 4096, 7168),
    ("shared down", 7168, 2048),
]


def graph_time_ms(fn, x: torch.Tensor, iters: int = 200) -> float:
    """Mean milliseconds of fn(x) replayed as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    out = open(args.json, "w") if args.json else None
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("| layer | out x in | tokens | bf16 us | fp8 us | fp8 / bf16 | weight GB/s bf16 | fp8 |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        q, scale_inv = quantize_block_fp8(w)
        layer = Fp8BlockLinear(k, n, bias=False, device=device)
        with torch.no_grad():
            layer.weight.copy_(q.to(device))
            layer.weight_scale_inv.copy_(scale_inv.to(device))
        w_bf16 = dequantize_block_fp8(q, scale_inv, (128, 128)).to(device, torch.bfloat16)
        for m in args.tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                bf16_ms = graph_time_ms(lambda t: F.linear(t, w_bf16), x)
                fp8_ms = graph_time_ms(layer, x)
            row = {"layer": name, "out": n, "in": k, "tokens": m, "bf16_us": bf16_ms * 1e3, "fp8_us": fp8_ms * 1e3,
                   "bf16_weight_gbs": n * k * 2 / bf16_ms / 1e6, "fp8_weight_gbs": n * k / fp8_ms / 1e6}
            print(f"| {name} | {n}x{k} | {m} | {row['bf16_us']:.1f} | {row['fp8_us']:.1f} | "
                  f"{fp8_ms / bf16_ms:.2f} | {row['bf16_weight_gbs']:.0f} | {row['fp8_weight_gbs']:.0f} |")
            if out:
                out.write(json.dumps(row) + "\n")
        del w_bf16, layer
    if out:
        out.close()


if __name__ == "__main__":
    main()
