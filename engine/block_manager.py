"""Paged KV blocks: a free list, and each request's block table grown on demand and returned on finish,
abort or preemption. A slot is `block_id * block_size + offset`."""
from __future__ import annotations

from collections import deque

from engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks to add so `request` has room for `num_tokens` KV entries in total."""
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_needed(request, num_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grows the block table to hold `num_tokens`; False (and nothing taken) when blocks run out."""
        need = self.blocks_needed(request, num_tokens)
        if need > self.num_free_blocks:
            return False
        request.block_ids.extend(self.free_blocks.popleft() for _ in range(need))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the blocks beyond what `num_tokens` entries need (after a tree's rejected rows)."""
        keep = -(-num_tokens // self.block_size)
        while len(request.block_ids) > keep:
            self.free_blocks.append(request.block_ids.pop())

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []

    def slot(self, request: Request, index: int) -> int:
        """Cache slot of the request's logical KV position `index`."""
        return request.block_ids[index // self.block_size] * self.block_size + index % self.block_size
