// Paged attention entry points: the schedule (attn_plan), the SIMT kernel that serves every dtype and head
// dim (fp32 engines, odd head sizes), and the split-KV combine. The tensor-core kernels live in
// attention_mma.cuh (instantiated in attention_gqa.cu and attention_mla.cu).
#include "common.cuh"

namespace ddtree {

namespace {

constexpr int kSimtWarps = 4;

// One warp per (token, head). Positions are visited in increasing order and invisible ones are skipped
// outright, so a node's result does not depend on which other tree rows share the step (a tree row and the
// same token decoded alone do identical arithmetic).
template <typename T, int N>
__global__ void __launch_bounds__(32 * kSimtWarps) attn_simt_kernel(const AttnParams p) {
  const int warp = blockIdx.x * kSimtWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (warp >= p.num_tokens * p.num_q_heads) return;
  const int t = warp / p.num_q_heads, h = warp % p.num_q_heads, kvh = h / p.group;
  int lo = 0, hi = p.num_seqs;  // query_start_loc[lo] <= t < query_start_loc[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.query_start_loc[mid] <= t) lo = mid; else hi = mid;
  }
  const int seq = lo, q0 = p.query_start_loc[seq], qlen = p.query_start_loc[seq + 1] - q0, qi = t - q0;
  const int kv_len = p.seq_lens[seq], ctx = kv_len - qlen;
  const int kv_end = p.tree_bits ? kv_len : ctx + qi + 1;
  const uint64_t* bits = p.tree_bits ? p.tree_bits + static_cast<int64_t>(t) * p.tree_words : nullptr;
  const int* bt = p.block_tables + static_cast<int64_t>(seq) * p.bt_stride;

  float q[N], acc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int d = lane + 32 * i;
    float x = 0.f;
    if (d < p.qa_dim)
      x = Num<T>::to_f(static_cast<const T*>(p.q_a)[static_cast<int64_t>(t) * p.qa_stride_t + static_cast<int64_t>(h) * p.qa_stride_h + d]);
    else if (d < p.dk)
      x = Num<T>::to_f(static_cast<const T*>(p.q_b)[static_cast<int64_t>(t) * p.qb_stride_t + static_cast<int64_t>(h) * p.qb_stride_h + d - p.qa_dim]);
    q[i] = x;
    acc[i] = 0.f;
  }
  float m = -CUDART_INF_F, l = 0.f;
  const T* kb = static_cast<const T*>(p.k) + static_cast<int64_t>(kvh) * p.k_stride_head;
  const T* vb = static_cast<const T*>(p.v) + static_cast<int64_t>(kvh) * p.v_stride_head;
  constexpr int U = N >= 16 ? 1 : 4;  // wide rows: fewer positions in flight, no spills
  for (int pos0 = 0; pos0 < kv_end; pos0 += U) {
    bool vis[U];
    int64_t slot[U];
    float s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pos = pos0 + u;
      bool ok = pos < kv_end;
      if (ok && bits && pos >= ctx) {
        const int j = pos - ctx;
        ok = ((bits[j >> 6] >> (j & 63)) & 1ull) != 0;
      }
      vis[u] = ok;
      slot[u] = ok ? static_cast<int64_t>(bt[pos / p.block_size]) * p.block_size + pos % p.block_size : 0;
      float part = 0.f;
      if (ok) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const int d = lane + 32 * i;
          if (d < p.dk) part += q[i] * Num<T>::to_f(kb[slot[u] * p.k_stride_slot + d]);
        }
      }
      s[u] = part;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) s[u] = warp_sum(s[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!vis[u]) continue;
      const float x = s[u] * p.scale_log2;
      const float mn = fmaxf(m, x);
      const float corr = exp2f(m - mn), pe = exp2f(x - mn);
      l = l * corr + pe;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int d = lane + 32 * i;
        const float v = d < p.dv ? Num<T>::to_f(vb[slot[u] * p.v_stride_slot + d]) : 0.f;
        acc[i] = acc[i] * corr + pe * v;
      }
      m = mn;
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* orow = static_cast<T*>(p.out) + static_cast<int64_t>(t) * p.o_stride_t + static_cast<int64_t>(h) * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int d = lane + 32 * i;
    if (d < p.dv) orow[d] = Num<T>::from_f(acc[i] * inv);
  }
}

// out[t, h] = sum_s w_s o_part[s, t, h] / sum_s w_s with w_s = 2^(lse_s - max lse); empty splits skipped. One warp
// per (token, head), kCombineWarps to a CTA: a tree-verify step at batch 64 combines ~10k (token, head) rows of
// 64 values each, and a CTA per row left most of its threads idle and made the launch CTA-bound (12.7 us a layer
// for ~2 us of traffic on the H200). A lane owns VEC = dv / 32 adjacent columns and loads kCombineLoads / VEC
// splits' partials before it adds any: reading one split and one column at a time made the kernel a chain of
// num_splits * dv / 32 dependent L2 round trips (27 splits of a Qwen3-8B decode at 4096 keys: 108, 15 us a launch;
// batched, plain decoding there went from 5.24 to 4.92 ms a step on the H200).
constexpr int kCombineWarps = 4, kCombineLoads = 64;  // floats a lane has in flight

// A lane's VEC partial values of one split, or zeros when !ok. The load is unconditional (a skipped split reads split
// 0's row instead, which exists) so that the unrolled loads of several splits issue back to back, not as branches.
template <int VEC>
__device__ __forceinline__ void load_partial(float (&v)[VEC], const float* part, int64_t split_stride, int s, bool ok) {
  static_assert(VEC == 2 || VEC % 4 == 0, "a lane's columns: a float2 or whole float4s");
  const float* src = part + (ok ? s : 0) * split_stride;
  if constexpr (VEC == 2) {
    const float2 x = *reinterpret_cast<const float2*>(src);
    v[0] = ok ? x.x : 0.f; v[1] = ok ? x.y : 0.f;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 x = *reinterpret_cast<const float4*>(src + i);
      v[i] = ok ? x.x : 0.f; v[i + 1] = ok ? x.y : 0.f; v[i + 2] = ok ? x.z : 0.f; v[i + 3] = ok ? x.w : 0.f;
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(32 * kCombineWarps) attn_combine_kernel(const AttnParams p) {
  pdl_wait();     // the partials are the attention launch's output
  pdl_trigger();  // then the output projection's GEMV may start
  constexpr int U = kCombineLoads / VEC;  // splits loaded before any is added
  const int64_t plane = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  const int64_t th = static_cast<int64_t>(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (th >= plane) return;  // the whole warp: th is the warp's
  const int lane = threadIdx.x & 31;
  const int t = static_cast<int>(th / p.num_q_heads), h = static_cast<int>(th % p.num_q_heads);
  // lane l holds splits l and l + 32 (at most 64)
  const float la = lane < p.num_splits ? p.lse_part[lane * plane + th] : -CUDART_INF_F;
  const float lb = lane + 32 < p.num_splits ? p.lse_part[(lane + 32) * plane + th] : -CUDART_INF_F;
  float mx = fmaxf(la, lb);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float a = la == -CUDART_INF_F ? 0.f : exp2f(la - mx);
  const float b = lb == -CUDART_INF_F ? 0.f : exp2f(lb - mx);
  const float tot = warp_sum(a + b);
  const float inv = tot > 0.f ? 1.f / tot : 0.f;
  // splits after the last one with weight are not visited (a short sequence leaves the planned tail empty)
  const unsigned busy_a = __ballot_sync(0xffffffffu, a != 0.f), busy_b = __ballot_sync(0xffffffffu, b != 0.f);
  const int num_busy = busy_b ? 64 - __clz(busy_b) : 32 - __clz(busy_a);
  const int64_t split_stride = plane * p.dv;
  const float* part = p.o_part + th * p.dv + lane * VEC;
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  for (int s0 = 0; s0 < num_busy; s0 += U) {
    float w[U], v[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u;  // the same in every lane
      const float ws = __shfl_sync(0xffffffffu, s < 32 ? a : b, s & 31);
      w[u] = s < num_busy ? ws : 0.f;  // past 63 the shuffle above wraps to real splits' weights
      load_partial<VEC>(v[u], part, split_stride, s, w[u] != 0.f);  // an empty split's partial is never used
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += w[u] * v[u][i];
  }
  T* orow = static_cast<T*>(p.out) + static_cast<int64_t>(t) * p.o_stride_t + static_cast<int64_t>(h) * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < VEC; ++i) orow[lane * VEC + i] = Num<T>::from_f(acc[i] * inv);
}

template <typename T>
cudaError_t launch_simt(const AttnParams& p, cudaStream_t stream) {
  const int dmax = p.dk > p.dv ? p.dk : p.dv;
  const int warps = p.num_tokens * p.num_q_heads;
  const dim3 grid((warps + kSimtWarps - 1) / kSimtWarps), block(32 * kSimtWarps);
  if (dmax <= 32) attn_simt_kernel<T, 1><<<grid, block, 0, stream>>>(p);
  else if (dmax <= 64) attn_simt_kernel<T, 2><<<grid, block, 0, stream>>>(p);
  else if (dmax <= 128) attn_simt_kernel<T, 4><<<grid, block, 0, stream>>>(p);
  else if (dmax <= 256) attn_simt_kernel<T, 8><<<grid, block, 0, stream>>>(p);
  else if (dmax <= 512) attn_simt_kernel<T, 16><<<grid, block, 0, stream>>>(p);
  else if (dmax <= 1024) attn_simt_kernel<T, 32><<<grid, block, 0, stream>>>(p);
  else return cudaErrorNotSupported;
  return cudaGetLastError();
}

// A programmatic dependent of the attention launch, which releases it only after its KV loop: released at the
// attention's start, the combine's CTAs took slots the attention grid still needed (a Qwen3-8B decode step at 4096
// keys, 5.68 against 4.89 ms); released late, plain decoding there took 4.73-4.74 against 4.78-4.79 ms as a plain
// launch (docs/BENCHMARKS.md, 2026-12-04).
template <typename T>
cudaError_t launch_combine(const AttnParams& p, cudaStream_t stream) {
  const int rows = p.num_tokens * p.num_q_heads;
  const dim3 grid((rows + kCombineWarps - 1) / kCombineWarps), block(32 * kCombineWarps);
  switch (p.dv) {  // the tensor-core kernels' value widths (GQA 64 / 128, MLA's 512-wide latent)
    case 64: return launch(attn_combine_kernel<T, 2>, grid, block, stream, p.pdl != 0, p);
    case 128: return launch(attn_combine_kernel<T, 4>, grid, block, stream, p.pdl != 0, p);
    case 512: return launch(attn_combine_kernel<T, 16>, grid, block, stream, p.pdl != 0, p);
    default: return cudaErrorNotSupported;
  }
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// KV splits for a grid of `ctas` tiles that fills `slots` resident CTAs more than once: the count whose waves end
// soonest, a CTA's time taken as its KV tiles plus kSplitTiles for its start, its partials and their combine. At 192
// CTAs on 132 slots (8 requests' 65-node trees at 4 heads a kv head: 3 tiles of 128 rows each, 8 kv heads) one
// split runs 2 waves of the whole length, two splits 3 waves of half of it. At most kWaveSplits (the combine reads
// every split's partials), and a split must win by kSplitGain.
constexpr int kSplitTiles = 2, kWaveSplits = 8;
constexpr double kSplitGain = 0.9;
int split_waves(int ctas, int slots, int kv_tiles, int max_splits) {
  auto cost = [&](int s) {
    return static_cast<double>(ceil_div(ctas * s, slots)) * (ceil_div(kv_tiles, s) + kSplitTiles);
  };
  int best = 1;
  for (int s = 2; s <= max_splits && s <= kWaveSplits; ++s)
    if (cost(s) < cost(best)) best = s;
  return cost(best) < kSplitGain * cost(1) ? best : 1;
}

}  // namespace

AttnPlan attn_plan(DType dtype, int dk, int dv, int qa_dim, bool shared_kv, bool aligned, int group, int num_seqs,
                   int num_kv_heads, int max_query_len, int max_seq_len, int num_sms, bool clusters, bool wgmma) {
  AttnPlan plan{0, 0, 1, 1, 1, 0};
  const bool half = dtype == kBFloat16 || dtype == kFloat16;
  const bool gqa = half && aligned && !shared_kv && dk == dv && (dk == 64 || dk == 128);
  const bool mla = half && aligned && shared_kv && dk == 576 && dv == 512 && qa_dim == 512;
  if (!gqa && !mla) return plan;
  plan.kind = gqa ? 1 : 2;
  const int rows = (max_query_len > 0 ? max_query_len : 1) * group;
  // past 64 rows (a 16-node tree at 4 heads a kv head: 68), warpgroup tiles of 128 rows (attention_gqa.cu)
  plan.config = rows <= 16 ? 0 : (gqa && wgmma && rows > 64 ? 2 : 1);
  plan.tile_rows = plan.config == 0 ? 16 : (plan.config == 2 ? 128 : 64);
  const int bn = (mla && plan.config == 1) ? 32 : 64;
  plan.tiles_per_seq = ceil_div(rows, plan.tile_rows);
  // Split KV so the grid fills the resident CTA slots in one wave (a partial second wave costs a whole
  // CTA time); splits keep >= 2 KV tiles each. A grid of compute-bound tiles (verify, prefill) already past one wave
  // is split where that ends its last wave sooner (split_waves); memory-bound decode tiles are not (a partial last
  // wave of them gets the bandwidth the others leave, so the wave count prices them wrongly; not measured).
  const int ctas = num_seqs * plan.tiles_per_seq * num_kv_heads;
  const int per_sm = gqa ? attn_mma_gqa_ctas_per_sm(dtype, dk, plan.config) : attn_mma_mla_ctas_per_sm(dtype, plan.config);
  const int slots = per_sm * num_sms;
  const int max_by_len = max_seq_len / (2 * bn) > 1 ? max_seq_len / (2 * bn) : 1;
  const int max_splits = max_by_len < 64 ? max_by_len : 64;
  int splits = ctas < slots ? slots / (ctas > 0 ? ctas : 1)
                            : (plan.config == 0 ? 1 : split_waves(ctas, slots, ceil_div(max_seq_len, bn), max_splits));
  splits = splits < max_splits ? splits : max_splits;
  splits = splits > 1 ? splits : 1;
  const int split_tokens = ceil_div(ceil_div(max_seq_len > 0 ? max_seq_len : 1, splits), bn) * bn;
  plan.num_splits = ceil_div(max_seq_len > 0 ? max_seq_len : 1, split_tokens);
  // decode-shaped GQA tiles on sm_90 combine their splits inside the kernel (a cluster per tile): no partials in
  // global memory and no second launch
  plan.cluster_combine = clusters && gqa && plan.config == 0 && plan.num_splits > 1 &&
                         plan.num_splits <= kMaxClusterSplits;
  return plan;
}

cudaError_t attn_launch(AttnParams p, const AttnPlan& plan, DType dtype, cudaStream_t stream) {
  p.tiles_per_seq = plan.tiles_per_seq;
  p.num_splits = plan.num_splits;
  p.cluster_combine = plan.cluster_combine;
  p.block_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((1 << sh) == p.block_size) p.block_shift = sh;
  if (p.num_tokens == 0) return cudaSuccess;
  if (plan.kind == 0) {
    p.num_splits = 1;
    if (dtype == kFloat32) return launch_simt<float>(p, stream);
    if (dtype == kFloat16) return launch_simt<__half>(p, stream);
    return launch_simt<__nv_bfloat16>(p, stream);
  }
  cudaError_t err = plan.kind == 1 ? attn_mma_gqa(p, dtype, plan.config, stream)
                                   : attn_mma_mla(p, dtype, plan.config, stream);
  if (err != cudaSuccess || p.num_splits == 1 || p.cluster_combine) return err;
  return dtype == kFloat16 ? launch_combine<__half>(p, stream) : launch_combine<__nv_bfloat16>(p, stream);
}

}  // namespace ddtree
