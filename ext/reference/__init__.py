"""Pure-PyTorch reference of every op in `ext.ops` (fp32-exact; also the CPU implementation)."""
from ext.reference.attention import mla_paged_attention, paged_attention, write_kv
from ext.reference.compact import compaction_slots, kv_compact
from ext.reference.ngram import ngram_propose
from ext.reference.layers import fused_add_rmsnorm, gemm_skinny, gemv, rope_inplace, rope_write_kv, silu_and_mul, write_kv_pair
from ext.reference.quant import int4_dequantize, quantize_fp8_blockwise, w4a16_gemm
from ext.reference.sampling import sample_tokens, seeded_uniforms, top_k_top_p_floor
from ext.reference.tree import TreeBuild, build_tree, topk_logprobs, tree_accept

__all__ = ["paged_attention", "mla_paged_attention", "write_kv", "kv_compact", "compaction_slots",
           "TreeBuild", "build_tree", "topk_logprobs", "tree_accept", "sample_tokens", "top_k_top_p_floor",
           "seeded_uniforms", "fused_add_rmsnorm",
           "rope_inplace", "rope_write_kv", "silu_and_mul", "write_kv_pair", "quantize_fp8_blockwise",
           "w4a16_gemm", "int4_dequantize", "gemv", "gemm_skinny", "ngram_propose"]
