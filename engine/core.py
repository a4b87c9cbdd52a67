"""EngineCore: the step loop. step() = scheduler.schedule() -> runner.execute(plan) -> scheduler.update(result),
returning what changed for each request. It owns the loaded model, the KV cache and the scheduler."""
from __future__ import annotations

import time

import torch

from engine.block_manager import BlockManager
from engine.config import CPU_KV_CACHE_MEMORY, EngineConfig
from engine.messages import Delta, RequestError, StepStats
from engine.model.loader import load_model, resolve_dtype
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.speculative.drafter import make_drafter
from engine.speculative.speculator import Speculator


def eos_token_ids(hf_config: dict, tokenizer) -> tuple[int, ...]:
    ids = set()
    eos = hf_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None, drafter=None):
        self.config = config
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.loaded = loaded or load_model(config.model, self.dtype, config.device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        cfg = self.loaded.hf_config
        self.max_model_len = config.max_model_len or min(cfg.get("max_position_embeddings") or 2048, 32768)
        self.eos_token_ids = eos_token_ids(cfg, self.tokenizer)
        # never more blocks than max_num_seqs full-length sequences can use
        useful = -(-config.max_num_seqs * self.max_model_len // config.block_size)
        per_block = ModelRunner.kv_bytes_per_block(self.model, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or max(1, min(useful, (config.kv_cache_memory or CPU_KV_CACHE_MEMORY) // per_block))
        self.speculator = self.make_speculator(drafter)
        # a drafter fed by target features needs them for every prompt token, so cached prefixes would starve it
        needs_features = self.speculator is not None and bool(self.speculator.capture_layer_ids)
        self.blocks = BlockManager(num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching and not needs_features)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.device, self.dtype,
                                  self.speculator)
        max_budget = 0 if self.speculator is None else self.speculator.max_budget
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, max_budget)
        self.rng = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.request_errors: list[RequestError] = []  # requests that failed while the engine went on

    def pop_request_errors(self) -> list[RequestError]:
        """Requests that failed since the last call (each already removed from the engine)."""
        errors, self.request_errors = self.request_errors, []
        return errors

    def fail_request(self, request_id: str, message: str) -> None:
        """Removes one request after a failure tied to it; the server answers it with an internal error."""
        self.abort(request_id)
        self.request_errors.append(RequestError(request_id, message, kind="internal"))

    def make_speculator(self, drafter) -> Speculator | None:
        """The DDTree half of the runner, or None for plain decoding. `drafter` overrides the configured one
        (tests pass an oracle drafter object)."""
        spec = self.config.spec
        if drafter is None:
            if not spec.enabled:
                return None
            drafter = make_drafter(spec, self.model, self.model.vocab_size, device=self.config.device,
                                   dtype=self.dtype)
        budget = drafter.horizon if spec.chain else spec.budget
        return Speculator(drafter, budget, chain=spec.chain) if budget > 0 else None

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> str:
        sampling.validate(self.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the maximum context length is "
                             f"{self.max_model_len} tokens")
        longest = min(len(prompt_token_ids) + sampling.max_tokens, self.max_model_len)
        if -(-longest // self.config.block_size) > self.blocks.num_blocks:
            raise ValueError(f"the request needs {longest} tokens of KV cache but the cache holds "
                             f"{self.blocks.num_blocks * self.config.block_size}; raise kv_cache_memory")
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.rng))
        req = Request(list(prompt_token_ids), sampling, self.eos_token_ids,
                      generator=torch.Generator().manual_seed(seed))
        if request_id is not None:
            req.request_id = request_id
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)
        self.runner.release(request_id)
        return req is not None

    def _inject_faults(self) -> None:
        """Test-only hook (EngineConfig.test_fault_seed): a decoding request with that seed fails."""
        seed = self.config.test_fault_seed
        if seed is None:
            return
        for req in list(self.scheduler.running):
            if req.sampling.seed == seed and req.output_token_ids:
                self.fail_request(req.request_id, "RuntimeError: injected fault (test_fault_seed)")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Delta]:
        """One engine step; returns a Delta for every request that produced tokens or finished."""
        t0 = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        self._inject_faults()
        plan = self.scheduler.schedule()
        if not plan.seqs:
            self.last_stats = None
            return []
        now = time.monotonic()
        for s in plan.seqs:
            s.request.first_scheduled_time = s.request.first_scheduled_time or now
        schedule_time = time.perf_counter() - t0
        before = {s.request.request_id: len(s.request.output_token_ids) for s in plan.seqs}
        result = self.runner.execute(plan)
        result.timings["schedule"] = schedule_time
        self.scheduler.update(plan, result)
        for req in plan.preempted:
            self.runner.release(req.request_id)
        deltas = []
        for s in plan.seqs:
            req = s.request
            n0 = before[req.request_id]
            new = req.output_token_ids[n0:]
            if new and req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if not new and not req.finished:
                continue
            delta = Delta(req.request_id, new, req.finished, req.finish_reason,
                          req.output_logprobs[n0:] if req.sampling.logprobs is not None else None,
                          num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens)
            if req.finished:
                delta.queue_time = (req.first_scheduled_time or now) - req.arrival_time
                delta.accept_lengths = list(req.accept_lengths)
                self.requests.pop(req.request_id, None)
                self.runner.release(req.request_id)
            deltas.append(delta)
        self.last_stats = StepStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.blocks.usage, batch_size=len(plan.seqs),
            num_preemptions=self.scheduler.num_preemptions - preemptions_before, timings=result.timings,
            accept_lengths=result.accept_lengths, tree_nodes=result.tree_nodes,
            accepted_per_position=result.accepted_per_position)
        return deltas
