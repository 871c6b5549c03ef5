#include "client/stats_summary.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace flce {

double HistogramQuantile(const v1::Histogram& h, double q) {
  int64_t total = 0;
  for (int64_t c : h.counts()) total += c;
  if (total == 0) return std::nan("");
  const double rank = q * total;
  double below = 0;
  for (int i = 0; i < h.counts_size(); ++i) {
    const double count = h.counts(i);
    if (below + count >= rank && count > 0) {
      if (i >= h.upper_bounds_size()) {
        return h.upper_bounds_size() > 0 ? h.upper_bounds(h.upper_bounds_size() - 1) : std::nan("");
      }
      const double lo = i == 0 ? 0 : h.upper_bounds(i - 1);
      const double hi = h.upper_bounds(i);
      return lo + (hi - lo) * (rank - below) / count;
    }
    below += count;
  }
  return h.upper_bounds_size() > 0 ? h.upper_bounds(h.upper_bounds_size() - 1) : std::nan("");
}

std::string HumanBytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  while (std::fabs(bytes) >= 1024 && unit < 5) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrFormat("%.0f B", bytes)
                   : absl::StrFormat("%.1f %s", bytes, kUnits[unit]);
}

namespace {

std::string Millis(double seconds) {
  if (std::isnan(seconds)) return "-";
  const double ms = seconds * 1e3;
  return ms < 10 ? absl::StrFormat("%.2f ms", ms) : absl::StrFormat("%.1f ms", ms);
}

std::string Uptime(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  return absl::StrFormat("%dd%02dh", s / 86400, (s % 86400) / 3600);
}

std::string Rate(double per_second) {
  if (per_second >= 1e6) return absl::StrFormat("%.2fM", per_second / 1e6);
  if (per_second >= 1e4) return absl::StrFormat("%.0fk", per_second / 1e3);
  return absl::StrFormat("%.0f", per_second);
}

}  // namespace

std::string StatsSummary(const v1::GetStatsResponse& s) {
  std::string out =
      absl::StrCat("server      ", s.serving() ? "SERVING" : "NOT_SERVING (draining or failed)");
  if (s.uptime_seconds() > 0) absl::StrAppend(&out, ", up ", Uptime(s.uptime_seconds()));
  absl::StrAppend(&out, "\n\n");

  // Requests by RPC: OK and every other code.
  std::map<std::string, int64_t> ok, errors;
  std::map<std::string, std::map<std::string, int64_t>> by_code;
  std::set<std::string> rpcs;
  for (const auto& r : s.requests()) {
    rpcs.insert(r.rpc());
    if (r.code() == "OK") {
      ok[r.rpc()] += r.count();
    } else {
      errors[r.rpc()] += r.count();
      by_code[r.rpc()][r.code()] += r.count();
    }
  }
  for (const auto& [rpc, h] : s.request_duration()) rpcs.insert(rpc);
  if (rpcs.empty()) {
    absl::StrAppend(&out, "no requests yet\n");
  } else {
    absl::StrAppend(
        &out, absl::StrFormat("%-22s %8s %7s %10s %10s %11s %11s %10s\n", "rpc", "ok", "errors",
                              "p50", "p99", "engine p50", "engine p99", "tokens/s"));
    for (const std::string& rpc : rpcs) {
      const auto latency = s.request_duration().find(rpc);
      const auto engine = s.engine_duration().find(rpc);
      const auto tokens = s.tokens().find(rpc);
      std::string p50 = "-", p99 = "-", e50 = "", e99 = "", rate = "";
      if (latency != s.request_duration().end()) {
        p50 = Millis(HistogramQuantile(latency->second, 0.5));
        p99 = Millis(HistogramQuantile(latency->second, 0.99));
      }
      if (engine != s.engine_duration().end() && engine->second.count() > 0) {
        e50 = Millis(HistogramQuantile(engine->second, 0.5));
        e99 = Millis(HistogramQuantile(engine->second, 0.99));
        if (tokens != s.tokens().end() && engine->second.sum() > 0) {
          rate = Rate(tokens->second / engine->second.sum());
        }
      }
      absl::StrAppend(&out, absl::StrFormat("%-22s %8d %7d %10s %10s %11s %11s %10s\n", rpc,
                                            ok[rpc], errors[rpc], p50, p99, e50, e99, rate));
    }
    for (const auto& [rpc, codes] : by_code) {
      std::vector<std::string> parts;
      for (const auto& [code, count] : codes) parts.push_back(absl::StrCat(code, " ", count));
      absl::StrAppend(&out, "  errors of ", rpc, ": ", absl::StrJoin(parts, ", "), "\n");
    }
  }
  absl::StrAppend(&out,
                  "  (p50/p99: receipt to finish; engine: compute time; tokens/s: rows "
                  "per engine second)\n\n");

  int64_t received = 0, sent = 0;
  for (const auto& [rpc, b] : s.received_bytes()) received += b;
  for (const auto& [rpc, b] : s.sent_bytes()) sent += b;
  absl::StrAppend(
      &out,
      absl::StrFormat("queue       %d queued, %d running; wait p50 %s, p99 %s\n",
                      s.queued_requests(), s.running_requests(),
                      Millis(HistogramQuantile(s.queue_wait(), 0.5)),
                      Millis(HistogramQuantile(s.queue_wait(), 0.99))),
      "bytes       received ", HumanBytes(received), ", sent ", HumanBytes(sent), "\n",
      absl::StrFormat("sessions    %d live holding %s; %d expired unused\n", s.live_sessions(),
                      HumanBytes(s.session_memory_bytes()), s.sessions_expired()),
      absl::StrFormat("weights     %d versions, %s host, %s device\n", s.registered_weights(),
                      HumanBytes(s.weight_memory_bytes()),
                      HumanBytes(s.weight_device_memory_bytes())),
      absl::StrFormat("streams     %d open, %s reserved; %d idle timeouts\n", s.open_streams(),
                      HumanBytes(s.request_memory_bytes()), s.stream_idle_timeouts()),
      absl::StrFormat("shared mem  %d regions mapping %s; %d call channels\n",
                      s.shared_memory_regions(), HumanBytes(s.shared_memory_bytes()),
                      s.call_channels()),
      absl::StrFormat("bulk port   %d connections; regions of server memory hold %s\n",
                      s.bulk_connections(), HumanBytes(s.region_memory_bytes())),
      "device mem  ", HumanBytes(s.device_memory_bytes()),
      " held by the engine (pool, weights, gradient sums)\n",
      absl::StrFormat("reruns      %d Forward calls recomputed on the exact path\n",
                      s.engine_forward_reruns()),
      absl::StrFormat("staged      %d Forward calls' X copied onto the device as they arrived\n",
                      s.forwards_staged()));
  return out;
}

}  // namespace flce
