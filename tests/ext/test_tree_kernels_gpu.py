"""The DDTree tree kernels against their references on fresh random inputs: the walk (tree_accept), slot
compaction (kv_compact_tree), top-K log-probs and the best-first tree build, bit-exact (top-K: the same ids),
and the packed tree mask. (Attention and cache ops: test_kernels_gpu.py; sampling: test_sampling_gpu.py.)"""
from __future__ import annotations

import pytest
import torch

from ext import ops, reference
from ext.metadata import pack_bits
from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)

DEV = "cuda"

pytestmark = pytest.mark.gpu


def random_walk_case(r, gen, num_reqs, depth, vocab, budget, device="cpu"):
    lp, ids = reference.topk_logprobs(torch.randn(num_reqs, depth, vocab, generator=gen), min(vocab, budget))
    tree = reference.build_tree(lp, ids, torch.randint(0, budget + 1, (num_reqs,), generator=gen), budget)
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    for n in range(num_reqs):
        for i in range(int(tree.num_nodes[n])):
            children = (tree.parents[n] == i).nonzero().flatten().tolist()
            if children and r.random() < 0.85:
                target[n, i] = tree.node_token_ids[n, r.choice(children)]
    return tree, target


def test_tree_accept_exact():
    r, gen = rng()
    for num_reqs, depth, vocab, budget in [(64, 15, 40, 64), (7, 4, 5, 10), (3, 1, 3, 2), (5, 7, 1000, 128),
                                           (2, 3, 4, 0)]:
        tree, target = random_walk_case(r, gen, num_reqs, depth, vocab, budget)
        ref = reference.tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, depth)
        got = ops.tree_accept(target.to(DEV), tree.node_token_ids.to(DEV), tree.parents.to(DEV),
                              tree.num_nodes.to(DEV), depth)
        for a, b in zip(got, ref):
            assert torch.equal(a.cpu(), b), (num_reqs, depth, budget)


def test_kv_compact_tree_exact():
    r, gen = rng()
    num_reqs, depth, budget = 24, 6, 30
    tree, target = random_walk_case(r, gen, num_reqs, depth, 6, budget)
    accepted, accept_len, _ = reference.tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, depth)
    accepted[0, 1:] = torch.tensor([1, 2, 3, -1, -1, -1])  # a spine: nothing moves
    num_slots = num_reqs * (budget + 1) + 50
    tree_slots = torch.randperm(num_slots, generator=gen)[: num_reqs * (budget + 1)].view(num_reqs, budget + 1)
    caches = [torch.randn(num_slots, 2, 64, generator=gen).to(DEV, torch.bfloat16),
              torch.randn(num_slots, 576, generator=gen).to(DEV, torch.bfloat16),
              torch.randn(num_slots, 5, generator=gen).to(DEV)]
    expect = [c.clone() for c in caches]
    src, dst, noop = reference.compaction_slots(accepted, tree_slots)
    assert bool(noop[0])
    reference.kv_compact(expect, src.to(DEV), dst.to(DEV))
    ops.kv_compact_tree(caches, accepted.to(DEV), tree_slots.to(DEV))
    assert all(torch.equal(a, b) for a, b in zip(caches, expect))


# ---- top-K and tree build ------------------------------------------------------------------------------------------

TOPK_CASES = [
    ("bf16 R=1 chunked", torch.bfloat16, (1, 15, 151936), 64),
    ("bf16 R=64", torch.bfloat16, (64, 15, 151936), 16),
    ("bf16 K=1000", torch.bfloat16, (2, 3, 30000), 1000),
    ("fp32 odd V", torch.float32, (2, 3, 5003), 128),
    ("fp16 K=V", torch.float16, (3, 2, 300), 300),
    ("bf16 integer ties", torch.bfloat16, (4, 5, 20000), 100),
    ("fp32 K=1", torch.float32, (5, 2, 1000), 1),
    ("fp32 aligned, chunked with a tail", torch.float32, (3, 4, 50000), 64),  # the cp.async ring for 32-byte rounds
    ("fp16 mostly masked", torch.float16, (2, 3, 45000), 32),
]


@pytest.mark.parametrize("case", range(len(TOPK_CASES)))
def test_topk_logprobs(case):
    r, gen = rng()
    name, dtype, shape, k = TOPK_CASES[case]
    if "ties" in name:
        logits = torch.randint(-3, 4, shape, generator=gen).float()
        logits[..., ::2] *= -1  # -0.0 at even ids: it ties with +0.0 (the kernel compares and keys canonical zeros)
    else:
        logits = (torch.randn(shape, generator=gen) * 3 * 1024).round() / 1024  # distinct values differ >= 1e-3
    logits[..., r.randrange(shape[-1])] = float("-inf")  # a masked token (DFlash drops its mask id)
    if "masked" in name:
        logits[..., 3: shape[-1] - 5000] = float("-inf")  # whole rounds of -inf before the first finite run
    logits = logits.to(DEV, dtype)
    lp, ids = ops.topk_logprobs(logits, k)
    ref_lp, ref_ids = reference.topk_logprobs(logits, k)
    assert torch.equal(ids, ref_ids), name
    torch.testing.assert_close(lp, ref_lp, atol=3e-5, rtol=1e-5)


def quantized_logprobs(gen, n, depth, k):
    """Sorted log-probs on a 1/4 grid: many exact fp64 ties between different rank paths."""
    lp = -(torch.randint(0, 8, (n, depth, k), generator=gen).float() / 4).sort(-1).values  # descending, <= 0
    ids = torch.stack([torch.stack([torch.randperm(5000, generator=gen)[:k] for _ in range(depth)]) for _ in range(n)])
    return lp.contiguous(), ids


# (requests, depth L, K, max budget B): B + 1 <= 256 runs the register frontier, larger B the shared-memory one
TREE_CASES = [(64, 15, 64, 64), (8, 7, 16, 128), (5, 3, 2, 20), (3, 1, 5, 3), (4, 4, 1, 4), (6, 5, 4, 0),
              (2, 15, 256, 256), (33, 8, 32, 32), (3, 6, 40, 100), (2, 15, 255, 255), (2, 10, 64, 600)]


@pytest.mark.parametrize("case", range(len(TREE_CASES)))
@pytest.mark.parametrize("ties", [False, True])
def test_build_tree_exact(case, ties):
    r, gen = rng()
    n, depth, k, budget = TREE_CASES[case]
    if ties:
        lp, ids = quantized_logprobs(gen, n, depth, k)
    else:
        lp, ids = reference.topk_logprobs(torch.randn(n, depth, max(k, 2) * 3, generator=gen) * 2, k)
    budgets = torch.randint(0, budget + 1, (n,), generator=gen)
    budgets[0] = budget
    ref = reference.build_tree(lp, ids, budgets, budget)  # the CPU heap
    got = ops.build_tree(lp.to(DEV), ids.to(DEV), budgets.to(DEV), budget)
    for field, a, b in zip(reference.TreeBuild._fields, got, ref):
        assert torch.equal(a.cpu(), b), (field, n, depth, k, budget, ties)


def test_pack_tree_mask():
    r, gen = rng()
    mask = torch.rand(r.randrange(1, 300), r.randrange(1, 200), generator=gen) < 0.5
    assert torch.equal(ops.pack_tree_mask(mask.to(DEV)).cpu(), pack_bits(mask))
