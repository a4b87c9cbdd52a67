"""Pure-PyTorch reference for the DDTree tree ops: top-K log-probs, tree build, tree walk.

This module is the specification for the CUDA kernels and the CPU implementation. Given the
same inputs, build_tree and tree_accept are exact integer / float64 procedures that a kernel
must match bit for bit (this code gives identical results on CPU and CUDA). topk_logprobs can
only match to fp32 rounding: log_softmax's reduction order differs between devices. Every op
is batched over N requests and returns padded fixed-shape tensors (no Python lists), so the
same shapes can live in CUDA-graph static buffers.

Tree layout (per request, B = max_budget, row 0 = root):
  node_token_ids [B+1]  row 0 = -1 (the caller writes last round's bonus token there), -1 = padding
  parents        [B+1]  -1 for the root and for padding; parents[i] < i for every drafted node
  depths         [B+1]  0 for the root and for padding; drafted nodes have depth 1..L
  num_nodes      []     drafted nodes + 1 (the root); rows >= num_nodes are padding
Rows are numbered in pop order of the best-first heap (ddtree.md §2.3), so scores are
non-increasing along rows and every node's parent comes before it.
"""

from typing import NamedTuple

import heapq

import numpy as np
import torch
from torch import Tensor

__all__ = ["TreeBuild", "topk_logprobs", "build_tree", "tree_accept"]

_LOW32 = (1 << 32) - 1


def topk_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Fused log_softmax (in fp32) + top-K over the vocabulary.

    logits: [N, L, V], any float dtype. Returns (logprobs [N, L, K] float32 sorted descending,
    token_ids [N, L, K] int64) with K = min(k, V).

    Ties are broken by the lowest token id: among equal log-probs the smaller id ranks first
    (torch.topk makes no such promise, so the order is forced through a unique int64 sort key
    = order-preserving bits of the fp32 log-prob in the high word, reversed token id in the
    low word). -0.0 is canonicalised to +0.0 so it ties with +0.0. Inputs must not hold NaN.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, L, V], got {tuple(logits.shape)}")
    vocab_size = logits.shape[-1]
    k = max(0, min(int(k), vocab_size))
    logprobs = torch.log_softmax(logits.float(), dim=-1) + 0.0  # [N, L, V]; +0.0 turns -0.0 into +0.0
    bits = logprobs.view(torch.int32).to(torch.int64)
    # Map float bits to integers with the same order: negative floats have their magnitude bits flipped.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    vocab_ids = torch.arange(vocab_size, device=logits.device, dtype=torch.int64)
    sort_key = ordered * (1 << 32) + (_LOW32 - vocab_ids)  # [N, L, V], unique per row
    token_ids = torch.topk(sort_key, k, dim=-1, largest=True, sorted=True).indices  # [N, L, K]
    return logprobs.gather(-1, token_ids), token_ids


class TreeBuild(NamedTuple):
    """Output of build_tree. B = max_budget; row 0 is the root; rows >= num_nodes are padding."""

    node_token_ids: Tensor  # [N, B+1] int64, root and padding = -1
    parents: Tensor  # [N, B+1] int64, root and padding = -1
    depths: Tensor  # [N, B+1] int64, root and padding = 0
    num_nodes: Tensor  # [N] int64, drafted nodes + root
    # [N, B+1, B+1] bool: visibility[n, i, j] = node j is an ancestor-or-self of node i.
    # The diagonal is True on padding rows too, so every verify row keeps one visible key
    # (a fully masked softmax row would produce NaN); padding rows see nothing else and no
    # real row ever sees a padding column.
    visibility: Tensor
    scores: Tensor  # [N, B+1] float64 log q(prefix) at pop time; root = 0.0, padding = -inf
    ranks: Tensor  # [N, B+1] int64 index of the node's token in its depth's top-K; root/padding = -1


def build_tree(
    draft_logprobs: Tensor,
    draft_token_ids: Tensor,
    budgets: Tensor,
    max_budget: int,
) -> TreeBuild:
    """Best-first DDTree build (PAPER Alg. 1), batched over requests.

    draft_logprobs [N, L, K] float32, sorted descending along K (as topk_logprobs returns);
    draft_token_ids [N, L, K] int64; budgets [N] int64 = drafted nodes wanted per request,
    clamped to [0, max_budget] (0 gives a root-only tree).

    Per request this pops exactly min(b, sum_d K^d) prefixes, in the order the reference heap
    does:
      - a candidate is a rank path (r_1..r_d); its score is accumulated in float64 from the fp32
        log-probs with the reference's incremental arithmetic: first child = score + lp[d][0],
        next sibling = (score - lp[d-1][r]) + lp[d-1][r+1];
      - the highest score pops first; exact float64 ties go to the lexicographically smaller
        rank path (Python tuple order, so (0, 0) pops before (1,));
      - popping (d, r) pushes its next sibling (if r+1 < K) and its first child (if d < L).
    Log-probs must be finite (a top-K of log_softmax over finite logits is).
    """
    if draft_logprobs.device.type == "cpu":
        return _build_heap(draft_logprobs, draft_token_ids, budgets, max_budget)
    build = _Build(draft_logprobs, draft_token_ids, budgets, max_budget)
    for step in range(max_budget if build.can_pop else 0):
        build.pop(step)
    return build.result()


def _build_heap(draft_logprobs: Tensor, draft_token_ids: Tensor, budgets: Tensor, max_budget: int) -> TreeBuild:
    """The same build with a per-request Python heap: the CPU path (tensor ops per pop cost ~0.5 ms each on
    CPU, a heap push/pop microseconds). Heap entries order by (-score, rank path) exactly like `_Build`. The
    rows are written into numpy arrays, made tensors once (small tensor writes per node and per request took
    ~150 us of a one-request build)."""
    num_reqs, max_depth, k = draft_logprobs.shape
    num_rows = max_budget + 1
    lp_all, ids_all = draft_logprobs.double().tolist(), draft_token_ids.tolist()
    budget_list = budgets.clamp(0, max_budget).tolist()
    node_token_ids = np.full((num_reqs, num_rows), -1, dtype=np.int64)
    parents = np.full((num_reqs, num_rows), -1, dtype=np.int64)
    depths = np.zeros((num_reqs, num_rows), dtype=np.int64)
    ranks = np.full((num_reqs, num_rows), -1, dtype=np.int64)
    scores = np.full((num_reqs, num_rows), float("-inf"), dtype=np.float64)
    scores[:, 0] = 0.0
    num_nodes = np.ones(num_reqs, dtype=np.int64)
    visibility = np.zeros((num_reqs, num_rows, num_rows), dtype=bool)
    diagonal = np.arange(num_rows)
    visibility[:, diagonal, diagonal] = True
    for n in range(num_reqs):
        lp, ids, budget = lp_all[n], ids_all[n], int(budget_list[n])
        rows = []  # (token, parent, depth, rank, score)
        heap = [(-lp[0][0], (0,), 0, 1, 0, lp[0][0])] if budget > 0 and max_depth and k else []
        while heap and len(rows) < budget:
            _, path, parent, depth, rank, score = heapq.heappop(heap)
            rows.append((ids[depth - 1][rank], parent, depth, rank, score))
            node = len(rows)
            if rank + 1 < k:
                s = score - lp[depth - 1][rank] + lp[depth - 1][rank + 1]
                heapq.heappush(heap, (-s, path[:-1] + (rank + 1,), parent, depth, rank + 1, s))
            if depth < max_depth:
                s = score + lp[depth][0]
                heapq.heappush(heap, (-s, path + (0,), node, depth + 1, 0, s))
        if rows:
            count = len(rows)
            token_col, parent_col, depth_col, rank_col, score_col = zip(*rows)
            node_token_ids[n, 1 : count + 1] = token_col
            parents[n, 1 : count + 1] = parent_col
            depths[n, 1 : count + 1] = depth_col
            ranks[n, 1 : count + 1] = rank_col
            scores[n, 1 : count + 1] = score_col
            num_nodes[n] = count + 1
            vis = visibility[n]
            for i, parent in enumerate(parent_col, start=1):
                vis[i] |= vis[parent]
    return TreeBuild(*(torch.from_numpy(a) for a in (node_token_ids, parents, depths, num_nodes, visibility, scores,
                                                     ranks)))


# Columns of a frontier candidate: parent row, depth (1-based; 0 = empty slot), rank, rank path.
_PARENT, _DEPTH, _RANK, _PATH = 0, 1, 2, 3


class _Build:
    """State of one batched build: the tree rows filled so far and the heap frontier."""

    def __init__(self, draft_logprobs: Tensor, draft_token_ids: Tensor, budgets: Tensor, max_budget: int):
        num_reqs, self.max_depth, self.k = draft_logprobs.shape
        device = draft_logprobs.device
        num_rows = max_budget + 1
        self.can_pop = max_budget > 0 and self.max_depth > 0 and self.k > 0
        self.rows = torch.arange(num_reqs, device=device)
        self.row_ids = torch.arange(num_rows, device=device)
        self.lp = draft_logprobs.to(torch.float64)  # [N, L, K]
        self.token_ids = draft_token_ids  # [N, L, K]
        self.budgets = budgets.to(device=device, dtype=torch.int64).clamp(0, max_budget)  # [N]

        # Tree rows: (token id, parent, depth, rank); root and padding rows stay (-1, -1, 0, -1).
        self.pad_record = torch.tensor([-1, -1, 0, -1], dtype=torch.int64, device=device)
        self.records = self.pad_record.repeat(num_reqs, num_rows, 1)  # [N, B+1, 4]
        self.scores = torch.full((num_reqs, num_rows), float("-inf"), dtype=torch.float64, device=device)
        self.scores[:, 0] = 0.0
        self.num_nodes = torch.ones(num_reqs, dtype=torch.int64, device=device)
        eye = torch.eye(num_rows, dtype=torch.bool, device=device)
        self.visibility = eye.expand(num_reqs, num_rows, num_rows).clone()  # [N, B+1, B+1]

        # Frontier of B+1 slots: each pop removes one candidate and adds at most two. Pop t puts
        # its next sibling back into the popped slot and its first child into fresh slot t+1.
        self.cand_scores = torch.full((num_reqs, num_rows), float("-inf"), dtype=torch.float64, device=device)
        self.cands = torch.zeros((num_reqs, num_rows, _PATH + self.max_depth), dtype=torch.int64, device=device)
        self.cands[..., _PATH:] = -1  # rank paths padded with -1: a prefix compares smaller (tuple order)
        if self.can_pop:
            self.cand_scores[:, 0] = self.lp[:, 0, 0]
            self.cands[:, 0, _DEPTH] = (self.budgets > 0).to(torch.int64)
            self.cands[:, 0, _PATH] = 0

    def pop(self, step: int) -> None:
        """Tree row step+1 of every request that still has budget gets its best candidate."""
        rows, lp, node, k = self.rows, self.lp, step + 1, self.k
        # 1. Pop.
        slot = _best_slot(self.cand_scores, self.cands)  # [N]
        score = self.cand_scores[rows, slot]  # [N]
        cand = self.cands[rows, slot]  # [N, 3+L]
        active = (cand[:, _DEPTH] > 0) & (step < self.budgets)  # [N]
        # Clamps only keep the gathers legal on inactive rows (an emptied slot may hold rank K).
        parent, rank = cand[:, _PARENT], cand[:, _RANK].clamp(max=k - 1)
        depth = cand[:, _DEPTH].clamp(min=1)

        # 2. Record it as tree row `node`; its visibility row = its parent's row plus itself.
        token = self.token_ids[rows, depth - 1, rank]
        record = torch.stack([token, parent, depth, rank], dim=-1)  # [N, 4]
        self.records[:, node] = torch.where(active[:, None], record, self.pad_record)
        self.scores[:, node] = torch.where(active, score, float("-inf"))
        self.num_nodes += active.to(torch.int64)
        parent_row = self.visibility[rows, parent] & active[:, None]  # [N, B+1]
        self.visibility[:, node] = parent_row | (self.row_ids == node)

        # 3. Next sibling into the popped slot (or empty it). Inactive requests never pop again,
        #    so their frontier may be overwritten freely.
        next_rank = rank + 1
        sibling = cand.clone()
        sibling[:, _DEPTH] = torch.where(active & (next_rank < k), depth, 0)
        sibling[:, _RANK] = next_rank
        sibling[rows, _PATH + depth - 1] = next_rank
        next_lp = lp[rows, depth - 1, next_rank.clamp(max=k - 1)]
        self.cand_scores[rows, slot] = (score - lp[rows, depth - 1, rank]) + next_lp
        self.cands[rows, slot] = sibling

        # 4. First child into the fresh slot `node` (its rank-path entry sits at index depth).
        child_pos = depth.clamp(max=self.max_depth - 1)
        child = cand.clone()
        child[:, _PARENT] = node
        child[:, _DEPTH] = torch.where(active & (depth < self.max_depth), depth + 1, 0)
        child[:, _RANK] = 0
        child[rows, _PATH + child_pos] = 0
        self.cand_scores[:, node] = score + lp[rows, child_pos, 0]
        self.cands[:, node] = child

    def result(self) -> TreeBuild:
        node_token_ids, parents, depths, ranks = (t.contiguous() for t in self.records.unbind(-1))
        return TreeBuild(node_token_ids, parents, depths, self.num_nodes, self.visibility, self.scores, ranks)


def _best_slot(cand_scores: Tensor, cands: Tensor) -> Tensor:
    """[N] slot of the max-score live candidate; exact ties go to the smallest rank path."""
    live = cands[..., _DEPTH] > 0  # [N, F]
    masked = torch.where(live, cand_scores, float("-inf"))
    tied = live & (masked == masked.amax(-1, keepdim=True))
    if bool((tied.sum(-1) > 1).any()):
        # Rank paths are unique, so narrowing column by column leaves exactly one candidate.
        big = torch.iinfo(torch.int64).max
        for d in range(_PATH, cands.shape[-1]):
            column = torch.where(tied, cands[..., d], big)
            tied &= column == column.amin(-1, keepdim=True)
    return tied.to(torch.uint8).argmax(-1)


def tree_accept(
    target_token_ids: Tensor,
    node_token_ids: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Walk each tree from the root along the target's tokens.

    target_token_ids [N, B+1] int64: the target's token after node i (argmax at T=0, or one
    sample from the target's processed distribution at node i at T>0; the same walk serves
    both). node_token_ids, parents [N, B+1] and num_nodes [N] as built by build_tree;
    max_depth = L, the draft horizon.

    From the root, repeatedly move to the child of the current node whose token equals
    target_token_ids[current]; stop when there is none (sibling tokens are distinct, so there
    is at most one). Returns:
      accepted_nodes  [N, L+1] int64: accepted tree rows in root-to-leaf order, [n, 0] = 0
                      (the root), padded with -1;
      accept_len      [N] int64: accepted rows including the root (= tokens emitted this round,
                      counting the bonus and not the root, which was last round's bonus);
      emitted         [N, L+1] int64: the target's token after each accepted row (= the accepted
                      drafts' tokens, then the bonus at [n, accept_len - 1]), padded with -1.
    Token id 0 is an ordinary token; only rows < num_nodes (and > 0) can be children.
    """
    num_reqs, num_rows = node_token_ids.shape
    device = node_token_ids.device
    rows = torch.arange(num_reqs, device=device)
    row_ids = torch.arange(num_rows, device=device)
    is_drafted = (row_ids > 0) & (row_ids < num_nodes.to(device)[:, None])  # [N, B+1]

    accepted_nodes = torch.full((num_reqs, max_depth + 1), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    accept_len = torch.ones(num_reqs, dtype=torch.int64, device=device)
    current = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    walking = torch.ones(num_reqs, dtype=torch.bool, device=device)
    for step in range(1, max_depth + 1):
        wanted = target_token_ids[rows, current]  # [N]
        match = is_drafted & (parents == current[:, None]) & (node_token_ids == wanted[:, None])
        found = walking & match.any(-1)
        child = match.to(torch.uint8).argmax(-1)
        current = torch.where(found, child, current)
        accepted_nodes[:, step] = torch.where(found, child, -1)
        accept_len += found.to(torch.int64)
        walking = found
    emitted = target_token_ids.gather(1, accepted_nodes.clamp(min=0))
    return accepted_nodes, accept_len, torch.where(accepted_nodes >= 0, emitted, -1)
