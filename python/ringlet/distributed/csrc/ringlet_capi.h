// The C ABI of ringlet's Rust engine (rust/ringlet-core/src/capi.rs), as
// the C++ torch.distributed Backend sees it. Python hands the Backend the
// address of the table (ringlet._core.capi_table()) and, per process group,
// a group handle (ringlet._core.native_group(queue, comm)); nothing links
// against the engine's library. Keep this struct in the order and layout of
// `RingletCApi` in capi.rs; `version` and `size` are checked at load.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct RingletNativeGroup;  // opaque: a group's progress queue and communicator
struct RingletCError;       // opaque: an engine error (message + kind + culprit)

enum : int32_t { RINGLET_OK = 0, RINGLET_ERROR = 1 };
enum : uint32_t { RINGLET_CAPI_VERSION = 2 };

// Engine dtype codes (ringlet_core::DType) and reduce op codes
// (ringlet_core::ReduceOp).
enum RingletDType : uint32_t {
  RINGLET_F32 = 0, RINGLET_F64 = 1, RINGLET_F16 = 2, RINGLET_BF16 = 3, RINGLET_I8 = 4,
  RINGLET_U8 = 5, RINGLET_I16 = 6, RINGLET_I32 = 7, RINGLET_I64 = 8, RINGLET_BOOL = 9,
};
enum RingletReduceOp : uint32_t {
  RINGLET_SUM = 0, RINGLET_MUL = 1, RINGLET_MIN = 2, RINGLET_MAX = 3,
  RINGLET_AND = 4, RINGLET_OR = 5, RINGLET_XOR = 6,
};

// A buffer of a list (the list forms' inputs and outputs): address and bytes.
struct RingletBuf {
  void* ptr;
  size_t nbytes;
};

// The list forms' kinds (ringlet_core::collective::ListOp).
enum RingletListKind : uint32_t {
  RINGLET_LIST_ALL_GATHER = 0, RINGLET_LIST_GATHER = 1, RINGLET_LIST_SCATTER = 2,
  RINGLET_LIST_ALL_TO_ALL = 3, RINGLET_LIST_REDUCE_SCATTER = 4,
};

// Every collective runs in the group's issue order: at once on the calling
// thread when the group's queue is idle, else behind the earlier operations
// (waited for up to timeout_ms; a call that could not start by then never
// runs). The caller must not hold the GIL. On RINGLET_ERROR, *err holds an
// error the caller frees (error_free) or hands to ringlet._core.native_error.
struct RingletCApi {
  uint32_t version;
  uint32_t size;
  int32_t (*all_reduce)(const RingletNativeGroup* g, void* buf, size_t nbytes, uint32_t dtype,
                        uint32_t op, uint64_t timeout_ms, RingletCError** err);
  int32_t (*all_gather)(const RingletNativeGroup* g, const void* in, size_t in_bytes, void* out,
                        size_t out_bytes, uint32_t dtype, uint64_t timeout_ms,
                        RingletCError** err);
  int32_t (*reduce_scatter)(const RingletNativeGroup* g, const void* in, size_t in_bytes,
                            void* out, size_t out_bytes, uint32_t dtype, uint32_t op,
                            uint64_t timeout_ms, RingletCError** err);
  int32_t (*broadcast)(const RingletNativeGroup* g, void* buf, size_t nbytes, uint32_t dtype,
                       size_t root, uint64_t timeout_ms, RingletCError** err);
  int32_t (*barrier)(const RingletNativeGroup* g, uint64_t timeout_ms, RingletCError** err);
  int32_t (*all_to_all)(const RingletNativeGroup* g, const void* in, size_t in_bytes,
                        const size_t* send_counts, void* out, size_t out_bytes,
                        const size_t* recv_counts, size_t ncounts, uint32_t dtype,
                        uint64_t timeout_ms, RingletCError** err);
  // A list form (RingletListKind): the lists' buffers may alias each other.
  int32_t (*list_collective)(const RingletNativeGroup* g, uint32_t kind, const RingletBuf* ins,
                             size_t nin, const RingletBuf* outs, size_t nout, uint32_t dtype,
                             uint32_t op, size_t root, uint64_t timeout_ms, RingletCError** err);
  const char* (*error_message)(const RingletCError* err);
  void (*error_free)(RingletCError* err);
  void (*group_free)(RingletNativeGroup* g);
};

}  // extern "C"
