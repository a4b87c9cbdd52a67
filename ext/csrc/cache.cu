// KV-cache kernels: write_kv and write_kv_pair (slot_mapping scatter, -1 skipped; K and V in one launch), generic
// KV compaction (gather to a workspace, then scatter), DDTree compaction (one in-place pass per request), and the
// tree-mask bit packing.
#include "common.cuh"

namespace ddtree {

namespace {

// blockIdx.x = token, blockIdx.y = which row set (K, V) of the launch.
template <typename V>
__global__ void __launch_bounds__(128) write_kv_copy_kernel(KvRows a, KvRows b, const int64_t* slots, int64_t esize) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const bool second = blockIdx.y != 0;
  const int64_t row_bytes = (second ? b.row_elems : a.row_elems) * esize;
  const V* src = reinterpret_cast<const V*>(static_cast<const char*>(second ? b.rows : a.rows) +
                                            blockIdx.x * (second ? b.rows_stride : a.rows_stride) * esize);
  V* dst = reinterpret_cast<V*>(static_cast<char*>(second ? b.cache : a.cache) + slot * row_bytes);
  for (int64_t i = threadIdx.x; i < row_bytes / static_cast<int64_t>(sizeof(V)); i += blockDim.x) dst[i] = src[i];
}

template <typename TC, typename TR>
__global__ void __launch_bounds__(128) write_kv_convert_kernel(KvRows a, KvRows b, const int64_t* slots) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const bool second = blockIdx.y != 0;  // field by field: no local copy of a parameter struct
  const int64_t elems = second ? b.row_elems : a.row_elems;
  const TR* src = static_cast<const TR*>(second ? b.rows : a.rows) + blockIdx.x * (second ? b.rows_stride : a.rows_stride);
  TC* dst = static_cast<TC*>(second ? b.cache : a.cache) + slot * elems;
  for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) dst[i] = Num<TC>::from_f(Num<TR>::to_f(src[i]));
}

template <typename TC>
cudaError_t convert_from(const KvRows& a, const KvRows& b, DType rd, const int64_t* slots, dim3 grid,
                         cudaStream_t stream) {
  if (rd == kFloat32) write_kv_convert_kernel<TC, float><<<grid, 128, 0, stream>>>(a, b, slots);
  else if (rd == kFloat16) write_kv_convert_kernel<TC, __half><<<grid, 128, 0, stream>>>(a, b, slots);
  else write_kv_convert_kernel<TC, __nv_bfloat16><<<grid, 128, 0, stream>>>(a, b, slots);
  return cudaGetLastError();
}

int elem_size(DType d) { return d == kFloat32 ? 4 : 2; }

int granule_of(int64_t value) {
  int g = 16;
  while (g > 1 && value % g != 0) g >>= 1;
  return g;
}

template <typename V>
__global__ void __launch_bounds__(128) compact_gather_kernel(CacheList cl, const int64_t* src, const int64_t* dst, char* ws) {
  const int64_t m = blockIdx.x;
  const int c = blockIdx.y;
  const int64_t s = src[m];
  if (s == dst[m]) return;
  const int64_t n = cl.row_bytes[c] / static_cast<int64_t>(sizeof(V));
  const V* from = reinterpret_cast<const V*>(cl.base[c] + s * cl.row_bytes[c]);
  V* to = reinterpret_cast<V*>(ws + m * cl.ws_row_bytes + cl.ws_offset[c]);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

template <typename V>
__global__ void __launch_bounds__(128) compact_scatter_kernel(CacheList cl, const int64_t* src, const int64_t* dst, const char* ws) {
  const int64_t m = blockIdx.x;
  const int c = blockIdx.y;
  const int64_t d = dst[m];
  if (src[m] == d) return;
  const int64_t n = cl.row_bytes[c] / static_cast<int64_t>(sizeof(V));
  const V* from = reinterpret_cast<const V*>(ws + m * cl.ws_row_bytes + cl.ws_offset[c]);
  V* to = reinterpret_cast<V*>(cl.base[c] + d * cl.row_bytes[c]);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

// One block per (request, cache). Each thread owns one column of V across the request's accepted rows and moves
// rows j = 1.. in batches of 8 (loads of a batch before its stores). Safe in place because accepted rows
// strictly increase (acc[j] >= j): no row is read after an earlier pair wrote it.
template <typename V>
__global__ void __launch_bounds__(128) compact_tree_kernel(CacheList cl, const int64_t* __restrict__ accepted, int A,
                                                           const int64_t* __restrict__ tree_slots, int R) {
  const int n = blockIdx.x, c = blockIdx.y;
  const int64_t* acc = accepted + static_cast<int64_t>(n) * A;
  const int64_t* ts = tree_slots + static_cast<int64_t>(n) * R;
  const int64_t rb = cl.row_bytes[c];
  char* base = cl.base[c];
  bool moves = false;  // no-op fast path: the spine in pop order needs no copy
  for (int j = 1; j < A; ++j) {
    const int64_t a = acc[j];
    if (a < 0) break;
    if (a != j) { moves = true; break; }
  }
  if (!moves) return;
  const int64_t nv = rb / static_cast<int64_t>(sizeof(V));
  for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
    bool stop = false;
    for (int j0 = 1; j0 < A && !stop; j0 += 8) {
      V tmp[8];
      int64_t to[8];
      bool mv[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int j = j0 + u;
        const int64_t a = (!stop && j < A) ? acc[j] : -1;
        if (a < 0) stop = true;
        mv[u] = a >= 0 && a != j && a < R && j < R;
        if (mv[u]) {
          tmp[u] = reinterpret_cast<const V*>(base + ts[a] * rb)[i];
          to[u] = ts[j];
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (mv[u]) reinterpret_cast<V*>(base + to[u] * rb)[i] = tmp[u];
    }
  }
}

template <template <typename> class K, typename... Args>
cudaError_t by_granule(int granule, dim3 grid, cudaStream_t stream, Args... args) {
  switch (granule) {
    case 16: K<uint4>::launch(grid, stream, args...); break;
    case 8: K<uint2>::launch(grid, stream, args...); break;
    case 4: K<unsigned>::launch(grid, stream, args...); break;
    case 2: K<unsigned short>::launch(grid, stream, args...); break;
    default: K<unsigned char>::launch(grid, stream, args...); break;
  }
  return cudaGetLastError();
}

template <typename V> struct Gather {
  static void launch(dim3 g, cudaStream_t s, CacheList cl, const int64_t* a, const int64_t* b, char* ws) {
    compact_gather_kernel<V><<<g, 128, 0, s>>>(cl, a, b, ws);
  }
};
template <typename V> struct Scatter {
  static void launch(dim3 g, cudaStream_t s, CacheList cl, const int64_t* a, const int64_t* b, char* ws) {
    compact_scatter_kernel<V><<<g, 128, 0, s>>>(cl, a, b, ws);
  }
};
template <typename V> struct Tree {
  static void launch(dim3 g, cudaStream_t s, CacheList cl, const int64_t* acc, int A, const int64_t* ts, int R) {
    compact_tree_kernel<V><<<g, 128, 0, s>>>(cl, acc, A, ts, R);
  }
};

__global__ void pack_tree_mask_kernel(const bool* mask, int T, int Q, uint64_t* bits) {
  const int W = (Q + 63) / 64;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(T) * W) return;
  const int t = static_cast<int>(i / W), w = static_cast<int>(i % W);
  uint64_t word = 0;
  for (int j = 0; j < 64 && w * 64 + j < Q; ++j)
    if (mask[static_cast<int64_t>(t) * Q + w * 64 + j]) word |= 1ull << j;
  bits[i] = word;
}

}  // namespace

namespace {

int min_granule(int g, int64_t value) {
  const int h = granule_of(value);
  return g < h ? g : h;
}

// `count` row sets (1 or 2) of one launch: grid (tokens, count).
cudaError_t write_rows(const KvRows& a, const KvRows& b, int count, DType cd, DType rd, const int64_t* slots, int T,
                       cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  const dim3 grid(T, count);
  if (cd == rd) {
    const int64_t es = elem_size(cd);
    int g = 16;
    for (int i = 0; i < count; ++i) {
      const KvRows& w = i == 0 ? a : b;
      g = min_granule(g, w.row_elems * es);
      g = min_granule(g, w.rows_stride * es);
      g = min_granule(g, static_cast<int64_t>(reinterpret_cast<uintptr_t>(w.cache)));
      g = min_granule(g, static_cast<int64_t>(reinterpret_cast<uintptr_t>(w.rows)));
    }
    if (g == 16) write_kv_copy_kernel<uint4><<<grid, 128, 0, stream>>>(a, b, slots, es);
    else if (g == 8) write_kv_copy_kernel<uint2><<<grid, 128, 0, stream>>>(a, b, slots, es);
    else if (g == 4) write_kv_copy_kernel<unsigned><<<grid, 128, 0, stream>>>(a, b, slots, es);
    else write_kv_copy_kernel<unsigned short><<<grid, 128, 0, stream>>>(a, b, slots, es);
    return cudaGetLastError();
  }
  if (cd == kFloat32) return convert_from<float>(a, b, rd, slots, grid, stream);
  if (cd == kFloat16) return convert_from<__half>(a, b, rd, slots, grid, stream);
  return convert_from<__nv_bfloat16>(a, b, rd, slots, grid, stream);
}

}  // namespace

cudaError_t write_kv(void* cache, DType cd, const void* rows, DType rd, int64_t rows_stride, const int64_t* slots,
                     int T, int64_t elems, cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  const KvRows a{cache, rows, rows_stride, elems};
  return write_rows(a, a, 1, cd, rd, slots, T, stream);
}

cudaError_t write_kv_pair(const KvRows& k, const KvRows& v, DType cd, DType rd, const int64_t* slots, int T,
                          cudaStream_t stream) {
  if (k.row_elems == 0 && v.row_elems == 0) return cudaSuccess;
  return write_rows(k, v, 2, cd, rd, slots, T, stream);
}

cudaError_t kv_compact(const CacheList& caches, const int64_t* src, const int64_t* dst, int num_pairs, void* workspace,
                       cudaStream_t stream) {
  if (num_pairs == 0 || caches.count == 0) return cudaSuccess;
  const dim3 grid(num_pairs, caches.count);
  char* ws = static_cast<char*>(workspace);
  cudaError_t err = by_granule<Gather>(caches.granule, grid, stream, caches, src, dst, ws);
  if (err != cudaSuccess) return err;
  return by_granule<Scatter>(caches.granule, grid, stream, caches, src, dst, ws);
}

cudaError_t kv_compact_tree(const CacheList& caches, const int64_t* accepted_nodes, int num_reqs, int accepted_width,
                            const int64_t* tree_slots, int num_rows, cudaStream_t stream) {
  if (num_reqs == 0 || caches.count == 0 || accepted_width <= 1) return cudaSuccess;
  return by_granule<Tree>(caches.granule, dim3(num_reqs, caches.count), stream, caches, accepted_nodes,
                          accepted_width, tree_slots, num_rows);
}

cudaError_t pack_tree_mask(const bool* mask, int T, int Q, uint64_t* bits, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(T) * ((Q + 63) / 64);
  if (n == 0) return cudaSuccess;
  pack_tree_mask_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(mask, T, Q, bits);
  return cudaGetLastError();
}

}  // namespace ddtree
