"""What drafter training writes to its output folder, and reads back on a restart.

- The drafter, in the published DFlash layout (ddtree.md §1.5): config.json (with dflash_config {mask_token_id,
  target_layer_ids}, block_size, num_target_layers) and model.safetensors, or model-0000i-of-0000n.safetensors
  shards with model.safetensors.index.json when a shard size is given. Written into a temporary sibling and moved
  in file by file (weights first, config.json last), so `--draft-model DIR` never reads a half-written weight file;
  stale shards of an earlier layout are removed.
- train_state.pt: the step, the fp32 drafter weights, the AdamW and LR-schedule states and the drafter's config,
  written to a temporary file and renamed (a run killed mid-save keeps the previous checkpoint).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_FILE = "train_state.pt"
INDEX_FILE = "model.safetensors.index.json"


def _shards(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    if max_bytes is None:
        return [state]
    shards, size = [{}], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_drafter(folder: str, model: torch.nn.Module, hf_config: dict, dtype: str = "bf16",
                 max_shard_mb: int | None = None) -> list[str]:
    """Writes the drafter's weights (parameter names = checkpoint names) and config.json; returns the files."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = {name: p.detach().to("cpu", DTYPES[dtype]).contiguous() for name, p in model.named_parameters()}
    shards = _shards(state, None if max_shard_mb is None else max_shard_mb << 20)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    cfg = dict(hf_config, torch_dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    tmp = tempfile.mkdtemp(prefix=".drafter-", dir=folder)
    try:
        for name, shard in zip(names, shards):
            save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        keep = set(names) | ({INDEX_FILE} if len(shards) > 1 else set())
        for old in os.listdir(folder):  # weights of an earlier layout would be read beside the new ones
            if (old.endswith(".safetensors") or old == INDEX_FILE) and old not in keep:
                os.remove(os.path.join(folder, old))
        for name in sorted(keep) + ["config.json"]:
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(keep) + ["config.json"]


def save_state(folder: str, step: int, model, optimizer, scheduler, hf_config: dict) -> None:
    path = os.path.join(folder, STATE_FILE)
    state = {"step": step, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "drafter_config": hf_config}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def architecture(hf_config: dict) -> dict:
    """The parts of a drafter config a resumed run must share with the checkpoint."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "block_size", "num_target_layers")
    return {k: hf_config.get(k) for k in keys} | {"dflash_config": hf_config.get("dflash_config")}


def load_state(folder: str, hf_config: dict) -> dict | None:
    """The checkpoint in `folder`, or None. A checkpoint of another drafter architecture is a one-line error."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    theirs, ours = architecture(state["drafter_config"]), architecture(hf_config)
    diff = [k for k in ours if ours[k] != theirs.get(k)]
    if diff:
        k = diff[0]
        raise ValueError(f"{path}: the checkpoint is for another drafter ({k} {theirs.get(k)} here, {ours[k]} asked "
                         f"for); use a new --out folder or the checkpoint's settings")
    return state
