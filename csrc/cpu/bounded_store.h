// The transport's store (core::KeyValue) on a c10d::Store, every call bounded.
//
// A c10d TCPStore call blocks until the store host answers or the store's own timeout passes (under torchrun
// that can be 30 minutes), and the store lives in rank 0's process: a frozen rank 0 would hang every other
// rank's error path. So each call runs on a helper thread and the caller waits at most the given seconds
// (get, which waits for keys itself for the given seconds: kStoreSeconds more, so that a key nobody set and
// a store that does not answer give different messages); a call that does not answer in time raises
// core::StoreTimeout, and its thread is left to finish (or fail) on its own, holding its own reference to
// the store.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

#include "core/transport.h"

namespace torchstrategies {

class BoundedStore : public core::KeyValue {
 public:
  explicit BoundedStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value, double seconds) override;
  std::vector<std::string> get(const std::vector<std::string>& keys, double seconds) override;
  bool check(const std::string& key, double seconds) override;
  std::vector<bool> check_all(const std::vector<std::string>& keys, double seconds) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace torchstrategies
