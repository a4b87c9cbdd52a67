// Hopper warpgroup MMA (wgmma, sm_90a) primitives for the tensor-core attention (attention_mma.cuh, WG = true):
// the 128-byte swizzled shared-memory layout its B operands are read from, their matrix descriptors, and the
// register-A wgmma shapes the kernel issues (S = Q K^T with N = 64 keys, O += P V with N = the value width).
//
// Layout of a B tile of R rows x C columns (K rows of keys x head dims, or V the same way): C / 64 column blocks,
// each R rows of 128 bytes; inside each 8-row, 1024-byte atom the 16-byte chunk c of row r sits at chunk c ^ (r % 8)
// (the hardware's 128B swizzle, applied to the absolute shared address, so every block starts 1024-byte aligned).
// Read as K-major (S: a key's head dims are contiguous) and as MN-major (P V: a key's value dims are contiguous).
// The wgmma calls compile to nothing unless the pass targets sm_90a (__CUDA_ARCH_FEAT_SM90_ALL, kWgmmaCompiled);
// the host plans WG tiles where attn_wgmma_built() and the device is compute capability 9.0.
#pragma once
#include <type_traits>

#include "common.cuh"

namespace ddtree {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaCompiled = true;   // this device pass can issue wgmma
#else
constexpr bool kWgmmaCompiled = false;  // host pass, or a device pass for another target
#endif

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside one swizzled column block.
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// A shared-memory matrix descriptor for the 128B-swizzled layout: `lbo` / `sbo` in bytes (K-major: lbo unused,
// sbo = 1024 between 8-row groups; MN-major: lbo = the column blocks' stride, sbo = 1024 between 8-key groups).
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Shared memory written by cp.async (the generic proxy) made visible to wgmma's reads (the async proxy); each
// writing thread fences before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Accumulators are written asynchronously until wgmma_wait<n>(): this pins every later read (and every earlier
// write) of `d` to its side of the wait, which the compiler cannot see through the asm.
template <int NT>
__device__ __forceinline__ void wgmma_pin(float (&d)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

#define DDTREE_WGMMA_D64(d)  \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

#define DDTREE_WGMMA_D128(d)  \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), \
  "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
  "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), \
  "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), \
  "+f"(d[15][3])

// One register-A wgmma: outputs OUTS (the accumulators' "+f" list), then a[4], desc_b, scale-d = 1, trans-b, whose
// operand numbers follow the accumulators'.
#define DDTREE_WGMMA_RS(SHAPE, TY, DREGS, AREGS, DESC, SCALE, TRANS, OUTS)                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE ", 0;\n"                                           \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" DREGS "}, " AREGS ", %" DESC      \
               ", p, 1, 1, %" TRANS ";\n}\n"                                                                 \
               : OUTS                                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(TRANS_B))
#define DDTREE_WGMMA_R32 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31"
#define DDTREE_WGMMA_R64 \
  DDTREE_WGMMA_R32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51," \
  "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"

// d[N / 8][4] (+)= a (the warpgroup's 64 x 16 A fragments, one m16k16 fragment a warp) x B (16 x N, descriptor).
template <typename T, int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "wgmma widths instantiated here");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 64 && kHalf) {
    DDTREE_WGMMA_RS("m64n64k16", "f16", DDTREE_WGMMA_R32, "{%32,%33,%34,%35}", "36", "37", "38", DDTREE_WGMMA_D64(d));
  } else if constexpr (N == 64) {
    DDTREE_WGMMA_RS("m64n64k16", "bf16", DDTREE_WGMMA_R32, "{%32,%33,%34,%35}", "36", "37", "38", DDTREE_WGMMA_D64(d));
  } else if constexpr (kHalf) {
    DDTREE_WGMMA_RS("m64n128k16", "f16", DDTREE_WGMMA_R64, "{%64,%65,%66,%67}", "68", "69", "70",
                    DDTREE_WGMMA_D128(d));
  } else {
    DDTREE_WGMMA_RS("m64n128k16", "bf16", DDTREE_WGMMA_R64, "{%64,%65,%66,%67}", "68", "69", "70",
                    DDTREE_WGMMA_D128(d));
  }
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {  // at most N of this warp's latest wgmma groups still pending
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// The warpgroup tiles' KV loop (attention_mma.cuh, kWG), software-pipelined over three stages: tile it's softmax
// runs while P V of tile it - 1 is on the tensor cores, S of tile it + 1 is issued together with P V of tile it,
// and tile it + 2 loads meanwhile. S = Q K^T reads the Q fragments (reloaded every tile) and the K stage K-major;
// P V reads P packed from the S accumulators' layout (which is the A fragments') and the V stage MN-major
// (transposed): 16 keys a call, column blocks BN * 128 bytes apart. load_kv(stage, pos0) issues a tile's
// cp.async copies; load_q(qf) the Q fragments; softmax(s, pos0, corr, rs) the tile's online softmax (P in s).
template <typename T, int DK, int DV, int BN, int STAGES, typename LoadKV, typename LoadQ, typename Softmax>
__device__ __forceinline__ void wg_kv_loop(int ntiles, int s_begin, const T* Ks, const T* Vs, LoadKV& load_kv,
                                           LoadQ& load_q, Softmax& softmax, float (&o)[DV / 8][4], float (&l_r)[2]) {
  static_assert(STAGES == 3, "S of the next tile, P V of this one, the tile after loading");
  float s[BN / 8][4];
  uint32_t qf[DK / 16][4], pa[BN / 16][4];
  auto zero_s = [&] {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
  };
  auto issue_s = [&](int stage) {  // 16 head dims a call: column block kk / 4, 32 bytes into its rows
    const T* ks = Ks + stage * BN * DK;
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk)
      wgmma_rs<T, BN, 0>(s, qf[kk], sw128_desc(ks + (kk / 4) * BN * 64 + (kk % 4) * 16, 16, 1024));
  };
  load_kv(0, s_begin);  // group 0 also carries the Q tile
  cp_async_commit();
  if (ntiles > 1) load_kv(1, s_begin + BN);
  cp_async_commit();
  cp_async_wait<1>();
  fence_proxy_async_shared();
  __syncthreads();
  load_q(qf);
  zero_s();
  wgmma_fence();
  issue_s(0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_pin(s);
  // Tile it's softmax (overlapping P V of tile it - 1), then, that P V done, P packed and o, l rescaled.
  auto softmax_and_pack = [&](int it) {
    float corr[2], rs[2];
    softmax(s, s_begin + it * BN, corr, rs);
    wgmma_wait<0>();
    wgmma_pin(o);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = Num<T>::pack2(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = Num<T>::pack2(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = Num<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = Num<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
#pragma unroll
    for (int nt = 0; nt < DV / 8; ++nt) {
      o[nt][0] *= corr[0]; o[nt][1] *= corr[0];
      o[nt][2] *= corr[1]; o[nt][3] *= corr[1];
    }
    l_r[0] = l_r[0] * corr[0] + rs[0];
    l_r[1] = l_r[1] * corr[1] + rs[1];
    wgmma_pin(o);
  };
  auto issue_pv = [&](int it) {
    const T* vs = Vs + (it % STAGES) * BN * DV;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<T, DV, 1>(o, pa[kk], sw128_desc(vs + kk * 16 * 64, BN * 128, 1024));
    wgmma_commit();
  };
  // Every wgmma below is issued unconditionally between its fence and its wait (a conditional one makes ptxas
  // serialize them all, C7514): the last tile is peeled.
  for (int it = 0; it + 1 < ntiles; ++it) {
    softmax_and_pack(it);
    cp_async_wait<0>();  // tile it + 1 has landed
    fence_proxy_async_shared();
    __syncthreads();  // ... for every warp, and every warpgroup is done with tile it - 1's stage
    if (it + 2 < ntiles) load_kv((it + 2) % STAGES, s_begin + (it + 2) * BN);
    cp_async_commit();
    load_q(qf);
    zero_s();
    wgmma_fence();
    issue_s((it + 1) % STAGES);
    wgmma_commit();
    issue_pv(it);
    wgmma_wait<1>();  // S of tile it + 1 (committed before this P V)
    wgmma_pin(s);
  }
  softmax_and_pack(ntiles - 1);
  wgmma_fence();
  issue_pv(ntiles - 1);
  wgmma_wait<0>();
  wgmma_pin(o);
}

}  // namespace ddtree
