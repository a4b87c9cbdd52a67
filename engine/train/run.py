"""`ddtree train-drafter`: the three stages over one loaded target.

  1. generate: the target answers the training split's prompts through our engine (responses.jsonl, resumable);
  2. train: a DFlash drafter learns to predict those responses (train_state.pt, train_log.jsonl and the drafter
     itself in the published layout: config.json + model.safetensors);
  3. eval: tau of the chain and of DDTree on held-out prompts, through the engine (eval.json).

The target is loaded once; the engine's KV cache of stage 1 is released before training starts.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os

import torch

from engine.config import EngineConfig
from engine.train.config import TrainConfig

logger = logging.getLogger("ddtree.train")
EVAL_FILE = "eval.json"


def engine_config(config: TrainConfig) -> EngineConfig:
    """The engine settings of generation and evaluation (greedy or seeded sampling, no speculation)."""
    return EngineConfig(model=config.target, dtype=config.dtype, device=config.device, seed=config.seed,
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(2048, config.max_num_seqs * 32))


def drafter_config(config: TrainConfig, loaded) -> dict:
    """config.json of the drafter to train (published DFlash layout) for the target `loaded`."""
    from engine.speculative.dflash_files import dflash_config_dict
    from engine.train.target import default_mask_token_id, default_target_layer_ids

    model = loaded.model
    layer_ids = config.target_layer_ids or default_target_layer_ids(model.num_layers)
    mask = config.mask_token_id if config.mask_token_id is not None else \
        default_mask_token_id(loaded.tokenizer, model.vocab_size)
    if not 0 <= mask < model.vocab_size:
        raise ValueError(f"mask_token_id {mask} is outside the target's vocabulary (size {model.vocab_size})")
    cfg = dflash_config_dict(loaded.hf_config, num_layers=config.num_layers, block_size=config.block_size,
                             mask_token_id=mask, target_layer_ids=layer_ids)
    cfg["vocab_size"] = model.vocab_size
    cfg["num_target_layers"] = model.num_layers
    return cfg


def _release(device: str) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def train_drafter(config: TrainConfig) -> dict:
    """Runs the configured stages; returns a summary (responses counts, last training record, eval results)."""
    from engine.core import EngineCore
    from engine.model.loader import load_model
    from engine.train import responses
    from engine.train.prompts import load_prompts, split

    os.makedirs(config.out, exist_ok=True)
    engine = engine_config(config)
    loaded = load_model(config.target, engine.dtype, config.device)
    prompts = load_prompts(config.prompts) if {"generate", "eval"} & set(config.stages) else []
    train_prompts, heldout = split(prompts)
    if config.max_prompts is not None:
        train_prompts = train_prompts[:config.max_prompts]
    logger.info("prompts: %d for training, %d held out", len(train_prompts), len(heldout))
    summary: dict = {"train_prompts": len(train_prompts), "heldout_prompts": len(heldout)}
    path = os.path.join(config.out, responses.RESPONSES_FILE)
    if "generate" in config.stages:
        core = EngineCore(engine, loaded=loaded)
        summary["responses"] = responses.generate_responses(
            core, train_prompts, path, chat=config.chat, max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature, max_in_flight=config.max_num_seqs)
        del core
        _release(config.device)
    draft_cfg = drafter_config(config, loaded)
    if "train" in config.stages:
        summary["train"] = _train(config, loaded, draft_cfg, path)
        _release(config.device)
    if "eval" in config.stages:
        summary["eval"] = _evaluate(config, loaded, engine, heldout)
    return summary


def _train(config: TrainConfig, loaded, draft_cfg: dict, path: str) -> dict:
    from engine.train.responses import training_sequences
    from engine.train.target import FrozenTarget
    from engine.train.trainer import Trainer

    seqs = training_sequences(path, config.max_seq_len)
    logger.info("training on %d sequences (%d response tokens)", len(seqs), sum(len(i) - p for i, p in seqs))
    target = FrozenTarget(loaded.model, draft_cfg["dflash_config"]["target_layer_ids"])
    trainer = Trainer(config, target, draft_cfg, seqs, config.out)
    last = trainer.run()
    del trainer, target
    return last


def _evaluate(config: TrainConfig, loaded, engine: EngineConfig, heldout) -> list[dict]:
    from engine.train.evaluate import TABLE_HEADER, evaluate_drafter
    from engine.train.responses import encode_prompt

    if not os.path.isfile(os.path.join(config.out, "config.json")):
        raise ValueError(f"{config.out}: no trained drafter to evaluate (run the train stage first)")
    ids = [encode_prompt(loaded.tokenizer, p, config.chat) for p in heldout]
    ids = [i for i in ids if len(i) <= config.max_prompt_tokens][:config.eval_prompts]
    if not ids:
        raise ValueError("no held-out prompts to evaluate on (the prompt sources hold none, or all are too long)")
    results = evaluate_drafter(loaded, dataclasses.replace(engine, enable_prefix_caching=False), config.out, ids,
                               budget=config.eval_budget, max_tokens=config.eval_max_tokens,
                               concurrency=config.max_num_seqs, seed=config.seed)
    records = [dataclasses.asdict(m) for m in results]
    with open(os.path.join(config.out, EVAL_FILE), "w") as f:
        json.dump({"heldout_prompts": len(ids), "results": records}, f, indent=2)
    print(TABLE_HEADER)
    for m in results:
        print(m.row())
    return records
