// How every kernel family looks up its GPU-dependent choices (no torch, no CUDA here).
//
// Each family keeps one table per parameter in csrc/kernels/<family>/tuning.h: rows that say
// on which GPUs and shapes they apply (When), the value, and a one-line reason. The first row
// that matches wins, so a table runs from the most specific GPU down to a last row that
// matches any GPU. Kernels and launchers read these parameters through tuned() and hold no
// GPU-specific numbers of their own; adding a GPU means adding rows.
//
// Every parameter has a name, under which the tuning command (python -m
// make_torch_inplace.tune) may override it for the whole process while it measures the
// candidates; nothing else sets overrides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace mti {

// What a row may be keyed on: the GPU (compute capability as 10 * major + minor, SM count,
// memory bandwidth in GB/s, shared memory a block may opt into) and the call (element bytes,
// row length n).
struct TuningKey {
  int cc = 0;
  int sm_count = 0;
  int mem_gbps = 0;
  int smem_optin = 0;
  int elem_bytes = 0;
  int64_t n = 0;
};

// The GPUs and calls a row applies to; every bound is inclusive, a default bound takes all.
struct When {
  int cc_min = 0;
  int cc_max = std::numeric_limits<int>::max();
  int gbps_min = 0;
  int elem_bytes = 0;  // 0: every dtype
  int64_t n_min = 0;
  int64_t n_max = std::numeric_limits<int64_t>::max();

  constexpr bool matches(const TuningKey& k) const {
    return k.cc >= cc_min && k.cc <= cc_max && k.mem_gbps >= gbps_min &&
           (elem_bytes == 0 || k.elem_bytes == elem_bytes) && k.n >= n_min && k.n <= n_max;
  }
};

// `w` on sm_90 GPUs with at least 4.8 TB/s of memory bandwidth (the H200), whose rows come
// before the H100's in a table.
constexpr When on_h200(When w) {
  w.cc_min = 90;
  w.cc_max = 90;
  w.gbps_min = 4800;
  return w;
}
static_assert(!on_h200(When{}).matches(TuningKey{.cc = 90, .mem_gbps = 3352}) &&
                  !on_h200(When{}).matches(TuningKey{.cc = 90, .mem_gbps = 3938}),
              "an H100's (SXM, NVL) choices stay the H100 rows'");

struct TuningRow {
  When when;
  int64_t value;
  const char* why;
};

// A named parameter: its table, in order of precedence, ending in a catch-all row.
struct Tunable {
  const char* name;
  const TuningRow* rows;
  size_t count;
};

// Whether a table's last row matches every key (each table static_asserts this).
template <size_t R>
constexpr bool ends_in_catch_all(const TuningRow (&rows)[R]) {
  const When& w = rows[R - 1].when;
  const When all{};
  return w.cc_min == all.cc_min && w.cc_max == all.cc_max && w.gbps_min == all.gbps_min &&
         w.elem_bytes == all.elem_bytes && w.n_min == all.n_min && w.n_max == all.n_max;
}

template <size_t R>
constexpr Tunable tunable(const char* name, const TuningRow (&rows)[R]) {
  return Tunable{name, rows, R};
}

// Defined in csrc/common/tuning.cpp. Whether the tuning command set an override for `name`
// (then *value holds it). Costs one relaxed atomic load when no override is set.
bool tuning_override(const char* name, int64_t* value);

// The value of `t` for `key`: an override if set, else the first row that matches (the last
// row if none does: tables end in a catch-all row, which a test checks).
inline int64_t tuned(const Tunable& t, const TuningKey& key) {
  int64_t value;
  if (tuning_override(t.name, &value)) return value;
  for (size_t i = 0; i < t.count; ++i)
    if (t.rows[i].when.matches(key)) return t.rows[i].value;
  return t.rows[t.count - 1].value;
}

}  // namespace mti
