#include "server/metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flce {

void ServiceMetrics::Histogram::Observe(double v) {
  size_t i = 0;
  while (i < kLatencyBuckets.size() && v > kLatencyBuckets[i]) ++i;
  ++counts[i];
  sum += v;
  ++count;
}

HistogramSnapshot ServiceMetrics::Histogram::Snapshot() const {
  return HistogramSnapshot{std::vector<int64_t>(counts.begin(), counts.end()), sum, count};
}

void ServiceMetrics::RecordRpc(absl::string_view rpc, absl::StatusCode code, double seconds) {
  absl::MutexLock lock(&mu_);
  ++requests_[{std::string(rpc), absl::StatusCodeToString(code)}];
  latency_[std::string(rpc)].Observe(seconds);
}

void ServiceMetrics::RecordQueueWait(double seconds) {
  absl::MutexLock lock(&mu_);
  queue_wait_.Observe(seconds);
}

void ServiceMetrics::RecordEngine(absl::string_view rpc, double seconds, int64_t tokens) {
  absl::MutexLock lock(&mu_);
  engine_[std::string(rpc)].Observe(seconds);
  tokens_[std::string(rpc)] += tokens;
}

void ServiceMetrics::AddBytes(absl::string_view rpc, int64_t received, int64_t sent) {
  absl::MutexLock lock(&mu_);
  received_[std::string(rpc)] += received;
  sent_[std::string(rpc)] += sent;
}

MetricsSnapshot ServiceMetrics::Snapshot(const Gauges& gauges) const {
  MetricsSnapshot s;
  absl::MutexLock lock(&mu_);
  s.requests = requests_;
  for (const auto& [rpc, h] : latency_) s.latency[rpc] = h.Snapshot();
  for (const auto& [rpc, h] : engine_) s.engine[rpc] = h.Snapshot();
  s.queue_wait = queue_wait_.Snapshot();
  s.received_bytes = received_;
  s.sent_bytes = sent_;
  s.tokens = tokens_;
  s.uptime_seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  s.gauges = gauges;
  return s;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

namespace {

void Family(std::string* out, absl::string_view name, absl::string_view type,
            absl::string_view help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

std::string Number(double v) { return absl::StrFormat("%.9g", v); }

// One histogram's series; `labels` is empty or `key="value"` pairs.
void AppendHistogram(std::string* out, absl::string_view name, const std::string& labels,
                     const HistogramSnapshot& h) {
  const std::string sep = labels.empty() ? "" : ",";
  int64_t cumulative = 0;
  for (size_t i = 0; i < h.counts.size(); ++i) {
    cumulative += h.counts[i];
    const std::string le = i < kLatencyBuckets.size() ? Number(kLatencyBuckets[i]) : "+Inf";
    absl::StrAppend(out, name, "_bucket{", labels, sep, "le=\"", le, "\"} ", cumulative, "\n");
  }
  const std::string braces = labels.empty() ? "" : absl::StrCat("{", labels, "}");
  absl::StrAppend(out, name, "_sum", braces, " ", Number(h.sum), "\n");
  absl::StrAppend(out, name, "_count", braces, " ", h.count, "\n");
}

void AppendGauge(std::string* out, absl::string_view name, absl::string_view help,
                 int64_t value) {
  Family(out, name, "gauge", help);
  absl::StrAppend(out, name, " ", value, "\n");
}

}  // namespace

std::string PrometheusText(const MetricsSnapshot& s) {
  std::string out;
  Family(&out, "flce_requests_total", "counter", "Finished RPCs by method and status code.");
  for (const auto& [key, count] : s.requests) {
    absl::StrAppend(&out, "flce_requests_total{rpc=\"", EscapeLabelValue(key.first),
                    "\",code=\"", EscapeLabelValue(key.second), "\"} ", count, "\n");
  }
  Family(&out, "flce_request_duration_seconds", "histogram",
         "Time from receiving an RPC to finishing it, by method.");
  for (const auto& [rpc, h] : s.latency) {
    AppendHistogram(&out, "flce_request_duration_seconds",
                    absl::StrCat("rpc=\"", EscapeLabelValue(rpc), "\""), h);
  }
  Family(&out, "flce_engine_duration_seconds", "histogram",
         "Time the loss engine computed for a request, by method.");
  for (const auto& [rpc, h] : s.engine) {
    AppendHistogram(&out, "flce_engine_duration_seconds",
                    absl::StrCat("rpc=\"", EscapeLabelValue(rpc), "\""), h);
  }
  Family(&out, "flce_queue_wait_seconds", "histogram",
         "Time engine work waited in the queue for a worker.");
  AppendHistogram(&out, "flce_queue_wait_seconds", "", s.queue_wait);
  Family(&out, "flce_received_bytes_total", "counter", "Request message bytes, by method.");
  for (const auto& [rpc, bytes] : s.received_bytes) {
    absl::StrAppend(&out, "flce_received_bytes_total{rpc=\"", EscapeLabelValue(rpc), "\"} ",
                    bytes, "\n");
  }
  Family(&out, "flce_sent_bytes_total", "counter", "Response message bytes, by method.");
  for (const auto& [rpc, bytes] : s.sent_bytes) {
    absl::StrAppend(&out, "flce_sent_bytes_total{rpc=\"", EscapeLabelValue(rpc), "\"} ", bytes,
                    "\n");
  }
  Family(&out, "flce_tokens_total", "counter",
         "Rows (tokens) the engine computed, by method (calls that succeeded).");
  for (const auto& [rpc, tokens] : s.tokens) {
    absl::StrAppend(&out, "flce_tokens_total{rpc=\"", EscapeLabelValue(rpc), "\"} ", tokens,
                    "\n");
  }
  Family(&out, "flce_sessions_expired_total", "counter",
         "Sessions freed after their idle TTL (the server never evicts live sessions).");
  absl::StrAppend(&out, "flce_sessions_expired_total ", s.gauges.sessions_expired, "\n");
  Family(&out, "flce_engine_forward_reruns_total", "counter",
         "Forward calls the engine ran again on its exact, slower path (data out of its fast "
         "path's range: the CUDA engine's one-pass rows).");
  absl::StrAppend(&out, "flce_engine_forward_reruns_total ", s.gauges.engine_forward_reruns,
                  "\n");
  Family(&out, "flce_forwards_staged_total", "counter",
         "Forward calls whose X (in a region of server memory) was copied onto the device when "
         "they arrived, beside the calls before them (--stage_ahead_bytes).");
  absl::StrAppend(&out, "flce_forwards_staged_total ", s.gauges.forwards_staged, "\n");
  Family(&out, "flce_stream_idle_timeouts_total", "counter",
         "Client streams finished for sending no message within --stream_idle_timeout.");
  absl::StrAppend(&out, "flce_stream_idle_timeouts_total ", s.gauges.stream_idle_timeouts,
                  "\n");
  const Gauges& g = s.gauges;
  AppendGauge(&out, "flce_open_streams", "ForwardStream and PutWeight streams open.",
              g.open_streams);
  AppendGauge(&out, "flce_request_memory_bytes",
              "Bytes reserved by open ForwardStreams for their announced tensors.",
              g.request_memory_bytes);
  AppendGauge(&out, "flce_shared_memory_bytes", "Bytes mapped by shared-memory regions.",
              g.shared_memory_bytes);
  AppendGauge(&out, "flce_queued_requests", "Engine tasks waiting for a worker.",
              g.queued_requests);
  AppendGauge(&out, "flce_running_requests", "Engine tasks running.", g.running_requests);
  AppendGauge(&out, "flce_live_sessions", "Sessions kept for a Backward.", g.live_sessions);
  AppendGauge(&out, "flce_session_memory_bytes",
              "Bytes held by live sessions and reservations.", g.session_memory_bytes);
  AppendGauge(&out, "flce_registered_weights", "Registered weight versions alive.",
              g.registered_weights);
  AppendGauge(&out, "flce_weight_memory_bytes",
              "Bytes held by registered weights (every version alive) and uploads in progress.",
              g.weight_memory_bytes);
  AppendGauge(&out, "flce_weight_device_memory_bytes",
              "Device bytes of registered weights' copies and gradient sums (CUDA).",
              g.weight_device_memory_bytes);
  AppendGauge(&out, "flce_shared_memory_regions", "Registered shared-memory regions.",
              g.shared_memory_regions);
  AppendGauge(&out, "flce_call_channels", "Open call channels (a server thread each).",
              g.call_channels);
  AppendGauge(&out, "flce_bulk_connections",
              "Connections open on the bulk HTTP port (a server thread each).",
              g.bulk_connections);
  AppendGauge(&out, "flce_region_memory_bytes",
              "Bytes of the server's own memory held by registered regions (server_memory).",
              g.region_memory_bytes);
  AppendGauge(&out, "flce_device_memory_bytes",
              "Device memory the engine holds (its pool, registered weights and their "
              "gradient sums; 0 on the CPU).", g.device_memory_bytes);
  AppendGauge(&out, "flce_serving", "1 while health is SERVING, 0 when draining or failed.",
              g.serving ? 1 : 0);
  return out;
}

}  // namespace flce
