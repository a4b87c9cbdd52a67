"""Tree build ops (ext.reference.tree) and DraftTree helpers (engine.speculative.tree).

Oracles: the ddtree.md §6.2 vectors, a heapq re-statement of Algorithm 1 with rank tuples
(bit-exact order and scores, ties included), and brute-force enumeration of all prefixes.
"""

import heapq
import itertools
import math

import pytest
import torch

from engine.speculative.tree import DraftTree, additive_mask
from ext.reference.tree import build_tree, topk_logprobs


def build_one(logits, budget: int, k: int | None = None):
    """Build a single request's tree from logits [L, V] (list or tensor)."""
    logits = torch.as_tensor(logits, dtype=torch.float32)[None]
    lp, ids = topk_logprobs(logits, k if k is not None else max(1, min(budget, logits.shape[-1])))
    return build_tree(lp, ids, torch.tensor([budget]), budget)


def heap_ref(lp, ids, budget: int):
    """Algorithm 1 with heapq entries (-score, ranks, parent, depth, rank, score) -> lists."""
    depth_count, k = lp.shape
    lp, ids = lp.double().tolist(), ids.tolist()
    tokens, depths, parents, scores = [], [], [-1], []
    heap = [(-lp[0][0], (0,), 0, 1, 0, lp[0][0])] if budget > 0 and depth_count and k else []
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        node = len(tokens) + 1
        tokens.append(ids[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        scores.append(score)
        if rank + 1 < k:
            s = score - lp[depth - 1][rank] + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < depth_count:
            s = score + lp[depth][0]
            heapq.heappush(heap, (-s, ranks + (0,), node, depth + 1, 0, s))
    return tokens, depths, parents, scores


def paths_of(tree, n: int = 0) -> list[tuple[int, ...]]:
    """Root-to-node token tuples of request n's drafted nodes, in row order."""
    tokens, parents = tree.node_token_ids[n].tolist(), tree.parents[n].tolist()
    out = {0: ()}
    for i in range(1, int(tree.num_nodes[n])):
        out[i] = out[parents[i]] + (tokens[i],)
    return [out[i] for i in range(1, int(tree.num_nodes[n]))]


def v1_logits() -> torch.Tensor:
    logits = torch.full((3, 6), -10.0)
    logits[0, 1], logits[0, 2], logits[1, 3], logits[1, 4], logits[2, 5] = 4, 3, 5, 1, 6
    return logits


# ---- topk_logprobs -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_logprobs_matches_log_softmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 50) * 3).to(dtype)
    lp, ids = topk_logprobs(logits, 8)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == (3, 5, 8)
    full = torch.log_softmax(logits.float(), -1)
    assert torch.equal(lp, full.gather(-1, ids))
    assert torch.equal(lp, full.topk(8, -1).values)
    assert (lp[..., :-1] >= lp[..., 1:]).all()


def test_topk_ties_break_by_lowest_id():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0, 1.0]], [[0.0] * 6]])
    _, ids = topk_logprobs(logits, 4)
    assert ids[0, 0].tolist() == [1, 2, 4, 0]
    assert ids[1, 0].tolist() == [0, 1, 2, 3]
    # A large tied block, where an unconstrained topk is free to return any of the tied ids.
    wide = torch.zeros(1, 2, 4096)
    wide[0, 1, 3000:] = 1.0
    _, ids = topk_logprobs(wide, 16)
    assert ids[0, 0].tolist() == list(range(16))
    assert ids[0, 1].tolist() == list(range(3000, 3016))


def test_topk_k_clamped_to_vocab():
    lp, ids = topk_logprobs(torch.randn(2, 3, 5), 9)
    assert lp.shape == ids.shape == (2, 3, 5)
    assert (ids.sort(-1).values == torch.arange(5)).all()


# ---- ddtree.md §6.2 vectors ----------------------------------------------------------------


def test_vector_v1():
    tree = build_one(v1_logits(), 4)
    assert tree.node_token_ids[0].tolist() == [-1, 1, 3, 5, 2]
    assert tree.depths[0].tolist() == [0, 1, 2, 3, 1]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 0]
    assert tree.num_nodes.tolist() == [5]


def test_vector_v2():
    tree = build_one([[2.0, 1.0, 0.0], [0.0, -1.0, 1.0]], 3)
    assert tree.node_token_ids[0].tolist() == [-1, 0, 2, 1]
    assert tree.depths[0].tolist() == [0, 1, 2, 1]
    assert tree.parents[0].tolist() == [-1, 0, 1, 0]
    rows = ["".join(str(int(v)) for v in row) for row in tree.visibility[0]]
    assert rows == ["1000", "1100", "1110", "1001"]


def test_vector_v3():
    probs = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.5, 0.4, 0.05, 0.05], [0.9, 0.05, 0.03, 0.02]])
    tree = build_one(probs.log(), 6)  # fp32 log of the probabilities, used as logits
    assert tree.node_token_ids[0, 1:].tolist() == [0, 0, 1, 0, 1, 0]
    assert tree.depths[0, 1:].tolist() == [1, 2, 1, 3, 2, 3]
    assert tree.parents[0].tolist() == [-1, 0, 1, 0, 2, 1, 5]
    expected = [-0.511, -1.204, -1.204, -1.309, -1.427, -1.532]
    assert [round(s, 3) for s in tree.scores[0, 1:].tolist()] == expected
    assert tree.scores[0, 0].item() == 0.0


def test_exact_tie_pops_smaller_rank_tuple_first():
    # (0,0) and (1,) both score exactly -2.0; tuple order puts (0, 0) first.
    lp = torch.tensor([[[-1.0, -2.0], [-1.0, -2.0]]])
    ids = torch.tensor([[[10, 11], [20, 21]]])
    tree = build_tree(lp, ids, torch.tensor([3]), 3)
    assert tree.node_token_ids[0].tolist() == [-1, 10, 20, 11]
    assert tree.scores[0, 2].item() == tree.scores[0, 3].item() == -2.0


# ---- oracles ---------------------------------------------------------------------------------


def random_cases(seed: int, count: int, kind: str):
    """(lp [L, V], ids [L, V], budget, tree row index, batched tree) for `count` random cases.

    Cases are grouped by (L, V) and each group is built as one batch (K = V, per-request budgets),
    which also exercises batching. kind "ties": logits take few distinct values, so log-probs and
    path scores have many exact ties. kind "wide": log-probs span ~30 binary orders of magnitude,
    so float64 sums of them round and the order of the score arithmetic shows (sums of a few
    fp32 values of similar magnitude are exact in float64 and would hide it).
    """
    gen = torch.Generator().manual_seed(seed)
    groups = {}
    for _ in range(count):
        depth_count = int(torch.randint(1, 5, (1,), generator=gen))
        vocab = int(torch.randint(1, 7, (1,), generator=gen))
        if kind == "ties":
            logits = torch.randint(0, 3, (depth_count, vocab), generator=gen).float()
        else:
            logits = torch.randn(depth_count, vocab, generator=gen) * (12 if kind == "wide" else 2)
        total = sum(vocab**d for d in range(1, depth_count + 1))
        budget = int(torch.randint(0, min(total, 24) + 2, (1,), generator=gen))
        groups.setdefault((depth_count, vocab), []).append((logits, budget))
    for (_, vocab), cases in groups.items():
        lp, ids = topk_logprobs(torch.stack([c[0] for c in cases]), vocab)
        budgets = torch.tensor([c[1] for c in cases])
        tree = build_tree(lp, ids, budgets, int(budgets.max()))
        for n, (_, budget) in enumerate(cases):
            yield lp[n], ids[n], budget, n, tree


@pytest.mark.parametrize(("seed", "kind"), [(1, "continuous"), (2, "ties"), (3, "wide")])
def test_matches_heap_reference_bit_exact(seed, kind):
    for lp, ids, budget, n, tree in random_cases(seed, 150, kind):
        tokens, depths, parents, scores = heap_ref(lp, ids, budget)
        num = len(tokens) + 1
        assert tree.num_nodes[n].item() == num
        assert tree.node_token_ids[n, 1:num].tolist() == tokens
        assert tree.depths[n, 1:num].tolist() == depths
        assert tree.parents[n, :num].tolist() == parents
        assert tree.scores[n, 1:num].tolist() == scores  # exact float64 equality


def test_brute_force_optimality():
    for lp, ids, budget, n, tree in random_cases(7, 200, "continuous"):
        depth_count, vocab = lp.shape
        # lp is sorted per depth; map back to token ids to score every prefix of the vocabulary.
        by_token = torch.empty_like(lp.double()).scatter_(1, ids, lp.double()).tolist()
        prefixes = [p for d in range(1, depth_count + 1) for p in itertools.product(range(vocab), repeat=d)]
        # Exact ties only occur with V = 1 (every prefix scores 0), where token = rank order.
        scored = sorted((-sum(by_token[i][t] for i, t in enumerate(p)), p) for p in prefixes)
        best = scored[:budget]
        assert set(paths_of(tree, n)) == {p for _, p in best}
        got = tree.scores[n, 1 : int(tree.num_nodes[n])].tolist()
        assert sorted(got, reverse=True) == pytest.approx([-s for s, _ in best], abs=1e-9)


# ---- structural invariants -----------------------------------------------------------------


def random_batch(seed: int, num_reqs=6, depth_count=5, vocab=40, max_budget=24, k=None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depth_count, vocab, generator=gen) * 2
    budgets = torch.randint(0, max_budget + 1, (num_reqs,), generator=gen)
    lp, ids = topk_logprobs(logits, k if k is not None else min(max_budget, vocab))
    return logits, lp, ids, budgets


def check_invariants(tree, n: int):
    num = int(tree.num_nodes[n])
    tok, par, dep = tree.node_token_ids[n], tree.parents[n], tree.depths[n]
    assert par[0] == -1 and dep[0] == 0 and tok[0] == -1
    scores = tree.scores[n, 1:num]
    assert (scores[:-1] >= scores[1:]).all()
    for i in range(1, num):
        assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1
    siblings = {}
    for i in range(1, num):
        siblings.setdefault(int(par[i]), []).append(int(tok[i]))
    assert all(len(v) == len(set(v)) for v in siblings.values())
    assert (tok[num:] == -1).all() and (par[num:] == -1).all() and (dep[num:] == 0).all()
    assert (tree.scores[n, num:] == float("-inf")).all()


def ancestor_closure(parents: list[int], num: int, num_rows: int) -> torch.Tensor:
    vis = torch.eye(num_rows, dtype=torch.bool)
    for i in range(1, num):
        j = i
        while j != -1:
            vis[i, j] = True
            j = parents[j]
    return vis


def test_invariants_and_visibility():
    for seed in range(4):
        _, lp, ids, budgets = random_batch(seed)
        tree = build_tree(lp, ids, budgets, 24)
        for n in range(len(budgets)):
            check_invariants(tree, n)
            num = int(tree.num_nodes[n])
            vis = tree.visibility[n]
            assert torch.equal(vis, ancestor_closure(tree.parents[n].tolist(), num, 25))
            assert not vis.triu(1).any()
            assert vis[:num, 0].all() and vis.diagonal().all()
            off_diagonal = vis & ~torch.eye(25, dtype=torch.bool)
            assert not off_diagonal[num:].any() and not off_diagonal[:, num:].any()  # padding


@pytest.mark.parametrize(("depth_count", "vocab", "k", "budget"), [
    (1, 3, 3, 10), (2, 2, 2, 10), (3, 2, 2, 14), (3, 2, 2, 20), (4, 6, 6, 30), (2, 5, 1, 9), (5, 40, 8, 24),
])
def test_node_count(depth_count, vocab, k, budget):
    logits = torch.randn(2, depth_count, vocab)
    lp, ids = topk_logprobs(logits, k)
    tree = build_tree(lp, ids, torch.tensor([budget, budget // 2]), budget)
    total = sum(k**d for d in range(1, depth_count + 1))
    assert tree.num_nodes.tolist() == [1 + min(budget, total), 1 + min(budget // 2, total)]


def test_nesting_across_budgets():
    logits = torch.randn(1, 4, 7)
    prev = None
    for budget in range(0, 30):
        tree = build_one(logits[0], budget, k=7)
        if prev is not None:
            rows = budget  # tree for budget-1 has `budget` rows
            for field in ("node_token_ids", "parents", "depths", "scores"):
                assert torch.equal(getattr(tree, field)[:, :rows], getattr(prev, field))
            assert torch.equal(tree.visibility[:, :rows, :rows], prev.visibility)
        prev = tree


def test_batched_equals_single_builds():
    logits, lp, ids, _ = random_batch(11, num_reqs=6, max_budget=12, k=12)
    budgets = torch.tensor([5, 0, 12, 12, 3, 12])  # equal sizes catch row/segment mix-ups
    batch = build_tree(lp, ids, budgets, 12)
    for n, b in enumerate(budgets.tolist()):
        single = build_tree(lp[n : n + 1], ids[n : n + 1], budgets[n : n + 1], b)
        rows = b + 1
        for field in ("node_token_ids", "parents", "depths", "scores", "ranks"):
            got = getattr(batch, field)[n]
            assert torch.equal(got[:rows], getattr(single, field)[0])
        assert torch.equal(batch.visibility[n, :rows, :rows], single.visibility[0])
        assert batch.num_nodes[n] == single.num_nodes[0] == rows


def test_budget_zero_and_empty_inputs():
    root_only = build_tree(*topk_logprobs(torch.randn(2, 3, 5), 4), torch.tensor([0, 0]), 4)
    assert root_only.num_nodes.tolist() == [1, 1]
    assert (root_only.parents == -1).all() and (root_only.node_token_ids == -1).all()
    assert torch.equal(root_only.visibility[0], torch.eye(5, dtype=torch.bool))
    for lp, ids, b in [(torch.zeros(1, 0, 3), torch.zeros(1, 0, 3, dtype=torch.long), 3),
                       (torch.zeros(1, 3, 0), torch.zeros(1, 3, 0, dtype=torch.long), 3),
                       (torch.zeros(1, 3, 2), torch.zeros(1, 3, 2, dtype=torch.long), 0)]:
        tree = build_tree(lp, ids, torch.tensor([b]), b)
        assert tree.num_nodes.tolist() == [1] and tree.node_token_ids.shape == (1, b + 1)


def test_token_id_zero_is_a_real_token():
    logits = torch.full((1, 4, 6), -5.0)
    logits[..., 0] = 5.0  # token 0 is the top-1 at every depth
    tree = build_tree(*topk_logprobs(logits, 6), torch.tensor([6]), 6)
    assert tree.num_nodes.tolist() == [7]
    assert tree.node_token_ids[0, 1:5].tolist() == [0, 0, 0, 0]  # the spine is all token 0
    assert tree.depths[0, 1:5].tolist() == [1, 2, 3, 4]


# ---- DraftTree -----------------------------------------------------------------------------


def test_draft_tree_positions_and_inputs():
    tree = DraftTree.from_draft_logits(v1_logits()[None], torch.tensor([7]), torch.tensor([4]), 6)
    assert tree.node_token_ids[0].tolist() == [7, 1, 3, 5, 2, -1, -1]
    assert tree.max_depth == 3 and tree.num_rows == 7
    assert tree.positions(torch.tensor([10]))[0].tolist() == [10, 11, 12, 13, 11, 10, 10]
    assert tree.input_ids(pad_token_id=0)[0].tolist() == [7, 1, 3, 5, 2, 0, 0]
    assert tree.flat_tree_mask().shape == (7, 7)

    logits, _, _, budgets = random_batch(3, num_reqs=4, max_budget=10)
    batch = DraftTree.from_draft_logits(logits, torch.arange(4), budgets, 10)
    start = torch.tensor([0, 5, 17, 100])
    pos = batch.positions(start)
    for n in range(4):
        num = int(batch.num_nodes[n])
        assert pos[n, 0] == start[n] and (pos[n, :num] == start[n] + batch.depths[n, :num]).all()
        for i in range(1, num):  # siblings share positions; children sit one further
            assert pos[n, i] == pos[n, batch.parents[n, i]] + 1


def test_attention_mask_compile_vector():
    # NNT compile vector: root 99, start 5, past 2 -> prefix columns visible, tree block = vis.
    tree = DraftTree.from_draft_logits(torch.tensor([[[2.0, 1.0, 0.0], [0.0, -1.0, 1.0]]]),
                                       torch.tensor([99]), torch.tensor([3]), 4)
    assert tree.input_ids()[0, 0] == 99
    mask = tree.attention_mask(torch.tensor([2]), kv_len=8)[0]  # [5, 8]
    vis = tree.visibility[0]
    assert mask[:4, :2].all()  # real rows see the prefix
    assert torch.equal(mask[:, 2:7], vis) and not mask[:, 7].any()
    assert mask[4].tolist() == [False] * 6 + [True, False]  # padding row: itself only
    bias = additive_mask(mask, torch.float16)
    assert bias.dtype == torch.float16 and (bias[mask] == 0).all()
    assert (bias[~mask] == torch.finfo(torch.float16).min).all()


def test_attention_mask_batch_offsets():
    logits, _, _, budgets = random_batch(5, num_reqs=3, max_budget=6)
    tree = DraftTree.from_draft_logits(logits, torch.zeros(3, dtype=torch.long), budgets, 6)
    prefix_lens = torch.tensor([0, 3, 9])
    mask = tree.attention_mask(prefix_lens, kv_len=16)
    for n, p in enumerate(prefix_lens.tolist()):
        num = int(tree.num_nodes[n])
        assert mask[n, :num, :p].all() and not mask[n, num:, :p].any()
        assert torch.equal(mask[n, :, p : p + 7], tree.visibility[n])
        assert not mask[n, :, p + 7 :].any()
    assert math.isfinite(float(additive_mask(mask, torch.float32).max()))


def test_heap_and_vectorized_builds_are_identical():
    """The CPU heap path and the device-style vectorized path of build_tree give the same tensors."""
    from ext.reference.tree import _Build, _build_heap

    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        num_reqs, depth, vocab = 3, int(torch.randint(1, 5, (1,), generator=g)), 6
        logits = torch.randn(num_reqs, depth, vocab, generator=g) * 2
        logits[0] = logits[0].round()  # exact ties
        budget = int(torch.randint(0, 12, (1,), generator=g))
        lp, ids = topk_logprobs(logits, max(1, min(budget, vocab)))
        budgets = torch.tensor([budget, max(0, budget - 3), budget])
        build = _Build(lp, ids, budgets, budget)
        for step in range(budget if build.can_pop else 0):
            build.pop(step)
        vec, heap = build.result(), _build_heap(lp, ids, budgets, budget)
        for a, b in zip(vec, heap):
            assert torch.equal(a, b)
