"""CPU checks of the CUDA extension: every kernel source compiles with nvcc alone (syntax and types, sm_90),
and without a GPU every op in ext.ops falls back to the reference with the same results."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ext import build, ops, reference
from ext.metadata import build_metadata, pack_bits


@pytest.mark.skipif(build.nvcc() is None, reason="nvcc is not on PATH (the CUDA toolkit is not installed)")
def test_every_kernel_source_compiles_with_nvcc(tmp_path):
    sources = build.kernel_sources()
    assert {s.name for s in sources} >= {"attention.cu", "attention_gqa.cu", "attention_mla.cu", "tree.cu", "cache.cu"}

    def compile_one(src):
        cmd = [build.nvcc(), "-c", "-arch=sm_90", "-std=c++17", "-Xptxas", "-O0", "-I", str(build.CSRC), str(src),
               "-o", str(tmp_path / (src.stem + ".o"))]
        return src.name, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, proc in pool.map(compile_one, sources):
            assert proc.returncode == 0, f"{name}:\n{proc.stderr[-4000:]}"


def test_kernel_sources_are_torch_free():
    for src in build.kernel_sources() + sorted(build.CSRC.glob("*.cuh")) + [build.CSRC / "kernels.h"]:
        includes = [line for line in src.read_text().splitlines() if line.lstrip().startswith("#include")]
        assert not [i for i in includes if any(w in i for w in ("torch", "ATen", "c10", "pybind"))], src.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_load_ops_is_none_without_cuda():
    assert build.load_ops() is None


def _tiny_meta(seed=0):
    gen = torch.Generator().manual_seed(seed)
    block_size, query_lens, ctx = 4, [1, 3], [5, 2]
    seq_lens = [c + q for c, q in zip(ctx, query_lens)]
    tables = [[2, 0], [1, 3]]
    slots, positions = [], []
    for table, c, q in zip(tables, ctx, query_lens):
        for p in range(c, c + q):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    meta = build_metadata(positions, slots, query_lens, seq_lens, tables, block_size, tree_masks=[None, mask])
    return meta, gen


def test_cpu_ops_equal_reference():
    meta, gen = _tiny_meta()
    k = torch.randn(4, 4, 2, 8, generator=gen)
    v = torch.randn(4, 4, 2, 8, generator=gen)
    q = torch.randn(4, 4, 8, generator=gen)
    assert torch.equal(ops.paged_attention(q, k, v, meta, 0.3), reference.paged_attention(q, k, v, meta, 0.3))
    latent = torch.randn(4, 4, 12, generator=gen)
    ql, qr = torch.randn(4, 4, 8, generator=gen), torch.randn(4, 4, 4, generator=gen)
    assert torch.equal(ops.mla_paged_attention(ql, qr, latent, meta, 0.3),
                       reference.mla_paged_attention(ql, qr, latent, meta, 0.3))
    cache_a, cache_b = k.clone(), k.clone()
    rows = torch.randn(4, 2, 8, generator=gen)
    ops.write_kv(cache_a, rows, meta.slot_mapping)
    reference.write_kv(cache_b, rows, meta.slot_mapping)
    assert torch.equal(cache_a, cache_b)

    logits = torch.randn(3, 4, 50, generator=gen)
    lp, ids = ops.topk_logprobs(logits, 6)
    ref_lp, ref_ids = reference.topk_logprobs(logits, 6)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
    budgets = torch.tensor([0, 5, 9])
    tree = ops.build_tree(lp, ids, budgets, 9)
    ref_tree = reference.build_tree(lp, ids, budgets, 9)
    assert all(torch.equal(a, b) for a, b in zip(tree, ref_tree))
    target = torch.randint(0, 50, tree.node_token_ids.shape, generator=gen)
    target[:, 0] = tree.node_token_ids[:, 1]
    walked = ops.tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, 4)
    ref_walked = reference.tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, 4)
    assert all(torch.equal(a, b) for a, b in zip(walked, ref_walked))

    caches = [torch.randn(40, 3, generator=gen), torch.randn(40, 2, 2, generator=gen)]
    copies = [c.clone() for c in caches]
    accepted = torch.tensor([[0, 2, 5, -1], [0, 1, 2, 3]])
    tree_slots = torch.stack([torch.arange(0, 10), torch.arange(20, 30)])
    ops.kv_compact_tree(caches, accepted, tree_slots)
    src, dst, noop = reference.compaction_slots(accepted, tree_slots)
    assert noop.tolist() == [False, True]
    reference.kv_compact(copies, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, copies))
    ops.kv_compact(caches, src, dst)
    reference.kv_compact(copies, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, copies))

    scores = torch.randn(5, 30, generator=gen)
    assert torch.equal(ops.sample_tokens(scores), scores.argmax(-1))
    sampled = ops.sample_tokens(scores, torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0]), seed=1)
    assert sampled[0] == scores[0].argmax() and sampled[3] == scores[3].argmax()
    assert ((sampled >= 0) & (sampled < 30)).all()
    assert torch.equal(ops.pack_tree_mask(meta.tree_mask), pack_bits(meta.tree_mask))
    assert torch.equal(meta.packed_tree_mask(), pack_bits(meta.tree_mask))
    assert ops.cuda_calls() == {} or torch.cuda.is_available()
