"""CUDA graphs for the DFlash drafter's block: for N requests (a bucket of engine.cuda_graphs.BATCH_SIZES), the
blocks' embedding, the draft layers over the paged draft KV, the target's head and the top-K, captured once per
bucket and replayed with the call's bonus tokens, positions, slots, lengths and page tables written into static
buffers. The call's new context rows (the target features of the tokens accepted since the last call) go through
graphs of their own, one per row count bucket (CONTEXT_ROWS; rows past the call's count write to slot -1, which
the cache write skips); more rows than the largest bucket (a prompt's first draft) run eagerly, counted.

Batch buckets whose head logits would pass MAX_GRAPH_LOGITS_BYTES are not captured (a graph keeps its memory).
Padding requests (rows past the call's N in its bucket) are blocks at positions 0..bs-1 over a scratch page the
graphs reserve in the pool; their outputs are never read. The attention launch is planned for the capacity
(max_model_len + bs keys) and reads each request's length from the device. The graphs hold the pool's tensors:
if the pool ever had to grow (it is sized at startup so that it does not), they are dropped and the drafter runs
eagerly, logged once; every eager call (or context write) is counted
(kernel_reference_fallbacks{op="dflash_draft_graph"})."""
from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from engine.cuda_graphs import collector_paused
from engine.speculative.draft_kv import PAGE_TOKENS
from ext.dispatch import count_slow_path
from ext.metadata import AttentionMetadata

logger = logging.getLogger("ddtree.engine")

SCRATCH = "\0draft-graph-padding"  # the pool's owner name of the padding page(s)
CONTEXT_ROWS = tuple(1 << i for i in range(4, 12))  # 16 .. 2048 new context rows a call
# A captured graph keeps its memory, and the head's fp32 logits (N x horizon x vocab) are most of a block graph's:
# batch buckets past this many bytes of logits are not captured (their calls run eagerly, counted), which keeps
# the drafter's graphs outside the KV plan small (SmolLM2's vocabulary: up to 128 requests; Qwen3's: up to 48)
MAX_GRAPH_LOGITS_BYTES = 512 << 20


class DraftGraphs:
    def __init__(self, drafter, batch_sizes: list[int], top_k: int, max_model_len: int, emulate: bool = False):
        self.drafter, self.top_k, self.emulate = drafter, top_k, emulate
        logits_bytes = drafter.horizon * drafter.vocab_size * 4  # a request's
        self.batch_sizes = sorted(n for n in batch_sizes if n == 1 or n * logits_bytes <= MAX_GRAPH_LOGITS_BYTES)
        bs, device = drafter.block_size, drafter.device
        self.bs, self.capacity = bs, max_model_len + bs
        num = self.batch_sizes[-1]
        scratch = drafter.pool.reserve(SCRATCH, bs)
        self.pad_slots = torch.tensor(drafter.pool.slots(SCRATCH, 0, bs), dtype=torch.int64, device=device)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.bonus = torch.zeros(num, **i64)
        self.positions = torch.arange(bs, **i64).repeat(num)
        self.slots = self.pad_slots.repeat(num)
        self.query_start_loc = torch.arange(num + 1, **i32) * bs
        self.seq_lens = torch.full((num,), bs, **i32)
        self.tables = torch.zeros(num, -(-self.capacity // PAGE_TOKENS), **i32)
        self.tables[:, :len(scratch)] = torch.tensor(scratch, **i32)
        self.pad_table = self.tables[0].clone()
        self.mask = torch.ones(num * bs, bs, dtype=torch.bool, device=device)
        self._real = 0  # leading requests whose rows hold a call's inputs (the rest hold padding)
        c = drafter.model.config
        rows = CONTEXT_ROWS[-1]
        self.feats = torch.zeros(rows, len(c.target_layer_ids) * c.target_hidden_size, dtype=drafter.dtype,
                                 device=device)
        self.context_positions = torch.zeros(rows, **i64)
        self.context_slots = torch.full((rows,), -1, **i64)
        self._context_real = 0  # leading context rows holding a call's slots (the rest hold -1)
        self.context_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graphs: dict[int, tuple] = {}
        self.dropped = self._warned = False
        drafter.pool.on_grow = self._drop
        if not emulate:
            self._capture()

    def meta(self, n: int) -> AttentionMetadata:
        """Metadata over the static buffers for bucket n; host lengths are capacities (launch shapes)."""
        rows = n * self.bs
        return AttentionMetadata(
            positions=self.positions[:rows], slot_mapping=self.slots[:rows], query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.seq_lens[:n], block_tables=self.tables[:n], block_size=PAGE_TOKENS, tree_mask=self.mask[:rows],
            query_lens_host=[self.bs] * n, seq_lens_host=[self.capacity] * n)

    @torch.inference_mode()
    @collector_paused()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for n in tqdm(sorted(self.batch_sizes, reverse=True), desc="capturing drafter CUDA graphs", unit="graph",
                      disable=None, leave=False):
            self.drafter.block_topk(self.bonus[:n], self.meta(n), self.top_k)  # warm-up, eager
            torch.cuda.synchronize(self.drafter.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.drafter.block_topk(self.bonus[:n], self.meta(n), self.top_k)
            pool = graph.pool()
            self.graphs[n] = (graph, out)
        for t in sorted(CONTEXT_ROWS, reverse=True):  # slots all -1 at capture: the warm-up writes nothing
            self._write_context(t)
            torch.cuda.synchronize(self.drafter.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._write_context(t)
            pool = graph.pool()
            self.context_graphs[t] = graph
        torch.cuda.synchronize(self.drafter.device)
        logger.info("captured %d drafter CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.batch_sizes,
                    time.perf_counter() - t0)

    def _write_context(self, t: int) -> None:
        self.drafter.write_context(self.feats[:t], self.context_positions[:t], self.context_slots[:t])

    def write_context(self, rows: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> bool:
        """The new context rows' K/V (rows: target features [n_i, F] per request, positions and slots [sum n_i])
        through their bucket's replay; False (the caller writes them eagerly) when no bucket holds them."""
        num = positions.shape[0]
        t = next((b for b in CONTEXT_ROWS if b >= num), None)
        if self.dropped or t is None:
            count_slow_path("dflash_draft_graph")
            return False
        if num < self._context_real:
            self.context_slots[num:self._context_real].fill_(-1)
        self._context_real = num
        if len(rows) == 1 or any(r.dtype != self.feats.dtype for r in rows):
            self.feats[:num].copy_(rows[0] if len(rows) == 1 else torch.cat(rows))
        else:
            torch.cat(rows, out=self.feats[:num])
        self.context_positions[:num].copy_(positions)
        self.context_slots[:num].copy_(slots)
        if self.emulate:
            self._write_context(t)
        else:
            self.context_graphs[t].replay()
        return True

    def _drop(self) -> None:
        if not self.dropped:
            logger.warning("the draft-KV pool outgrew its startup size: drafter CUDA graphs dropped, the drafter "
                           "runs eagerly from now on")
        self.graphs, self.dropped = {}, True

    def run(self, call, top_k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The call's ([N, L, K] log-probs, ids) from its bucket's replay (views of the graph's outputs, valid until
        the next replay), or None (the caller runs the block eagerly) after the graphs were dropped."""
        num = call.bonus.shape[0]
        n = next((b for b in self.batch_sizes if b >= num), None)
        if self.dropped or n is None or top_k != self.top_k:
            count_slow_path("dflash_draft_graph")
            if not self.dropped and not self._warned:
                logger.warning("no drafter CUDA graph for %d requests at top-K %d: drafting eagerly (logged once)",
                               num, top_k)
                self._warned = True
            return None
        bs, meta = self.bs, call.meta
        if num < self._real:  # rows of an earlier, larger call become padding again
            rows = slice(num * bs, self._real * bs)
            self.positions[rows].copy_(torch.arange(bs, device=self.bonus.device).repeat(self._real - num))
            self.slots[rows].copy_(self.pad_slots.repeat(self._real - num))
            self.seq_lens[num:self._real].fill_(bs)
            self.tables[num:self._real].copy_(self.pad_table.expand(self._real - num, -1))
        self._real = num
        self.bonus[:num].copy_(call.bonus)
        self.positions[:num * bs].copy_(meta.positions)
        self.slots[:num * bs].copy_(meta.slot_mapping)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.tables[:num, :meta.block_tables.shape[1]].copy_(meta.block_tables)  # columns past a request's
        # last page are never read (the kernel stops at its length)
        if self.emulate:
            static = self.meta(n)
            static.seq_lens_host = self.seq_lens[:n].tolist()  # the CPU reference reads host lengths
            lp, ids = self.drafter.block_topk(self.bonus[:n], static, top_k)
        else:
            graph, (lp, ids) = self.graphs[n]
            graph.replay()
        return lp[:num], ids[:num]
