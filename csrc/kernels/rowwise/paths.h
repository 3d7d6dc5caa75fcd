// Where a row lives between its read and its write: one vocabulary for the forward kernel
// (forward.cuh) and the backward kernel (backward_kernel.cuh). Each compiles the paths it
// has; its launcher picks one per call.
#pragma once

#include <type_traits>

namespace mti {

enum class RowPath {
  // In registers, held by a group of <= 32 lanes (several rows per CTA), a run of whole warps
  // or a whole CTA.
  kRegisters,
  // kRegisters with more elements per thread: the backward's 16-bit softmax rows that a CTA
  // holds only so.
  kWideRegisters,
  // In the registers of a CTA of the cluster size (kMaxThreads; the backward's may be
  // kLargeCtaThreads) or, on sm_90+, of a cluster of such CTAs that reduce over distributed
  // shared memory.
  kCluster,
  // kCluster with kWideRegisters' elements per thread (backward): rows that no cluster holds
  // otherwise.
  kWideCluster,
  // kCluster with each thread holding as much of the row again in shared memory (forward).
  kStashed,
  // Staged in the shared memory of a CTA or a cluster, read from there vector by vector
  // (backward).
  kShared,
  // Rows too long for the above: read once to reduce and once more to write.
  kStream,
};

// A path as a type, for the launchers' compile-time dispatch.
template <RowPath kPath>
using PathTag = std::integral_constant<RowPath, kPath>;

// Steps of NV vectors that a thread holds of a row on `path`.
constexpr int held_steps(RowPath path) { return path == RowPath::kStashed ? 2 : 1; }

// Whether a row on `path` may span the CTAs of a cluster (the CTAs then have the cluster
// size, and CTA `rank` owns the rank-th run of the row).
constexpr bool spans_cluster(RowPath path) {
  return path == RowPath::kCluster || path == RowPath::kWideCluster || path == RowPath::kStashed ||
         path == RowPath::kShared;
}

// Whether `path` holds more elements per thread than the op's plain register rows.
constexpr bool is_wide(RowPath path) {
  return path == RowPath::kWideRegisters || path == RowPath::kWideCluster;
}

// Which backward rows past a CTA's registers a cluster's registers hold (RowPath::kCluster,
// and kWideCluster where the op has it), the others being staged (RowPath::kShared): none,
// only those that take clusters of large CTAs, or all. Values of the cluster_registers tables.
enum class ClusterRegisters { kNone = 0, kLargeCtas = 1, kAll = 2 };

}  // namespace mti
