"""Tree walk (ext.reference.tree.tree_accept) and verification (engine.speculative.verify)."""

import pytest
import torch

from engine.speculative.tree import DraftTree
from engine.speculative.verify import accept, verify_greedy
from ext.reference.tree import build_tree, topk_logprobs, tree_accept


def v1_tree(root: int = 7, max_budget: int = 4) -> DraftTree:
    logits = torch.full((1, 3, 6), -10.0)
    logits[0, 0, 1], logits[0, 0, 2], logits[0, 1, 3], logits[0, 1, 4], logits[0, 2, 5] = 4, 3, 5, 1, 6
    return DraftTree.from_draft_logits(logits, torch.tensor([root]), torch.tensor([4]), max_budget)


def one_hot_logits(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, R] target tokens -> [N, R, vocab] logits whose argmax is that token."""
    return torch.nn.functional.one_hot(token_ids, vocab).float() * 5.0


def test_vector_v1_walk():
    tree = v1_tree()
    result = accept(tree, torch.tensor([[1, 3, 5, 0, 0]]))
    assert result.accepted_nodes.tolist() == [[0, 1, 2, 3]]
    assert result.accept_len.tolist() == [4] and result.bonus_token_ids.tolist() == [0]
    assert result.emitted_token_ids.tolist() == [[1, 3, 5, 0]]  # 3 drafts + bonus = tau tokens


def test_walk_partial_sibling_and_immediate_reject():
    tree = v1_tree()
    cases = [  # target tokens at rows 0..4 -> (accepted rows, bonus)
        ([2, 0, 0, 0, 4], [0, 4, -1, -1], 4),  # the rank-1 sibling wins, then its target token
        ([1, 4, 0, 0, 0], [0, 1, -1, -1], 4),  # depth 2 rejects: bonus is row 1's target token
        ([3, 3, 5, 0, 0], [0, -1, -1, -1], 3),  # immediate reject: bonus = target at the root
    ]
    for target, accepted, bonus in cases:
        result = accept(tree, torch.tensor([target]))
        assert result.accepted_nodes.tolist() == [accepted]
        assert result.bonus_token_ids.tolist() == [bonus]
        tau = sum(a >= 0 for a in accepted)
        assert result.accept_len.tolist() == [tau]
        assert result.emitted_token_ids[0, :tau].tolist()[-1] == bonus
        assert (result.emitted_token_ids[0, tau:] == -1).all()


def test_walk_accepts_token_zero_and_ignores_padding_rows():
    logits = torch.full((1, 3, 4), -5.0)
    logits[..., 0] = 5.0  # the spine is token 0 at every depth
    lp, ids = topk_logprobs(logits, 2)
    built = build_tree(lp, ids, torch.tensor([3]), 6)
    tokens = built.node_token_ids.clone()
    tokens[0, 0] = 0
    target = torch.zeros(1, 7, dtype=torch.long)
    acc, tau, emitted = tree_accept(target, tokens, built.parents, built.num_nodes, 3)
    assert acc.tolist() == [[0, 1, 2, 3]] and tau.tolist() == [4] and emitted.tolist() == [[0, 0, 0, 0]]
    # Padding rows that look like children of the root must never be accepted.
    tokens[0, 4:], parents = 9, built.parents.clone()
    parents[0, 4:] = 0
    acc, tau, emitted = tree_accept(torch.full((1, 7), 9), tokens, parents, built.num_nodes, 3)
    assert acc.tolist() == [[0, -1, -1, -1]] and emitted.tolist() == [[9, -1, -1, -1]]


def test_walk_properties_random():
    gen = torch.Generator().manual_seed(0)
    num_reqs, depth_count, vocab, budget = 64, 5, 6, 20
    logits = torch.randn(num_reqs, depth_count, vocab, generator=gen)
    budgets = torch.randint(0, budget + 1, (num_reqs,), generator=gen)
    tree = DraftTree.from_draft_logits(logits, torch.randint(0, vocab, (num_reqs,), generator=gen), budgets, budget)
    # Target tokens: a child's token most of the time (deep walks), else any token.
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    for n in range(num_reqs):
        for i in range(int(tree.num_nodes[n])):
            children = (tree.parents[n] == i).nonzero().flatten()
            if len(children) and torch.rand((), generator=gen) < 0.8:
                pick = children[torch.randint(0, len(children), (1,), generator=gen)]
                target[n, i] = tree.node_token_ids[n, pick]
    result = accept(tree, target)
    assert result.accepted_nodes.shape == (num_reqs, depth_count + 1)
    assert (result.accept_len > 2).any()
    for n in range(num_reqs):
        tau = int(result.accept_len[n])
        acc = result.accepted_nodes[n].tolist()
        assert acc[0] == 0 and all(a == -1 for a in acc[tau:]) and all(a >= 0 for a in acc[:tau])
        assert 1 <= tau <= depth_count + 1 and tau <= int(tree.num_nodes[n])
        for prev, cur in zip(acc[: tau - 1], acc[1:tau]):
            assert tree.parents[n, cur] == prev and tree.node_token_ids[n, cur] == target[n, prev]
        last = acc[tau - 1]
        assert result.bonus_token_ids[n] == target[n, last]
        children = (tree.parents[n] == last) & (torch.arange(budget + 1) < tree.num_nodes[n])
        assert result.bonus_token_ids[n] not in tree.node_token_ids[n, children].tolist()
        emitted = result.emitted_token_ids[n].tolist()
        assert emitted[: tau - 1] == tree.node_token_ids[n, acc[1:tau]].tolist()
        assert emitted[tau - 1] == result.bonus_token_ids[n] and all(e == -1 for e in emitted[tau:])


def test_verify_greedy_uses_argmax_per_row():
    tree = v1_tree(max_budget=6)
    target = torch.tensor([[1, 3, 4, 0, 0, 2, 2]])
    result = verify_greedy(tree, one_hot_logits(target, 6))
    assert result.accepted_nodes.tolist() == [[0, 1, 2, -1]] and result.bonus_token_ids.tolist() == [4]