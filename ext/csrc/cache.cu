// KV-cache kernels: write_kv (slot_mapping scatter, -1 skipped), generic KV compaction (gather to a workspace,
// then scatter), DDTree compaction (one in-place pass per request), and the tree-mask bit packing.
#include "common.cuh"

namespace ddtree {

namespace {

template <typename V>
__global__ void __launch_bounds__(128) write_kv_copy_kernel(char* cache, const char* rows, int64_t rows_stride_bytes,
                                                            const int64_t* slots, int64_t row_bytes) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const V* src = reinterpret_cast<const V*>(rows + blockIdx.x * rows_stride_bytes);
  V* dst = reinterpret_cast<V*>(cache + slot * row_bytes);
  for (int64_t i = threadIdx.x; i < row_bytes / static_cast<int64_t>(sizeof(V)); i += blockDim.x) dst[i] = src[i];
}

template <typename TC, typename TR>
__global__ void __launch_bounds__(128) write_kv_convert_kernel(TC* cache, const TR* rows, int64_t rows_stride,
                                                               const int64_t* slots, int64_t elems) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const TR* src = rows + blockIdx.x * rows_stride;
  TC* dst = cache + slot * elems;
  for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) dst[i] = Num<TC>::from_f(Num<TR>::to_f(src[i]));
}

template <typename TC>
cudaError_t convert_from(TC* cache, const void* rows, DType rd, int64_t stride, const int64_t* slots, int T,
                         int64_t elems, cudaStream_t stream) {
  if (rd == kFloat32) write_kv_convert_kernel<TC, float><<<T, 128, 0, stream>>>(cache, static_cast<const float*>(rows), stride, slots, elems);
  else if (rd == kFloat16) write_kv_convert_kernel<TC, __half><<<T, 128, 0, stream>>>(cache, static_cast<const __half*>(rows), stride, slots, elems);
  else write_kv_convert_kernel<TC, __nv_bfloat16><<<T, 128, 0, stream>>>(cache, static_cast<const __nv_bfloat16*>(rows), stride, slots, elems);
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

cudaError_t write_kv(void* cache, DType cd, const void* rows, DType rd, int64_t rows_stride, const int64_t* slots,
                     int T, int64_t elems, cudaStream_t stream) {
  if (T == 0 || elems == 0) return cudaSuccess;
  if (cd == rd) {
    const int64_t row_bytes = elems * elem_size(cd), stride_bytes = rows_stride * elem_size(rd);
    int g = granule_of(row_bytes);
    g = g < granule_of(stride_bytes) ? g : granule_of(stride_bytes);
    g = g < granule_of(reinterpret_cast<uintptr_t>(cache)) ? g : granule_of(reinterpret_cast<uintptr_t>(cache));
    g = g < granule_of(reinterpret_cast<uintptr_t>(rows)) ? g : granule_of(reinterpret_cast<uintptr_t>(rows));
    char* c = static_cast<char*>(cache);
    const char* r = static_cast<const char*>(rows);
    if (g == 16) write_kv_copy_kernel<uint4><<<T, 128, 0, stream>>>(c, r, stride_bytes, slots, row_bytes);
    else if (g == 8) write_kv_copy_kernel<uint2><<<T, 128, 0, stream>>>(c, r, stride_bytes, slots, row_bytes);
    else if (g == 4) write_kv_copy_kernel<unsigned><<<T, 128, 0, stream>>>(c, r, stride_bytes, slots, row_bytes);
    else write_kv_copy_kernel<unsigned short><<<T, 128, 0, stream>>>(c, r, stride_bytes, slots, row_bytes);
    return cudaGetLastError();
  }
  if (cd == kFloat32) return convert_from(static_cast<float*>(cache), rows, rd, rows_stride, slots, T, elems, stream);
  if (cd == kFloat16) return convert_from(static_cast<__half*>(cache), rows, rd, rows_stride, slots, T, elems, stream);
  return convert_from(static_cast<__nv_bfloat16*>(cache), rows, rd, rows_stride, slots, T, elems, stream);
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
