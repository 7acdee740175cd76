// The wire kernels: bfloat16 conversions and the parameter servers'
// averages, free of TensorFlow. The op library uses the conversions in its
// pack and unpack; the parameter servers load the same code as
// libdsgd_wire.so (through ctypes, dsgd/kernels.py) to average pushes.
#ifndef DSGD_OPS_CC_WIRE_KERNELS_H_
#define DSGD_OPS_CC_WIRE_KERNELS_H_

#include <cstdint>

namespace dsgd {

// float32 -> bfloat16 bits, rounded to nearest, ties to even; a NaN stays a
// quiet NaN. dsgd/wire.py does the same in numpy, bit for bit.
void FloatToBfloat16(const float* in, uint16_t* out, int64_t n);

// bfloat16 bits -> float32, exactly.
void Bfloat16ToFloat(const uint16_t* in, float* out, int64_t n);

}  // namespace dsgd

extern "C" {

void dsgd_bf16_round(const float* in, uint16_t* out, int64_t n);
void dsgd_bf16_widen(const uint16_t* in, float* out, int64_t n);

// (inputs[0] + inputs[1] + ... + inputs[count - 1]) / divisor, element by
// element in float32, adding in the order given (as dsgd/arrays.py does);
// the result goes to `out` as float32 if it is not null, else to `rounded`
// as bfloat16 bits, rounded once.
void dsgd_bf16_average(const uint16_t* const* inputs, int64_t count, int64_t size,
                       float divisor, float* out, uint16_t* rounded);

// The same for float32 inputs, into float32 `out`.
void dsgd_f32_average(const float* const* inputs, int64_t count, int64_t size, float divisor,
                      float* out);

}  // extern "C"

#endif  // DSGD_OPS_CC_WIRE_KERNELS_H_
