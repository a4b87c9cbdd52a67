"""Engine and speculative-decoding configuration: frozen dataclasses, validated on construction. Each field's
`metadata["help"]` is its user-facing description (the CLI builds its flags from it). Environment variables are
read here only (DDTREE_CACHE: where converted checkpoints and the built extension are cached;
DDTREE_TEST_FAULT_SEED: the test-only fault hook)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("DDTREE_CACHE", "~/.cache/ddtree"))


def test_fault_seed_from_env() -> int | None:
    value = os.environ.get("DDTREE_TEST_FAULT_SEED")
    return int(value) if value else None


def opt(default, help: str, *, factory=None, **kwargs):
    """A dataclass field with its help text (`factory` instead of a default for mutable values)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


DRAFTERS = ("none", "ngram", "dflash", "oracle")
CPU_KV_CACHE_MEMORY = 1 << 30  # bytes of KV cache on the CPU when --kv-cache-memory is not given
# --max-num-batched-tokens by device: a GPU prefills 8192 tokens in a few milliseconds (a burst of requests is
# admitted in a few steps instead of dozens of eager mixed steps); a CPU step that large would stall decoding
STEP_TOKENS_CUDA, STEP_TOKENS_CPU = 8192, 2048


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = opt("none", "drafter: none, ngram, dflash (--draft-model; the embedded model has one built in) "
                               "or oracle (tests)",
                       choices=DRAFTERS)
    budget: int = opt(16, "draft-tree nodes per request per step (B); 0 = plain decoding", flag="--spec-budget",
                      aliases=("--budget",))
    draft_model: str | None = opt(None, "DFlash drafter checkpoint folder")
    chain: bool = opt(False, "verify the drafter's top-1 chain instead of a tree (DFlash's own method)")
    adaptive: bool = opt(True, "choose each request's tree budget every step (0..--spec-budget) from its measured "
                               "acceptance and the measured cost of a verify row; --no-adaptive always verifies "
                               "--spec-budget nodes")
    guard: bool = opt(True, "check the adaptive budget's trees against measured plain decoding: now and then a few "
                            "plain steps, and trees that lose to them stay off for a while; --no-spec-guard trusts "
                            "the cost model alone", flag="--spec-guard")
    grammar_pruning: bool = opt(True, "structured output: drop draft-tree candidates the request's grammar "
                                      "forbids before verification; --no-grammar-pruning verifies them anyway "
                                      "(they are never accepted; for comparison)")

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r} (choose none, ngram, dflash or oracle)")
        if not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"spec budget must be an integer >= 0, got {self.budget!r}")

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.budget > 0


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = opt(None, "HF checkpoint folder or .gguf file (default: the embedded "
                                  "SmolLM2-135M-Instruct)", positional=True)
    dtype: str | None = opt(None, "fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA)",
                            choices=("fp32", "bf16", "fp16"))
    device: str = opt("cpu", "cpu, cuda or cuda:N")
    load_format: str = opt("auto", "auto (read the checkpoint's weights) or dummy (random weights of the "
                                   "checkpoint's shapes, for benchmarks)", choices=("auto", "dummy"))
    block_size: int = opt(16, "tokens per KV-cache page")
    num_kv_blocks: int | None = opt(None, "KV-cache pages (overrides every memory-based sizing)")
    kv_cache_memory: int | None = opt(None, "bytes of KV cache, e.g. 4G (default: sized from "
                                            "--gpu-memory-utilization on CUDA, 1 GiB on CPU)", kind="bytes")
    gpu_memory_utilization: float = opt(0.90, "fraction of the GPU's memory this engine may use: weights, "
                                              "activations and the KV cache, which takes what remains")
    max_num_seqs: int = opt(64, "requests running in the engine at once")
    admission_wait_steps: int = opt(0, "a waiting request takes a free seat only once a seat has been free this "
                                       "many steps (or nothing runs), so seats freed a few steps apart are filled "
                                       "by one admission step (on CUDA its prompts' pieces replay beside the "
                                       "decoding step); 0 = at once")
    admission_decode_rows: int = opt(256, "under CUDA graphs: an admission step may run its prompt chunks as "
                                          "one-row requests beside its decoding requests, up to this many rows "
                                          "past --max-num-seqs, in one plain-decoding graph replay (those graphs "
                                          "are captured too); 0 = off: each chunk replays a prompt graph of its "
                                          "own beside the decoders' replay")
    max_num_batched_tokens: int | None = opt(None, "token budget of one engine step (prefill chunks + decodes + "
                                                   "tree rows; default: 8192 on CUDA, as vLLM's server, 2048 on "
                                                   "CPU)")
    max_model_len: int | None = opt(None, "context length (default: the model's max_position_embeddings, "
                                          "capped at 32768)")
    tensor_parallel_size: int = opt(1, "ranks the model is split across (one process per rank; on CUDA rank r "
                                       "runs on cuda:r; gloo on CPU, NCCL on CUDA)")
    seed: int = opt(0, "seed for requests that do not set one")
    enable_prefix_caching: bool = opt(True, "reuse the KV of shared prompt prefixes")
    enforce_eager: bool = opt(False, "run every step eagerly: no CUDA graphs (they are captured at startup on "
                                     "CUDA for decode-only steps)")
    async_scheduling: bool = opt(True, "on CUDA, launch a plain decoding step before the previous step's "
                                       "results reach the host, so the host's bookkeeping overlaps the GPU's "
                                       "work (steps with trees, grammars or penalties wait for their results)")
    dense_prefill_min_tokens: int = opt(2048, "on CUDA, prefill chunks of at least this many tokens (and the "
                                              "whole prompts after them in the step) attend through torch's fused "
                                              "attention instead of the paged kernel: whole prompts through cuDNN, "
                                              "chunks after cached context through FlashAttention (1.2-1.5x "
                                              "shorter time to first token at 2k-32k tokens on the H200); 0 = off")
    reference_kernels: bool = opt(False, "on CUDA, run ext's PyTorch references when the CUDA extension cannot "
                                         "be loaded (slow; for debugging) instead of failing at startup")
    spec: SpecConfig = opt(None, "speculative decoding", factory=SpecConfig, cli=False)
    # test-only: a request whose sampling seed equals this fails inside its sampling step (fault isolation
    # tests); set through DDTREE_TEST_FAULT_SEED, never a flag
    test_fault_seed: int | None = field(default_factory=test_fault_seed_from_env, metadata={"cli": False})

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.dense_prefill_min_tokens < 0:
            raise ValueError(f"dense_prefill_min_tokens must be >= 0 (0 = off), got {self.dense_prefill_min_tokens}")
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", STEP_TOKENS_CUDA if self.is_cuda else STEP_TOKENS_CPU)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.admission_decode_rows < 0:
            raise ValueError(f"admission_decode_rows must be >= 0 (0 = off), got {self.admission_decode_rows}")
        if self.admission_wait_steps < 0:
            raise ValueError(f"admission_wait_steps must be >= 0 (0 = at once), got {self.admission_wait_steps}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.spec.drafter == "dflash" and not self.spec.draft_model:
            if self.model is not None:
                raise ValueError("the dflash drafter needs --draft-model PATH (a drafter ships only for the "
                                 "embedded SmolLM2-135M-Instruct)")
            from engine.drafters import shipped_drafter_dir

            object.__setattr__(self, "spec", replace(self.spec, draft_model=shipped_drafter_dir()))

    @property
    def is_cuda(self) -> bool:
        return str(self.device).startswith("cuda")
