#include "kernels/cpu/buffer_pool.h"

#include <algorithm>
#include <utility>

#include "kernels/tensor.h"

namespace flce {

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    Return();
    pool_ = std::exchange(other.pool_, nullptr);
    storage_ = std::move(other.storage_);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

PooledBuffer::~PooledBuffer() { Return(); }

void PooledBuffer::Return() {
  if (pool_ != nullptr && storage_ != nullptr) {
    pool_->Put(std::move(storage_), capacity_);
  }
  pool_ = nullptr;
}

PooledBuffer BufferPool::Take(int64_t floats) {
  floats = std::max<int64_t>(floats, 1);
  {
    absl::MutexLock lock(&mu_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity >= floats && (best == free_.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    // Reuse only a buffer that is not much larger than asked for.
    if (best != free_.end() && best->capacity <= 2 * floats) {
      Entry entry = std::move(*best);
      free_.erase(best);
      cached_bytes_ -= entry.capacity * static_cast<int64_t>(sizeof(float));
      return PooledBuffer(this, std::move(entry.storage), entry.capacity);
    }
  }
  std::unique_ptr<float[]> storage(new float[floats]);
  AdviseHugePages(storage.get(), static_cast<size_t>(floats) * sizeof(float));
  return PooledBuffer(this, std::move(storage), floats);
}

void BufferPool::Put(std::unique_ptr<float[]> storage, int64_t capacity) {
  const int64_t bytes = capacity * static_cast<int64_t>(sizeof(float));
  absl::MutexLock lock(&mu_);
  if (bytes > max_cached_bytes_) return;  // freed when `storage` goes
  // Make room by dropping the largest cached buffers first.
  while (cached_bytes_ + bytes > max_cached_bytes_ && !free_.empty()) {
    auto largest = std::max_element(free_.begin(), free_.end(),
                                    [](const Entry& a, const Entry& b) {
                                      return a.capacity < b.capacity;
                                    });
    cached_bytes_ -= largest->capacity * static_cast<int64_t>(sizeof(float));
    free_.erase(largest);
  }
  cached_bytes_ += bytes;
  free_.push_back(Entry{std::move(storage), capacity});
}

int64_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

}  // namespace flce
