// ringlet's native torch.distributed Backend (a c10d::Backend subclass) and
// the in-place operator torch.ops.ringlet.all_reduce_.
//
// Compiled against the user's installed torch at first use
// (ringlet/distributed/_native.py, torch.utils.cpp_extension) and cached: libtorch's C++
// ABI differs between torch versions, and the wheel accepts a range of them.
//
// The Backend is a thin shell around the Python process group
// (ringlet.distributed.c10d.ProcessGroupRinglet), which it holds:
//  * the hot collectives on dense contiguous CPU tensors (all_reduce,
//    all_gather_into_tensor, reduce_scatter_tensor, broadcast, barrier,
//    all_to_all_single), when synchronous, call the Rust engine through its
//    C ABI (ringlet_capi.h) with no Python in between: this file converts
//    arguments and nothing else;
//  * everything else (asynchronous work, object collectives, p2p, coalescing,
//    sparse and complex tensors, AVG/PREMUL_SUM, subgroups, monitored
//    barriers, shrink, split, abort) is forwarded to the Python group with
//    the GIL held, so no behaviour of the Python backend is lost.
// Both doors feed the group's one progress queue in the Rust core, so a
// group's operations run in exactly the order they were issued.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ringlet_capi.h"

namespace py = pybind11;

namespace ringlet {

using c10d::Backend;
using c10d::Work;

namespace {

// Releases the GIL for a blocking engine call when this thread holds it
// (torch's Python bindings of ProcessGroup methods already released it; a
// C++ caller such as DDP's reducer never held it).
class NoGil {
 public:
  NoGil() {
    if (PyGILState_Check()) {
      release_.emplace();
    }
  }

 private:
  std::optional<py::gil_scoped_release> release_;
};

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Drops a Python reference from any thread, never during interpreter exit.
void drop(py::object& o) {
  if (!o || !Py_IsInitialized() || finalizing()) {
    o.release();
    return;
  }
  py::gil_scoped_acquire gil;
  o = py::object();
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return RINGLET_F32;
    case at::kDouble: return RINGLET_F64;
    case at::kHalf: return RINGLET_F16;
    case at::kBFloat16: return RINGLET_BF16;
    case at::kChar: return RINGLET_I8;
    case at::kByte: return RINGLET_U8;
    case at::kShort: return RINGLET_I16;
    case at::kInt: return RINGLET_I32;
    case at::kLong: return RINGLET_I64;
    case at::kBool: return RINGLET_BOOL;
    default: return -1;
  }
}

// The engine's reduce op for a torch ReduceOp on `t`, or -1 where the
// Python group does more (AVG, PREMUL_SUM) or raises torch's error (a
// bitwise op on floating-point tensors).
int op_code(const c10d::ReduceOp& op, at::ScalarType t) {
  const bool fp = at::isFloatingType(t);
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return RINGLET_SUM;
    case c10d::ReduceOp::PRODUCT: return RINGLET_MUL;
    case c10d::ReduceOp::MIN: return RINGLET_MIN;
    case c10d::ReduceOp::MAX: return RINGLET_MAX;
    case c10d::ReduceOp::BAND: return fp ? -1 : RINGLET_AND;
    case c10d::ReduceOp::BOR: return fp ? -1 : RINGLET_OR;
    case c10d::ReduceOp::BXOR: return fp ? -1 : RINGLET_XOR;
    default: return -1;
  }
}

// A tensor the engine takes as it is: dense, contiguous, on the CPU, of a
// dtype it knows. Its engine dtype code, else -1.
int plain(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided ||
      !t.is_contiguous()) {
    return -1;
  }
  return dtype_code(t.scalar_type());
}

// Options handed to Python as copies of their own: the Python group's jobs
// keep them (or their reduce op) after this call's stack frame is gone.
// Converted in `forward`, with the GIL held.
template <typename T>
struct Own {
  const T& value;
};

template <typename T>
Own<T> own(const T& opts) {
  return Own<T>{opts};
}

template <typename T>
py::object to_py(Own<T>&& o) {
  return py::cast(o.value, py::return_value_policy::copy);
}

template <typename T>
py::object to_py(Own<T>& o) {
  return py::cast(o.value, py::return_value_policy::copy);
}

template <typename T>
T&& to_py(T&& x) {
  return std::forward<T>(x);
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  const auto na = a.nbytes(), nb = b.nbytes();
  return na && nb && pa < pb + nb && pb < pa + na;
}

// The Work of an operation that already ran (synchronous native calls).
class DoneWork : public Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> out) : Work(-1, c10d::OpType::UNKNOWN),
                                                   out_(std::move(out)) {
    completed_ = true;
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return out_; }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto fut = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()));
    fut->markCompleted(c10::IValue(out_));
    return fut;
  }

 private:
  std::vector<at::Tensor> out_;
};

// The Work of an operation the Python group runs: every method is the
// Python Work's (its future through torch's Work trampoline, which unwraps
// the Python future).
class __attribute__((visibility("hidden"))) PyForwardWork : public Work {
 public:
  explicit PyForwardWork(py::object work)
      : Work(-1, c10d::OpType::UNKNOWN),
        work_(work.cast<c10::intrusive_ptr<Work>>()),
        py_(std::move(work)) {}
  ~PyForwardWork() override { drop(py_); }

  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return py_.attr("is_completed")().cast<bool>();
  }
  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return py_.attr("is_success")().cast<bool>();
  }
  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object e = py_.attr("exception")();
    if (e.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(e).cast<std::string>()));
  }
  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return py_.attr("_source_rank")().cast<int>();
  }
  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    py::object r = py_.attr("result")();
    std::vector<at::Tensor> out;
    for (py::handle h : r) {
      if (THPVariable_Check(h.ptr())) {
        out.push_back(h.cast<at::Tensor>());
      }
    }
    return out;
  }
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    return py_.attr("wait")(timeout).cast<bool>();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

  // The Python Work (Python callers get its own methods' results: the same
  // exception object, the same future).
  const py::object& py() const { return py_; }

 private:
  c10::intrusive_ptr<Work> work_;  // the Python Work's C++ part (a trampoline)
  py::object py_;
};

}  // namespace

// Hidden (it holds Python objects), as pybind11 asks of such classes.
class __attribute__((visibility("hidden"))) RingletBackend : public Backend {
 public:
  // `pg`: the Python group; `table`: the address of the engine's C ABI table.
  RingletBackend(py::object pg, uintptr_t table, int rank, int size, double timeout_s)
      : Backend(rank, size),
        api_(reinterpret_cast<const RingletCApi*>(table)),
        pg_(std::move(pg)),
        timeout_ms_(static_cast<uint64_t>(std::max(timeout_s, 1e-3) * 1000.0)) {
    TORCH_CHECK(api_ != nullptr && api_->version == RINGLET_CAPI_VERSION &&
                    api_->size == sizeof(RingletCApi),
                "ringlet: the engine's C ABI table does not match this build of the native "
                "backend (rebuild it: it is cached by the source's hash)");
    native_error_ = py::module_::import("ringlet.distributed.c10d").attr("native_error");
    init();
  }

  ~RingletBackend() override {
    if (auto* g = group_.exchange(nullptr)) {
      api_->group_free(g);
    }
    drop(native_error_);
    drop(pg_);
  }

  static c10::intrusive_ptr<RingletBackend> create(py::object pg, uintptr_t table,
                                                   double timeout_s) {
    const int rank = pg.attr("rank")().cast<int>();
    const int size = pg.attr("size")().cast<int>();
    pg.attr("_kind") = "native";  // what the group says it is (repr, backend_kind)
    return c10::make_intrusive<RingletBackend>(std::move(pg), table, rank, size, timeout_s);
  }

  // -- identity ------------------------------------------------------------

  const std::string getBackendName() const override { return "ringlet"; }

  py::object pythonGroup() const { return pg_; }
  bool nativeConnected() const { return group_.load() != nullptr; }
  uint64_t nativeCalls() const { return native_calls_.load(); }
  bool closed() const { return closed_.load(); }
  uintptr_t table() const { return reinterpret_cast<uintptr_t>(api_); }
  double timeoutSeconds() const { return timeout_ms_.load() / 1000.0; }

  std::string repr() const {
    std::ostringstream s;
    s << "RingletBackend(native, rank=" << getRank() << ", size=" << getSize()
      << ", name='" << getGroupUid() << "', desc='" << getGroupDesc() << "', engine="
      << (nativeConnected() ? "connected" : "not yet connected") << ")";
    return s.str();
  }

  void setGroupUid(const std::string& uid) override {
    Backend::setGroupUid(uid);
    py::gil_scoped_acquire gil;
    pg_.attr("setGroupName")(uid);
  }

  bool supportsSplitting() const override { return true; }
  bool supportsShrinking() const override { return true; }
  // batch_isend_irecv and the coalescing manager take the per-operation
  // path, as with the Python group.
  bool supportsCoalescing() const override { return false; }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    auto o = c10::make_intrusive<Options>("ringlet",
                                          std::chrono::milliseconds(timeout_ms_.load()));
    o->group_name = getGroupUid();
    o->group_desc = getGroupDesc();
    return o;
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ms_.store(static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 1)));
    py::gil_scoped_acquire gil;
    pg_.attr("_set_default_timeout")(timeout);
  }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  void eagerConnectSingleDevice(at::Device /*device*/) override {}

  // -- hot collectives -------------------------------------------------------

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) override {
    ++seq_;
    if (tensors.size() == 1 && !opts.asyncOp) {
      at::Tensor& t = tensors[0];
      const int d = plain(t);
      const int op = d >= 0 ? op_code(opts.reduceOp, t.scalar_type()) : -1;
      if (op >= 0 && native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
            return api_->all_reduce(g, t.data_ptr(), t.nbytes(), d, op, ms, e);
          })) {
        return c10::make_intrusive<DoneWork>(tensors);
      }
    }
    return forward("allreduce", tensors, own(opts));
  }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) override {
    ++seq_;
    if (tensors.size() == 1 && !opts.asyncOp && opts.rootTensor == 0 && opts.rootRank >= 0 &&
        opts.rootRank < getSize()) {
      at::Tensor& t = tensors[0];
      const int d = plain(t);
      if (d >= 0 && native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
            return api_->broadcast(g, t.data_ptr(), t.nbytes(), d, opts.rootRank, ms, e);
          })) {
        return c10::make_intrusive<DoneWork>(tensors);
      }
    }
    return forward("broadcast", tensors, own(opts));
  }

  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    ++seq_;
    if (!opts.asyncOp) {
      const int d = plain(input);
      if (d >= 0 && plain(output) == d &&
          output.nbytes() == input.nbytes() * static_cast<size_t>(getSize()) &&
          !overlap(input, output) &&
          native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
            return api_->all_gather(g, input.data_ptr(), input.nbytes(), output.data_ptr(),
                                    output.nbytes(), d, ms, e);
          })) {
        return c10::make_intrusive<DoneWork>(output.chunk(getSize()));
      }
    }
    return forward("_allgather_base", output, input, own(opts));
  }

  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    ++seq_;
    if (!opts.asyncOp) {
      const int d = plain(input);
      const int op = d >= 0 ? op_code(opts.reduceOp, input.scalar_type()) : -1;
      if (op >= 0 && plain(output) == d &&
          output.nbytes() * static_cast<size_t>(getSize()) == input.nbytes() &&
          !overlap(input, output) &&
          native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
            return api_->reduce_scatter(g, input.data_ptr(), input.nbytes(), output.data_ptr(),
                                        output.nbytes(), d, op, ms, e);
          })) {
        return c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{output});
      }
    }
    return forward("_reduce_scatter_base", output, input, own(opts));
  }

  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& outputSplitSizes,
                                         std::vector<int64_t>& inputSplitSizes,
                                         const c10d::AllToAllOptions& opts) override {
    ++seq_;
    if (!opts.asyncOp) {
      const int d = plain(input);
      std::vector<size_t> sends, recvs;
      if (d >= 0 && plain(output) == d && !overlap(input, output) &&
          counts(input, inputSplitSizes, sends) && counts(output, outputSplitSizes, recvs) &&
          native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
            return api_->all_to_all(g, input.data_ptr(), input.nbytes(), sends.data(),
                                    output.data_ptr(), output.nbytes(), recvs.data(),
                                    sends.size(), d, ms, e);
          })) {
        return c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{output});
      }
    }
    return forward("alltoall_base", output, input, outputSplitSizes, inputSplitSizes, own(opts));
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    ++seq_;
    if (!opts.asyncOp &&
        native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
          return api_->barrier(g, ms, e);
        })) {
      return c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{});
    }
    return forward("barrier", own(opts));
  }

  // -- everything else: the Python group ---------------------------------------

  c10::intrusive_ptr<Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                            const c10d::AllreduceOptions& opts) override {
    ++seq_;
    return forward("allreduce", tensors, own(opts));
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    ++seq_;
    return forward("allreduce_coalesced", tensors, own(opts));
  }
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) override {
    ++seq_;
    return forward("reduce", tensors, own(opts));
  }
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    ++seq_;
    if (!opts.asyncOp && inputs.size() == 1 && outputs.size() == 1 &&
        outputs[0].size() == static_cast<size_t>(getSize()) &&
        list_call(RINGLET_LIST_ALL_GATHER, inputs, outputs[0], RINGLET_SUM, 0)) {
      return c10::make_intrusive<DoneWork>(outputs[0]);
    }
    return forward("allgather", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    ++seq_;
    return forward("allgather_coalesced", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    ++seq_;
    return forward("allgather_into_tensor_coalesced", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    ++seq_;
    const std::vector<at::Tensor> none;
    const bool root = opts.rootRank == getRank();
    if (!opts.asyncOp && inputs.size() == 1 && valid_root(opts.rootRank) &&
        (root ? outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(getSize())
              : outputs.empty() || (outputs.size() == 1 && outputs[0].empty())) &&
        list_call(RINGLET_LIST_GATHER, inputs, root ? outputs[0] : none, RINGLET_SUM,
             opts.rootRank)) {
      return c10::make_intrusive<DoneWork>(root ? outputs[0] : std::vector<at::Tensor>{});
    }
    return forward("gather", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    ++seq_;
    const std::vector<at::Tensor> none;
    const bool root = opts.rootRank == getRank();
    if (!opts.asyncOp && outputs.size() == 1 && valid_root(opts.rootRank) &&
        (root ? inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(getSize())
              : inputs.empty() || (inputs.size() == 1 && inputs[0].empty())) &&
        list_call(RINGLET_LIST_SCATTER, root ? inputs[0] : none, outputs, RINGLET_SUM,
             opts.rootRank)) {
      return c10::make_intrusive<DoneWork>(outputs);
    }
    return forward("scatter", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    ++seq_;
    if (!opts.asyncOp && outputs.size() == 1 && inputs.size() == 1 &&
        inputs[0].size() == static_cast<size_t>(getSize()) && outputs[0].defined() &&
        inputs[0][getRank()].defined() &&
        inputs[0][getRank()].numel() == outputs[0].numel()) {
      const int op = op_code(opts.reduceOp, outputs[0].scalar_type());
      if (op >= 0 && list_call(RINGLET_LIST_REDUCE_SCATTER, inputs[0], outputs, op, 0)) {
        return c10::make_intrusive<DoneWork>(outputs);
      }
    }
    return forward("reduce_scatter", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    ++seq_;
    return forward("reduce_scatter_tensor_coalesced", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    ++seq_;
    const auto n = static_cast<size_t>(getSize());
    if (!opts.asyncOp && inputs.size() == n && outputs.size() == n &&
        list_call(RINGLET_LIST_ALL_TO_ALL, inputs, outputs, RINGLET_SUM, 0)) {
      return c10::make_intrusive<DoneWork>(outputs);
    }
    return forward("alltoall", outputs, inputs, own(opts));
  }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                int tag) override {
    return forward("send", tensors, dstRank, tag);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                int tag) override {
    return forward("recv", tensors, srcRank, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return forward("recv_anysource", tensors, tag);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    py::gil_scoped_acquire gil;
    py::object timeout = py::none();
    if (opts.timeout.count() >= 0) {
      timeout = py::cast(opts.timeout);
    }
    pg_.attr("monitored_barrier")(timeout, waitAllRanks);
  }

  void startCoalescing() override {
    coalescing_ = true;
    py::gil_scoped_acquire gil;
    pg_.attr("_start_coalescing")(py::none());
  }

  c10::intrusive_ptr<Work> endCoalescing() override {
    coalescing_ = false;
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<PyForwardWork>(pg_.attr("_end_coalescing")(py::none()));
  }

  void abort() override {
    closed_ = true;
    py::gil_scoped_acquire gil;
    pg_.attr("abort")();
  }

  void shutdown() override {
    closed_ = true;
    py::gil_scoped_acquire gil;
    pg_.attr("shutdown")();
  }

  // The survivors' group: a new Python group (and Backend) of the ranks not
  // in `ranks` (group ranks), connected through this group's store.
  c10::intrusive_ptr<Backend> shrink(const std::vector<int64_t>& ranks, int flags,
                                     const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    double timeout_s = timeoutSeconds();
    if (opts && opts->timeout.count() > 0) {
      timeout_s = opts->timeout.count() / 1000.0;
    }
    py::object smaller = pg_.attr("_shrink")(ranks, flags, timeout_s);
    return create(smaller, table(), timeout_s);
  }

  // A group of the parent ranks `ranks` (group ranks) on `store`; none for
  // the ranks outside it.
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                    const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    double timeout_s = timeoutSeconds();
    if (opts && opts->timeout.count() > 0) {
      timeout_s = opts->timeout.count() / 1000.0;
    }
    py::object part = pg_.attr("_split")(store, ranks, timeout_s);
    if (part.is_none()) {
      return nullptr;
    }
    return create(part, table(), timeout_s);
  }

  // -- the engine ------------------------------------------------------------

  // The engine handle of the group's communicator, once the Python group
  // has connected it (its first collective runs there), else null.
  const RingletNativeGroup* engine() {
    auto* g = group_.load(std::memory_order_acquire);
    if (g != nullptr || closed_.load(std::memory_order_relaxed)) {
      return g;
    }
    py::gil_scoped_acquire gil;
    auto addr = pg_.attr("_native_handle")().cast<uintptr_t>();
    if (addr == 0) {
      return nullptr;
    }
    auto* fresh = reinterpret_cast<RingletNativeGroup*>(addr);
    RingletNativeGroup* expected = nullptr;
    if (!group_.compare_exchange_strong(expected, fresh)) {
      api_->group_free(fresh);
      return expected;
    }
    return fresh;
  }

  // Raises the engine's error `err` as the Python group would have (the
  // same exception types, attributes and messages).
  [[noreturn]] void raise(RingletCError* err) {
    py::gil_scoped_acquire gil;
    if (!native_error_) {
      std::string msg = err ? api_->error_message(err) : "unknown error";
      api_->error_free(err);
      TORCH_CHECK(false, msg);
    }
    py::object exc = native_error_(reinterpret_cast<uintptr_t>(err));
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
  }

  uint64_t timeoutMs() const { return timeout_ms_.load(std::memory_order_relaxed); }
  const RingletCApi* api() const { return api_; }

 private:
  // Runs `call(group, timeout_ms, &err)` when the group's communicator is
  // connected, no coalescing block is open and the group is not shut down:
  // false (nothing done) else.
  template <typename F>
  bool native(F&& call) {
    if (coalescing_ || closed_) {
      return false;  // the Python group records or refuses it
    }
    auto* g = group_.load(std::memory_order_acquire);
    if (g == nullptr) {
      return false;  // the Python group connects on its first collective
    }
    RingletCError* err = nullptr;
    int32_t code;
    {
      NoGil nogil;
      code = call(g, timeout_ms_.load(std::memory_order_relaxed), &err);
    }
    native_calls_.fetch_add(1, std::memory_order_relaxed);
    if (code != RINGLET_OK) {
      raise(err);
    }
    return true;
  }

  bool valid_root(int64_t root) const { return root >= 0 && root < getSize(); }

  // A list form (RingletListKind) as one engine call when every tensor of
  // `ins` and `outs` is plain with one dtype (the engine stages the lists
  // through flat buffers of its own, so they may alias); false (nothing
  // done) otherwise: the Python group then checks, converts or names the
  // problem.
  bool list_call(uint32_t kind, const std::vector<at::Tensor>& ins,
            const std::vector<at::Tensor>& outs, int op, int64_t root) {
    int d = -1;
    std::vector<RingletBuf> in_bufs, out_bufs;
    in_bufs.reserve(ins.size());
    out_bufs.reserve(outs.size());
    for (const auto& pair : {std::make_pair(&ins, &in_bufs), std::make_pair(&outs, &out_bufs)}) {
      for (const at::Tensor& t : *pair.first) {
        const int code = plain(t);
        if (code < 0 || (d >= 0 && code != d)) {
          return false;
        }
        d = code;
        pair.second->push_back(RingletBuf{t.data_ptr(), t.nbytes()});
      }
    }
    return d >= 0 && native([&](const RingletNativeGroup* g, uint64_t ms, RingletCError** e) {
             return api_->list_collective(g, kind, in_bufs.data(), in_bufs.size(),
                                          out_bufs.data(), out_bufs.size(), d, op,
                                          static_cast<size_t>(root), ms, e);
           });
  }

  // Element counts per rank of an all-to-all tensor split by dim-0 rows.
  bool counts(const at::Tensor& t, const std::vector<int64_t>& splits,
              std::vector<size_t>& out) const {
    const int64_t n = getSize();
    const int64_t rows = t.dim() ? t.size(0) : 1;
    const int64_t row = rows ? t.numel() / rows : 0;
    out.clear();
    if (splits.empty()) {
      if (rows % n) {
        return false;  // the Python group names the problem
      }
      out.assign(n, static_cast<size_t>(rows / n * row));
      return true;
    }
    int64_t sum = 0;
    for (int64_t s : splits) {
      if (s < 0) {
        return false;
      }
      sum += s;
      out.push_back(static_cast<size_t>(s * row));
    }
    return static_cast<int64_t>(splits.size()) == n && sum == rows;
  }

  template <typename... Args>
  c10::intrusive_ptr<Work> forward(const char* method, Args&&... args) {
    c10::intrusive_ptr<Work> work;
    {
      py::gil_scoped_acquire gil;
      if (!synced_.exchange(true)) {
        pg_.attr("setGroupDesc")(getGroupDesc());
      }
      work = c10::make_intrusive<PyForwardWork>(
          pg_.attr(method)(to_py(std::forward<Args>(args))...));
    }
    engine();  // connected by now if this was the group's first collective
    return work;
  }

  const RingletCApi* api_;
  py::object pg_;
  py::object native_error_;
  std::atomic<RingletNativeGroup*> group_{nullptr};
  std::atomic<uint64_t> timeout_ms_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> native_calls_{0};
  std::atomic<bool> closed_{false};
  std::atomic<bool> coalescing_{false};
  std::atomic<bool> synced_{false};
};

// A Backend whose collectives do nothing and return completed work: torch's
// own cost of dist.all_reduce (its Python wrapper and C++ dispatch), the
// floor under any backend, measured by `python -m ringlet.bench c10d`.
class NoopBackend : public Backend {
 public:
  NoopBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "ringlet_noop"; }
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& /*opts*/) override {
    return c10::make_intrusive<DoneWork>(tensors);
  }
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    return c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{});
  }
};

// -- torch.ops.ringlet.all_reduce_ -------------------------------------------

namespace {

std::mutex g_mutex;
c10::intrusive_ptr<RingletBackend> g_backend;  // the last group resolved
std::string g_name;                            // ... and the name it was asked by

// The native Backend of c10d group `name` ("" for the default group),
// resolved through Python once and cached until that group shuts down.
c10::intrusive_ptr<RingletBackend> backend_for(c10::string_view name) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_backend && !g_backend->closed() && g_name == name) {
      return g_backend;
    }
  }
  py::gil_scoped_acquire gil;
  py::object b =
      py::module_::import("ringlet.distributed.c10d").attr("backend_of")(std::string(name));
  auto found = b.cast<c10::intrusive_ptr<RingletBackend>>();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_backend = found;
  g_name = std::string(name);
  return found;
}

int op_by_name(c10::string_view name) {
  static const char* names[] = {"sum", "mul", "min", "max", "and", "or", "xor"};
  for (int i = 0; i < 7; ++i) {
    if (name == names[i]) {
      return i;
    }
  }
  if (name == "product") return RINGLET_MUL;
  if (name == "band") return RINGLET_AND;
  if (name == "bor") return RINGLET_OR;
  if (name == "bxor") return RINGLET_XOR;
  TORCH_CHECK_VALUE(false, "torch.ops.ringlet.all_reduce_: unknown reduce_op '", name,
                    "' (expected one of sum, mul, min, max, and, or, xor)");
}

void all_reduce_cpu(at::Tensor& x, c10::string_view reduce_op, c10::string_view group) {
  const int op = op_by_name(reduce_op);
  const int d = dtype_code(x.scalar_type());
  TORCH_CHECK_VALUE(d >= 0, "torch.ops.ringlet.all_reduce_: unsupported dtype ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(op < RINGLET_AND || !at::isFloatingType(x.scalar_type()),
                    "torch.ops.ringlet.all_reduce_: reduce_op '", reduce_op,
                    "' needs an integer or bool tensor, got ", x.scalar_type());
  auto b = backend_for(group);
  const bool dense = plain(x) >= 0;
  at::Tensor buf = dense ? x : x.contiguous();
  const RingletNativeGroup* g = b->engine();
  if (g == nullptr) {
    // Not connected yet: the group's first collective connects it.
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(
        op == RINGLET_SUM ? c10d::ReduceOp::SUM
        : op == RINGLET_MUL ? c10d::ReduceOp::PRODUCT
        : op == RINGLET_MIN ? c10d::ReduceOp::MIN
        : op == RINGLET_MAX ? c10d::ReduceOp::MAX
        : op == RINGLET_AND ? c10d::ReduceOp::BAND
        : op == RINGLET_OR ? c10d::ReduceOp::BOR
                           : c10d::ReduceOp::BXOR));
    opts.asyncOp = false;
    b->allreduce(ts, opts)->wait();
  } else {
    RingletCError* err = nullptr;
    int32_t code;
    {
      NoGil nogil;
      code = b->api()->all_reduce(g, buf.data_ptr(), buf.nbytes(), d, op, b->timeoutMs(), &err);
    }
    if (code != RINGLET_OK) {
      b->raise(err);
    }
  }
  if (!dense) {
    x.copy_(buf);
  }
}

void all_reduce_meta(at::Tensor& /*x*/, c10::string_view /*reduce_op*/,
                     c10::string_view /*group*/) {}

}  // namespace

}  // namespace ringlet

TORCH_LIBRARY_FRAGMENT(ringlet, m) {
  // Returns nothing (as torch's mutating ops that torch.compile
  // functionalizes): the result is in `x`.
  m.def("all_reduce_(Tensor(a!) x, str reduce_op='sum', str group='') -> ()");
}

TORCH_LIBRARY_IMPL(ringlet, CPU, m) { m.impl("all_reduce_", &ringlet::all_reduce_cpu); }

TORCH_LIBRARY_IMPL(ringlet, Meta, m) { m.impl("all_reduce_", &ringlet::all_reduce_meta); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using ringlet::NoopBackend;
  using ringlet::RingletBackend;
  py::module_::import("torch._C._distributed_c10d");
  py::class_<RingletBackend, c10d::Backend, c10::intrusive_ptr<RingletBackend>>(
      m, "RingletBackend")
      .def(py::init(&RingletBackend::create), py::arg("pg"), py::arg("table"),
           py::arg("timeout_s"))
      .def("python_group", &RingletBackend::pythonGroup,
           "The Python process group (ringlet.distributed.c10d.ProcessGroupRinglet) behind this Backend.")
      .def_property_readonly("native_connected", &RingletBackend::nativeConnected,
                             "Whether the engine handle is in place (after the first collective).")
      .def_property_readonly("native_calls", &RingletBackend::nativeCalls,
                             "Collectives that took the C ABI (no Python) so far.")
      .def("_set_default_timeout", &RingletBackend::setTimeout, py::arg("timeout"),
           "The timeout of the operations issued from now on (as gloo's and NCCL's).")
      .def("__repr__", &RingletBackend::repr);
  // Python sees the Python group's own Work through a forwarded one.
  using ringlet::PyForwardWork;
  auto call = [](const char* name) {
    return [name](const PyForwardWork& w, py::args args, py::kwargs kwargs) {
      return w.py().attr(name)(*args, **kwargs);
    };
  };
  py::class_<PyForwardWork, c10d::Work, c10::intrusive_ptr<PyForwardWork>>(m, "PyForwardWork")
      .def("wait", call("wait"))
      .def("is_completed", call("is_completed"))
      .def("is_success", call("is_success"))
      .def("exception", call("exception"))
      .def("get_future", call("get_future"))
      .def("result", call("result"))
      .def("source_rank", call("source_rank"))
      .def("_source_rank", call("_source_rank"))
      .def("synchronize", call("synchronize"))
      .def("__getattr__", [](const PyForwardWork& w, const std::string& name) {
        return w.py().attr(name.c_str());
      })
      .def("__repr__", [](const PyForwardWork& w) {
        return "<ringlet native Work of " + py::repr(w.py()).cast<std::string>() + ">";
      });
  py::class_<NoopBackend, c10d::Backend, c10::intrusive_ptr<NoopBackend>>(m, "NoopBackend")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"));
}
