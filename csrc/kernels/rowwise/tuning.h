// Every GPU-dependent choice of the row-wise kernels (softmax / log_softmax, LayerNorm,
// RMSNorm, forward and backward), in one place.
//
// Compile-time constants come first: they shape the kernels' template instantiations (values
// per thread, CTA sizes, the CTAs per SM that cap their registers), so they stay constexpr and
// the tuning command cannot change them. The runtime tables come after: the launchers' choices,
// looked up with tuned() (kernels/tuning.h) for the GPU and the call, which the tuning command
// (make_torch_inplace/tune/rowwise.py names their candidates and deciding calls) may override.
// The values were chosen on an H100 (cc 90, 132 SMs); rows under on_h200() were measured on an
// H200 by the tuning command and apply there alone.
#pragma once

#include "kernels/rowwise/paths.h"
#include "kernels/tuning.h"

namespace mti {

// ------------------------------------------------------------------ hardware

constexpr int kWarpSize = 32;
constexpr int kMaxCluster = 16;  // 16 needs the non-portable cluster size opt-in (sm_90)

// ------------------------------------------------------------------ compile time: CTAs

// CTA size of every path but the backward's large CTAs: two fit an SM at up to 128 registers
// a thread, one loading while the other reduces or writes.
constexpr int kMaxThreads = 256;
constexpr int kMaxWarps = kMaxThreads / kWarpSize;
// CTA size where rows of up to a warp share a CTA.
constexpr int kSmallRowThreads = 128;
// The backward's large CTAs (one per SM at up to 128 registers a thread): a row takes half the
// CTAs of kMaxThreads, and rows that those would spread over a cluster take none.
constexpr int kLargeCtaThreads = 512;

// ------------------------------------------------------------------ compile time: forward

// Values (fp32 registers; 16-bit types as many elements) a thread holds of a row of up to a
// warp: the fewest lanes, the most bytes in flight per thread.
constexpr int kWarpRegs = 32;
// Values a thread holds of a row on the cluster paths: with ~35 registers of bookkeeping a CTA
// of kMaxThreads needs <= 128 a thread, so that two fit an SM (CTAs of 512 holding twice as
// much, one per SM, were slower).
constexpr int kCtaRegs = 64;
// Values per thread and step of a streamed row: fewer keep the two-pass kernel clear of spills.
constexpr int kStreamRegs = 16;
// Elements per thread and step on the scalar paths (VEC 1), forward and backward.
constexpr int kScalarNV = 8;
// Side inputs (masks) are read in batches of at most this many bytes after all of x's loads:
// a float mask read up front too would hold two copies of the step in registers.
constexpr int kAuxBatchBytes = 64;

// The most values per thread of a row that a CTA holds on the register path (the kernels
// compiled; the ops' tables pick up to this many): 16-bit values pack two to a register.
constexpr int cta_row_regs(int elem_bytes) { return elem_bytes == 2 ? 64 : kWarpRegs; }

// CTAs of kMaxThreads that the forward kernel is compiled to fit on an SM, which caps its
// registers (128 a thread for 2, 80 for 3, 64 for 4): more CTAs keep more rows in flight. Only
// 16-bit rows of at most kWarpRegs values a thread take more than 2 (longer rows need the
// registers; fp32 ones spilled on some architectures); 4 only on sm_90+ and only the register
// rows of ops that read nothing but x (older architectures, params and masks spill at 64). A
// stashed CTA's 64 KiB of shared memory leave one per SM where an SM has less than 164 KiB
// (sm_75, sm_86, sm_89), which then takes the registers of two.
constexpr int forward_min_ctas(int elem_bytes, int values, RowPath path, bool reads_only_x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 800 && __CUDA_ARCH__ < 900
  if (path == RowPath::kStashed) return 1;
#endif
  if (elem_bytes != 2 || values > kWarpRegs) return 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (reads_only_x && path == RowPath::kRegisters) return 4;
#endif
  return 3;
}

// ------------------------------------------------------------------ compile time: backward

// Elements of y and of dy a thread holds on softmax's register paths: 32 registers each in
// fp32 (16 or 64 per thread ran slower).
constexpr int kSoftmaxElems = 32;
// Elements a thread holds on the norms' register paths, which keep weight, bias and two fp32
// parameter gradient sums per element along.
constexpr int kParamElems = 16;
// Vectors of y and of dy a thread stages per buffer on the shared path: 64 KiB per CTA of
// kMaxThreads with both buffers, so that two CTAs fit an SM.
constexpr int kStagedVectors = 4;
// Elements per thread and step of a streamed row: fewer than registers would take, against
// spills.
constexpr int kStreamElems = 16;
// Partial rows in flight per thread where the parameter gradients' partial rows are summed.
constexpr int kSumChains = 4;

// Elements per thread on softmax's wide paths: a 16-bit thread holds 64, packed as 32
// registers each of y and dy, so that a CTA holds 16384 and a cluster 262144.
constexpr int softmax_wide_elems(int elem_bytes) {
  return elem_bytes == 2 ? 2 * kSoftmaxElems : kSoftmaxElems;
}
// Whether the norms' register rows take a large CTA before a cluster: 16-bit ones (fp32 rows
// lost on them).
constexpr bool norm_large_ctas(int elem_bytes) { return elem_bytes == 2; }
// Rows a norm takes per step on the shared path's largest clusters: two 16-bit rows share one
// pass of each reduction; fp32 rows stage twice the bytes, and two would leave one CTA per SM.
constexpr int norm_shared_rows(int elem_bytes) { return elem_bytes == 2 ? 2 : 1; }

// CTAs of `cta` threads that the backward kernel is compiled to fit on an SM: one large CTA,
// else two (128 registers a thread), but three (80 registers on sm_90a, 768 threads) for the
// 16-bit register rows of ops that read nothing but y and dy (with a mask tensor fp16 spilled
// at 80).
constexpr int backward_min_ctas(int elem_bytes, RowPath path, int cta, bool reads_only_rows) {
  if (cta > kMaxThreads) return 1;
  if (reads_only_rows && elem_bytes == 2 && path == RowPath::kRegisters) return 3;
  return 2;
}

// ------------------------------------------------------------------ runtime: both passes

// The most CTAs of a cluster that holds a row (no more than kMaxCluster).
inline constexpr TuningRow kMaxClusterRows[] = {
    {When{}, kMaxCluster, "the most that sm_90 allows"},
};
static_assert(ends_in_catch_all(kMaxClusterRows));
inline constexpr Tunable kTunedMaxCluster = tunable("rowwise.max_cluster", kMaxClusterRows);

// ------------------------------------------------------------------ runtime: forward

// The largest cluster a stashed row takes (ops whose stashed kernels are compiled for the
// dtype, see launch_rows); larger ones keep the row in registers.
inline constexpr TuningRow kStashMaxClusterRows[] = {
    {on_h200(When{.elem_bytes = 4, .n_min = 262144}), 8, "3% faster at n = 262144 (H200)"},
    {When{.elem_bytes = 4}, 2, "fp32 rows gained only where they then take at most two CTAs"},
    {When{}, kMaxCluster, "16-bit rows move as many bytes per CTA as fp32 ones when stashed"},
};
static_assert(ends_in_catch_all(kStashMaxClusterRows));
inline constexpr Tunable kStashMaxCluster =
    tunable("rowwise.forward.stash_max_cluster", kStashMaxClusterRows);

// Values per thread where a CTA holds a row on the register path, by op: at most
// cta_row_regs (the kernels compiled). More values a thread keep more bytes in flight per
// register of bookkeeping; fewer (more threads a row) ran slower everywhere measured.
inline constexpr TuningRow kSoftmaxCtaRowValuesRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_min = 6145, .n_max = 12288}), 64,
     "n = 8192-12288: 1-20% faster, masked most; causal lost 4-7% at n <= 6144 (H200)"},
    {When{}, kWarpRegs, "as many as a warp's rows hold"},
};
static_assert(ends_in_catch_all(kSoftmaxCtaRowValuesRows));
inline constexpr Tunable kSoftmaxCtaRowValues =
    tunable("rowwise.forward.softmax_cta_row_values", kSoftmaxCtaRowValuesRows);
inline constexpr TuningRow kRmsNormCtaRowValuesRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_min = 4096}), 64,
     "n = 6144-12288: 11-22% faster, n = 4096 2% (H200)"},
    {When{}, kWarpRegs, "as many as a warp's rows hold"},
};
static_assert(ends_in_catch_all(kRmsNormCtaRowValuesRows));
inline constexpr Tunable kRmsNormCtaRowValues =
    tunable("rowwise.forward.rms_norm_cta_row_values", kRmsNormCtaRowValuesRows);
inline constexpr TuningRow kLayerNormCtaRowValuesRows[] = {
    {When{.elem_bytes = 2}, 64, "twice the bytes in flight of softmax's and RMSNorm's rows"},
    {When{}, kWarpRegs, "as many as a warp's rows hold"},
};
static_assert(ends_in_catch_all(kLayerNormCtaRowValuesRows));
inline constexpr Tunable kLayerNormCtaRowValues =
    tunable("rowwise.forward.layer_norm_cta_row_values", kLayerNormCtaRowValuesRows);

// The most threads of a CTA that holds a row of an op with params at kCtaRegs values a thread
// on the register path, where the cluster path's CTA would hold it alike (16-bit LayerNorm);
// longer rows take the cluster path.
inline constexpr TuningRow kParamsCtaRowThreadsRows[] = {
    {When{}, kMaxThreads - kWarpSize, "the cluster path ran the longest such rows faster"},
};
static_assert(ends_in_catch_all(kParamsCtaRowThreadsRows));
inline constexpr Tunable kParamsCtaRowThreads =
    tunable("rowwise.forward.params_cta_row_threads", kParamsCtaRowThreadsRows);

// Row groups per CTA of a single-CTA launch that caches at most one param's vectors, by op (0:
// a grid of the CTAs resident at once, each striding over the rows).
inline constexpr TuningRow kSoftmaxRowsPerCtaRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_max = 8192}), 2,
     "n = 2048-8192: 2-8% faster than 1, log_softmax and masked too (H200)"},
    {on_h200(When{.n_max = 1024}), 2, "n = 256-1024: 1-5% faster than 1 (H200)"},
    {When{}, 1, "a new CTA starts on an SM whenever one ends, evening out the last wave"},
};
inline constexpr TuningRow kRmsNormRowsPerCtaRows[] = {
    {on_h200(When{.n_max = 1024}), 2, "bf16 n = 1024: 1% faster than 1, 3% than 0 (H200)"},
    {When{}, 1, "a new CTA starts on an SM whenever one ends, evening out the last wave"},
};
inline constexpr TuningRow kLayerNormRowsPerCtaRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_max = 8192}), 0,
     "n = 256-8192: 2-9% faster than 1 or 2 (H200)"},
    {on_h200(When{.n_max = 1024}), 2, "fp32 n <= 1024: as softmax's and RMSNorm's (H200)"},
    {When{}, 1, "a new CTA starts on an SM whenever one ends, evening out the last wave"},
};
static_assert(ends_in_catch_all(kSoftmaxRowsPerCtaRows) &&
              ends_in_catch_all(kRmsNormRowsPerCtaRows) &&
              ends_in_catch_all(kLayerNormRowsPerCtaRows));
inline constexpr Tunable kSoftmaxRowsPerCta =
    tunable("rowwise.forward.softmax_rows_per_cta", kSoftmaxRowsPerCtaRows);
inline constexpr Tunable kRmsNormRowsPerCta =
    tunable("rowwise.forward.rms_norm_rows_per_cta", kRmsNormRowsPerCtaRows);
inline constexpr Tunable kLayerNormRowsPerCta =
    tunable("rowwise.forward.layer_norm_rows_per_cta", kLayerNormRowsPerCtaRows);

// Rows per cluster of two CTAs that cache nothing (0: a grid of the clusters resident at once,
// each striding over the rows; larger clusters always do).
inline constexpr TuningRow kRowsPerPairRows[] = {
    {When{}, 2, "a row each paid the cluster's setup too often, striding evened out less"},
};
static_assert(ends_in_catch_all(kRowsPerPairRows));
inline constexpr Tunable kRowsPerPair = tunable("rowwise.forward.rows_per_pair", kRowsPerPairRows);

// The most params a row held by one CTA caches in shared memory (an op with more given caches
// none and reads them from L1).
inline constexpr TuningRow kCtaCachedParamsRows[] = {
    {When{}, 1, "LayerNorm's weight and bias ran faster from L1 than cached"},
};
static_assert(ends_in_catch_all(kCtaCachedParamsRows));
inline constexpr Tunable kCtaCachedParams =
    tunable("rowwise.forward.cta_cached_params", kCtaCachedParamsRows);

// ------------------------------------------------------------------ runtime: backward

// Threads per SM that a grid is sized for where no occupancy query decides (streamed rows).
inline constexpr TuningRow kThreadsPerSmRows[] = {
    {When{}, 2048, "an SM's threads on sm_80 and sm_90"},
};
static_assert(ends_in_catch_all(kThreadsPerSmRows));
inline constexpr Tunable kThreadsPerSm =
    tunable("rowwise.backward.threads_per_sm", kThreadsPerSmRows);

// How softmax's rows past a CTA's registers are held (ClusterRegisters): softmax, log_softmax
// without a mask tensor, log_softmax with one.
inline constexpr TuningRow kSoftmaxClusterRegistersRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_min = 262144}),
     static_cast<int64_t>(ClusterRegisters::kLargeCtas), "7% faster at n = 262144 (H200)"},
    {When{}, static_cast<int64_t>(ClusterRegisters::kAll), "registers ran faster than staging"},
};
static_assert(ends_in_catch_all(kSoftmaxClusterRegistersRows));
inline constexpr Tunable kSoftmaxClusterRegisters =
    tunable("rowwise.backward.softmax_cluster_registers", kSoftmaxClusterRegistersRows);
inline constexpr TuningRow kLogSoftmaxClusterRegistersRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_min = 65536, .n_max = 131072}),
     static_cast<int64_t>(ClusterRegisters::kNone), "staging ran n = 131072 9% faster (H200)"},
    {on_h200(When{.elem_bytes = 4, .n_max = 32768}), static_cast<int64_t>(ClusterRegisters::kNone),
     "staging ran n = 32768 4% faster (H200)"},
    {When{.elem_bytes = 2}, static_cast<int64_t>(ClusterRegisters::kLargeCtas),
     "16-bit rows recompute exp(y) in both passes: registers won on large CTAs only"},
    {When{}, static_cast<int64_t>(ClusterRegisters::kAll), "registers ran faster than staging"},
};
static_assert(ends_in_catch_all(kLogSoftmaxClusterRegistersRows));
inline constexpr Tunable kLogSoftmaxClusterRegisters =
    tunable("rowwise.backward.log_softmax_cluster_registers", kLogSoftmaxClusterRegistersRows);
inline constexpr TuningRow kMaskedLogSoftmaxClusterRegistersRows[] = {
    {When{.elem_bytes = 2}, static_cast<int64_t>(ClusterRegisters::kNone),
     "16-bit rows with a mask tensor take the slow exp: staging won"},
    {When{}, static_cast<int64_t>(ClusterRegisters::kAll), "registers ran faster than staging"},
};
static_assert(ends_in_catch_all(kMaskedLogSoftmaxClusterRegistersRows));
inline constexpr Tunable kMaskedLogSoftmaxClusterRegisters = tunable(
    "rowwise.backward.masked_log_softmax_cluster_registers", kMaskedLogSoftmaxClusterRegistersRows);

// Whether softmax's vector register rows of more than a warp take a CTA each (1) rather than
// sharing CTAs of up to kMaxThreads (0).
inline constexpr TuningRow kSoftmaxRowPerCtaRows[] = {
    {When{.elem_bytes = 2}, 1, "each row's loads, reduction and stores then run at their pace"},
    {When{}, 0, "fp32 rows ran as fast sharing CTAs"},
};
static_assert(ends_in_catch_all(kSoftmaxRowPerCtaRows));
inline constexpr Tunable kSoftmaxRowPerCta =
    tunable("rowwise.backward.softmax_row_per_cta", kSoftmaxRowPerCtaRows);

// The fewest CTAs of kMaxThreads that softmax's register cluster would number for it to take
// large CTAs instead.
inline constexpr TuningRow kLargeClusterMinRows[] = {
    {When{.elem_bytes = 4}, 2, "fp32 rows gained on large CTAs from clusters of two on"},
    {When{}, 9, "16-bit clusters of 4 and 16 lost on large CTAs"},
};
static_assert(ends_in_catch_all(kLargeClusterMinRows));
inline constexpr Tunable kLargeClusterMin =
    tunable("rowwise.backward.large_cluster_min", kLargeClusterMinRows);

// Shared-path clusters of more CTAs than this take a norm's rows norm_shared_rows at a time.
inline constexpr TuningRow kGroupedRowsPastClusterRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_max = 65536}), 1,
     "pairs of rows ran 16-bit LayerNorm at n = 32768 12% faster (H200)"},
    {When{}, 8, "smaller clusters' reductions cost too little to gain"},
};
static_assert(ends_in_catch_all(kGroupedRowsPastClusterRows));
inline constexpr Tunable kGroupedRowsPastCluster =
    tunable("rowwise.backward.grouped_rows_past_cluster", kGroupedRowsPastClusterRows);

// How many times over the grid holds the resident clusters of at most kSharedWavesMaxCluster
// CTAs on the shared path where they neither sum parameter gradients nor cache columns.
inline constexpr TuningRow kSharedWavesRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_min = 40960, .n_max = 65536}), 1,
     "3% faster at n = 40960-65536 (H200)"},
    {When{}, 4, "the hardware starts the next cluster as one ends, evening out the end"},
};
static_assert(ends_in_catch_all(kSharedWavesRows));
inline constexpr Tunable kSharedWaves = tunable("rowwise.backward.shared_waves", kSharedWavesRows);
inline constexpr TuningRow kSharedWavesMaxClusterRows[] = {
    {When{}, 8, "clusters of 16 lost with more waves"},
};
static_assert(ends_in_catch_all(kSharedWavesMaxClusterRows));
inline constexpr Tunable kSharedWavesMaxCluster =
    tunable("rowwise.backward.shared_waves_max_cluster", kSharedWavesMaxClusterRows);

// How many times over the grid holds the resident CTAs of softmax's wide rows where those do
// not take a CTA per row (16-bit log_softmax on large CTAs).
inline constexpr TuningRow kWideWavesRows[] = {
    {When{}, 2, "faster than striding over the rows and than a CTA per row"},
};
static_assert(ends_in_catch_all(kWideWavesRows));
inline constexpr Tunable kWideWaves = tunable("rowwise.backward.wide_waves", kWideWavesRows);

// CTAs per SM that column_sums_kernel's grid fills (streamed rows whose parameter gradient
// sums fit in no CTA's shared memory).
inline constexpr TuningRow kColumnSumsCtasPerSmRows[] = {
    {When{}, 8, "enough CTAs to fill the GPU a few times over"},
};
static_assert(ends_in_catch_all(kColumnSumsCtasPerSmRows));
inline constexpr Tunable kColumnSumsCtasPerSm =
    tunable("rowwise.backward.column_sums_ctas_per_sm", kColumnSumsCtasPerSmRows);

// The most slices of a CTA that share sum_partials_kernel's partial rows (a power of two of
// at most kMaxThreads): many for a few hundred rows, few for a few dozen.
inline constexpr TuningRow kSumMaxSlicesRows[] = {
    {When{}, 32, "a few hundred partial rows need many loads in flight per column"},
};
static_assert(ends_in_catch_all(kSumMaxSlicesRows));
inline constexpr Tunable kSumMaxSlices =
    tunable("rowwise.backward.sum_max_slices", kSumMaxSlicesRows);

}  // namespace mti
