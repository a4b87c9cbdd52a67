"""The drafter protocol of DDTree: from each request's committed state a drafter returns, for depths 1..L
after the root (the last committed token, not yet seen by the target), the top-K log-probs and token ids that
the tree builder (ext.ops.build_tree) expands best-first.

Contract of every `propose` result ([N, L, K] float32 log-probs, [N, L, K] int64 ids):
  - each row (request, depth) holds K distinct token ids, sorted by log-prob descending, all finite;
  - a drafter with fewer real candidates pads with other tokens at least PAD_GAP below its last real one;
  - excluded ids (the DFlash mask token) never appear; token id 0 is an ordinary token;
  - K = min(top_k, number of proposable tokens), which is top_k for any real vocabulary.

Drafters: "ngram" (engine.speculative.ngram, no weights; on CUDA engine.speculative.ngram_device, the same rule
drafted on the device), "dflash" (engine.speculative.dflash, a z-lab DFlash checkpoint),
"oracle" (engine.speculative.oracle, golden continuations, for tests).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ext.reference.candidates import PAD_GAP, pack_candidates, proposal_width  # noqa: F401 (the contract's)


@dataclass
class DraftRequest:
    request_id: str
    # all committed tokens (prompt + output: a list, or the request's TokenView); the LAST one is the root/bonus
    # token, which the target has not processed yet; its position is len(token_ids) - 1
    token_ids: Sequence[int]
    # [num_new, len(target_layer_ids) * hidden] target features (outputs of decoder layers target_layer_ids,
    # concatenated in that order) of the committed tokens the drafter has not seen yet, i.e. positions
    # drafter_context_len .. len(token_ids) - 2; None for drafters that need no features
    new_hidden: torch.Tensor | None = None

    @property
    def root_position(self) -> int:
        return len(self.token_ids) - 1


@runtime_checkable
class Drafter(Protocol):
    horizon: int  # L: depths proposed per call
    target_layer_ids: tuple[int, ...]  # () when no target features are needed

    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, L, K] f32 log-probs sorted descending per depth, [N, L, K] int64 token ids)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget per-request state (finish, abort, preempt)."""
        ...

    # Optional: request_specific = True when a drafter's confidence comes from the request's own text alone (the
    # n-gram rule), so another request's tree says nothing about this one's (BudgetController.borrow).
    # Optional, for tree steps launched before the previous tree step's results reach the host (engine.core):
    # propose_ahead(batch, top_k, root_ids, root_positions, num_new, feats=None, emitted_ids=None) drafts from
    # roots [N] and root positions [N] on the device (num_new [N]: tokens the previous step accepted, its bonus
    # included; emitted_ids [N, A]: those tokens, -1 padded; feats [N, A, F]: their target features, padded, for
    # drafters with target_layer_ids); `batch` holds the host state as of before that step. A drafter with
    # target features also has confirm_ahead(request_id, num_rows), called once the previous step's results arrive.


def make_drafter(
    spec,  # engine.config.SpecConfig (or anything with .drafter, .budget, .draft_model)
    target_model,  # engine.model.base.CausalLM
    vocab_size: int,
    *,
    horizon: int | None = None,  # ngram / oracle depths per call (default 8); DFlash's is block_size - 1
    oracle: Mapping[str, Sequence[int]] | Callable[[DraftRequest], Sequence[int] | None] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Drafter | None:
    """The drafter `spec` names, or None when speculation is off. Every problem is a one-line ValueError."""
    name = getattr(spec, "drafter", None)
    if name not in ("none", "ngram", "dflash", "oracle"):
        raise ValueError(f"unknown drafter {name!r} (choose none, ngram, dflash or oracle)")
    if name == "none" or getattr(spec, "budget", 1) <= 0:
        return None
    if horizon is not None and horizon < 1:
        raise ValueError(f"drafter horizon must be >= 1, got {horizon}")
    param = next(target_model.parameters(), None) if target_model is not None else None
    if device is None:
        device = param.device if param is not None else "cpu"
    if name == "ngram":
        if torch.device(device).type == "cuda":  # drafts on the device, so tree steps can be drafted ahead
            from engine.speculative.ngram_device import DeviceNgramDrafter

            return DeviceNgramDrafter(vocab_size, horizon=horizon or 8, device=device)
        from engine.speculative.ngram import NgramDrafter

        return NgramDrafter(vocab_size, horizon=horizon or 8, device=device)
    if name == "oracle":
        from engine.speculative.oracle import OracleDrafter

        if oracle is None:
            raise ValueError("the oracle drafter needs golden continuations (make_drafter(..., oracle=...))")
        return OracleDrafter(oracle, vocab_size, horizon=horizon or 8, device=device)
    from engine.speculative.dflash import load_dflash

    if not getattr(spec, "draft_model", None):
        raise ValueError("the dflash drafter needs --draft-model PATH")
    return load_dflash(spec.draft_model, target_model, vocab_size, device=device,
                       dtype=dtype or (param.dtype if param is not None else torch.float32))
