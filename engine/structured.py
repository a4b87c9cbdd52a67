"""Structured output in the engine: a request's grammar (engine/grammar.py) compiled against the model's
tokenizer into an llguidance matcher that follows the committed output; the token bitmask of its state for a
plain sampling row; and for DDTree the grammar-aware tree: best-first over the drafter's top-K like
ext.ops.build_tree, except that a node whose token the grammar forbids after its parent's path is skipped (its
sibling still enters the frontier), so the budget goes to legal continuations only, with the bitmask of every
row's path state for the sampler. A rejected path needs no undo: paths are consumed and rolled back while the
tree is built, and only accepted tokens are committed.

Bitmasks are llguidance's: int32 words, bit t of word t // 32 set when token t is allowed, over the model's
vocabulary (ids the tokenizer lacks are never allowed; EOS only when the grammar can end).
"""
from __future__ import annotations

import heapq
import json
import logging

import torch
from llguidance import LLMatcher, LLTokenizer

logger = logging.getLogger("ddtree.engine")


def grammar_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids) -> LLTokenizer:
    """The llguidance view of a fast HF tokenizer. Byte-level BPE tokenizers converted from GGUF carry their
    ByteLevel decoder inside a Sequence, which llguidance would not recognise (it would read 'Ġ' as a letter):
    the decoder is reduced to that ByteLevel step here."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence" and (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    spec["padding"] = spec["truncation"] = None
    return LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=list(eos_token_ids))


def allows(mask: bytes, token: int) -> bool:
    return bool((mask[token >> 3] >> (token & 7)) & 1)


class Constraint:
    """One request's grammar state. Raises ValueError (the request's 400) when the grammar does not compile."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, eos_token_ids=()):
        self.eos_token_ids = frozenset(eos_token_ids)  # end the output: a tree node holding one has no children
        self.matcher = LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"the grammar does not compile: {self.matcher.get_error()}")
        self._mask: bytes | None = None  # of the committed state

    def commit(self, token: int) -> bool:
        """Consumes a committed output token; False (and the matcher's error logged) if the grammar refuses it."""
        self._mask = None
        if self.matcher.is_stopped():  # only EOS was allowed; the request stops on it
            return True
        ok = self.matcher.consume_token(token)
        if not ok:
            logger.error("grammar refused committed token %d: %s", token, self.matcher.get_error())
        return ok

    def mask(self) -> bytes:
        """The bitmask after the committed output."""
        if self._mask is None:
            self._mask = self.matcher.compute_bitmask()
        return self._mask

    def path_mask(self, path: list[int]) -> bytes:
        """The bitmask after the committed output plus `path` (tokens the grammar allows, in order)."""
        if not path:
            return self.mask()
        if not self.matcher.consume_tokens(path):
            raise RuntimeError(f"grammar refused a draft path it had allowed: {self.matcher.get_error()}")
        try:
            return self.matcher.compute_bitmask()
        finally:
            self.matcher.rollback(len(path))


class ConstrainedTree:
    """One request's grammar-aware best-first tree (host lists, rows in pop order, row 0 = root)."""

    def __init__(self, logprobs: list[list[float]], token_ids: list[list[int]], budget: int,
                 constraint: Constraint, prune: bool = True):
        """logprobs / token_ids [L][K]: the drafter's top-K per depth, sorted descending. prune=False keeps the
        drafter's own tree: forbidden nodes (and everything under them) are verified but can never be accepted
        (bench/accept.py's comparison)."""
        depth_count, k = len(token_ids), len(token_ids[0]) if token_ids else 0
        self.tokens, self.parents, self.depths, self.scores = [-1], [-1], [0], [0.0]
        self.masks, paths = [constraint.mask()], [[]]
        dead = [False]  # a forbidden node kept when not pruning, or a node under one
        self.num_pruned = 0
        frontier = [(-logprobs[0][0], 0, 0, 0)] if depth_count and k else []  # (-score, depth - 1, rank, parent)
        while frontier and len(self.tokens) <= budget:
            neg, d, r, parent = heapq.heappop(frontier)
            score = -neg
            if r + 1 < k:  # the next sibling replaces this candidate in the frontier, legal or not
                heapq.heappush(frontier, (-(score - logprobs[d][r] + logprobs[d][r + 1]), d, r + 1, parent))
            token = token_ids[d][r]
            forbidden = dead[parent] or not allows(self.masks[parent], token)
            if forbidden and prune:
                self.num_pruned += 1
                continue
            dead.append(forbidden)
            path = paths[parent] + [token]
            row = len(self.tokens)
            # the output ends here (or cannot get here): nothing follows, any mask will do
            final = forbidden or token in constraint.eos_token_ids
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(d + 1)
            self.scores.append(score)
            self.masks.append(self.masks[parent] if final else constraint.path_mask(path))
            paths.append(path)
            if d + 1 < depth_count and (not final or forbidden):
                heapq.heappush(frontier, (-(score + logprobs[d + 1][0]), d + 1, 0, row))

    @property
    def num_nodes(self) -> int:
        """Rows holding the root or a drafted node."""
        return len(self.tokens)

    def write_into(self, tree, index: int) -> None:
        """Overwrites request `index` of a DraftTree (whose width is at least num_nodes) with this tree."""
        width, n = tree.num_rows, self.num_nodes
        device = tree.node_token_ids.device

        def padded(values: list, fill, dtype) -> torch.Tensor:
            return torch.tensor(values[:width] + [fill] * (width - min(n, width)), dtype=dtype)

        tree.node_token_ids[index, 1:] = padded(self.tokens, -1, torch.int64)[1:].to(device)  # row 0: the root
        tree.parents[index] = padded(self.parents, -1, torch.int64).to(device)
        tree.depths[index] = padded(self.depths, 0, torch.int64).to(device)
        tree.scores[index] = padded(self.scores, float("-inf"), torch.float64).to(device)
        tree.num_nodes[index] = min(n, width)
        vis = torch.eye(width, dtype=torch.bool)
        for row in range(1, min(n, width)):
            vis[row] |= vis[self.parents[row]]
        tree.visibility[index] = vis.to(device)

    def row_masks(self, width: int) -> list[bytes]:
        """The bitmask of each of `width` rows; padding rows repeat the root's (they are never accepted)."""
        return [self.masks[j] if j < len(self.masks) else self.masks[0] for j in range(width)]


def masks_tensor(masks: list[bytes], device) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 bitmasks on `device`."""
    flat = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32)
    return flat.view(len(masks), -1).to(device, non_blocking=True)


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with the rows `rows` [Rc] restricted to their bitmasks [Rc, W32] (-inf elsewhere)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    allowed = ((masks[:, :, None] >> shifts) & 1).reshape(masks.shape[0], -1)[:, :vocab].bool()  # [Rc, V]
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def step_grammar_masks(sampling: list, batch) -> tuple[list[int], list[bytes]]:
    """A step's sampled rows (numbered as the sampler sees them: plain rows, then every tree's rows; sampling:
    (request, row) per sampled plain row, batch: the step's speculative TreeBatch or None) whose request has a
    grammar, and the bitmask of each row's grammar state."""
    rows, masks = [], []
    for i, (req, _) in enumerate(sampling):
        if req.constraint is not None:
            rows.append(i)
            masks.append(req.constraint.mask())
    if batch is not None:
        width = batch.width
        for i, built in batch.constrained.items():
            first = len(sampling) + i * width
            rows.extend(range(first, first + width))
            masks.extend(built.row_masks(width))
    return rows, masks
