// Registry of the buffers that TensorFlow tensors may alias.
//
// Python registers the address and size of a buffer it keeps alive (a numpy
// view of shared memory, or the array ray.get returned) and gets an integer
// handle. The
// DsgdAliasTensor op claims the handle and wraps the memory in a
// TensorBuffer; when the last tensor aliasing it dies, the handle is pushed
// onto a "released" queue that Python drains to drop its reference. No Python
// or GIL is involved on the C++ side.
#ifndef DSGD_OPS_CC_BUFFER_REGISTRY_H_
#define DSGD_OPS_CC_BUFFER_REGISTRY_H_

#include <cstddef>
#include <cstdint>

namespace dsgd {

struct RegisteredBuffer {
  void* data = nullptr;
  size_t nbytes = 0;
};

// Returns a new handle (> 0) for the buffer [data, data + nbytes).
int64_t RegisterBuffer(void* data, size_t nbytes);

// Marks the handle as used by one more tensor. Returns false if unknown.
bool ClaimBuffer(int64_t handle, RegisteredBuffer* out);

// Undoes one ClaimBuffer; the last one moves the handle to the released queue.
void ReleaseBuffer(int64_t handle);

// Moves up to `capacity` released handles into `out`; returns how many.
size_t DrainReleased(int64_t* out, size_t capacity);

// Forgets up to `capacity` registered handles that no tensor ever claimed
// (e.g. after a failed session.run) and writes them to `out`.
size_t DiscardUnclaimed(int64_t* out, size_t capacity);

// Registered handles not yet released (claimed or not).
size_t LiveBufferCount();

}  // namespace dsgd

#endif  // DSGD_OPS_CC_BUFFER_REGISTRY_H_
