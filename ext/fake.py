"""Fake (meta) implementations of the ddtree CUDA ops, so torch.compile can trace them and shapes are known
without running a kernel. Output shapes depend only on input shapes and int arguments (no data)."""
from __future__ import annotations

import torch

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    fake = torch.library.register_fake

    @fake("ddtree::write_kv")
    def _(cache, rows, slot_mapping):
        return None

    @fake("ddtree::paged_attention")
    def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, tree_bits, max_query_len, max_seq_len, scale):
        return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))

    @fake("ddtree::mla_paged_attention")
    def _(q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_tables, tree_bits, max_query_len,
          max_seq_len, scale):
        return q_latent.new_empty(q_latent.shape)

    @fake("ddtree::topk_logprobs")
    def _(logits, k):
        n, l, v = logits.shape
        k = max(0, min(k, v))
        return (logits.new_empty((n, l, k), dtype=torch.float32), logits.new_empty((n, l, k), dtype=torch.int64))

    @fake("ddtree::build_tree")
    def _(draft_logprobs, draft_token_ids, budgets, max_budget):
        n, rows = draft_logprobs.shape[0], max_budget + 1
        i64 = dict(dtype=torch.int64)
        return (draft_logprobs.new_empty((n, rows), **i64), draft_logprobs.new_empty((n, rows), **i64),
                draft_logprobs.new_empty((n, rows), **i64), draft_logprobs.new_empty((n,), **i64),
                draft_logprobs.new_empty((n, rows, rows), dtype=torch.bool),
                draft_logprobs.new_empty((n, rows), dtype=torch.float64), draft_logprobs.new_empty((n, rows), **i64))

    @fake("ddtree::tree_accept")
    def _(target_token_ids, node_token_ids, parents, num_nodes, max_depth):
        n = node_token_ids.shape[0]
        return (node_token_ids.new_empty((n, max_depth + 1)), node_token_ids.new_empty((n,)),
                node_token_ids.new_empty((n, max_depth + 1)))

    @fake("ddtree::kv_compact")
    def _(caches, src_slots, dst_slots):
        return None

    @fake("ddtree::kv_compact_tree")
    def _(caches, accepted_nodes, tree_slots):
        return None

    @fake("ddtree::sample_tokens")
    def _(logits, temperature, min_p, uniform):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @fake("ddtree::seeded_uniforms")
    def _(seeds, indices):
        return seeds.new_empty(seeds.shape, dtype=torch.float64)

    @fake("ddtree::top_k_top_p_floor")
    def _(logits, top_k, top_p):
        return logits.new_empty((logits.shape[0],), dtype=torch.float32)

    @fake("ddtree::ngram_propose")
    def _(history, rows, root_positions, emitted, num_new, calibration, horizon, top_k, vocab_size, max_ngram,
          max_matches, backoff, recency, cal_prior):
        n = rows.shape[0]
        return (history.new_empty((n, horizon, top_k), dtype=torch.float32),
                history.new_empty((n, horizon, top_k), dtype=torch.int64),
                history.new_empty((n, 1 + 2 * horizon), dtype=torch.int64))

    @fake("ddtree::pack_tree_mask")
    def _(tree_mask):
        return tree_mask.new_empty((tree_mask.shape[0], (tree_mask.shape[1] + 63) // 64), dtype=torch.int64)

    @fake("ddtree::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))

    @fake("ddtree::fused_add_rmsnorm")
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape)

    @fake("ddtree::rope_inplace")
    def _(q, k, cos, sin):
        return None

    @fake("ddtree::rope_write_kv")
    def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return None

    @fake("ddtree::qk_norm_rope_write_kv")
    def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps):
        return None

    @fake("ddtree::silu_and_mul")
    def _(x):
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    def few_rows_product(x, weight, bias, silu_mul):
        return x.new_empty((x.shape[0], weight.shape[0] // 2 if silu_mul else weight.shape[0]))

    fake("ddtree::gemv")(few_rows_product)
    fake("ddtree::gemm_skinny")(few_rows_product)

    @fake("ddtree::quantize_fp8_blockwise")
    def _(x, padded_rows, amax_floor):
        cols = x.shape[1]
        return (x.new_empty((padded_rows, cols), dtype=torch.float8_e4m3fn),
                x.new_empty((cols // 128, padded_rows), dtype=torch.float32))

    @fake("ddtree::w4a16_gemm")
    def _(x, packed, scale, group_size):
        return x.new_empty((x.shape[0], packed.shape[0]))

    @fake("ddtree::int4_dequantize")
    def _(packed, scale, group_size, dtype):
        return packed.new_empty((packed.shape[0], packed.shape[1] * 8), dtype=dtype)

    @fake("ddtree::write_kv_pair")
    def _(k_cache, v_cache, k, v, slot_mapping):
        return None
