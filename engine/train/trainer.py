"""The drafter's training loop: AdamW with linear warm-up then cosine decay, batches of the target's responses
with random anchors, the DFlash objective (engine/train/objective.py), bf16 autocast on CUDA and fp32 on CPU,
per-position loss and accuracy logged to `<out>/train_log.jsonl`, checkpoints to resume.

Determinism and resumption: the data order of epoch e is a permutation seeded by (seed, e) and the anchors of
step s are drawn from a generator seeded by (seed, s), so a run resumed from the checkpoint of step s draws the
same batches from s on as an uninterrupted run would.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time

import torch

from engine.speculative.dflash import DFlashConfig, DFlashModel
from engine.train.checkpoint import load_state, save_drafter, save_state
from engine.train.objective import dflash_loss, make_batch

logger = logging.getLogger("ddtree.train")
LOG_FILE = "train_log.jsonl"
INIT_STD = 0.02  # HF's initializer_range for Qwen3/Llama linear layers


def init_drafter(hf_config: dict, seed: int, device) -> DFlashModel:
    """A fresh drafter: linear weights ~ N(0, 0.02), norm weights 1 (as HF initialises a Qwen3 layer)."""
    gen = torch.Generator().manual_seed(seed)
    model = DFlashModel(DFlashConfig.from_hf(hf_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
    model.to(device)
    model.rotary.init_buffers(torch.device(device))
    return model


def lr_lambda(warmup: int, total: int):
    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return scale


class Trainer:
    """Trains a DFlash drafter for `target` (a FrozenTarget) on `seqs` ((ids, prompt length) pairs)."""

    def __init__(self, config, target, hf_config: dict, seqs: list[tuple[list[int], int]], out: str):
        if not seqs:
            raise ValueError("no training sequences: generate responses first (--stages generate train)")
        self.config, self.target, self.hf_config, self.seqs, self.out = config, target, hf_config, seqs, out
        self.device = target.device
        self.model = init_drafter(hf_config, config.seed, self.device)
        with torch.no_grad():  # the drafter's hidden feeds the target's lm_head: start at the target's final scale
            self.model.norm.weight.copy_(target.model.norm.weight.float())
        decay = [p for p in self.model.parameters() if p.dim() > 1]
        no_decay = [p for p in self.model.parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=config.lr,
                                           betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(config.num_warmup_steps, config.max_steps))
        self.step = 0
        state = load_state(out, hf_config)
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            logger.info("resumed drafter training at step %d of %d", self.step, config.max_steps)

    def batch_at(self, step: int):
        """The sequences and anchors of `step` (a pure function of seed and step)."""
        n, size = len(self.seqs), min(self.config.batch_size, len(self.seqs))
        first = step * size
        epoch, offset = divmod(first, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed * 100003 + epoch))
        picks = [order[(offset + i) % n].item() for i in range(size)]  # wraps into the same epoch's order
        anchors = torch.Generator().manual_seed(self.config.seed * 1000003 + step)
        return make_batch([self.seqs[i] for i in picks], self.config.anchors, anchors)

    def train_step(self, step: int):
        batch = self.batch_at(step).to(self.device)
        feats = self.target.features(batch.tokens, batch.lengths)  # [B, T, F] no grad
        cuda = self.device.type == "cuda"
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            metrics = dflash_loss(self.model, self.target, feats, batch, self.config.loss_gamma)
        self.optimizer.zero_grad(set_to_none=True)
        metrics.loss.backward()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def save(self) -> None:
        save_state(self.out, self.step, self.model, self.optimizer, self.scheduler, self.hf_config)
        save_drafter(self.out, self.model, self.hf_config, self.config.save_dtype, self.config.max_shard_mb)

    def run(self) -> dict:
        """Trains to max_steps (from the resumed step); returns the last logged record."""
        from tqdm import tqdm

        c = self.config
        self.model.train()
        window = _Window(c.block_size - 1, self.device)
        last: dict = {}
        start = time.perf_counter()
        with open(os.path.join(self.out, LOG_FILE), "a", encoding="utf-8") as log, \
                tqdm(total=c.max_steps, initial=self.step, desc="train", unit="step") as bar:
            while self.step < c.max_steps:
                window.add(self.train_step(self.step))
                self.step += 1
                bar.update(1)
                if self.step % c.log_every == 0 or self.step == c.max_steps:
                    last = window.record(self.step, self.scheduler.get_last_lr()[0], time.perf_counter() - start)
                    log.write(json.dumps(last) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{last['loss']:.3f}", acc1=f"{last['accuracy'][0]:.2f}",
                                    chain_tau=f"{last['chain_tau']:.2f}")
                    logger.info("step %d loss %.4f accuracy by position %s", self.step, last["loss"],
                                " ".join(f"{a:.2f}" for a in last["accuracy"]))
                    window = _Window(c.block_size - 1, self.device)
                if self.step % c.save_every == 0 or self.step == c.max_steps:
                    self.save()
        if not last:  # resumed at max_steps: the drafter folder is already there
            save_drafter(self.out, self.model, self.hf_config, c.save_dtype, c.max_shard_mb)
        return last


class _Window:
    """Sums of the step metrics since the last log line (kept on the device: no sync per step)."""

    def __init__(self, positions: int, device):
        self.loss = torch.zeros((), device=device)
        self.ce = torch.zeros(positions, device=device)
        self.correct = torch.zeros(positions, device=device)
        self.count = torch.zeros(positions, device=device)
        self.streak = torch.zeros((), device=device)
        self.blocks = torch.zeros((), device=device)
        self.steps = 0

    def add(self, m) -> None:
        self.loss += m.loss.detach().float()
        self.ce += m.ce_sum
        self.correct += m.correct
        self.count += m.count
        self.streak += m.streak_sum
        self.blocks += m.num_blocks
        self.steps += 1

    def record(self, step: int, lr: float, elapsed: float) -> dict:
        count = self.count.clamp(min=1)
        return {"step": step, "lr": lr, "elapsed_s": round(elapsed, 1), "loss": (self.loss / self.steps).item(),
                "ce": (self.ce / count).tolist(), "accuracy": (self.correct / count).tolist(),
                # the chain's expected tokens per step on these blocks: 1 (bonus) + leading correct drafts
                "chain_tau": 1.0 + (self.streak / self.blocks.clamp(min=1)).item()}
