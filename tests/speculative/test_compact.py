"""KV compaction after accept (ext.reference.compact)."""

import torch

from ext.reference.compact import compaction_slots, kv_compact, tree_slots_from_block_table
from ext.reference.tree import build_tree, topk_logprobs, tree_accept


def random_walks(seed: int, num_reqs: int, depth_count: int = 4, vocab: int = 5, budget: int = 10):
    """accepted_nodes [N, L+1] and accept_len [N] from real builds and walks that go deep often."""
    gen = torch.Generator().manual_seed(seed)
    lp, ids = topk_logprobs(torch.randn(num_reqs, depth_count, vocab, generator=gen), vocab)
    tree = build_tree(lp, ids, torch.randint(0, budget + 1, (num_reqs,), generator=gen), budget)
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    for n in range(num_reqs):
        for i in range(int(tree.num_nodes[n])):
            children = ((tree.parents[n] == i).nonzero().flatten()).tolist()
            if children and torch.rand((), generator=gen) < 0.85:
                pick = children[int(torch.randint(0, len(children), (1,), generator=gen))]
                target[n, i] = tree.node_token_ids[n, pick]
    accepted, accept_len, _ = tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, depth_count)
    return accepted, accept_len


def make_caches(num_slots: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_slots, 2, 8, generator=gen),  # K: [slots, kv_heads, head_dim]
        torch.randn(num_slots, 2, 8, generator=gen).to(torch.bfloat16),  # V in another dtype
        torch.randn(num_slots, 24, generator=gen),  # MLA latent: [slots, kv_lora_rank + rope_dim]
    ]


def check_compacted(before, after, accepted, accept_len, tree_slots):
    moved = torch.zeros(before.shape[0], dtype=torch.bool)
    for n in range(len(accept_len)):
        for j in range(int(accept_len[n])):
            dst, src = tree_slots[n, j], tree_slots[n, accepted[n, j]]
            assert torch.equal(after[dst], before[src]), (n, j)
            moved[dst] = True
    assert torch.equal(after[~moved], before[~moved])  # every other slot is untouched


def test_forward_shift_overlap_reads_before_writing():
    cache = torch.arange(8.0)[:, None].repeat(1, 3)
    kv_compact([cache], torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))  # a naive loop would smear row 1
    assert cache[:, 0].tolist() == [0, 1, 1, 2, 3, 5, 6, 7]
    kv_compact([cache], torch.tensor([5, 6]), torch.tensor([5, 6]))  # src == dst is harmless
    assert cache[:, 0].tolist() == [0, 1, 1, 2, 3, 5, 6, 7]


def test_compaction_random_slots():
    num_reqs, num_rows, num_slots = 12, 11, 200
    accepted, accept_len = random_walks(0, num_reqs)
    assert (accept_len >= 3).any() and (accepted[:, 1] > 1).any()  # deep walks and non-spine accepts
    # Distinct, scattered slots per request (a permuted pool, as a paged allocator gives).
    tree_slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1))
    tree_slots = tree_slots[: num_reqs * num_rows].view(num_reqs, num_rows)
    caches = make_caches(num_slots)
    before = [c.clone() for c in caches]
    src, dst, is_noop = compaction_slots(accepted, tree_slots)
    assert src.shape == dst.shape == (num_reqs * accepted.shape[1],)
    kv_compact(caches, src, dst)
    for b, a in zip(before, caches):
        check_compacted(b, a, accepted, accept_len, tree_slots)
    spine = [all(accepted[n, j] == j for j in range(int(accept_len[n]))) for n in range(num_reqs)]
    assert is_noop.tolist() == spine


def test_identity_is_noop():
    accepted = torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1], [0, -1, -1, -1], [0, 2, -1, -1]])
    tree_slots = torch.arange(4 * 6).view(4, 6) + 3
    src, dst, is_noop = compaction_slots(accepted, tree_slots)
    assert is_noop.tolist() == [True, True, True, False]
    moves = src != dst
    assert moves.sum() == 1 and src[moves].tolist() == [tree_slots[3, 2]] and dst[moves].tolist() == [tree_slots[3, 1]]
    caches = make_caches(30)
    before = [c.clone() for c in caches]
    kv_compact(caches[:1], src[:12], dst[:12])  # the first three requests only: nothing changes
    assert torch.equal(caches[0], before[0])


def test_contiguous_overlapping_ranges():
    # Each request's tree rows are one contiguous run right after its prefix, so sources and
    # destinations overlap heavily; e.g. accepted [0, 2, 5, 7] moves rows 2->1, 5->2, 7->3.
    accepted = torch.tensor([[0, 2, 5, 7], [0, 1, 3, 4], [0, 4, 6, -1]])
    accept_len = torch.tensor([4, 4, 3])
    past = torch.tensor([5, 20, 33])
    tree_slots = past[:, None] + torch.arange(9)
    caches = make_caches(48)
    before = [c.clone() for c in caches]
    kv_compact(caches, *compaction_slots(accepted, tree_slots)[:2])
    for b, a in zip(before, caches):
        check_compacted(b, a, accepted, accept_len, tree_slots)
        assert torch.equal(a[5:9], b[[5, 7, 10, 12]])  # past + j holds old past + acc[j]


def test_paged_cache_page_size_4():
    page_size, num_blocks, num_reqs, num_rows = 4, 40, 5, 11
    accepted, accept_len = random_walks(3, num_reqs)
    # [N, 8] scattered, distinct physical blocks per request
    block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2)).view(num_reqs, 8)
    start = torch.tensor([0, 6, 13, 3, 9])  # unaligned starts: tree rows span 3-4 blocks
    tree_slots = tree_slots_from_block_table(block_table, start, num_rows, page_size)
    for n in range(num_reqs):
        for j in range(num_rows):
            pos = int(start[n]) + j
            assert tree_slots[n, j] == block_table[n, pos // page_size] * page_size + pos % page_size
    assert len(set(tree_slots.flatten().tolist())) == num_reqs * num_rows
    paged = [torch.randn(num_blocks, page_size, 2, 8), torch.randn(num_blocks, page_size, 24)]
    flat = [c.view(num_blocks * page_size, *c.shape[2:]) for c in paged]  # slot-major views
    before = [c.clone() for c in flat]
    kv_compact(flat, *compaction_slots(accepted, tree_slots)[:2])
    for b, a in zip(before, flat):
        check_compacted(b, a, accepted, accept_len, tree_slots)
    # Through the paged layout: logical position start + j now holds node accepted[n, j].
    for n in range(num_reqs):
        for j in range(int(accept_len[n])):
            pos, src_pos = int(start[n]) + j, int(start[n]) + int(accepted[n, j])
            got = paged[0][block_table[n, pos // page_size], pos % page_size]
            want = before[0][block_table[n, src_pos // page_size] * page_size + src_pos % page_size]
            assert torch.equal(got, want)


def test_pairs_truncate_to_tree_width():
    # Horizon L = 5 but only B+1 = 3 tree rows: accepted columns beyond the tree are never used.
    accepted = torch.tensor([[0, 2, -1, -1, -1, -1]])
    src, dst, is_noop = compaction_slots(accepted, torch.tensor([[10, 11, 12]]))
    assert src.tolist() == [10, 12, 12] and dst.tolist() == [10, 11, 12] and is_noop.tolist() == [False]
