// A bounded load test: many concurrent clients on loopback, each running a
// fixed number of Forward + Backward steps on its own random problems
// against one server with a small queue. Every request must end with a
// result that meets the accuracy bar or with RESOURCE_EXHAUSTED (the queue
// is full: a clear, retryable error), nothing else; afterwards no session,
// reservation or queued task is left and the process's resident memory is
// back near its level after a warm-up round. Prints the figures
// bench/RESULTS.md records.

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/loss_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"
#include "server/loss_server.h"

namespace flce {
namespace {

constexpr int kClients = 32;
constexpr int kStepsPerClient = 25;

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4096;
}

struct Tally {
  absl::Mutex mu;
  std::vector<double> latency_ms;  // Forward + Backward, successful steps
  int64_t ok = 0, wrong = 0, other = 0;
  int64_t busy = 0;  // RESOURCE_EXHAUSTED (queue full) answers, retried
  std::vector<std::string> failures;
};

bool IsBusy(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         absl::StrContains(status.message(), "queue");
}

void Backoff(int attempt, Tally* tally) {
  {
    absl::MutexLock lock(&tally->mu);
    ++tally->busy;
  }
  absl::SleepFor(absl::Milliseconds(2 + (attempt * 7) % 23));
}

// One client's steps; `verify` checks every result against the reference.
void Client(int port, int id, int steps, bool verify, Tally* tally) {
  ClientOptions options;
  options.timeout = absl::Seconds(120);
  auto client = LossClient::Create("127.0.0.1:" + std::to_string(port), options);
  for (int step = 0; step < steps; ++step) {
    RandomProblemSpec spec;
    spec.rows = 17 + (id * 7 + step) % 23;
    spec.hidden = 24 + id % 9;
    spec.vocab = 301 + 13 * (step % 5);
    spec.dtype = step % 3 == 0 ? DType::kBFloat16 : DType::kFloat32;
    spec.bias = id % 2 == 0;
    spec.seed = static_cast<uint64_t>(id * 1000 + step);
    const OwnedProblem p = MakeRandomProblem(spec);
    ForwardArgs args;
    args.problem = p.view();
    args.need_backward = true;
    args.want_lse = true;
    const absl::Time start = absl::Now();
    // A full queue answers RESOURCE_EXHAUSTED at once; clients back off and
    // retry, as the error asks.
    absl::StatusOr<RemoteForward> fwd = absl::UnknownError("not sent");
    absl::StatusOr<RemoteGradients> grads = absl::UnknownError("not sent");
    for (int attempt = 0; attempt < 200; ++attempt) {
      fwd = client->Forward(args);
      if (fwd.ok()) {
        BackwardArgs back;
        back.session_id = fwd->session_id;
        do {
          grads = client->Backward(back);
        } while (IsBusy(grads.status()) && (Backoff(attempt++, tally), attempt < 200));
        if (!grads.ok()) client->ReleaseSession(fwd->session_id).IgnoreError();
        break;
      }
      grads = fwd.status();
      if (!IsBusy(fwd.status())) break;
      Backoff(attempt, tally);
    }
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    absl::MutexLock lock(&tally->mu);
    if (grads.ok()) {
      if (verify) {
        const AccuracyReport report = CheckAccuracy(p.view(), {1.0}, CollectOutputs(*fwd, &*grads));
        if (!report.ok()) {
          ++tally->wrong;
          tally->failures.push_back(report.ToString());
          continue;
        }
      }
      ++tally->ok;
      tally->latency_ms.push_back(ms);
    } else {
      ++tally->other;
      tally->failures.push_back(grads.status().ToString());
    }
  }
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

TEST(LoadTest, ConcurrentClientsGetCorrectAnswersOrClearErrorsAndMemoryReturns) {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.security.insecure = true;
  o.backend = "cpu";
  o.workers = 2;
  o.max_queued_requests = 8;
  o.engine.cpu.chunk_bytes = 1 << 20;
  auto server = LossServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  {  // Warm-up: pools, allocator arenas, gRPC's buffers.
    Tally warm;
    std::vector<std::thread> threads;
    for (int i = 0; i < kClients; ++i) threads.emplace_back(Client, port, i, 2, false, &warm);
    for (auto& t : threads) t.join();
  }
  const int64_t baseline = ResidentBytes();

  Tally tally;
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back(Client, port, i, kStepsPerClient, true, &tally);
  }
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);

  // A worker finishes its bookkeeping just after its reply has gone out.
  for (int i = 0; i < 500 && ((*server)->Metrics().gauges.running_requests > 0 ||
                              (*server)->Metrics().gauges.queued_requests > 0);
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const MetricsSnapshot m = (*server)->Metrics();
  const int64_t after = ResidentBytes();
  std::printf(
      "load: %d clients x %d steps (Forward+Backward) in %.1f s: ok=%lld "
      "wrong=%lld other=%lld (queue-full answers retried: %lld); step p50=%.1f ms p99=%.1f ms; RSS %.1f MiB after warm-up, "
      "%.1f MiB after the run; live sessions %lld, session bytes %lld, queued %lld\n",
      kClients, kStepsPerClient, seconds, static_cast<long long>(tally.ok),
      static_cast<long long>(tally.wrong), static_cast<long long>(tally.other),
      static_cast<long long>(tally.busy), Percentile(tally.latency_ms, 0.5),
      Percentile(tally.latency_ms, 0.99), baseline / 1048576.0, after / 1048576.0,
      static_cast<long long>(m.gauges.live_sessions),
      static_cast<long long>(m.gauges.session_memory_bytes),
      static_cast<long long>(m.gauges.queued_requests));
  for (const std::string& f : tally.failures) std::printf("failure: %s\n", f.c_str());
  EXPECT_EQ(tally.ok, kClients * kStepsPerClient);
  EXPECT_EQ(tally.wrong, 0);
  EXPECT_EQ(tally.other, 0);
  EXPECT_EQ(m.gauges.live_sessions, 0);
  EXPECT_EQ(m.gauges.session_memory_bytes, 0);
  EXPECT_EQ(m.gauges.queued_requests, 0);
  EXPECT_EQ(m.gauges.running_requests, 0);
  // Memory returns to the warm-up level (allocator slack allowed).
  EXPECT_LT(after - baseline, int64_t{96} << 20);
}

}  // namespace
}  // namespace flce
