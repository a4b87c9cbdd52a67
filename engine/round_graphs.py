"""Whole-round CUDA graphs for tree steps. A tree step is, besides the drafter's call, three graph replays per
bucket (N requests x W rows: the forward graphs' buckets with W > 1, and root-only trees, W = 1, over the
full-context plain-decoding forward) and a few copies:

  prologue  the best-first trees built from the drafter's proposal (full budget, then cut to each request's
            budget), their node q, and the verify rows written into the forward graph's static buffers:
            input ids, rope positions (root position + depth), cache slots (looked up in the block tables on
            the device), key counts and the tree mask;
  forward   the target forward's own graph (engine/cuda_graphs.py);
  epilogue  logits of every row, the target's token after it (a variant per way of choosing it: argmax, the
            sampler's draw at temperature > 0 with min-p, the same after top-k/top-p), the tree walk, the KV
            compaction, and one packed result per request (accept length, accepted rows, emitted tokens, node
            confidence).

Without it the same step launches ~150 operators from the host after the forward's replay, which at small
batches bounds the step. Inputs live in static buffers the host fills with one staged copy (budgets, roots,
root positions, seeds, output counts), one more for sampling parameters, the block-table rows whose lists changed
(CudaGraphs.write_tables), and two device copies (the proposal); roots, root positions and output offsets may come
from the previous tree step's epilogue on the device (a step launched ahead of its predecessor's results).

Invariants: rows a request does not own in the bucket (its rows past the step's W, and every row of a padding
request) write their K/V into the scratch slots (engine/cuda_graphs.py) and are never accepted; a bucket's
outputs are static (rewritten by its next replay), so every reader of them is enqueued before that replay or
reads the host copy; their memory pool is not the forward graphs' (whose replays rewrite what their captures
freed). Steps the epilogue cannot serve (logprobs, penalties, logit bias, min_tokens, grammars, a bucket
without the variant) replay the forward graph only, and say why in StepStats.cuda_graph.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine import graph_sampling
from engine.cuda_graphs import collector_paused
from engine.graph_sampling import GREEDY, VARIANTS, GraphSampling
from engine.plan import ScheduledSeq
from engine.speculative.speculator import Proposal, Speculator, Walk
from engine.speculative.tree import DraftTree
from engine.staging import Staging
from ext.metadata import slots_on_device

logger = logging.getLogger("ddtree.engine")

# rows of RoundGraphs.small: per request of the bucket
BUDGET, FULL, OWNED, ROOT, START = range(5)


@dataclass
class RoundStep:
    """A launched whole-round step's device outputs, cut to its requests (views of static buffers)."""

    tree: DraftTree  # [N, W_bucket]
    curve: torch.Tensor  # [N, B] float64 node q
    tree_slots: torch.Tensor  # [N, W_bucket] int64
    walk: Walk
    starts: torch.Tensor  # [N] int64 root positions
    packed: torch.Tensor  # [N, 1 + 2A + B] float64
    captured: list[torch.Tensor]  # the forward's captured layers, [N * W_bucket, hidden] each (views)
    width: int  # W_bucket
    successors: tuple[torch.Tensor, torch.Tensor]  # [N] int64 each: the last emitted token, the position after it


@dataclass
class _Round:
    prologue: torch.cuda.CUDAGraph | None
    built: tuple  # (tree, curve, slots) of the prologue's capture
    epilogues: dict  # variant -> (graph, (walk, packed) of its capture)


_NONE = _Round(None, (), {})


class RoundGraphs:
    def __init__(self, graphs, model, slot_views: list[torch.Tensor], max_budget: int, horizon: int, top_k: int):
        """graphs: the engine's CudaGraphs (their static buffers, buckets and memory pool); emulated like them."""
        self.graphs, self.model, self.slot_views = graphs, model, slot_views
        self.max_budget, self.horizon, self.top_k = max_budget, horizon, top_k
        device, most = graphs.device, max(graphs.batch_sizes)
        self.logprobs = torch.zeros(most, horizon, top_k, dtype=torch.float32, device=device)
        self.token_ids = torch.zeros(most, horizon, top_k, dtype=torch.int64, device=device)
        self.small = torch.zeros(5, most, dtype=torch.int64, device=device)  # BUDGET .. START
        self.sampling = GraphSampling(most, device)
        # tree buckets, and root-only trees at the full context (a step leaving trees while its predecessor's
        # accepted lengths are still on the device: engine.scheduler.schedule_ahead_trees)
        # (not the plain buckets past max_num_seqs: an admission step's rows, never a round)
        self.keys = [b for b in graphs.buckets if (b[1] > 1 or b[2] == graphs.max_model_len) and b[0] <= most]
        self.columns = torch.arange(max(graphs.widths), device=device)  # a row's index inside its request
        self.rounds: dict[tuple[int, int, int], _Round] = {}
        # a pool of their own: a prologue's outputs must survive the forward graph's replay, and in the forward
        # graphs' pool they could sit where a forward graph keeps its intermediates
        self.pool = None
        self._told: set[str] = set()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # _inputs_of's

    # ------------------------------------------------------------------------------------------ eligibility

    def plan(self, seqs: list[ScheduledSeq], width: int, fault_injection: bool = False) -> tuple[str | None, str]:
        """(the epilogue variant, None) when this tree step (every request decoding, `width` rows each) can run
        as a whole round, else (None, why not)."""
        variant, why = self._plan(seqs, width, fault_injection)
        if why and why not in self._told:
            self._told.add(why)
            logger.info("tree steps whose %s run their sampling, walk and compaction outside the CUDA graphs "
                        "(counted in engine_steps_total{mode=\"replay\"})", why)
        return variant, why

    def _plan(self, seqs: list[ScheduledSeq], width: int, fault_injection: bool) -> tuple[str | None, str]:
        variant, why = graph_sampling.variant(seqs, fault_injection)
        if variant is None:
            return None, why
        key = self.graphs.bucket(len(seqs), width)
        if key is None or not (self.graphs.emulate or variant in self.rounds.get(key, _NONE).epilogues):
            return None, f"shape {len(seqs)}x{width} has no round graph ({variant})"
        return variant, ""

    def fits(self, proposal: Proposal) -> str | None:
        """Why this proposal does not fit the static buffers, or None."""
        shape = tuple(proposal.logprobs.shape[1:])
        if shape != (self.horizon, self.top_k):
            return f"the drafter proposed {shape[1]} candidates at {shape[0]} depths, the round graph holds " \
                   f"{self.top_k} at {self.horizon}"
        return None

    # ---------------------------------------------------------------------------------------------- capture

    @torch.inference_mode()
    @collector_paused()
    def capture(self) -> None:
        """Prologue and epilogue graphs of every tree bucket (an epilogue per variant), in one memory pool of their
        own."""
        graphs = self.graphs
        for key in sorted(self.keys, key=lambda b: -b[0] * b[1]):
            n, w, _ = key
            graphs.set_layout(0, n, w, w)  # every request a padding request: nothing but scratch is written
            self.small.zero_()
            self.sampling.params.zero_()
            hidden = graphs.graphs[key].hidden
            built = self._prologue(n, w)  # warm-up, eager
            for variant in VARIANTS:
                self._epilogue(n, w, hidden, *built, variant)
            torch.cuda.synchronize(graphs.device)
            prologue = torch.cuda.CUDAGraph()
            with torch.cuda.graph(prologue, pool=self.pool):
                built = self._prologue(n, w)
            self.pool = prologue.pool()
            epilogues = {}
            for variant in VARIANTS:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    epilogues[variant] = (graph, self._epilogue(n, w, hidden, *built, variant))
            self.rounds[key] = _Round(prologue, built, epilogues)
        graphs.forget_layout()  # the next step writes its own
        torch.cuda.synchronize(graphs.device)
        logger.info("captured whole-round tree-step graphs for %d buckets", len(self.rounds))

    # ------------------------------------------------------------------------------------------------- run

    def run(self, proposal: Proposal, variant: str, block_size: int, stage: Staging) -> RoundStep:
        """Replays the round for a proposal (plan() gave `variant`; fits() None): its roots, root positions and
        output offsets from the proposal when drafted ahead, else from the requests on the host."""
        seqs, graphs = proposal.seqs, self.graphs
        num, budgets = len(seqs), proposal.budgets
        width = max(budgets) + 1
        key = graphs.bucket(num, width)
        n, w, _ = key
        graphs.set_layout(num, n, w, w)  # the prologue writes every row of the real requests
        self._stage_inputs(proposal, n, w, width, variant, stage)
        if graphs.emulate:
            built = self._prologue(n, w)
            hidden, layers = graphs.replay(key)
            walk, packed, nexts = self._epilogue(n, w, hidden, *built, variant)
        else:
            rnd = self.rounds[key]
            rnd.prologue.replay()
            _, layers = graphs.replay(key)
            graph, (walk, packed, nexts) = rnd.epilogues[variant]
            graph.replay()
            built = rnd.built
        tree, curve, slots = built
        starts = self._inputs_of(num, n)[2]
        if num == n:  # the bucket holds just these requests: its outputs as they are (each cut costs a torch call)
            return RoundStep(tree, curve, slots, walk, starts, packed,
                             [c if c.shape[0] == num * w else c[:num * w] for c in layers], w, nexts)
        cut = DraftTree(*(t[:num] for t in (tree.node_token_ids, tree.parents, tree.depths, tree.num_nodes,
                                            tree.visibility, tree.scores)), tree.max_depth)
        return RoundStep(cut, curve[:num], slots[:num],
                         Walk(walk.accepted_nodes[:num], walk.accept_len[:num], walk.emitted[:num]),
                         starts, packed[:num], [c[:num * w] for c in layers], w,
                         (nexts[0][:num], nexts[1][:num]))

    def _stage_inputs(self, proposal: Proposal, n: int, w: int, width: int, variant: str, stage: Staging) -> None:
        """The static inputs of a round: one staged copy of the requests' integers and block tables (and one of
        their sampling parameters), the proposal, and what the previous round left on the device."""
        seqs, num = proposal.seqs, len(proposal.seqs)
        pad = [0] * (n - num)
        small_n, roots, starts, logprobs, token_ids = self._inputs_of(num, n)
        host_ends = proposal.roots is None
        rows = [proposal.budgets, proposal.full_budgets(self.max_budget), [width] * num,
                [s.request.last_token_id for s in seqs] if host_ends else [0] * num,
                [s.request.num_computed_tokens for s in seqs] if host_ends else [0] * num]
        small_n.copy_(stage([v for row in rows for v in row + pad]).view(len(rows), n))
        self.graphs.write_tables([s.request.block_ids for s in seqs], stage)
        if variant != GREEDY:
            self.sampling.stage(seqs, [s.request.num_output_tokens for s in seqs], stage,
                                None if host_ends else proposal.depth_offsets)
        if not host_ends:
            roots.copy_(proposal.roots)
            starts.copy_(proposal.starts)
        logprobs.copy_(proposal.logprobs)
        token_ids.copy_(proposal.token_ids)

    def _inputs_of(self, num: int, n: int) -> tuple[torch.Tensor, ...]:
        """The static inputs of `num` requests in bucket n, as views: the integers' rows [5, n], roots and root
        positions [num], the proposal [num, L, K] twice. Kept per shape: each view is a torch call, a few us of host
        time a round."""
        key = (num, n)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = (self.small[:, :n], self.small[ROOT, :num], self.small[START, :num],
                                        self.logprobs[:num], self.token_ids[:num])
        return views

    # --------------------------------------------------------------------------------------- graph bodies

    def _prologue(self, n: int, w: int) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
        """Trees and verify rows of bucket (n, w) from the static inputs, into the forward's static buffers ->
        (the trees cut to W rows, node q [n, B], cache slots [n, W])."""
        g, small = self.graphs, self.small[:, :n]
        budget_rows = max(self.max_budget, w - 1)  # a bucket wider than the largest tree pads it
        full = DraftTree.from_topk(self.logprobs[:n], self.token_ids[:n], small[ROOT], small[FULL], budget_rows)
        curve = full.node_probabilities()[:, :self.max_budget]  # [n, B]: the host bins it (node_confidence)
        tree = full.truncated(small[BUDGET], w)
        starts, owned = small[START], small[OWNED]
        g.input_ids[:n * w].copy_(tree.input_ids().reshape(-1))
        g.positions[:n * w].copy_(tree.positions(starts).reshape(-1))
        columns = self.columns[:w]
        # rows past the ones a request owns go to scratch slots (their positions clamped into its table)
        kv = starts[:, None] + torch.minimum(columns, (owned - 1).clamp(min=0)[:, None])  # [n, w]
        slots = torch.where(columns < owned[:, None], slots_on_device(g.block_tables[:n], kv, g.block_size),
                            g.scratch_slots[:w])
        g.slot_mapping[:n * w].copy_(slots.reshape(-1))
        g.seq_lens[:n].copy_(starts + w)
        if w > 1:  # a root-only bucket is causal: the plain-decoding forward's
            g.tree_masks[w][:n * w].copy_(tree.flat_tree_mask())
        return tree, curve, slots

    def _epilogue(self, n: int, w: int, hidden: torch.Tensor, tree: DraftTree, curve: torch.Tensor,
                  slots: torch.Tensor, variant: str) -> tuple[Walk, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The target's token after every row, the walk, the compaction, the packed results of bucket (n, w), and
        what a round launched ahead of these results starts from (PendingStep.successors): each request's last
        emitted token and the position after it, [n] each."""
        logits = self.model.compute_logits(hidden, fp32=variant != GREEDY)  # [n * w, vocab]
        targets = self.sampling.choose(logits, n, w, tree.depths, variant)
        walk = Speculator.walk_tree(tree, targets.view(n, w))
        Speculator.compact(self.slot_views, walk, slots)
        parts = [walk.accept_len[:, None], walk.accepted_nodes, walk.emitted, curve]
        last = (walk.accept_len - 1).clamp(min=0)  # (a padding request's walk is never read: no index below 0)
        nexts = (walk.emitted.gather(1, last[:, None])[:, 0], self.small[START, :n] + walk.accept_len)
        return walk, torch.cat([p.to(torch.float64) for p in parts], dim=1), nexts
