"""ModelRunner: owns the model and its paged KV cache; turns a StepPlan into one target forward and the
sampled tokens. Speculative steps (draft -> tree -> verify -> accept) go through `engine.spec` when enabled."""
from __future__ import annotations

import time

import torch

from engine import sampler
from engine.plan import StepPlan, StepResult
from ext.metadata import AttentionMetadata, build_metadata


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str, dtype: torch.dtype):
        self.model, self.device, self.dtype = model, device, dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_caches = [
            torch.zeros(model.kv_cache_shape(i, num_blocks, block_size), dtype=dtype, device=device)
            for i in range(model.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        elems = sum(torch.Size(model.kv_cache_shape(i, 1, block_size)).numel() for i in range(model.num_layers))
        return elems * torch.empty((), dtype=dtype).element_size()

    def slot(self, block_ids: list[int], index: int) -> int:
        return block_ids[index // self.block_size] * self.block_size + index % self.block_size

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, metadata, and the row of each sampling sequence's last token."""
        input_ids, positions, slots, query_lens, seq_lens, tables, sample_rows = [], [], [], [], [], [], []
        for s in plan.seqs:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.slot(req.block_ids, i) for i in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(req.block_ids)
            if s.sample:
                sample_rows.append(len(input_ids) - 1)
        meta = build_metadata(positions, slots, query_lens, seq_lens, tables, self.block_size, device=self.device)
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), meta, sample_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        t0 = time.perf_counter()
        input_ids, meta, sample_rows = self.prepare(plan)
        hidden, _ = self.model(input_ids, meta, self.kv_caches)
        t1 = time.perf_counter()
        sampling = [s.request for s in plan.seqs if s.sample]
        if sampling:
            logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampling, vocab] fp32
            tokens, logprobs = sampler.sample(logits, sampling)
            for req, t, lp in zip(sampling, tokens, logprobs):
                result.new_token_ids[req.request_id] = [t]
                if lp is not None:
                    result.logprobs[req.request_id] = [lp]
        result.timings = {"forward": t1 - t0, "sample": time.perf_counter() - t1}
        return result
