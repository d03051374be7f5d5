// The in-process replicas' own tensors (MirroredStrategy, CentralStorageStrategy). Python's side:
// torchstrategies/distribute/replicated.py. (Their threads: replica_threads.cpp.)
//
// _C.ReplicaViews: every replica owns a component of every replicated tensor T (a parameter or buffer made
// in the scope), as a MirroredVariable has one per device in TF. T stays the user's own nn.Parameter (or
// buffer) object; what it holds depends on whose turn it is:
//
//   cross-replica view  T.data = P (the primary) and T.grad = the cross-replica gradient
//   replica k's view    T.data = C_k (replica k's component) and T.grad = replica k's gradient G_k
//
// C_0 is P itself when replica 0 computes on P's device (TF: the primary is component 0); every other
// component is a tensor of its own, on its replica's device, CPU replicas included. Replicas run one at a
// time, so `enter(k)` / `leave()` switch T between the views (set_data and the gradient, per tensor).
//
// Cross-replica writes reach the components in `seed`, called when cross-replica code has run and before
// any replica runs again: at the start of each run every component is copied from P (whatever the user's
// code did between runs, `.data` writes included); after a merge, the tensors the merge wrote (T's version
// counter moved, T.data was replaced, or `mark` named them: the optimizers' step, whose fused kernels do
// not move version counters). A replica's own writes stay in its component; `owned_components` hands the
// caller every buffer's components at the end of a run, to fold into P (BatchNorm's running statistics
// are written without moving T's version, so every buffer is folded).
//
// Gradients: in the cross-replica view T.grad is the sum of the replicas' gradients, kept up to date by
// the fold (gradients_to_sum / set_gradients) before any cross-replica code runs. After a sum EVERY
// replica holds the sum (replica 0 the cross-replica tensor itself where it computes on P's device, the
// others a copy of their own): the tensor handed to replica k is remembered, and a fold that finds every
// replica still holding its handed tensor (in-place changes such as clipping allowed) knows the gradient is
// already reduced and sums nothing (never twice). A backward in replica k > 0 first drops the handed
// tensor (`release`), so a backward without zero_grad adds each replica's new gradient to the sum once.
// A write to the cross-replica gradient (zero_grad, an assignment, an in-place change) is handed to every
// replica by the next `seed`.
//
// Writes in replica context: `leave` notes each tensor whose version moved, or whose data was replaced
// (`T.data = x`), while replica k's view was in (`written`), so the caller checks only those for replicas
// that wrote different values.
#include <torch/extension.h>

#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace torchstrategies {
namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// What identifies P's value apart from its version: the storage and the view of it.
struct Identity {
  const void* storage = nullptr;
  int64_t offset = -1;
  at::ScalarType dtype = at::ScalarType::Undefined;
  at::Device device = at::kCPU;
  std::vector<int64_t> sizes, strides;

  static Identity of(const at::Tensor& t) {
    return {t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.scalar_type(), t.device(),
            t.sizes().vec(), t.strides().vec()};
  }
  bool matches(const at::Tensor& t) const {
    return storage == t.storage().unsafeGetStorageImpl() && offset == t.storage_offset() &&
           dtype == t.scalar_type() && device == t.device() && t.sizes().equals(sizes) &&
           t.strides().equals(strides);
  }
};

// Each replicated tensor T is in three small state machines at once (docs/architecture.md draws them).
// A state changes only in the function named beside each transition; the decisions read the states.

// P against its components, for `seed`. A cross-replica write that moves T's version counter or replaces P
// (`T.data = x`) is seen by the stamps `seeded_version` and `identity` (`wrote_primary`); one that moves
// neither (an optimizer's fused step) is named by `mark`.
enum class PrimaryState : uint8_t {
  kSeeded,  // every component equals P as of `seeded_version`   (seeded(), left())
  kMarked,  // cross-replica code wrote P without moving T's version: the next seed copies it   (mark())
};

// T against replica writes, for `written`: whether T's version moved, or its data was replaced, while a
// replica's view was in.
enum class ReplicaWrites : uint8_t {
  kNone,     // (taken())
  kWritten,  // (left(): T's version moved since entered(), or T.data was replaced)
};

// Replica k's gradient against the tensor the last hand gave it, for the fold: when every replica is
// kHanded the gradient is already the sum and the fold sums nothing (never twice).
enum class GradSlot : uint8_t {
  kEmpty,   // no gradient   (hand_all() of no gradient; left() with none)
  kHanded,  // the tensor hand_all() gave it, in-place changes (clipping) allowed   (hand_all(); left())
  kOwn,     // a tensor of its own: a backward's (after release()), an assignment's   (left())
};

struct Entry {
  explicit Entry(const at::Tensor& t) : ref(t.getIntrusivePtr()) {}
  WeakTensor ref;                 // T (weak: a replicated tensor dies with its module)
  bool is_param = false;
  std::vector<at::Tensor> data;   // C_k (undefined where C_k is P)
  std::vector<at::Tensor> grads;  // G_k (parameters)
  at::Tensor primary;             // P (T.variable_data(): T's storage and view, its own version counter)
  at::Tensor primary_grad;        // the cross-replica view's gradient

  PrimaryState primary_state = PrimaryState::kSeeded;
  Identity identity;              // P's identity when seeded
  int64_t seeded_version = -1;    // T's version when its components last matched P (seed, leave)

  ReplicaWrites writes = ReplicaWrites::kNone;
  int64_t entered_version = -1;   // T's version when the active replica's view was entered

  std::vector<GradSlot> slots;    // replica k's gradient against handed[k]
  std::vector<at::Tensor> handed; // the gradient handed to replica k by the last hand_all
  int64_t handed_version = -1;    // primary_grad's version when it was handed
  int64_t first_version = -1;     // handed[0]'s version then (its in-place changes reach P's gradient)
};

// How hand_all gives replica k the sum g: the decision that reuses a replica's gradient memory.
enum class Hand : uint8_t {
  kNothing,   // g is undefined: replica k has no gradient
  kShare,     // replica 0 computing on g's device: g itself
  kCopyInto,  // replica k's gradient has g's layout on its device and is no alias of g or of replica 0's
  kAllocate,  // a new copy of g on replica k's device
};

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

// Whether a and b hold the same data: the same storage, viewed the same way (Identity, without a copy).
bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.scalar_type() == b.scalar_type() &&
         a.sizes().equals(b.sizes()) && a.strides().equals(b.strides());
}

class ReplicaViews {
 public:
  explicit ReplicaViews(std::vector<at::Device> devices) : devices_(std::move(devices)) {
    TORCH_CHECK(!devices_.empty(), "ReplicaViews: expected at least one replica device");
  }

  // Makes `params` and `buffers` the replicated set; what is known of a tensor that stays is kept.
  void refresh(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& buffers) {
    TORCH_CHECK(active_ < 0, "ReplicaViews.refresh: replica ", active_, "'s view is active");
    drop_queued();
    std::unordered_map<const c10::TensorImpl*, size_t> old;
    for (size_t i = 0; i < entries_.size(); ++i) {
      auto t = entries_[i].ref.lock();
      if (t) old.emplace(t.get(), i);
    }
    std::vector<Entry> next;
    std::unordered_map<const c10::TensorImpl*, bool> seen;
    const size_t n = devices_.size();
    auto add = [&](const at::Tensor& t, bool is_param) {
      if (!t.defined() || !seen.emplace(t.unsafeGetTensorImpl(), true).second) return;
      auto it = old.find(t.unsafeGetTensorImpl());
      if (it != old.end() && entries_[it->second].is_param == is_param) {
        next.push_back(std::move(entries_[it->second]));
        return;
      }
      Entry e(t);
      e.is_param = is_param;
      e.data.resize(n);
      e.grads.resize(n);
      e.handed.resize(n);
      e.slots.resize(n, GradSlot::kEmpty);
      if (is_param) {
        e.primary_grad = t.grad();
        hand_all(e, e.primary_grad);  // a gradient it already has is every replica's, as after a sum
      }
      next.push_back(std::move(e));
    };
    for (const auto& t : params) add(t, true);
    for (const auto& t : buffers) add(t, false);
    entries_ = std::move(next);
    if (!live_.empty()) hold();  // (refreshed during a run: hold the new set, in its order)
    flush();
  }

  // The start of a run: holds every replicated tensor (strong references, so no view switch locks a
  // weak one) until `end`, and copies P into every other component (`seed(true)`: whatever user code
  // did between runs, `.data` writes included).
  void begin() {
    TORCH_CHECK(active_ < 0, "ReplicaViews.begin: replica ", active_, "'s view is active");
    hold();
    seed(true);
  }

  // The end of a run: lets go of what `begin` held.
  void end() { live_.clear(); }

  // Copies P into every other component of the tensors cross-replica code wrote: all of them (`all`,
  // at the start of a run), else those whose version moved, whose P was replaced, or that were marked.
  // Also hands a cross-replica gradient that was (re)set (zero_grad, an assignment) to every replica.
  void seed(bool all) {
    TORCH_CHECK(active_ < 0, "ReplicaViews.seed: replica ", active_, "'s view is active");
    drop_queued();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      at::Tensor t = tensor(i);
      if (!t.defined()) continue;
      if (e.is_param && wrote_gradient(e, t)) {
        e.primary_grad = t.grad();
        hand_all(e, e.primary_grad);
      }
      if (all || wrote_primary(e, t)) seeded(e, t);
    }
    flush();
  }

  // Marks `tensors` as written by cross-replica code (for the next `seed`).
  void mark(const std::vector<at::Tensor>& tensors) {
    std::unordered_map<const c10::TensorImpl*, bool> wanted;
    for (const auto& t : tensors) wanted.emplace(t.unsafeGetTensorImpl(), true);
    for (size_t i = 0; i < entries_.size(); ++i) {
      at::Tensor t = tensor(i);
      if (t.defined() && wanted.count(t.unsafeGetTensorImpl())) entries_[i].primary_state = PrimaryState::kMarked;
    }
  }

  // Cross-replica view -> replica k's view.
  void enter(int64_t k) {
    TORCH_CHECK(active_ < 0, "ReplicaViews.enter(", k, "): replica ", active_, "'s view is active");
    TORCH_CHECK(k >= 0 && k < static_cast<int64_t>(devices_.size()), "ReplicaViews.enter: no replica ", k);
    for (size_t i = 0; i < entries_.size(); ++i) {
      at::Tensor t = tensor(i);
      if (t.defined()) entered(entries_[i], t, k);
    }
    active_ = k;
  }

  // Before a backward in the active replica's view: a replica k > 0 drops the sum it was handed, so the
  // backward's gradients are added to the sum once (replica 0 keeps it).
  void release() {
    if (active_ <= 0) return;
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (!e.is_param) continue;
      at::Tensor t = tensor(i);
      if (!t.defined()) continue;
      if (t.grad().defined() && same(t.grad(), e.handed[active_])) t.mutable_grad().reset();
    }
  }

  // (T, [replica k's value of T]) for the tensors replicas wrote since the last call (ReplicaWrites);
  // forgets them.
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> written() {
    TORCH_CHECK(active_ < 0, "ReplicaViews: a replica view is active");
    std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> out;
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (e.writes != ReplicaWrites::kWritten) continue;
      e.writes = ReplicaWrites::kNone;  // taken
      at::Tensor t = tensor(i);
      if (!t.defined()) continue;
      out.emplace_back(t, components(e, t, devices_.size()));
    }
    return out;
  }

  // Replica view -> cross-replica view.
  void leave() {
    const int64_t k = active_;
    if (k < 0) return;
    active_ = -1;
    for (size_t i = 0; i < entries_.size(); ++i) {
      at::Tensor t = tensor(i);
      if (t.defined()) left(entries_[i], t, k);
    }
  }

  // Fold, part 1 (cross-replica view): makes each parameter's gradient the sum of its replicas' where
  // that needs no arithmetic (every replica still holds the sum it was handed, or none or one has a
  // gradient) and returns the others: (T, [the replicas' gradients]).
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> gradients_to_sum() {
    TORCH_CHECK(active_ < 0, "ReplicaViews: a replica view is active");
    std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> out;
    pending_.clear();
    drop_queued();
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (!e.is_param) continue;
      at::Tensor t = tensor(i);
      if (!t.defined()) continue;
      if (already_reduced(e)) {
        first_changed(e);
        continue;
      }
      std::vector<at::Tensor> grads;
      for (const auto& g : e.grads) {
        if (g.defined()) grads.push_back(g);
      }
      if (grads.size() > 1) {
        out.emplace_back(t, std::move(grads));
        pending_.push_back(i);
        continue;
      }
      at::Tensor total = grads.empty() ? at::Tensor() : grads[0];
      if (!total.defined() && !e.primary_grad.defined()) continue;
      if (total.defined() && total.device() != t.device()) total = total.to(t.device());
      set_gradient(e, t, total);
    }
    flush();
    return out;
  }

  // Fold, part 2: the sums of what gradients_to_sum returned, in its order.
  void set_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& totals) {
    TORCH_CHECK(params.size() == totals.size(), "ReplicaViews.set_gradients: ", params.size(),
                " parameters but ", totals.size(), " sums");
    TORCH_CHECK(params.size() == pending_.size(), "ReplicaViews.set_gradients: ", params.size(),
                " parameters, but gradients_to_sum returned ", pending_.size());
    drop_queued();
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(same(tensor(pending_[i]), params[i]), "ReplicaViews.set_gradients: parameter ", i,
                  " is not the one gradients_to_sum returned there");
      set_gradient(entries_[pending_[i]], params[i], totals[i]);
    }
    pending_.clear();
    flush();
  }

  // Fold, part 3 (the end of a run): (T, [replica k's value of T]) for every buffer, and for each
  // parameter whose P is not replica 0's component ([C_0]: the cross-replica value of an ON_WRITE
  // parameter is component 0's). The caller writes the aggregate into T.
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> owned_components() {
    TORCH_CHECK(active_ < 0, "ReplicaViews: a replica view is active");
    std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> out;
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      at::Tensor t = tensor(i);
      if (!t.defined()) continue;
      if (e.is_param && !owns_component(e, 0)) continue;  // replica 0 wrote P itself
      out.emplace_back(t, components(e, t, e.is_param ? 1 : devices_.size()));
    }
    return out;
  }

  // What replica 0..N-1 holds for T now (T itself where that is P), or [T] if T is not replicated.
  std::vector<at::Tensor> components_of(const at::Tensor& t) {
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (same(tensor(i), t)) return components(entries_[i], t, devices_.size());
    }
    return {t};
  }

  int64_t active() const { return active_; }
  size_t size() const { return entries_.size(); }

 private:
  // T of entry i: held since `begin`, else locked from its weak reference (undefined if T is gone).
  at::Tensor tensor(size_t i) const {
    if (i < live_.size()) return live_[i];
    return at::Tensor(entries_[i].ref.lock());
  }

  void hold() {
    std::vector<at::Tensor> live;
    live.reserve(entries_.size());
    for (auto& e : entries_) live.emplace_back(e.ref.lock());
    live_ = std::move(live);
  }

  // Queues dst.copy_(src); `flush` makes the queued copies in one grouped call (torch's _foreach_copy_).
  // Every public method that queues flushes before it returns, and drops what a call that raised left
  // queued before it queues (a failed call writes nothing later).
  void copy_later(const at::Tensor& dst, const at::Tensor& src) {
    copy_dst_.push_back(dst);
    copy_src_.push_back(src);
  }
  void flush() {
    if (copy_dst_.empty()) return;
    at::NoGradGuard no_grad;
    at::_foreach_copy_(copy_dst_, copy_src_);
    drop_queued();
  }
  void drop_queued() {
    copy_dst_.clear();
    copy_src_.clear();
  }

  // Whether replica k computes with a component of its own (not P).
  bool owns_component(const Entry& e, int64_t k) const {
    return k > 0 || e.identity.device != devices_[0];
  }

  std::vector<at::Tensor> components(const Entry& e, const at::Tensor& t, size_t count) const {
    std::vector<at::Tensor> out;
    for (size_t k = 0; k < count; ++k) {
      const bool own = owns_component(e, static_cast<int64_t>(k)) && e.data[k].defined();
      out.push_back(own ? e.data[k] : t);
    }
    return out;
  }

  // --- the transitions (each state changes only here) ----------------------------------------------

  // PrimaryState -> kSeeded: copies P into every component of T (a replaced P is taken first).
  void seeded(Entry& e, const at::Tensor& t) {
    if (!e.identity.matches(t)) {
      e.identity = Identity::of(t);
      e.primary = t.variable_data();
    }
    for (size_t k = 0; k < devices_.size(); ++k) {
      if (!owns_component(e, static_cast<int64_t>(k))) continue;
      at::Tensor& c = e.data[k];
      if (c.defined() && c.scalar_type() == t.scalar_type() && c.sizes() == t.sizes() &&
          c.device() == devices_[k]) {
        copy_later(c, e.primary);
      } else {
        c = e.primary.to(devices_[k], /*non_blocking=*/false, /*copy=*/true);
      }
    }
    e.seeded_version = t._version();
    e.primary_state = PrimaryState::kSeeded;
  }

  // Cross-replica view -> replica k's view of T (stamps `entered_version` for left()).
  void entered(Entry& e, const at::Tensor& t, int64_t k) {
    if (owns_component(e, k)) {
      TORCH_CHECK(e.data[k].defined(), "ReplicaViews.enter: replica ", k, "'s component was not seeded");
      if (e.is_param) t.mutable_grad().reset();  // (a gradient must match the data's device)
      t.set_data(e.data[k]);
    }
    if (e.is_param) t.mutable_grad() = e.grads[k];
    e.entered_version = t._version();
  }

  // Replica k's view of T -> the cross-replica view: ReplicaWrites -> kWritten if replica k wrote T,
  // GradSlot k from the gradient it leaves, and T's version restamped (a replica's writes are its
  // component's, not P's).
  void left(Entry& e, const at::Tensor& t, int64_t k) {
    if (e.is_param) {
      e.grads[k] = t.grad();
      e.slots[k] = !e.grads[k].defined()           ? GradSlot::kEmpty
                   : same(e.grads[k], e.handed[k]) ? GradSlot::kHanded
                                                   : GradSlot::kOwn;
    }
    if (t._version() != e.entered_version) e.writes = ReplicaWrites::kWritten;
    // `T.data = x` in replica k (no version moves): x becomes replica k's component, written, so the
    // check compares it with the other replicas' (replica 0 without a component of its own replaced P:
    // the next seed hands it on, the check compares it first).
    const bool own = owns_component(e, k);
    if (own ? !same_view(e.data[k], t) : !e.identity.matches(t)) {
      if (own) e.data[k] = t.variable_data();
      e.writes = ReplicaWrites::kWritten;
    }
    if (own) {
      if (e.is_param) t.mutable_grad().reset();
      t.set_data(e.primary);
    }
    if (e.is_param) t.mutable_grad() = e.primary_grad;
    e.seeded_version = t._version();
  }

  // Every GradSlot -> kHanded (kEmpty where `g` is undefined): every replica starts from `g` (the
  // cross-replica gradient): replica 0 from `g` itself where it computes on its device, every other from
  // a copy of its own (its previous gradient's memory where that fits), so that an in-place change in one
  // replica (clipping) stays its own.
  void hand_all(Entry& e, const at::Tensor& g) {
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < e.grads.size(); ++k) {
      at::Tensor& x = e.grads[k];
      switch (hand_of(e, k, g)) {
        case Hand::kNothing:
          x.reset();
          break;
        case Hand::kShare:
          x = g;
          break;
        case Hand::kCopyInto:
          if (k == 0) {
            x.copy_(g);  // (now: its version is recorded below)
          } else {
            copy_later(x, g);
          }
          break;
        case Hand::kAllocate:
          x = g.to(devices_[k], /*non_blocking=*/false, /*copy=*/true);
          break;
      }
      e.handed[k] = x;
      e.slots[k] = x.defined() ? GradSlot::kHanded : GradSlot::kEmpty;
    }
    e.handed_version = g.defined() ? g._version() : -1;
    e.first_version = e.handed[0].defined() ? e.handed[0]._version() : -1;
  }

  // Every replica still kHanded: replica 0's in-place change to its handed gradient (clipping), where
  // that is a copy of P's, reaches P's (restamping the hand, so the next seed does not hand it back).
  void first_changed(Entry& e) {
    if (same(e.handed[0], e.primary_grad) || e.handed[0]._version() == e.first_version) return;
    at::NoGradGuard no_grad;
    e.primary_grad.copy_(e.handed[0]);
    e.first_version = e.handed[0]._version();
    e.handed_version = e.primary_grad._version();
  }

  // --- the decisions (read from the states and stamps) ----------------------------------------------

  // Whether cross-replica code wrote P since its components were seeded: marked, T's version moved, or P
  // was replaced (`T.data = x`).
  static bool wrote_primary(const Entry& e, const at::Tensor& t) {
    return e.primary_state == PrimaryState::kMarked || t._version() != e.seeded_version ||
           !e.identity.matches(t);
  }

  // Whether cross-replica code (re)set T's gradient since it was handed (zero_grad, an assignment, an
  // in-place change): the next seed hands it to every replica.
  static bool wrote_gradient(const Entry& e, const at::Tensor& t) {
    return !same(t.grad(), e.primary_grad) ||
           (e.primary_grad.defined() && e.primary_grad._version() != e.handed_version);
  }

  // Whether every replica still holds the sum it was handed: the gradient is reduced, nothing to sum.
  static bool already_reduced(const Entry& e) {
    for (GradSlot s : e.slots) {
      if (s != GradSlot::kHanded) return false;
    }
    return true;
  }

  // How replica k is handed `g` (hand_all): its gradient's memory is reused where it holds a tensor
  // (handed or its own) of g's strided layout on its device that aliases neither g nor replica 0's.
  Hand hand_of(const Entry& e, size_t k, const at::Tensor& g) const {
    if (!g.defined()) return Hand::kNothing;
    if (k == 0 && g.device() == devices_[0]) return Hand::kShare;
    const at::Tensor& x = e.grads[k];
    if (e.slots[k] == GradSlot::kEmpty || same(x, g) || !same_layout(x, g, devices_[k])) return Hand::kAllocate;
    if (x.is_alias_of(g) || (k > 0 && e.grads[0].defined() && x.is_alias_of(e.grads[0]))) return Hand::kAllocate;
    return Hand::kCopyInto;
  }

  // Whether x is a strided tensor on `device` with g's dtype, sizes and strides (g strided too).
  static bool same_layout(const at::Tensor& x, const at::Tensor& g, const at::Device& device) {
    return x.layout() == at::kStrided && g.layout() == at::kStrided && x.scalar_type() == g.scalar_type() &&
           x.sizes() == g.sizes() && x.strides() == g.strides() && x.device() == device;
  }

  void set_gradient(Entry& e, const at::Tensor& t, at::Tensor total) {
    TORCH_CHECK(!total.defined() || total.device() == t.device(), "ReplicaViews: the gradient sum is on ",
                total.device(), ", its parameter on ", t.device());
    if (total.defined() && total.layout() == at::kStrided && t.is_non_overlapping_and_dense() &&
        total.strides() != t.strides()) {
      // torch's gradient layout contract (AccumulateGrad): a dense parameter's gradient has its strides
      total = at::empty_strided(t.sizes(), t.strides(), total.options()).copy_(total);
    }
    t.mutable_grad() = total;
    e.primary_grad = total;
    hand_all(e, total);
  }

  std::vector<at::Device> devices_;
  std::vector<Entry> entries_;
  std::vector<at::Tensor> live_;     // entries_[i]'s tensor, held from `begin` to `end`
  std::vector<size_t> pending_;      // the entries gradients_to_sum returned, in its order
  std::vector<at::Tensor> copy_dst_, copy_src_;  // copies queued by copy_later
  int64_t active_ = -1;
};

}  // namespace

void init_replica_views_bindings(py::module_& m) {
  py::class_<ReplicaViews>(m, "ReplicaViews",
                           "Every in-process replica's own component of every replicated tensor "
                           "(csrc/cpu/replica_views.cpp, distribute/replicated.py).")
      .def(py::init<std::vector<at::Device>>(), py::arg("devices"))
      .def("refresh", &ReplicaViews::refresh, py::arg("params"), py::arg("buffers"))
      .def("begin", &ReplicaViews::begin)
      .def("end", &ReplicaViews::end)
      .def("seed", &ReplicaViews::seed, py::arg("all"))
      .def("mark", &ReplicaViews::mark, py::arg("tensors"))
      .def("enter", &ReplicaViews::enter, py::arg("replica"))
      .def("leave", &ReplicaViews::leave)
      .def("release", &ReplicaViews::release)
      .def("written", &ReplicaViews::written)
      .def("gradients_to_sum", &ReplicaViews::gradients_to_sum)
      .def("set_gradients", &ReplicaViews::set_gradients, py::arg("params"), py::arg("totals"))
      .def("owned_components", &ReplicaViews::owned_components)
      .def("components", &ReplicaViews::components_of, py::arg("tensor"))
      .def_property_readonly("active", &ReplicaViews::active)
      .def("__len__", &ReplicaViews::size);
}

}  // namespace torchstrategies
