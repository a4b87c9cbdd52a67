// Suffix-match (n-gram) drafting on the device, one block per request: the rule of ext/reference/ngram.py (its
// docstring and engine/speculative/ngram.py's give the weights, the conditional depths and the calibration), from
// a table of every request's tokens, so that a tree step can be drafted before its predecessor's results reach
// the host. fp32 here, float64 there: scores that tie within fp32 rounding may rank differently.
//
// Steps of a block: (1) write the tokens the previous step emitted into the request's history row; (2) scan the
// end positions from the newest down, 256 a pass, for the longest suffix each one closes, keeping per suffix
// length the max_matches most recent (stopping once the longest length has max_matches); (3) weigh the
// kept positions; (4) per depth: each surviving match's token, the score of every distinct token, its rank, the
// top's calibrated probability, the row's K best and its padding, then the matches that predicted the top survive.
#include "common.cuh"

namespace ddtree {

namespace {

constexpr int kThreads = kNgramThreads;
constexpr int kWarps = kThreads / 32;
constexpr float kPadGap = 1.0e4f;  // engine.speculative.drafter.PAD_GAP

struct Shared {
  int suffix[kNgramMaxNgram];   // t[T-1], t[T-2], ...: suffix[n-1] is the token n back from the end
  int counts[kNgramMaxNgram];   // positions found so far per suffix length n (index n-1)
  int warp_counts[kWarps];
  float warp_sums[kWarps];
  int num_list;
  int stop;
  float level_weight[kNgramMaxNgram];  // scale * m/(m+1) / sum of the level's weights, 0 for empty levels
  float mass;
  // the match list: kept end positions, the levels each counts at (bit n-1), weight, token at this depth
  int pos[kNgramMaxList];
  unsigned char levels[kNgramMaxList];
  unsigned char alive[kNgramMaxList];
  unsigned char rep[kNgramMaxList];
  float weight[kNgramMaxList];
  int tok[kNgramMaxList];
  float score[kNgramMaxList];
  int rank[kNgramMaxList];
  // one depth's row
  int cand[kNgramMaxK];
  int num_reps;
  int top_tok;
  float top_score;
  float top_prob, rest_scale, share_div;
  int top_bucket;
  float last_lp;
};

// Exclusive count of `flag` over the block's threads in thread order, and the block's total. Two barriers.
__device__ __forceinline__ int block_exclusive_count(bool flag, Shared& s, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned bal = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) s.warp_counts[warp] = __popc(bal);
  __syncthreads();
  int before = __popc(bal & ((1u << lane) - 1u)), sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    const int c = s.warp_counts[w];
    before += w < warp ? c : 0;
    sum += c;
  }
  total = sum;
  __syncthreads();
  return before;
}

// Sum of v over the block in a fixed order (warp shuffles, then the warps in order): deterministic.
__device__ __forceinline__ float block_sum(float v, Shared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s.warp_sums[warp] = v;
  __syncthreads();
  float sum = 0.f;
  for (int w = 0; w < kWarps; ++w) sum += s.warp_sums[w];
  __syncthreads();
  return sum;
}

__device__ __forceinline__ int bucket_of(int depth, float share) {
  const int group = (depth < kNgramDepthGroups ? depth : kNgramDepthGroups) - 1;
  int bin = static_cast<int>(share * kNgramShareBins + kNgramBucketEps);  // edges: ext/reference/ngram.py bucket_of
  bin = bin < kNgramShareBins - 1 ? bin : kNgramShareBins - 1;
  return group * kNgramShareBins + bin;
}

__global__ void __launch_bounds__(kThreads) ngram_kernel(NgramParams p) {
  __shared__ Shared s;
  const int i = blockIdx.x, tid = threadIdx.x;
  int* t = p.history + p.rows[i] * p.history_stride;
  const int64_t root = p.root_positions[i];
  const int T = static_cast<int>(root) + 1;
  const int L = p.horizon, K = p.top_k;
  float* out_lp = p.out_logprobs + static_cast<int64_t>(i) * L * K;
  int64_t* out_ids = p.out_ids + static_cast<int64_t>(i) * L * K;
  int64_t* out_tops = p.out_tops + static_cast<int64_t>(i) * (1 + 2 * L);

  // (1) the previous tree step's tokens
  if (p.emitted != nullptr) {
    const int64_t n_new = p.num_new[i];
    for (int j = tid; j < n_new && j < p.emitted_width; j += kThreads)
      t[root - n_new + 1 + j] = static_cast<int>(p.emitted[i * p.emitted_width + j]);
    __syncthreads();
  }
  const int n_max = T < p.max_ngram ? T : p.max_ngram;
  if (tid < n_max) s.suffix[tid] = t[T - 1 - tid];
  if (tid < kNgramMaxNgram) s.counts[tid] = 0;
  if (tid == 0) { s.num_list = 0; s.stop = 0; }
  __syncthreads();

  // (2) the newest end positions first: e = T-2 - (pass * kThreads + tid)
  for (int base = T - 2; base >= 0 && !s.stop; base -= kThreads) {
    const int e = base - tid;
    int ml = 0;
    if (e >= 0) {
      while (ml < n_max && e - ml >= 0 && t[e - ml] == s.suffix[ml]) ++ml;
    }
    unsigned kept = 0;
    for (int n = 1; n <= n_max; ++n) {
      int total;
      const int before = block_exclusive_count(ml >= n, s, total);
      if (ml >= n && s.counts[n - 1] + before < p.max_matches) kept |= 1u << (n - 1);
      __syncthreads();
      if (tid == 0) s.counts[n - 1] += total;
    }
    int num_kept;
    const int slot = block_exclusive_count(kept != 0, s, num_kept);
    if (kept) {
      const int at = s.num_list + slot;
      s.pos[at] = e;
      s.levels[at] = static_cast<unsigned char>(kept);
    }
    __syncthreads();
    if (tid == 0) {
      s.num_list += num_kept;
      s.stop = s.counts[n_max - 1] >= p.max_matches;
    }
    __syncthreads();
  }
  const int M = s.num_list;
  if (M == 0) {  // nothing to continue: padding only, nothing to check later
    for (int j = tid; j < L * K; j += kThreads) {
      out_ids[j] = j % K;
      out_lp[j] = -kPadGap - static_cast<float>(j % K);
    }
    for (int j = tid; j < 1 + 2 * L; j += kThreads) out_tops[j] = -1;
    return;
  }

  // (3) weights: a position's recency weight times the sum of its levels' factors
  const float inv_total = 1.0f / static_cast<float>(T);
  const float recency_w = tid < M ? 1.0f + p.recency * static_cast<float>(s.pos[tid] + 1) * inv_total : 0.f;
  const unsigned my_levels = tid < M ? s.levels[tid] : 0u;
  int longest = 0;
  for (int n = n_max; n >= 1; --n) {
    if (s.counts[n - 1] > 0) { longest = n; break; }
  }
  float mass = 0.f;
  for (int n = longest; n >= 1; --n) {
    const float level_sum = block_sum((my_levels >> (n - 1)) & 1u ? recency_w : 0.f, s);
    const int m = s.counts[n - 1] < p.max_matches ? s.counts[n - 1] : p.max_matches;
    float factor = 0.f;
    if (m > 0) {
      const float scale = powf(p.backoff, static_cast<float>(longest - n));
      mass += scale;
      factor = scale * static_cast<float>(m) / static_cast<float>(m + 1) / level_sum;
    }
    if (tid == 0) s.level_weight[n - 1] = factor;
  }
  __syncthreads();
  if (tid < M) {
    float sum = 0.f;
    for (int n = longest; n >= 1; --n) sum += (my_levels >> (n - 1)) & 1u ? s.level_weight[n - 1] : 0.f;
    s.weight[tid] = recency_w * sum;
    s.alive[tid] = 1;
  }
  if (tid == 0) s.mass = mass;
  __syncthreads();

  // (4) the depths
  if (tid == 0) out_tops[0] = T;
  for (int d = 1; d <= L; ++d) {
    if (tid < M) {
      const int q = s.pos[tid];
      s.tok[tid] = q + d < T ? t[q + d] : t[q + 1 + (d - 1) % (T - 1 - q)];
    }
    __syncthreads();
    // each distinct token's score (summed in list order), represented by its first surviving match
    bool is_rep = false;
    if (tid < M && s.alive[tid]) {
      const int my = s.tok[tid];
      float sc = 0.f;
      is_rep = true;
      for (int j = 0; j < M; ++j) {
        if (s.alive[j] && s.tok[j] == my) {
          sc += s.weight[j];
          if (j < tid) is_rep = false;
        }
      }
      s.score[tid] = sc;
    }
    if (tid < M) s.rep[tid] = is_rep;
    __syncthreads();
    if (is_rep) {  // rank: scores descending, ties by token id
      const int my = s.tok[tid];
      const float sc = s.score[tid];
      int r = 0;
      for (int j = 0; j < M; ++j) {
        if (s.rep[j] && j != tid) {
          const float o = s.score[j];
          r += (o > sc || (o == sc && s.tok[j] < my)) ? 1 : 0;
        }
      }
      s.rank[tid] = r;
      if (r == 0) { s.top_tok = my; s.top_score = sc; }
    }
    int num_reps;
    block_exclusive_count(is_rep, s, num_reps);
    float alive_sum = block_sum(tid < M && s.alive[tid] ? s.weight[tid] : 0.f, s);
    int num_alive;
    block_exclusive_count(tid < M && s.alive[tid], s, num_alive);
    if (tid == 0) {
      // the row's mass: the level scales at depth 1, else the survivors' weight times (m+1)/m
      const float row_mass = d == 1 ? s.mass : alive_sum * static_cast<float>(num_alive + 1) / static_cast<float>(num_alive);
      const float top_share = s.top_score / row_mass;
      int num_tied = 0;
      for (int j = 0; j < M; ++j) num_tied += (s.rep[j] && s.score[j] == s.top_score) ? 1 : 0;
      const int bucket = bucket_of(d, top_share);
      s.share_div = row_mass;
      s.top_bucket = bucket;
      if (p.calibration != nullptr) {
        const float hits = p.calibration[bucket], seen = p.calibration[kNgramBuckets + bucket];
        float top = (hits + p.cal_prior * top_share) / (seen + p.cal_prior);
        top = fminf(top, 1.0f / static_cast<float>(num_tied));
        const float rest_share = 1.0f - static_cast<float>(num_tied) * top_share;
        s.top_prob = top;
        s.rest_scale = rest_share > 1e-12f ? (1.0f - static_cast<float>(num_tied) * top) / rest_share : 0.f;
      }
      s.num_reps = num_reps;
      out_tops[d] = s.top_tok;
      out_tops[L + d] = bucket;
    }
    __syncthreads();
    const int c = s.num_reps < K ? s.num_reps : K;  // real candidates in the row
    float* row_lp = out_lp + static_cast<int64_t>(d - 1) * K;
    int64_t* row_ids = out_ids + static_cast<int64_t>(d - 1) * K;
    if (is_rep && s.rank[tid] < K) {
      const float share = s.score[tid] / s.share_div;
      float prob = share;
      if (p.calibration != nullptr) prob = s.score[tid] == s.top_score ? s.top_prob : share * s.rest_scale;
      const float lp = logf(fmaxf(prob, 1e-30f));
      const int r = s.rank[tid];
      row_lp[r] = lp;
      row_ids[r] = s.tok[tid];
      s.cand[r] = s.tok[tid];
      if (r == c - 1) s.last_lp = lp;
    }
    __syncthreads();
    // padding: the smallest ids that are no candidate, PAD_GAP and more below the last real one
    int filled = 0;
    for (int base = 0; filled < K - c && base < p.vocab_size; base += kThreads) {
      const int id = base + tid;
      bool free_id = id < p.vocab_size;
      for (int r = 0; r < c && free_id; ++r) free_id = s.cand[r] != id;
      int num_free;
      const int at = filled + block_exclusive_count(free_id, s, num_free);
      if (free_id && at < K - c) {
        row_ids[c + at] = id;
        row_lp[c + at] = s.last_lp - kPadGap - static_cast<float>(at);
      }
      filled += num_free;
    }
    // the matches that predicted the top token survive
    if (tid < M && s.tok[tid] != s.top_tok) s.alive[tid] = 0;
    __syncthreads();
  }
}

}  // namespace

cudaError_t ngram_propose(const NgramParams& p, int num_reqs, cudaStream_t stream) {
  if (num_reqs == 0) return cudaSuccess;
  ngram_kernel<<<num_reqs, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ddtree
