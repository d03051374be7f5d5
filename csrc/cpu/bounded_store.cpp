// Store calls bounded by a helper thread (see bounded_store.h).
#include "cpu/bounded_store.h"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace torchstrategies {
namespace {

template <typename R>
struct Call {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  R value{};
  std::exception_ptr error;
};

// Runs fn(store) on a detached thread; waits at most `seconds` for it.
template <typename R>
R bounded(const c10::intrusive_ptr<c10d::Store>& store, double seconds, const std::string& what,
          std::function<R(c10d::Store&)> fn) {
  auto call = std::make_shared<Call<R>>();
  std::thread([call, store, fn = std::move(fn)] {
    R value{};
    std::exception_ptr error;
    try {
      value = fn(*store);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(call->mu);
    call->value = std::move(value);
    call->error = error;
    call->done = true;
    call->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(call->mu);
  const auto limit = std::chrono::duration<double>(seconds < 0 ? 0 : seconds);
  if (!call->cv.wait_for(lock, limit, [&] { return call->done; })) {
    std::ostringstream s;
    s << "the rendezvous store did not answer " << what << " within " << seconds
      << " s (is the process hosting it, rank 0 under torchrun, stopped?)";
    throw core::StoreTimeout(s.str());
  }
  if (call->error) {
    try {
      std::rethrow_exception(call->error);
    } catch (const c10::Error& e) {  // the store's own message, without torch's C++ backtrace
      throw core::StoreTimeout(what + ": " + e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw core::StoreTimeout(what + ": " + e.what());
    }
  }
  return std::move(call->value);
}

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0) + 1);
}

}  // namespace

void BoundedStore::set(const std::string& key, const std::string& value, double seconds) {
  bounded<bool>(store_, seconds, "set('" + key + "')", [key, value](c10d::Store& s) {
    s.set(key, std::vector<uint8_t>(value.begin(), value.end()));
    return true;
  });
}

std::vector<std::string> BoundedStore::get(const std::vector<std::string>& keys, double seconds) {
  const std::string first = keys.empty() ? std::string() : keys.front();
  // The store's own wait ends first when its host answers (a key nobody set: "wait timeout ... keys: ..."),
  // so only a store that does not answer at all is reported as one, kStoreSeconds later.
  return bounded<std::vector<std::string>>(
      store_, seconds + core::kStoreSeconds, "the keys '" + first + "'...", [keys, seconds](c10d::Store& s) {
        s.wait(keys, ms(seconds));
        std::vector<std::string> out;
        for (const auto& k : keys) {
          const auto v = s.get(k);
          out.emplace_back(v.begin(), v.end());
        }
        return out;
      });
}

bool BoundedStore::check(const std::string& key, double seconds) {
  try {
    return bounded<bool>(store_, seconds, "check('" + key + "')",
                         [key](c10d::Store& s) { return s.check({key}); });
  } catch (const core::StoreTimeout&) {
    return false;
  }
}

std::vector<bool> BoundedStore::check_all(const std::vector<std::string>& keys, double seconds) {
  try {
    return bounded<std::vector<bool>>(store_, seconds, "check(...)", [keys](c10d::Store& s) {
      std::vector<bool> out;
      for (const auto& k : keys) out.push_back(s.check({k}));
      return out;
    });
  } catch (const core::StoreTimeout&) {
    return {};
  }
}

}  // namespace torchstrategies
