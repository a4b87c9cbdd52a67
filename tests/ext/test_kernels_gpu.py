"""CUDA kernels against the references, on fresh random inputs every run: random shapes, NaN-poisoned unused
cache slots, shuffled block tables with bogus ids in unused entries. Attention in bf16/fp16 must stay within
2x the error of torch computing the same attention in that dtype (both against fp64); fp32 near exact; tree
build, walk and compaction bit-exact; top-K the same ids. (Sampling: test_sampling_gpu.py.)"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from ext import ops, reference
from ext.metadata import build_metadata

pytestmark = pytest.mark.gpu
DEV = "cuda"


from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp(min=1e-30))


# ---- paged problems ------------------------------------------------------------------------------------------

def random_tree_mask(n: int, r: random.Random) -> torch.Tensor:
    parents = [-1] + [r.randrange(0, i) for i in range(1, n)]
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        vis[i] |= vis[parents[i]]
    return vis


def make_problem(r, gen, specs, block_size, row_shape, dtype, poison=True):
    """specs: list of (context_len, query_len, kind) with kind in decode | chain | tree.
    Returns (cache [num_blocks, block_size, *row_shape], meta, per-seq dense visibility [q, seq_len])."""
    seq_lens = [c + q for c, q, _ in specs]
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + r.randrange(1, 6)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n])
        used += n
    cache = torch.full((num_blocks, block_size, *row_shape), float("nan") if poison else 0.0, dtype=torch.float32)
    positions, slots, masks, dense = [], [], [], []
    for (ctx, q, kind), table, seq_len in zip(specs, tables, seq_lens):
        for p in range(seq_len):
            cache[table[p // block_size], p % block_size] = torch.randn(row_shape, generator=gen)
        mask = random_tree_mask(q, r) if kind == "tree" else None
        masks.append(mask)
        for p in range(ctx, ctx + q):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
        block = mask if mask is not None else torch.ones(q, q, dtype=torch.bool).tril()
        dense.append(torch.cat([torch.ones(q, ctx, dtype=torch.bool), block], dim=1))
    any_tree = any(m is not None for m in masks)
    meta = build_metadata(positions, slots, [q for _, q, _ in specs], seq_lens, tables, block_size,
                          tree_masks=masks if any_tree else None, device=DEV)
    width = meta.block_tables.shape[1]
    for i, t in enumerate(tables):  # unused block-table entries point far outside the cache
        meta.block_tables[i, len(t):] = 10**6 + i
    assert width >= 1
    return cache.to(DEV, dtype), meta, dense, tables


def gather_rows(cache, table, seq_len, block_size):
    idx = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)], device=DEV)
    return cache.view(-1, *cache.shape[2:])[idx]


def attention_refs(q, k_cache, v_cache, meta, dense, tables, scale):
    """(fp64 reference, same attention computed by torch in q.dtype)."""
    out64 = torch.empty(*q.shape[:2], v_cache.shape[-1], dtype=torch.float64, device=DEV)
    outlo = torch.empty(*q.shape[:2], v_cache.shape[-1], dtype=q.dtype, device=DEV)
    bs = k_cache.shape[1]
    q0 = 0
    for i, (ql, sl) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        k = gather_rows(k_cache, tables[i], sl, bs).transpose(0, 1)  # [Hkv, S, D]
        v = gather_rows(v_cache, tables[i], sl, bs).transpose(0, 1)
        qs = q[q0 : q0 + ql].transpose(0, 1)  # [Hq, q, D]
        mask = dense[i].to(DEV)
        out64[q0 : q0 + ql] = F.scaled_dot_product_attention(
            qs.double(), k.double(), v.double(), attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
        outlo[q0 : q0 + ql] = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
        q0 += ql
    return out64, outlo


def assert_attention_close(out, ref64, reflo, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err, base = rel_err(out, ref64), rel_err(reflo, ref64)
    print(f"{what}: kernel {err:.3e} torch-{out.dtype} {base:.3e}")
    if out.dtype == torch.float32:
        assert err < 1e-5, (what, err)
    else:
        assert err <= 2 * base + 1e-4, (what, err, base)


GQA_CASES = [
    # (dtype, head_dim, q heads, kv heads, block size, specs)
    (torch.bfloat16, 128, 32, 8, 16, [(1000, 65, "tree"), (37, 1, "decode"), (300, 20, "chain"), (0, 50, "chain")]),
    (torch.bfloat16, 64, 8, 2, 64, [(9000, 1, "decode"), (2500, 17, "tree")]),
    (torch.float16, 128, 16, 16, 1, [(700, 17, "tree"), (64, 1, "decode")]),
    (torch.bfloat16, 128, 32, 8, 16, [(5000 + 37 * i, 1, "decode") for i in range(8)]),
    (torch.bfloat16, 128, 8, 1, 16, [(3000, 129, "tree")]),
    (torch.bfloat16, 64, 4, 4, 16, [(130, 33, "chain"), (5, 2, "chain")]),
    (torch.float32, 64, 8, 2, 16, [(900, 33, "tree"), (40, 1, "decode"), (10, 12, "chain")]),
    (torch.float32, 16, 4, 2, 1, [(50, 9, "tree"), (3, 1, "decode")]),
    (torch.bfloat16, 16, 4, 2, 16, [(200, 9, "tree"), (33, 1, "decode")]),
    (torch.bfloat16, 80, 6, 3, 16, [(300, 17, "tree")]),
    # decode-shaped tiles whose KV splits combine inside one cluster launch on sm_90 (2-8 splits), short sequences
    # with empty splits, and a 9-row tree of one kv head per q head (still one 16-row tile)
    (torch.bfloat16, 64, 9, 3, 16, [(512, 1, "decode")]),
    (torch.bfloat16, 128, 32, 8, 16, [(1024, 1, "decode")]),
    (torch.bfloat16, 128, 32, 8, 16, [(900, 1, "decode"), (40, 1, "decode"), (3, 1, "decode")]),
    (torch.float16, 128, 16, 16, 16, [(700, 9, "tree"), (64, 1, "decode")]),
    # verify-shaped 64-row tiles (Qwen3-8B's heads) over a few KV splits: splits left empty by a short sequence,
    # a tile no row of the shorter tree reaches
    (torch.bfloat16, 128, 32, 8, 16, [(600, 17, "tree"), (40, 9, "tree")]),
    # 128-row warpgroup tiles on sm_90a (past 64 packed rows): many KV tiles and splits, fp16 and head dim 64,
    # causal prefill chunks with and without context; 64-row mma.sync tiles beside them (34 rows)
    (torch.bfloat16, 128, 32, 8, 16, [(6000, 65, "tree"), (2000, 17, "tree")]),
    (torch.float16, 64, 8, 2, 16, [(0, 200, "chain"), (3000, 300, "chain")]),
    (torch.float16, 128, 32, 8, 64, [(1500, 33, "tree")]),
    (torch.bfloat16, 64, 4, 2, 16, [(777, 17, "tree"), (64, 1, "decode")]),
    # more 128-row tiles than CTA slots (8 x 3 x 8 = 192 on 132 SMs): KV split so the waves end sooner
    (torch.bfloat16, 128, 32, 8, 16, [(1500 + 50 * i, 65, "tree") for i in range(8)]),
]


@pytest.mark.parametrize("case", range(len(GQA_CASES)))
def test_paged_attention_gqa(case):
    r, gen = rng()
    dtype, d, hq, hkv, bs, specs = GQA_CASES[case]
    specs = [(c + r.randrange(0, 40), q, kind) for c, q, kind in specs]  # fresh lengths each run
    k_cache, meta, dense, tables = make_problem(r, gen, specs, bs, (hkv, d), dtype)
    v_cache = torch.where(torch.isnan(k_cache), k_cache, torch.randn(k_cache.shape, generator=gen).to(DEV, dtype))
    q = torch.randn(meta.slot_mapping.shape[0], hq, d, generator=gen).to(DEV, dtype)
    scale = d**-0.5
    before = ops.cuda_calls().get("paged_attention", 0)
    out = ops.paged_attention(q, k_cache, v_cache, meta, scale)
    assert ops.cuda_calls()["paged_attention"] == before + 1
    ref64, reflo = attention_refs(q, k_cache, v_cache, meta, dense, tables, scale)
    assert_attention_close(out, ref64, reflo, f"gqa{case} {dtype} d{d} bs{bs}")


def test_hopper_runs_the_warpgroup_attention_tiles():
    """On compute capability 9.0 the library the session built (9.0a) runs tiles past 64 packed rows as wgmma,
    unless DDTREE_WGMMA=0 turns them off; elsewhere never."""
    import os

    hopper = torch.cuda.get_device_capability() == (9, 0)
    expected = hopper and os.environ.get("DDTREE_WGMMA") != "0"
    assert torch.ops.ddtree.attention_wgmma() is expected


def test_attention_plan_reports_the_schedule():
    """torch.ops.ddtree.attention_plan (printed by bench/kernels.py): decode rows in 16-row tiles, a 65-node tree's
    260 rows in 128-row warpgroup tiles where they run (else 64-row tiles), and on a 132-SM Hopper the 192 CTAs of 8
    such trees split in two (tests/ext/test_attention_plan_cpu.py checks the rule itself on the host)."""
    wg = torch.ops.ddtree.attention_wgmma()
    kind, config, rows, tiles, splits, _ = torch.ops.ddtree.attention_plan(128, 4, 8, 8, 65, 32833)
    assert (kind, config, rows, tiles) == ((1, 2, 128, 3) if wg else (1, 1, 64, 5))
    if wg and torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert splits == 2
    assert torch.ops.ddtree.attention_plan(128, 4, 1, 8, 1, 4096)[:3] == [1, 0, 16]


def test_decode_attention_combines_its_splits_in_one_launch():
    """On sm_90 a batch-1 decode (SmolLM2's heads, 512 tokens: four KV splits) is one kernel: the splits combine
    through the cluster's shared memory, no attn_combine_kernel, and the result is the same attention."""
    from torch.profiler import ProfilerActivity, profile

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    r, gen = rng()
    k_cache, meta, dense, tables = make_problem(r, gen, [(512, 1, "decode")], 16, (3, 64), torch.bfloat16)
    v_cache = torch.where(torch.isnan(k_cache), k_cache, torch.randn(k_cache.shape, generator=gen).to(DEV, k_cache.dtype))
    q = torch.randn(1, 9, 64, generator=gen).to(DEV, torch.bfloat16)
    ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len([k for k in kernels if "attn" in k]) == 1 and not any("combine" in k for k in kernels), kernels
    ref64, reflo = attention_refs(q, k_cache, v_cache, meta, dense, tables, 0.125)
    assert_attention_close(out, ref64, reflo, "decode, splits combined in a cluster")


def mla_refs(ql, qr, cache, meta, dense, tables, scale, kv_rank):
    out64 = torch.empty_like(ql, dtype=torch.float64)
    outlo = torch.empty_like(ql)
    bs = cache.shape[1]
    q0 = 0
    for i, (n, sl) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        rows = gather_rows(cache, tables[i], sl, bs)
        mask = dense[i].to(DEV)
        for dt, out in ((torch.float64, out64), (ql.dtype, outlo)):
            lat, rope = rows[:, :kv_rank].to(dt), rows[:, kv_rank:].to(dt)
            a, b = ql[q0 : q0 + n].to(dt), qr[q0 : q0 + n].to(dt)
            s = (torch.einsum("thc,sc->hts", a, lat) + torch.einsum("thr,sr->hts", b, rope)) * scale
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            out[q0 : q0 + n] = torch.einsum("hts,sc->thc", p, lat).to(out.dtype)
        q0 += n
    return out64, outlo


MLA_CASES = [
    (torch.bfloat16, 512, 64, 16, 64, [(2000, 65, "tree"), (5000, 1, "decode")]),
    (torch.bfloat16, 512, 64, 16, 64, [(6000, 1, "decode"), (700, 1, "decode")]),
    (torch.bfloat16, 512, 64, 128, 64, [(3000, 1, "decode"), (100, 5, "tree")]),
    (torch.float16, 512, 64, 8, 16, [(900, 33, "tree"), (60, 9, "chain")]),
    (torch.float32, 32, 16, 4, 16, [(300, 17, "tree"), (20, 1, "decode")]),
    (torch.bfloat16, 32, 16, 4, 1, [(100, 9, "tree")]),
]


@pytest.mark.parametrize("case", range(len(MLA_CASES)))
def test_mla_paged_attention(case):
    r, gen = rng()
    dtype, c, rd, h, bs, specs = MLA_CASES[case]
    specs = [(ctx + r.randrange(0, 40), q, kind) for ctx, q, kind in specs]
    cache, meta, dense, tables = make_problem(r, gen, specs, bs, (c + rd,), dtype)
    t = meta.slot_mapping.shape[0]
    ql = torch.randn(t, h, c, generator=gen).to(DEV, dtype)
    qr = torch.randn(t, h, rd, generator=gen).to(DEV, dtype)
    scale = (c // 4 + rd) ** -0.5
    out = ops.mla_paged_attention(ql, qr, cache, meta, scale)
    ref64, reflo = mla_refs(ql, qr, cache, meta, dense, tables, scale, c)
    assert_attention_close(out, ref64, reflo, f"mla{case} {dtype} h{h} bs{bs}")


def test_chain_tree_equals_causal():
    """A chain-shaped tree mask gives the causal result through the same kernel (bf16, tensor-core path)."""
    r, gen = rng()
    specs = [(400, 33, "chain"), (1200, 17, "chain")]
    k_cache, meta, dense, tables = make_problem(r, gen, specs, 16, (8, 128), torch.bfloat16)
    v_cache = torch.where(torch.isnan(k_cache), k_cache, torch.randn(k_cache.shape, generator=gen).to(DEV, torch.bfloat16))
    q = torch.randn(meta.slot_mapping.shape[0], 32, 128, generator=gen).to(DEV, torch.bfloat16)
    causal = ops.paged_attention(q, k_cache, v_cache, meta, 0.088)
    meta.tree_mask = _stack_masks([33, 17])
    meta._tree_bits = None
    tree = ops.paged_attention(q, k_cache, v_cache, meta, 0.088)
    assert torch.equal(causal, tree)


def _stack_masks(lens):
    width = max(lens)
    rows = []
    for n in lens:
        m = torch.zeros(n, width, dtype=torch.bool)
        m[:, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        rows.append(m)
    return torch.cat(rows).to(DEV)


# ---- cache ops -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype,rows_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                                    (torch.float32, torch.bfloat16)])
def test_write_kv(cache_dtype, rows_dtype):
    r, gen = rng()
    nb, bs, shape = r.randrange(3, 40), r.choice([1, 16, 64]), r.choice([(8, 128), (576,), (2, 16), (3,)])
    cache = torch.full((nb, bs, *shape), float("nan")).to(DEV, cache_dtype)
    t = r.randrange(1, nb * bs)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.2] = -1
    rows = torch.randn(t, *shape, generator=gen).to(DEV, rows_dtype)
    expect = cache.clone()
    reference.write_kv(expect, rows, slots.to(DEV))
    ops.write_kv(cache, rows, slots.to(DEV))
    assert torch.equal(cache.nan_to_num(7.0), expect.nan_to_num(7.0))


def test_kv_compact_generic_overlapping():
    r, gen = rng()
    num_slots = 500
    caches = [torch.randn(num_slots, 8, 128, generator=gen).to(DEV, torch.bfloat16) for _ in range(3)]
    caches += [torch.randn(num_slots, 24, generator=gen).to(DEV) for _ in range(68)]  # > 64: two launches
    caches += [torch.randn(num_slots, 3, generator=gen).to(DEV, torch.float16)]  # 6-byte rows: narrow granule
    m = r.randrange(1, 200)
    dst = torch.randperm(num_slots, generator=gen)[:m]
    src = torch.where(torch.rand(m, generator=gen) < 0.5, dst[torch.randperm(m, generator=gen)],
                      torch.randint(0, num_slots, (m,), generator=gen))  # sources overlap destinations
    src[:5] = dst[:5]  # some no-op pairs
    expect = [c.clone() for c in caches]
    reference.kv_compact(expect, src.to(DEV), dst.to(DEV))
    ops.kv_compact(caches, src.to(DEV), dst.to(DEV))
    assert all(torch.equal(a, b) for a, b in zip(caches, expect))


# ---- capture and registration ------------------------------------------------------------------------------------

def test_cuda_graph_replay_matches_eager():
    r, gen = rng()
    specs = [(3000, 65, "tree"), (500, 1, "decode")]
    k_cache, meta, dense, tables = make_problem(r, gen, specs, 16, (8, 128), torch.bfloat16, poison=False)
    v_cache = k_cache.flip(0).contiguous()
    q = torch.randn(meta.slot_mapping.shape[0], 32, 128, generator=gen).to(DEV, torch.bfloat16)
    lp, ids = reference.topk_logprobs(torch.randn(4, 7, 300, generator=gen), 32)
    lp, ids, budgets = lp.to(DEV), ids.to(DEV), torch.tensor([32, 5, 0, 17], device=DEV)
    meta.packed_tree_mask()
    ops.paged_attention(q, k_cache, v_cache, meta, 0.1)  # warm up outside the capture
    ops.build_tree(lp, ids, budgets, 32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(q, k_cache, v_cache, meta, 0.1)
        built = ops.build_tree(lp, ids, budgets, 32)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=gen).to(DEV, torch.bfloat16))
        new_lp, new_ids = reference.topk_logprobs(torch.randn(4, 7, 300, generator=gen), 32)
        lp.copy_(new_lp)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.paged_attention(q, k_cache, v_cache, meta, 0.1))
        for a, b in zip(built, reference.build_tree(new_lp, new_ids, budgets.cpu(), 32)):
            assert torch.equal(a.cpu(), b)


def test_opcheck_schemas_and_fakes(cuda_ops):
    r, gen = rng()
    utils = ("test_schema", "test_faketensor")
    specs = [(100, 9, "tree"), (30, 1, "decode")]
    k_cache, meta, _, _ = make_problem(r, gen, specs, 16, (2, 64), torch.bfloat16, poison=False)
    q = torch.randn(meta.slot_mapping.shape[0], 4, 64, generator=gen).to(DEV, torch.bfloat16)
    args = (q, k_cache, k_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.packed_tree_mask(),
            9, 109, 0.125)
    torch.library.opcheck(cuda_ops.paged_attention.default, args, test_utils=utils)
    logits = torch.randn(2, 3, 500, generator=gen).to(DEV)
    torch.library.opcheck(cuda_ops.topk_logprobs.default, (logits, 16), test_utils=utils)
    lp, ids = ops.topk_logprobs(logits, 16)
    torch.library.opcheck(cuda_ops.build_tree.default, (lp, ids, torch.tensor([16, 3], device=DEV), 16),
                          test_utils=utils)
    cache = torch.randn(4, 16, 2, 8, device=DEV)
    torch.library.opcheck(cuda_ops.write_kv.default, (cache, torch.randn(3, 2, 8, device=DEV),
                                                      torch.tensor([5, -1, 9], device=DEV)), test_utils=utils)


def test_torch_compile_traces_the_ops(cuda_ops):
    """The fake kernels let torch.compile trace the ops (fullgraph, AOT autograd on fake tensors)."""
    r, gen = rng()
    specs = [(200, 17, "tree"), (50, 1, "decode")]
    k_cache, meta, _, _ = make_problem(r, gen, specs, 16, (2, 64), torch.bfloat16, poison=False)
    q = torch.randn(meta.slot_mapping.shape[0], 4, 64, generator=gen).to(DEV, torch.bfloat16)
    bits = meta.packed_tree_mask()

    def step(q, logits, budgets):
        out = cuda_ops.paged_attention(q, k_cache, k_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       bits, 17, 267, 0.125)
        lp, ids = cuda_ops.topk_logprobs(logits, 8)
        tree = cuda_ops.build_tree(lp, ids, budgets, 8)
        return out.float().sum(), tree[0], tree[4]

    logits = torch.randn(3, 4, 100, generator=gen).to(DEV)
    budgets = torch.tensor([8, 2, 0], device=DEV)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, logits, budgets), step(q, logits, budgets)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
