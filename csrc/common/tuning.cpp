// The tuning command's overrides of tuned parameters (csrc/kernels/tuning.h): a map from
// name to value, read under a lock only while at least one override is set.
#include "kernels/tuning.h"

#include <atomic>
#include <map>
#include <mutex>
#include <string>

namespace mti {
namespace {

std::mutex mutex;
std::map<std::string, int64_t> overrides;
std::atomic<bool> any{false};

}  // namespace

bool tuning_override(const char* name, int64_t* value) {
  if (!any.load(std::memory_order_relaxed)) return false;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = overrides.find(name);
  if (it == overrides.end()) return false;
  *value = it->second;
  return true;
}

void set_tuning_override(const std::string& name, const int64_t* value) {
  const std::lock_guard<std::mutex> lock(mutex);
  if (value)
    overrides[name] = *value;
  else
    overrides.erase(name);
  any.store(!overrides.empty(), std::memory_order_relaxed);
}

}  // namespace mti
