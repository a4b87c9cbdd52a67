"""ModelRunner: owns the model and its paged KV cache; turns a StepPlan into one target forward. Plain
requests (prefill chunks, decode) sample their next token; requests with a tree budget go through DDTree:
draft -> tree -> verify (their tree rows ride in the same forward) -> accept -> KV compaction."""
from __future__ import annotations

import time

import torch

from engine import sampler
from engine.plan import StepPlan, StepResult
from engine.speculative import verify
from engine.speculative.speculator import Speculator, TreeBatch
from ext.metadata import AttentionMetadata, build_metadata


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str, dtype: torch.dtype,
                 speculator: Speculator | None = None):
        self.model, self.device, self.dtype = model, device, dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        self.speculator = speculator
        self.kv_caches = [
            torch.zeros(model.kv_cache_shape(i, num_blocks, block_size), dtype=dtype, device=device)
            for i in range(model.num_layers)
        ]
        # slot-major views [num_blocks * block_size, ...] of every cache tensor, for KV compaction
        self.slot_views = []
        for cache in self.kv_caches:
            parts = [cache[0], cache[1]] if cache.dim() == 5 else [cache]  # GQA [2, NB, bs, H, D]; MLA [NB, bs, C]
            self.slot_views.extend(p.flatten(0, 1) for p in parts)

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        elems = sum(torch.Size(model.kv_cache_shape(i, 1, block_size)).numel() for i in range(model.num_layers))
        return elems * torch.empty((), dtype=dtype).element_size()

    def slot(self, block_ids: list[int], index: int) -> int:
        return block_ids[index // self.block_size] * self.block_size + index % self.block_size

    def release(self, request_id: str) -> None:
        """Forgets per-request drafting state (finish, abort, preemption)."""
        if self.speculator is not None:
            self.speculator.release(request_id)

    def prepare(self, plan: StepPlan, tree: TreeBatch | None = None
                ) -> tuple[torch.Tensor, AttentionMetadata, list[tuple[int, int]]]:
        """Flat input ids, metadata, and each scheduled sequence's (first row, number of rows)."""
        tree_index = {id(s): i for i, s in enumerate(tree.seqs)} if tree is not None else {}
        input_ids, positions, slots, query_lens, seq_lens, tables, masks, rows = [], [], [], [], [], [], [], []
        for s in plan.seqs:
            req, start = s.request, s.request.num_computed_tokens
            if id(s) in tree_index:
                ids, pos, mask = self.speculator.verify_inputs(tree, tree_index[id(s)])
            else:
                ids = req.all_token_ids[start : start + s.num_new_tokens]
                pos, mask = list(range(start, start + len(ids))), None
            n = len(ids)
            rows.append((len(input_ids), n))
            input_ids.extend(ids)
            positions.extend(pos)
            slots.extend(self.slot(req.block_ids, i) for i in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(req.block_ids)
            masks.append(mask)
        meta = build_metadata(positions, slots, query_lens, seq_lens, tables, self.block_size,
                              tree_masks=masks if tree is not None else None, device=self.device)
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), meta, rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        spec = self.speculator
        tree = None
        tree_seqs = [s for s in plan.seqs if s.spec_budget > 0] if spec is not None else []
        if tree_seqs:
            tree = spec.draft(tree_seqs)
        t1 = time.perf_counter()
        input_ids, meta, rows = self.prepare(plan, tree)
        capture = spec.capture_layer_ids if spec is not None else ()
        hidden, captured = self.model(input_ids, meta, self.kv_caches, capture_layer_ids=capture)
        features = torch.cat(captured, dim=-1) if captured else None  # [num_tokens, num_layers * hidden]
        t2 = time.perf_counter()
        # 1. plain sequences: keep their features for the drafter, sample where the chunk reaches the end
        plain = [(s, r) for s, r in zip(plan.seqs, rows) if s.spec_budget == 0 or tree is None]
        if spec is not None:
            for s, (r0, n) in plain:
                spec.record_hidden(s.request.request_id, features[r0 : r0 + n] if features is not None else None)
        sampling = [(s.request, r0 + n - 1) for s, (r0, n) in plain if s.sample]
        if sampling:
            logits = self.model.compute_logits(hidden[[r for _, r in sampling]])  # [num_sampling, vocab] fp32
            tokens, logprobs = sampler.sample(logits, [req for req, _ in sampling])
            for (req, _), t, lp in zip(sampling, tokens, logprobs):
                result.new_token_ids[req.request_id] = [t]
                if lp is not None:
                    result.logprobs[req.request_id] = [lp]
        t3 = time.perf_counter()
        # 2. tree sequences: target token per row, walk, compaction, drafter feedback
        if tree is not None:
            self.accept_trees(tree, [r for s, r in zip(plan.seqs, rows) if s.spec_budget > 0], hidden, features,
                              result)
        t4 = time.perf_counter()
        if tree is not None:
            result.timings.update(draft=tree.draft_s, tree_build=tree.tree_build_s, verify=t2 - t1, accept=t4 - t2)
        else:
            result.timings.update(forward=t2 - t1, sample=t3 - t2)
        return result

    def accept_trees(self, batch: TreeBatch, rows: list[tuple[int, int]], hidden: torch.Tensor,
                     features: torch.Tensor | None, result: StepResult) -> None:
        spec = self.speculator
        logits = [self.model.compute_logits(hidden[r0 : r0 + n]) for r0, n in rows]  # each [n, vocab] fp32
        targets = torch.stack([spec.target_tokens(batch, i, lg) for i, lg in enumerate(logits)])  # [N, B+1]
        walk = verify.accept(batch.tree, targets)
        row_slots, accepted_rows = [], []
        for i, s in enumerate(batch.seqs):
            req, tau = s.request, int(walk.accept_len[i])
            acc = walk.accepted_nodes[i, :tau].tolist()
            emitted = walk.emitted_token_ids[i, :tau].tolist()  # accepted drafts, then the bonus
            start = req.num_computed_tokens
            row_slots.append([self.slot(req.block_ids, start + j) for j in range(batch.num_rows[i])])
            accepted_rows.append(acc)
            result.new_token_ids[req.request_id] = emitted
            result.num_accepted[req.request_id] = tau - 1
            result.num_draft_tokens[req.request_id] = batch.num_rows[i] - 1
            if req.sampling.logprobs is not None:  # token j was chosen at accepted row acc[j]
                result.logprobs[req.request_id] = [
                    sampler.token_logprobs(logits[i][a], t, req.sampling.logprobs) for a, t in zip(acc, emitted)]
            if features is not None:
                spec.record_hidden(req.request_id, features[[rows[i][0] + a for a in acc]])
            result.accept_lengths.append(tau)
            result.tree_nodes.append(batch.num_rows[i] - 1)
            for d in range(tau - 1):
                if d >= len(result.accepted_per_position):
                    result.accepted_per_position.append(0)
                result.accepted_per_position[d] += 1
        spec.compact(self.slot_views, row_slots, accepted_rows)
