#ifndef FLCE_SERVER_METRICS_H_
#define FLCE_SERVER_METRICS_H_

// The server's counters and histograms, and their Prometheus text exposition
// (format 0.0.4), written here once: Debian has no Prometheus client library.
// Counters and histograms are recorded as RPCs finish; gauges (queue depth,
// sessions, memory) are read from their owners when a snapshot is taken.

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flce {

// Upper bounds (seconds) of the latency histograms' buckets; +Inf follows.
inline constexpr std::array<double, 14> kLatencyBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60};

struct HistogramSnapshot {
  std::vector<int64_t> counts;  // per bucket (not cumulative), +Inf last
  double sum = 0;
  int64_t count = 0;
};

// Read at scrape time from the components that own them.
struct Gauges {
  int64_t queued_requests = 0, running_requests = 0;
  int64_t live_sessions = 0, session_memory_bytes = 0;
  int64_t weight_memory_bytes = 0, registered_weights = 0;
  int64_t weight_device_memory_bytes = 0;  // their device copies and sums
  int64_t shared_memory_regions = 0;
  int64_t device_memory_bytes = 0;  // the engine's device pool (0 on the CPU)
  bool serving = true;              // health SERVING
  // Counters kept by the session store and the engine, read like the
  // gauges.
  int64_t sessions_expired = 0;
  int64_t engine_forward_reruns = 0;
  int64_t forwards_staged = 0;  // X copied onto the device on arrival
  // Client streams (ForwardStream, PutWeight) and shared-memory mappings.
  int64_t open_streams = 0, request_memory_bytes = 0, stream_idle_timeouts = 0;
  int64_t shared_memory_bytes = 0;
  int64_t call_channels = 0;  // open (server/call_channel.h)
  int64_t region_memory_bytes = 0;  // regions of server memory
  int64_t bulk_connections = 0;     // open on the bulk port (server/bulk_http.h)
};

struct MetricsSnapshot {
  // (rpc, code name) → count.
  std::map<std::pair<std::string, std::string>, int64_t> requests;
  std::map<std::string, HistogramSnapshot> latency;  // per rpc
  std::map<std::string, HistogramSnapshot> engine;   // per rpc, engine time
  HistogramSnapshot queue_wait;
  std::map<std::string, int64_t> received_bytes, sent_bytes;  // per rpc
  std::map<std::string, int64_t> tokens;  // per rpc: rows the engine computed
  double uptime_seconds = 0;              // since the metrics were made
  Gauges gauges;
};

class ServiceMetrics {
 public:
  // An RPC finished with `code` after `seconds`.
  void RecordRpc(absl::string_view rpc, absl::StatusCode code, double seconds);
  // Time a task waited for a worker; time the engine took, and the rows
  // (tokens) it computed (0 for a call that failed).
  void RecordQueueWait(double seconds);
  void RecordEngine(absl::string_view rpc, double seconds, int64_t tokens);
  // Message bytes an RPC received and sent.
  void AddBytes(absl::string_view rpc, int64_t received, int64_t sent);

  MetricsSnapshot Snapshot(const Gauges& gauges) const;

 private:
  struct Histogram {
    std::array<int64_t, kLatencyBuckets.size() + 1> counts{};
    double sum = 0;
    int64_t count = 0;
    void Observe(double v);
    HistogramSnapshot Snapshot() const;
  };
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, int64_t> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> latency_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> engine_ ABSL_GUARDED_BY(mu_);
  Histogram queue_wait_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> received_ ABSL_GUARDED_BY(mu_), sent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> tokens_ ABSL_GUARDED_BY(mu_);
  const absl::Time start_ = absl::Now();
};

// The snapshot in the Prometheus text format, every family with HELP and
// TYPE lines, histograms with cumulative buckets, _sum and _count.
std::string PrometheusText(const MetricsSnapshot& snapshot);

// A label value escaped for the text format (\\, \" and \n).
std::string EscapeLabelValue(absl::string_view value);

}  // namespace flce

#endif  // FLCE_SERVER_METRICS_H_
