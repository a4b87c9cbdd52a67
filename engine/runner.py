"""ModelRunner: owns the model and its paged KV cache; turns a StepPlan into one target forward and the step's
tokens. Plain sequences (prefill chunks, decodes) and DDTree verify rows ride in the same forward; one batched
sampler picks the next token of every plain sequence that reaches its end and the target's token after every
tree row; the trees are walked and their accepted KV compacted on the device; then the step's results come to
the host in one device-to-host copy."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
import torch

from engine.admission_steps import AdmissionSteps
from engine.inputs import StepInputs, decode_rows, prepare_inputs, prepare_tree_inputs_ahead
from engine.plan import ScheduledSeq, StepPlan, StepResult
from engine.sampler import SampleOutput, Sampler, SamplingBatch
from engine.structured import step_grammar_masks
from engine.speculative.speculator import Proposal, Speculator, TreeBatch, Walk
from engine.pending import PendingStep
from engine.staging import Staging
from engine.step_results import ResultCopy, RoundCopy, tree_results


# Eager steps' row counts are rounded up to a multiple of this on CUDA: cuBLAS picks its kernels once per row
# count (223-243 us of host time a new count against 15 us a known one, per projection shape, on the H200)
EAGER_PAD_ROWS = 64


class ModelRunner(AdmissionSteps):
    def __init__(self, model, num_blocks: int, block_size: int, device: str, dtype: torch.dtype,
                 sampler: Sampler | None = None, speculator: Speculator | None = None,
                 dense_prefill_min_tokens: int = 0):
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.dense_prefill_min_tokens = dense_prefill_min_tokens  # ext/prefill.py; 0 = off
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sampler = sampler if sampler is not None else Sampler(model.vocab_size, device)
        self.speculator = speculator
        self.graphs = None  # engine.cuda_graphs.CudaGraphs once captured (CUDA, not --enforce-eager)
        self.rounds = None  # engine.round_graphs.RoundGraphs: tree steps as whole-round graphs (with graphs)
        self.plain_graphs = None  # engine.plain_graphs.PlainGraphs: decode steps' sampling as graphs (with graphs)
        self.admissions = None  # engine.admission.Admissions: prompt chunks beside decoding rows as graphs (with graphs)
        self.staging = Staging(device)  # pinned host buffers for the step's metadata (reset every step)
        self.sampler.stage = self.staging
        if speculator is not None:
            speculator.use_staging(self.staging)
        self.uniform_trees = False  # with graphs: a tree step lays out every decoding request as a tree
        # eager steps on CUDA round their rows up to a multiple of this (engine.inputs.padding_rows)
        self.eager_pad_to = EAGER_PAD_ROWS if self.device.type == "cuda" else 0
        # adaptive budgets: which decoding requests at budget 0 draft anyway (curves only), by request id
        self.watch: Callable[[str], bool] | None = None
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

    def release(self, request_id: str) -> None:
        """Forgets per-request state (finish, abort, preemption)."""
        self.sampler.release(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, object, list[tuple[int, int]]]:
        """Inputs of a plan without trees: (input ids, attention metadata, (first row, rows) per sequence)."""
        inputs = prepare_inputs(plan.seqs, None, self.block_size, self.device,
                                dense_prefill_min_tokens=self.dense_prefill_min_tokens)
        return inputs.input_ids, inputs.meta, inputs.plain_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step and waits for its results."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, after: PendingStep | None = None) -> PendingStep:
        """Queues the step's device work and the copy of its results to the host, without waiting for them.
        after: the launched step whose results this plan's requests feed (a plan scheduled ahead: each request
        decodes the token `after` samples for it, still on the device)."""
        self.staging.reset()  # the buffers of the step before the previous one: its results came back
        if plan.seqs and plan.seqs[0].root_on_device:
            return self._launch_tree_ahead(plan, after)
        # the tokens fed from the device, [number of requests scheduled ahead] (an admission's prompts feed theirs)
        input_ids = after.sampled_tokens([s.request for s in plan.seqs if s.num_ahead], self.staging) if after \
            else None
        spec = self.speculator
        is_tree = [spec is not None and s.spec_budget > 0 for s in plan.seqs]
        if self.uniform_trees and any(is_tree):  # budget-0 requests ride as root-only trees: one graph shape (beside
            is_tree = [t or s.decodes for s, t in zip(plan.seqs, is_tree)]  # an admission's prompt pieces)
        plain = [s for s, t in zip(plan.seqs, is_tree) if not t]
        tree_seqs = [s for s, t in zip(plan.seqs, is_tree) if t]
        # a budget-0 request riding as a root-only tree drafts only when the adaptive budget watches it
        drafted = [s.spec_budget > 0 or self.watch is None or self.watch(s.request.request_id) for s in tree_seqs]
        # a step that fails after this leaves no trace the next step would see: the drafter's state covers
        # committed tokens only, features are recorded and tokens returned only at the end
        batch = why = None
        if tree_seqs:
            proposal = spec.propose(tree_seqs, drafted)
            if not plain:
                variant, why = self._round_plan(proposal)
                if variant is not None:
                    return self._launch_round(proposal, variant)
            batch = spec.build(proposal)
        # decoding requests at budget 0 still draft (no verify rows): their curves tell the adaptive budget
        # when a tree would pay again (requests scheduled ahead: when planned so, from the token fed from the
        # device, s.watched)
        watched = None
        if spec is not None and self.watch is not None:
            watch = [s for s in plain if s.decodes
                     and (s.watched if s.num_ahead else input_ids is None and self.watch(s.request.request_id))]
            ahead = after.watch_inputs(watch, plain, input_ids, self.staging, bool(spec.capture_layer_ids)) \
                if input_ids is not None and watch else None
            watched = (watch, *spec.curves(watch, ahead)) if watch else None
        return self._launch(plain, batch, watched, input_ids, why)

    def _round_plan(self, proposal: Proposal) -> tuple[str | None, str]:
        """A step of only trees as a whole-round graph (engine/round_graphs.py): (its epilogue variant, "") or
        (None, why not; "" without graphs)."""
        if self.rounds is None:
            return None, "" if self.graphs is None else "no round graphs"
        variant, why = self.rounds.plan(proposal.seqs, max(proposal.budgets) + 1, self.sampler.fault_seed is not None)
        why = why or self.rounds.fits(proposal) or ""
        return (variant, "") if not why else (None, why)

    def _launch_round(self, proposal: Proposal, variant: str) -> PendingStep:
        """A tree step as three graph replays (engine/round_graphs.py); its results come back in one copy."""
        t1 = time.perf_counter()
        step = self.rounds.run(proposal, variant, self.block_size, self.staging)
        t2 = time.perf_counter()
        batch = TreeBatch(proposal.seqs, step.tree, proposal.budgets, proposal.drafted, step.curve,
                          clock=proposal.clock, starts=proposal.starts, depth_offsets=proposal.depth_offsets)
        features = torch.cat(step.captured, dim=-1) if step.captured else None  # a copy: the buffers get reused
        inputs = StepInputs(None, None, [], 0, step.tree_slots, step.starts)
        none = SampleOutput(torch.empty(0, dtype=torch.int64, device=self.device), [], None, None, None)
        copy = RoundCopy(step.packed, step.walk.accepted_nodes.shape[1])
        return PendingStep([], batch, None, inputs, [], none, step.walk, features, "replay: whole round", copy,
                           t1, t2, step.successors)

    def _launch_tree_ahead(self, plan: StepPlan, after: PendingStep) -> PendingStep:
        """A tree step for every request of `plan` (root-only trees included), launched before `after` (a
        decoding step, tree or plain) has reported: each request's root is the token `after` emits last for it
        and its root position is past `after`'s tokens, all on the device
        (engine.inputs.prepare_tree_inputs_ahead)."""
        seqs = [s for s in plan.seqs if s.root_on_device]
        prompts = [s for s in plan.seqs if not s.root_on_device]  # admitted ahead: their prompts' chunks
        requests = [s.request for s in seqs]
        roots, starts, num_new, emitted_ids = after.successors(requests, self.staging)
        # a drafter fed by target features takes the accepted rows' from the device
        feats = after.accepted_features(requests, self.staging) if self.speculator.capture_layer_ids else None
        drafted = [s.spec_budget > 0 or self.watch is None or self.watch(s.request.request_id, ahead=True)
                   for s in seqs]
        proposal = self.speculator.propose(seqs, drafted, ahead=(roots, starts, num_new, feats, emitted_ids))
        # (a whole-round graph holds no prompt rows)
        variant, why = self._round_plan(proposal) if not prompts else (None, None)
        if variant is not None:
            return self._launch_round(proposal, variant)
        batch = self.speculator.build(proposal)
        # positions reached in the longest case: the request's root, past its previous step's most tokens (the host
        # has not applied `after`: its last token lacks KV, or it is past the prompt's chunk that `after` computes)
        most_emitted = after.most_emitted()
        max_starts = [s.request.num_tokens - 1 + most_emitted[id(s.request)] for s in seqs]
        t1 = time.perf_counter()
        inputs = prepare_tree_inputs_ahead(batch, max_starts, self.block_size, self.staging,
                                           self.dense_prefill_min_tokens)
        if prompts:  # the chunks' replays (or one eager forward), then the trees' verify replay
            replays = self._replays(prompts)
            first = self._prompt_forward(prompts, replays)
            rest = self._forward((batch.num_requests, batch.width), inputs)[:2]
            return self._run_beside(prompts, [], batch, None, first, rest, inputs, t1, why)
        return self._run(plain=[], batch=batch, watched=None, inputs=inputs, t1=t1, round_why=why)

    def _launch(self, plain: list[ScheduledSeq], batch: TreeBatch | None, watched: tuple | None,
                ahead_ids: torch.Tensor | None, round_why: str | None = None) -> PendingStep:
        t1 = time.perf_counter()
        shape = _uniform_shape(plain, batch)  # None: a mixed step, never one graph replay
        if batch is None and shape is not None and self.graphs is not None:  # plain decoding: N requests x 1 row
            inputs = self._decode_in_graph(plain, ahead_ids)
            if inputs is not None:
                return self._run(plain, batch, watched, inputs, t1, round_why)
        mixed_why = "mixed step"
        if shape is None and self.admissions is not None:
            step = self._launch_admission(plain, batch, watched, ahead_ids, t1, round_why)
            if not isinstance(step, str):
                return step
            mixed_why = step
        pad_to = self.eager_pad_to if (self.graphs is None or shape is None) and ahead_ids is None else 0
        inputs = prepare_inputs(plain, batch, self.block_size, self.device, self.staging, pad_to,
                                self.dense_prefill_min_tokens)
        if ahead_ids is not None and ahead_ids.shape[0] == inputs.input_ids.shape[0]:  # every row fed from there
            inputs.input_ids = ahead_ids
        elif ahead_ids is not None:  # into the rows of the requests scheduled ahead (an admission's prompts beside)
            first = [r0 for s, (r0, _) in zip(plain, inputs.plain_rows) if s.num_ahead]
            inputs.input_ids = inputs.input_ids.index_copy(0, self.staging(first), ahead_ids)
        return self._run(plain, batch, watched, inputs, t1, round_why, mixed_why)

    def _decode_in_graph(self, plain: list[ScheduledSeq], ahead_ids: torch.Tensor | None) -> StepInputs | None:
        """A plain decoding step's inputs written straight into its graph's static buffers (CudaGraphs.
        write_decode: fewer copies and no device tensors in between); None when no graph holds the step."""
        ids, positions, slots, seq_lens = decode_rows(plain, self.block_size)
        if ahead_ids is not None and ahead_ids.shape[0] < len(plain):
            # an admission launched ahead whose prompts need one row each (their prefixes cached): their prompts'
            # last tokens from the host, the others' tokens from the device
            fed = self.staging([i for i, s in enumerate(plain) if s.num_ahead])
            ahead_ids = self.staging(ids).index_copy(0, fed, ahead_ids)
        key = self.graphs.write_decode(ahead_ids if ahead_ids is not None else ids, positions, slots, seq_lens,
                                       [s.request.block_ids for s in plain], self.staging)
        if key is None:
            return None
        n = len(plain)  # no metadata: nothing after the replay reads it (graph_key says where the inputs are)
        return StepInputs(self.graphs.input_ids[:n], None, [(i, 1) for i in range(n)], n, None, graph_key=key)

    def _run(self, plain: list[ScheduledSeq], batch: TreeBatch | None, watched: tuple | None, inputs: StepInputs,
             t1: float, round_why: str | None = None, mixed_why: str = "mixed step",
             forward: tuple[torch.Tensor, list[torch.Tensor], str] | None = None, graph_tail: int = 0,
             tokens: torch.Tensor | None = None) -> PendingStep:
        """The target forward (unless given: hidden, captured layers, graph mode), sampling, walk and compaction of
        a prepared step, and its results' copy. round_why: why a step of only trees is not a whole-round graph
        (said in the step's graph mode when it replays); mixed_why: why a step of several shapes runs eagerly;
        graph_tail: the step's last rows are that many decoding rows whose decode graph replayed last; tokens:
        the sampled rows' tokens, already chosen in a graph."""
        hidden, captured, graph_mode = forward or self._forward(_uniform_shape(plain, batch), inputs, mixed_why)
        features = torch.cat(captured, dim=-1) if captured else None  # [num_tokens, num_layers * hidden]
        t2 = time.perf_counter()
        sampling = [(s.request, r0 + n - 1) for s, (r0, n) in zip(plain, inputs.plain_rows) if s.sample]
        out = walk = None
        fault = self.sampler.fault_seed is not None
        if tokens is not None:
            out = SampleOutput(tokens, [], None, None, None)
        elif graph_mode == "replay" and batch is None and self.plain_graphs is not None:  # N decodes x 1 row
            chosen, round_why = self.plain_graphs.plan(plain, self.graphs.last_key, fault)
            if chosen is not None:
                tokens = self.plain_graphs.run(plain, self.graphs.last_key, chosen, self.staging, hidden)
                out, graph_mode = SampleOutput(tokens, [], None, None, None), "replay: whole step"
        elif graph_tail:  # an admission's decoders, replayed last in their decode graph: its sampling graph's tokens
            tail = self.plain_graphs.tokens(plain[-graph_tail:], self.graphs.last_key, self.staging,
                                            hidden[-graph_tail:], fault)
            if tail is not None:  # the prompts' sampled rows (sampled first) by the sampler
                head, _ = self._sample(hidden, inputs, sampling[:-graph_tail], None, [0] * (len(sampling) - graph_tail))
                out = replace(head, tokens=torch.cat([head.tokens, tail]))
        if out is None:
            if graph_mode == "replay" and round_why:
                graph_mode = f"replay: forward only ({round_why})"
            out, walk = self._sample(hidden, inputs, sampling, batch, [s.num_ahead for s in plain if s.sample])
        curves = [c for c in (batch.curve if batch is not None else None, watched[1] if watched else None)
                  if c is not None]
        copy = ResultCopy(out, walk, len(sampling), torch.cat(curves) if curves else None)
        return PendingStep(plain, batch, watched, inputs, sampling, out, walk, features, graph_mode, copy, t1, t2)

    def collect(self, step: PendingStep) -> StepResult:
        """Waits for a launched step's results and turns them into the StepResult."""
        plain, batch, watched, inputs, sampling, features = (step.plain, step.batch, step.watched, step.inputs,
                                                             step.sampling, step.features)
        host = step.copy.wait()
        t3 = time.perf_counter()
        result = StepResult()
        for i, (req, _) in enumerate(sampling):
            result.new_token_ids[req.request_id] = [host.tokens[i]]
            if req.sampling.logprobs is not None:
                result.logprobs[req.request_id] = [host.logprob(i, req.sampling.logprobs)]
        if self.speculator is not None and self.speculator.capture_layer_ids:  # (else record_hidden keeps nothing)
            for s, (r0, n) in zip(plain, inputs.plain_rows):
                self.speculator.record_hidden(s.request.request_id,
                                              features[r0:r0 + n] if features is not None else None)
        result.cuda_graph = step.graph_mode
        if watched:
            first = batch.num_requests if batch is not None else 0
            for j, s in enumerate(watched[0]):
                result.curves[s.request.request_id] = host.curves[first + j]
        clocks = [c for c in (batch.clock if batch is not None else None, watched[2] if watched else None) if c]
        result.num_drafted, result.num_curve_drafts = step.num_drafted, step.num_curve_drafts
        result.draft_seconds = sum(c.seconds() for c in clocks)  # the fetch synchronized: events are complete
        if batch is not None:
            result.num_grammar_pruned = batch.num_pruned
            tree_results(batch, inputs.tree_row0, host, len(sampling), features, result,
                         self.speculator.record_hidden)
            result.timings.update(draft=batch.draft_s, tree_build=batch.tree_build_s, verify=step.t2 - step.t1,
                                  accept=time.perf_counter() - step.t2)
        else:
            result.timings.update(forward=step.t2 - step.t1, sample=t3 - step.t2)
        return result

    def _forward(self, shape: tuple[int, int] | None, inputs: StepInputs, mixed_why: str = "mixed step"
                 ) -> tuple[torch.Tensor, list[torch.Tensor], str]:
        """The target forward: a CUDA-graph replay when the step is N decoding requests x W rows (shape, from
        _uniform_shape) and a graph fits, else eager. Returns (hidden, captured layers, "replay" | "eager: <why>"
        | "" without graphs)."""
        capture = self.speculator.capture_layer_ids if self.speculator is not None else ()
        mode = ""
        if inputs.graph_key is not None:
            hidden, layers = self.graphs.replay_rows(inputs.graph_key, len(inputs.plain_rows))
            return hidden, layers, "replay"
        if self.graphs is not None:
            out = self.graphs.run(inputs.input_ids, inputs.meta, *shape) if shape is not None else None
            if out is not None:
                return out[0], out[1], "replay"
            mode = f"eager: {mixed_why}" if shape is None else f"eager: no graph for {shape[0]}x{shape[1]}"
        hidden, captured = self.model(inputs.input_ids, inputs.meta, self.kv_caches, capture_layer_ids=capture)
        return hidden, captured, mode

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, sampling: list, batch: TreeBatch | None,
                ahead: list[int]) -> tuple[SampleOutput, Walk | None]:
        """Logits of every sampled row -> tokens (and, for the trees, the walk and the KV compaction). ahead: per
        sampled plain row, tokens its request runs past its committed output (its row's depth)."""
        row_ids = [r for _, r in sampling]
        # plain decoding: the sampled rows are the first ones, a slice (no index tensor, no gather)
        rows = slice(0, len(row_ids)) if batch is None and row_ids == list(range(len(row_ids))) \
            else self.staging(row_ids)
        requests, num_rows = [req for req, _ in sampling], [1] * len(sampling)
        depths = self.staging(ahead) if any(ahead) else None
        tree_tokens = tree_vis = None
        if batch is not None:
            width = batch.width
            tree_rows = torch.arange(inputs.tree_row0, inputs.tree_row0 + batch.num_requests * width,
                                     device=self.device)
            rows = torch.cat([rows, tree_rows])
            requests += [s.request for s in batch.seqs]
            num_rows += [width] * batch.num_requests
            plain_depths = depths if depths is not None else \
                torch.zeros(len(sampling), dtype=torch.int64, device=self.device)
            tree_depths = batch.tree.depths if batch.depth_offsets is None else \
                batch.tree.depths + batch.depth_offsets[:, None]  # a tree drafted ahead: past `after`'s tokens
            depths = torch.cat([plain_depths, tree_depths.reshape(-1)])
            tree_tokens, tree_vis = batch.tree.node_token_ids, batch.tree.visibility
        if not requests:
            return SampleOutput(torch.empty(0, dtype=torch.int64, device=self.device), [], None, None, None), None
        logits = self.model.compute_logits(hidden[rows])  # [R, vocab] fp32
        grammar_rows, grammar_masks = step_grammar_masks(sampling, batch)
        out = self.sampler(logits, SamplingBatch(requests, num_rows, depths, tree_tokens, tree_vis,
                                                 grammar_rows, grammar_masks))
        walk = None
        if batch is not None:
            targets = out.tokens[len(sampling):].view(batch.num_requests, batch.width)
            walk = Speculator.walk(batch, targets)
            Speculator.compact(self.slot_views, walk, inputs.tree_slots)
        return out, walk


def _uniform_shape(plain: list[ScheduledSeq], batch: TreeBatch | None) -> tuple[int, int] | None:
    """(requests, rows each) when every request of the step has the same rows and only decodes, else None."""
    if batch is not None:
        return (batch.num_requests, batch.width) if not plain else None
    return (len(plain), 1) if plain and all(s.decodes for s in plain) else None
