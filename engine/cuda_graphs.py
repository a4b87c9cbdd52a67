"""CUDA graphs for decode-only steps: the target forward of N requests x W rows each (W = 1 plain decoding,
W = budget + 1 tree verify), captured once per bucket at startup and replayed with the step's inputs written
in place into static buffers. Kernel launches per step drop from thousands to one replay.

Layout of a bucket (N_pad, W_pad) with T = N_pad * W_pad rows: request i owns rows i*W_pad .. i*W_pad + W - 1
of its verify width W <= W_pad (a step's own W is padded up: extra rows are padding rows). Static buffers hold
input ids, rope positions, cache slots, cumulative query lengths, KV lengths, block tables and the tree mask.
Invariants of padding: a padding row writes its K/V into scratch blocks that no request owns (the engine
reserves them past the BlockManager's blocks), attends only to itself and its request's context, and its output
is never read; a padding request (i >= N) is a W_pad-token sequence over the scratch blocks. The attention
kernels' launch shape is fixed at capture from capacities (W_pad query rows, context + W_pad keys), and every
per-step length is read from the device buffers (the kernels spread their KV splits over each sequence's actual
length), so a replay serves any lengths. Plain decoding (W = 1) is captured twice, for contexts up to
SHORT_CONTEXT and up to max_model_len: the short capacity plans at most 8 KV splits, which combine inside the
attention launch (ext/csrc/attention_mma.cuh, sm_90 clusters) instead of a second kernel.

Prompt buckets (one request of PROMPT_WIDTHS rows) are captured beside those for admission steps: their prompt
chunks replay as causal pieces (engine/admission.py). With --admission-decode-rows, plain-decoding buckets past
max_num_seqs (full context only, `row_sizes`) are captured too, for admission steps run as one-row requests. A
bucket's key is (requests, rows each, context capacity); prompt buckets that coincide with verify buckets are one
graph.

Graphs run only where they can: CUDA, no --enforce-eager, models without host-synchronizing layers (MoE layers
qualify when their grouped-GEMM dispatch serves the device and dtype), steps of decoding requests, and admission
steps as above; other steps run eagerly, and each eager step is counted with its reason (StepStats.cuda_graph).
"""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.staging import Staging
from engine.table_mirror import TableMirror
from ext.metadata import AttentionMetadata, block_table_rows

logger = logging.getLogger("ddtree.engine")

BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# plain-decoding graphs are also captured for contexts up to this many tokens: attention plans its KV splits from
# a graph's capacity, and at most 8 splits (a capacity this short) combine inside one launch on sm_90
SHORT_CONTEXT = 1024
WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)  # verify rows per request (budget + 1); 1 = plain decoding
# admission steps (engine/admission.py): prompt chunks run as causal pieces of up to these many rows, one piece a
# replay; a chain is a tree, so they are verify-layout buckets of one request with a causal mask
PROMPT_WIDTHS = (17, 65, 257)


@contextmanager
def collector_paused():
    """Python's garbage collector off while graphs are captured (after one collection): a collection mid-capture
    that frees another engine's graphs (kept in reference cycles until then) destroys graph executables, which a
    capturing stream forbids; the capture is invalidated and the random generators are left inside it. torch's
    capture no longer collects first (torch.compiler.config.force_cudagraph_gc). Seen on an H100 when GPU tests
    built several engines in one process."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def bucket_of(values: tuple[int, ...], n: int) -> int | None:
    return next((v for v in values if v >= n), None)


def graph_shape(num_seqs: int, width: int) -> tuple[int, int]:
    """The (batch, width) buckets a decoding step of num_seqs requests at `width` rows each runs as (beyond the
    largest bucket: the sizes themselves)."""
    return bucket_of(BATCH_SIZES, num_seqs) or num_seqs, bucket_of(WIDTHS, width) or width


def buckets_up_to(values: tuple[int, ...], n: int) -> list[int]:
    """The buckets of `values` that serve sizes up to n: every one below n and the one that holds n (which can be
    larger than n; when none does, the largest, already among those below n)."""
    holder = bucket_of(values, max(1, n))
    return [v for v in values if v < n] + ([holder] if holder is not None else [])


def bucket_widths(max_width: int) -> list[int]:
    """Verify widths captured for requests of at most max_width rows."""
    return buckets_up_to(WIDTHS, max_width)


def widest_bucket(max_width: int) -> int:
    """Rows per request of the widest bucket captured for verify widths up to max_width: a prompt bucket's or a
    verify bucket's."""
    return max(*bucket_widths(max_width), *PROMPT_WIDTHS)


def scratch_blocks_needed(max_width: int, block_size: int) -> int:
    """KV blocks the padding rows of the widest bucket write into (one slot per row position)."""
    return -(-widest_bucket(max_width) // block_size)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [T, hidden]
    captured: list[torch.Tensor]  # captured decoder-layer outputs, [T, hidden] each


class CudaGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, scratch_blocks: list[int],
                 max_num_seqs: int, max_width: int, max_tokens: int, max_model_len: int, max_blocks: int,
                 capture_layer_ids: tuple[int, ...], device: torch.device, emulate: bool = False,
                 admission_rows: int = 0):
        """emulate: no capture; each "replay" runs the model eagerly over the same padded static buffers (CPU
        tests of the layout and the padding). admission_rows: plain-decoding buckets are also captured past
        max_num_seqs, up to the one that holds max_num_seqs + admission_rows rows (full context only), for
        admission steps whose prompt chunks run as one-row requests (engine/admission.py)."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.scratch_blocks, self.max_model_len = scratch_blocks, max_model_len
        self.capture_layer_ids, self.device = capture_layer_ids, device
        self.batch_sizes = [n for n in BATCH_SIZES if n <= max_num_seqs]
        # every width up to the first bucket that holds max_width (a chain of 7 drafts verifies 8 rows: bucket 9)
        self.widths = bucket_widths(max_width)
        widest = widest_bucket(max_width)
        if widest > len(scratch_blocks) * block_size:
            raise ValueError(f"{len(scratch_blocks)} scratch blocks of {block_size} slots cannot pad a "
                             f"{widest}-row bucket (reserve scratch_blocks_needed())")
        self.contexts = [c for c in (SHORT_CONTEXT,) if c < max_model_len] + [max_model_len]
        self.buckets = [(n, w, c) for w in self.widths for n in self.batch_sizes if n * w <= max_tokens
                        for c in (self.contexts if w == 1 else [max_model_len])]
        # plain-decoding sizes past max_num_seqs, for admission steps' rows only
        holder = (bucket_of(BATCH_SIZES, max_num_seqs + admission_rows) or BATCH_SIZES[-1]) if admission_rows else 0
        self.row_sizes = [n for n in BATCH_SIZES if max(self.batch_sizes, default=0) < n <= min(holder, max_tokens)]
        if admission_rows and not self.row_sizes:
            logger.warning("--admission-decode-rows %d: no plain bucket past %d requests within the step's %d tokens "
                           "(batch sizes end at %d): admission steps replay prompt pieces", admission_rows,
                           max_num_seqs, max_tokens, BATCH_SIZES[-1])
        self.buckets += [(n, 1, max_model_len) for n in self.row_sizes]
        self.decode_sizes = tuple(self.batch_sizes + self.row_sizes)
        self.prompt_widths = [w for w in PROMPT_WIDTHS if w <= max_tokens]
        self.prompt_buckets = [(1, w, max_model_len) for w in self.prompt_widths]
        every_width = sorted({*self.widths, *self.prompt_widths})
        rows = max((n * w for n, w, _ in self.buckets + self.prompt_buckets), default=1)
        seqs = max(self.decode_sizes, default=1)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.slot_mapping = torch.zeros(rows, **i64)
        self.query_start_loc = torch.zeros(seqs + 1, **i32)
        self.seq_lens = torch.zeros(seqs, **i32)
        self.block_tables = torch.zeros(seqs, max(max_blocks, len(scratch_blocks)), **i32)
        self.table_mirror = TableMirror()  # the rows write_tables wrote (anything else writing rows forgets them)
        self.tree_masks = {w: torch.zeros(rows, w, dtype=torch.bool, device=device) for w in every_width if w > 1}
        # the scratch blocks and their slots, on the device once (a host list copied every step would synchronize)
        self.scratch = torch.tensor(scratch_blocks, dtype=torch.int32, device=device)
        self.scratch_slots = (self.scratch.long()[:, None] * block_size
                              + torch.arange(block_size, device=device)).reshape(-1)
        # each width's request offsets (i * w), on the device once
        self._starts = {w: torch.arange(seqs + 1, device=device) * w for w in {1, *every_width}}
        self._columns = torch.arange(max(every_width), device=device)  # a row's index inside its request
        # one-row padding requests: their block-table rows (the scratch blocks) to copy, and their one slot
        self._pad_tables = torch.zeros_like(self.block_tables)
        self._pad_tables[:, :len(scratch_blocks)] = self.scratch
        self._pad_slot = scratch_blocks[0] * block_size
        self._layout: tuple | None = None  # (num_seqs, n, w, width) of the last replay: its padding is in place
        self.last_key: tuple[int, int, int] | None = None  # the bucket run() replayed last
        self.graphs: dict[tuple[int, int, int], _Captured] = {}  # (requests, rows each, context capacity)
        self.pool = None
        self.emulate = emulate
        if emulate:
            self.graphs = {b: None for b in self.buckets + self.prompt_buckets}

    # ---------------------------------------------------------------------------------------------- capture

    def meta(self, n: int, w: int, context: int) -> AttentionMetadata:
        """Metadata over the static buffers for bucket (n, w, context); host lengths are capacities (launch
        shapes)."""
        t = n * w
        return AttentionMetadata(
            positions=self.positions[:t], slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], block_size=self.block_size,
            tree_mask=self.tree_masks[w][:t] if w > 1 else None,
            query_lens_host=[w] * n, seq_lens_host=[context + w] * n)

    @torch.inference_mode()
    @collector_paused()
    def capture(self) -> None:
        """Captures every bucket, largest first (they share one memory pool)."""
        t0 = time.perf_counter()
        buckets = sorted({*self.buckets, *self.prompt_buckets}, key=lambda b: (-b[0] * b[1], -b[2]))
        for n, w, c in tqdm(buckets, desc="capturing CUDA graphs", unit="graph", disable=None, leave=False):
            self._fill_padding(0, n, w)
            meta = self.meta(n, w, c)
            ids = self.input_ids[:n * w]
            self.model(ids, meta, self.kv_caches, capture_layer_ids=self.capture_layer_ids)  # warm-up, eager
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden, captured = self.model(ids, self.meta(n, w, c), self.kv_caches,
                                              capture_layer_ids=self.capture_layer_ids)
            self.pool = graph.pool()
            self.graphs[n, w, c] = _Captured(graph, hidden, captured)
        self._layout = None  # capture wrote every bucket's padding
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (batch sizes %s, verify widths %s, plain-decoding contexts %s, prompt "
                    "widths %s, admission rows %s) in %.1f s", len(self.graphs), self.batch_sizes, self.widths,
                    self.contexts, self.prompt_widths, self.row_sizes, time.perf_counter() - t0)

    # ----------------------------------------------------------------------------------------------- replay

    def bucket(self, num_seqs: int, width: int, max_seq_len: int | None = None) -> tuple[int, int, int] | None:
        """The graph for a step: the smallest batch and width buckets that hold it and, for plain decoding, the
        shortest context capacity that holds its longest sequence (max_seq_len keys; None: the full one)."""
        w = bucket_of(tuple(self.widths), width)
        n = bucket_of(self.decode_sizes if w == 1 else tuple(self.batch_sizes), num_seqs)
        if n is None or w is None:
            return None
        short = w == 1 and max_seq_len is not None and n not in self.row_sizes  # (admission rows: full context)
        key = (n, w, next((c for c in self.contexts if short and max_seq_len <= c + w), self.max_model_len))
        return key if key in self.graphs else None

    @property
    def max_decode_rows(self) -> int:
        """Rows of the largest plain-decoding bucket (admission rows included)."""
        return max(self.decode_sizes, default=0)

    def prompt_bucket(self, width: int) -> tuple[int, int, int] | None:
        """The prompt bucket for a prompt piece of `width` rows, or None."""
        w = bucket_of(tuple(self.prompt_widths), width)
        return (1, w, self.max_model_len) if w is not None else None

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata, num_seqs: int, width: int,
            key: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Replays the bucket for a step of num_seqs requests x width rows (inputs laid out request-major, as
        engine.inputs builds them; key: that bucket, default the smallest that holds the step); returns the first
        num_seqs * width rows of hidden and captured layers (for plain decoding, views of the graph's output
        buffers, valid until the next replay), or None when no bucket fits."""
        key = key or self.bucket(num_seqs, width, max(meta.seq_lens_host) if meta.seq_lens_host else None)
        if key is None:
            return None
        self.last_key = key
        n, w, _ = key
        self.set_layout(num_seqs, n, w, width)
        if w == 1:  # plain decoding: the step's rows are the first num_seqs rows
            rows = None
            self.input_ids[:num_seqs].copy_(input_ids)
            self.positions[:num_seqs].copy_(meta.positions)
            self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        else:
            rows = (self._starts[w][:num_seqs, None] + self._columns[:width]).reshape(-1)  # rows in the layout
            self.input_ids.index_copy_(0, rows, input_ids)
            self.positions.index_copy_(0, rows, meta.positions)
            self.slot_mapping.index_copy_(0, rows, meta.slot_mapping)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens if w == width else meta.seq_lens + (w - width))
        self.table_mirror.forget(0, num_seqs)
        self.block_tables[:num_seqs, :meta.block_tables.shape[1]].copy_(meta.block_tables)  # columns past a
        # request's last block are never read (the kernels stop at its length)
        if w > 1:
            mask = self.tree_masks[w]
            mask[:num_seqs * w].copy_(self._padded_mask(meta, num_seqs, width, w))
        hidden, layers = self.replay(key)
        if rows is None:
            return hidden[:num_seqs], [c[:num_seqs] for c in layers]
        return hidden.index_select(0, rows), [c.index_select(0, rows) for c in layers]

    def write_decode(self, input_ids: torch.Tensor | list[int], positions: list[int], slots: list[int],
                     seq_lens: list[int], tables: list[list[int]], stage: Staging, table_runs: bool = False
                     ) -> tuple[int, int, int] | None:
        """A plain decoding step (one row per request) written straight into the static buffers of the bucket
        that holds it, each array in one copy from pinned memory (engine/staging.py), for replay_rows(); the
        bucket, or None when none holds the step. input_ids: host ids, or the tokens the step in flight samples
        (a device tensor). table_runs: the tables come in runs of one list object (block_table_rows)."""
        num_seqs = len(seq_lens)
        key = self.bucket(num_seqs, 1, max(seq_lens))
        if key is None:
            return None
        self.last_key = key
        self.set_layout(num_seqs, key[0], 1, 1)
        if isinstance(input_ids, torch.Tensor):
            self.input_ids[:num_seqs].copy_(input_ids)
        else:
            stage.into(self.input_ids[:num_seqs], input_ids)
        stage.into(self.positions[:num_seqs], positions)
        stage.into(self.slot_mapping[:num_seqs], slots)
        stage.into(self.seq_lens[:num_seqs], seq_lens)
        self.write_tables(tables, stage, table_runs)
        return key

    def write_tables(self, tables: list[list[int]], stage: Staging, runs: bool = False) -> None:
        """Block-table rows 0 .. len(tables) - 1 hold `tables` (columns past a request's last block are never read):
        only the rows whose lists changed since this wrote them are written (TableMirror). runs: as write_decode."""
        if runs:  # an admission step's one-row requests, a few lists repeated: not worth recording
            self.table_mirror.forget(0, len(tables))
            changed = range(len(tables))
        else:
            changed = self.table_mirror.changed(tables)
        if 2 * len(changed) > len(tables):  # most of them: all in one copy
            table = block_table_rows(tables, runs)
            self.block_tables[:len(tables), :table.shape[1]].copy_(stage(table, torch.int32))
        elif changed:
            table = block_table_rows([tables[i] for i in changed])
            self.block_tables[stage(changed), :table.shape[1]] = stage(table, torch.int32)

    def replay_rows(self, key: tuple[int, int, int], num_seqs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The first num_seqs rows of hidden and captured layers after replaying a bucket that write_decode()
        filled (views of the graph's output buffers, valid until its next replay)."""
        hidden, layers = self.replay(key)
        return hidden[:num_seqs], [c[:num_seqs] for c in layers]

    def set_layout(self, num_seqs: int, n: int, w: int, width: int) -> None:
        """num_seqs requests of width rows each in bucket (n, w): padding rows and request offsets in place (kept
        while the layout repeats)."""
        layout = (num_seqs, n, w, width)
        if layout == self._layout:
            return
        last = self._layout
        if w == 1 and last is not None and last[1:] == layout[1:]:
            # one-row requests in the same bucket as the step before, whose padding is in place past its requests:
            # only rows that stopped being real become padding (those that became real are written by the step,
            # and a row's offset is its index either way). As requests finish and join, a queued batch-64 load
            # changed its plain steps' layout every other step, each time ~12 small copies and kernels for the
            # whole padding on the host's critical path.
            if num_seqs < last[0]:
                self._fill_padding(num_seqs, last[0], w, width)
        else:
            self._fill_padding(num_seqs, n, w, width)
            self.query_start_loc[:num_seqs + 1].copy_(self._starts[w][:num_seqs + 1])
        self._layout = layout

    def forget_layout(self) -> None:
        """Something else wrote the static buffers: the next step lays its padding out again."""
        self._layout = None

    def replay(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The bucket's forward over what its static buffers hold now: (hidden [n * w, hidden], captured layers),
        the graph's own output buffers (valid until its next replay)."""
        n, w, _ = key
        if self.emulate:
            meta = self.meta(*key)
            meta.query_lens_host = [w] * n  # the CPU reference reads host lengths: the real ones
            meta.seq_lens_host = self.seq_lens[:n].tolist()
            return self.model(self.input_ids[:n * w], meta, self.kv_caches, capture_layer_ids=self.capture_layer_ids)
        captured = self.graphs[key]
        captured.graph.replay()
        return captured.hidden, captured.captured

    def _padded_mask(self, meta: AttentionMetadata, num_seqs: int, width: int, w: int) -> torch.Tensor:
        """The step's [num_seqs * width, width] visibility in the bucket's [num_seqs * w, w] layout: each request's
        extra rows see only themselves."""
        out = torch.eye(w, dtype=torch.bool, device=self.device).repeat(num_seqs, 1, 1)  # [N, w, w]
        if meta.tree_mask is not None:
            out[:, :width, :width] = meta.tree_mask[:, :width].reshape(num_seqs, width, width)
        elif width == 1:
            out[:, 0, 0] = True
        return out.reshape(num_seqs * w, w)

    def _fill_padding(self, first: int, n: int, w: int, width: int | None = None) -> None:
        """Padding: requests first..n-1 become w-row sequences over the scratch blocks, and each real request's
        rows width..w-1 write into scratch slots (never into a request's blocks)."""
        scratch, slots = self.scratch, self.scratch_slots[:w]  # one scratch slot per row position
        if width is not None and width < w and first > 0:
            extra = (torch.arange(first, device=self.device)[:, None] * w
                     + torch.arange(width, w, device=self.device)).reshape(-1)
            self.slot_mapping.index_copy_(0, extra, slots[width:w].repeat(first))
            self.positions.index_fill_(0, extra, 0)
            self.input_ids.index_fill_(0, extra, 0)
        if first < n and w == 1:  # plain decoding's buckets: fills and one copy, no temporaries to build
            self.input_ids[first:n].zero_()
            self.positions[first:n].zero_()
            self.slot_mapping[first:n].fill_(self._pad_slot)
            self.query_start_loc[first:n + 1].copy_(self._starts[1][first:n + 1])
            self.seq_lens[first:n].fill_(1)
            self.table_mirror.forget(first, n)
            self.block_tables[first:n].copy_(self._pad_tables[:n - first])
        elif first < n:
            self.input_ids[first * w:n * w].zero_()
            self.positions[first * w:n * w].copy_(torch.arange(w, device=self.device).repeat(n - first))
            self.slot_mapping[first * w:n * w].copy_(slots.repeat(n - first))
            self.query_start_loc[first:n + 1].copy_(torch.arange(first, n + 1, device=self.device) * w)
            self.seq_lens[first:n].fill_(w)
            self.table_mirror.forget(first, n)
            self.block_tables[first:n].zero_()
            self.block_tables[first:n, :len(self.scratch_blocks)].copy_(scratch)
            if w > 1:
                causal = torch.ones(w, w, dtype=torch.bool, device=self.device).tril()
                self.tree_masks[w][first * w:n * w].copy_(causal.repeat(n - first, 1))


def supports_graphs(model) -> str | None:
    """None when the model's forward can be captured, else why not."""
    from engine.model.moe import sync_free

    if not sync_free(model):
        param = next(model.parameters())
        return (f"MoE dispatch synchronizes with the host (its grouped GEMM needs bf16 on sm_90+, this is "
                f"{str(param.dtype).removeprefix('torch.')})")
    return None
