// Helpers of the TCP ring's two files (ring.cpp: connections and the collectives' steps; ring_call.cpp: the
// engine that runs one call's steps): the clock, deadlines and error text. Time is double seconds, as in the
// rest of csrc/core; poll's milliseconds come from ms_left, the one conversion.
#pragma once

#include <time.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace torchstrategies {
namespace core {
namespace ring {

constexpr uint32_t kCallMagic = 0x52494e47;  // "RING": the first word of every call's descriptor

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Milliseconds left until `deadline` (seconds on now_s's clock), for poll: 0 once it has passed.
inline int ms_left(double deadline) {
  const double left = deadline - now_s();
  if (left <= 0) return 0;
  return left > 3.6e6 ? 3600 * 1000 : static_cast<int>(left * 1000.0) + 1;
}

inline std::string err_text(int e) { return std::string(std::strerror(e)); }

}  // namespace ring
}  // namespace core
}  // namespace torchstrategies
