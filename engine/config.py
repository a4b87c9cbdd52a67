"""Engine and speculative-decoding configuration: frozen dataclasses, validated on construction. Environment
variables are read here only (DDTREE_CACHE: where converted checkpoints are cached)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("DDTREE_CACHE", "~/.cache/ddtree"))


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "none"  # none | ngram | dflash | oracle
    budget: int = 16  # tree nodes per request per step (B); 0 = plain decoding
    draft_model: str | None = None  # DFlash checkpoint folder
    chain: bool = False  # DFlash chain mode: top-1 per depth, B = horizon

    def __post_init__(self):
        if self.drafter not in ("none", "ngram", "dflash", "oracle"):
            raise ValueError(f"unknown drafter {self.drafter!r} (choose none, ngram, dflash or oracle)")
        if not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"spec budget must be an integer >= 0, got {self.budget!r}")
        if self.drafter == "dflash" and not self.draft_model:
            raise ValueError("the dflash drafter needs --draft-model PATH")

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.budget > 0


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2-135M-Instruct
    dtype: str | None = None  # fp32 | bf16 | fp16; default fp32 on CPU, bf16 on CUDA
    device: str = "cpu"
    block_size: int = 16  # tokens per KV page
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    kv_cache_memory: int = 1 << 30  # bytes of KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 32768
    seed: int = 0
    enable_prefix_caching: bool = True
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
