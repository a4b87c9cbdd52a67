r"""DraftTree: one batch of DDTree draft trees and the verify inputs derived from them.

Owns the engine-side view of the tree: building it from draft logits, the verify block's
input ids, RoPE positions and attention mask. The tree math lives in the tree ops
(ext.ops: CUDA kernels on CUDA, ext.reference elsewhere).

Glossary
  root        tree row 0: last round's bonus token, at position `start`, not yet in the target
              KV cache. It is verified like any other row but never "drafted".
  node        a drafted tree row i >= 1: one prefix of the best-first search (ddtree.md §2.3).
  depth       root 0, drafted nodes 1..L; the node's token sits at position start + depth.
  budget B    drafted nodes per request (max_budget = the padded width; each request has its
              own budget b <= B). Every request has B+1 rows; rows >= num_nodes are padding.
  horizon L   draft depths = drafter block_size - 1 (kept separate from the budget).
  visibility  vis[i, j] = node j is an ancestor-or-self of node i.

Example (ddtree.md §6.2 V1: B = 4, L = 3, root token 7 at start = 10)

        row 0  [7]  pos 10            node_token_ids  [ 7, 1, 3, 5, 2]
         /        \                   parents         [-1, 0, 1, 2, 0]
  row 1 [1]     row 4 [2]  pos 11     depths          [ 0, 1, 2, 3, 1]
     |                                positions       [10,11,12,13,11]   siblings share 11
  row 2 [3]                pos 12     visibility row 3 = 1 1 1 1 0 (root, 1, 2, self)
     |                                visibility row 4 = 1 0 0 0 1 (root, self)
  row 3 [5]                pos 13

Rows are in pop order, so parents[i] < i and the visibility block is lower-triangular.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from ext import ops

__all__ = ["DraftTree", "additive_mask"]


@dataclass(frozen=True)
class DraftTree:
    """A batch of N draft trees padded to B+1 rows each (row 0 = root)."""

    node_token_ids: Tensor  # [N, B+1] int64, row 0 = root token, padding = -1
    parents: Tensor  # [N, B+1] int64, root and padding = -1
    depths: Tensor  # [N, B+1] int64, root and padding = 0
    num_nodes: Tensor  # [N] int64, drafted nodes + root
    visibility: Tensor  # [N, B+1, B+1] bool, ancestor-or-self; padding rows see only themselves
    scores: Tensor  # [N, B+1] float64 draft log-probability of each prefix; root 0, padding -inf
    max_depth: int  # L, the draft horizon

    @classmethod
    def from_draft_logits(
        cls, draft_logits: Tensor, root_token_ids: Tensor, budgets: Tensor, max_budget: int
    ) -> "DraftTree":
        """Build the trees from the drafter's logits.

        draft_logits [N, L, V] (row d predicts depth d+1); root_token_ids [N] int64 (last
        round's bonus tokens); budgets [N] int64 drafted nodes per request (<= max_budget).
        """
        vocab_size = draft_logits.shape[-1]
        # Lemma 1: only the top min(B, V) tokens of each depth can enter a B-node tree.
        logprobs, token_ids = ops.topk_logprobs(draft_logits, max(1, min(max_budget, vocab_size)))
        return cls.from_topk(logprobs, token_ids, root_token_ids, budgets, max_budget)

    @classmethod
    def from_topk(cls, draft_logprobs: Tensor, draft_token_ids: Tensor, root_token_ids: Tensor,
                  budgets: Tensor, max_budget: int) -> "DraftTree":
        """Build the trees from a drafter's per-depth top-K ([N, L, K] log-probs sorted descending, ids)."""
        built = ops.build_tree(draft_logprobs, draft_token_ids, budgets, max_budget)
        node_token_ids = built.node_token_ids.clone()
        node_token_ids[:, 0] = root_token_ids
        return cls(node_token_ids, built.parents, built.depths, built.num_nodes,
                   built.visibility, built.scores, draft_logprobs.shape[1])

    def truncated(self, budgets: Tensor, width: int) -> "DraftTree":
        """The first budgets[n] drafted nodes of each tree, in `width` rows. Best-first trees nest (the first b
        nodes of a tree built for B >= b are the tree built for b), so this is the b-node tree; rows past a
        request's budget become padding (never children, never accepted)."""
        num_nodes = torch.minimum(self.num_nodes, budgets.to(self.num_nodes.device) + 1)
        return DraftTree(self.node_token_ids[:, :width], self.parents[:, :width], self.depths[:, :width], num_nodes,
                         self.visibility[:, :width, :width], self.scores[:, :width], self.max_depth)

    def node_probabilities(self) -> Tensor:
        """[N, B] float64: the draft probability q of each drafted node's prefix, best-first (padding 0); the first
        b of them sum to the drafter's own estimate of the drafts a b-node tree accepts (DDTree, Prop. 1)."""
        return self.scores[:, 1:].exp()

    @property
    def num_rows(self) -> int:
        """B+1: verify rows per request, padding included."""
        return self.node_token_ids.shape[1]

    def is_real(self) -> Tensor:
        """[N, B+1] bool: rows that hold the root or a drafted node."""
        row_ids = torch.arange(self.num_rows, device=self.num_nodes.device)
        return row_ids < self.num_nodes[:, None]

    def input_ids(self, pad_token_id: int = 0) -> Tensor:
        """[N, B+1] verify input ids; padding rows carry pad_token_id so they can be embedded."""
        return torch.where(self.is_real(), self.node_token_ids, pad_token_id)

    def positions(self, start_positions: Tensor) -> Tensor:
        """[N, B+1] RoPE positions start + depth (siblings share one); padding rows get start."""
        return start_positions[:, None] + self.depths

    def flat_tree_mask(self) -> Tensor:
        """[N * (B+1), B+1] bool: visibility rows flattened request-major, one row per verify token."""
        return self.visibility.reshape(-1, self.num_rows)

    def attention_mask(self, prefix_lens: Tensor, kv_len: int) -> Tensor:
        """[N, B+1, kv_len] bool verify mask, True = may attend.

        Assumes the tree's K/V rows sit right after each request's prefix: key column
        prefix_lens[n] + j holds tree row j. Real rows see the whole prefix plus their
        ancestors-or-self; padding rows see only themselves (never an empty row); columns
        past prefix + B+1 are masked.
        """
        num_reqs, num_rows = self.node_token_ids.shape
        cols = torch.arange(kv_len, device=self.visibility.device)
        tree_cols = cols[None, :] - prefix_lens[:, None]  # [N, kv_len], tree row of each column
        in_prefix = tree_cols < 0
        in_tree = (tree_cols >= 0) & (tree_cols < num_rows)
        gather_cols = tree_cols.clamp(0, num_rows - 1)[:, None, :].expand(num_reqs, num_rows, kv_len)
        tree_part = self.visibility.gather(2, gather_cols) & in_tree[:, None, :]
        prefix_part = in_prefix[:, None, :] & self.is_real()[:, :, None]
        return prefix_part | tree_part


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask -> additive attention bias: 0 where visible, finfo(dtype).min elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)
