#include "dsgd/ops/cc/wire_kernels.h"

#include <algorithm>
#include <cstring>

// The loops are compiled once per x86 vector extension (AVX-512F, AVX2) and
// the widest the CPU supports is picked when the library loads (GCC's
// target_clones): a portable build that still converts 16 floats at a time
// where it can. Extensions, not CPU models: "arch=skylake-avx512" picks its
// clone only on that very model, so other AVX-512 CPUs fell back to SSE2
// (4.8x slower rounding, measured).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DSGD_VECTOR_CLONES \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DSGD_VECTOR_CLONES
#endif

namespace dsgd {
namespace {

// Branch-free, so the loops that call it vectorize.
inline uint16_t FloatToBfloat16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline float Bfloat16BitsToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

DSGD_VECTOR_CLONES void AddBfloat16(const uint16_t* in, float* sum, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] += Bfloat16BitsToFloat(in[i]);
}

DSGD_VECTOR_CLONES void AddFloat(const float* a, const float* b, float* sum, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
}

DSGD_VECTOR_CLONES void Divide(float* values, float divisor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) values[i] /= divisor;
}

// Elements averaged at a time: the float32 block stays in L1 between adds.
constexpr int64_t kBlock = 4096;

}  // namespace

DSGD_VECTOR_CLONES void FloatToBfloat16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBfloat16Bits(in[i]);
}

DSGD_VECTOR_CLONES void Bfloat16ToFloat(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bfloat16BitsToFloat(in[i]);
}

}  // namespace dsgd

extern "C" {

void dsgd_bf16_round(const float* in, uint16_t* out, int64_t n) { dsgd::FloatToBfloat16(in, out, n); }

void dsgd_bf16_widen(const uint16_t* in, float* out, int64_t n) { dsgd::Bfloat16ToFloat(in, out, n); }

void dsgd_bf16_average(const uint16_t* const* inputs, int64_t count, int64_t size,
                       float divisor, float* out, uint16_t* rounded) {
  alignas(64) float scratch[dsgd::kBlock];
  for (int64_t lo = 0; lo < size; lo += dsgd::kBlock) {
    const int64_t n = std::min(dsgd::kBlock, size - lo);
    float* sum = out != nullptr ? out + lo : scratch;
    dsgd::Bfloat16ToFloat(inputs[0] + lo, sum, n);
    for (int64_t k = 1; k < count; ++k) dsgd::AddBfloat16(inputs[k] + lo, sum, n);
    if (divisor != 1.0f) dsgd::Divide(sum, divisor, n);
    if (out == nullptr) dsgd::FloatToBfloat16(sum, rounded + lo, n);
  }
}

void dsgd_f32_average(const float* const* inputs, int64_t count, int64_t size, float divisor,
                      float* out) {
  for (int64_t lo = 0; lo < size; lo += dsgd::kBlock) {
    const int64_t n = std::min(dsgd::kBlock, size - lo);
    float* sum = out + lo;
    if (count == 1) {
      std::memcpy(sum, inputs[0] + lo, n * sizeof(float));
    } else {
      dsgd::AddFloat(inputs[0] + lo, inputs[1] + lo, sum, n);
      for (int64_t k = 2; k < count; ++k) dsgd::AddFloat(sum, inputs[k] + lo, sum, n);
    }
    if (divisor != 1.0f) dsgd::Divide(sum, divisor, n);
  }
}

}  // extern "C"
