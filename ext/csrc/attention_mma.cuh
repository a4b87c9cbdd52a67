// Tensor-core (mma.sync m16n8k16, bf16/fp16) paged attention for tree verify, decode and chunked prefill.
// One CTA = one (sequence, query tile, kv head, KV split). Query rows are packed (token, head-in-group), so
// GQA heads sharing a kv head, and MLA's heads sharing the one latent head, read each KV tile once. Warps
// form a WM x WN grid: warp (wm, wn) computes S for rows wm*16.. and KV columns wn*BN/WN.., the row max and
// sum are exchanged through shared memory, P goes to shared memory as bf16/fp16, and the same warp then owns
// output columns wn*DV/WN... KV tiles of BN tokens are gathered through the block table with cp.async, two
// stages deep; positions past the split end are zero-filled (never read), so NaN in unused cache slots
// cannot leak. Masking is applied only to tiles that reach the new tokens (the tree / causal block) or the
// split end: the context prefix is fully visible.
// WG (sm_90a, GQA, a warpgroup per 64 rows, WN = 1): S and P V run as warpgroup MMAs (wgmma.cuh) from
// the Q and P fragments in registers and the K / V tiles in 128B-swizzled shared memory; the rest is shared.
#pragma once
#include "attention_cluster.cuh"
#include "attention_store.cuh"
#include "common.cuh"
#include "wgmma.cuh"

namespace ddtree {

template <int DK, int DV, int WM, int WN, int BN, bool SHARED_KV, int ELEM, int STAGES, bool WG = false>
struct MmaCfg {
  static constexpr int BM = 16 * WM, NWARPS = WM * WN, NTHREADS = 32 * NWARPS;
  static constexpr int KSTR = DK + 8;                         // smem row strides (elements): +16 B per row
  static constexpr int VSTR = SHARED_KV ? KSTR : DV + 8;      //   keeps ldmatrix rows on distinct banks
  static constexpr int PSTR = BN + 8;
  static constexpr bool QREG = DK <= 128;                     // keep the Q fragments in registers
  static constexpr int S_COLS = BN / WN, S_NT = S_COLS / 8;   // S columns per warp, as n8 tiles
  static constexpr int O_COLS = DV / WN, O_NT = O_COLS / 8;   // output columns per warp, as n8 tiles
  static constexpr int Q_ELEMS = BM * KSTR, K_ELEMS = STAGES * BN * KSTR;
  // WN == 1: a warp owns whole rows, so P stays in registers (its S fragments are the PV A fragments)
  static constexpr int V_ELEMS = SHARED_KV ? 0 : STAGES * BN * VSTR, P_ELEMS = WN > 1 ? BM * PSTR : 0;
  // WG: swizzled tiles start 1024-byte aligned; stages stay padded (a pass without sm_90a runs WG as mma.sync)
  static constexpr size_t ALIGN_SLACK = WG ? 1024 : 0;
  static constexpr size_t SMEM = static_cast<size_t>(Q_ELEMS + K_ELEMS + V_ELEMS + P_ELEMS) * ELEM +
                                 2 * WN * BM * sizeof(float) + ALIGN_SLACK;
  static_assert(S_NT % 2 == 0 && O_NT % 2 == 0 && DK % 16 == 0 && BN % 16 == 0, "tile shape");
  static_assert(SHARED_KV || DK == DV, "separate K and V caches share a head dim");
  static_assert(STAGES >= 2, "cp.async pipeline depth");
  static_assert(!WG || (WM % 4 == 0 && WN == 1 && !SHARED_KV && BN == 64 && DK % 64 == 0 && (DV == 64 || DV == 128) &&
                        Q_ELEMS * ELEM % 1024 == 0 && K_ELEMS * ELEM % 1024 == 0 && ELEM == 2),
                "warpgroup tiles: 64 rows a warpgroup, 64 keys, 1024-byte aligned stages");
};

template <typename T, int DK, int DV, int WM, int WN, int BN, bool SHARED_KV, int STAGES, bool WG>
__global__ void __launch_bounds__(32 * WM * WN) attn_mma_kernel(const AttnParams p) {
  using C = MmaCfg<DK, DV, WM, WN, BN, SHARED_KV, sizeof(T), STAGES, WG>;
  constexpr bool kWG = WG && kWgmmaCompiled;  // a pass without sm_90a (sm_90 beside it) runs WG as mma.sync
  // The next kernel (the GEMV) may start at once; a combine kernel only after the KV loop (attention.cu)
  const bool combine_follows = p.num_splits > 1 && !p.cluster_combine;
  if (!combine_follows) pdl_trigger();
  constexpr int BM = C::BM, KSTR = C::KSTR, VSTR = C::VSTR, PSTR = C::PSTR, NTHREADS = C::NTHREADS;
  extern __shared__ __align__(16) unsigned char smem_dyn[];
  unsigned char* smem_raw = smem_dyn;
  if constexpr (kWG) {  // the slack in C::SMEM: round the shared address up to 1024 bytes
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dyn));
    smem_raw += ((a + 1023u) & ~1023u) - a;
  }
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + C::Q_ELEMS;
  T* Vs = SHARED_KV ? Ks : Ks + C::K_ELEMS;
  T* Ps = Ks + C::K_ELEMS + C::V_ELEMS;
  float* red_max = reinterpret_cast<float*>(Ps + C::P_ELEMS);  // [WN][BM]
  float* red_sum = red_max + WN * BM;                           // [WN][BM]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane >> 2, tq = lane & 3;

  const int seq = blockIdx.x / p.tiles_per_seq, tile = blockIdx.x % p.tiles_per_seq;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int q0 = p.query_start_loc[seq], qlen = p.query_start_loc[seq + 1] - q0;
  const int rows_total = qlen * p.group;
  const int row0 = tile * BM;
  if (row0 >= rows_total) return;
  const int kv_len = p.seq_lens[seq], ctx = kv_len - qlen;
  const int last_tok = (min(row0 + BM, rows_total) - 1) / p.group;
  const int kv_end = p.tree_bits ? kv_len : min(kv_len, ctx + last_tok + 1);
  // Splits spread over this tile's own KV length, not the plan's (a CUDA graph's capacity, which would leave most
  // empty), in whole KV tiles, >= 2 a split: 9 tiles over 6 splits make 5 of 2 (dividing keys made 3 of 3, 3 idle).
  const int tiles = (kv_end + BN - 1) / BN;
  const int split_tokens = max(2, (tiles + p.num_splits - 1) / p.num_splits) * BN;
  const int s_begin = split * split_tokens;
  const int s_end = min(kv_end, s_begin + split_tokens);
  // Before the PDL wait: the metadata reads above and the split's block-table lines into L1, never the previous
  // kernel's output (rope, or a torch kernel that completes before this launch) and written by kernels that have
  // completed (every programmatic dependent but this one, never followed by another, waits before releasing its
  // own). q, the KV cache and stores wait. Decode 4.53 vs 4.56-4.57 ms (docs/BENCHMARKS.md, 2026-12-04).
  const int* bt = p.block_tables + static_cast<int64_t>(seq) * p.bt_stride;
  auto block_of = [&](int pos) { return p.block_shift >= 0 ? pos >> p.block_shift : pos / p.block_size; };
  if (s_begin < s_end) {  // every 128-byte line the split's entries touch
    const char* first = reinterpret_cast<const char*>(bt + block_of(s_begin));
    const char* last = reinterpret_cast<const char*>(bt + block_of(s_end - 1));
    for (const char* line = first - (reinterpret_cast<uintptr_t>(first) & 127) + 128 * threadIdx.x; line <= last;
         line += 128 * NTHREADS)
      prefetch_l1(line);
  }
  pdl_wait();
  if (s_begin >= s_end) {  // nothing of this tile in this split: mark its rows empty for the combine
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (!SHARED_KV) {
      if (p.cluster_combine) {
        float* plse = reinterpret_cast<float*>(smem_raw) + BM * DV;
        for (int r = tid; r < BM; r += NTHREADS) plse[r] = -CUDART_INF_F;
        cluster_combine<T, BM, DV, NTHREADS>(p, reinterpret_cast<float*>(smem_raw), plse, q0, row0, rows_total, kvh);
        return;
      }
    }
#endif
    for (int r = tid; r < BM; r += NTHREADS) {
      const int pr = row0 + r;
      if (pr < rows_total) {
        const int t = q0 + pr / p.group, h = kvh * p.group + pr % p.group;
        p.lse_part[(static_cast<int64_t>(split) * p.num_tokens + t) * p.num_q_heads + h] = -CUDART_INF_F;
      }
    }
    return;
  }

  // Q tile -> smem (rows past the sequence's last packed row are zero-filled).
  {
    constexpr int CPR = DK / 8;
    for (int c = tid; c < BM * CPR; c += NTHREADS) {
      const int r = c / CPR, col = (c % CPR) * 8;
      const int pr = row0 + r;
      const bool ok = pr < rows_total;
      const int tok = ok ? pr / p.group : 0, h = kvh * p.group + (ok ? pr % p.group : 0);
      const T* src = col < p.qa_dim
                         ? static_cast<const T*>(p.q_a) + static_cast<int64_t>(q0 + tok) * p.qa_stride_t +
                               static_cast<int64_t>(h) * p.qa_stride_h + col
                         : static_cast<const T*>(p.q_b) + static_cast<int64_t>(q0 + tok) * p.qb_stride_t +
                               static_cast<int64_t>(h) * p.qb_stride_h + (col - p.qa_dim);
      cp_async_16(Qs + r * KSTR + col, src, ok);
    }
  }
  // Each thread gathers the same 16-byte columns of K and V for its tokens: one block-table lookup per token.
  constexpr int KROW = kWG ? DK : KSTR, VROW = kWG ? DV : VSTR;  // a stage's elements per key (kWG: unpadded)
  auto load_kv = [&](int stage, int pos0) {
    constexpr int KCPR = DK / 8, CHUNKS = BN * KCPR;
    T* ks = Ks + stage * BN * KROW;
    T* vs = Vs + stage * BN * VROW;
#pragma unroll
    for (int c0 = 0; c0 < CHUNKS; c0 += NTHREADS) {
      const int c = c0 + tid;
      if (CHUNKS % NTHREADS != 0 && c >= CHUNKS) break;
      const int r = c / KCPR, col = (c % KCPR) * 8;
      const int pos = pos0 + r;
      const bool ok = pos < s_end;
      int64_t slot = 0;
      if (ok) {
        const int blk = block_of(pos);
        const int off = p.block_shift >= 0 ? pos & (p.block_size - 1) : pos - blk * p.block_size;
        slot = static_cast<int64_t>(bt[blk]) * p.block_size + off;
      }
      // kWG: column block col / 64 of the swizzled layout (wgmma.cuh), else padded rows
      const uint32_t dst = kWG ? (col / 64) * BN * 128 + sw128_offset(r, (col % 64) / 8)
                              : static_cast<uint32_t>((r * KSTR + col) * sizeof(T));
      const T* k_src =
          static_cast<const T*>(p.k) + slot * p.k_stride_slot + static_cast<int64_t>(kvh) * p.k_stride_head;
      cp_async_16(reinterpret_cast<unsigned char*>(ks) + dst, k_src + col, ok);
      if constexpr (!SHARED_KV) {
        const uint32_t vdst = kWG ? dst : static_cast<uint32_t>((r * VSTR + col) * sizeof(T));
        const T* v_src =
            static_cast<const T*>(p.v) + slot * p.v_stride_slot + static_cast<int64_t>(kvh) * p.v_stride_head;
        cp_async_16(reinterpret_cast<unsigned char*>(vs) + vdst, v_src + col, ok);
      }
    }
  };

  float o[C::O_NT][4];
#pragma unroll
  for (int i = 0; i < C::O_NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_r[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_r[2] = {0.f, 0.f};
  const int ntiles = (s_end - s_begin + BN - 1) / BN;
  const int rbase = wm * 16;
  auto load_q = [&](uint32_t (&frag)[C::QREG ? DK / 16 : 1][4]) {
#pragma unroll
    for (int kk = 0; kk < (C::QREG ? DK / 16 : 0); ++kk)
      ldmatrix_x4(frag[kk], Qs + (rbase + (lane & 15)) * KSTR + kk * 16 + (lane >> 4) * 8);
  };

  // One tile's scores scaled and masked, the running max updated (corr rescales o and l) and P = exp2(S - max)
  // left in s (WN > 1: in shared memory for the P V warps); rs = the warp's row sums of P.
  auto softmax_tile = [&](float (&s)[C::S_NT][4], int pos0, float (&corr)[2], float (&rs)[2]) {
#pragma unroll
    for (int nt = 0; nt < C::S_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;

    if (pos0 + BN > ctx || pos0 + BN > s_end) {  // tile reaches the new tokens or the split end
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int pr = row0 + rbase + g + hr * 8;
        const int tok = min(pr / p.group, qlen - 1);  // padding rows borrow the last token's mask
        const uint64_t* bits = p.tree_bits ? p.tree_bits + static_cast<int64_t>(q0 + tok) * p.tree_words : nullptr;
#pragma unroll
        for (int nt = 0; nt < C::S_NT; ++nt)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int pos = pos0 + wn * C::S_COLS + nt * 8 + tq * 2 + e2;
            bool ok = pos < s_end;
            if (ok && pos >= ctx) {
              const int j = pos - ctx;
              ok = bits ? ((bits[j >> 6] >> (j & 63)) & 1ull) != 0 : j <= tok;
            }
            if (!ok) s[nt][hr * 2 + e2] = -CUDART_INF_F;
          }
      }
    }

    // Online softmax: row max over the whole tile (exchanged across the WN column warps).
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int nt = 0; nt < C::S_NT; ++nt) {
      mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
      mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
    }
    if constexpr (WN > 1) {
      if (tq == 0) {
        red_max[wn * BM + rbase + g] = mx[0];
        red_max[wn * BM + rbase + g + 8] = mx[1];
      }
      __syncthreads();
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float v = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < WN; ++w) v = fmaxf(v, red_max[w * BM + rbase + g + hr * 8]);
        mx[hr] = v;
      }
    }
    float mu[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float mn = fmaxf(m_r[hr], mx[hr]);
      mu[hr] = mn == -CUDART_INF_F ? 0.f : mn;
      corr[hr] = exp2f(m_r[hr] - mu[hr]);
      m_r[hr] = mn;
    }
    rs[0] = rs[1] = 0.f;
    T* prow = Ps + (rbase + g) * PSTR + wn * C::S_COLS + tq * 2;
#pragma unroll
    for (int nt = 0; nt < C::S_NT; ++nt) {
      const float p0 = exp2f(s[nt][0] - mu[0]), p1 = exp2f(s[nt][1] - mu[0]);
      const float p2 = exp2f(s[nt][2] - mu[1]), p3 = exp2f(s[nt][3] - mu[1]);
      rs[0] += p0 + p1;
      rs[1] += p2 + p3;
      if constexpr (WN > 1) {
        *reinterpret_cast<uint32_t*>(prow + nt * 8) = Num<T>::pack2(p0, p1);
        *reinterpret_cast<uint32_t*>(prow + 8 * PSTR + nt * 8) = Num<T>::pack2(p2, p3);
      } else {
        s[nt][0] = p0; s[nt][1] = p1; s[nt][2] = p2; s[nt][3] = p3;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 1);
      rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 2);
    }
  };

  if constexpr (kWG) {
    wg_kv_loop<T, DK, DV, BN, STAGES>(ntiles, s_begin, Ks, Vs, load_kv, load_q, softmax_tile, o, l_r);
  } else {
    uint32_t qf[C::QREG ? DK / 16 : 1][4];  // loaded once: mma.sync reads them synchronously
    // STAGES-deep cp.async pipeline: group g carries tile g (group 0 also the Q tile); empty groups keep the
    // count uniform, so wait_group<STAGES-1> always means "tile it has landed".
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (st < ntiles) load_kv(st, s_begin + st * BN);
      cp_async_commit();
    }
    for (int it = 0; it < ntiles; ++it) {
      const int stage = it % STAGES, pos0 = s_begin + it * BN;
      if (it + STAGES - 1 < ntiles) load_kv((it + STAGES - 1) % STAGES, pos0 + (STAGES - 1) * BN);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      if constexpr (C::QREG) {
        if (it == 0) load_q(qf);
      }

      // S = Q K^T for this warp's 16 rows x S_COLS columns.
      float s[C::S_NT][4];
#pragma unroll
      for (int i = 0; i < C::S_NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      const T* ks = Ks + stage * BN * KROW;
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        uint32_t a[4];
        if constexpr (C::QREG) {
          a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
        } else {
          ldmatrix_x4(a, Qs + (rbase + (lane & 15)) * KSTR + kk * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int nt = 0; nt < C::S_NT; nt += 2) {
          const int n0 = wn * C::S_COLS + nt * 8;
          uint32_t b[4];
          ldmatrix_x4(b, ks + (n0 + ((lane >> 4) << 3) + (lane & 7)) * KSTR + kk * 16 + ((lane >> 3) & 1) * 8);
          mma16816<T>(s[nt], a, b[0], b[1]);
          mma16816<T>(s[nt + 1], a, b[2], b[3]);
        }
      }
      float corr[2], rs[2];
      softmax_tile(s, pos0, corr, rs);
      if constexpr (WN > 1) {
        if (tq == 0) {
          red_sum[wn * BM + rbase + g] = rs[0];
          red_sum[wn * BM + rbase + g + 8] = rs[1];
        }
      }
#pragma unroll
      for (int nt = 0; nt < C::O_NT; ++nt) {
        o[nt][0] *= corr[0]; o[nt][1] *= corr[0];
        o[nt][2] *= corr[1]; o[nt][3] *= corr[1];
      }
      if constexpr (WN > 1) __syncthreads();  // P and the partial sums are visible
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float tot = rs[hr];
        if constexpr (WN > 1) {
          tot = 0.f;
#pragma unroll
          for (int w = 0; w < WN; ++w) tot += red_sum[w * BM + rbase + g + hr * 8];
        }
        l_r[hr] = l_r[hr] * corr[hr] + tot;
      }

      // O += P V for this warp's 16 rows x O_COLS columns.
      const T* vs = Vs + stage * BN * VROW;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        if constexpr (WN > 1) {
          ldmatrix_x4(a, Ps + (rbase + (lane & 15)) * PSTR + kk * 16 + (lane >> 4) * 8);
        } else {
          a[0] = Num<T>::pack2(s[2 * kk][0], s[2 * kk][1]);
          a[1] = Num<T>::pack2(s[2 * kk][2], s[2 * kk][3]);
          a[2] = Num<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          a[3] = Num<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
#pragma unroll
        for (int nt = 0; nt < C::O_NT; nt += 2) {
          const int n0 = wn * C::O_COLS + nt * 8;
          uint32_t b[4];
          ldmatrix_x4_trans(b, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VSTR + n0 + (lane >> 4) * 8);
          mma16816<T>(o[nt], a, b[0], b[1]);
          mma16816<T>(o[nt + 1], a, b[2], b[3]);
        }
      }
      __syncthreads();  // everyone is done with this stage, P and the exchange buffers
    }
  }
  if (combine_follows) pdl_trigger();

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (!SHARED_KV) {
    if (p.cluster_combine) {  // partials into this CTA's shared memory (the KV tiles are dead), then the cluster
      static_assert(C::SMEM >= (BM * DV + BM) * sizeof(float), "cluster partials fit in the tile buffers");
      float* po = reinterpret_cast<float*>(smem_raw);
      float* plse = po + BM * DV;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = rbase + g + hr * 8;
        const float inv = l_r[hr] > 0.f ? 1.f / l_r[hr] : 0.f;
#pragma unroll
        for (int nt = 0; nt < C::O_NT; ++nt) {
          const int col = wn * C::O_COLS + nt * 8 + tq * 2;
          po[r * DV + col] = o[nt][hr * 2] * inv;
          po[r * DV + col + 1] = o[nt][hr * 2 + 1] * inv;
        }
        if (wn == 0 && tq == 0) plse[r] = l_r[hr] > 0.f ? m_r[hr] + log2f(l_r[hr]) : -CUDART_INF_F;
      }
      cluster_combine<T, BM, DV, NTHREADS>(p, po, plse, q0, row0, rows_total, kvh);
      return;
    }
  }
#endif
  store_tile_rows<T, DV, C::O_NT>(p, o, m_r, l_r, row0 + rbase + g, rows_total, q0, kvh, split, wn * C::O_COLS, tq);
}

}  // namespace ddtree
