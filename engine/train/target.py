"""The frozen target during drafter training: the features of its chosen layers for padded batches of sequences
(our model's own forward with capture_layer_ids over a scratch paged KV cache, no grad), its embedding and its
lm_head weight; and the defaults that depend on the target (target layer ids, mask token id).

Mask token default (`default_mask_token_id`), first that applies:
  1. the model's vocabulary is larger than the tokenizer's: the first id past the tokenizer (no text encodes to
     it; z-lab's Qwen3 drafters use 151669 this way);
  2. the highest added special token that is not bos/eos/pad/unk and does not occur in the chat template (for
     SmolLM2-135M-Instruct: 16, `<empty_output>`, a StarCoder-era marker chat never uses);
  3. no tokenizer: the last id (as save_random_dflash).
The target's embedding of that id is what the mask slots carry; the drafter never proposes it (its logit is
removed), and training drops labels equal to it.
"""
from __future__ import annotations

import torch

from engine.speculative.dflash import build_target_layer_ids
from ext.metadata import build_metadata

MAX_FEATURE_LAYERS = 5  # the published drafters read 5 target layers (ddtree.md §1.2, §1.9)


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """Every layer of a target with at most 5, else 5 spread over [1, L-3] (z-lab's rule)."""
    if num_target_layers <= MAX_FEATURE_LAYERS:
        return list(range(num_target_layers))
    return build_target_layer_ids(num_target_layers, MAX_FEATURE_LAYERS)


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """See the module docstring."""
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [i for i, tok in added.items()
                  if i < vocab_size and i not in reserved and str(tok) not in template and getattr(tok, "special", True)]
    return max(candidates) if candidates else vocab_size - 1


class FrozenTarget:
    """Wraps a loaded target model (engine.model.base.CausalLM) for training: frozen, features without grad."""

    def __init__(self, model, layer_ids, page_size: int = 16, max_tokens_per_forward: int = 16384):
        self.model, self.layer_ids = model, tuple(int(i) for i in layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < model.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {list(self.layer_ids)} name layers outside the target's "
                             f"{model.num_layers}")
        for p in model.parameters():
            p.requires_grad_(False)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.page_size, self.max_tokens = page_size, max_tokens_per_forward
        self._caches: list[torch.Tensor] = []
        self._num_pages = 0

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.model.hidden_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H], no grad
        with torch.no_grad():
            return self.model.embed(ids)

    @property
    def head_weight(self) -> torch.Tensor:  # [V, H], the lm_head (tied: the embedding)
        m = self.model
        return m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight

    def _pages(self, num_pages: int) -> list[torch.Tensor]:
        if num_pages > self._num_pages:
            self._caches = []  # free the old ones first
            self._caches = [torch.empty(self.model.kv_cache_shape(i, num_pages, self.page_size), dtype=self.dtype,
                                        device=self.device) for i in range(self.model.num_layers)]
            self._num_pages = num_pages
        return self._caches

    def features(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """tokens [B, T] (padded), lengths [B] -> features [B, T, len(layer_ids) * H] in the target's dtype
        (outputs of the layers, concatenated in layer_ids order; zeros past each length)."""
        batch, width = tokens.shape
        out = torch.zeros(batch, width, self.feature_size, dtype=self.dtype, device=self.device)
        group: list[int] = []
        for b in range(batch):  # groups of whole sequences, at most max_tokens per forward (a single longer one alone)
            if group and sum(lengths[i] for i in group) + lengths[b] > self.max_tokens:
                self._forward(tokens, lengths, group, out)
                group = []
            group.append(b)
        if group:
            self._forward(tokens, lengths, group, out)
        return out

    def _forward(self, tokens: torch.Tensor, lengths: list[int], rows: list[int], out: torch.Tensor) -> None:
        ps = self.page_size
        pages = [-(-lengths[b] // ps) for b in rows]
        caches = self._pages(sum(pages))
        tables, positions, slots, first = [], [], [], 0
        for b, n in zip(rows, pages):
            table = list(range(first, first + n))
            tables.append(table)
            positions.extend(range(lengths[b]))
            slots.extend(first * ps + i for i in range(lengths[b]))  # the sequence's pages are contiguous
            first += n
        lens = [lengths[b] for b in rows]
        meta = build_metadata(positions, slots, lens, lens, tables, ps, device=self.device)
        ids = torch.cat([tokens[b, :lengths[b]] for b in rows]).to(self.device)  # [N]
        with torch.no_grad():
            _, captured = self.model(ids, meta, caches, capture_layer_ids=self.layer_ids)
        feats = torch.cat(captured, dim=-1)  # [N, F]
        start = 0
        for b in rows:
            out[b, :lengths[b]] = feats[start:start + lengths[b]]
            start += lengths[b]
