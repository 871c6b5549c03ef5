#include "server/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace flce {
namespace {

struct Slot {
  std::atomic<uintptr_t> base{0};  // 0: free
  std::atomic<size_t> bytes{0};
  std::atomic<bool> broken{false};
};

Slot g_slots[SigbusGuard::kCapacity];
std::mutex g_mu;  // Guard and Unguard; the handler only reads
struct sigaction g_previous;
uintptr_t g_page = 4096;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& slot : g_slots) {
    const uintptr_t base = slot.base.load(std::memory_order_acquire);
    const size_t bytes = slot.bytes.load(std::memory_order_acquire);
    if (base == 0 || address < base || address - base >= bytes) continue;
    const uintptr_t from = address & ~(g_page - 1);
    const uintptr_t end = (base + bytes + g_page - 1) & ~(g_page - 1);
    void* zeros = mmap(reinterpret_cast<void*>(from), end - from, PROT_READ | PROT_WRITE,
                       MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (zeros != MAP_FAILED) {
      slot.broken.store(true, std::memory_order_release);
      return;  // the access is retried on the zero pages
    }
    break;
  }
  // Not ours: the previous disposition handles the retried access.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signal, info, context);
    return;
  }
  sigaction(SIGBUS, &g_previous, nullptr);
}

void Install() {
  g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_RESTART | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous);
}

}  // namespace

int SigbusGuard::Guard(void* base, size_t bytes) {
  static std::once_flag installed;
  std::call_once(installed, Install);
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kCapacity; ++i) {
    Slot& slot = g_slots[i];
    if (slot.base.load(std::memory_order_relaxed) != 0) continue;
    slot.broken.store(false, std::memory_order_relaxed);
    slot.bytes.store(bytes, std::memory_order_release);
    slot.base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return i;
  }
  return -1;
}

void SigbusGuard::Unguard(int slot) {
  if (slot < 0 || slot >= kCapacity) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_slots[slot].base.store(0, std::memory_order_release);
  g_slots[slot].bytes.store(0, std::memory_order_release);
}

bool SigbusGuard::Broken(int slot) {
  return slot >= 0 && slot < kCapacity && g_slots[slot].broken.load(std::memory_order_acquire);
}

}  // namespace flce
