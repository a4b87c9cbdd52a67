// Launch functions of the ddtree CUDA kernels: plain CUDA C++ (no torch headers), raw pointers plus a
// cudaStream_t, so every .cu here compiles with nvcc alone. ops.cpp is the only torch-facing file: it checks
// the tensors, allocates outputs and workspaces, and calls these on the current stream. Every launcher
// returns the launch's cudaError_t; none synchronizes with the host.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace ddtree {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---- attention ---------------------------------------------------------------------------------------------
// One paged-attention call. Query token t (of sequence s, rows query_start_loc[s]..query_start_loc[s+1]),
// head h reads kv head h / group. Its sequence has seq_lens[s] logical KV positions; the last q_len of them
// are the step's new tokens. A query sees every context position, and among the new tokens either a causal
// prefix (tree_bits == nullptr) or the columns whose bit is set in tree_bits[t] (bit j = new token j).
struct AttnParams {
  const void* q_a;            // [T, Hq, qa_dim] first part of each query row (dims 0..qa_dim-1)
  const void* q_b;            // [T, Hq, dk - qa_dim] second part (MLA rope dims) or nullptr
  int64_t qa_stride_t, qa_stride_h, qb_stride_t, qb_stride_h;  // element strides
  int qa_dim;                 // dims taken from q_a (== dk without q_b)
  const void* k;              // cache; key dim d of (slot, kv head) at k[slot*k_stride_slot + kvh*k_stride_head + d]
  const void* v;              // cache for values (MLA: the same latent rows, first dv dims)
  int64_t k_stride_slot, k_stride_head, v_stride_slot, v_stride_head;
  void* out;                  // [T, Hq, dv] in the query dtype
  int64_t o_stride_t, o_stride_h;
  float* o_part;              // [num_splits, T, Hq, dv] fp32 split partials (normalized), nullptr if 1 split
  float* lse_part;            // [num_splits, T, Hq] log2-sum-exp of each split (-inf = empty)
  const int* query_start_loc; // [num_seqs + 1]
  const int* seq_lens;        // [num_seqs]
  const int* block_tables;    // [num_seqs, bt_stride] physical block of each logical block
  int64_t bt_stride;
  const uint64_t* tree_bits;  // [T, tree_words] ancestor bitmask over the new tokens, or nullptr (causal)
  int tree_words;
  int num_seqs, num_tokens, num_q_heads, num_kv_heads, group, block_size, dk, dv;
  int block_shift;            // log2(block_size) when it is a power of two, else -1 (set by attn_launch)
  float scale_log2;           // softmax scale * log2(e)
  int tiles_per_seq;          // query tiles per sequence (grid.x = num_seqs * tiles_per_seq)
  int num_splits;             // split-KV: the planned splits (the tensor-core kernels spread a sequence's
                              // positions over min(num_splits, its length / 2 tiles) of them)
  int cluster_combine;        // 1: the splits of a tile form one thread-block cluster and combine through
                              // distributed shared memory (sm_90, tensor-core GQA, at most kMaxClusterSplits)
  int pdl;                    // the tensor-core kernels and the split combine launch as programmatic dependents
                              // (they wait before reading anything but the step's metadata)
};

constexpr int kMaxClusterSplits = 8;  // the portable cluster size

struct AttnPlan {
  int kind;          // 0 = SIMT (any dtype / head dim), 1 = tensor-core GQA, 2 = tensor-core MLA (576/512)
  int config;        // tensor-core tile config: 0 = 16-row tiles (decode-shaped), 1 = 64-row tiles,
                     // 2 = GQA 128-row tiles as warpgroup MMAs (sm_90a)
  int tile_rows;     // packed (token, head) rows per CTA
  int tiles_per_seq, num_splits;
  int cluster_combine;  // AttnParams::cluster_combine
};

// Picks the kernel, tile and split-KV schedule from host-known maxima (no device reads).
// wgmma: the device runs the sm_90a warpgroup tiles (compute capability 9.0 and attn_wgmma_built()).
AttnPlan attn_plan(DType dtype, int dk, int dv, int qa_dim, bool shared_kv, bool aligned, int group,
                   int num_seqs, int num_kv_heads, int max_query_len, int max_seq_len, int num_sms, bool clusters,
                   bool wgmma);
// Runs the planned kernel (plus the split combine kernel); p.o_part / p.lse_part must be set when num_splits > 1
// and the splits do not combine in a cluster.
cudaError_t attn_launch(AttnParams p, const AttnPlan& plan, DType dtype, cudaStream_t stream);
cudaError_t attn_mma_gqa(const AttnParams& p, DType dtype, int config, cudaStream_t stream);
cudaError_t attn_mma_mla(const AttnParams& p, DType dtype, int config, cudaStream_t stream);
// Resident CTAs per SM of a tensor-core config (0 if not instantiated), for the split-KV schedule.
int attn_mma_gqa_ctas_per_sm(DType dtype, int head_dim, int config);
// Whether this library holds sm_90a machine code (the build's targets include 9.0a: -DDDTREE_SM90A).
bool attn_wgmma_built();
int attn_mma_mla_ctas_per_sm(DType dtype, int config);

// ---- tree ops ---------------------------------------------------------------------------------------------
// Top-K of log_softmax over V per row; ties -> lower id. rows = N*L. Needs k <= kTopkMaxK.
constexpr int kTopkMaxK = 1024;
int topk_num_chunks(int rows, int vocab, int k, int num_sms);
size_t topk_workspace_bytes(int rows, int k, int chunks);
cudaError_t topk_logprobs(const void* logits, DType dtype, int rows, int vocab, int k, int chunks,
                          void* workspace, float* out_logprobs, int64_t* out_ids, cudaStream_t stream);

// Best-first tree build, one warp per request; outputs as ext.reference.tree.TreeBuild.
size_t build_tree_smem_bytes(int max_depth, int k, int max_budget);
cudaError_t build_tree(const float* logprobs, const int64_t* token_ids, const int64_t* budgets, int num_reqs,
                       int max_depth, int k, int max_budget, int64_t* node_token_ids, int64_t* parents,
                       int64_t* depths, int64_t* num_nodes, bool* visibility, double* scores, int64_t* ranks,
                       cudaStream_t stream);

// Tree walk along the target's tokens (greedy or sampled), one warp per request.
cudaError_t tree_accept(const int64_t* target_token_ids, const int64_t* node_token_ids, const int64_t* parents,
                        const int64_t* num_nodes, int num_reqs, int num_rows, int max_depth,
                        int64_t* accepted_nodes, int64_t* accept_len, int64_t* emitted, cudaStream_t stream);

// Suffix-match drafting from a table of token histories (ngram.cu; the rule: ext/reference/ngram.py), one block
// of kNgramThreads per request. Needs max_ngram <= kNgramMaxNgram, max_ngram * max_matches <= kNgramMaxList and
// top_k <= kNgramMaxK.
constexpr int kNgramThreads = 256;
constexpr int kNgramMaxNgram = 8;
constexpr int kNgramMaxList = 256;
constexpr int kNgramMaxK = 256;
constexpr int kNgramShareBins = 10;
constexpr int kNgramDepthGroups = 3;
constexpr int kNgramBuckets = kNgramShareBins * kNgramDepthGroups;
constexpr float kNgramBucketEps = 1e-4f;  // a share on a decile's edge goes up whatever its rounding
struct NgramParams {
  int* history;                 // [R, history_stride] int32, one request per row (written: the emitted tokens)
  int64_t history_stride;
  const int64_t* rows;          // [N] each request's row
  const int64_t* root_positions;  // [N]
  const int64_t* emitted;       // [N, emitted_width] the previous step's tokens, or nullptr
  int64_t emitted_width;
  const int64_t* num_new;       // [N] how many of them (with emitted)
  const float* calibration;     // [2, kNgramBuckets] hits then seen, or nullptr (shares as probabilities)
  int horizon, top_k, vocab_size, max_ngram, max_matches;
  float backoff, recency, cal_prior;
  float* out_logprobs;          // [N, horizon, top_k]
  int64_t* out_ids;             // [N, horizon, top_k]
  int64_t* out_tops;            // [N, 1 + 2 * horizon]: history length or -1, top token per depth, bucket per depth
};
cudaError_t ngram_propose(const NgramParams& p, int num_reqs, cudaStream_t stream);

// ---- sampling ---------------------------------------------------------------------------------------------
// Target token per row, as ext/reference/sampling.py: argmax (NaN largest, ties -> lower id) where
// temperature[r] < 1e-5 (or NaN); else inverse-CDF sampling of p = softmax(logits / T) over the tokens with
// p >= min_p[r] * max p: the first token, in vocabulary order, whose cumulative kept mass (fp64) exceeds
// uniform[r] * the total kept mass. Rows without a finite max (all -inf, NaN, +inf) take the argmax.
constexpr int kSampleMaxVocab = 1 << 30;
constexpr int kSampleMaxChunks = 4096;  // per-chunk masses kept in shared memory (8 bytes each)
cudaError_t sample_tokens(const void* logits, DType dtype, int rows, int vocab, const float* temperature,
                          const float* min_p, const double* uniform, int64_t* out, cudaStream_t stream);
// The counter-based uniform of each sampled row (engine/sampler.py draws with it; the definition is
// ext/reference/sampling.py's seeded_uniforms): out[r] = (h >> 11) * 2^-53 for
// h = splitmix64(splitmix64(seeds[r]) + indices[r]), all in uint64 arithmetic; one thread a row.
cudaError_t seeded_uniforms(const int64_t* seeds, const int64_t* indices, int rows, double* out, cudaStream_t stream);
// The floor of top-k / top-p per row (sampling_filter.cu; the definition is ext/reference/sampling.py's
// top_k_top_p_floor): out[r] = the smallest value row r keeps; -inf when neither filter is on or the row has no finite
// max. top_k[r] outside (0, V) and top_p[r] >= 1 are off.
cudaError_t top_k_top_p_floor(const void* logits, DType dtype, int rows, int vocab, const int64_t* top_k,
                              const float* top_p, float* out, cudaStream_t stream);

// ---- decoder-layer ops (layers.cu; the eager math they reproduce: ext/reference/layers.py) -----------------
// RMSNorm of rows of `hidden` elements, row (t, r) at x + t*x_stride0 + r*x_stride1 (element strides, unit last
// dim), t < rows / inner, r < inner. With a residual (same row layout): new_residual = round(x + residual) is
// written contiguous [rows, hidden] and normalised; without one, x is. out [rows, hidden] contiguous in the
// weight-promoted dtype (x's dtype when the weight shares it, else fp32): weight * round(r * rsqrt(mean(r^2) + eps)).
struct RmsNormParams {
  const void* x;
  int64_t x_stride0, x_stride1;
  const void* residual;       // nullptr: none (new_residual unused)
  int64_t r_stride0, r_stride1;
  const void* weight;         // [hidden] contiguous
  void* out;
  void* new_residual;
  int64_t rows;
  int64_t inner;
  int hidden;
  float eps;
  bool pdl;  // launch as a programmatic dependent of the previous kernel (sm_90; common.cuh)
};
cudaError_t rms_norm(const RmsNormParams& p, DType x_dtype, DType weight_dtype, cudaStream_t stream);

// Neox (rotate-half) rope in place on q [T, Hq, D] and k [T, Hk, D] (element strides, unit last dim) with
// cos/sin [T, D]; q, k, cos and sin share `dtype`.
struct RopeParams {
  void* q;
  int64_t q_stride_t, q_stride_h;
  void* k;
  int64_t k_stride_t, k_stride_h;
  const void* cos;
  const void* sin;
  int64_t cos_stride_t, sin_stride_t;
  int num_tokens, num_q_heads, num_k_heads, head_dim;
  // optional (k_cache != nullptr): also write the roped k and v [T, Hk, D] into contiguous caches of the same
  // dtype, [num_slots, Hk, D], at slots[t] (-1 skipped): rope and the K+V cache write in one launch
  void* k_cache;
  void* v_cache;
  const void* v;
  int64_t v_stride_t, v_stride_h;
  const int64_t* slots;
  // optional (q_norm != nullptr): Qwen3's per-head RMSNorm of q and k before the rope, weights [D] in `dtype`,
  // in rms_norm's rounding and order of the sum of squares (bit for bit rms_norm then rope). Needs the vectorized
  // path with (D / 2) / (16 / sizeof(dtype)) a power of two <= 16; cudaErrorInvalidValue otherwise.
  const void* q_norm;
  const void* k_norm;
  float norm_eps;
  bool pdl;  // programmatic dependent launch (common.cuh)
};
cudaError_t rope_inplace(const RopeParams& p, DType dtype, cudaStream_t stream);

// out [rows, inter] contiguous = silu(x[:, :inter]) * x[:, inter:], x rows `x_stride` elements apart.
cudaError_t silu_and_mul(const void* x, DType dtype, int64_t x_stride, void* out, int64_t rows, int inter,
                         cudaStream_t stream);

// FP8 activations for the blockwise GEMM: x [rows, cols] (cols % 128 == 0, rows x_stride apart) -> q [padded_rows,
// cols] float8_e4m3 (rows >= `rows` zero) and scale_t [cols / 128, padded_rows] fp32 (x ~= q * scale per group).
cudaError_t quantize_fp8_blockwise(const void* x, DType dtype, int64_t x_stride, int64_t rows, int64_t padded_rows,
                                   int64_t cols, float amax_floor, void* q, float* scale_t, cudaStream_t stream);

// W4A16 (decode-sized batches): out [rows, n_out] = x [rows, 8 * words] . dequant(packed)^T, rows <= kW4A16MaxRows.
// packed [n_out, words] holds 8 int4 per word (value k at bits 4(k % 8), stored as q + 8), scale [n_out, groups]
// fp32 with one scale per group_words words (a group of 8 * group_words input columns).
constexpr int kW4A16MaxRows = 8;
cudaError_t w4a16_gemm(const void* x, DType dtype, int64_t x_stride, int rows, const void* packed, int64_t words,
                       const float* scale, int64_t groups, int64_t group_words, int64_t n_out, void* out,
                       cudaStream_t stream);
// out [n_out, 8 * words] in `dtype` = the int4 weight (layout as above) times its scales (for larger batches).
cudaError_t int4_dequantize(const void* packed, int64_t n_out, int64_t words, const float* scale, int64_t groups,
                            int64_t group_words, void* out, DType dtype, cudaStream_t stream);

// ---- dense GEMV (decode-sized matmuls) ---------------------------------------------------------------------
// out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for m < rows <= kGemvMaxRows; silu_mul: w is [gate; up] ([2 n_out, k],
// no bias) and out[m, n] = silu(gate . x) * (up . x) with silu_and_mul's rounding. bf16/fp16; k and x_stride
// multiples of 8, x and w 16-byte aligned, w rows contiguous.
constexpr int kGemvMaxRows = 8;
struct GemvParams {
  const void* x;       // [rows, k], rows x_stride elements apart
  int64_t x_stride;
  int rows;
  const void* w;       // [n_out (x2 for silu_mul), k] contiguous
  const void* bias;    // [n_out] or nullptr
  int64_t n_out, k;
  void* out;           // [rows, n_out], rows out_stride elements apart
  int64_t out_stride;
  bool pdl;            // programmatic dependent launch: the launch (and, for small weights, an L2 prefetch of
                       // the weight) overlaps the previous kernel
  bool prefetch;       // set by gemv(): prefetch the first weight loads into L2 before waiting
};
cudaError_t gemv(const GemvParams& p, DType dtype, bool silu_mul, cudaStream_t stream);
// The same product on tensor cores for up to kSkinnyMaxRows rows (gemm_skinny.cu); k a multiple of 32.
constexpr int kSkinnyMaxRows = 32;
cudaError_t gemm_skinny(const GemvParams& p, DType dtype, bool silu_mul, cudaStream_t stream);

// ---- cache ops --------------------------------------------------------------------------------------------
cudaError_t write_kv(void* cache, DType cache_dtype, const void* rows, DType rows_dtype, int64_t rows_stride,
                     const int64_t* slot_mapping, int num_tokens, int64_t row_elems, cudaStream_t stream);
// K and V in one launch: rows of `k` go to k_cache and rows of `v` to v_cache at the same slots (-1 skipped).
// Both caches share cache_dtype, both row sets rows_dtype.
struct KvRows {
  void* cache;                // contiguous [num_slots, row_elems]
  const void* rows;           // [num_tokens, row_elems], rows `rows_stride` elements apart, unit last stride
  int64_t rows_stride;
  int64_t row_elems;
};
cudaError_t write_kv_pair(const KvRows& k, const KvRows& v, DType cache_dtype, DType rows_dtype,
                          const int64_t* slot_mapping, int num_tokens, cudaStream_t stream);

constexpr int kMaxCaches = 64;
struct CacheList {
  char* base[kMaxCaches];       // slot-major cache tensors [num_slots, ...]
  int64_t row_bytes[kMaxCaches];
  int64_t ws_offset[kMaxCaches];  // byte offset of cache i inside one workspace row
  int count;
  int64_t ws_row_bytes;         // sum of row_bytes
  int granule;                  // copy width in bytes (16, 8, 4, 2, 1): divides every row and base
};
// Generic: cache[dst[m]] = old cache[src[m]] for every m, all gathered (into workspace) before scattered.
cudaError_t kv_compact(const CacheList& caches, const int64_t* src, const int64_t* dst, int num_pairs,
                       void* workspace, cudaStream_t stream);
// DDTree: accepted row accepted[n, j] -> tree_slots[n, j], one pass, in place (accepted rows strictly increase).
cudaError_t kv_compact_tree(const CacheList& caches, const int64_t* accepted_nodes, int num_reqs,
                            int accepted_width, const int64_t* tree_slots, int num_rows, cudaStream_t stream);

// bool [T, Q] -> uint64 [T, ceil(Q/64)]: bit j of word w = column 64*w + j.
cudaError_t pack_tree_mask(const bool* mask, int num_tokens, int num_cols, uint64_t* bits, cudaStream_t stream);

}  // namespace ddtree
