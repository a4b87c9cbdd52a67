"""How many KV-cache blocks the engine gets, and the warm-up that measures what the rest of a step needs.

On CUDA the cache takes what `gpu_memory_utilization` of the device leaves after everything else: the weights
and whatever else is resident (measured after loading), plus the peak activation memory of the largest step
(measured by a warm-up at the largest step shape: a full max_num_batched_tokens forward and the sampler over
the most rows a step can sample, with every sampling feature on). On the CPU it is a fixed size. Explicit
overrides: num_kv_blocks, then kv_cache_memory. Never more blocks than max_num_seqs full-length requests can
use; never fewer than one max_model_len request needs (startup fails naming the flags to change).

While serving, AllocatorWatch reports when a step outgrew that working memory: the caching allocator then fails
an allocation, frees its cache and retries, a synchronizing stall that would otherwise go unseen.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import CPU_KV_CACHE_MEMORY, EngineConfig

logger = logging.getLogger("ddtree.engine")

GIB = 1 << 30


@dataclass
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # which setting decided the size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def max_concurrency(self, max_model_len: int) -> float:
        return self.num_tokens / max_model_len

    def describe(self, max_model_len: int) -> str:
        return (f"KV cache: {self.num_blocks:,} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens "
                f"({self.num_bytes / GIB:.2f} GiB, {self.source}); maximum concurrency at max_model_len "
                f"{max_model_len:,}: {self.max_concurrency(max_model_len):.2f} requests")


def plan_kv_cache(config: EngineConfig, bytes_per_block: int, max_model_len: int, lookahead: int,
                  measure_peak: Callable[[], int] | None = None) -> KVCachePlan:
    """The cache size. `measure_peak` (CUDA) runs the warm-up and returns its peak extra bytes; `lookahead` is
    the most tree rows a request may hold past its tokens."""
    block_size = config.block_size
    per_request = -(-(max_model_len + lookahead) // block_size)
    useful = config.max_num_seqs * per_request
    if config.num_kv_blocks is not None:
        num_blocks, source = config.num_kv_blocks, "--num-kv-blocks"
    elif config.kv_cache_memory is not None:
        num_blocks, source = config.kv_cache_memory // bytes_per_block, "--kv-cache-memory"
    elif config.is_cuda:
        num_blocks = _cuda_budget(config, measure_peak) // bytes_per_block
        source = f"--gpu-memory-utilization {config.gpu_memory_utilization:.2f}"
    else:
        num_blocks, source = CPU_KV_CACHE_MEMORY // bytes_per_block, "the CPU default of 1 GiB"
    if num_blocks > useful:
        num_blocks, source = useful, source + f", capped at what --max-num-seqs {config.max_num_seqs} can use"
    if num_blocks < per_request:
        have = max(num_blocks, 0) * block_size
        raise ValueError(
            f"the KV cache ({source}) holds {have:,} tokens, fewer than one request at max_model_len "
            f"{max_model_len:,} needs ({per_request * block_size:,}); lower --max-model-len, or raise "
            f"{'--gpu-memory-utilization or ' if config.is_cuda else ''}--kv-cache-memory")
    return KVCachePlan(int(num_blocks), block_size, bytes_per_block, source)


def _cuda_budget(config: EngineConfig, measure_peak: Callable[[], int] | None) -> int:
    """Bytes left for the KV cache on the device."""
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights, the CUDA context, other processes
    peak = measure_peak() if measure_peak is not None else 0
    budget = int(total * config.gpu_memory_utilization) - in_use - peak
    logger.info("device memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB peak for the largest "
                "step; %.2f GiB left for the KV cache at --gpu-memory-utilization %.2f", total / GIB,
                in_use / GIB, peak / GIB, max(budget, 0) / GIB, config.gpu_memory_utilization)
    return max(budget, 0)


def measure_cuda_peak(device: torch.device, warmup: Callable[[], None]) -> int:
    """Peak device memory `warmup` allocates beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    warmup()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


ALLOC_CHECK_EVERY = 64  # steps between reads of the allocator's counters (memory_stats builds a dict of them all)


class AllocatorWatch:
    """The CUDA caching allocator's retries (num_alloc_retries), read every ALLOC_CHECK_EVERY steps; the first
    retry logs a warning. Retries mean the KV cache left a step too little working memory."""

    def __init__(self, device: torch.device):
        self.device, self.steps, self.warned = device, 0, False
        self.retries = self._total()  # startup's own (warm-up, capture) are not serving's

    def _total(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def new_retries(self) -> int:
        """Retries since the last read (0 between reads)."""
        self.steps += 1
        if self.steps < ALLOC_CHECK_EVERY:
            return 0
        self.steps = 0
        total = self._total()
        new, self.retries = total - self.retries, total
        if new and not self.warned:
            self.warned = True
            logger.warning("the CUDA caching allocator ran out of memory and retried after freeing its cache (%d "
                           "times): steps stall while it does; lower --gpu-memory-utilization to leave the steps more "
                           "working memory (counted in ddtree:cuda_alloc_retries_total)", new)
        return new
