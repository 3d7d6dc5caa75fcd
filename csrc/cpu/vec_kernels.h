// The CPU row-wise kernels, forward and backward, vectorized with ATen's Vectorized<T> and
// parallel over rows (at::parallel_for). Included once per instruction set by isa_base.cpp and
// isa_avx2.cpp, each of which includes ATen's vec headers and defines MTI_CPU_ISA, the
// namespace the kernels land in (isa.h declares them and picks one at run time).
//
// Each row is computed in opmath (fp32, fp64 for double) on a contiguous array: the row itself
// when x is fp32/fp64 with unit column stride, else a copy of it in a row buffer, written back
// at the end. Extra memory: that one row buffer per thread (none for contiguous fp32/fp64
// forward rows), two in the norms' backward, plus for 16-bit types the weight and bias in fp32.
//
// Sums: four vector accumulators over each chunk of kSumChunk elements, the chunk totals in
// double, so a sum's error stays near fp32's rounding of each term whatever the row length
// (PyTorch's CPU kernels keep one accumulator vector over the whole row).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/isa.h"
#include "cpu/rowwise_common.h"

#ifndef MTI_CPU_ISA
#error "define MTI_CPU_ISA (the namespace of this instantiation) before including vec_kernels.h"
#endif

namespace mti::cpu::MTI_CPU_ISA {
namespace {

using at::vec::Vectorized;

constexpr int64_t kSumChunk = 1024;

template <typename T>
const T kNegInf = -std::numeric_limits<T>::infinity();

// p itself where scalar_t is its own opmath type, else nullptr (never used: such rows are
// buffered).
template <typename acc_t, typename scalar_t>
acc_t* as_acc(scalar_t* p) {
  if constexpr (std::is_same_v<acc_t, std::remove_const_t<scalar_t>>)
    return const_cast<acc_t*>(p);
  else
    return nullptr;
}

// fv(j) for each full vector of [0, n) at j, then fs(j) for each element left.
template <typename acc_t, typename FV, typename FS>
void for_each_vec(int64_t n, const FV& fv, const FS& fs) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  int64_t j = 0;
  for (; j + W <= n; j += W) fv(j);
  for (; j < n; ++j) fs(j);
}

// K sums over [0, n) at once: fv(j) gives each sum's vector of terms j..j+W-1, fs(j) each
// sum's one term, added in double (a row shorter than a vector is summed in double). fv and fs
// may write as they go (softmax stores each exp).
template <typename acc_t, size_t K, typename FV, typename FS>
std::array<double, K> chunked_sums(int64_t n, const FV& fv, const FS& fs) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  std::array<double, K> total{};
  for (int64_t c0 = 0; c0 < n; c0 += kSumChunk) {
    const int64_t c1 = std::min(n, c0 + kSumChunk);
    std::array<Vec, K> a0, a1, a2, a3;
    for (size_t k = 0; k < K; ++k) a0[k] = a1[k] = a2[k] = a3[k] = Vec(0);
    int64_t j = c0;
    for (; j + 4 * W <= c1; j += 4 * W) {
      const std::array<Vec, K> t0 = fv(j), t1 = fv(j + W), t2 = fv(j + 2 * W), t3 = fv(j + 3 * W);
      for (size_t k = 0; k < K; ++k) {
        a0[k] += t0[k];
        a1[k] += t1[k];
        a2[k] += t2[k];
        a3[k] += t3[k];
      }
    }
    for (; j + W <= c1; j += W) {
      const std::array<Vec, K> t = fv(j);
      for (size_t k = 0; k < K; ++k) a0[k] += t[k];
    }
    std::array<double, K> s;
    for (size_t k = 0; k < K; ++k)
      s[k] = static_cast<double>(at::vec::vec_reduce_all<acc_t>([](Vec a, Vec b) { return a + b; },
                                                                (a0[k] + a1[k]) + (a2[k] + a3[k])));
    for (; j < c1; ++j) {
      const std::array<double, K> t = fs(j);
      for (size_t k = 0; k < K; ++k) s[k] += t[k];
    }
    for (size_t k = 0; k < K; ++k) total[k] += s[k];
  }
  return total;
}

// chunked_sums of one sum: fv(j) a vector, fs(j) one term.
template <typename acc_t, typename FV, typename FS>
double chunked_sum(int64_t n, const FV& fv, const FS& fs) {
  return chunked_sums<acc_t, 1>(
      n, [&](int64_t j) { return std::array<Vectorized<acc_t>, 1>{fv(j)}; },
      [&](int64_t j) { return std::array<double, 1>{static_cast<double>(fs(j))}; })[0];
}

// The sum over [0, n) of f(j), a double, in double: eight partial sums, which the compiler
// keeps in vector registers. For the norm backward, whose sums cancel: the products of two
// opmath values are exact in double.
template <typename F>
double sum_f64(int64_t n, const F& f) {
  double acc[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) acc[k] += f(j + k);
  double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; j < n; ++j) s += f(j);
  return s;
}

// The largest of z[0, n); NaN if any is NaN, -inf for n == 0.
template <typename acc_t>
acc_t row_max(const acc_t* z, int64_t n) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  int64_t j = 0;
  acc_t mx = kNegInf<acc_t>;
  if (n >= 2 * W) {
    Vec m0 = Vec::loadu(z), m1 = Vec::loadu(z + W);
    for (j = 2 * W; j + 2 * W <= n; j += 2 * W) {
      m0 = at::vec::maximum(m0, Vec::loadu(z + j));
      m1 = at::vec::maximum(m1, Vec::loadu(z + j + W));
    }
    mx = at::vec::vec_reduce_all<acc_t>([](Vec a, Vec b) { return at::vec::maximum(a, b); },
                                        at::vec::maximum(m0, m1));
  }
  for (; j < n; ++j)
    if (std::isnan(z[j]) || z[j] > mx) mx = z[j];
  return mx;
}

// n elements of a row with column stride `stride` into the array dst (opmath, or double).
template <typename acc_t, typename scalar_t>
void load_row(acc_t* dst, const scalar_t* src, int64_t stride, int64_t n) {
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    if (stride == 1) {
      std::memcpy(dst, src, n * sizeof(acc_t));
      return;
    }
  } else if constexpr (std::is_same_v<acc_t, at::opmath_type<scalar_t>>) {
    // 16-bit to fp32: convert a vector at a time
    using BVec = Vectorized<scalar_t>;
    constexpr int64_t W = Vectorized<float>::size();
    if (stride == 1) {
      int64_t j = 0;
      for (; j + BVec::size() <= n; j += BVec::size()) {
        const auto [lo, hi] = at::vec::convert_to_float<scalar_t>(BVec::loadu(src + j));
        lo.store(dst + j);
        hi.store(dst + j + W);
      }
      for (; j < n; ++j) dst[j] = static_cast<acc_t>(src[j]);
      return;
    }
  }
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[j * stride]);
}

// The inverse of load_row: n values over a row, each rounded to scalar_t (a double through
// opmath first).
template <typename acc_t, typename scalar_t>
void store_row(scalar_t* dst, int64_t stride, const acc_t* src, int64_t n) {
  using op_t = at::opmath_type<scalar_t>;
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    if (stride == 1) {
      if (dst != src) std::memcpy(dst, src, n * sizeof(acc_t));
      return;
    }
  } else if constexpr (std::is_same_v<acc_t, op_t>) {
    using FVec = Vectorized<float>;
    constexpr int64_t W = FVec::size();
    if (stride == 1) {
      int64_t j = 0;
      for (; j + 2 * W <= n; j += 2 * W)
        at::vec::convert_from_float<scalar_t>(FVec::loadu(src + j), FVec::loadu(src + j + W))
            .store(dst + j);
      for (; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j]);
      return;
    }
  }
  for (int64_t j = 0; j < n; ++j)
    dst[j * stride] = static_cast<scalar_t>(static_cast<op_t>(src[j]));
}

// z = z * scale, then the mask: False -> -inf (bool), or added (additive).
template <typename acc_t, typename mask_t>
void prepare_logits(acc_t* z, int64_t n, acc_t scale, const mask_t* m, int64_t ms) {
  if (scale != acc_t(1))
    for (int64_t j = 0; j < n; ++j) z[j] *= scale;
  if (!m) return;
  if constexpr (std::is_same_v<mask_t, bool>) {
    if (ms == 1) {
      for (int64_t j = 0; j < n; ++j) z[j] = m[j] ? z[j] : kNegInf<acc_t>;
    } else {
      for (int64_t j = 0; j < n; ++j) z[j] = m[j * ms] ? z[j] : kNegInf<acc_t>;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) z[j] += static_cast<acc_t>(m[j * ms]);
  }
}

// softmax (or log_softmax) of the logits z[0, n), in place. Returns false, z unchanged, when
// no element takes part (the max is -inf).
template <typename acc_t>
bool softmax_in_place(acc_t* z, int64_t n, bool log) {
  using Vec = Vectorized<acc_t>;
  const acc_t mx = row_max(z, n);
  if (mx == kNegInf<acc_t>) return false;
  const Vec vmx(mx);
  if (!log) {  // each exp kept in z, so the scaling pass multiplies instead of exponentiating
    const double sum = chunked_sum<acc_t>(
        n,
        [&](int64_t j) {
          const Vec e = (Vec::loadu(z + j) - vmx).exp();
          e.store(z + j);
          return e;
        },
        [&](int64_t j) { return z[j] = std::exp(z[j] - mx); });
    const acc_t inv = static_cast<acc_t>(1.0 / sum);
    for_each_vec<acc_t>(
        n, [&](int64_t j) { (Vec::loadu(z + j) * Vec(inv)).store(z + j); },
        [&](int64_t j) { z[j] *= inv; });
  } else {
    const double sum = chunked_sum<acc_t>(
        n, [&](int64_t j) { return (Vec::loadu(z + j) - vmx).exp(); },
        [&](int64_t j) { return std::exp(z[j] - mx); });
    const acc_t shift = static_cast<acc_t>(mx + std::log(sum));
    for_each_vec<acc_t>(
        n, [&](int64_t j) { (Vec::loadu(z + j) - Vec(shift)).store(z + j); },
        [&](int64_t j) { z[j] -= shift; });
  }
  return true;
}

template <typename scalar_t, typename mask_t>
void softmax_rows_impl(scalar_t* x, const RowLayout& L, const mask_t* mask, const MaskLayout& ML,
                       const SoftmaxParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const bool direct = std::is_same_v<acc_t, scalar_t> && L.col_stride == 1;
  const acc_t scale = static_cast<acc_t>(p.scale);
  at::parallel_for(0, L.rows, grain_rows(L.n), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(direct ? 0 : L.n);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = x + L.row.offset(r);
      const int64_t n_act = p.causal ? std::min(L.n, r % p.q_len + 1) : L.n;  // causal: j <= i
      acc_t* z = direct ? as_acc<acc_t>(row) : buf.data();
      if (!direct) load_row(z, row, L.col_stride, n_act);
      if (scale != acc_t(1) || mask)
        prepare_logits(z, n_act, scale, mask ? mask + ML.row.offset(r) : nullptr, ML.col_stride);
      // A row in which nothing takes part becomes zeros (documented); past the causal limit,
      // softmax gives 0 and log_softmax -inf.
      const bool any = softmax_in_place(z, n_act, p.log);
      const int64_t written = any ? n_act : 0;
      if (!direct) store_row(row, L.col_stride, z, written);
      const scalar_t rest = any && p.log ? kNegInf<scalar_t> : scalar_t(0);
      for (int64_t j = written; j < L.n; ++j) row[j * L.col_stride] = rest;
    }
  });
}

// 16-bit weight and bias converted to opmath once per call (into `storage`, two rows);
// fp32/fp64 ones used as they are.
template <typename acc_t, typename scalar_t>
std::pair<const acc_t*, const acc_t*> opmath_params(const scalar_t* weight, const scalar_t* bias,
                                                    int64_t n, std::vector<acc_t>& storage) {
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    return {weight, bias};
  } else {
    storage.resize((weight ? n : 0) + (bias ? n : 0));
    acc_t* w = weight ? storage.data() : nullptr;
    acc_t* b = bias ? storage.data() + (weight ? n : 0) : nullptr;
    if (w) load_row(w, weight, 1, n);
    if (b) load_row(b, bias, 1, n);
    return {w, b};
  }
}

// LayerNorm (rms = false) or RMSNorm (rms = true) of every row. Two passes for the statistics
// (the mean, then centred squares: accurate when |mean| >> std), one to write. Each pass is
// vectorized in opmath; the statistics are chunked sums (chunked_sum) and the mean and rstd are
// doubles, so that rstd carries no more than fp32's rounding of each square into every x_hat
// that the backward recovers from y. A row's last elements (fewer than a vector) are computed
// in double throughout.
template <typename scalar_t>
void norm_rows_impl(scalar_t* x, const RowLayout& L, const scalar_t* weight, const scalar_t* bias,
                    double eps, float* rstd_out, bool rms) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t n = L.n;
  const bool direct = std::is_same_v<acc_t, scalar_t> && L.col_stride == 1;
  std::vector<acc_t> param_storage;
  const acc_t *w, *b;
  std::tie(w, b) = opmath_params(weight, bias, n, param_storage);
  at::parallel_for(0, L.rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(direct ? 0 : n);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = x + L.row.offset(r);
      acc_t* z = direct ? as_acc<acc_t>(row) : buf.data();
      if (!direct) load_row(z, row, L.col_stride, n);
      // The mean as pivot + mean(x - pivot), pivot = x[0]: each term is then rounded at the
      // row's spread, not at |x|.
      double mean = 0;
      if (!rms && n > 0) {
        const acc_t pivot = z[0];
        const Vec vp(pivot);
        mean = static_cast<double>(pivot) +
               chunked_sum<acc_t>(
                   n, [&](int64_t j) { return Vec::loadu(z + j) - vp; },
                   [&](int64_t j) { return static_cast<double>(z[j]) - pivot; }) /
                   static_cast<double>(n);
      }
      // mean as hi + lo in opmath: (x - hi) - lo is x - mean rounded at its own size (x - hi
      // is exact where x is near the mean).
      const acc_t mean_hi = static_cast<acc_t>(mean);
      const acc_t mean_lo = static_cast<acc_t>(mean - static_cast<double>(mean_hi));
      const Vec vhi(mean_hi), vlo(mean_lo);
      const auto centred = [&](int64_t j) { return (Vec::loadu(z + j) - vhi) - vlo; };
      const double sq = chunked_sum<acc_t>(
          n,
          [&](int64_t j) {
            const Vec d = centred(j);
            return d * d;
          },
          [&](int64_t j) {
            const double d = static_cast<double>(z[j]) - mean;
            return d * d;
          });
      const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(n) + eps);
      if (rstd_out) rstd_out[r] = static_cast<float>(rstd);
      const Vec vr(static_cast<acc_t>(rstd));
      const auto write = [&](auto with_w, auto with_b) {
        for_each_vec<acc_t>(
            n,
            [&](int64_t j) {
              const Vec xh = centred(j) * vr;
              Vec y;
              if constexpr (decltype(with_w)::value && decltype(with_b)::value)
                y = at::vec::fmadd(xh, Vec::loadu(w + j), Vec::loadu(b + j));
              else if constexpr (decltype(with_w)::value)
                y = xh * Vec::loadu(w + j);
              else if constexpr (decltype(with_b)::value)
                y = xh + Vec::loadu(b + j);
              else
                y = xh;
              y.store(z + j);
            },
            [&](int64_t j) {
              double y = (static_cast<double>(z[j]) - mean) * rstd;
              if constexpr (decltype(with_w)::value) y *= static_cast<double>(w[j]);
              if constexpr (decltype(with_b)::value) y += static_cast<double>(b[j]);
              z[j] = static_cast<acc_t>(y);
            });
      };
      if (w && b)
        write(std::true_type{}, std::true_type{});
      else if (w)
        write(std::true_type{}, std::false_type{});
      else if (b)
        write(std::false_type{}, std::true_type{});
      else
        write(std::false_type{}, std::false_type{});
      if (!direct) store_row(row, L.col_stride, z, n);
    }
  });
}

// Whether element j of a row takes part, by the mask alone.
template <typename acc_t, typename mask_t>
bool mask_active(const mask_t* m, int64_t j, int64_t ms) {
  if constexpr (std::is_same_v<mask_t, bool>)
    return m[j * ms];
  else
    return static_cast<acc_t>(m[j * ms]) != kNegInf<acc_t>;
}

// dz = y * (dy - sum(dy * y) / sum(y)) (softmax) or dy - exp(y) * sum(dy) / sum(exp(y))
// (log_softmax), the sums over the whole row; grad_x = dz * scale, 0 where an element is
// masked (bool mask False, additive mask -inf, or past the causal limit). The divisions are
// by 1 but for rounding: the rounded probabilities of a stored output need not sum to 1 (a
// 16-bit y, or a log-probability's shared offset), and where the difference cancels, that
// error would dominate grad_x.
template <typename scalar_t, typename mask_t>
void softmax_backward_rows_impl(const scalar_t* y, const scalar_t* dy, scalar_t* dx,
                                const BackwardRows& R, const mask_t* mask, const MaskLayout& ML,
                                const SoftmaxParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t n = R.y.n;
  const bool direct = std::is_same_v<acc_t, scalar_t> && R.y.col_stride == 1 &&
                      R.grad.col_stride == 1 && R.grad_x.col_stride == 1;
  at::parallel_for(0, R.y.rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(direct ? 0 : 2 * n);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* yr = y + R.y.row.offset(r);
      const scalar_t* gr = dy + R.grad.row.offset(r);
      scalar_t* xr = dx + R.grad_x.row.offset(r);
      const acc_t *yv = as_acc<acc_t>(yr), *gv = as_acc<acc_t>(gr);
      acc_t* out = as_acc<acc_t>(xr);
      if (!direct) {
        load_row(buf.data(), yr, R.y.col_stride, n);
        load_row(buf.data() + n, gr, R.grad.col_stride, n);
        yv = out = buf.data();  // each output overwrites the y it was computed from
        gv = buf.data() + n;
      }
      // Vectorized in opmath. The gradient's sum cancels (terms of both signs), so it is summed
      // in double (sum_f64), the probabilities' in opmath chunks; s in double. dy - s cancels
      // where dy is close to the row's mean gradient, so softmax subtracts s as hi + lo (each
      // difference rounded at its own size). A row's last elements (fewer than a vector) are
      // computed in double.
      const Vec vscale(static_cast<acc_t>(p.scale));
      if (p.log) {  // out = exp(y) in the sums' pass (each output overwrites only its inputs)
        const double sum_p = chunked_sum<acc_t>(
            n,
            [&](int64_t j) {
              const Vec e = Vec::loadu(yv + j).exp();
              e.store(out + j);
              return e;
            },
            [&](int64_t j) { return out[j] = std::exp(yv[j]); });
        const double sum_g = sum_f64(n, [&](int64_t j) { return static_cast<double>(gv[j]); });
        const double s = sum_p > 0 ? sum_g / sum_p : 0;  // 0: no active element
        const Vec neg_s(static_cast<acc_t>(-s));
        for_each_vec<acc_t>(
            n,
            [&](int64_t j) {
              (at::vec::fmadd(Vec::loadu(out + j), neg_s, Vec::loadu(gv + j)) * vscale)
                  .store(out + j);
            },
            [&](int64_t j) {
              out[j] = static_cast<acc_t>((static_cast<double>(gv[j]) - out[j] * s) * p.scale);
            });
      } else {
        const double sum_p =
            chunked_sum<acc_t>(n, [&](int64_t j) { return Vec::loadu(yv + j); },
                               [&](int64_t j) { return yv[j]; });
        const double sum_gy = sum_f64(
            n, [&](int64_t j) { return static_cast<double>(gv[j]) * static_cast<double>(yv[j]); });
        const double s = sum_p > 0 ? sum_gy / sum_p : 0;
        const acc_t s_hi = static_cast<acc_t>(s);
        const Vec vhi(s_hi), vlo(static_cast<acc_t>(s - static_cast<double>(s_hi)));
        for_each_vec<acc_t>(
            n,
            [&](int64_t j) {
              ((((Vec::loadu(gv + j) - vhi) - vlo) * Vec::loadu(yv + j)) * vscale).store(out + j);
            },
            [&](int64_t j) {
              out[j] = static_cast<acc_t>((static_cast<double>(gv[j]) - s) * yv[j] * p.scale);
            });
      }
      const int64_t n_act = p.causal ? std::min(n, r % p.q_len + 1) : n;  // causal: j <= i
      if (mask) {
        const mask_t* mr = mask + ML.row.offset(r);
        for (int64_t j = 0; j < n_act; ++j)
          if (!mask_active<acc_t>(mr, j, ML.col_stride)) out[j] = 0;
      }
      std::fill(out + n_act, out + n, acc_t(0));
      if (!direct) store_row(xr, R.grad_x.col_stride, out, n);
    }
  });
}

// grad_x = rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)), g_hat = dy * weight,
// x_hat = (y - bias) / weight recovered from the output (0 where weight is 0); RMSNorm
// without the mean(g_hat) term. In double throughout (x_hat and g_hat in two row buffers of
// double per thread), as the recovery of x_hat and the difference both cancel; the loops
// vectorize with conversions.
template <typename scalar_t>
void norm_backward_rows_impl(const scalar_t* y, const scalar_t* dy, scalar_t* dx,
                             const BackwardRows& R, const scalar_t* weight, const scalar_t* bias,
                             const float* rstd, bool rms) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = R.y.n;
  std::vector<acc_t> param_storage;
  const acc_t *w, *b;
  std::tie(w, b) = opmath_params(weight, bias, n, param_storage);
  at::parallel_for(0, R.y.rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<double> xh(n), gh(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(xh.data(), y + R.y.row.offset(r), R.y.col_stride, n);
      load_row(gh.data(), dy + R.grad.row.offset(r), R.grad.col_stride, n);
      double *xp = xh.data(), *gp = gh.data();
      if (b)
        for (int64_t j = 0; j < n; ++j) xp[j] -= static_cast<double>(b[j]);
      if (w) {
        for (int64_t j = 0; j < n; ++j) {
          const double wj = static_cast<double>(w[j]);
          xp[j] = wj != 0 ? xp[j] / wj : 0.0;
          gp[j] *= wj;
        }
      }
      const double mean_g = rms ? 0.0 : sum_f64(n, [&](int64_t j) { return gp[j]; }) / n;
      const double mean_gx = sum_f64(n, [&](int64_t j) { return gp[j] * xp[j]; }) / n;
      const double rs = static_cast<double>(rstd[r]);
      for (int64_t j = 0; j < n; ++j) xp[j] = rs * (gp[j] - mean_g - xp[j] * mean_gx);
      store_row(dx + R.grad_x.row.offset(r), R.grad_x.col_stride, xp, n);
    }
  });
}

}  // namespace

// The overloads isa.h declares.
#define MTI_CPU_ROWWISE_DEFS(T)                                                                    \
  void softmax_rows(T* x, const RowLayout& L, const bool* mask, const MaskLayout& ML,              \
                    const SoftmaxParams& p) {                                                      \
    softmax_rows_impl<T, bool>(x, L, mask, ML, p);                                                 \
  }                                                                                                \
  void softmax_rows(T* x, const RowLayout& L, const T* mask, const MaskLayout& ML,                 \
                    const SoftmaxParams& p) {                                                      \
    softmax_rows_impl<T, T>(x, L, mask, ML, p);                                                    \
  }                                                                                                \
  void norm_rows(T* x, const RowLayout& L, const T* weight, const T* bias, double eps,             \
                 float* rstd_out, bool rms) {                                                      \
    norm_rows_impl<T>(x, L, weight, bias, eps, rstd_out, rms);                                     \
  }                                                                                                \
  void softmax_backward_rows(const T* y, const T* dy, T* dx, const BackwardRows& R,                \
                             const bool* mask, const MaskLayout& ML, const SoftmaxParams& p) {     \
    softmax_backward_rows_impl<T, bool>(y, dy, dx, R, mask, ML, p);                                \
  }                                                                                                \
  void softmax_backward_rows(const T* y, const T* dy, T* dx, const BackwardRows& R, const T* mask, \
                             const MaskLayout& ML, const SoftmaxParams& p) {                       \
    softmax_backward_rows_impl<T, T>(y, dy, dx, R, mask, ML, p);                                   \
  }                                                                                                \
  void norm_backward_rows(const T* y, const T* dy, T* dx, const BackwardRows& R, const T* weight,  \
                          const T* bias, const float* rstd, bool rms) {                            \
    norm_backward_rows_impl<T>(y, dy, dx, R, weight, bias, rstd, rms);                             \
  }

MTI_CPU_ROWWISE_DEFS(float)
MTI_CPU_ROWWISE_DEFS(double)
MTI_CPU_ROWWISE_DEFS(c10::Half)
MTI_CPU_ROWWISE_DEFS(c10::BFloat16)

#undef MTI_CPU_ROWWISE_DEFS

}  // namespace mti::cpu::MTI_CPU_ISA
