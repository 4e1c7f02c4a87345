// One GEMM per source rank for ag_matmul's GEMM="cublas" mode.
//
// The copy engines push every rank's shard into its peers' heap inboxes
// (ce_gather.cc). Step s of world computes the rows of rank me-s: step 0
// reads x itself, step s > 0 the inbox rows that rank me-s pushed (it
// pushes to this rank s-th, so shards are consumed in the order they land),
// after a Triton kernel has waited for that shard's flags. Each step writes
// its rows of the one [world * m_shard, n] output in place (XLA aliases the
// output through the steps). The library GEMM is cuBLASLt on GPUs and a
// plain loop on the CPU backend, behind the same step plan.
#ifndef JAXTDIST_CSRC_SHARD_GEMM_H_
#define JAXTDIST_CSRC_SHARD_GEMM_H_

#include <cstdint>
#include <string>
#include <utility>

#include "runtime_state.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Where one step reads its shard and writes its rows.
struct ShardStep {
  const char* a = nullptr;   // [m_shard, k] rows of the source rank
  std::int64_t out_row = 0;  // first output row (source rank * m_shard)
};

// Plans step `step` on mesh position `position`; returns "" or what is wrong.
// `x` is this rank's shard of `shard_bytes`; the inbox holds world shards per
// parity (parity = this call's epoch % 2, as the pushes used).
inline std::string PlanShardStep(int position, xla::ffi::Span<const std::int64_t> groups,
                                 std::int64_t world, std::int64_t step,
                                 std::int64_t counter_id, std::int64_t inbox_offset,
                                 std::int64_t parity_bytes, const void* x,
                                 std::int64_t shard_bytes, std::int64_t m_shard,
                                 ShardStep* plan) {
  std::string err;
  const std::int64_t* group = RuntimeState::GroupOf(
      groups.begin(), static_cast<std::int64_t>(groups.size()), world, position, &err);
  if (group == nullptr) return err;
  if (step < 0 || step >= world) {
    return "step " + std::to_string(step) + " is outside [0, " + std::to_string(world) + ")";
  }
  std::int64_t me = -1;
  for (std::int64_t r = 0; r < world; ++r) {
    if (group[r] == position) me = r;
  }
  if (me < 0) return "mesh position " + std::to_string(position) + " is not in its group";
  const std::int64_t src = (me - step + world) % world;
  plan->out_row = src * m_shard;
  if (step == 0) {
    plan->a = static_cast<const char*>(x);
    return "";
  }
  auto heap = RuntimeState::Get().Heap(position);
  if (!heap) return "no heap for mesh position " + std::to_string(position);
  const std::int64_t epoch = RuntimeState::Get().PeekEpoch(counter_id, position);
  const std::int64_t offset = inbox_offset + (epoch & 1) * parity_bytes + src * shard_bytes;
  if (inbox_offset < 0 || parity_bytes < world * shard_bytes || offset < 0 ||
      inbox_offset + 2 * parity_bytes > heap->bytes) {
    return "inbox outside the heap";
  }
  plan->a = reinterpret_cast<const char*>(heap->base + offset);
  return "";
}

// One step's GEMM: rows [out_row, out_row + m) of `c` = a[m, k] @ w[k, n],
// row-major, all of dtype `type`.
struct ShardGemm {
  const char* a = nullptr;
  const void* w = nullptr;
  char* c = nullptr;  // the step's first output row
  std::int64_t m = 0, n = 0, k = 0;
  xla::ffi::DataType type = xla::ffi::DataType::F32;
};

// Checks a step's operands and plans it on mesh position `position`; returns
// "" or what is wrong (the handlers' shared front half).
inline std::string PlanShardGemm(int position, const xla::ffi::AnyBuffer& x,
                                 const xla::ffi::AnyBuffer& w, xla::ffi::AnyBuffer& out,
                                 std::int64_t world, xla::ffi::Span<const std::int64_t> groups,
                                 std::int64_t step, std::int64_t counter_id,
                                 std::int64_t inbox_offset, std::int64_t parity_bytes,
                                 ShardGemm* gemm) {
  using xla::ffi::DataType;
  const DataType t = x.element_type();
  if (t != w.element_type() || t != out.element_type() ||
      (t != DataType::F32 && t != DataType::BF16 && t != DataType::F16)) {
    return "x, w and out must share a dtype among float32, bfloat16 and float16";
  }
  if (x.dimensions().size() != 2 || w.dimensions().size() != 2) return "x and w must be 2-D";
  gemm->m = x.dimensions()[0];
  gemm->k = x.dimensions()[1];
  gemm->n = w.dimensions()[1];
  gemm->type = t;
  gemm->w = w.untyped_data();
  const std::int64_t shard_bytes = static_cast<std::int64_t>(x.size_bytes());
  ShardStep plan;
  std::string err = PlanShardStep(position, groups, world, step, counter_id, inbox_offset,
                                  parity_bytes, x.untyped_data(), shard_bytes, gemm->m, &plan);
  if (!err.empty()) return err;
  gemm->a = plan.a;
  const std::int64_t item = shard_bytes / (gemm->m * gemm->k);
  gemm->c = static_cast<char*>(out.untyped_data()) + plan.out_row * gemm->n * item;
  return "";
}

// What both handlers take after their own leading operands (the CUDA handler's
// stream and device, the CPU handler's mesh position): x, w, the wait token,
// the previous step's output when aliased (remaining), the output, the attributes.
template <typename Binding>
auto BindShardGemmOperands(Binding&& binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()
      .template Arg<xla::ffi::AnyBuffer>()
      .template Arg<xla::ffi::AnyBuffer>()
      .RemainingArgs()
      .template Ret<xla::ffi::AnyBuffer>()
      .template Attr<std::int64_t>("world")
      .template Attr<xla::ffi::Span<const std::int64_t>>("groups")
      .template Attr<std::int64_t>("step")
      .template Attr<std::int64_t>("counter_id")
      .template Attr<std::int64_t>("inbox_offset")
      .template Attr<std::int64_t>("parity_bytes")
      .template Attr<std::int64_t>("generation")
      .template Attr<std::int64_t>("algo_index");
}

#ifdef JAXTDIST_WITH_CUDA
extern "C" XLA_FFI_Error* JaxtdistShardGemmCuda(XLA_FFI_CallFrame* call_frame);
#endif
extern "C" XLA_FFI_Error* JaxtdistShardGemmCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_SHARD_GEMM_H_
