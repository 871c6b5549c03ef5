#ifndef FLCE_TESTS_SHM_OBJECT_H_
#define FLCE_TESTS_SHM_OBJECT_H_

// A POSIX shared-memory object of a test, mapped into it and unlinked at the
// end: what a same-host client registers with the server.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace flce {

class ShmObject {
 public:
  explicit ShmObject(size_t bytes)
      : name_("/flce-test-" + std::to_string(getpid()) + "-" + std::to_string(++counter_)),
        bytes_(bytes) {
    fd_ = shm_open(name_.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    base_ = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
  }
  ~ShmObject() {
    munmap(base_, bytes_);
    close(fd_);
    shm_unlink(name_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  const std::string& name() const { return name_; }
  // This process's mapping; past a Resize below its size, not to be touched.
  char* base() const { return base_; }
  // What a client that shrinks (or grows) its object does.
  void Resize(size_t bytes) { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

 private:
  static inline int counter_ = 0;
  std::string name_;
  size_t bytes_;
  int fd_ = -1;
  char* base_ = nullptr;
};

}  // namespace flce

#endif  // FLCE_TESTS_SHM_OBJECT_H_
