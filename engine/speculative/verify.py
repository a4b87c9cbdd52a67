"""Tree verification: pick the target's token at every tree row, then walk the tree.

Owns the accept rule for greedy (T=0) and sampled (T>0) decoding. Both are "sample and walk":
the target picks one token per tree row from its own (processed) distribution, and the walk
follows the draft child that carries that token. The draft distribution is never used, so
T>0 output is distributed exactly as autoregressive sampling (ddtree.md §2.6); it is not
seed-identical to it, because random numbers are consumed differently.

Glossary (per request and round; rows as in engine.speculative.tree)
  target token   target_token_ids[i]: the target's token after tree row i (argmax, or one
                 sample from the temperature/top-k/top-p processed distribution at row i).
  accepted       tree rows on the walked path, root first: accepted_nodes[0] = 0 (the root),
                 then each next accepted row is the child whose token is the target token of
                 the previous one.
  bonus          the target token at the last accepted row: the first target token the tree
                 did not contain. It is emitted now and becomes next round's root.
  accept length  tau = accept_len = accepted rows INCLUDING the root, 1 <= tau <= L+1.
  emitted tokens the tokens this round appends to the output: the tau-1 accepted drafts
                 (accepted rows 1..) followed by the bonus = exactly tau tokens. The root is
                 not re-emitted (it was last round's bonus), so counting tau+1 tokens, or
                 adding 1 to tau for the bonus, counts the bonus twice.
"""

from dataclasses import dataclass

from torch import Tensor

from engine.speculative.tree import DraftTree
from ext import ops

__all__ = [
    "VerifyResult",
    "greedy_target_token_ids",
    "accept",
    "verify_greedy",
]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verify round for N requests (L = draft horizon)."""

    accepted_nodes: Tensor  # [N, L+1] int64 accepted tree rows, root first, -1 padded
    accept_len: Tensor  # [N] int64 tau = accepted rows incl. root = emitted tokens
    emitted_token_ids: Tensor  # [N, L+1] int64 accepted drafts then the bonus, -1 padded; accept_len valid

    @property
    def bonus_token_ids(self) -> Tensor:
        """[N] int64 next round's root: the last emitted token."""
        return self.emitted_token_ids.gather(1, (self.accept_len - 1)[:, None]).squeeze(1)


def accept(tree: DraftTree, target_token_ids: Tensor) -> VerifyResult:
    """Walk `tree` along target_token_ids [N, B+1] and collect the emitted tokens (one kernel on CUDA)."""
    accepted_nodes, accept_len, emitted = ops.tree_accept(
        target_token_ids, tree.node_token_ids, tree.parents, tree.num_nodes, tree.max_depth
    )
    return VerifyResult(accepted_nodes, accept_len, emitted)


def greedy_target_token_ids(target_logits: Tensor) -> Tensor:
    """[N, B+1, V] -> [N, B+1] argmax per row; ties go to the lowest token id."""
    return target_logits.argmax(-1)


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> VerifyResult:
    """T=0 verify: target_logits [N, B+1, V] from the verify pass."""
    return accept(tree, greedy_target_token_ids(target_logits))
