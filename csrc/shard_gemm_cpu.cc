// CPU backend of the shard-at-a-time GEMM (shard_gemm.h): the step plan that
// the CUDA handler uses, with a plain loop in place of cuBLAS, so that the
// interpreter tests exercise the waits, epochs and row placement.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "shard_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

float FromBf16(std::uint16_t bits) {
  std::uint32_t word = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, 4);
  return f;
}

std::uint16_t ToBf16(float f) {
  std::uint32_t word;
  std::memcpy(&word, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  word += 0x7fff + ((word >> 16) & 1);  // round to nearest even
  return static_cast<std::uint16_t>(word >> 16);
}

float FromF16(std::uint16_t h) {
  const std::uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -mag : mag;
}

std::uint16_t ToF16(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  float a = std::fabs(f);
  if (std::isnan(f)) return 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;
  if (a < std::ldexp(1.0f, -14)) {  // subnormal: units of 2^-24, nearest even
    return sign | static_cast<std::uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  }
  int e;
  float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  auto mant = static_cast<std::uint32_t>(std::nearbyint(std::ldexp(m, 11)));  // 11 bits
  if (mant == 2048) {
    mant = 1024;
    ++e;
  }
  if (e + 14 >= 31) return sign | 0x7c00;
  return sign | static_cast<std::uint16_t>(((e + 14) << 10) | (mant & 0x3ff));
}

float Load(const void* p, std::int64_t i, ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return static_cast<const float*>(p)[i];
    case ffi::DataType::BF16: return FromBf16(static_cast<const std::uint16_t*>(p)[i]);
    default: return FromF16(static_cast<const std::uint16_t*>(p)[i]);
  }
}

void Store(void* p, std::int64_t i, ffi::DataType t, float v) {
  switch (t) {
    case ffi::DataType::F32: static_cast<float*>(p)[i] = v; break;
    case ffi::DataType::BF16: static_cast<std::uint16_t*>(p)[i] = ToBf16(v); break;
    default: static_cast<std::uint16_t*>(p)[i] = ToF16(v); break;
  }
}

ffi::Error ShardGemmCpu(ffi::Buffer<ffi::S32> position, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::AnyBuffer token, ffi::RemainingArgs previous,
                        ffi::Result<ffi::AnyBuffer> out, std::int64_t world,
                        ffi::Span<const std::int64_t> groups, std::int64_t step,
                        std::int64_t counter_id, std::int64_t inbox_offset,
                        std::int64_t parity_bytes, std::int64_t generation,
                        std::int64_t algo_index) {
  (void)token;       // orders this step after its wait
  (void)previous;    // the output so far: XLA aliases it to `out`
  (void)algo_index;  // cuBLASLt's choice; the loop has none
  if (std::string stale = CheckGeneration(generation); !stale.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, stale);
  }
  ShardGemm g;
  std::string err = PlanShardGemm(position.typed_data()[0], x, w, *out, world, groups, step,
                                  counter_id, inbox_offset, parity_bytes, &g);
  if (!err.empty()) return ffi::Error::InvalidArgument("jaxtdist shard GEMM: " + err);
  std::vector<float> row(g.n);
  for (std::int64_t i = 0; i < g.m; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (std::int64_t kk = 0; kk < g.k; ++kk) {
      const float a = Load(g.a, i * g.k + kk, g.type);
      for (std::int64_t j = 0; j < g.n; ++j) row[j] += a * Load(g.w, kk * g.n + j, g.type);
    }
    for (std::int64_t j = 0; j < g.n; ++j) Store(g.c, i * g.n + j, g.type, row[j]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistShardGemmCpu, ShardGemmCpu,
                              BindShardGemmOperands(ffi::Ffi::Bind()
                                                     .Arg<ffi::Buffer<ffi::S32>>()));

}  // namespace jaxtdist
