"""W4A16 against bf16, end to end and per layer, in the same run on one GPU: a Qwen3-8B-shaped checkpoint written
in compressed-tensors pack-quantized INT4 (random int4 values, group-128 scales; embeddings and lm_head bf16, as
published INT4 checkpoints keep them) is loaded like any checkpoint (its linears become Int4Linear layers running
ext.ops.w4a16_gemm for up to 8 rows), beside the same shapes with dummy bf16 weights. Plain greedy decoding,
tokens/s at each batch size; then each Qwen3-8B linear as a CUDA graph, W4A16 vs bf16 F.linear. Prints JSON lines.

    python bench/int4_e2e.py [--batch 1 4 8 16] [--folder /tmp/qwen3-8b-int4]
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
import torch.nn.functional as F  # noqa: E402

from bench.e2e import emit, prompts, timed, weight_bytes  # noqa: E402
from bench.fp8_gemm import graph_time_ms  # noqa: E402
from bench.gpu_serving import QWEN3_8B, free_engine_memory  # noqa: E402
from engine import LLM  # noqa: E402
from engine.model.int4_linear import Int4Linear, int4_modules  # noqa: E402

GROUP = 128
QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
             "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}
LINEARS = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
           "gate_proj": (12288, 4096), "up_proj": (12288, 4096), "down_proj": (4096, 12288)}


def packed_linear(out_dim: int, in_dim: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random int4 values (any 32-bit word is 8 valid nibbles) and scales near what real weights get."""
    words = torch.randint(-2**31, 2**31 - 1, (out_dim, in_dim // 8), generator=g, dtype=torch.int64)
    scale = (torch.rand(out_dim, in_dim // GROUP, generator=g) * 0.004 + 0.001).to(torch.bfloat16)
    return {"weight_packed": words.to(torch.int32), "weight_scale": scale,
            "weight_shape": torch.tensor([out_dim, in_dim], dtype=torch.int64)}


def write_checkpoint(folder: str) -> None:
    from safetensors.torch import save_file

    cfg = dict(QWEN3_8B, quantization_config=QUANT)
    g = torch.Generator().manual_seed(0)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    state = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16),
             "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16),
             "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for name, (out_dim, in_dim) in LINEARS.items():
            module = prefix + ("mlp." if name.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn.") + name
            state.update({f"{module}.{k}": v for k, v in packed_linear(out_dim, in_dim, g).items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[prefix + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            state[prefix + norm + ".weight"] = torch.ones(cfg["head_dim"], dtype=torch.bfloat16)
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def decode(args, folder: str, load_format: str, label: str) -> None:
    llm = LLM(folder, device="cuda", load_format=load_format, max_num_seqs=max(args.batch), max_model_len=4096)
    emit(bench="int4_e2e", model=label, weight_gb=round(weight_bytes(llm.engine.model) / 1e9, 3),
         int4_linears=len(int4_modules(llm.engine.model)), cuda_graphs=llm.engine.runner.graphs is not None)
    for batch in args.batch:
        elapsed, outs = timed(llm, prompts(llm.engine.vocab_size, batch, args.prompt_len), args.new_tokens)
        tokens = sum(len(o.token_ids) for o in outs)
        emit(bench="int4_e2e", model=label, mode="plain", batch=batch, tok_s=round(tokens / elapsed, 1),
             ms_per_step=round(elapsed / args.new_tokens * 1e3, 3))
    del llm
    free_engine_memory()


def layers(args) -> None:
    g = torch.Generator().manual_seed(1)
    for name, (out_dim, in_dim) in LINEARS.items():
        stored = packed_linear(out_dim, in_dim, g)
        layer = Int4Linear(in_dim, out_dim, GROUP, bias=False, device="cuda")
        with torch.no_grad():
            layer.weight_packed.copy_(stored["weight_packed"])
            layer.weight_scale.copy_(stored["weight_scale"].float())
        dense = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
        for rows in args.batch:
            x = torch.randn(rows, in_dim, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                bf16_us = graph_time_ms(lambda t: F.linear(t, dense), x) * 1e3
                int4_us = graph_time_ms(layer, x) * 1e3
            emit(bench="int4_layer", layer=name, out=out_dim, **{"in": in_dim}, tokens=rows,
                 bf16_us=round(bf16_us, 1), int4_us=round(int4_us, 1), ratio=round(int4_us / bf16_us, 2),
                 int4_weight_gbs=round(out_dim * in_dim / 2 / (int4_us * 1e-6) / 1e9))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--folder", default=None, help="where the INT4 checkpoint is written (default: a temp dir)")
    args = p.parse_args()
    emit(bench="device", name=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    layers(args)
    folder = args.folder or tempfile.mkdtemp(prefix="qwen3-8b-int4-")
    os.makedirs(folder, exist_ok=True)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        write_checkpoint(folder)
    dense = tempfile.mkdtemp(prefix="qwen3-8b-bf16-")
    with open(os.path.join(dense, "config.json"), "w") as f:
        json.dump(QWEN3_8B, f)
    decode(args, folder, "auto", "Qwen3-8B shape, INT4 W4A16 (group 128)")
    decode(args, dense, "dummy", "Qwen3-8B shape, bf16 (dummy weights)")


if __name__ == "__main__":
    main()
