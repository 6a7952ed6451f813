// DDTree kernels: tree build, greedy accept, KV compaction. Each is capturable in a CUDA graph (no
// allocation, no host synchronisation), so a decoding round never waits on the host.
//
// build: one CTA per request. All threads stage the reachable log-probs in shared memory; thread 0 then
//   runs the best-first heap exactly as kdev/ddtree.py does: entries (score, parent, depth, rank), popped
//   best first; score = parent score + log_prob in double, in path order; ties broken on the rank path
//   (lexicographically smaller first; a prefix sorts before its extensions; rebuilt from the parent chain
//   only when scores tie), then on the parent index. The heap lives in shared memory (at most 1 + budget
//   entries of 16 bytes). Afterwards all threads fill the outputs; each node's mask row holds its own and
//   its ancestors' bits (at most 16).
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

// A heap entry is 16 bytes: the rank path is not stored but rebuilt from the emitted parent chain when two
// scores tie (rare), so sift steps move 16 bytes instead of a 48-byte path-carrying entry.
struct HeapEntry {
  double score;
  int16_t parent;  // emitted node index of the parent
  int16_t depth;   // 1..D
  int16_t rank;    // rank at this depth (index into the parent's top-k)
  int16_t pad;
};

struct Tree {
  const int16_t* parent;  // per emitted node
  const int16_t* rank;    // per emitted node (unused for the root)
};

// rank path of an entry: its parent's path, then its own rank
__device__ void rank_path(const HeapEntry& e, const Tree& t, int (&path)[KDTREE_MAX_DEPTH]) {
  path[e.depth - 1] = e.rank;
  int n = e.parent;
  for (int k = e.depth - 2; k >= 0; --k) {
    path[k] = t.rank[n];
    n = t.parent[n];
  }
}

// a before b in pop order: higher score; on a tie the lexicographically smaller rank path (a prefix before
// its extensions), then the smaller parent index -- exactly kdev/ddtree.py's heap order
__device__ bool entry_less(const HeapEntry& a, const HeapEntry& b, const Tree& t) {
  if (a.score != b.score) return a.score > b.score;
  int pa[KDTREE_MAX_DEPTH], pb[KDTREE_MAX_DEPTH];
  rank_path(a, t, pa);
  rank_path(b, t, pb);
  const int n = a.depth < b.depth ? a.depth : b.depth;
  for (int i = 0; i < n; ++i)
    if (pa[i] != pb[i]) return pa[i] < pb[i];
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.parent < b.parent;
}

__device__ void heap_push(HeapEntry* h, int& n, const HeapEntry& e, const Tree& t) {
  int i = n++;
  while (i > 0) {
    const int up = (i - 1) / 2;
    if (!entry_less(e, h[up], t)) break;
    h[i] = h[up];
    i = up;
  }
  h[i] = e;
}

__device__ HeapEntry heap_pop(HeapEntry* h, int& n, const Tree& t) {
  const HeapEntry top = h[0];
  const HeapEntry last = h[--n];
  int i = 0;
  while (true) {
    const int l = 2 * i + 1, r = l + 1;
    if (l >= n) break;
    const int c = (r < n && entry_less(h[r], h[l], t)) ? r : l;
    if (!entry_less(h[c], last, t)) break;
    h[i] = h[c];
    i = c;
  }
  if (n > 0) h[i] = last;
  return top;
}

// Ranks that a build can reach: a node of rank r has r elder siblings in the tree, so r < budget and a
// sibling push reads rank <= budget. Only these log-probs are staged in shared memory.
__host__ __device__ inline int staged_ranks(int topk, int budget) { return topk < budget + 1 ? topk : budget + 1; }

struct BuildSmem {  // carve-up of the dynamic shared memory (sizes in build_ddtree_smem_bytes)
  HeapEntry* heap;  // 1 + budget
  double* score;    // 1 + budget, per emitted node
  float* lp;        // depth x staged_ranks
  int16_t* parent;  // 1 + budget
  int16_t* depth;   // 1 + budget
  int16_t* rank;    // 1 + budget
};

__host__ __device__ inline size_t build_smem_layout(int budget, int depth, int topk, unsigned char* base,
                                                    BuildSmem* out) {
  const size_t t = 1 + (size_t)budget;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    unsigned char* ptr = base ? base + off : nullptr;
    off += (bytes + 15) / 16 * 16;
    return ptr;
  };
  BuildSmem s;
  s.heap = reinterpret_cast<HeapEntry*>(take(t * sizeof(HeapEntry)));
  s.score = reinterpret_cast<double*>(take(t * sizeof(double)));
  s.lp = reinterpret_cast<float*>(take((size_t)depth * staged_ranks(topk, budget) * sizeof(float)));
  s.parent = reinterpret_cast<int16_t*>(take(t * sizeof(int16_t)));
  s.depth = reinterpret_cast<int16_t*>(take(t * sizeof(int16_t)));
  s.rank = reinterpret_cast<int16_t*>(take(t * sizeof(int16_t)));
  if (out) *out = s;
  return off;
}

__global__ void build_ddtree_kernel(DDTreeBuildParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  BuildSmem sm;
  build_smem_layout(p.budget, p.depth, p.topk, smem, &sm);
  __shared__ int s_count;
  const int b = blockIdx.x;
  const int t_stride = 1 + p.budget;
  const int kk = staged_ranks(p.topk, p.budget);
  const float* lp = p.log_probs + (size_t)b * p.depth * p.topk;
  const int32_t* ids = p.token_ids + (size_t)b * p.depth * p.topk;
  // the heap loop runs on one thread: every log-prob it reads comes from shared memory, staged by all
  for (int i = threadIdx.x; i < p.depth * kk; i += blockDim.x) sm.lp[i] = lp[(size_t)(i / kk) * p.topk + i % kk];
  __syncthreads();
  if (threadIdx.x == 0) {
    const Tree tree{sm.parent, sm.rank};
    int n_heap = 0, count = 1;
    sm.score[0] = 0.0;
    sm.parent[0] = -1;
    sm.depth[0] = 0;
    sm.rank[0] = 0;
    heap_push(sm.heap, n_heap, HeapEntry{(double)sm.lp[0], 0, 1, 0, 0}, tree);
    while (n_heap > 0 && count - 1 < p.budget) {
      const HeapEntry e = heap_pop(sm.heap, n_heap, tree);
      const int idx = count++;
      const int d = e.depth, r = e.rank;
      sm.score[idx] = e.score;
      sm.parent[idx] = e.parent;
      sm.depth[idx] = (int16_t)d;
      sm.rank[idx] = (int16_t)r;
      if (r + 1 < p.topk)  // next sibling: same parent, next rank
        heap_push(sm.heap, n_heap,
                  HeapEntry{sm.score[e.parent] + (double)sm.lp[(d - 1) * kk + r + 1], e.parent, (int16_t)d,
                            (int16_t)(r + 1), 0},
                  tree);
      if (d < p.depth)  // first child
        heap_push(sm.heap, n_heap, HeapEntry{e.score + (double)sm.lp[d * kk], (int16_t)idx, (int16_t)(d + 1), 0, 0},
                  tree);
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
    if (i >= count) {  // padding rows: no node
      for (int w = 0; w < p.mask_words; ++w) mrow[w] = 0ull;
      p.node_tokens[row] = -1;
      p.parents[row] = -1;
      p.depths[row] = -1;
      p.positions[row] = -1;
      continue;
    }
    const int d = sm.depth[i];
    p.node_tokens[row] = i == 0 ? p.root_tokens[b] : ids[(size_t)(d - 1) * p.topk + sm.rank[i]];
    p.parents[row] = sm.parent[i];
    p.depths[row] = d;
    p.positions[row] = L + d;
    // a node's row holds itself and its ancestors: at most 16 bits, written word by word (no global
    // read-modify-write)
    for (int w = 0; w < p.mask_words; ++w) {
      uint64_t bits = 0ull;
      for (int a = i; a >= 0; a = sm.parent[a])
        if (a / 64 == w) bits |= 1ull << (a % 64);
      mrow[w] = bits;
    }
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

size_t build_ddtree_smem_bytes(int budget, int depth, int topk) {
  return build_smem_layout(budget, depth, topk, nullptr, nullptr);
}

cudaError_t launch_build_ddtree(const DDTreeBuildParams& p, cudaStream_t stream) {
  const size_t smem = build_ddtree_smem_bytes(p.budget, p.depth, p.topk);
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
