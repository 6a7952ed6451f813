// DDTree kernels: tree build, greedy accept, KV compaction. Each is capturable in a CUDA graph (no
// allocation, no host synchronisation), so a decoding round never waits on the host.
//
// build: one CTA per request. Thread 0 runs the best-first heap exactly as kdev/ddtree.py does: entries
//   (score, rank path, parent), popped best first; score = parent score + log_prob in double, in path
//   order; ties broken on the rank path (lexicographically smaller first; a prefix sorts before its
//   extensions), then on the parent index. The heap lives in shared memory (at most 1 + budget entries).
//   Afterwards all threads fill the outputs; each node's mask row ORs its ancestors' bits, walking up at
//   most 15 parents.
// accept: one warp per request. From the root, the first child (in node order) whose token equals the
//   target's argmax at the current node is accepted (a ballot over the node rows); the first miss ends
//   the walk and that argmax is the bonus token.
// compact: one CTA per request copies accepted node i's row (logical prefix_len + accepted[i]) to slot
//   prefix_len + i. accepted[] is strictly increasing with accepted[i] >= i, so a destination can be the
//   source of an earlier-indexed entry: chunks of 32 rows are read completely into shared memory before
//   any of them is written, and a chunk's writes never touch a later chunk's sources.
#include <cuda_runtime.h>

#include <cstdint>

#include "kdev/ddtree.cuh"
#include "kdev/verify_attn.cuh"

namespace kdtree {
namespace {

struct HeapEntry {
  double score;
  uint16_t ranks[KDTREE_MAX_DEPTH];
  int16_t depth;
  int16_t parent;
};

// a before b in pop order
__device__ bool entry_less(const HeapEntry& a, const HeapEntry& b) {
  if (a.score != b.score) return a.score > b.score;
  const int n = a.depth < b.depth ? a.depth : b.depth;
  for (int i = 0; i < n; ++i)
    if (a.ranks[i] != b.ranks[i]) return a.ranks[i] < b.ranks[i];
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.parent < b.parent;
}

__device__ void heap_push(HeapEntry* h, int& n, const HeapEntry& e) {
  int i = n++;
  while (i > 0) {
    const int up = (i - 1) / 2;
    if (!entry_less(e, h[up])) break;
    h[i] = h[up];
    i = up;
  }
  h[i] = e;
}

__device__ HeapEntry heap_pop(HeapEntry* h, int& n) {
  const HeapEntry top = h[0];
  const HeapEntry last = h[--n];
  int i = 0;
  while (true) {
    const int l = 2 * i + 1, r = l + 1;
    if (l >= n) break;
    const int c = (r < n && entry_less(h[r], h[l])) ? r : l;
    if (!entry_less(h[c], last)) break;
    h[i] = h[c];
    i = c;
  }
  if (n > 0) h[i] = last;
  return top;
}

__global__ void build_ddtree_kernel(DDTreeBuildParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.x;
  const int t_stride = 1 + p.budget;
  HeapEntry* heap = reinterpret_cast<HeapEntry*>(smem);
  double* score = reinterpret_cast<double*>(heap + t_stride);  // per emitted node
  int* s_parent = reinterpret_cast<int*>(score + t_stride);
  int* s_depth = s_parent + t_stride;
  int* s_token = s_depth + t_stride;
  __shared__ int s_count;

  const float* lp = p.log_probs + (size_t)b * p.depth * p.topk;
  const int32_t* ids = p.token_ids + (size_t)b * p.depth * p.topk;
  if (threadIdx.x == 0) {
    int n_heap = 0, count = 1;
    score[0] = 0.0;
    s_parent[0] = -1;
    s_depth[0] = 0;
    s_token[0] = p.root_tokens[b];
    HeapEntry first{};
    first.score = (double)lp[0];
    first.depth = 1;
    first.ranks[0] = 0;
    first.parent = 0;
    heap_push(heap, n_heap, first);
    while (n_heap > 0 && count - 1 < p.budget) {
      const HeapEntry e = heap_pop(heap, n_heap);
      const int idx = count++;
      const int d = e.depth, r = e.ranks[d - 1];
      score[idx] = e.score;
      s_parent[idx] = e.parent;
      s_depth[idx] = d;
      s_token[idx] = ids[(d - 1) * p.topk + r];
      if (r + 1 < p.topk) {  // next sibling: same parent, next rank
        HeapEntry s = e;
        s.ranks[d - 1] = (uint16_t)(r + 1);
        s.score = score[e.parent] + (double)lp[(d - 1) * p.topk + r + 1];
        heap_push(heap, n_heap, s);
      }
      if (d < p.depth) {  // first child
        HeapEntry c = e;
        c.depth = (int16_t)(d + 1);
        c.ranks[d] = 0;
        c.parent = (int16_t)idx;
        c.score = score[idx] + (double)lp[d * p.topk];
        heap_push(heap, n_heap, c);
      }
    }
    s_count = count;
    p.node_count[b] = count;
  }
  __syncthreads();
  const int count = s_count;
  const int L = p.prefix_lens[b];
  for (int i = threadIdx.x; i < t_stride; i += blockDim.x) {
    const size_t row = (size_t)b * t_stride + i;
    uint64_t* mrow = p.tree_mask + row * p.mask_words;
    for (int w = 0; w < p.mask_words; ++w) mrow[w] = 0ull;
    if (i >= count) {  // padding rows: no node
      p.node_tokens[row] = -1;
      p.parents[row] = -1;
      p.depths[row] = -1;
      p.positions[row] = -1;
      continue;
    }
    p.node_tokens[row] = s_token[i];
    p.parents[row] = s_parent[i];
    p.depths[row] = s_depth[i];
    p.positions[row] = L + s_depth[i];
    for (int a = i; a >= 0; a = s_parent[a]) mrow[a / 64] |= 1ull << (a % 64);
  }
}

__global__ void accept_greedy_kernel(AcceptParams p) {
  const int b = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (b >= p.batch) return;
  const int lane = threadIdx.x % 32;
  const size_t base = (size_t)b * p.t_stride;
  const int count = p.node_count[b];
  int cur = 0, len = 1;
  if (lane == 0) p.accepted[base] = 0;
  while (true) {
    const int want = p.target_argmax[base + cur];
    int found = -1;
    for (int i0 = cur + 1; i0 < count && found < 0; i0 += 32) {  // children come after their parent
      const int i = i0 + lane;
      const bool hit = i < count && p.parents[base + i] == cur && p.node_tokens[base + i] == want;
      const unsigned m = __ballot_sync(0xffffffffu, hit);
      if (m) found = i0 + __ffs(m) - 1;
    }
    if (found < 0) {
      if (lane == 0) {
        p.accept_len[b] = len;
        p.bonus_token[b] = want;
      }
      break;
    }
    if (lane == 0) p.accepted[base + len] = found;
    ++len;
    cur = found;
  }
  for (int i = len + lane; i < p.t_stride; i += 32) p.accepted[base + i] = -1;
}

constexpr int kCompactChunk = 32;
constexpr int kCompactThreads = 256;

__global__ void __launch_bounds__(kCompactThreads) compact_kv_kernel(CompactParams p) {
  __shared__ __align__(16) uint4 rows[kCompactChunk][KDTREE_QK_DIM * 2 / 16];  // 36,864 B
  constexpr int kVecs = KDTREE_QK_DIM * 2 / 16;                                  // 72 x 16 B per row
  const int b = blockIdx.x;
  const int n = p.accept_len[b];
  const int L = p.prefix_lens[b];
  const int32_t* pages = p.page_table + (size_t)b * p.max_pages;
  const int32_t* acc = p.accepted + (size_t)b * p.t_stride;
  uint4* kv = static_cast<uint4*>(p.kv_cache);
  auto slot = [&](int pos) -> size_t {
    return ((size_t)pages[pos / p.page_size] * p.page_size + pos % p.page_size) * kVecs;
  };
  for (int c0 = 0; c0 < n; c0 += kCompactChunk) {
    const int rows_here = n - c0 < kCompactChunk ? n - c0 : kCompactChunk;
    for (int i = threadIdx.x; i < rows_here * kVecs; i += blockDim.x) {
      const int r = i / kVecs, v = i % kVecs;
      rows[r][v] = kv[slot(L + acc[c0 + r]) + v];
    }
    __syncthreads();  // every source of this chunk is read before any destination is written
    for (int i = threadIdx.x; i < rows_here * kVecs; i += blockDim.x) {
      const int r = i / kVecs, v = i % kVecs;
      kv[slot(L + c0 + r) + v] = rows[r][v];
    }
    __syncthreads();
  }
}

}  // namespace

size_t build_ddtree_smem_bytes(int budget) {
  const size_t t = 1 + (size_t)budget;
  return t * sizeof(HeapEntry) + t * sizeof(double) + 3 * t * sizeof(int);
}

cudaError_t launch_build_ddtree(const DDTreeBuildParams& p, cudaStream_t stream) {
  const size_t smem = build_ddtree_smem_bytes(p.budget);
  cudaError_t err = cudaFuncSetAttribute(build_ddtree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  build_ddtree_kernel<<<p.batch, 256, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_accept_greedy(const AcceptParams& p, cudaStream_t stream) {
  const int warps = 4;
  accept_greedy_kernel<<<(p.batch + warps - 1) / warps, warps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_compact_kv(const CompactParams& p, cudaStream_t stream) {
  compact_kv_kernel<<<p.batch, kCompactThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kdtree
