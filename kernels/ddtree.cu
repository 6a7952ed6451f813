// DDTree kernels: tree build, greedy accept, KV compaction. Each is capturable in a CUDA graph (no
// allocation, no host synchronisation), so a decoding round never waits on the host.
//
// build: one CTA per request. All threads stage the reachable log-probs in shared memory; one warp then
//   makes exactly the pops of kdev/ddtree.py's best-first heap: score = parent score + log_prob in double,
//   in path order; ties broken on the rank path (lexicographically smaller first; a prefix sorts before
//   its extensions), then on the parent index. The frontier is one candidate per emitted node (its next
//   child) under a two-level tournament of warp reductions (see below). Afterwards all threads fill the
//   outputs; each node's mask row holds its own and its ancestors' bits (at most 16).
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
#include "kdev/kv_pages.cuh"
#include "kdev/verify_attn.cuh"

namespace kdtree {
namespace {

// The frontier of the best-first search holds, for every emitted node with children left, its next child
// (children come in rank order because each depth's log-probs are sorted). So the heap is replaced by one
// candidate per emitted node, kept as an order-preserving 64-bit key of its score, and a tournament: the
// best candidate of each group of 32 nodes, and the best of those groups. One warp runs it: each step is
// a few warp reductions instead of a single thread's heap walk through shared memory.
constexpr int kGroup = 32;
constexpr int kMaxGroups = (KDTREE_MAX_QLEN + kGroup - 1) / kGroup;
static_assert(kMaxGroups <= 2 * kGroup, "the group step reads at most two groups per lane");

// Higher score -> larger key; 0 means no candidate. -0.0 is folded into +0.0 first: they compare equal as
// doubles (and in kdev/ddtree.py), so they must get the same key and fall through to the path order.
__device__ __forceinline__ unsigned long long score_key(double s) {
  if (s == 0.0) s = 0.0;
  const unsigned long long b = (unsigned long long)__double_as_longlong(s);
  return (b >> 63) ? ~b : b | (1ull << 63);
}

struct BuildSmem {  // carve-up of the dynamic shared memory (sizes in build_ddtree_smem_bytes)
  double* score;               // 1 + budget, per emitted node
  unsigned long long* cand;    // 1 + budget: key of the node's next child, 0 when it has none left
  unsigned long long* gkey;    // kMaxGroups: best key of each group of 32 nodes
  float* lp;                   // depth x staged_ranks
  int16_t* parent;             // 1 + budget
  int16_t* depth;              // 1 + budget
  int16_t* rank;               // 1 + budget
  int16_t* next;               // 1 + budget: rank of the node's next child
  int16_t* gnode;              // kMaxGroups: node holding that best key
};

// Ranks that a build can reach: a node of rank r has r elder siblings in the tree, so r < budget and a
// sibling candidate reads rank <= budget. Only these log-probs are staged in shared memory.
__host__ __device__ inline int staged_ranks(int topk, int budget) { return topk < budget + 1 ? topk : budget + 1; }

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
  s.score = reinterpret_cast<double*>(take(t * sizeof(double)));
  s.cand = reinterpret_cast<unsigned long long*>(take(t * 8));
  s.gkey = reinterpret_cast<unsigned long long*>(take(kMaxGroups * 8));
  s.lp = reinterpret_cast<float*>(take((size_t)depth * staged_ranks(topk, budget) * sizeof(float)));
  s.parent = reinterpret_cast<int16_t*>(take(t * 2));
  s.depth = reinterpret_cast<int16_t*>(take(t * 2));
  s.rank = reinterpret_cast<int16_t*>(take(t * 2));
  s.next = reinterpret_cast<int16_t*>(take(t * 2));
  s.gnode = reinterpret_cast<int16_t*>(take(kMaxGroups * 2));
  if (out) *out = s;
  return off;
}

// Candidate of node a before that of node b when their scores are equal: the rank path (a's path, then
// its next rank) lexicographically smaller, a prefix first, then the smaller parent -- the order of
// kdev/ddtree.py's heap tuples.
__device__ bool tie_before(const BuildSmem& sm, int a, int b) {
  int pa[KDTREE_MAX_DEPTH + 1], pb[KDTREE_MAX_DEPTH + 1];
  const int da = sm.depth[a] + 1, db = sm.depth[b] + 1;  // candidate depths
  pa[da - 1] = sm.next[a];
  pb[db - 1] = sm.next[b];
  for (int k = da - 2, n = a; k >= 0; --k, n = sm.parent[n]) pa[k] = sm.rank[n];
  for (int k = db - 2, n = b; k >= 0; --k, n = sm.parent[n]) pb[k] = sm.rank[n];
  const int m = da < db ? da : db;
  for (int i = 0; i < m; ++i)
    if (pa[i] != pb[i]) return pa[i] < pb[i];
  if (da != db) return da < db;
  return a < b;
}

// The best (key, node) over the warp; every lane gets it. Equal best keys (exact score ties) are settled
// by the path order, serially: they are rare.
__device__ __forceinline__ int warp_best(const BuildSmem& sm, unsigned long long key, int node,
                                         unsigned long long* best_key) {
  const unsigned hi = __reduce_max_sync(0xffffffffu, (unsigned)(key >> 32));
  const unsigned lo = __reduce_max_sync(0xffffffffu, (unsigned)(key >> 32) == hi ? (unsigned)key : 0u);
  const unsigned long long mk = ((unsigned long long)hi << 32) | lo;
  *best_key = mk;
  if (mk == 0ull) return -1;
  unsigned tied = __ballot_sync(0xffffffffu, key == mk);
  int best = __shfl_sync(0xffffffffu, node, __ffs(tied) - 1);
  if (__popc(tied) > 1) {
    tied &= tied - 1;
    while (tied) {
      const int other = __shfl_sync(0xffffffffu, node, __ffs(tied) - 1);
      if (tie_before(sm, other, best)) best = other;  // the same decision in every lane
      tied &= tied - 1;
    }
  }
  return best;
}

// Recompute group g's best candidate over its emitted nodes (< count).
__device__ __forceinline__ void refresh_group(const BuildSmem& sm, int g, int count, int lane) {
  const int n = g * kGroup + lane;
  const unsigned long long k = n < count ? sm.cand[n] : 0ull;
  unsigned long long bk;
  const int best = warp_best(sm, k, n, &bk);
  if (lane == 0) {
    sm.gkey[g] = bk;
    sm.gnode[g] = (int16_t)best;
  }
  __syncwarp();
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
  for (int i = threadIdx.x; i < p.depth * kk; i += blockDim.x) sm.lp[i] = lp[(size_t)(i / kk) * p.topk + i % kk];
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (lane == 0) {
      sm.score[0] = 0.0;
      sm.parent[0] = -1;
      sm.depth[0] = 0;
      sm.rank[0] = 0;
      sm.next[0] = 0;
      sm.cand[0] = p.depth > 0 ? score_key(0.0 + (double)sm.lp[0]) : 0ull;  // the root's first child, if any
    }
    __syncwarp();
    int count = 1;
    refresh_group(sm, 0, count, lane);
    while (count - 1 < p.budget) {
      // the best group: each lane looks at groups lane and lane + 32
      const int groups = (count + kGroup - 1) / kGroup;
      unsigned long long k = lane < groups ? sm.gkey[lane] : 0ull;
      int node = lane < groups ? sm.gnode[lane] : -1;
      if (lane + kGroup < groups) {
        const unsigned long long k2 = sm.gkey[lane + kGroup];
        const int n2 = sm.gnode[lane + kGroup];
        if (k2 > k || (k2 == k && k2 != 0ull && tie_before(sm, n2, node))) {
          k = k2;
          node = n2;
        }
      }
      unsigned long long bk;
      const int P = warp_best(sm, k, node, &bk);
      if (P < 0) break;  // no candidates left: the drafter's paths are exhausted before the budget
      // emit P's next child as node idx; P's candidate moves to its next sibling, idx gets its first child
      const int idx = count++;
      if (lane == 0) {
        const int d = sm.depth[P] + 1, r = sm.next[P];
        const double s = sm.score[P] + (double)sm.lp[(d - 1) * kk + r];
        sm.score[idx] = s;
        sm.parent[idx] = (int16_t)P;
        sm.depth[idx] = (int16_t)d;
        sm.rank[idx] = (int16_t)r;
        sm.next[idx] = 0;
        sm.cand[idx] = d < p.depth ? score_key(s + (double)sm.lp[d * kk]) : 0ull;
        sm.next[P] = (int16_t)(r + 1);
        sm.cand[P] = r + 1 < p.topk ? score_key(sm.score[P] + (double)sm.lp[(d - 1) * kk + r + 1]) : 0ull;
      }
      __syncwarp();
      refresh_group(sm, P / kGroup, count, lane);
      if (idx / kGroup != P / kGroup) refresh_group(sm, idx / kGroup, count, lane);
    }
    if (lane == 0) {
      s_count = count;
      p.node_count[b] = count;
    }
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
  const KvPagesBySize pages = kv_pages_by_size(p.page_table, p.max_pages, b, p.page_size);
  const int32_t* acc = p.accepted + (size_t)b * p.t_stride;
  uint4* kv = static_cast<uint4*>(p.kv_cache);
  auto slot = [&](int pos) -> size_t {
    return kv_slot<size_t>(pages, pos) * kVecs;
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
