#include "dsgd/ops/cc/buffer_registry.h"

#include <mutex>
#include <unordered_map>
#include <vector>

namespace dsgd {
namespace {

struct Entry {
  RegisteredBuffer buffer;
  int64_t claims = 0;
  bool ever_claimed = false;
};

struct Registry {
  std::mutex mu;
  int64_t next_handle = 1;
  std::unordered_map<int64_t, Entry> live;
  std::vector<int64_t> released;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;  // never destroyed: tensors may outlive statics
  return *registry;
}

size_t MoveOut(std::vector<int64_t>* from, int64_t* out, size_t capacity) {
  size_t n = from->size() < capacity ? from->size() : capacity;
  for (size_t i = 0; i < n; ++i) out[i] = (*from)[i];
  from->erase(from->begin(), from->begin() + n);
  return n;
}

}  // namespace

int64_t RegisterBuffer(void* data, size_t nbytes) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t handle = r.next_handle++;
  r.live[handle].buffer = RegisteredBuffer{data, nbytes};
  return handle;
}

bool ClaimBuffer(int64_t handle, RegisteredBuffer* out) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(handle);
  if (it == r.live.end()) return false;
  it->second.claims += 1;
  it->second.ever_claimed = true;
  *out = it->second.buffer;
  return true;
}

void ReleaseBuffer(int64_t handle) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(handle);
  if (it == r.live.end()) return;
  if (--it->second.claims == 0) {
    r.live.erase(it);
    r.released.push_back(handle);
  }
}

size_t DrainReleased(int64_t* out, size_t capacity) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return MoveOut(&r.released, out, capacity);
}

size_t DiscardUnclaimed(int64_t* out, size_t capacity) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<int64_t> unclaimed;
  for (const auto& kv : r.live) {
    if (!kv.second.ever_claimed) unclaimed.push_back(kv.first);
  }
  size_t n = unclaimed.size() < capacity ? unclaimed.size() : capacity;
  for (size_t i = 0; i < n; ++i) r.live.erase(unclaimed[i]);
  return MoveOut(&unclaimed, out, n);
}

size_t LiveBufferCount() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.live.size();
}

}  // namespace dsgd

// C entry points for the Python loader (ctypes).
extern "C" {

int64_t dsgd_register_buffer(uint64_t address, uint64_t nbytes) {
  return dsgd::RegisterBuffer(reinterpret_cast<void*>(address), nbytes);
}

uint64_t dsgd_drain_released(int64_t* out, uint64_t capacity) {
  return dsgd::DrainReleased(out, capacity);
}

uint64_t dsgd_discard_unclaimed(int64_t* out, uint64_t capacity) {
  return dsgd::DiscardUnclaimed(out, capacity);
}

uint64_t dsgd_live_buffer_count() { return dsgd::LiveBufferCount(); }

}  // extern "C"
