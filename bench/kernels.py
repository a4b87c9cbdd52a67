"""Micro-benchmarks of the ddtree CUDA kernels (shared/reference/kernels.md §5 items 1-4, 7, 8) on one GPU,
reported against ceilings measured in the same run: a device-to-device copy (bytes read + written) and a bf16
8192^3 GEMM on random data. Every kernel time is the median over CUDA-graph replays of a run of launches
(rotating over several input sets when they would fit in L2), so launch gaps and cache reuse stay out.

    python3 bench/kernels.py [--quick] [--json results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.top_k_top_p import sort_top_k_top_p  # noqa: E402
from ext import build, ops, reference  # noqa: E402
from ext.metadata import AttentionMetadata  # noqa: E402

DEV = "cuda"
V = 151936
L2_ROTATE_BYTES = 256 << 20  # rotate inputs until a graph's working set exceeds this (L2 is 60 MB)
ROWS: list[dict] = []


def graph_ms(fns, reps: int = 7) -> tuple[float, float]:
    """(median, spread) ms per call of one CUDA graph that replays fns in order."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / len(fns))
    del graph
    return statistics.median(times), max(times) - min(times)


def event_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def rotations(bytes_per_set: float, most: int = 16) -> int:
    return max(1, min(most, math.ceil(L2_ROTATE_BYTES / max(bytes_per_set, 1))))


def record(section: str, **row) -> None:
    ROWS.append({"section": section, **row})


def ceilings() -> tuple[float, float]:
    x = torch.randn(1 << 29, device=DEV)  # 2 GiB
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (event_ms(lambda: y.copy_(x)) * 1e-3)
    del x, y
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    flops = 2 * 8192**3 / (event_ms(lambda: a @ b) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return bw, flops


def bench_topk(bw: float, quick: bool) -> None:
    print("\n## 1. per-depth top-K + log-softmax, D = 15, V = 151936 bf16 (bytes R*D*V*2)")
    print(f"{'R':>3} {'K':>4} {'ours ms':>9} {'TB/s':>6} {'%BW':>5} {'torch ms':>9}")
    for r_ in (1, 8, 64):
        nbytes = r_ * 15 * V * 2
        rot = rotations(nbytes)
        logits = [torch.randn(r_, 15, V, device=DEV).to(torch.bfloat16) for _ in range(rot)]
        for k in (16, 64, 128):
            t, spread = graph_ms([lambda i=i: ops.topk_logprobs(logits[i % rot], k) for i in range(max(rot, 8))])
            base = ""
            if k == 64:
                tb, _ = graph_ms([lambda i=i: torch.log_softmax(logits[i % rot].float(), -1).topk(k)
                                  for i in range(max(rot, 4))], reps=3)
                base = f"{tb:9.3f}"
            tbs = nbytes / (t * 1e-3) / 1e12
            print(f"{r_:>3} {k:>4} {t:9.4f} {tbs:6.2f} {100 * tbs * 1e12 / bw:5.0f} {base:>9}")
            record("topk", R=r_, K=k, ms=t, spread_ms=spread, TBps=tbs, torch_ms=base.strip() or None)
        del logits
    torch.cuda.empty_cache()


def bench_tree_build() -> None:
    print("\n## 2. best-first tree build, D = 15, K = B (one launch for all requests)")
    print(f"{'R':>3} {'B':>4} {'us':>8}")
    for r_ in (1, 8, 64):
        for b in (16, 32, 64, 128):
            lp, ids = ops.topk_logprobs(torch.randn(r_, 15, 4096, device=DEV), b)
            budgets = torch.full((r_,), b, device=DEV, dtype=torch.int64)
            t, spread = graph_ms([lambda: ops.build_tree(lp, ids, budgets, b)] * 50)
            none = torch.zeros_like(budgets)  # same launch, no pops: load + output writing only
            t0, _ = graph_ms([lambda: ops.build_tree(lp, ids, none, b)] * 50)
            print(f"{r_:>3} {b:>4} {t * 1e3:8.2f}   (no pops {t0 * 1e3:.2f})")
            record("tree_build", R=r_, B=b, us=t * 1e3, spread_us=spread * 1e3, no_pop_us=t0 * 1e3)


def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        vis[i] |= vis[parents[i]]
    return vis


def attention_metas(num_reqs, ctx, b, block_size, perm, rot, gen):
    """rot metadata objects, each over its own blocks of the pool (num_reqs sequences of ctx + b + 1 tokens)."""
    q = b + 1
    seq_len = ctx + q
    nblk = math.ceil(seq_len / block_size)
    tree = random_tree_mask(q, gen).to(DEV) if b > 0 else None
    metas = []
    for j in range(rot):
        blocks = perm[j * num_reqs * nblk : (j + 1) * num_reqs * nblk].view(num_reqs, nblk)
        metas.append(AttentionMetadata(
            positions=torch.zeros(num_reqs * q, dtype=torch.int64, device=DEV),
            slot_mapping=torch.zeros(num_reqs * q, dtype=torch.int64, device=DEV),
            query_start_loc=(torch.arange(num_reqs + 1, device=DEV) * q).int(),
            seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32, device=DEV),
            block_tables=blocks.int().to(DEV), block_size=block_size,
            tree_mask=tree.repeat(num_reqs, 1) if tree is not None else None,
            query_lens_host=[q] * num_reqs, seq_lens_host=[seq_len] * num_reqs))
        metas[-1].packed_tree_mask()
    return metas


def bench_gqa(bw: float, flops: float, quick: bool) -> None:
    print("\n## 3. GQA verify attention, one Qwen3-8B layer (32 q / 8 kv heads, d = 128, bf16), paged")
    print("bytes R*4096*L (K+V once), FLOPs R*16384*L*(B+1); ratio = time / time(B=0) at the same L, R, page; "
          "plan = tile rows x tiles a sequence x KV splits")
    print(f"{'page':>4} {'R':>2} {'L':>6} {'B':>4} {'ms':>8} {'TB/s':>6} {'TFLOP/s':>8} {'ratio':>6} {'plan':>10}")
    gen = torch.Generator().manual_seed(0)
    hkv, d, hq = 8, 128, 32
    cases = [(16, r_, L) for r_ in (1, 8) for L in (4096, 32768, 131072)] + [(64, 1, 32768), (64, 8, 4096)]
    if quick:
        cases = [(16, 1, 4096), (16, 1, 32768)]
    pools = {}
    for page, r_, L in cases:
        if page not in pools:
            need = max(math.ceil((L_ + 129) / page) * r__ * rotations(r__ * L_ * 4096)
                       for page_, r__, L_ in cases if page_ == page)
            k = torch.randn(need, page, hkv, d, device=DEV, dtype=torch.bfloat16)
            pools[page] = (k, torch.randn_like(k), torch.randperm(need))
        k_cache, v_cache, perm = pools[page]
        rot = rotations(r_ * L * 4096)
        decode_ms = None
        for b in (0, 16, 32, 64, 128):
            metas = attention_metas(r_, L, b, page, perm, rot, gen)
            q = torch.randn(r_ * (b + 1), hq, d, device=DEV, dtype=torch.bfloat16)
            t, spread = graph_ms([lambda i=i: ops.paged_attention(q, k_cache, v_cache, metas[i % rot], d**-0.5)
                                  for i in range(max(rot, 6))])
            decode_ms = t if b == 0 else decode_ms
            tbs = r_ * 4096 * L / (t * 1e-3) / 1e12
            tfl = r_ * 16384 * L * (b + 1) / (t * 1e-3) / 1e12
            _, _, rows, tiles, splits, _ = torch.ops.ddtree.attention_plan(d, hq // hkv, r_, hkv, b + 1, L + b + 1)
            plan = f"{rows}x{tiles}x{splits}"
            print(f"{page:>4} {r_:>2} {L:>6} {b:>4} {t:8.4f} {tbs:6.2f} {tfl:8.1f} {t / decode_ms:6.2f} {plan:>10}")
            record("gqa", page=page, R=r_, L=L, B=b, ms=t, spread_ms=spread, TBps=tbs, TFLOPs=tfl, plan=plan,
                   ratio=t / decode_ms, pct_bw=100 * tbs * 1e12 / bw, pct_flops=100 * tfl * 1e12 / flops)
    del pools
    torch.cuda.empty_cache()
    # torch SDPA on a dense (unpaged) copy, the baseline of kernels.md A.2
    L, b = 32768, 64
    k = torch.randn(1, hkv, L + b + 1, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, hq, b + 1, d, device=DEV, dtype=torch.bfloat16)
    mask = torch.ones(b + 1, L + b + 1, dtype=torch.bool, device=DEV)
    mask[:, L:] = random_tree_mask(b + 1, gen).to(DEV)
    t = event_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    print(f"torch SDPA (dense, bool tree mask) L=32k B=64 R=1: {t:.4f} ms")
    record("gqa_sdpa", L=L, B=b, ms=t)


def bench_prefill(flops: float) -> None:
    """Causal prefill chunks through the same paged kernel (R = 1, page 16), against torch SDPA (FlashAttention
    backend, dense, is_causal) on the same shapes."""
    print("\n## 9. GQA prefill attention, one Qwen3-8B layer (32 q / 8 kv heads, d = 128, bf16), causal chunk of Q "
          "new tokens after C cached ones")
    print(f"{'C':>6} {'Q':>5} {'ours ms':>8} {'TFLOP/s':>8} {'% GEMM':>7} {'SDPA ms':>8} {'TFLOP/s':>8} "
          f"{'engine ms':>9}")
    hkv, d, hq, page = 8, 128, 32, 16
    for ctx, q_len in ((0, 2048), (0, 8192), (30720, 2048)):
        seq = ctx + q_len
        nblk = math.ceil(seq / page)
        k_cache = torch.randn(nblk, page, hkv, d, device=DEV, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        meta = AttentionMetadata(
            positions=torch.arange(ctx, seq, device=DEV), slot_mapping=torch.zeros(q_len, dtype=torch.int64, device=DEV),
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=DEV),
            seq_lens=torch.tensor([seq], dtype=torch.int32, device=DEV),
            block_tables=torch.arange(nblk, dtype=torch.int32, device=DEV)[None], block_size=page,
            query_lens_host=[q_len], seq_lens_host=[seq])
        q = torch.randn(q_len, hq, d, device=DEV, dtype=torch.bfloat16)
        work = 4 * hq * d * q_len * (ctx + q_len / 2)  # causal: half of the chunk's own square
        t = event_ms(lambda: ops.paged_attention(q, k_cache, v_cache, meta, d**-0.5))
        k = k_cache.reshape(-1, hkv, d)[:seq].transpose(0, 1)[None]
        v = v_cache.reshape(-1, hkv, d)[:seq].transpose(0, 1)[None]
        qd = q.transpose(0, 1)[None]
        if ctx == 0:
            ts = event_ms(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, enable_gqa=True))
        else:  # a chunk after context: bottom-right causal mask
            mask = torch.ones(q_len, seq, dtype=torch.bool, device=DEV).tril(ctx)
            ts = event_ms(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True))
        tf, tfs = work / (t * 1e-3) / 1e12, work / (ts * 1e-3) / 1e12
        # the engine's path with --dense-prefill-min-tokens up to Q (ext/prefill.py): cuDNN on a whole prompt,
        # FlashAttention over the context gathered from the cache after cached context
        kd, vd = k[0, :, ctx:].transpose(0, 1), v[0, :, ctx:].transpose(0, 1)  # the layer's new rows [Q, kv heads, d]
        meta.dense_prefill_min_tokens = q_len
        routed = event_ms(lambda: ops.paged_attention(q, k_cache, v_cache, meta, d**-0.5, k=kd, v=vd))
        print(f"{ctx:>6} {q_len:>5} {t:8.3f} {tf:8.1f} {100 * tf * 1e12 / flops:6.1f}% {ts:8.3f} {tfs:8.1f} "
              f"{routed:9.3f}")
        record("prefill", C=ctx, Q=q_len, ms=t, TFLOPs=tf, pct_flops=100 * tf * 1e12 / flops, sdpa_ms=ts,
               sdpa_TFLOPs=tfs, engine_ms=routed)
        del k_cache, v_cache
        torch.cuda.empty_cache()


def bench_mla(bw: float, flops: float, quick: bool) -> None:
    print("\n## 4. MLA verify attention (absorbed, 512 latent + 64 rope, bf16), page 64, R = 1")
    print("bytes 1152*L, FLOPs 2*h*1088*L*(B+1)")
    print(f"{'h':>4} {'L':>6} {'B':>4} {'ms':>8} {'TB/s':>6} {'TFLOP/s':>8} {'%GEMM':>6}")
    gen = torch.Generator().manual_seed(1)
    page = 64
    Ls = (4096,) if quick else (4096, 32768)
    need = math.ceil((max(Ls) + 65) / page) * rotations(4096 * 1152)
    cache = torch.randn(need, page, 576, device=DEV, dtype=torch.bfloat16)
    perm = torch.randperm(need)
    for h in (16, 128):
        for L in Ls:
            rot = rotations(L * 1152)
            for b in (0, 16, 64):
                metas = attention_metas(1, L, b, page, perm, rot, gen)
                ql = torch.randn(b + 1, h, 512, device=DEV, dtype=torch.bfloat16)
                qr = torch.randn(b + 1, h, 64, device=DEV, dtype=torch.bfloat16)
                t, spread = graph_ms([lambda i=i: ops.mla_paged_attention(ql, qr, cache, metas[i % rot], 0.07)
                                      for i in range(max(rot, 6))])
                tbs = 1152 * L / (t * 1e-3) / 1e12
                tfl = 2 * h * 1088 * L * (b + 1) / (t * 1e-3) / 1e12
                print(f"{h:>4} {L:>6} {b:>4} {t:8.4f} {tbs:6.2f} {tfl:8.1f} {100 * tfl * 1e12 / flops:6.1f}")
                record("mla", h=h, L=L, B=b, ms=t, spread_ms=spread, TBps=tbs, TFLOPs=tfl,
                       pct_flops=100 * tfl * 1e12 / flops)
    del cache
    torch.cuda.empty_cache()


def bench_accept(bw: float) -> None:
    print("\n## 7. accept: target token per node (argmax / temperature sample over V bf16) + tree walk, R=64, B=64")
    n = 64 * 65
    logits = torch.randn(n, V, device=DEV).to(torch.bfloat16)
    nbytes = n * V * 2
    zeros = torch.zeros(n, device=DEV)
    uniform = torch.rand(n, device=DEV, dtype=torch.float64)
    t_arg, _ = graph_ms([lambda: ops.sample_tokens(logits, zeros, zeros, uniform)] * 4)
    t_torch, _ = graph_ms([lambda: logits.argmax(-1)] * 4)
    temp = torch.full((n,), 0.8, device=DEV)
    t_smp, _ = graph_ms([lambda: ops.sample_tokens(logits, temp, zeros, uniform)] * 4)
    print(f"argmax  {t_arg:.4f} ms  {nbytes / (t_arg * 1e-3) / 1e12:.2f} TB/s   (torch.argmax {t_torch:.4f} ms, "
          f"{nbytes / (t_torch * 1e-3) / 1e12:.2f} TB/s)")
    print(f"sample  {t_smp:.4f} ms  {nbytes / (t_smp * 1e-3) / 1e12:.2f} TB/s   sample/greedy = {t_smp / t_arg:.2f}")
    del logits
    gen = torch.Generator().manual_seed(2)
    lp, ids = reference.topk_logprobs(torch.randn(64, 15, 200, generator=gen), 64)
    tree = reference.build_tree(lp, ids, torch.full((64,), 64), 64)
    target = tree.node_token_ids.clone()
    for i in range(64):  # follow the first child everywhere: deep walks
        target[i, :-1] = tree.node_token_ids[i, 1:]
    args = [x.to(DEV) for x in (target, tree.node_token_ids, tree.parents, tree.num_nodes)]
    t_walk, _ = graph_ms([lambda: ops.tree_accept(*args, 15)] * 50)
    print(f"walk    {t_walk * 1e3:.2f} us for 64 trees of 64 nodes")
    record("accept", argmax_ms=t_arg, argmax_TBps=nbytes / (t_arg * 1e-3) / 1e12, torch_argmax_ms=t_torch,
           sample_ms=t_smp, sample_over_greedy=t_smp / t_arg, walk_us=t_walk * 1e3)
    torch.cuda.empty_cache()


def bench_top_p(quick: bool) -> None:
    print("\n## 10. top-k / top-p filter of fp32 rows: the floor kernel + a masking pass against sorting the rows")
    print("| rows | V | logits | filter | sort ms | floor ms | floor + mask ms | sort / (floor + mask) |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [(16, 49152), (272, 49152), (1088, 49152), (16, 151936), (272, 151936)]
    gen = torch.Generator(device=DEV).manual_seed(5)
    for rows, vocab in cases[:2] if quick else cases:
        for spread in (2.0, 6.0):
            x = torch.randn(rows, vocab, device=DEV, generator=gen) * spread
            for name, top_k, top_p in (("top_p 0.9", 0, 0.9), ("top_k 50", 50, 1.0), ("both", 50, 0.9)):
                k = torch.full((rows,), top_k if top_k else vocab, device=DEV, dtype=torch.int64)
                p = torch.full((rows,), top_p, device=DEV)
                t_sort, _ = graph_ms([lambda: sort_top_k_top_p(x, k, p)] * 3)
                t_floor, _ = graph_ms([lambda: ops.top_k_top_p_floor(x, k, p)] * 3)
                t_both, _ = graph_ms([lambda: x.masked_fill(x < ops.top_k_top_p_floor(x, k, p)[:, None],
                                                            float("-inf"))] * 3)
                print(f"| {rows} | {vocab} | randn x {spread:g} | {name} | {t_sort:.4f} | {t_floor:.4f} | "
                      f"{t_both:.4f} | {t_sort / t_both:.1f}x |")
                record("top_p", rows=rows, vocab=vocab, spread=spread, filter=name, sort_ms=t_sort,
                       floor_ms=t_floor, floor_mask_ms=t_both)
            del x
    torch.cuda.empty_cache()


def bench_compaction(bw: float) -> None:
    print("\n## 8. KV compaction after accept, R = 64, B = 64 (bytes 2*(A-1)*kappa per request)")
    print(f"{'layout':>6} {'A':>3} {'MB':>7} {'us':>9} {'TB/s':>6}   (generic gather/scatter us)")
    r_, rows = 64, 65
    for layout, views, row_shape in (("GQA", 72, (8, 128)), ("MLA", 61, (576,))):
        num_slots = r_ * rows + 512
        caches = [torch.randn(num_slots, *row_shape, device=DEV, dtype=torch.bfloat16) for _ in range(views)]
        kappa = views * math.prod(row_shape) * 2
        tree_slots = torch.randperm(num_slots, device=DEV)[: r_ * rows].view(r_, rows)
        for a in (1, 4, 8, 16):
            accepted = torch.full((r_, 16), -1, dtype=torch.int64, device=DEV)
            accepted[:, :a] = torch.arange(a, device=DEV) * 2  # 0, 2, 4, ...: every row moves
            moved = r_ * 2 * (a - 1) * kappa
            t, _ = graph_ms([lambda: ops.kv_compact_tree(caches, accepted, tree_slots)] * 10)
            src, dst, _ = reference.compaction_slots(accepted, tree_slots)
            tg, _ = graph_ms([lambda: ops.kv_compact(caches, src, dst)] * 5)
            tbs = moved / (t * 1e-3) / 1e12 if a > 1 else 0.0
            print(f"{layout:>6} {a:>3} {moved / 1e6:7.1f} {t * 1e3:9.2f} {tbs:6.2f}   ({tg * 1e3:.2f})")
            record("compaction", layout=layout, A=a, MB=moved / 1e6, us=t * 1e3, TBps=tbs, generic_us=tg * 1e3)
        spine = torch.full((r_, 16), -1, dtype=torch.int64, device=DEV)
        spine[:, :8] = torch.arange(8, device=DEV)
        t, _ = graph_ms([lambda: ops.kv_compact_tree(caches, spine, tree_slots)] * 10)
        print(f"{layout:>6} spine A=8 (already in place, 0 bytes): {t * 1e3:.2f} us")
        record("compaction", layout=layout, A=8, spine=True, us=t * 1e3)
        del caches
        torch.cuda.empty_cache()


GEMV_SHAPES = {  # name -> (out features, in features) of the decode-step projections
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576), "qwen3-8b qkv": (6144, 4096), "qwen3-8b o": (4096, 4096),
    "qwen3-8b gate_up": (24576, 4096), "qwen3-8b down": (4096, 12288), "qwen3-8b lm_head": (151936, 4096),
}


def bench_gemv(bw: float, quick: bool) -> None:
    """Decode- and verify-sized projections (1-32 rows): the CUDA-core GEMV (up to 8 rows) and the tensor-core GEMM
    (3-32 rows) against cuBLAS (F.linear) on the same bf16 weights, each replayed in a CUDA graph over enough
    weight copies that every call reads its weight from HBM; gate_up also with SiLU-and-mul (one fused launch
    against cuBLAS + the silu_and_mul kernel)."""
    kernels = {"gemv": (torch.ops.ddtree.gemv, 8), "gemm_skinny": (torch.ops.ddtree.gemm_skinny, 32)}
    print("\n## Few-row projections vs cuBLAS (us per call; weight-read floor at the measured copy bandwidth)")
    print("| projection | rows | weight MB | floor us | cuBLAS us | GEMV us | skinny GEMM us | best ours / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in GEMV_SHAPES.items():
        if quick and "qwen3" in name and "lm_head" not in name:
            continue
        nbytes = n * k * 2
        sets = rotations(nbytes, most=512)  # > 256 MB of weights in flight: every call reads HBM, as a model's do
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5 for _ in range(sets)]
        fused = "gate_up" in name
        for rows in (1, 2, 4, 8, 16, 17, 32):
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            ref = [(lambda w=w: ops.silu_and_mul(F.linear(x, w))) if fused else (lambda w=w: F.linear(x, w))
                   for w in ws]
            t_ref = graph_ms(ref)[0] * 1e3
            times = {}
            for kernel, (op, most) in kernels.items():
                if rows <= most and (kernel == "gemv" or (rows >= 3 and k % 32 == 0)):
                    times[kernel] = graph_ms([lambda w=w, op=op: op(x, w, None, fused) for w in ws])[0] * 1e3
            floor = nbytes / bw * 1e6  # as bench/e2e.py's floor: weight bytes over the copy's bytes moved per second
            label = name + (" + SiLU" if fused else "")
            cells = " | ".join(f"{times[kernel]:.2f}" if kernel in times else "-" for kernel in kernels)
            print(f"| {label} | {rows} | {nbytes / 1e6:.1f} | {floor:.2f} | {t_ref:.2f} | {cells} | "
                  f"{min(times.values()) / t_ref:.2f} |", flush=True)
            record("gemv", projection=label, rows=rows, weight_mb=nbytes / 1e6, floor_us=floor, cublas_us=t_ref,
                   **{f"{kernel}_us": t for kernel, t in times.items()})
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a few cases of each section")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--only", default="",
                   help="comma list of sections: topk,tree,gqa,mla,accept,compact,prefill,gemv,topp")
    args = p.parse_args()
    assert build.load_ops() is not None, "the CUDA extension did not build"
    props = torch.cuda.get_device_properties(0)
    tiles = "wgmma" if torch.ops.ddtree.attention_wgmma() else "mma.sync"
    print(f"# ddtree kernels on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"{datetime.datetime.now().isoformat(timespec='minutes')}; attention tiles past 64 rows: {tiles}")
    bw, flops = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s (read + write), bf16 GEMM 8192^3 {flops / 1e12:.0f} TFLOP/s")
    record("ceilings", TBps=bw / 1e12, TFLOPs=flops / 1e12)
    only = set(filter(None, args.only.split(",")))
    sections = [("topk", lambda: bench_topk(bw, args.quick)), ("tree", bench_tree_build),
                ("gqa", lambda: bench_gqa(bw, flops, args.quick)), ("mla", lambda: bench_mla(bw, flops, args.quick)),
                ("accept", lambda: bench_accept(bw)), ("compact", lambda: bench_compaction(bw)),
                ("prefill", lambda: bench_prefill(flops)), ("gemv", lambda: bench_gemv(bw, args.quick)),
                ("topp", lambda: bench_top_p(args.quick))]
    for name, fn in sections:
        if only and name not in only:
            continue
        try:
            fn()
        except Exception as e:  # one broken section must not hide the others
            print(f"section {name} failed: {type(e).__name__}: {e}")
            record(name, error=str(e))
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
