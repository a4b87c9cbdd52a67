"""The runner's DDTree half: for the requests the scheduler gave a tree budget, draft per-depth top-K
distributions, build the best-first trees, lay them out as verify rows, and after the target forward (and the
batched sampler's target token per row) walk the trees and compact the accepted rows' KV into place. Every
step of the round stays on the device: no host sync until the runner's one copy of the step's results.

Per request and step (root = the last committed token, at position `start`, not yet in the target cache):
every tree request of a step has the same number of verify rows W = (largest budget) + 1; row j sits at
logical KV position start + j and rope position start + depth[j]; rows past the request's own nodes are
padding (they see only themselves and are never accepted). After the walk, accepted row acc[j] moves to
logical position start + j, so the cache again holds a plain sequence of start + tau tokens, and tau tokens
(accepted drafts + bonus) are emitted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.plan import ScheduledSeq
from engine.speculative import verify
from engine.speculative.drafter import DraftRequest
from engine.speculative.tree import DraftTree
from engine.structured import ConstrainedTree
from engine.staging import Staging
from ext import ops


@dataclass
class TreeBatch:
    """The step's trees, one per scheduled request that got a tree budget, in plan order."""

    seqs: list[ScheduledSeq]
    tree: DraftTree  # [N, W] rows, root first
    budgets: list[int]  # drafted nodes per request (host copy of what the scheduler granted)
    drafted: list[bool]  # the drafter ran for this request (False: a root-only tree, no proposal, no curve)
    curve: torch.Tensor | None = None  # [N, B] the full-budget tree's node q (the host bins it: node_confidence)
    tree_build_s: float = 0.0  # seconds building the trees from its proposal
    # structured output: request index -> its grammar-aware tree (rows' bitmasks), and nodes the grammar pruned
    constrained: dict = field(default_factory=dict)
    num_pruned: int = 0
    clock: "DraftClock | None" = None  # the drafter's time (device time read after the step's fetch)
    # drafted ahead of the previous tree step's results: [N] int64 root positions and the tokens that step
    # emits per request (the rows' output offset), on the device; None when the host knows both
    starts: torch.Tensor | None = None
    depth_offsets: torch.Tensor | None = None

    @property
    def draft_s(self) -> float:
        """Host seconds in the drafter's propose()."""
        return self.clock.host_s if self.clock is not None else 0.0

    @property
    def width(self) -> int:
        """W: verify rows per request, padding included."""
        return self.tree.num_rows

    @property
    def num_requests(self) -> int:
        return len(self.seqs)


MAX_SPARE_CLOCKS = 8  # event pairs of read clocks kept for reuse (a step reads one or two)


class DraftClock:
    """How long the drafter ran: host seconds on CPU; on CUDA, a pair of events recorded around it, read once
    the step's single device-to-host copy has synchronized (so waiting on the end event costs nothing)."""

    def __init__(self, device: torch.device, spare: list | None = None):
        """spare: event pairs of clocks already read, reused (creating two events costs the host more than
        recording them); seconds() returns this clock's pair there."""
        self.cuda = device.type == "cuda"
        self.host_s = 0.0
        if self.cuda:
            self.spare = spare if spare is not None else []
            self.start, self.end = self.spare.pop() if self.spare else \
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.start.record()
        self.t0 = time.perf_counter()

    def stop(self) -> "DraftClock":
        self.host_s = time.perf_counter() - self.t0
        if self.cuda:
            self.end.record()
        return self

    def seconds(self) -> float:
        """Call after the step's fetch: the device work is then complete (the wait below returns at once)."""
        if not self.cuda:
            return self.host_s
        if self.start is not None:  # (read once: its events then go back to be reused)
            self.end.synchronize()
            self.device_s = self.start.elapsed_time(self.end) / 1000.0
            if len(self.spare) < MAX_SPARE_CLOCKS:
                self.spare.append((self.start, self.end))
            self.start = self.end = None
        return self.device_s


@dataclass
class Walk:
    """The accepted paths, on the device. A = L + 1 (the horizon plus the root)."""

    accepted_nodes: torch.Tensor  # [N, A] int64 accepted tree rows, root first, -1 padded
    accept_len: torch.Tensor  # [N] int64 tau (accepted rows incl. the root = emitted tokens)
    emitted: torch.Tensor  # [N, A] int64 accepted drafts then the bonus, -1 padded


@dataclass
class Proposal:
    """A tree step's drafter output before its trees are built: per request (plan order) the per-depth top-K
    log-probs and ids [N, L, K] on the target's device (zeros for requests not drafted)."""

    seqs: list[ScheduledSeq]
    drafted: list[bool]
    logprobs: torch.Tensor  # [N, L, K] float32, descending along K
    token_ids: torch.Tensor  # [N, L, K] int64
    clock: DraftClock
    # drafted ahead of the previous tree step's results: [N] int64 roots, root positions and the tokens that step
    # emits per request, on the device (None: the host knows them)
    roots: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    depth_offsets: torch.Tensor | None = None

    @property
    def budgets(self) -> list[int]:
        """Drafted nodes per request this step (0 for requests not drafted)."""
        return [s.spec_budget if d else 0 for s, d in zip(self.seqs, self.drafted)]

    def full_budgets(self, max_budget: int) -> list[int]:
        """The budget each request's full tree is built with (its node confidence covers all of them)."""
        return [max_budget if d else 0 for d in self.drafted]


class Speculator:
    def __init__(self, drafter, max_budget: int, chain: bool = False, device: torch.device | str = "cpu",
                 grammar_pruning: bool = True):
        self.drafter, self.max_budget, self.chain = drafter, max_budget, chain
        self.grammar_pruning = grammar_pruning
        self.device = torch.device(device)  # the target's: trees live where the verify rows are
        self.stage = Staging(device)  # the runner shares its own (reset every step)
        self._spare_events: list = []  # DraftClock's event pairs, reused once read
        self.pending_hidden: dict[str, list[torch.Tensor]] = {}  # request -> feature rows not yet drafted on

    def use_staging(self, stage: Staging) -> None:
        """The runner's staging (reset every step) for this step's host-to-device copies, the drafter's too when
        it stages its own."""
        self.stage = stage
        if isinstance(getattr(self.drafter, "stage", None), Staging):
            self.drafter.stage = stage

    @property
    def draft_kv_bytes_per_token(self) -> int:
        """KV bytes the drafter keeps per context token (0: none kept, or not in the engine's memory plan)."""
        return int(getattr(self.drafter, "kv_bytes_per_token", 0))

    def reserve_draft_kv(self, num_tokens: int, max_num_seqs: int) -> None:
        """Sizes a drafter's own KV once, for an engine cache of num_tokens (drafters without one: nothing)."""
        if hasattr(self.drafter, "reserve_kv"):
            self.drafter.reserve_kv(num_tokens, max_num_seqs)

    def capture_draft_graphs(self, batch_sizes: list[int], max_model_len: int, emulate: bool = False) -> None:
        """CUDA graphs of the drafter's call for these batch sizes, if it has them."""
        if hasattr(self.drafter, "capture_graphs"):
            self.drafter.capture_graphs(batch_sizes, self.draft_top_k, max_model_len, emulate=emulate)

    @property
    def draft_top_k(self) -> int:
        """Proposals a depth the drafter is asked for: the chain's top-1, a tree's full budget."""
        return 1 if self.chain else self.max_budget

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layer_ids)

    @property
    def horizon(self) -> int:
        return self.drafter.horizon

    def record_hidden(self, request_id: str, rows: torch.Tensor | None) -> None:
        """Target features [num_rows, num_layers * hidden] of tokens that just got KV, in position order."""
        if rows is not None and self.capture_layer_ids:
            self.pending_hidden.setdefault(request_id, []).append(rows)

    def release(self, request_id: str) -> None:
        self.pending_hidden.pop(request_id, None)
        self.drafter.release(request_id)

    def cannot_draft_ahead(self) -> str | None:
        """Why trees cannot be drafted before the previous tree step's results reach the host, or None."""
        if not hasattr(self.drafter, "propose_ahead"):
            return "the drafter drafts from tokens on the host"
        if getattr(self.drafter, "graphs", True) is None:
            return "the drafter has no CUDA graphs"
        return None

    def confirm_ahead(self, batch: TreeBatch, new_token_ids: dict[str, list[int]]) -> None:
        """The previous tree step's results reached the host (new_token_ids: its tokens per request) while
        `batch`, drafted ahead of them, had already fed its accepted rows' features to the drafter from the
        device: those rows, just recorded again, are dropped, and the drafter counts them as context."""
        if batch.starts is None or not self.capture_layer_ids:
            return
        for s, drafted in zip(batch.seqs, batch.drafted):
            rid = s.request.request_id
            if drafted and rid in new_token_ids:
                self.pending_hidden.pop(rid, None)
                self.drafter.confirm_ahead(rid, len(new_token_ids[rid]))

    def draft(self, seqs: list[ScheduledSeq], drafted: list[bool] | None = None,
              ahead: tuple | None = None) -> TreeBatch:
        """Drafter proposal -> per-request best-first trees, W = max budget + 1 rows each. Requests with
        drafted[i] False (budget 0, not watched) get a root-only tree without running the drafter for them. The
        drafter takes the pending features into its own state; if it fails they stay pending. ahead: (roots,
        root positions, tokens the previous step emits) [N] and the features of its accepted rows [N, A, F] (None
        for drafters without features), on the device, for trees drafted before the previous tree step's results
        reach the host (cannot_draft_ahead() is None)."""
        return self.build(self.propose(seqs, drafted, ahead))

    def build(self, proposal: "Proposal") -> TreeBatch:
        """The proposal's trees, each cut to its request's budget (the tree step's verify rows)."""
        seqs, drafted = proposal.seqs, proposal.drafted
        t1 = time.perf_counter()
        tree, curve, constrained = self._full_trees(proposal)
        tree = tree.truncated(self.stage(proposal.budgets), max(proposal.budgets) + 1)
        return TreeBatch(seqs, tree, proposal.budgets, drafted, curve, tree_build_s=time.perf_counter() - t1,
                         clock=proposal.clock, constrained=constrained,
                         num_pruned=sum(c.num_pruned for c in constrained.values()),
                         starts=proposal.starts, depth_offsets=proposal.depth_offsets)

    def curves(self, seqs: list[ScheduledSeq], ahead: tuple | None = None) -> tuple[torch.Tensor, DraftClock]:
        """[M, B] node q of these requests' full-budget trees, verified by nobody this step (binned on the host by
        confidence.node_confidence, what the adaptive budget reads to decide whether a request at budget 0 should
        verify a tree next step), and the drafter's clock. ahead: as propose()'s, for requests scheduled ahead of
        their newest token."""
        proposal = self.propose(seqs, ahead=ahead)
        _, curve, _ = self._full_trees(proposal)
        return curve, proposal.clock

    def propose(self, seqs: list[ScheduledSeq], drafted: list[bool] | None = None,
                ahead: tuple | None = None) -> "Proposal":
        """The drafter's per-depth top-K for these requests (zeros for the undrafted), on the target's device;
        arguments as draft()."""
        drafted = drafted if drafted is not None else [True] * len(seqs)
        run = [s for s, d in zip(seqs, drafted) if d]
        consumed, batch = {}, []
        for s in run:
            rows = self.pending_hidden.pop(s.request.request_id, None)
            if rows:
                consumed[s.request.request_id] = rows
            batch.append(DraftRequest(s.request.request_id, s.request.committed,
                                      torch.cat(rows) if rows else None))
        top_k = self.draft_top_k
        # the drafted requests' rows, when some are not drafted
        index = self.stage([i for i, d in enumerate(drafted) if d]) if len(run) < len(seqs) else None
        clock = DraftClock(self.device, self._spare_events)
        try:
            if batch and ahead is not None:
                roots, positions, num_new, feats, emitted_ids = (a if a is None or index is None else a[index]
                                                                 for a in ahead)
                logprobs, token_ids = self.drafter.propose_ahead(batch, top_k, roots, positions, num_new, feats,
                                                                 emitted_ids=emitted_ids)  # [N, L, K]
            elif batch:
                logprobs, token_ids = self.drafter.propose(batch, top_k)  # [N, L, K]
            else:
                logprobs = torch.zeros((0, self.horizon, top_k), dtype=torch.float32, device=self.device)
                token_ids = torch.zeros((0, self.horizon, top_k), dtype=torch.int64, device=self.device)
        except BaseException:
            self.restore_hidden(consumed)
            raise
        clock.stop()
        device = self.device
        logprobs, token_ids = logprobs.to(device, non_blocking=True), token_ids.to(device, non_blocking=True)
        if index is not None:  # undrafted requests: any proposal will do, their trees hold the root only
            logprobs = logprobs.new_zeros((len(seqs), *logprobs.shape[1:])).index_copy_(0, index, logprobs)
            token_ids = token_ids.new_zeros((len(seqs), *token_ids.shape[1:])).index_copy_(0, index, token_ids)
        return Proposal(seqs, drafted, logprobs, token_ids, clock, *(ahead[:3] if ahead is not None else (None,) * 3))

    def _full_trees(self, proposal: "Proposal") -> tuple[DraftTree, torch.Tensor, dict]:
        """The proposal built into full-budget trees (best-first trees nest, so a request's own budget is a cut of
        it), their node q [N, B] (the host bins them: confidence.node_confidence) and the grammar-aware trees of
        requests with structured output (built on the host: their proposals come to the host, a sync that only steps
        with such requests pay)."""
        seqs, drafted = proposal.seqs, proposal.drafted
        roots = proposal.roots if proposal.roots is not None else self.stage([s.request.last_token_id for s in seqs])
        # the full budget's node probabilities tell the adaptive budget what a bigger tree would bring
        full = self.stage(proposal.full_budgets(self.max_budget))
        tree = DraftTree.from_topk(proposal.logprobs, proposal.token_ids, roots, full, self.max_budget)
        constrained = self._constrained_trees(seqs, proposal.logprobs, proposal.token_ids, tree, drafted)
        return tree, tree.node_probabilities(), constrained

    def _constrained_trees(self, seqs: list[ScheduledSeq], logprobs: torch.Tensor, token_ids: torch.Tensor,
                           tree: DraftTree, drafted: list[bool]) -> dict[int, ConstrainedTree]:
        """Rebuilds the trees of requests with a grammar so that every node is legal after its parent's path."""
        which = [i for i, s in enumerate(seqs) if s.request.constraint is not None]  # root-only trees too: masks
        if not which:
            return {}
        index = torch.tensor(which, device=logprobs.device)
        lps, ids = logprobs[index].float().cpu().tolist(), token_ids[index].cpu().tolist()
        out = {}
        for j, i in enumerate(which):
            out[i] = ConstrainedTree(lps[j], ids[j], self.max_budget if drafted[i] else 0,
                                     seqs[i].request.constraint, prune=self.grammar_pruning)
            out[i].write_into(tree, i)
        return out

    def restore_hidden(self, consumed: dict[str, list[torch.Tensor]]) -> None:
        """Puts features a failed step consumed back in front of any recorded since."""
        for request_id, rows in consumed.items():
            self.pending_hidden[request_id] = rows + self.pending_hidden.get(request_id, [])

    @staticmethod
    def verify_rows(batch: TreeBatch, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The verify rows of every tree, request-major: input ids [N*W] (padding rows carry token 0), rope
        positions start + depth [N*W] (starts [N] int64 on the device), visibility [N*W, W] bool."""
        tree = batch.tree
        return tree.input_ids().reshape(-1), tree.positions(starts).reshape(-1), tree.flat_tree_mask()

    @staticmethod
    def walk(batch: TreeBatch, target_token_ids: torch.Tensor) -> Walk:
        """target_token_ids [N, W] (the sampler's token after every row) -> the accepted paths."""
        return Speculator.walk_tree(batch.tree, target_token_ids)

    @staticmethod
    def walk_tree(tree: DraftTree, target_token_ids: torch.Tensor) -> Walk:
        """walk() of the trees alone."""
        result = verify.accept(tree, target_token_ids)
        return Walk(result.accepted_nodes, result.accept_len, result.emitted_token_ids)

    @staticmethod
    def compact(slot_views: list[torch.Tensor], walk: Walk, tree_slots: torch.Tensor) -> None:
        """Moves every request's accepted row acc[j] from tree_slots[acc[j]] to tree_slots[j] (on the device;
        a request whose path is the spine in pop order moves nothing)."""
        ops.kv_compact_tree(slot_views, walk.accepted_nodes, tree_slots)
