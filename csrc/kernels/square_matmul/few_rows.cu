// The few-rows kernel (fp16/bf16, sm_80+ and fp16 on sm_75; at most kFewRowsMax rows:
// decoding).
//
// With so few rows, x @ W is bound by reading W once, and the staging kernels' row blocks
// would leave most of the GPU idle. Here every block owns BN = 16 * NA output columns of all
// the rows: its warps split K among them, each streaming its share of the block's W columns
// from global memory straight into mma.sync fragments (no shared memory, no cp.async), and x's
// few rows come from L2. The warps' partial sums meet in shared memory; the grid (launched
// cooperatively, every block resident) then syncs, since every block reads all of x, and
// each block writes its columns over x. So the default path's cuBLAS GEMM into a fresh
// output and its copy back become one kernel and no memory.
//
// The MMA computes out^T = Wv^T x^T as the staging kernel does: W the 16-row A operand
// (rows = output columns j), x the 8-wide B operand (columns = x's rows n, MT tiles of 8).
// A sum over k may take its terms in any order, so each thread loads chunks of W (4-16 bytes,
// see FewRowsStep) and x and feeds them to fragment slots of the k order that suits the load;
// A and B use the same order. Fragment slots (g = lane / 4, q = lane % 4): a[0] (row g, k 2q
// and 2q + 1), a[1] (row g + 8, same k), a[2] and a[3] (rows g, g + 8, k 2q + 8 and 2q + 9);
// b[0] (k 2q and 2q + 1, column g), b[1] (k 2q + 8 and 2q + 9); d[0..1] (row g, columns 2q
// and 2q + 1), d[2..3] (row g + 8).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/mma_sync.cuh"
#include "kernels/square_matmul/tuning.h"

namespace mti::square_matmul {
namespace {

namespace cg = cooperative_groups;

// Warps per block, chosen by config(): from 4 up to 16, or up to 8 where a thread's
// accumulators for 32 or more rows need more than the 128 registers of 16 warps.
constexpr int kFewWarpsMin = 4;
template <int MT>
constexpr int few_warps_max() {
  return MT <= 2 ? 16 : 8;
}

// W rows and x rows of one step of a warp, and the MMAs on them. TRANS (W^T: W's row j is
// Wv's column j, contiguous along k): a step covers 32 k; the thread loads 8 k from k0 + 8q
// of W rows j0 + 16i + g and + 8 (tile i), and the same 8 k of x's row 8t + g (tile t); the
// chunks' 32-bit words 2u and 2u + 1 feed slots k 2q.. and 2q + 8.. of the step's u-th MMA.
// Output row r of tile i is column j0 + 16i + r.
// Not TRANS (W's row k is contiguous along the output columns): a step covers 16 k; the
// thread loads 2 NA columns from j0 + 2 NA g of W rows k0 + 4q + s (s = 0..3), and 4 k from
// k0 + 4q of x's row 8t + g. Rows s = 0, 1 pair up (byte_perm) into slot k 2q.., rows 2, 3
// into k 2q + 8..; of the pairs of column c, c = 2i goes to row g of tile i and c = 2i + 1 to
// row g + 8: output row g + 8h of tile i is column j0 + 2 NA g + 2i + h.
template <typename T, bool TRANS, int NA, int MT>
struct FewRowsStep {
  static constexpr int KS = TRANS ? 32 : 16;          // k per step
  static constexpr int W_LOADS = TRANS ? 2 * NA : 4;  // W chunks per thread
  static constexpr int W_WORDS = TRANS ? 4 : NA;      // 32-bit words per W chunk
  static constexpr int X_WORDS = TRANS ? 4 : 2;       // per x chunk
  // Steps in flight per thread: as many as about 80 registers hold beside the accumulators
  // (of 128 at 16 warps; 128 of 255 at 8, where more spilled).
  static constexpr int kUnroll =
      std::max(1, std::min(8, ((few_warps_max<MT>() == 16 ? 80 : 128) - 4 * NA * MT) /
                                  (W_LOADS * W_WORDS + MT * X_WORDS)));
  uint32_t w[W_LOADS][W_WORDS];
  uint32_t x[MT][X_WORDS];

  // A chunk where `in`, else dst unchanged. W through the read-only path; not x, which the
  // kernel writes (after its last read).
  template <bool READ_ONLY, int WORDS>
  __device__ __forceinline__ static void load(uint32_t (&dst)[WORDS], const T* src, bool in) {
    static_assert(WORDS == 1 || WORDS == 2 || WORDS == 4, "4-, 8- or 16-byte chunks");
    if (!in) return;
    if constexpr (WORDS == 1) {
      const auto* p = reinterpret_cast<const uint32_t*>(src);
      dst[0] = READ_ONLY ? __ldg(p) : *p;
    } else if constexpr (WORDS == 4) {
      const auto* p = reinterpret_cast<const uint4*>(src);
      const uint4 v = READ_ONLY ? __ldg(p) : *p;
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    } else {
      const auto* p = reinterpret_cast<const uint2*>(src);
      const uint2 v = READ_ONLY ? __ldg(p) : *p;
      dst[0] = v.x, dst[1] = v.y;
    }
  }

  // Where this thread's chunks of step 0 start (nullptr: outside W or past x's last row,
  // read as zeros), set once per block; step k0's are k0 further along x's rows and W's
  // rows (TRANS) or k0 rows of W further (not TRANS).
  struct Base {
    const T* w[W_LOADS];
    const T* x[MT];
  };

  __device__ __forceinline__ static Base base(const Args<T>& a, int j0, int g, int q) {
    Base b;
#pragma unroll
    for (int l = 0; l < W_LOADS; ++l) {
      // TRANS: W row j from k 8q; else W row 4q + l from column j.
      const int j = TRANS ? j0 + 16 * (l / 2) + g + 8 * (l % 2) : j0 + 2 * NA * g;
      b.w[l] = j >= a.k ? nullptr
               : TRANS  ? a.w + static_cast<int64_t>(j) * a.k + 8 * q
                        : a.w + static_cast<int64_t>(4 * q + l) * a.k + j;
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const int n = 8 * t + g;
      b.x[t] = n < a.rows ? a.x + a.row.offset(n) + (TRANS ? 8 : 4) * q : nullptr;
    }
    return b;
  }

  // Every chunk zero: those outside W or x are never loaded (fetch) and stay so.
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int l = 0; l < W_LOADS; ++l)
#pragma unroll
      for (int v = 0; v < W_WORDS; ++v) w[l][v] = 0;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int v = 0; v < X_WORDS; ++v) x[t][v] = 0;
  }

  // The step at k0, a multiple of KS. K is a multiple of KS, so a step lies wholly inside K,
  // or past it where `live` is false: nothing is loaded then (nor multiplied).
  __device__ __forceinline__ void fetch(const Args<T>& a, const Base& b, int k0, bool live) {
    const int64_t w_off = TRANS ? k0 : static_cast<int64_t>(k0) * a.k;
#pragma unroll
    for (int l = 0; l < W_LOADS; ++l) load<true>(w[l], b.w[l] + w_off, live && b.w[l]);
#pragma unroll
    for (int t = 0; t < MT; ++t) load<false>(x[t], b.x[t] + k0, live && b.x[t]);
  }

  __device__ __forceinline__ void mma(float (&acc)[NA][MT][4]) const {
    if constexpr (TRANS) {
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < NA; ++i) {
          const uint32_t af[4] = {w[2 * i][2 * u], w[2 * i + 1][2 * u], w[2 * i][2 * u + 1],
                                  w[2 * i + 1][2 * u + 1]};
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const uint32_t bf[2] = {x[t][2 * u], x[t][2 * u + 1]};
            mma_16816<T>(acc[i][t], af, bf);
          }
        }
    } else {
#pragma unroll
      for (int i = 0; i < NA; ++i) {
        // Columns 2i (row g) and 2i + 1 (row g + 8) are the halves of word i: 0x5410 pairs
        // the low halves of two words, 0x7632 the high ones (the first word's in the low
        // half, the smaller k).
        const uint32_t af[4] = {
            __byte_perm(w[0][i], w[1][i], 0x5410), __byte_perm(w[0][i], w[1][i], 0x7632),
            __byte_perm(w[2][i], w[3][i], 0x5410), __byte_perm(w[2][i], w[3][i], 0x7632)};
#pragma unroll
        for (int t = 0; t < MT; ++t) mma_16816<T>(acc[i][t], af, x[t]);
      }
    }
  }

  // The output column of accumulator row r (0..15) of tile i.
  __device__ __forceinline__ static int column(int j0, int i, int r) {
    return TRANS ? j0 + 16 * i + r : j0 + 2 * NA * (r % 8) + 2 * i + r / 8;
  }
};

template <typename T, bool TRANS, int NA, int MT>
__device__ __forceinline__ void few_rows_body(const Args<T>& a) {
  using Step = FewRowsStep<T, TRANS, NA, MT>;
  constexpr int BN = 16 * NA, U = Step::kUnroll, ACC = NA * MT * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int j0 = blockIdx.x * BN;

  const typename Step::Base base = Step::base(a, j0, g, q);
  float acc[NA][MT][4] = {};
  const int steps = a.k / Step::KS;
  // Warp w takes steps w, w + warps, ...: the warps of a block read neighbouring k. U steps
  // in flight: each step's registers are fetched again, U steps on, once its MMAs have
  // issued.
  Step st[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int s = warp + u * warps;
    st[u].zero();
    st[u].fetch(a, base, s * Step::KS, s < steps);
  }
  for (int s0 = warp; s0 < steps; s0 += U * warps) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u * warps < steps) st[u].mma(acc);
      const int s = s0 + (U + u) * warps;
      st[u].fetch(a, base, s * Step::KS, s < steps);
    }
  }

  // Partial sums of the warps, [warp][accumulator][lane]; thread e sums element e of every
  // warp into warp 0's (the only thread to read or write it).
  extern __shared__ __align__(16) unsigned char smem[];
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < NA; ++i)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        part[(warp * ACC + (i * MT + t) * 4 + c) * 32 + lane] = acc[i][t][c];
  __syncthreads();
  for (int e = threadIdx.x; e < ACC * 32; e += blockDim.x) {
    float sum = part[e];
    for (int w = 1; w < warps; ++w) sum += part[w * ACC * 32 + e];
    part[e] = sum;
  }

  // Every block has read all of x's rows once every block is here.
  cg::this_grid().sync();
  for (int e = threadIdx.x; e < ACC * 32; e += blockDim.x) {
    // e = (accumulator index, lane of the thread that held it); accumulator (i, t, c):
    // row g' + 8 (c / 2) of tile i, x row 8t + 2q' + c % 2, (g', q') of that lane.
    const int l = e % 32, idx = e / 32;
    const int c = idx % 4, t = idx / 4 % MT, i = idx / 4 / MT;
    const int j = Step::column(j0, i, l / 4 + 8 * (c / 2));
    const int n = 8 * t + 2 * (l % 4) + c % 2;
    if (j < a.k && n < a.rows) {
      const float v = a.bias ? part[e] + to_float(a.bias[j]) : part[e];
      a.x[a.row.offset(n) + j] = from_float<T>(v);
    }
  }
}

template <typename T, bool TRANS, int NA, int MT>
__global__ void __launch_bounds__(few_warps_max<MT>() * 32)
    few_rows_kernel(const __grid_constant__ Args<T> a) {
  if constexpr (has_mma<T>())
    few_rows_body<T, TRANS, NA, MT>(a);
  else
    __trap();
}

// Shared memory of few_rows_kernel: the warps' partial sums.
template <int NA, int MT>
constexpr size_t few_rows_smem(int warps) {
  return static_cast<size_t>(warps) * NA * MT * 4 * 32 * sizeof(float);
}

// Blocks of few_rows_kernel<T, TRANS, NA, MT> of `warps` warps (4, 8 or 16) resident at once
// on the current device. The kernel's shared memory limit is raised to what its largest
// blocks need, or as far as the device allows (blocks that need more are not resident), the
// same for every size asked, so that no later question lowers it under an earlier answer.
template <typename T, bool TRANS, int NA, int MT>
int few_rows_resident(int warps, const DeviceInfo& d) {
  static std::atomic<int> cache[3][kMaxDevices];
  return once_per_device(cache[warps == 4   ? 0
                               : warps == 8 ? 1
                                            : 2],
                         [&](int) {
                           const size_t smem = few_rows_smem<NA, MT>(warps), optin = d.smem_optin;
                           if (smem > optin) return 0;
                           return occupancy_units(
                               &few_rows_kernel<T, TRANS, NA, MT>, warps * 32, 1, smem, d.sm_count,
                               std::min(few_rows_smem<NA, MT>(few_warps_max<MT>()), optin));
                         });
}

// Calls f(std::bool_constant<TRANS>, std::integral_constant<int, NA>,
// std::integral_constant<int, MT>) for the kernel built for trans, na (1, 2 or 4) and mt
// (1, 2, 4 or 8).
template <class F>
auto with_shape(bool trans, int na, int mt, F&& f) {
  const auto by_mt = [&](auto tr, auto n) {
    switch (mt) {
      case 1:
        return f(tr, n, std::integral_constant<int, 1>{});
      case 2:
        return f(tr, n, std::integral_constant<int, 2>{});
      case 4:
        return f(tr, n, std::integral_constant<int, 4>{});
      default:
        return f(tr, n, std::integral_constant<int, 8>{});
    }
  };
  const auto by_na = [&](auto tr) {
    switch (na) {
      case 1:
        return by_mt(tr, std::integral_constant<int, 1>{});
      case 2:
        return by_mt(tr, std::integral_constant<int, 2>{});
      default:
        return by_mt(tr, std::integral_constant<int, 4>{});
    }
  };
  return trans ? by_na(std::true_type{}) : by_na(std::false_type{});
}

// The launch of blocks of na tiles: one block per 16 * na columns, with as many warps per
// block (halving from few_warps_max) as keep the grid within warps_per_sm warps per
// multiprocessor; no warps where the blocks do not all fit at once even with kFewWarpsMin.
template <typename T>
FewRowsConfig config(const Args<T>& a, bool trans, int na, int64_t warps_per_sm,
                     const DeviceInfo& d) {
  FewRowsConfig c;
  c.na = na <= 1 ? 1 : na == 2 ? 2 : 4;
  c.mt = a.rows <= 8 ? 1 : a.rows <= 16 ? 2 : a.rows <= 32 ? 4 : 8;
  c.warps = with_shape(trans, c.na, c.mt, [&](auto tr, auto n, auto m) {
    constexpr bool TRANS = decltype(tr)::value;
    constexpr int NA = decltype(n)::value, MT = decltype(m)::value;
    const int64_t grid = ceil_div(a.k, 16 * NA);
    int warps = few_warps_max<MT>();
    while (warps > kFewWarpsMin && grid * warps > warps_per_sm * d.sm_count) warps /= 2;
    while (warps >= kFewWarpsMin && grid > few_rows_resident<T, TRANS, NA, MT>(warps, d))
      warps /= 2;
    return warps < kFewWarpsMin ? 0 : warps;
  });
  return c;
}

}  // namespace

template <typename T>
void few_rows_configs(const Args<T>& a, bool trans, const DeviceInfo& d,
                      FewRowsConfig (&configs)[2]) {
  const TuningKey key = tuning_key(d, sizeof(T), a.k);
  const Tunable& tiles = trans          ? (a.rows <= 16 ? kFewRowsTilesXwt16 : kFewRowsTilesXwt64)
                         : a.rows <= 8  ? kFewRowsTilesXw8
                         : a.rows <= 16 ? kFewRowsTilesXw16
                                        : kFewRowsTilesXw64;
  const int na = static_cast<int>(tuned(tiles, key));
  const int64_t warps_per_sm = tuned(kFewRowsWarpsPerSm, key);
  configs[0] = config(a, trans, na, warps_per_sm, d);
  configs[1] = FewRowsConfig{};
  // Blocks of one tile fall back on blocks of two, half as many, where they do not all fit.
  if (configs[0].na == 1)
    (configs[0].warps > 0 ? configs[1] : configs[0]) = config(a, trans, 2, warps_per_sm, d);
}

template <typename T>
cudaError_t launch_few_rows(const Args<T>& a, bool trans, const FewRowsConfig& c,
                            cudaStream_t stream) {
  return with_shape(trans, c.na, c.mt, [&](auto tr, auto n, auto m) {
    constexpr bool TRANS = decltype(tr)::value;
    constexpr int NA = decltype(n)::value, MT = decltype(m)::value;
    void* args[] = {const_cast<Args<T>*>(&a)};
    const cudaError_t err = cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(&few_rows_kernel<T, TRANS, NA, MT>),
        dim3(static_cast<unsigned>(ceil_div(a.k, 16 * NA))), dim3(c.warps * 32), args,
        few_rows_smem<NA, MT>(c.warps), stream);
    return err == cudaSuccess ? cudaGetLastError() : err;
  });
}

#define MTI_INSTANTIATE(T)                                                                         \
  template void few_rows_configs<T>(const Args<T>&, bool, const DeviceInfo&, FewRowsConfig(&)[2]); \
  template cudaError_t launch_few_rows<T>(const Args<T>&, bool, const FewRowsConfig&, cudaStream_t);
MTI_INSTANTIATE(__half)
MTI_INSTANTIATE(__nv_bfloat16)
#undef MTI_INSTANTIATE

}  // namespace mti::square_matmul
