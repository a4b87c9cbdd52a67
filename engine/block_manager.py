"""Paged KV blocks: a free list, per-block reference counts, each request's block table grown on demand and
returned on finish, abort or preemption, and prefix caching. A slot is `block_id * block_size + offset`.

Prefix caching: a block whose block_size tokens all have KV is content-addressed by a digest chained over
every token before it. A new request reuses the longest run of its prompt's leading blocks found in the cache
(shared, reference-counted, never written again: writes only go to positions >= num_computed_tokens). Freed
blocks keep their digest and stay reusable until the free list hands them out again, oldest first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.request import Request


def block_digest(parent: bytes, token_ids: list[int]) -> bytes:
    # the ids' 8-byte encoding in one C-level copy (a per-token str() cost ~10 us a block, per step at batch 64)
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.ref_counts = [0] * num_blocks
        self.block_to_digest: dict[int, bytes] = {}
        self.digest_to_block: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _take(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        digest = self.block_to_digest.pop(block, None)
        if digest is not None:  # evict: its content is about to be overwritten
            del self.digest_to_block[digest]
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def reserve(self, count: int) -> list[int]:
        """Takes `count` blocks out of circulation for good (CUDA-graph padding rows write into them)."""
        blocks = [self._take() for _ in range(count)]
        self.num_blocks -= count  # usage and sizing see only what requests can use
        return blocks

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
        request.block_ids.extend(self._take() for _ in range(need))
        return True

    def match_prefix(self, request: Request) -> int:
        """For a request without KV: adopts the cached blocks of its leading full blocks and returns how many
        tokens they cover. At least the last known token is left to compute (its logits are needed)."""
        if not self.enable_prefix_caching or request.block_ids or request.num_computed_tokens:
            return 0
        tokens, parent, blocks = request.all_token_ids, b"", []
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            parent = block_digest(parent, tokens[start : start + self.block_size])
            block = self.digest_to_block.get(parent)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        request.block_ids = blocks
        request.block_digests = [self.block_to_digest[b] for b in blocks]
        request.num_computed_tokens = len(blocks) * self.block_size
        return request.num_computed_tokens

    def commit(self, request: Request) -> None:
        """Registers the digests of the request's blocks that just became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        # a stop inside a multi-token step leaves computed KV past the kept tokens: only kept tokens count
        computed = request.num_computed_tokens
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        num_full = (computed if computed < num_tokens else num_tokens) // self.block_size
        while len(request.block_digests) < num_full:  # usually no block fills this step: nothing to build
            i = len(request.block_digests)
            parent = request.block_digests[-1] if request.block_digests else b""
            digest = block_digest(parent, request.token_ids(i * self.block_size, (i + 1) * self.block_size))
            request.block_digests.append(digest)
            block = request.block_ids[i]
            if digest not in self.digest_to_block and block not in self.block_to_digest:
                self.digest_to_block[digest] = block
                self.block_to_digest[block] = digest

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the blocks beyond what `num_tokens` entries need (after a tree's rejected rows)."""
        keep = -(-num_tokens // self.block_size)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())

    def free(self, request: Request) -> None:
        for block in reversed(request.block_ids):  # tail blocks first: they are the least likely to be shared
            self._release(block)
        request.block_ids = []
        request.block_digests = []

    def slot(self, request: Request, index: int) -> int:
        """Cache slot of the request's logical KV position `index`."""
        return request.block_ids[index // self.block_size] * self.block_size + index % self.block_size
