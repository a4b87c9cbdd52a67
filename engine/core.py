"""EngineCore: the step loop. step() = scheduler.schedule() -> runner.launch(plan) (and, under asynchronous
scheduling, the next step launched ahead) -> runner.collect() -> scheduler.update(result), returning what changed
for each request. It owns the loaded model, the KV cache, the sampler and the scheduler, and at startup checks
the CUDA extension (engine.startup), sizes the KV cache (engine.memory) and warms up."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

import torch

from engine.ahead import AheadLauncher, Launched, trees_blocked
from engine.admission import Admissions
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cuda_graphs import (BATCH_SIZES, CudaGraphs, buckets_up_to, graph_shape, scratch_blocks_needed,
                                supports_graphs, widest_bucket)
from engine.detokenizer import OutputText
from engine.draft_first import DraftFirst
from engine.memory import AllocatorWatch, measure_cuda_peak, plan_kv_cache
from engine.messages import Delta, RequestError, StepStats
from engine.model.loader import default_sampling, load_model, resolve_dtype
from engine.plan import StepPlan
from engine.plain_graphs import PlainGraphs
from engine.request import Request, SamplingParams, Status, next_request_id
from engine.round_graphs import RoundGraphs
from engine.runner import ModelRunner
from engine.sampler import RequestFault, Sampler
from engine.scheduler import Scheduler
from engine.speculative.adaptive import BudgetController
from engine.speculative.drafter import make_drafter
from engine.speculative.speculator import Speculator
from engine.startup import check_extension, eos_token_ids, signed64
from engine.step_outputs import step_delta, step_stats
from engine.warmup import warm_up

logger = logging.getLogger("ddtree.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None, drafter=None, tp=None, log_level=None):
        """tp: this rank's engine.distributed.TPGroup when this core is a follower (engine/ranks.py); a leader
        (config.tensor_parallel_size > 1, tp None) starts its followers here."""
        self.followers = None
        if config.tensor_parallel_size > 1 and tp is None:
            if loaded is not None or drafter is not None:
                raise ValueError("tensor parallelism loads its own model shards and drafter (pass neither)")
            from engine.ranks import Followers

            self.followers = Followers(config, log_level)
            tp = self.followers.tp
        self.tp = tp
        try:
            self._start(config, loaded, drafter)
        except BaseException:
            self.shutdown(graceful=False)  # a leader's followers would otherwise wait for it forever
            raise

    def _start(self, config: EngineConfig, loaded, drafter) -> None:
        """Loading, KV-cache sizing, warm-up and graph capture (the same on every rank)."""
        tp = self.tp
        if tp is not None:
            from engine.ranks import rank_config

            config = rank_config(config, tp.rank)
        self.config = config
        self.dtype = resolve_dtype(config.dtype, config.device)
        check_extension(config)
        self.loaded = loaded or load_model(config.model, self.dtype, config.device, config.load_format, tp=tp)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        cfg, gen = self.loaded.hf_config, self.loaded.generation_config
        self.max_model_len = config.max_model_len or min(cfg.get("max_position_embeddings") or 2048, 32768)
        self.eos_token_ids = eos_token_ids(cfg, gen, self.tokenizer)
        self.default_sampling = default_sampling(gen)
        self.sampler = Sampler(self.model.vocab_size, config.device, fault_seed=config.test_fault_seed)
        self.speculator = self.make_speculator(drafter)
        max_budget = 0 if self.speculator is None else self.speculator.max_budget
        per_block = ModelRunner.kv_bytes_per_block(self.model, config.block_size, self.dtype)
        if self.speculator is not None:  # a drafter's own KV grows with the context like the target's
            per_block += self.speculator.draft_kv_bytes_per_token * config.block_size
        measure = (lambda: measure_cuda_peak(torch.device(config.device),
                                             lambda: warm_up(config, self.model, self.dtype, max_budget))) \
            if config.is_cuda else None
        self.kv_plan = plan_kv_cache(config, per_block, self.max_model_len, max_budget, measure)
        if tp is not None:  # every rank's cache has the same blocks: the smallest that fits on each device
            self.kv_plan = replace(self.kv_plan, num_blocks=tp.min_int(self.kv_plan.num_blocks))
        logger.info("%s", self.kv_plan.describe(self.max_model_len))
        if self.speculator is not None:
            self.speculator.reserve_draft_kv(self.kv_plan.num_tokens, config.max_num_seqs)
        # a drafter fed by target features needs them for every prompt token, so cached prefixes would starve it
        needs_features = self.speculator is not None and bool(self.speculator.capture_layer_ids)
        self.blocks = BlockManager(self.kv_plan.num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching and not needs_features)
        self.runner = ModelRunner(self.model, self.kv_plan.num_blocks, config.block_size, config.device, self.dtype,
                                  self.sampler, self.speculator, config.dense_prefill_min_tokens)
        adaptive = self.speculator is not None and config.spec.adaptive and not config.spec.chain
        self.budgets = BudgetController(max_budget, enabled=adaptive, guard=config.spec.guard)
        self.budgets.borrow = self.speculator is None or not getattr(self.speculator.drafter, "request_specific", False)
        budgets = self.budgets  # not self: a closure over the engine would keep it alive after its last user
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, max_budget,
                                   budget_of=lambda request: budgets.budget(request.request_id),
                                   width_of=lambda requests, wanted: budgets.harmonize(
                                       [r.request_id for r in requests], wanted),
                                   uniform_of=lambda requests, wanted, caps, synchronous: budgets.uniform(
                                       [r.request_id for r in requests], wanted, caps, synchronous))
        graph_blocker = self._graph_blocker()
        if graph_blocker is None:
            self.enable_graphs()
        elif config.is_cuda:
            logger.warning("CUDA graphs are off (%s): every step runs eagerly", graph_blocker)
        self.rng = random.Random(config.seed)
        self.requests: dict[str, Request] = {}
        self.request_errors: list[RequestError] = []  # requests that failed while the engine went on
        self.last_stats: StepStats | None = None
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, built for the first grammar
        self.num_constrained_requests = 0
        # asynchronous scheduling: on CUDA (one rank), unless --no-async-scheduling; tests may switch it on
        self.overlap = config.async_scheduling and config.is_cuda and tp is None
        self.inflight: Launched | None = None  # a step launched ahead, its results not yet read
        self.ahead = AheadLauncher(self.scheduler, self.runner, self.speculator, self.budgets)
        self._next_scheduling = "synchronous: first step" if self.overlap else ""  # the next scheduled step's
        self._last_ready = 0.0  # when the last step's results reached the host (perf_counter)
        self._call_start = 0.0  # when the current step() call began
        self.alloc_watch = AllocatorWatch(torch.device(config.device)) if config.is_cuda else None

    @property
    def overlap(self) -> bool:
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        """Asynchronous scheduling on or off, and what follows from it: the budget's view of drafting costs, and
        whether trees are drafted before their budgets are chosen (engine/draft_first.py) or curve-only after
        each step (the runner's watch)."""
        self._overlap = self.budgets.pipelined = on
        self._price_switches()
        first = DraftFirst.applies(self.speculator, self.budgets.enabled, on, self.tp is not None)
        self.draft_first = DraftFirst(self.speculator, self.budgets) if first else None
        self.runner.watch = None if not self.budgets.enabled else \
            self.draft_first.watch if first else self.budgets.should_draft

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
        return Speculator(drafter, budget, chain=spec.chain, device=self.config.device,
                          grammar_pruning=spec.grammar_pruning) if budget > 0 else None

    def _graph_blocker(self) -> str | None:
        """Why this engine cannot use CUDA graphs, or None."""
        if not self.config.is_cuda:
            return "not a CUDA device"
        if self.config.enforce_eager:
            return "--enforce-eager"
        from ext import build

        if build.load_ops() is None:
            return "the CUDA extension is not loaded (--reference-kernels: the references synchronize)"
        return supports_graphs(self.model)

    def enable_graphs(self, emulate: bool = False) -> None:
        """CUDA graphs for decode-only steps (captured now). `emulate` runs the same padded layout eagerly
        instead of capturing: how CPU tests check it."""
        config = self.config
        max_budget = self.speculator.max_budget if self.speculator is not None else 0
        max_blocks = -(-(self.max_model_len + widest_bucket(max_budget + 1)) // config.block_size)
        scratch = self.blocks.reserve(scratch_blocks_needed(max_budget + 1, config.block_size))  # padding rows
        capture = self.speculator.capture_layer_ids if self.speculator is not None else ()
        graphs = CudaGraphs(self.model, self.runner.kv_caches, config.block_size, scratch, config.max_num_seqs,
                            max_budget + 1, config.max_num_batched_tokens, self.max_model_len, max_blocks, capture,
                            torch.device(config.device), emulate=emulate, admission_rows=config.admission_decode_rows)
        if not emulate:
            graphs.capture()
        self.runner.graphs = graphs
        self.runner.admissions = Admissions(graphs)  # admission steps' prompt chunks as replays
        plain = PlainGraphs(graphs, self.model)  # decode steps choose their tokens in graphs too
        if not emulate:
            plain.capture()
        self.runner.plain_graphs = plain
        spec = self.speculator
        if spec is not None:  # tree steps as whole-round graphs; the drafter's call for every batch size
            rounds = RoundGraphs(graphs, self.model, self.runner.slot_views, spec.max_budget, spec.horizon,
                                 min(spec.draft_top_k, self.model.vocab_size))
            if not emulate:
                rounds.capture()
            self.runner.rounds = rounds
            spec.capture_draft_graphs(buckets_up_to(BATCH_SIZES, config.max_num_seqs), self.max_model_len,
                                      emulate=emulate)
        self.runner.uniform_trees = self.scheduler.uniform_trees = self.speculator is not None
        self.budgets.price_tree_steps = False  # the uniform width prices a graph step (BudgetController.uniform)
        self.budgets.costs.shape_of = graph_shape  # ... at its shape's measured time (step_costs.py)
        self._price_switches()

    def _price_switches(self) -> None:
        """Whether the adaptive budget charges a switch into trees for the synchronous steps it costs: not when
        tree steps run ahead of any decoding step (engine/ahead.py)."""
        self.budgets.switches_ahead = getattr(self, "_overlap", False) and \
            trees_blocked(self.speculator, self.runner) is None

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    # ------------------------------------------------------------------------------------------ requests

    def _mirror(self, name: str, *args) -> None:
        """Leader of a tensor-parallel group: the followers make this call too (engine/ranks.py)."""
        if self.tp is not None and self.tp.is_leader:
            self.tp.broadcast_object((name, args))

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> str:
        if self.tp is not None:
            request_id = request_id if request_id is not None else next_request_id()  # the same id on every rank
            self._mirror("add_request", list(prompt_token_ids), sampling, request_id)
        sampling.validate(self.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        # min/max first: a token-by-token scan of a 32k-token prompt took milliseconds of the host's step loop
        bad = None if 0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab else \
            next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the maximum context length is "
                             f"{self.max_model_len} tokens")
        longest = min(len(prompt_token_ids) + sampling.max_tokens, self.max_model_len)
        if longest > self.kv_plan.num_tokens:
            raise ValueError(f"the request needs {longest} tokens of KV cache but the cache holds "
                             f"{self.kv_plan.num_tokens}")
        if (sampling.stop or sampling.grammar) and self.tokenizer is None:
            raise ValueError("stop strings and structured output need the model's tokenizer, and this model has none")
        constraint = self._constraint(sampling.grammar) if sampling.grammar is not None else None
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        req = Request(list(prompt_token_ids), sampling, self.eos_token_ids, seed=signed64(seed))
        if request_id is not None:
            req.request_id = request_id
        req.constraint = constraint
        self.num_constrained_requests += constraint is not None
        if sampling.detokenize and self.tokenizer is not None:
            req.text = OutputText(self.tokenizer, stop=sampling.stop, skip_special_tokens=sampling.skip_special_tokens,
                                  include_stop_str_in_output=sampling.include_stop_str_in_output,
                                  prompt_ids=prompt_token_ids)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def _constraint(self, grammar: str):
        """The request's grammar state; the tokenizer's llguidance view is built on first use (about 0.5 s)."""
        from engine.structured import Constraint, grammar_tokenizer

        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return Constraint(self._grammar_tokenizer, grammar, self.eos_token_ids)

    def abort(self, request_id: str) -> bool:
        self._mirror("abort", request_id)
        req = self.scheduler.abort(request_id)
        self._release(request_id)
        return req is not None

    def _release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.runner.release(request_id)
        self.budgets.release(request_id)

    def fail_request(self, request_id: str, message: str) -> None:
        """Removes one request after a failure tied to it; the server answers it with an internal error."""
        self.abort(request_id)
        self.request_errors.append(RequestError(request_id, message, kind="internal"))

    def pop_request_errors(self) -> list[RequestError]:
        """Requests that failed since the last call (each already removed from the engine)."""
        errors, self.request_errors = self.request_errors, []
        return errors

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_ranks(self) -> None:
        """A tensor-parallel leader: raises if another rank has exited (the engine loop calls it while idle too,
        so a dead rank turns /health to 503 without waiting for the next request)."""
        if self.followers is not None:
            self.followers.check()

    def shutdown(self, graceful: bool = True) -> None:
        """Stops a tensor-parallel leader's followers (nothing to do otherwise); the core is unusable after."""
        if self.followers is not None:
            self.followers.stop(graceful)
            self.followers = None

    # ---------------------------------------------------------------------------------------------- step

    def step(self) -> list[Delta]:
        """One engine step; returns a Delta for every request that produced tokens or finished. A failure tied
        to one request (RequestFault) fails that request only: nothing of the step was committed, so the
        others simply run again next step. Any other exception propagates (the engine process dies).

        Asynchronous scheduling (`overlap`): before waiting for a step's results the next step is launched
        when it can be planned without them (engine/ahead.py), so the host's bookkeeping of
        step k runs while the device computes step k+1; step() then returns step k's deltas and keeps step k+1
        in flight for the next call."""
        self._mirror("step")
        self._call_start = time.perf_counter()
        current, self.inflight = self.inflight, None
        if current is None:
            current = self._launch_scheduled()
            if current is None:
                return []
        if self.overlap:
            self.inflight = self.ahead.launch(current)
            if self.inflight is None:
                current.next_scheduling = f"synchronous: {self.ahead.why_not}"
        return self._complete(current)

    def _launch_scheduled(self) -> "Launched | None":
        """schedule() and launch; None when nothing runs (or the step failed one request)."""
        t0 = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        if self.draft_first is not None:
            self.draft_first.refresh(self.scheduler.running)
        plan = self.scheduler.schedule()
        if not plan.seqs:
            self.last_stats = None
            return None
        schedule_time = time.perf_counter() - t0
        t_launch = time.perf_counter()
        try:
            step = self.runner.launch(plan)
        except RequestFault as fault:
            logger.error("request %s failed: %s", fault.request_id, fault, exc_info=fault.__cause__)
            self.fail_request(fault.request_id, str(fault))
            self.last_stats = None
            return None
        return Launched(plan, step, schedule_time, preemptions_before, t_launch, scheduling=self._next_scheduling)

    def _complete(self, launched: "Launched") -> list[Delta]:
        """Waits for a launched step's results and applies them: the scheduler's update and the deltas."""
        plan = launched.plan
        result = self.runner.collect(launched.step)
        ready = time.perf_counter()
        if self.inflight is not None and self.inflight.step.batch is not None:  # a tree step drafted ahead of these
            self.speculator.confirm_ahead(self.inflight.step.batch, result.new_token_ids)
        self._next_scheduling = launched.next_scheduling
        # the step's cost: from its launch, or from the previous step's results when it was queued behind them;
        # under asynchronous scheduling a step that could not run ahead also pays its scheduling (the device
        # idles meanwhile): from this call's start (the switch into and out of trees, BudgetController)
        synchronous = self.overlap and launched.scheduling != "ahead"
        seconds = ready - max(self._call_start if synchronous else launched.t_launch, self._last_ready)
        cycle = ready - self._last_ready if self._last_ready else seconds  # everything since the last results
        self._last_ready = ready
        result.timings["schedule"] = launched.schedule_time
        # (request, output tokens before the step) of those not finished while the step ran: nothing to emit
        live = [(s.request, len(s.request.output_token_ids)) for s in plan.seqs
                if s.request.status is not Status.FINISHED]
        if not live:  # a step run ahead for requests that all finished before it: its work is dropped
            self.last_stats = None
            return []
        if self.speculator is not None:
            self._observe_budgets(plan, result, seconds, synchronous, cycle)
        self.scheduler.update(plan, result, in_flight=self.inflight.plan if self.inflight is not None else None)
        for req in plan.preempted:
            self.runner.release(req.request_id)
        now = time.monotonic()
        deltas = [d for d in (step_delta(req, num_before, now) for req, num_before in live) if d]
        for delta in deltas:
            if delta.finished:
                self._release(delta.request_id)
        self.last_stats = step_stats(plan, result, self.scheduler, self.blocks.usage, self.budgets,
                                     self.scheduler.num_preemptions - launched.preemptions_before,
                                     self._take_constrained())
        self.last_stats.cuda_alloc_retries = self.alloc_watch.new_retries() if self.alloc_watch else 0
        self.last_stats.scheduling = launched.scheduling
        return deltas

    def _observe_budgets(self, plan: StepPlan, result, seconds: float, synchronous: bool = False,
                         cycle: float | None = None) -> None:
        """What the adaptive budget learns from a step (StepBudgets.observe_engine_step)."""
        draft_seconds = result.draft_seconds
        if self.tp is not None and self.budgets.enabled:  # budgets follow the leader's clock on every rank
            seconds, draft_seconds, cycle = self.tp.broadcast_object((seconds, draft_seconds, cycle))
        self.budgets.observe_engine_step(plan, result, seconds, draft_seconds, synchronous, self.runner.uniform_trees,
                                         cycle, unpriced_drafts=self._unpriced_drafts(result))

    def _unpriced_drafts(self, result) -> tuple[bool, bool]:
        """Under asynchronous scheduling: whether the step being observed drafted, and whether the step launched
        ahead while it ran did (that launch's host work is in this step's time). There the budget prices a draft by
        its device time (CUDA events), while its cost is mostly the host's launches, so the guard counts drafting
        steps as speculation and charges it with the steps that paid (guard.py). Without asynchronous scheduling a
        draft's host time is measured and priced: (False, False)."""
        if not self.overlap:
            return False, False
        return result.num_drafted > 0, self.inflight is not None and self.inflight.step.num_drafted > 0

    def _take_constrained(self) -> int:
        """Requests admitted with a grammar since the last step's statistics."""
        n, self.num_constrained_requests = self.num_constrained_requests, 0
        return n
