// Checks the registry's claim/release bookkeeping without TensorFlow.
#include "dsgd/ops/cc/buffer_registry.h"

#include <cstdio>
#include <cstdlib>

#define CHECK(cond)                                              \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                              \
    }                                                            \
  } while (0)

int main() {
  char memory[128];
  int64_t out[4];
  const int64_t a = dsgd::RegisterBuffer(memory, sizeof(memory));
  const int64_t b = dsgd::RegisterBuffer(memory + 64, 64);
  CHECK(a > 0 && b > a);
  CHECK(dsgd::LiveBufferCount() == 2);

  dsgd::RegisteredBuffer buffer;
  CHECK(dsgd::ClaimBuffer(a, &buffer));
  CHECK(buffer.data == memory && buffer.nbytes == sizeof(memory));
  CHECK(dsgd::ClaimBuffer(a, &buffer));  // two tensors share the buffer
  dsgd::ReleaseBuffer(a);
  CHECK(dsgd::DrainReleased(out, 4) == 0);  // one tensor still alive
  dsgd::ReleaseBuffer(a);
  CHECK(dsgd::DrainReleased(out, 4) == 1 && out[0] == a);
  CHECK(!dsgd::ClaimBuffer(a, &buffer));  // gone once released

  CHECK(dsgd::DiscardUnclaimed(out, 4) == 1 && out[0] == b);
  CHECK(dsgd::LiveBufferCount() == 0);
  std::puts("buffer_registry_test: OK");
  return 0;
}
