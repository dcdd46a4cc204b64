// Tree attention for Medusa verification: M tree queries per row against the row's past (no mask)
// and the tree's own nodes (ancestor bitmasks). Plain CUDA C++, no torch headers: compiled by
// torch.utils.cpp_extension.load_inline (cuda_kernel.py) and compile-checked alone with nvcc.
//
// One block per (row b, KV head, block of ROWS packed query rows, KV split). The g = Hq / Hkv query
// heads sharing a KV head are packed into g * M query rows, so K/V tiles are read once per KV head.
// A block stages a tile of BN keys and values in shared memory, computes the ROWS x BN scores,
// updates each row's running max and sum (online softmax, fp32, exp2 with the scale folded in) and
// its fp32 accumulator. Past columns [lo, past_b) carry no mask; tree columns past_b + j are visible
// to node i iff bit j % 64 of word j / 64 of bits[i] is set. With several splits each block writes its
// unnormalised partial output and (max, sum) to fp32 scratch, and tree_attn_combine merges them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

namespace medusa_tree {

constexpr int THREADS = 128;
constexpr int ROWS = 16;  // packed query rows per block

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
  int tree_tiles = split == p.S - 1 ? (p.M + BN - 1) / BN : 0;
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
cudaError_t launch(const Params& p, int B, cudaStream_t stream) {
  int GM = p.G * p.M;
  dim3 grid((GM + ROWS - 1) / ROWS, B * p.HKV, p.S);
  tree_attn_fwd<T, DMAX><<<grid, THREADS, 0, stream>>>(p);
  if (p.S > 1) {
    dim3 cgrid((GM * DMAX + 255) / 256, B * p.HKV);
    tree_attn_combine<T, DMAX><<<cgrid, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_d(const Params& p, int B, cudaStream_t stream) {
  if (p.D <= 32) return launch<T, 32>(p, B, stream);
  if (p.D <= 64) return launch<T, 64>(p, B, stream);
  if (p.D <= 128) return launch<T, 128>(p, B, stream);
  return launch<T, 256>(p, B, stream);
}

// dtype: 0 fp32, 1 fp16, 2 bf16. Returns the CUDA error of the launch.
cudaError_t tree_attention_launch(const Params& p, int B, int dtype, cudaStream_t stream) {
  if (dtype == 1) return launch_d<__half>(p, B, stream);
  if (dtype == 2) return launch_d<__nv_bfloat16>(p, B, stream);
  return launch_d<float>(p, B, stream);
}

// The padded head dim (row stride of the split scratch) used for head dim D.
int padded_head_dim(int D) { return D <= 32 ? 32 : D <= 64 ? 64 : D <= 128 ? 128 : 256; }

}  // namespace medusa_tree
