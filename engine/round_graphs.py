"""Whole-round CUDA graphs for tree steps. A tree step of greedy requests is, besides the drafter's call, three
graph replays per bucket (N requests x W rows, the forward graphs' buckets with W > 1) and two copies:

  prologue  the best-first trees built from the drafter's proposal (full budget, then cut to each request's
            budget), their node confidence, and the verify rows written into the forward graph's static buffers:
            input ids, rope positions (root position + depth), cache slots (looked up in the block tables on
            the device), key counts and the tree mask;
  forward   the target forward's own graph (engine/cuda_graphs.py);
  epilogue  logits of every row, argmax, the tree walk, the KV compaction, and one packed result per request
            (accept length, accepted rows, emitted tokens, node confidence).

Without it the same step launches ~150 operators from the host after the forward's replay, which at small
batches bounds the step. Inputs live in static buffers the host fills with one staged copy (budgets, roots,
root positions, block tables) and two device copies (the proposal); roots and root positions may come from the
previous tree step's epilogue on the device (a step launched ahead of its predecessor's results).

Invariants: rows a request does not own in the bucket (its rows past the step's W, and every row of a padding
request) write their K/V into the scratch slots (engine/cuda_graphs.py) and are never accepted; a bucket's
outputs are static (rewritten by its next replay), so every reader of them is enqueued before that replay or
reads the host copy; their memory pool is not the forward graphs' (whose replays rewrite what their captures
freed). Steps the epilogue cannot serve (sampling at temperature > 0, logprobs, penalties, logit
bias, min_tokens, grammars) replay the forward graph only, and say why in StepStats.cuda_graph.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.plan import ScheduledSeq
from engine.sampler import needs_penalty
from engine.speculative.adaptive import node_confidence
from engine.speculative.speculator import Proposal, Walk
from engine.speculative.tree import DraftTree
from engine.speculative import verify
from engine.staging import Staging
from ext import ops
from ext.metadata import flat_block_table, slots_on_device

logger = logging.getLogger("ddtree.engine")

# rows of RoundGraphs.small: per request of the bucket
BUDGET, FULL, OWNED, ROOT, START = range(5)


@dataclass
class RoundStep:
    """A launched whole-round step's device outputs, cut to its requests (views of static buffers)."""

    tree: DraftTree  # [N, W_bucket]
    curve: torch.Tensor  # [N, 2B] float64
    tree_slots: torch.Tensor  # [N, W_bucket] int64
    walk: Walk
    starts: torch.Tensor  # [N] int64 root positions
    packed: torch.Tensor  # [N, 1 + 2A + 2B] float64
    captured: list[torch.Tensor]  # the forward's captured layers, [N * W_bucket, hidden] each (views)
    width: int  # W_bucket


@dataclass
class _Round:
    prologue: torch.cuda.CUDAGraph | None
    epilogue: torch.cuda.CUDAGraph | None
    outputs: tuple  # (tree, curve, slots, walk, packed) of the capture


class RoundGraphs:
    def __init__(self, graphs, model, slot_views: list[torch.Tensor], max_budget: int, horizon: int, top_k: int):
        """graphs: the engine's CudaGraphs (their static buffers, buckets and memory pool); emulated like them."""
        self.graphs, self.model, self.slot_views = graphs, model, slot_views
        self.max_budget, self.horizon, self.top_k = max_budget, horizon, top_k
        device, most = graphs.device, max(graphs.batch_sizes)
        self.logprobs = torch.zeros(most, horizon, top_k, dtype=torch.float32, device=device)
        self.token_ids = torch.zeros(most, horizon, top_k, dtype=torch.int64, device=device)
        self.small = torch.zeros(5, most, dtype=torch.int64, device=device)  # BUDGET, FULL, OWNED, ROOT, START
        self.keys = [b for b in graphs.buckets if b[1] > 1]
        self.columns = torch.arange(max(graphs.widths), device=device)  # a row's index inside its request
        self.rounds: dict[tuple[int, int, int], _Round] = {}
        # a pool of their own: a prologue's outputs must survive the forward graph's replay, and in the forward
        # graphs' pool they could sit where a forward graph keeps its intermediates
        self.pool = None
        self._told: set[str] = set()

    # ------------------------------------------------------------------------------------------ eligibility

    def why_not(self, seqs: list[ScheduledSeq], width: int, fault_injection: bool = False) -> str | None:
        """Why this tree step (every request decoding, `width` rows each) cannot run as a whole round, or None."""
        why = self._why_not(seqs, width, fault_injection)
        if why is not None and why not in self._told:
            self._told.add(why)
            logger.info("tree steps whose %s run their sampling, walk and compaction outside the CUDA graphs "
                        "(counted in engine_steps_total{mode=\"replay\"})", why)
        return why

    def _why_not(self, seqs: list[ScheduledSeq], width: int, fault_injection: bool) -> str | None:
        key = self.graphs.bucket(len(seqs), width)
        if key is None or (key not in self.rounds and not self.graphs.emulate):
            return f"shape {len(seqs)}x{width} has no round graph"
        if fault_injection:
            return "requests face an injected fault"
        for s in seqs:
            req, sp = s.request, s.request.sampling
            if not sp.greedy:
                return "requests sample at temperature > 0"
            if sp.logprobs is not None:
                return "requests ask for logprobs"
            if sp.logit_bias or needs_penalty(req):
                return "requests have penalties or a logit bias"
            if sp.min_tokens > req.num_output_tokens:
                return "requests are below min_tokens"
            if req.constraint is not None:
                return "requests have a grammar"
        return None

    def fits(self, proposal: Proposal) -> str | None:
        """Why this proposal does not fit the static buffers, or None."""
        shape = tuple(proposal.logprobs.shape[1:])
        if shape != (self.horizon, self.top_k):
            return f"the drafter proposed {shape[1]} candidates at {shape[0]} depths, the round graph holds " \
                   f"{self.top_k} at {self.horizon}"
        return None

    # ---------------------------------------------------------------------------------------------- capture

    @torch.inference_mode()
    def capture(self) -> None:
        """Prologue and epilogue graphs of every tree bucket, in one memory pool of their own."""
        graphs = self.graphs
        for key in sorted(self.keys, key=lambda b: -b[0] * b[1]):
            n, w, _ = key
            graphs.set_layout(0, n, w, w)  # every request a padding request: nothing but scratch is written
            self.small.zero_()
            hidden = graphs.graphs[key].hidden
            self._prologue(n, w)  # warm-up, eager
            self._epilogue(n, w, hidden, *self._prologue(n, w))
            torch.cuda.synchronize(graphs.device)
            prologue, epilogue = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(prologue, pool=self.pool):
                built = self._prologue(n, w)
            self.pool = prologue.pool()
            with torch.cuda.graph(epilogue, pool=self.pool):
                walk, packed = self._epilogue(n, w, hidden, *built)
            self.rounds[key] = _Round(prologue, epilogue, (*built, walk, packed))
        graphs.forget_layout()  # the next step writes its own
        torch.cuda.synchronize(graphs.device)
        logger.info("captured %d whole-round tree-step graph pairs", len(self.rounds))

    # ------------------------------------------------------------------------------------------------- run

    def run(self, proposal: Proposal, block_size: int, stage: Staging) -> RoundStep:
        """Replays the round for a proposal (why_not() and fits() None): its roots and root positions from the
        proposal when drafted ahead, else from the requests on the host."""
        seqs, graphs = proposal.seqs, self.graphs
        num, budgets = len(seqs), proposal.budgets
        width = max(budgets) + 1
        key = graphs.bucket(num, width)
        n, w, _ = key
        graphs.set_layout(num, n, w, w)  # the prologue writes every row of the real requests
        pad = [0] * (n - num)
        host_ends = proposal.roots is None
        roots = [s.request.last_token_id for s in seqs] if host_ends else [0] * num
        starts = [s.request.num_computed_tokens for s in seqs] if host_ends else [0] * num
        flat, num_cols = flat_block_table([s.request.block_ids for s in seqs])
        small, table = stage.pack([budgets + pad + proposal.full_budgets(self.max_budget) + pad
                                   + [width] * num + pad + roots + pad + starts + pad, flat])
        self.small[:, :n].copy_(small.view(5, n))
        if not host_ends:
            self.small[ROOT, :num].copy_(proposal.roots)
            self.small[START, :num].copy_(proposal.starts)
        graphs.block_tables[:num, :num_cols].copy_(table.view(num, num_cols))
        self.logprobs[:num].copy_(proposal.logprobs)
        self.token_ids[:num].copy_(proposal.token_ids)
        if graphs.emulate:
            built = self._prologue(n, w)
            hidden, layers = graphs.replay(key)
            walk, packed = self._epilogue(n, w, hidden, *built)
        else:
            rnd = self.rounds[key]
            rnd.prologue.replay()
            _, layers = graphs.replay(key)
            rnd.epilogue.replay()
            built, (walk, packed) = rnd.outputs[:3], rnd.outputs[3:]
        tree, curve, slots = built
        cut = DraftTree(*(t[:num] for t in (tree.node_token_ids, tree.parents, tree.depths, tree.num_nodes,
                                            tree.visibility, tree.scores)), tree.max_depth)
        return RoundStep(cut, curve[:num], slots[:num],
                         Walk(walk.accepted_nodes[:num], walk.accept_len[:num], walk.emitted[:num]),
                         self.small[START, :num], packed[:num], [c[:num * w] for c in layers], w)

    # --------------------------------------------------------------------------------------- graph bodies

    def _prologue(self, n: int, w: int) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
        """Trees and verify rows of bucket (n, w) from the static inputs, into the forward's static buffers ->
        (the trees cut to W rows, node confidence [n, 2B], cache slots [n, W])."""
        g, small = self.graphs, self.small[:, :n]
        budget_rows = max(self.max_budget, w - 1)  # a bucket wider than the largest tree pads it
        built = ops.build_tree(self.logprobs[:n], self.token_ids[:n], small[FULL], budget_rows)
        node_token_ids = built.node_token_ids.clone()
        node_token_ids[:, 0] = small[ROOT]
        curve = node_confidence(built.scores[:, 1:self.max_budget + 1].exp())
        tree = DraftTree(node_token_ids, built.parents, built.depths, built.num_nodes, built.visibility,
                         built.scores, self.horizon).truncated(small[BUDGET], w)
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
        g.tree_masks[w][:n * w].copy_(tree.flat_tree_mask())
        return tree, curve, slots

    def _epilogue(self, n: int, w: int, hidden: torch.Tensor, tree: DraftTree, curve: torch.Tensor,
                  slots: torch.Tensor) -> tuple[Walk, torch.Tensor]:
        """Greedy targets of every row, the walk, the compaction and the packed results of bucket (n, w)."""
        logits = self.model.compute_logits(hidden)  # [n * w, vocab] fp32
        result = verify.accept(tree, logits.argmax(-1).view(n, w))
        walk = Walk(result.accepted_nodes, result.accept_len, result.emitted_token_ids)
        ops.kv_compact_tree(self.slot_views, walk.accepted_nodes, slots)
        parts = [walk.accept_len[:, None], walk.accepted_nodes, walk.emitted, curve]
        return walk, torch.cat([p.to(torch.float64) for p in parts], dim=1)
