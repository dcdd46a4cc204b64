// Tree attention for Medusa verification: M tree queries per row against the row's past (no mask)
// and the tree's own nodes (ancestor bitmasks). Plain CUDA C++, no torch headers: compiled by
// torch.utils.cpp_extension.load_inline (cuda_kernel.py) and compile-checked alone with nvcc.
//
// One block per (row b, KV head, block of packed query rows, KV split). The g = Hq / Hkv query heads
// sharing a KV head are packed into g * M query rows (row -> head kvh * g + row / M, node row % M),
// so K/V tiles are read once per KV head. A block stages a tile of keys and values in shared memory,
// computes the scores of its rows against them, updates each row's running max and sum (online
// softmax, fp32, scores in log2 units: exp2 with the scale folded in) and its fp32 accumulator. Past
// columns [lo, past_b) carry no mask (lo: the row's first visible column, raised by a sliding window);
// tree columns past_b + j are visible to node i iff bit j % 64 of word j / 64 of bits[i] is set (a
// node's ancestors precede it, so a block reads the tree up to its last node only). With
// several splits each block writes its unnormalised partial output and (max, sum) to fp32 scratch, and
// tree_attn_combine merges them (flash-decoding).
//
// Two forward kernels share that contract:
//
// tree_attn_mma (fp16/bf16, 32 < D <= 128, sm_80+): tensor cores through nvcuda::wmma 16x16x16
//   fragments with fp32 accumulation. 128 threads = 4 warps; MMA_ROWS = 64 packed query rows per
//   block, warp w owning rows [16 w, 16 w + 16); tiles of MMA_BN = 64 keys. Dynamic shared memory:
//     k_s, v_s  (64, DMAX + 8) in the input dtype: the tile's keys and values, row = key; zeros past
//               the tile's last column and past D (the +8 pads rows against bank conflicts and keeps
//               every row 16-byte aligned). k_s first holds the block's queries, read once into
//               registers (matrix_a fragments).
//     w_s       (64, DMAX + 4) fp32, one 16-row band per warp, used three ways per tile:
//               the scores S = Q K^T (columns [0, 64)); then, in place, row r's probabilities P in
//               the input dtype (the first 128 bytes of row r, row stride 2 (DMAX + 4) elements);
//               then the tile's P V (columns [0, DMAX)).
//     a_s, l_s  (64,) fp32: each row's rescale factor of the tile, and its final sum.
//   Per tile: stage K/V (all threads) | sync | per warp: S = Q K^T -> w_s; softmax on the band (lane
//   pair 2r, 2r + 1 owns row r, even/odd columns): mask, max, exp2, sum, P -> w_s, alpha -> a_s; P V
//   -> w_s; acc = acc * alpha + P V (lane owns columns lane + 32 k of its rows: conflict-free) | sync.
//   The accumulator stays in registers, in that fixed lane layout (wmma's own accumulator layout is
//   unspecified, so the per-row rescale goes through shared memory).
//
// tree_attn_fwd (fp32, other head dims, pre-sm_80 devices): the same walk in fp32 on the CUDA cores,
//   ROWS = 16 packed query rows per block, fp32 shared tiles.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <mma.h>
#include <stdint.h>

namespace medusa_tree {

constexpr int THREADS = 128;
constexpr int ROWS = 16;      // packed query rows per block of the fp32 kernel
constexpr int MMA_ROWS = 64;  // packed query rows per block of the tensor-core kernel (4 warps x 16)
constexpr int MMA_BN = 64;    // keys per tile of the tensor-core kernel (one bits word per tree tile)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* out;        // (B, M, Hq, D) contiguous
  float* part;      // (B * Hkv * S * G * M, DMAX) when S > 1
  float* ml;        // (B * Hkv * S * G * M, 2) when S > 1
  const int* past;  // (B,)
  const int* start; // (B,)
  const long long* bits;  // (M, num_words)
  const int* depth;       // (M,)
  long long sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd;
  int num_words, M, G, HKV, D, window, S;
  float qk_scale;  // softmax scale * log2(e)
};

template <typename T, int DMAX>
__global__ void __launch_bounds__(THREADS) tree_attn_fwd(Params p) {
  constexpr int BN = DMAX >= 256 ? 8 : 32;  // keys per tile (static shared memory stays < 48 KiB)
  constexpr int NACC = ROWS * DMAX / THREADS;
  __shared__ float q_s[ROWS][DMAX];
  __shared__ float k_s[BN][DMAX + 1];
  __shared__ float v_s[BN][DMAX];
  __shared__ float s_s[ROWS][BN];
  __shared__ float m_s[ROWS], l_s[ROWS], a_s[ROWS];
  __shared__ int node_s[ROWS], lo_s[ROWS];

  const int tid = threadIdx.x;
  const int bh = blockIdx.y;
  const int b = bh / p.HKV, kvh = bh % p.HKV;
  const int split = blockIdx.z;
  const int row0 = blockIdx.x * ROWS;
  const int GM = p.G * p.M;
  const int past = p.past[b], start = p.start[b];
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k) + b * p.skb + kvh * p.skh;
  const T* V = static_cast<const T*>(p.v) + b * p.svb + kvh * p.svh;

  // Query rows to shared memory (zeros past D and past the last row).
  for (int e = tid; e < ROWS * DMAX; e += THREADS) {
    int r = e / DMAX, d = e % DMAX, row = row0 + r;
    float x = 0.f;
    if (row < GM && d < p.D) {
      int head = kvh * p.G + row / p.M, node = row % p.M;
      x = to_float(Q[b * p.sqb + head * p.sqh + node * p.sqm + d * p.sqd]);
    }
    q_s[r][d] = x;
  }
  if (tid < ROWS) {
    int row = row0 + tid;
    int node = row < GM ? row % p.M : 0;
    node_s[tid] = node;
    int lo = start;
    if (p.window > 0) lo = max(lo, past + p.depth[node] - p.window + 1);
    lo_s[tid] = lo;
    m_s[tid] = -CUDART_INF_F;
    l_s[tid] = 0.f;
  }
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  __syncthreads();

  int lo = start;
  if (p.window > 0) lo = max(lo, past - p.window + 1);
  int span = max(past - lo, 0);
  int chunk = ((span + p.S - 1) / p.S + BN - 1) / BN * BN;
  int c_lo = lo + split * chunk, c_hi = min(c_lo + chunk, past);
  // A node's ancestors precede it: a block of one head's nodes sees no tree column after its last node.
  const int last_row = min(row0 + ROWS, GM) - 1;
  const int tree_hi = row0 / p.M == last_row / p.M ? last_row % p.M + 1 : p.M;
  int tree_tiles = split == p.S - 1 ? (tree_hi + BN - 1) / BN : 0;
  int past_tiles = c_hi > c_lo ? (c_hi - c_lo + BN - 1) / BN : 0;

  for (int t = 0; t < past_tiles + tree_tiles; ++t) {
    const bool in_tree = t >= past_tiles;
    const int n0 = in_tree ? past + (t - past_tiles) * BN : c_lo + t * BN;
    const int n_hi = in_tree ? past + p.M : c_hi;
    // 1. Stage the tile's keys and values (zeros outside the tile's columns).
    for (int e = tid; e < BN * DMAX; e += THREADS) {
      int j = e / DMAX, d = e % DMAX, col = n0 + j;
      bool ok = col < n_hi && d < p.D;
      k_s[j][d] = ok ? to_float(K[col * p.skn + d * p.skd]) : 0.f;
      v_s[j][d] = ok ? to_float(V[col * p.svn + d * p.svd]) : 0.f;
    }
    __syncthreads();
    // 2. Scores (log2 units); masked entries are -inf.
    for (int e = tid; e < ROWS * BN; e += THREADS) {
      int r = e / BN, j = e % BN, col = n0 + j;
      bool ok = col < n_hi;
      if (in_tree) {
        int nj = col - past;
        unsigned long long w = ok ? (unsigned long long)p.bits[node_s[r] * p.num_words + nj / 64] : 0ull;
        ok = ok && ((w >> (nj % 64)) & 1ull);
      } else {
        ok = ok && col >= lo_s[r];
      }
      float s = -CUDART_INF_F;
      if (ok) {
        float dot = 0.f;
#pragma unroll 8
        for (int d = 0; d < DMAX; ++d) dot += q_s[r][d] * k_s[j][d];
        s = dot * p.qk_scale;
      }
      s_s[r][j] = s;
    }
    __syncthreads();
    // 3. Online softmax per row: one warp per row at a time.
    const int warp = tid / 32, lane = tid % 32;
    for (int r = warp; r < ROWS; r += THREADS / 32) {
      float mx = -CUDART_INF_F;
      for (int j = lane; j < BN; j += 32) mx = fmaxf(mx, s_s[r][j]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      float m_old = m_s[r];
      float m_new = fmaxf(m_old, mx);
      float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
      float sum = 0.f;
      for (int j = lane; j < BN; j += 32) {
        float pj = exp2f(s_s[r][j] - m_use);
        s_s[r][j] = pj;
        sum += pj;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) {
        float alpha = exp2f(m_old - m_use);
        a_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
    // 4. acc = acc * alpha + P V.
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      int e = tid + i * THREADS, r = e / DMAX, d = e % DMAX;
      float x = acc[i] * a_s[r];
#pragma unroll 8
      for (int j = 0; j < BN; ++j) x += s_s[r][j] * v_s[j][d];
      acc[i] = x;
    }
    __syncthreads();
  }

  // 5. Normalised output, or the split's partial result.
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    int e = tid + i * THREADS, r = e / DMAX, d = e % DMAX, row = row0 + r;
    if (row >= GM || d >= p.D) continue;
    if (p.S == 1) {
      int head = kvh * p.G + row / p.M, node = row % p.M;
      float l = l_s[r] > 0.f ? l_s[r] : 1.f;
      T* O = static_cast<T*>(p.out);
      O[(((long long)b * p.M + node) * (p.HKV * p.G) + head) * p.D + d] = from_float<T>(acc[i] / l);
    } else {
      long long pr = ((long long)bh * p.S + split) * GM + row;
      p.part[pr * DMAX + d] = acc[i];
      if (d == 0) {
        p.ml[pr * 2] = m_s[r];
        p.ml[pr * 2 + 1] = l_s[r];
      }
    }
  }
}

// Shared-memory layout of tree_attn_mma (byte offsets, each a multiple of 128: wmma needs 32-byte
// aligned fragment pointers, the staging 16-byte aligned rows).
template <typename T, int DMAX>
struct MmaSmem {
  static constexpr int LDT = DMAX + 8;  // row stride of k_s / v_s (elements of T)
  static constexpr int LDW = DMAX + 4;  // row stride of w_s (floats)
  static constexpr size_t K_OFF = 0;
  static constexpr size_t V_OFF = K_OFF + sizeof(T) * MMA_BN * LDT;
  static constexpr size_t W_OFF = V_OFF + sizeof(T) * MMA_BN * LDT;
  static constexpr size_t A_OFF = W_OFF + sizeof(float) * MMA_ROWS * LDW;
  static constexpr size_t L_OFF = A_OFF + sizeof(float) * MMA_ROWS;
  static constexpr size_t BYTES = L_OFF + sizeof(float) * MMA_ROWS;
  static_assert(DMAX % 32 == 0 && DMAX >= MMA_BN, "w_s holds a score tile and a P V tile per row");
  static_assert(MMA_BN == MMA_ROWS, "k_s holds the block's queries before the first tile");
  static_assert(MMA_BN == 64, "a tree tile reads one 64-bit word of ancestor bits per row");
  static_assert(MMA_ROWS == 16 * (THREADS / 32), "one 16-row band per warp");
  static_assert(V_OFF % 128 == 0 && W_OFF % 128 == 0 && A_OFF % 128 == 0 && L_OFF % 128 == 0, "");
};

template <typename T, int DMAX>
__global__ void __launch_bounds__(THREADS) tree_attn_mma(Params p, bool vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // never launched: the host takes tree_attn_fwd below sm_80 (bf16 wmma needs sm_80)
#else
  using namespace nvcuda;
  using L = MmaSmem<T, DMAX>;
  constexpr int LDT = L::LDT, LDW = L::LDW;
  constexpr int LDP = 2 * LDW;             // row stride of P inside w_s (elements of T)
  constexpr int KD = DMAX / 16;            // 16-wide slices of the head dim
  constexpr int KN = MMA_BN / 16;          // 16-wide slices of the key tile
  constexpr int PER_ROW = DMAX / 32;       // accumulator values per lane and row
  constexpr int NACC = 16 * PER_ROW;       // accumulator values per lane (16 rows x DMAX per warp)
  constexpr int NS = MMA_BN / 2;           // score columns per lane (the even or the odd ones)
  constexpr unsigned FULL = 0xffffffffu;
  extern __shared__ __align__(128) unsigned char smem[];
  T* k_s = reinterpret_cast<T*>(smem + L::K_OFF);
  T* v_s = reinterpret_cast<T*>(smem + L::V_OFF);
  float* w_s = reinterpret_cast<float*>(smem + L::W_OFF);
  float* a_s = reinterpret_cast<float*>(smem + L::A_OFF);
  float* l_s = reinterpret_cast<float*>(smem + L::L_OFF);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bh = blockIdx.y;
  const int b = bh / p.HKV, kvh = bh % p.HKV;
  const int split = blockIdx.z;
  const int row0 = blockIdx.x * MMA_ROWS;
  const int GM = p.G * p.M;
  const int past = p.past[b], start = p.start[b];
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k) + b * p.skb + kvh * p.skh;
  const T* V = static_cast<const T*>(p.v) + b * p.svb + kvh * p.svh;
  const T zero = from_float<T>(0.f);

  // 1. The block's query rows to k_s (zeros past D and past the last row), then each warp's 16 rows
  //    to registers as matrix_a fragments, kept for the whole walk.
  for (int e = tid; e < MMA_ROWS * DMAX; e += THREADS) {
    int r = e / DMAX, d = e % DMAX, row = row0 + r;
    T x = zero;
    if (row < GM && d < p.D) {
      int head = kvh * p.G + row / p.M, node = row % p.M;
      x = Q[b * p.sqb + head * p.sqh + node * p.sqm + d * p.sqd];
    }
    k_s[r * LDT + d] = x;
  }
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_f[KD];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) wmma::load_matrix_sync(q_f[kk], k_s + warp * 16 * LDT + kk * 16, LDT);
  __syncthreads();  // the first tile overwrites k_s

  // The softmax row of this lane (lanes 2 sr and 2 sr + 1 share row sr of the warp's band) and its
  // first visible past column; padding rows (past G * M) read node 0 and are never written out.
  const int sr = lane >> 1, half = lane & 1;
  const int srow = row0 + warp * 16 + sr;
  const int snode = srow < GM ? srow % p.M : 0;
  int lo_r = start;
  if (p.window > 0) lo_r = max(lo_r, past + p.depth[snode] - p.window + 1);
  float m_r = -CUDART_INF_F, l_r = 0.f;  // running max (log2 units) and sum of row sr
  // Lane owns the values (r, k * 32 + lane) of its warp's band: acc[r * PER_ROW + k].
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  float* w_band = w_s + warp * 16 * LDW;      // (16, LDW) fp32: scores, then P V
  T* p_band = reinterpret_cast<T*>(w_band);  // (16, LDP) in T: P, over the scores of its own row

  int lo = start;
  if (p.window > 0) lo = max(lo, past - p.window + 1);
  int span = max(past - lo, 0);
  int chunk = ((span + p.S - 1) / p.S + MMA_BN - 1) / MMA_BN * MMA_BN;
  int c_lo = lo + split * chunk, c_hi = min(c_lo + chunk, past);
  const int last_row = min(row0 + MMA_ROWS, GM) - 1;  // the tree columns after its last node: unseen
  const int tree_hi = row0 / p.M == last_row / p.M ? last_row % p.M + 1 : p.M;
  int tree_tiles = split == p.S - 1 ? (tree_hi + MMA_BN - 1) / MMA_BN : 0;
  int past_tiles = c_hi > c_lo ? (c_hi - c_lo + MMA_BN - 1) / MMA_BN : 0;

  for (int t = 0; t < past_tiles + tree_tiles; ++t) {
    const bool in_tree = t >= past_tiles;
    const int n0 = in_tree ? past + (t - past_tiles) * MMA_BN : c_lo + t * MMA_BN;
    const int n_hi = in_tree ? past + p.M : c_hi;
    // 2. Stage the tile's keys and values (zeros outside the tile's columns and past D: the
    //    columns after the tree may hold anything, NaN included, and 0 * NaN would poison P V).
    if (vec) {  // head-dim stride 1, 16-byte aligned rows: 8 elements per load
      constexpr int CH = DMAX / 8;
      for (int c = tid; c < MMA_BN * CH; c += THREADS) {
        int j = c / CH, d = (c % CH) * 8, col = n0 + j;
        uint4 kx = make_uint4(0u, 0u, 0u, 0u), vx = kx;
        if (col < n_hi && d < p.D) {
          kx = *reinterpret_cast<const uint4*>(K + col * p.skn + d);
          vx = *reinterpret_cast<const uint4*>(V + col * p.svn + d);
        }
        *reinterpret_cast<uint4*>(k_s + j * LDT + d) = kx;
        *reinterpret_cast<uint4*>(v_s + j * LDT + d) = vx;
      }
    } else {
      for (int e = tid; e < MMA_BN * DMAX; e += THREADS) {
        int j = e / DMAX, d = e % DMAX, col = n0 + j;
        bool ok = col < n_hi && d < p.D;
        k_s[j * LDT + d] = ok ? K[col * p.skn + d * p.skd] : zero;
        v_s[j * LDT + d] = ok ? V[col * p.svn + d * p.svd] : zero;
      }
    }
    __syncthreads();

    // 3. Scores of the warp's band: S = Q K^T (16 x MMA_BN, fp32) -> w_band[:, 0:MMA_BN). k_s
    //    holds K row-major (key, d), which is K^T (d, key) column-major.
#pragma unroll
    for (int jn = 0; jn < KN; ++jn) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_f;
      wmma::fill_fragment(s_f, 0.f);
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k_f;
        wmma::load_matrix_sync(k_f, k_s + jn * 16 * LDT + kk * 16, LDT);
        wmma::mma_sync(s_f, q_f[kk], k_f, s_f);
      }
      wmma::store_matrix_sync(w_band + jn * 16, s_f, LDW, wmma::mem_row_major);
    }
    __syncwarp();

    // 4. Online softmax of row sr over columns j = half + 2 i (log2 units, masked entries -inf).
    unsigned long long word = 0ull;  // tree tile: bits of nodes n0 - past + [0, 64) for node snode
    if (in_tree) word = (unsigned long long)p.bits[snode * p.num_words + (t - past_tiles)];
    float s[NS];
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      int j = half + 2 * i, col = n0 + j;
      bool ok = col < n_hi && (in_tree ? ((word >> j) & 1ull) != 0ull : col >= lo_r);
      s[i] = ok ? w_band[sr * LDW + j] * p.qk_scale : -CUDART_INF_F;
      mx = fmaxf(mx, s[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
    const float m_new = fmaxf(m_r, mx);
    const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
    const float alpha = exp2f(m_r - m_use);
    __syncwarp();  // every score of the band is in registers before P overwrites it
    T* p_row = p_band + sr * LDP;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      float pj = exp2f(s[i] - m_use);
      sum += pj;
      p_row[half + 2 * i] = from_float<T>(pj);
    }
    sum += __shfl_xor_sync(FULL, sum, 1);
    l_r = l_r * alpha + sum;
    m_r = m_new;
    if (half == 0) a_s[warp * 16 + sr] = alpha;
    __syncwarp();

    // 5. P V of the band (16 x DMAX, fp32) -> w_band[:, 0:DMAX), P (in T) times v_s (row-major
    //    (key, d)). P is read into registers first: the products overwrite it.
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_f[KN];
#pragma unroll
    for (int kk = 0; kk < KN; ++kk) wmma::load_matrix_sync(p_f[kk], p_band + kk * 16, LDP);
    __syncwarp();
#pragma unroll
    for (int dn = 0; dn < KD; ++dn) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> o_f;
      wmma::fill_fragment(o_f, 0.f);
#pragma unroll
      for (int kk = 0; kk < KN; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v_f;
        wmma::load_matrix_sync(v_f, v_s + kk * 16 * LDT + dn * 16, LDT);
        wmma::mma_sync(o_f, p_f[kk], v_f, o_f);
      }
      wmma::store_matrix_sync(w_band + dn * 16, o_f, LDW, wmma::mem_row_major);
    }
    __syncwarp();

    // 6. acc = acc * alpha + P V, in the lane's fixed layout.
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      int r = i / PER_ROW, d = (i % PER_ROW) * 32 + lane;
      acc[i] = acc[i] * a_s[warp * 16 + r] + w_band[r * LDW + d];
    }
    __syncthreads();  // the next tile restages k_s / v_s and rewrites the bands
  }

  // 7. Normalised output, or the split's partial result and (max, sum).
  if (half == 0) l_s[warp * 16 + sr] = l_r;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    int r = i / PER_ROW, d = (i % PER_ROW) * 32 + lane, row = row0 + warp * 16 + r;
    if (row >= GM || d >= p.D) continue;
    if (p.S == 1) {
      int head = kvh * p.G + row / p.M, node = row % p.M;
      float l = l_s[warp * 16 + r];
      T* O = static_cast<T*>(p.out);
      O[(((long long)b * p.M + node) * (p.HKV * p.G) + head) * p.D + d] =
          from_float<T>(acc[i] / (l > 0.f ? l : 1.f));
    } else {
      long long pr = ((long long)bh * p.S + split) * GM + row;
      p.part[pr * DMAX + d] = acc[i];
    }
  }
  if (p.S > 1 && half == 0 && srow < GM) {
    long long pr = ((long long)bh * p.S + split) * GM + srow;
    p.ml[pr * 2] = m_r;
    p.ml[pr * 2 + 1] = l_r;
  }
#endif
}

template <typename T, int DMAX>
__global__ void tree_attn_combine(Params p) {
  const int bh = blockIdx.y;
  const int b = bh / p.HKV, kvh = bh % p.HKV;
  const int GM = p.G * p.M;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = e / DMAX, d = e % DMAX;
  if (row >= GM || d >= p.D) return;
  float m_all = -CUDART_INF_F;
  for (int s = 0; s < p.S; ++s) m_all = fmaxf(m_all, p.ml[(((long long)bh * p.S + s) * GM + row) * 2]);
  float m_use = m_all == -CUDART_INF_F ? 0.f : m_all;
  float l = 0.f, x = 0.f;
  for (int s = 0; s < p.S; ++s) {
    long long pr = ((long long)bh * p.S + s) * GM + row;
    float w = exp2f(p.ml[pr * 2] - m_use);
    l += w * p.ml[pr * 2 + 1];
    x += w * p.part[pr * DMAX + d];
  }
  int head = kvh * p.G + row / p.M, node = row % p.M;
  T* O = static_cast<T*>(p.out);
  O[(((long long)b * p.M + node) * (p.HKV * p.G) + head) * p.D + d] = from_float<T>(x / (l > 0.f ? l : 1.f));
}

template <typename T, int DMAX>
void launch_combine(const Params& p, int B, cudaStream_t stream) {
  dim3 cgrid((p.G * p.M * DMAX + 255) / 256, B * p.HKV);
  tree_attn_combine<T, DMAX><<<cgrid, 256, 0, stream>>>(p);
}

// fp32 arithmetic on the CUDA cores (tree_attn_fwd).
template <typename T, int DMAX>
cudaError_t launch(const Params& p, int B, cudaStream_t stream) {
  int GM = p.G * p.M;
  dim3 grid((GM + ROWS - 1) / ROWS, B * p.HKV, p.S);
  tree_attn_fwd<T, DMAX><<<grid, THREADS, 0, stream>>>(p);
  if (p.S > 1) launch_combine<T, DMAX>(p, B, stream);
  return cudaGetLastError();
}

// Tensor cores (tree_attn_mma), fp16/bf16 only.
template <typename T, int DMAX>
cudaError_t launch_mma(const Params& p, int B, cudaStream_t stream) {
  constexpr size_t smem = MmaSmem<T, DMAX>::BYTES;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(
        tree_attn_mma<T, DMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  // 16-byte loads of K/V rows: head-dim stride 1, every other stride and both bases 16-byte aligned.
  const bool vec = p.skd == 1 && p.svd == 1 && p.D % 8 == 0 && p.skb % 8 == 0 && p.skh % 8 == 0 &&
                   p.skn % 8 == 0 && p.svb % 8 == 0 && p.svh % 8 == 0 && p.svn % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(p.k) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v) % 16 == 0;
  int GM = p.G * p.M;
  dim3 grid((GM + MMA_ROWS - 1) / MMA_ROWS, B * p.HKV, p.S);
  tree_attn_mma<T, DMAX><<<grid, THREADS, smem, stream>>>(p, vec);
  if (p.S > 1) launch_combine<T, DMAX>(p, B, stream);
  return cudaGetLastError();
}

// Whether the current device has bf16/fp16 wmma (sm_80+).
inline bool tensor_cores() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  return major >= 8;
}

template <typename T>
cudaError_t launch_d(const Params& p, int B, cudaStream_t stream) {
  if (p.D <= 32) return launch<T, 32>(p, B, stream);
  if (p.D <= 64) return launch<T, 64>(p, B, stream);
  if (p.D <= 128) return launch<T, 128>(p, B, stream);
  return launch<T, 256>(p, B, stream);
}

// fp16/bf16: the tensor-core kernel for head dims in (32, 128] on sm_80+, else the fp32 one.
template <typename T>
cudaError_t launch_d16(const Params& p, int B, cudaStream_t stream) {
  if (p.D > 32 && p.D <= 128 && tensor_cores()) {
    return p.D <= 64 ? launch_mma<T, 64>(p, B, stream) : launch_mma<T, 128>(p, B, stream);
  }
  return launch_d<T>(p, B, stream);
}

// dtype: 0 fp32, 1 fp16, 2 bf16. Returns the CUDA error of the launch.
cudaError_t tree_attention_launch(const Params& p, int B, int dtype, cudaStream_t stream) {
  if (dtype == 1) return launch_d16<__half>(p, B, stream);
  if (dtype == 2) return launch_d16<__nv_bfloat16>(p, B, stream);
  return launch_d<float>(p, B, stream);
}

// The padded head dim (row stride of the split scratch) used for head dim D.
int padded_head_dim(int D) { return D <= 32 ? 32 : D <= 64 ? 64 : D <= 128 ? 128 : 256; }

}  // namespace medusa_tree
