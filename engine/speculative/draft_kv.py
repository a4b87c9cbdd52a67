"""The DFlash drafter's draft KV: every request's context K/V (and, during a call, its block's) for all draft
layers, in pages of the layout the target's paged cache has, so one paged-attention launch a layer serves a whole
batch (engine/speculative/dflash.py)."""
from __future__ import annotations

import torch

PAGE_TOKENS = 16  # slots per page


class DraftKVPool:
    """Every request's draft K/V for all layers in pages of PAGE_TOKENS slots ([layers, pages, page, n_kv, hd]
    for K and V, each layer's slice the layout ext.ops.paged_attention reads), pages handed out per request as its
    context and block grow and given back on release; the pool doubles when it runs out (eager steps only)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 num_pages: int = 64):
        self.k = torch.zeros((num_layers, num_pages, PAGE_TOKENS, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: lowest page first
        self.pages: dict[str, list[int]] = {}
        self.on_grow = lambda: None  # called before the tensors are replaced (CUDA graphs hold the old ones)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def reserve(self, request_id: str, num_slots: int) -> list[int]:
        """The request's pages, extended to hold logical slots 0..num_slots-1."""
        pages = self.pages.setdefault(request_id, [])
        need = -(-num_slots // PAGE_TOKENS) - len(pages)
        if need > len(self.free):
            self._grow(need - len(self.free))
        pages.extend(self.free.pop() for _ in range(max(need, 0)))
        return pages

    def slots(self, request_id: str, start: int, count: int) -> list[int]:
        """Pool slots of the request's logical positions start..start+count-1 (reserved)."""
        pages = self.pages[request_id]
        return [pages[p // PAGE_TOKENS] * PAGE_TOKENS + p % PAGE_TOKENS for p in range(start, start + count)]

    def release(self, request_id: str) -> None:
        self.free.extend(reversed(self.pages.pop(request_id, [])))

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def ensure_pages(self, num_pages: int) -> None:
        """At least num_pages pages in all (the engine sizes the pool once at startup)."""
        if num_pages > self.num_pages:
            self._grow(num_pages - self.num_pages, exact=True)

    def _grow(self, at_least: int, exact: bool = False) -> None:
        old = self.k.shape[1]
        new = old + at_least if exact else max(2 * old, old + at_least)
        self.on_grow()
        for name in ("k", "v"):
            cur = getattr(self, name)
            grown = cur.new_zeros((cur.shape[0], new, *cur.shape[2:]))
            grown[:, :old] = cur
            setattr(self, name, grown)
        self.free[:0] = range(new - 1, old - 1, -1)  # the new pages are handed out after the free old ones
