// The torch side of the extension: the attention, tree and cache ops' schemas (the TORCH_LIBRARY block; the
// decoder-layer ops add theirs in ops_layers.cpp, the sampling ops in ops_sampling.cpp), input checks, output and workspace allocation, and the
// launch on the current CUDA stream. No op synchronizes with the host, so all of them can be captured in CUDA
// graphs; shapes depend only on arguments (fake kernels: ext/fake.py).
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops_common.h"

namespace {

using at::Tensor;
using namespace ddtree_ops;

void write_kv(Tensor cache, Tensor rows, Tensor slot_mapping) {
  CHECK_CUDA(cache); CHECK_CUDA(rows); CHECK_CUDA(slot_mapping);
  CHECK_TYPE(slot_mapping, at::kLong);
  TORCH_CHECK(cache.dim() >= 2 && cache.is_contiguous(), "ddtree::write_kv: cache must be contiguous [blocks, block_size, ...]");
  const int64_t T = rows.size(0);
  TORCH_CHECK(slot_mapping.numel() == T, "ddtree::write_kv: one slot per row");
  const int64_t slots = cache.size(0) * cache.size(1);
  const int64_t elems = slots == 0 ? 0 : cache.numel() / slots;
  TORCH_CHECK(rows.numel() == T * elems, "ddtree::write_kv: row shape does not match the cache row");
  if (T == 0) return;
  c10::cuda::CUDAGuard guard(cache.device());
  Tensor r = rows.reshape({T, elems});
  if (elems > 0 && r.stride(1) != 1) r = r.contiguous();
  Tensor sm = slot_mapping.contiguous();
  check(ddtree::write_kv(cache.data_ptr(), dtype_of(cache), r.data_ptr(), dtype_of(r), r.stride(0), sm.data_ptr<int64_t>(),
                         static_cast<int>(T), elems, stream()), "write_kv");
}

void check_metadata(const Tensor& qsl, const Tensor& seq_lens, const Tensor& block_tables, const std::optional<Tensor>& tree_bits,
                    int64_t num_tokens) {
  CHECK_CUDA(qsl); CHECK_CUDA(seq_lens); CHECK_CUDA(block_tables);
  CHECK_TYPE(qsl, at::kInt); CHECK_TYPE(seq_lens, at::kInt); CHECK_TYPE(block_tables, at::kInt);
  TORCH_CHECK(qsl.is_contiguous() && seq_lens.is_contiguous() && qsl.numel() == seq_lens.numel() + 1,
              "ddtree: query_start_loc [num_seqs + 1] and seq_lens [num_seqs] must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.numel() && block_tables.stride(1) == 1,
              "ddtree: block_tables must be [num_seqs, max_blocks] with unit column stride");
  if (tree_bits.has_value()) {
    CHECK_CUDA(*tree_bits); CHECK_TYPE(*tree_bits, at::kLong);
    TORCH_CHECK(tree_bits->dim() == 2 && tree_bits->size(0) == num_tokens && tree_bits->is_contiguous(),
                "ddtree: tree_bits must be contiguous [num_tokens, words]");
  }
}

void fill_metadata(ddtree::AttnParams& p, const Tensor& qsl, const Tensor& seq_lens, const Tensor& block_tables,
                   const std::optional<Tensor>& tree_bits) {
  p.query_start_loc = qsl.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.block_tables = block_tables.data_ptr<int>();
  p.bt_stride = block_tables.stride(0);
  p.num_seqs = static_cast<int>(seq_lens.numel());
  p.tree_bits = tree_bits.has_value() ? reinterpret_cast<const uint64_t*>(tree_bits->data_ptr<int64_t>()) : nullptr;
  p.tree_words = tree_bits.has_value() ? static_cast<int>(tree_bits->size(1)) : 0;
}

// The schedule of an attention launch on the current device (its SM count, clusters, warpgroup tiles): what
// run_attention launches and attention_plan reports.
ddtree::AttnPlan device_plan(ddtree::DType dt, int dk, int dv, int qa_dim, bool shared_kv, bool aligned, int group,
                             int num_seqs, int num_kv_heads, int64_t max_query_len, int64_t max_seq_len) {
  return ddtree::attn_plan(dt, dk, dv, qa_dim, shared_kv, aligned, group, num_seqs, num_kv_heads,
                           static_cast<int>(max_query_len), static_cast<int>(max_seq_len), num_sms(),
                           compute_major() >= 9, wgmma_enabled());
}

Tensor run_attention(ddtree::AttnParams& p, const Tensor& out, ddtree::DType dt, bool shared_kv, bool aligned,
                     int64_t max_query_len, int64_t max_seq_len) {
  const ddtree::AttnPlan plan = device_plan(dt, p.dk, p.dv, p.qa_dim, shared_kv, aligned, p.group, p.num_seqs,
                                            p.num_kv_heads, max_query_len, max_seq_len);
  Tensor o_part, lse_part;
  if (plan.kind != 0 && plan.num_splits > 1 && !plan.cluster_combine) {
    o_part = at::empty({plan.num_splits, p.num_tokens, p.num_q_heads, p.dv}, out.options().dtype(at::kFloat));
    lse_part = at::empty({plan.num_splits, p.num_tokens, p.num_q_heads}, out.options().dtype(at::kFloat));
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
  }
  p.pdl = pdl_enabled();
  check(ddtree::attn_launch(p, plan, dt, stream()), "paged_attention");
  return out;
}

Tensor paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor qsl, Tensor seq_lens, Tensor block_tables,
                       std::optional<Tensor> tree_bits, int64_t max_query_len, int64_t max_seq_len, double scale) {
  CHECK_CUDA(q); CHECK_CUDA(k_cache); CHECK_CUDA(v_cache);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "ddtree::paged_attention: q [T, H, D], caches [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "ddtree::paged_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "ddtree: last dims must be contiguous");
  TORCH_CHECK(k_cache.stride(0) == k_cache.size(1) * k_cache.stride(1) && v_cache.stride(0) == v_cache.size(1) * v_cache.stride(1),
              "ddtree::paged_attention: caches must be slot-major (block stride = block_size * slot stride)");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3) && k_cache.size(3) == q.size(2),
              "ddtree::paged_attention: cache shapes do not match q");
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "ddtree::paged_attention: num_heads must be a multiple of num_kv_heads");
  check_metadata(qsl, seq_lens, block_tables, tree_bits, T);
  c10::cuda::CUDAGuard guard(q.device());
  Tensor out = at::empty({T, Hq, v_cache.size(3)}, q.options());
  ddtree::AttnParams p{};
  p.q_a = q.data_ptr(); p.q_b = nullptr;
  p.qa_stride_t = q.stride(0); p.qa_stride_h = q.stride(1); p.qa_dim = static_cast<int>(q.size(2));
  p.k = k_cache.data_ptr(); p.v = v_cache.data_ptr();
  p.k_stride_slot = k_cache.stride(1); p.k_stride_head = k_cache.stride(2);
  p.v_stride_slot = v_cache.stride(1); p.v_stride_head = v_cache.stride(2);
  p.out = out.data_ptr(); p.o_stride_t = out.stride(0); p.o_stride_h = out.stride(1);
  fill_metadata(p, qsl, seq_lens, block_tables, tree_bits);
  p.num_tokens = static_cast<int>(T); p.num_q_heads = static_cast<int>(Hq); p.num_kv_heads = static_cast<int>(Hkv);
  p.group = static_cast<int>(Hq / Hkv); p.block_size = static_cast<int>(k_cache.size(1));
  p.dk = static_cast<int>(q.size(2)); p.dv = static_cast<int>(v_cache.size(3));
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const bool aligned = aligned16(q) && aligned16(k_cache) && aligned16(v_cache) && q.stride(0) % 8 == 0 &&
                       q.stride(1) % 8 == 0 && k_cache.stride(1) % 8 == 0 && k_cache.stride(2) % 8 == 0 &&
                       v_cache.stride(1) % 8 == 0 && v_cache.stride(2) % 8 == 0;
  if (T == 0) return out;
  return run_attention(p, out, dtype_of(q), false, aligned, max_query_len, max_seq_len);
}

Tensor mla_paged_attention(Tensor q_latent, Tensor q_rope, Tensor latent_cache, Tensor qsl, Tensor seq_lens,
                           Tensor block_tables, std::optional<Tensor> tree_bits, int64_t max_query_len,
                           int64_t max_seq_len, double scale) {
  CHECK_CUDA(q_latent); CHECK_CUDA(q_rope); CHECK_CUDA(latent_cache);
  TORCH_CHECK(q_latent.dim() == 3 && q_rope.dim() == 3 && latent_cache.dim() == 3,
              "ddtree::mla_paged_attention: q_latent [T, H, C], q_rope [T, H, R], cache [blocks, block_size, C + R]");
  const int64_t T = q_latent.size(0), H = q_latent.size(1), C = q_latent.size(2), R = q_rope.size(2);
  TORCH_CHECK(q_rope.size(0) == T && q_rope.size(1) == H && latent_cache.size(2) == C + R,
              "ddtree::mla_paged_attention: shapes do not match");
  TORCH_CHECK(q_rope.scalar_type() == q_latent.scalar_type() && latent_cache.scalar_type() == q_latent.scalar_type(),
              "ddtree::mla_paged_attention: q and the cache must share a dtype");
  TORCH_CHECK(q_latent.stride(2) == 1 && q_rope.stride(2) == 1 && latent_cache.stride(2) == 1 &&
              latent_cache.stride(0) == latent_cache.size(1) * latent_cache.stride(1),
              "ddtree::mla_paged_attention: last dims contiguous and a slot-major cache required");
  check_metadata(qsl, seq_lens, block_tables, tree_bits, T);
  c10::cuda::CUDAGuard guard(q_latent.device());
  Tensor out = at::empty({T, H, C}, q_latent.options());
  ddtree::AttnParams p{};
  p.q_a = q_latent.data_ptr(); p.q_b = q_rope.data_ptr();
  p.qa_stride_t = q_latent.stride(0); p.qa_stride_h = q_latent.stride(1);
  p.qb_stride_t = q_rope.stride(0); p.qb_stride_h = q_rope.stride(1);
  p.qa_dim = static_cast<int>(C);
  p.k = latent_cache.data_ptr(); p.v = latent_cache.data_ptr();
  p.k_stride_slot = latent_cache.stride(1); p.k_stride_head = 0;
  p.v_stride_slot = latent_cache.stride(1); p.v_stride_head = 0;
  p.out = out.data_ptr(); p.o_stride_t = out.stride(0); p.o_stride_h = out.stride(1);
  fill_metadata(p, qsl, seq_lens, block_tables, tree_bits);
  p.num_tokens = static_cast<int>(T); p.num_q_heads = static_cast<int>(H); p.num_kv_heads = 1;
  p.group = static_cast<int>(H); p.block_size = static_cast<int>(latent_cache.size(1));
  p.dk = static_cast<int>(C + R); p.dv = static_cast<int>(C);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const bool aligned = aligned16(q_latent) && aligned16(q_rope) && aligned16(latent_cache) && q_latent.stride(0) % 8 == 0 &&
                       q_latent.stride(1) % 8 == 0 && q_rope.stride(0) % 8 == 0 && q_rope.stride(1) % 8 == 0 &&
                       latent_cache.stride(1) % 8 == 0;
  if (T == 0) return out;
  return run_attention(p, out, dtype_of(q_latent), true, aligned, max_query_len, max_seq_len);
}

std::tuple<Tensor, Tensor> topk_logprobs(Tensor logits, int64_t k) {
  CHECK_CUDA(logits);
  TORCH_CHECK(logits.dim() == 3, "ddtree::topk_logprobs: logits must be [N, L, V]");
  const int64_t N = logits.size(0), L = logits.size(1), V = logits.size(2);
  const int64_t K = std::max<int64_t>(0, std::min<int64_t>(k, V));
  TORCH_CHECK(K <= ddtree::kTopkMaxK, "ddtree::topk_logprobs: k above ", ddtree::kTopkMaxK);
  TORCH_CHECK(V < (1ll << 31), "ddtree::topk_logprobs: vocabulary too large");
  c10::cuda::CUDAGuard guard(logits.device());
  Tensor x = logits.contiguous();
  Tensor lp = at::empty({N, L, K}, logits.options().dtype(at::kFloat));
  Tensor ids = at::empty({N, L, K}, logits.options().dtype(at::kLong));
  const int rows = static_cast<int>(N * L);
  if (rows == 0 || K == 0) return {lp, ids};
  const int chunks = ddtree::topk_num_chunks(rows, static_cast<int>(V), static_cast<int>(K), num_sms());
  const size_t ws_bytes = ddtree::topk_workspace_bytes(rows, static_cast<int>(K), chunks);
  Tensor ws = at::empty({static_cast<int64_t>(ws_bytes > 0 ? ws_bytes : 1)}, logits.options().dtype(at::kByte));
  check(ddtree::topk_logprobs(x.data_ptr(), dtype_of(x), rows, static_cast<int>(V), static_cast<int>(K), chunks,
                              ws.data_ptr(), lp.data_ptr<float>(), ids.data_ptr<int64_t>(), stream()), "topk_logprobs");
  return {lp, ids};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tree(Tensor lp, Tensor ids, Tensor budgets,
                                                                              int64_t max_budget) {
  CHECK_CUDA(lp); CHECK_CUDA(ids); CHECK_CUDA(budgets);
  CHECK_TYPE(lp, at::kFloat); CHECK_TYPE(ids, at::kLong); CHECK_TYPE(budgets, at::kLong);
  TORCH_CHECK(lp.dim() == 3 && ids.sizes() == lp.sizes() && budgets.numel() == lp.size(0),
              "ddtree::build_tree: logprobs/token_ids [N, L, K], budgets [N]");
  TORCH_CHECK(max_budget >= 0 && max_budget < 65535, "ddtree::build_tree: max_budget out of range");
  const int64_t N = lp.size(0), L = lp.size(1), K = lp.size(2), F = max_budget + 1;
  const size_t smem = ddtree::build_tree_smem_bytes(static_cast<int>(L), static_cast<int>(K), static_cast<int>(max_budget));
  TORCH_CHECK(smem <= 227 * 1024, "ddtree::build_tree: tree state does not fit in shared memory");
  c10::cuda::CUDAGuard guard(lp.device());
  Tensor lpc = lp.contiguous(), idc = ids.contiguous(), bc = budgets.contiguous();
  auto opt = lp.options();
  Tensor tokens = at::empty({N, F}, opt.dtype(at::kLong)), parents = at::empty({N, F}, opt.dtype(at::kLong));
  Tensor depths = at::empty({N, F}, opt.dtype(at::kLong)), ranks = at::empty({N, F}, opt.dtype(at::kLong));
  Tensor num_nodes = at::empty({N}, opt.dtype(at::kLong)), scores = at::empty({N, F}, opt.dtype(at::kDouble));
  Tensor vis = at::empty({N, F, F}, opt.dtype(at::kBool));
  check(ddtree::build_tree(lpc.data_ptr<float>(), idc.data_ptr<int64_t>(), bc.data_ptr<int64_t>(), static_cast<int>(N),
                           static_cast<int>(L), static_cast<int>(K), static_cast<int>(max_budget), tokens.data_ptr<int64_t>(),
                           parents.data_ptr<int64_t>(), depths.data_ptr<int64_t>(), num_nodes.data_ptr<int64_t>(),
                           vis.data_ptr<bool>(), scores.data_ptr<double>(), ranks.data_ptr<int64_t>(), stream()),
        "build_tree");
  return {tokens, parents, depths, num_nodes, vis, scores, ranks};
}

std::tuple<Tensor, Tensor, Tensor> tree_accept(Tensor target, Tensor tokens, Tensor parents, Tensor num_nodes,
                                               int64_t max_depth) {
  CHECK_CUDA(target); CHECK_CUDA(tokens); CHECK_CUDA(parents); CHECK_CUDA(num_nodes);
  CHECK_TYPE(target, at::kLong); CHECK_TYPE(tokens, at::kLong); CHECK_TYPE(parents, at::kLong); CHECK_TYPE(num_nodes, at::kLong);
  TORCH_CHECK(tokens.dim() == 2 && target.sizes() == tokens.sizes() && parents.sizes() == tokens.sizes() &&
              num_nodes.numel() == tokens.size(0), "ddtree::tree_accept: [N, B+1] rows and num_nodes [N]");
  const int64_t N = tokens.size(0), R = tokens.size(1);
  c10::cuda::CUDAGuard guard(tokens.device());
  Tensor tc = target.contiguous(), kc = tokens.contiguous(), pc = parents.contiguous(), nc = num_nodes.contiguous();
  Tensor accepted = at::empty({N, max_depth + 1}, tokens.options());
  Tensor accept_len = at::empty({N}, tokens.options()), emitted = at::empty({N, max_depth + 1}, tokens.options());
  check(ddtree::tree_accept(tc.data_ptr<int64_t>(), kc.data_ptr<int64_t>(), pc.data_ptr<int64_t>(), nc.data_ptr<int64_t>(),
                            static_cast<int>(N), static_cast<int>(R), static_cast<int>(max_depth),
                            accepted.data_ptr<int64_t>(), accept_len.data_ptr<int64_t>(), emitted.data_ptr<int64_t>(), stream()),
        "tree_accept");
  return {accepted, accept_len, emitted};
}

std::tuple<Tensor, Tensor, Tensor> ngram_propose(Tensor history, Tensor rows, Tensor root_positions,
                                                 std::optional<Tensor> emitted, std::optional<Tensor> num_new,
                                                 std::optional<Tensor> calibration, int64_t horizon, int64_t top_k,
                                                 int64_t vocab_size, int64_t max_ngram, int64_t max_matches,
                                                 double backoff, double recency, double cal_prior) {
  CHECK_CUDA(history); CHECK_CUDA(rows); CHECK_CUDA(root_positions);
  CHECK_TYPE(history, at::kInt); CHECK_TYPE(rows, at::kLong); CHECK_TYPE(root_positions, at::kLong);
  TORCH_CHECK(history.dim() == 2 && history.stride(1) == 1, "ddtree::ngram_propose: history [R, W] with unit column stride");
  TORCH_CHECK(rows.dim() == 1 && root_positions.sizes() == rows.sizes(), "ddtree::ngram_propose: rows and root_positions [N]");
  TORCH_CHECK(horizon >= 1 && top_k >= 1 && top_k <= ddtree::kNgramMaxK && top_k <= vocab_size,
              "ddtree::ngram_propose: 1 <= top_k <= min(vocab_size, kNgramMaxK) and horizon >= 1");
  TORCH_CHECK(max_ngram >= 1 && max_ngram <= ddtree::kNgramMaxNgram && max_matches >= 1 &&
              max_ngram * max_matches <= ddtree::kNgramMaxList, "ddtree::ngram_propose: max_ngram or max_matches too large");
  TORCH_CHECK(emitted.has_value() == num_new.has_value(), "ddtree::ngram_propose: emitted and num_new go together");
  const int64_t N = rows.numel();
  c10::cuda::CUDAGuard guard(history.device());
  Tensor rc = rows.contiguous(), pc = root_positions.contiguous();
  Tensor ec, nc, cc;
  ddtree::NgramParams p{};
  if (emitted.has_value()) {
    CHECK_CUDA((*emitted)); CHECK_CUDA((*num_new)); CHECK_TYPE((*emitted), at::kLong); CHECK_TYPE((*num_new), at::kLong);
    TORCH_CHECK(emitted->dim() == 2 && emitted->size(0) == N && num_new->numel() == N,
                "ddtree::ngram_propose: emitted [N, A] and num_new [N]");
    ec = emitted->contiguous();
    nc = num_new->contiguous();
    p.emitted = ec.data_ptr<int64_t>();
    p.emitted_width = ec.size(1);
    p.num_new = nc.data_ptr<int64_t>();
  }
  if (calibration.has_value()) {
    CHECK_CUDA((*calibration));
    TORCH_CHECK(calibration->numel() == 2 * ddtree::kNgramBuckets, "ddtree::ngram_propose: calibration [2, buckets]");
    cc = calibration->to(at::kFloat).contiguous();
    p.calibration = cc.data_ptr<float>();
  }
  auto opt = history.options();
  Tensor lp = at::empty({N, horizon, top_k}, opt.dtype(at::kFloat));
  Tensor ids = at::empty({N, horizon, top_k}, opt.dtype(at::kLong));
  Tensor tops = at::empty({N, 1 + 2 * horizon}, opt.dtype(at::kLong));
  p.history = history.data_ptr<int>();
  p.history_stride = history.stride(0);
  p.rows = rc.data_ptr<int64_t>();
  p.root_positions = pc.data_ptr<int64_t>();
  p.horizon = static_cast<int>(horizon);
  p.top_k = static_cast<int>(top_k);
  p.vocab_size = static_cast<int>(vocab_size);
  p.max_ngram = static_cast<int>(max_ngram);
  p.max_matches = static_cast<int>(max_matches);
  p.backoff = static_cast<float>(backoff);
  p.recency = static_cast<float>(recency);
  p.cal_prior = static_cast<float>(cal_prior);
  p.out_logprobs = lp.data_ptr<float>();
  p.out_ids = ids.data_ptr<int64_t>();
  p.out_tops = tops.data_ptr<int64_t>();
  check(ddtree::ngram_propose(p, static_cast<int>(N), stream()), "ngram_propose");
  return {lp, ids, tops};
}

std::vector<ddtree::CacheList> cache_lists(at::TensorList caches) {
  std::vector<ddtree::CacheList> lists;
  for (size_t i = 0; i < caches.size(); ++i) {
    const Tensor& c = caches[i];
    CHECK_CUDA(c);
    TORCH_CHECK(c.is_contiguous() && c.dim() >= 1, "ddtree: caches must be contiguous slot-major views [num_slots, ...]");
    if (lists.empty() || lists.back().count == ddtree::kMaxCaches) {
      lists.emplace_back();
      lists.back().count = 0;
      lists.back().ws_row_bytes = 0;
      lists.back().granule = 16;
    }
    ddtree::CacheList& l = lists.back();
    const int64_t rb = c.size(0) == 0 ? 0 : c.numel() / c.size(0) * c.element_size();
    l.base[l.count] = static_cast<char*>(c.data_ptr());
    l.row_bytes[l.count] = rb;
    l.ws_offset[l.count] = l.ws_row_bytes;
    l.ws_row_bytes += rb;
    ++l.count;
    while (l.granule > 1 && (rb % l.granule != 0 || reinterpret_cast<uintptr_t>(c.data_ptr()) % l.granule != 0)) l.granule >>= 1;
  }
  return lists;
}

void kv_compact(at::TensorList caches, Tensor src, Tensor dst) {
  CHECK_CUDA(src); CHECK_CUDA(dst); CHECK_TYPE(src, at::kLong); CHECK_TYPE(dst, at::kLong);
  TORCH_CHECK(src.numel() == dst.numel(), "ddtree::kv_compact: src_slots and dst_slots differ in length");
  const int64_t M = src.numel();
  if (M == 0 || caches.empty()) return;
  c10::cuda::CUDAGuard guard(src.device());
  Tensor s = src.contiguous(), d = dst.contiguous();
  for (const ddtree::CacheList& l : cache_lists(caches)) {
    Tensor ws = at::empty({std::max<int64_t>(1, M * l.ws_row_bytes)}, src.options().dtype(at::kByte));
    check(ddtree::kv_compact(l, s.data_ptr<int64_t>(), d.data_ptr<int64_t>(), static_cast<int>(M), ws.data_ptr(), stream()),
          "kv_compact");
  }
}

void kv_compact_tree(at::TensorList caches, Tensor accepted, Tensor tree_slots) {
  CHECK_CUDA(accepted); CHECK_CUDA(tree_slots); CHECK_TYPE(accepted, at::kLong); CHECK_TYPE(tree_slots, at::kLong);
  TORCH_CHECK(accepted.dim() == 2 && tree_slots.dim() == 2 && accepted.size(0) == tree_slots.size(0),
              "ddtree::kv_compact_tree: accepted_nodes [N, A], tree_slots [N, B+1]");
  if (caches.empty() || accepted.size(0) == 0) return;
  c10::cuda::CUDAGuard guard(accepted.device());
  Tensor a = accepted.contiguous(), t = tree_slots.contiguous();
  for (const ddtree::CacheList& l : cache_lists(caches))
    check(ddtree::kv_compact_tree(l, a.data_ptr<int64_t>(), static_cast<int>(a.size(0)), static_cast<int>(a.size(1)),
                                  t.data_ptr<int64_t>(), static_cast<int>(t.size(1)), stream()), "kv_compact_tree");
}

Tensor pack_tree_mask(Tensor mask) {
  CHECK_CUDA(mask); CHECK_TYPE(mask, at::kBool);
  TORCH_CHECK(mask.dim() == 2, "ddtree::pack_tree_mask: mask must be [num_tokens, max_query_len]");
  c10::cuda::CUDAGuard guard(mask.device());
  Tensor m = mask.contiguous();
  const int64_t T = m.size(0), Q = m.size(1);
  Tensor bits = at::empty({T, (Q + 63) / 64}, mask.options().dtype(at::kLong));
  check(ddtree::pack_tree_mask(m.data_ptr<bool>(), static_cast<int>(T), static_cast<int>(Q),
                               reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>()), stream()), "pack_tree_mask");
  return bits;
}

bool attention_wgmma() { return wgmma_enabled(); }

// The schedule paged_attention picks on this device for a bf16 GQA step of these shapes (bench/kernels.py prints it
// beside each time): [kind, config, tile_rows, tiles_per_seq, num_splits, cluster_combine].
std::vector<int64_t> attention_plan(int64_t head_dim, int64_t group, int64_t num_seqs, int64_t num_kv_heads,
                                    int64_t max_query_len, int64_t max_seq_len) {
  const int d = static_cast<int>(head_dim);
  const ddtree::AttnPlan p = device_plan(ddtree::kBFloat16, d, d, d, false, true, static_cast<int>(group),
                                         static_cast<int>(num_seqs), static_cast<int>(num_kv_heads), max_query_len,
                                         max_seq_len);
  return {p.kind, p.config, p.tile_rows, p.tiles_per_seq, p.num_splits, p.cluster_combine};
}

}  // namespace

TORCH_LIBRARY(ddtree, m) {
  m.set_python_module("ext.fake");  // where the fake (meta) kernels live
  m.def("write_kv(Tensor(a!) cache, Tensor rows, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, Tensor? tree_bits, int max_query_len, int max_seq_len, float scale) -> Tensor");
  m.def("mla_paged_attention(Tensor q_latent, Tensor q_rope, Tensor latent_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, Tensor? tree_bits, int max_query_len, int max_seq_len, float scale) -> Tensor");
  m.def("topk_logprobs(Tensor logits, int k) -> (Tensor, Tensor)");
  m.def("build_tree(Tensor draft_logprobs, Tensor draft_token_ids, Tensor budgets, int max_budget) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("tree_accept(Tensor target_token_ids, Tensor node_token_ids, Tensor parents, Tensor num_nodes, int max_depth) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("kv_compact(Tensor(a!)[] caches, Tensor src_slots, Tensor dst_slots) -> ()");
  m.def("kv_compact_tree(Tensor(a!)[] caches, Tensor accepted_nodes, Tensor tree_slots) -> ()");
  m.def("pack_tree_mask(Tensor tree_mask) -> Tensor");
  m.def("attention_wgmma() -> bool", &attention_wgmma);  // tiles past 64 rows run as wgmma on this device
  m.def("attention_plan(int head_dim, int group, int num_seqs, int num_kv_heads, int max_query_len, int max_seq_len) "
        "-> int[]", &attention_plan);
  m.def("ngram_propose(Tensor(a!) history, Tensor rows, Tensor root_positions, Tensor? emitted, Tensor? num_new, "
        "Tensor? calibration, int horizon, int top_k, int vocab_size, int max_ngram, int max_matches, float backoff, "
        "float recency, float cal_prior) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ddtree, CUDA, m) {
  m.impl("write_kv", &write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("mla_paged_attention", &mla_paged_attention);
  m.impl("topk_logprobs", &topk_logprobs);
  m.impl("build_tree", &build_tree);
  m.impl("tree_accept", &tree_accept);
  m.impl("kv_compact", &kv_compact);
  m.impl("kv_compact_tree", &kv_compact_tree);
  m.impl("pack_tree_mask", &pack_tree_mask);
  m.impl("ngram_propose", &ngram_propose);
}
