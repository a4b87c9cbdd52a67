"""Pure-PyTorch reference for KV compaction after a DDTree accept, and its slot math.

The verify pass writes the K/V of tree row j of request n into cache slot tree_slots[n, j].
After the walk, accepted row accepted_nodes[n, j] must live at tree_slots[n, j], so the
accepted path becomes a contiguous continuation of the request's sequence. Slots are flat
row indices of a slot-major cache view [num_slots, ...] (for a paged cache
[num_blocks, page_size, ...], slot = block * page_size + offset), so page_size > 1 just means
that a request's slot list jumps between blocks.
"""

import torch
from torch import Tensor

__all__ = ["kv_compact", "compaction_slots", "tree_slots_from_block_table"]


def kv_compact(caches: list[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """In place, for every cache [num_slots, ...]: cache[dst_slots[m]] = old cache[src_slots[m]].

    src_slots, dst_slots: [M] int64. All sources are gathered before any destination is
    written, so overlapping source and destination ranges are safe in any order. Pairs with
    src == dst are harmless (that is how fixed-shape callers pad). dst_slots must be distinct.
    """
    for cache in caches:
        rows = cache.index_select(0, src_slots)  # [M, ...], read everything before writing
        cache.index_copy_(0, dst_slots, rows)


def compaction_slots(accepted_nodes: Tensor, tree_slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Copy pairs that move each request's accepted rows into place, padded to a fixed shape.

    accepted_nodes [N, A] int64 from tree_accept (root first, -1 padded); tree_slots [N, B+1]
    int64, distinct slots. Returns:
      src_slots [N * A'] int64 and dst_slots [N * A'] int64, with A' = min(A, B+1): pair (n, j)
        copies tree_slots[n, accepted_nodes[n, j]] to tree_slots[n, j]; padding entries
        (accepted_nodes == -1) become src == dst no-ops;
      is_noop [N] bool: True where accepted_nodes is 0, 1, 2, ... (the spine in pop order), so
        the request needs no copy. Computed on the device; nothing here syncs with the host.
    """
    num_pairs = min(accepted_nodes.shape[1], tree_slots.shape[1])
    accepted = accepted_nodes[:, :num_pairs]  # [N, A']
    dst_rows = torch.arange(num_pairs, device=accepted.device).expand_as(accepted)  # [N, A']
    src_rows = torch.where(accepted >= 0, accepted, dst_rows)
    src_slots = tree_slots.gather(1, src_rows)
    dst_slots = tree_slots[:, :num_pairs]
    is_noop = (src_rows == dst_rows).all(-1)
    return src_slots.reshape(-1), dst_slots.reshape(-1), is_noop


def tree_slots_from_block_table(
    block_table: Tensor, start_positions: Tensor, num_rows: int, page_size: int
) -> Tensor:
    """[N, num_rows] slots of logical positions start .. start+num_rows-1 of each request.

    block_table [N, max_blocks] int64 maps a request's logical page to a physical block;
    start_positions [N] int64 is where the tree's row 0 (the root) is written.
    """
    positions = start_positions[:, None] + torch.arange(num_rows, device=block_table.device)
    blocks = block_table.gather(1, positions // page_size)  # [N, num_rows]
    return blocks * page_size + positions % page_size
