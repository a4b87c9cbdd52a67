"""Drafters shipped inside the package, for targets that ship with it.

`smollm2-135m-instruct/`: a DFlash drafter (published layout: config.json with dflash_config, safetensors shards)
for the embedded SmolLM2-135M-Instruct, trained on the H200 with `ddtree train-drafter` on the model's own greedy
responses to ShareGPT first user turns (the held-out split of engine/train/prompts.py excluded). Its training
command, seed and measured tau are in docs/BENCHMARKS.md ("Shipped drafter"). `--drafter dflash` without
`--draft-model` on the embedded model loads it.
"""
from __future__ import annotations

import os

EMBEDDED_DRAFTER = "smollm2-135m-instruct"


def shipped_drafter_dir() -> str:
    """Folder of the drafter shipped for the embedded model."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), EMBEDDED_DRAFTER)
