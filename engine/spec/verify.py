"""Tree verification: pick the target's token at every tree row, then walk the tree.

Owns the accept rule for greedy (T=0) and sampled (T>0) decoding. Both are "sample and walk":
the target picks one token per tree row from its own (processed) distribution, and the walk
follows the draft child that carries that token. The draft distribution is never used, so
T>0 output is distributed exactly as autoregressive sampling (ddtree.md §2.6); it is not
seed-identical to it, because random numbers are consumed differently.

Glossary (per request and round; rows as in engine.spec.tree)
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

import torch
from torch import Tensor

from engine.spec.tree import DraftTree
from ext.reference.tree import tree_accept

__all__ = [
    "VerifyResult",
    "greedy_target_token_ids",
    "sample_target_token_ids",
    "apply_top_k_top_p",
    "accept",
    "verify_greedy",
    "verify_sampled",
]

_GREEDY_EPS = 1e-5  # temperatures below this decode greedily, as the reference does


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verify round for N requests (L = draft horizon)."""

    accepted_nodes: Tensor  # [N, L+1] int64 accepted tree rows, root first, -1 padded
    accept_len: Tensor  # [N] int64 tau = accepted rows incl. root = emitted tokens
    bonus_token_ids: Tensor  # [N] int64 next round's root
    emitted_token_ids: Tensor  # [N, L+1] int64 accepted drafts then the bonus, -1 padded; accept_len valid


def accept(tree: DraftTree, target_token_ids: Tensor) -> VerifyResult:
    """Walk `tree` along target_token_ids [N, B+1] and collect the emitted tokens."""
    accepted_nodes, accept_len, bonus_token_ids = tree_accept(
        target_token_ids, tree.node_token_ids, tree.parents, tree.num_nodes, tree.max_depth
    )
    # Emitted slot j < tau-1 holds accepted row j+1's token; slot tau-1 holds the bonus.
    drafted_rows = accepted_nodes[:, 1:]  # [N, L]
    drafted_ids = tree.node_token_ids.gather(1, drafted_rows.clamp(min=0))
    drafted_ids = torch.where(drafted_rows >= 0, drafted_ids, -1)
    emitted = torch.cat([drafted_ids, torch.full_like(drafted_ids[:, :1], -1)], dim=1)  # [N, L+1]
    emitted.scatter_(1, (accept_len - 1)[:, None], bonus_token_ids[:, None])
    return VerifyResult(accepted_nodes, accept_len, bonus_token_ids, emitted)


def greedy_target_token_ids(target_logits: Tensor) -> Tensor:
    """[N, B+1, V] -> [N, B+1] argmax per row; ties go to the lowest token id."""
    return target_logits.argmax(-1)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask logits [N, R, V] (fp32) to -inf outside each request's top-k / top-p set.

    top_k [N] int64 (<= 0 or >= V disables); top_p [N] float (>= 1 disables). top-k is applied
    first; top-p keeps the smallest descending-probability prefix whose mass reaches top_p
    (the top token always survives). Tokens tied with the last kept value are kept too.
    """
    vocab_size = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [N, R, V]
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)  # [N]
    kth = sorted_logits.gather(-1, (k - 1)[:, None, None].expand(*logits.shape[:2], 1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # probability of strictly better-ranked tokens
    top_p = top_p.to(probs.dtype)[:, None, None]
    # top_p >= 1 must keep everything even where rounding pushes the cumulative sum past 1.
    drop = (mass_before >= top_p) & (top_p < 1.0)
    drop |= sorted_logits == float("-inf")  # so the cutoff below is the last kept finite value
    drop[..., 0] = False
    cutoff = sorted_logits.masked_fill(drop, float("inf")).amin(-1, keepdim=True)  # [N, R, 1]
    return logits.masked_fill(logits < cutoff, float("-inf"))


def sample_target_token_ids(
    target_logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    generator: "torch.Generator | list[torch.Generator | None] | None" = None,
    num_nodes: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """[N, B+1, V] -> [N, B+1]: one independent target sample per tree row.

    temperature [N] float (< 1e-5 means greedy for that request), top_k [N] int64, top_p [N]
    float, min_p [N] float (optional): the processing of the non-speculative sampler, applied
    to every row. generator: one for the batch, or one per request (a seeded request then
    draws the same numbers whatever else is batched with it). Rows >= num_nodes [N] (padding)
    are never read by the walk; their logits are replaced by zeros so garbage there cannot
    break sampling.
    """
    num_reqs, num_rows, vocab_size = target_logits.shape
    device = target_logits.device
    logits = target_logits.float()
    if num_nodes is not None:
        is_real = torch.arange(num_rows, device=device) < num_nodes[:, None]
        logits = torch.where(is_real[..., None], logits, 0.0)
    temperature = temperature.to(device=device, dtype=torch.float32)
    is_greedy = temperature < _GREEDY_EPS  # [N]
    scale = torch.where(is_greedy, 1.0, temperature)
    processed = apply_top_k_top_p(logits / scale[:, None, None], top_k.to(device), top_p.to(device))
    probs = processed.softmax(-1)  # [N, B+1, V]
    if min_p is not None:
        min_p = min_p.to(device=device, dtype=probs.dtype)[:, None, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    if isinstance(generator, (list, tuple)):
        sampled = torch.cat([torch.multinomial(probs[n], 1, generator=g).T for n, g in enumerate(generator)])
    else:
        sampled = torch.multinomial(probs.reshape(-1, vocab_size), 1, generator=generator)
    sampled = sampled.reshape(num_reqs, num_rows)
    return torch.where(is_greedy[:, None], logits.argmax(-1), sampled)


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> VerifyResult:
    """T=0 verify: target_logits [N, B+1, V] from the verify pass."""
    return accept(tree, greedy_target_token_ids(target_logits))


def verify_sampled(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    generator: "torch.Generator | list[torch.Generator | None] | None" = None,
    min_p: Tensor | None = None,
) -> VerifyResult:
    """T>0 verify (requests with temperature < 1e-5 decode greedily in the same batch)."""
    target_token_ids = sample_target_token_ids(
        target_logits, temperature, top_k, top_p, generator, tree.num_nodes, min_p
    )
    return accept(tree, target_token_ids)
